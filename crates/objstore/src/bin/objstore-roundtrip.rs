//! `objstore-roundtrip --device vfio:BDF [--device vfio:BDF ...] [--requests N] [--blocks N] [--k N]
//! [--layout separate|block-major]`
//!
//! Formats one pool over the first namespace of every device given (their data is lost),
//! stores KV for several requests layer by layer, reopens the pool, retrieves every request
//! into different engine blocks and compares every byte. Several devices are opened in one
//! VFIO container (one IOVA space), and the pool's blocks are striped across them. Prints
//! OBJSTORE_ROUNDTRIP_OK on success. The VM harness runs it against QEMU's NVMe controllers,
//! including one with `mdts=2,max_ioqpairs=1` (commands are cut to MDTS; with one I/O queue pair
//! the pool's metadata borrows the executor's).
//!
//! Exit status, as for every tutti tool: 0 the round trip passed, 1 it failed, 2 bad usage, 141
//! standard output was closed by its reader (`| head`).
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use nvme_driver::hw::vfio::{PciAddress, VfioDevice, VfioOptions};
use nvme_driver::{Controller, ControllerConfig, DeviceBackend};
use objstore::selfcheck::{round_trip, EngineLayout, RoundTripConfig};
use objstore::PoolTarget;

const USAGE: &str =
    "usage: objstore-roundtrip --device vfio:DOMAIN:BUS:DEVICE.FUNCTION [--device vfio:BDF ...] [--requests N] [--blocks N] \
                     [--k N] [--layout separate|block-major]\n\
     formats a pool over the first namespace of every device given: its data is lost. --k: 1..=1024 engine blocks per slot";
const EXIT_STATUS: &str = "exit status: 0 the round trip passed; 1 it failed; 2 bad usage; 141 standard output was closed by its reader";

/// The exit statuses of every tutti tool (tutti-cli's `exit`; this binary lives in objstore,
/// below that crate, so it restates the two it needs beyond 0).
const EXIT_FAILURE: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_STDOUT_CLOSED: u8 = 141;

/// Writes a line to standard output. A reader that closed the pipe ends the program quietly
/// with 141 (where `println!` would panic); another write error is a failure.
fn say(text: &str) -> Result<(), ExitCode> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Err(ExitCode::from(EXIT_STDOUT_CLOSED)),
        Err(error) => {
            eprintln!("objstore-roundtrip: cannot write to standard output: {error}");
            Err(ExitCode::from(EXIT_FAILURE))
        }
    }
}

/// What the command line asks for.
enum Request {
    Help,
    RoundTrip(Vec<PciAddress>, RoundTripConfig),
}

fn parse() -> Result<Request, String> {
    let mut addresses = Vec::new();
    let mut config = RoundTripConfig::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |text: String| text.parse::<u32>().ok().filter(|&n| n > 0).ok_or_else(|| format!("'{text}' is not a positive number"));
        match flag.as_str() {
            "--help" | "-h" => return Ok(Request::Help),
            "--device" => {
                let device = value()?;
                let address = device.strip_prefix("vfio:").ok_or_else(|| format!("'{device}' is not a vfio:BDF device"))?;
                addresses.push(address.parse::<PciAddress>().map_err(|error| error.to_string())?);
            }
            "--requests" => config.requests = number(value()?)?,
            "--blocks" => config.blocks_per_request = number(value()?)?,
            "--k" => config.blocks_per_slot = number(value()?)?,
            "--layout" => {
                config.layout = match value()?.as_str() {
                    "separate" => EngineLayout::SeparateKv,
                    "block-major" => EngineLayout::BlockMajor,
                    other => return Err(format!("layout '{other}': expected separate or block-major")),
                }
            }
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    if addresses.is_empty() {
        return Err("--device is required".into());
    }
    // Bad usage, refused before any device is opened (the round trip formats them first).
    config.check().map_err(|error| error.to_string())?;
    Ok(Request::RoundTrip(addresses, config))
}

fn run(addresses: &[PciAddress], config: &RoundTripConfig) -> Result<objstore::selfcheck::RoundTripReport, String> {
    let devices = VfioDevice::open_many(addresses, &VfioOptions::default()).map_err(|error| error.to_string())?;
    let mut targets = Vec::with_capacity(devices.len());
    for device in devices {
        let address = device.address();
        let backend: Arc<dyn DeviceBackend> = Arc::new(device);
        let controller = Controller::init(backend, ControllerConfig::default()).map_err(|error| format!("{address}: {error}"))?;
        let namespace =
            controller.namespaces().first().map(|namespace| namespace.id).ok_or_else(|| format!("{address} has no active namespace"))?;
        targets.push(PoolTarget { controller: Arc::new(controller), namespace });
    }
    round_trip(targets, config).map_err(|error| error.to_string())
}

fn main() -> ExitCode {
    match round_trip_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}

fn round_trip_main() -> Result<(), ExitCode> {
    let (addresses, config) = match parse() {
        Ok(Request::Help) => return say(&format!("{USAGE}\n{EXIT_STATUS}")),
        Ok(Request::RoundTrip(addresses, config)) => (addresses, config),
        Err(message) => {
            eprintln!("objstore-roundtrip: {message}\n{USAGE}");
            return Err(ExitCode::from(EXIT_USAGE));
        }
    };
    let names = addresses.iter().map(|address| format!("vfio:{address}")).collect::<Vec<_>>().join(" + ");
    match run(&addresses, &config) {
        Ok(report) => {
            say(&format!(
                "objstore round trip on {names}: {} blocks stored, {} shared, reopened ({} devices, {} valid slots, {} corrupt headers), {} MiB compared",
                report.blocks_stored,
                report.blocks_shared,
                report.recovery.devices,
                report.recovery.valid_slots,
                report.recovery.corrupt_headers,
                report.bytes_verified >> 20
            ))?;
            say("OBJSTORE_ROUNDTRIP_OK")
        }
        Err(message) => {
            eprintln!("objstore-roundtrip: {message}");
            say("OBJSTORE_ROUNDTRIP_FAILED")?;
            Err(ExitCode::from(EXIT_FAILURE))
        }
    }
}
