//! `nvme-conformance`: runs the driver's conformance suite against one or more devices.
//!
//! ```text
//! nvme-conformance --device vfio:0000:00:04.0 --overwrite # QEMU's controller or a real SSD
//! nvme-conformance --device emu:mem:256M                  # the software controller in memory
//! nvme-conformance --device emu:/tmp/nvme.img --integrity-mib 256
//! ```
//! Every device named is overwritten. Before any is written, each is locked as tuttid and
//! `tutti pool` lock it, and each block device claimed (`O_EXCL`); a `vfio:` device, or an
//! `emu:PATH` that already holds data (a non-empty file, a block device), is tested only with
//! `--overwrite`.
//!
//! Exit status: 0 when no check failed and some passed on every device (skipped checks aside),
//! 1 when any failed, or when none passed on a device (every selected check skipped there,
//! e.g. `--filter sgl` on a controller without SGL), 2 for bad usage
//! (bad flags, a device string that does not parse or a device that cannot be opened, e.g. a
//! memory device larger than the machine can spare; a device another process holds (its lock,
//! or a block device in use); a `vfio:` device or an `emu:PATH` holding data without `--overwrite`; a `--filter`
//! that selects no check, or only checks that need fault injection on a `vfio:` device; an `--integrity-mib` larger than the namespace; a `--timeout-s` above
//! a day), 141 when standard output was closed by its reader.
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use nvme_conformance::{run_suite, SuiteConfig};
use tutti_cli::{exit, outln};
use tutti_devices::{BlockDeviceClaims, DeviceLocks, DeviceSpec, FileUndo, HostBlockDevices, DEFAULT_LOCK_DIR};

mod devices;

/// Runs the NVMe conformance suite against the given devices.
#[derive(Parser, Debug)]
#[command(
    version,
    about,
    after_long_help = "Exit status: 0 no check failed and some passed on every device; 1 a check failed, or every check selected was skipped on a device (e.g. --filter sgl without controller SGL support); 2 unusable input (bad flag or device, a device another process holds or a block device in use, a vfio: device or an emu:PATH holding data without --overwrite, a --filter that selects no check or only fault-injection checks on a vfio: device, --integrity-mib larger than the namespace, --timeout-s above 86400); 141 standard output was closed by its reader (e.g. `| head`)."
)]
struct Arguments {
    /// Device to test: `vfio:BDF` (e.g. vfio:0000:00:04.0), `emu:mem:SIZE` or `emu:PATH` (a file
    /// of at least 256 MiB is created or grown). Repeatable. Every device named is overwritten
    /// (from LBA 0, in every namespace); one a tuttid or `tutti pool` holds, or a block device in
    /// use, is refused.
    #[arg(long = "device", required = true, value_parser = parse_device)]
    devices: Vec<DeviceSpec>,
    /// Allow testing a `vfio:` device, or an `emu:PATH` that already holds data (a non-empty
    /// file, a block device): the checks overwrite it.
    #[arg(long)]
    overwrite: bool,
    /// Where `vfio:` devices' lock files live: tuttid's `--lock-dir`, so that the suite never
    /// writes to a device a live tuttid (or `tutti pool`) is using.
    #[arg(long, default_value = DEFAULT_LOCK_DIR)]
    lock_dir: PathBuf,
    /// I/O queue pairs to ask for and exercise concurrently; a controller that grants fewer is
    /// tested with what it grants (the report says how many were used).
    #[arg(long, default_value_t = 4)]
    queue_pairs: u16,
    /// Upper bound on I/O queue depth (CAP.MQES bounds it too).
    #[arg(long, default_value_t = 1024)]
    queue_depth_max: u32,
    /// MiB of patterned data for the data-integrity check (0 skips it; at most the namespace).
    #[arg(long, default_value_t = 0)]
    integrity_mib: u64,
    /// Fewer sizes and iterations (slow emulation such as QEMU under TCG).
    #[arg(long)]
    quick: bool,
    /// Run only checks whose name contains this text (one that selects none is refused).
    #[arg(long)]
    filter: Option<String>,
    /// Deadline for any single wait, in seconds (1 to 86400).
    #[arg(long, default_value = "60", value_parser = tutti_cli::timeout::parse_timeout_s)]
    timeout_s: Duration,
}

fn parse_device(text: &str) -> Result<DeviceSpec, String> {
    DeviceSpec::parse(text, &devices::DEVICE_KINDS).map_err(|error| error.to_string())
}

fn main() -> ExitCode {
    tutti_cli::init_stderr_logging();
    let arguments = match Arguments::try_parse() {
        Ok(arguments) => arguments,
        Err(error) => return ExitCode::from(exit::report_parse_error(&error)),
    };
    match run(arguments).and_then(|passed| Ok(tutti_cli::stdout::flush().map(|()| passed)?)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(exit::FAILURE),
        Err(error) if tutti_cli::is_stdout_closed(error.as_ref()) => ExitCode::from(exit::STDOUT_CLOSED),
        Err(error) => {
            eprintln!("nvme-conformance: {error:#}");
            ExitCode::from(exit::UNUSABLE_INPUT)
        }
    }
}

fn run(arguments: Arguments) -> Result<bool> {
    if arguments.queue_pairs == 0 {
        bail!("--queue-pairs must be at least 1");
    }
    let config = SuiteConfig {
        queue_pairs: arguments.queue_pairs,
        queue_depth_max: arguments.queue_depth_max.max(2),
        timeout: arguments.timeout_s,
        integrity_mib: arguments.integrity_mib,
        quick: arguments.quick,
        filter: arguments.filter.clone(),
    };
    // Bad usage is refused before any check runs (exit status 2), not reported as a failed suite.
    config.validate()?;
    // What needs only the devices' kinds is refused before any device is tested, not when its
    // turn comes after others were tested and reported.
    if let Some(spec) = arguments.devices.iter().find(|spec| !devices::has_faults(spec)) {
        config.validate_without_faults().with_context(|| format!("device '{spec}'"))?;
    }
    // Every device is checked, locked and claimed before any is written: the suite writes from
    // LBA 0 on. One file or PCI function named twice is refused as such (not as in use).
    tutti_devices::refuse_shared_files(&arguments.devices)?;
    // A vfio: device holds data by its kind: refused at once, before its lock directory is
    // opened.
    let vfio = |spec: &&DeviceSpec| matches!(spec, DeviceSpec::Vfio(_));
    refuse_prior_data(arguments.devices.iter().filter(vfio), arguments.overwrite)?;
    // The lock tuttid and `tutti pool` take (flock on the emu: file, a lock file per vfio:
    // function), held until every device is done, so that the suite never writes under a live
    // daemon; a missing emu: file is created empty here (by `made`, locked as it is made, the
    // lock then shared) so that it is locked before the software controller grows it. Then the
    // claim (O_EXCL) of every block device: one that is mounted, swap or under
    // device-mapper/MD is refused, and nothing mounts it meanwhile. The lock comes first: only
    // its refusal names the holder.
    let made = FileUndo::create_missing(&arguments.devices, std::iter::empty());
    // The suite writes its test patterns over the file, which is no pool: its mode is its
    // owner's business, left as it is (neither narrowed nor, another user's, refused for it).
    let locks = DeviceLocks::acquire_created_leaving_modes(&arguments.devices, &arguments.lock_dir, &made)?;
    let _claims = BlockDeviceClaims::acquire(&arguments.devices, &HostBlockDevices)?;
    // Every emu: file exists and is held now: their sizes are recorded, so that a refusal
    // below shrinks back an existing (empty) file the integrity look grew, as `made` removes
    // the ones it created. Dropped before `made`, which then removes its own.
    let grown = FileUndo::create_missing(&arguments.devices, locks.paths());
    // What an emu: file holds is looked at only now, under the lock: before it, a `tutti pool
    // format` could fill a missing or empty file between the look and the lock, and a live
    // daemon's pool would be refused as holding data ("pass --overwrite") rather than as held.
    refuse_prior_data(arguments.devices.iter().filter(|spec| !vfio(spec)), arguments.overwrite)?;
    // An integrity run larger than a device's namespace is bad usage too: every device is
    // looked at for it before any is tested, not when its turn comes after others were tested
    // and reported. Opened one at a time and dropped (memory devices need not fit together);
    // only an integrity run needs it, so no other run opens a device twice.
    if config.selected_checks().contains(&"data_integrity") {
        for spec in &arguments.devices {
            let (device, faults) = devices::open(spec, &locks).with_context(|| format!("opening device '{spec}'"))?;
            config.validate_for(&device, faults.as_ref()).with_context(|| format!("device '{spec}'"))?;
        }
    }
    // Every refusal above (exit 2: nothing was changed) dropped `grown` and `made`, which
    // shrank back the files found and removed the ones created (grown by an opening above
    // included); past them they are the suite's to grow and test.
    grown.keep();
    made.keep();
    let mut all_passed = true;
    for spec in &arguments.devices {
        let (device, faults) = devices::open(spec, &locks).with_context(|| format!("opening device '{spec}'"))?;
        config.validate_for(&device, faults.as_ref()).with_context(|| format!("device '{spec}'"))?;
        let report = run_suite(device, faults, &config);
        tutti_cli::stdout::write_fmt(format_args!("{report}"))?;
        all_passed &= report.passed();
    }
    outln!("{}", if all_passed { "CONFORMANCE_OK" } else { "CONFORMANCE_FAILED" })?;
    Ok(all_passed)
}

/// Refuses the first of `specs` that holds data ([`devices::prior_data`]) unless `overwrite`.
fn refuse_prior_data<'a>(specs: impl Iterator<Item = &'a DeviceSpec>, overwrite: bool) -> Result<()> {
    if overwrite {
        return Ok(());
    }
    for spec in specs {
        if let Some(found) = devices::prior_data(spec) {
            bail!("{spec} {found}: the checks overwrite it from LBA 0 on; pass --overwrite if that is intended");
        }
    }
    Ok(())
}
