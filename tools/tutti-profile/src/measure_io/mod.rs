//! `tutti-profile io`: measures the I/O cost table (read/write × IOCB count × SM budget →
//! duration and bytes) by running gio-uring's CPU executor on a live NVMe controller, and writes
//! a profile table whose `io_cost_source` says what was measured, on what, and where.
//!
//! The CPU executor's costs calibrate the pipeline (driver, queues, controller, storage); they
//! are not the costs of the GPU I/O kernel on an H100, and the table says so.

mod backend;
mod probe;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use scheduler::analytic::{build_table, AnalyticGrid};
use scheduler::probe::{measure_io_costs_reporting, IoGrid, MeasuredPoint};
use scheduler::table::{IoCostEntry, IoKind, Profile, ProfileTable};
use tutti_cli::outln;

use crate::{load_table, unusable, write_file, TargetArgs};
use backend::{parse_size, Backend, Requirements};
use probe::{CpuProbe, DataPointer, ProbeShape};
use tutti_devices::{BlockDeviceClaims, DeviceLocks, DeviceSpec, HostBlockDevices, DEFAULT_LOCK_DIR};

/// Which executor runs the I/O kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ExecutorKind {
    /// gio-uring's CPU executor: one worker thread per SM of the budget.
    Cpu,
    /// The CUDA I/O kernel (not available in this build).
    Cuda,
}

#[derive(Args, Debug)]
pub struct IoArgs {
    /// Device: emu:PATH (software controller over a file; created if missing), emu:mem:SIZE
    /// (over memory, e.g. emu:mem:256M; refused when larger than the memory this machine can
    /// spare) or vfio:BDF. Default: a software controller over a temporary file, removed
    /// afterwards.
    #[arg(long)]
    device: Option<String>,
    /// Executor running the I/O kernels.
    #[arg(long, value_enum, default_value_t = ExecutorKind::Cpu)]
    executor: ExecutorKind,
    /// IOCB counts to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    iocb_counts: Vec<u32>,
    /// SM budgets to measure (comma-separated); the CPU executor runs one worker thread per SM.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    sm_budgets: Vec<u32>,
    /// Samples per grid point (median kept): 1..=1000.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    repetitions: u32,
    /// IOCTXs per IOCB (the presets' IOCB: 256 IOCTXs of 32 KiB).
    #[arg(long, default_value_t = 256)]
    ioctxs_per_iocb: u32,
    /// Bytes per IOCTX (one NVMe command each), e.g. 32K [default: one KV object of the model:
    /// tokens per block x KV heads x head dim x dtype bytes, 32K for llama3-8b with 16 tokens].
    #[arg(long, value_parser = parse_size)]
    ioctx_bytes: Option<u64>,
    /// Largest host DMA buffer; IOCTX data slots wrap over it.
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    buffer_bytes: u64,
    /// Data pointers of the NVMe commands.
    #[arg(long, value_enum, default_value_t = DataPointer::Auto)]
    data_pointer: DataPointer,
    /// Allow writing to a device that already holds data (an existing emu: file, a VFIO SSD):
    /// the write rows and the lay-out pass overwrite the LBAs the grid spans.
    #[arg(long)]
    overwrite: bool,
    /// Where `vfio:` devices' lock files live: tuttid's `--lock-dir`, so that `io` never writes
    /// to a device a live tuttid (or `tutti pool`) is using.
    #[arg(long, default_value = DEFAULT_LOCK_DIR)]
    lock_dir: PathBuf,
    /// Longest one sample may take, seconds (1 to 86400).
    #[arg(long, default_value = "60", value_parser = tutti_cli::timeout::parse_timeout_s)]
    timeout_s: Duration,
    /// Table whose compute side (model, GPU, buckets, decode steps) the measured rows join.
    /// Without it, the analytic roofline table of --model/--gpu (not measured) is used.
    #[arg(long)]
    base: Option<PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    /// SMs reserved for I/O in the analytic compute side (without --base); at least 1.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    io_sms: u32,
    /// Output table (JSON). Without it the rows are printed and nothing is written.
    #[arg(long, short)]
    out: Option<PathBuf>,
    /// Indent the JSON.
    #[arg(long)]
    pretty: bool,
}

/// The compute side the measured rows are joined to.
#[derive(Clone)]
enum Base {
    Table(Box<ProfileTable>, PathBuf),
    Analytic(scheduler::analytic::ModelConfig, scheduler::analytic::GpuSpec),
}

impl Base {
    fn sm_count(&self) -> u32 {
        match self {
            Self::Table(table, _) => table.gpu.sm_count,
            Self::Analytic(_, gpu) => gpu.sm_count,
        }
    }

    /// Runs `join`'s checks before anything is measured: the rows' durations do not matter to
    /// them (the decode-step check needs only the smallest write budget, the smallest of
    /// `--sm-budgets`), so `join` is tried on placeholder rows of the grid. A base `join` would
    /// refuse after the measurement is refused before the device is opened; before, the run
    /// laid out and wrote the device's span and measured every point, then refused.
    fn check_before_measuring(&self, grid: &IoGrid, io_sms: u32) -> Result<()> {
        let mut counts = grid.iocb_counts.clone();
        counts.sort_unstable();
        counts.dedup();
        let mut budgets = grid.sm_budgets.clone();
        budgets.sort_unstable();
        budgets.dedup();
        let mut rows = Vec::with_capacity(2 * counts.len() * budgets.len());
        for kind in [IoKind::Read, IoKind::Write] {
            for &sm_budget in &budgets {
                // Placeholders that pass the table's row checks: 1 µs and one 4 KiB IOCB per
                // IOCB counted (durations rise with the count, every row moves the same IOCBs).
                rows.extend(counts.iter().map(|&iocb_count| IoCostEntry {
                    kind,
                    iocb_count,
                    sm_budget,
                    duration_us: f64::from(iocb_count),
                    bytes: u64::from(iocb_count) * 4096,
                }));
            }
        }
        self.clone().join(rows, "placeholder rows (checked before measuring)", io_sms).map(drop)
    }

    fn join(self, rows: Vec<IoCostEntry>, source: &str, io_sms: u32) -> Result<Profile> {
        let table = match self {
            Self::Table(mut table, path) => {
                table.io_costs = rows;
                table.io_cost_source = source.to_string();
                table.compute_source = format!("{} (from {})", table.compute_source, path.display());
                *table
            }
            Self::Analytic(model, gpu) => {
                let grid = AnalyticGrid {
                    input_step_tokens: 4096,
                    input_step_count: 8,
                    prefix_step_tokens: 256,
                    io_sms,
                    decode_step_tokens: 4096,
                };
                build_table(&model, &gpu, &grid, rows, source)?
            }
        };
        let profile = Profile::from_table(table)?;
        // The slack-aware runtime refuses a table whose decode steps could never write, and
        // `check` calls it invalid (the same predicate): such a table is not written (status 2:
        // the base's decode steps or --io-sms do not fit the --sm-budgets measured).
        profile.check_decode_steps_can_write().map_err(|error| {
            unusable(format!(
                "the measured table would be unusable by the slack-aware runtime (nothing written; measure --sm-budgets no \
                 larger than the SMs its decode steps leave free, or raise --io-sms): {error}"
            ))
        })?;
        Ok(profile)
    }
}

pub fn run(args: &IoArgs) -> Result<()> {
    if args.executor == ExecutorKind::Cuda {
        return Err(unusable(
            "--executor cuda: the GPU executor cannot run here. tutti-profile is built without gio-uring's \
             `cuda` feature and has no probe that drives the CUDA I/O kernel (which also needs NVMe queue pairs \
             in GPU-reachable memory); nothing was measured. --executor cpu measures the CPU executor, whose \
             costs calibrate the pipeline, not a GPU kernel",
        ));
    }
    let grid = IoGrid { iocb_counts: args.iocb_counts.clone(), sm_budgets: args.sm_budgets.clone(), repetitions: args.repetitions };
    if grid.iocb_counts.is_empty() || grid.sm_budgets.is_empty() {
        return Err(unusable("--iocb-counts and --sm-budgets need at least one value"));
    }
    if grid.iocb_counts.iter().chain(&grid.sm_budgets).any(|&v| v == 0) || grid.repetitions == 0 {
        return Err(unusable("--iocb-counts, --sm-budgets and --repetitions must all be > 0"));
    }
    let ioctx_bytes_wanted = match args.ioctx_bytes {
        Some(bytes) => bytes,
        // One IOCTX moves one KV object of the model (a layer's K or V of one block).
        None => args.target.object_bytes()?,
    };
    let ioctx_bytes = u32::try_from(ioctx_bytes_wanted)
        .ok()
        .filter(|&bytes| bytes <= 1 << 24)
        .ok_or_else(|| unusable(format!("--ioctx-bytes={ioctx_bytes_wanted}: at most 16M (one NVMe command per IOCTX)")))?;
    if args.ioctxs_per_iocb == 0 || args.ioctxs_per_iocb > gio_uring::abi::MAX_IOCTX_PER_IOCB {
        return Err(unusable(format!("--ioctxs-per-iocb must be in 1..={}", gio_uring::abi::MAX_IOCTX_PER_IOCB)));
    }
    let iocb_count_max = grid.iocb_counts.iter().copied().max().unwrap_or(1);
    if iocb_count_max > gio_uring::abi::GIO_RING_DEPTH_MAX / 2 {
        return Err(unusable(format!("--iocb-counts: at most {} IOCBs per sample", gio_uring::abi::GIO_RING_DEPTH_MAX / 2)));
    }
    let sm_budget_max = grid.sm_budgets.iter().copied().max().unwrap_or(1);
    let queue_pairs =
        u16::try_from(sm_budget_max).ok().filter(|&n| n <= 256).ok_or_else(|| unusable("--sm-budgets: at most 256 CPU workers"))?;

    // Resolve the compute side first: a budget the table's GPU cannot hold is reported before
    // anything runs.
    let base = match &args.base {
        Some(path) => Base::Table(Box::new(load_table(path)?.table().clone()), path.clone()),
        None => Base::Analytic(args.target.model()?, args.target.gpu()?),
    };
    if sm_budget_max > base.sm_count() {
        return Err(unusable(format!("--sm-budgets: {sm_budget_max} exceeds the table GPU's {} SMs", base.sm_count())));
    }
    // A table `join` would refuse is refused now, before the device is opened (only with --out:
    // without it nothing is joined or written, the rows are only printed).
    if args.out.is_some() {
        base.check_before_measuring(&grid, args.io_sms).context("the table to be measured failed validation; nothing was measured")?;
    }

    let spec = match &args.device {
        Some(text) => Some(DeviceSpec::parse(text, &backend::DEVICE_KINDS).map_err(|error| unusable(error.to_string()))?),
        None => None,
    };
    let shape = ProbeShape {
        ioctxs_per_iocb: args.ioctxs_per_iocb,
        ioctx_bytes,
        iocb_count_max,
        buffer_bytes_max: args.buffer_bytes,
        data_pointer: args.data_pointer,
        sample_timeout: args.timeout_s,
    };
    if backend::holds_prior_data(spec.as_ref()) && !args.overwrite {
        return Err(unusable(format!(
            "{}: measuring writes overwrites the first {} of the device's first namespace; pass --overwrite if that \
             is intended",
            args.device.as_deref().unwrap_or("device"),
            tutti_devices::format_size(shape.span_bytes())
        )));
    }
    // Taken before the device is opened and held until the probe (and with it the controller)
    // is dropped: a block device that is mounted or claimed, or a device a live tuttid (or
    // `tutti pool`) holds, is refused before anything is written. The lock comes first, as
    // tuttid and tutti-bench take it: tuttid also claims an emu: block device it serves, and
    // only the lock's refusal names the holder (the claim's says "in use", not by whom).
    let specs: Vec<DeviceSpec> = spec.iter().cloned().collect();
    // A missing emu: file is created empty here so that it is locked before the controller
    // grows it (a tuttid starting beside this run cannot take it meanwhile).
    let emu_file_is_new = matches!(&spec, Some(DeviceSpec::EmuFile(path)) if !path.exists());
    // The file is a measurement's, overwritten with its pattern, not a pool: its mode is its
    // owner's business, left as it is (neither narrowed nor, another user's, refused for it).
    let locks = DeviceLocks::acquire_leaving_modes(&specs, &args.lock_dir, emu_file_is_new).map_err(|error| unusable(error.to_string()))?;
    let claims = BlockDeviceClaims::acquire(&specs, &HostBlockDevices).map_err(|error| unusable(error.to_string()))?;
    let needs = Requirements { span_bytes: shape.span_bytes(), command_bytes: u64::from(ioctx_bytes), queue_pairs };
    let backend = Backend::open(spec.as_ref(), needs, emu_file_is_new, &locks)?;
    let mut probe = CpuProbe::new(backend, shape)?;
    let sm_budget_min = grid.sm_budgets.iter().copied().min().unwrap_or(1);

    // Taken once, before the samples: the load average then is what they ran beside.
    let host = host_description();
    eprintln!("io: measuring on {}", probe.backend().description);
    eprintln!(
        "io: IOCB = {} IOCTXs x {} bytes ({} data pointers); {} grid points x {} samples; host {}",
        shape.ioctxs_per_iocb,
        ioctx_bytes,
        probe.data_pointer_name(),
        2 * dedup_len(&grid.iocb_counts) * dedup_len(&grid.sm_budgets),
        grid.repetitions,
        host
    );
    let layout = probe.lay_out(sm_budget_min)?;
    eprintln!("io: laid out {} (untimed pass, took {:.1} ms)", tutti_devices::format_size(shape.span_bytes()), layout.as_secs_f64() * 1e3);

    let mut points = Vec::new();
    let rows = {
        let mut reporter = Reporter::new();
        let result = measure_io_costs_reporting(&mut probe, &grid, &mut |done, total, point| {
            reporter.report(done, total, point);
            points.push(*point);
        });
        reporter.finish();
        result.context("measuring I/O costs")?
    };
    let raised = points.iter().filter(|p| p.raised()).count();
    print_rows(&points)?;

    let source = format!(
        "measured by tutti-profile io: executor cpu (gio-uring CpuWorkers; sm_budget N = N CPU worker threads, \
         each owning one NVMe I/O queue pair; these are CPU-executor costs, not GPU-kernel costs); device: {}; \
         IOCB = {} IOCTXs x {} bytes, {} data pointers; median of {} samples per point{}; host: {}",
        probe.backend().description,
        shape.ioctxs_per_iocb,
        ioctx_bytes,
        probe.data_pointer_name(),
        grid.repetitions,
        if raised == 0 {
            String::new()
        } else {
            format!(" ({raised} rows measured faster than a smaller IOCB count and carry that slower value)")
        },
        host
    );
    // The controller stops before the claim and the lock are let go.
    drop(probe);
    drop(claims);
    drop(locks);

    let Some(out) = &args.out else {
        eprintln!("io: no --out given; nothing written");
        return Ok(());
    };
    let profile = base.join(rows, &source, args.io_sms).context("the measured table failed validation")?;
    write_file(out, &if args.pretty { profile.to_json_pretty()? } else { profile.to_json()? })?;
    eprintln!(
        "wrote {} (io_costs measured; compute side: {}; model {}, GPU {})",
        out.display(),
        profile.table().compute_source,
        profile.model().name,
        profile.gpu().name
    );
    Ok(())
}

fn dedup_len(values: &[u32]) -> usize {
    let mut values = values.to_vec();
    values.sort_unstable();
    values.dedup();
    values.len()
}

/// Progress: a bar on a terminal, one line per point otherwise (logs, CI, tests).
struct Reporter {
    bar: Option<ProgressBar>,
}

impl Reporter {
    fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(0);
            if let Ok(style) = ProgressStyle::with_template("io {bar:30} {pos}/{len} {msg}") {
                bar.set_style(style);
            }
            bar
        });
        Self { bar }
    }

    fn report(&mut self, done: usize, total: usize, point: &MeasuredPoint) {
        let line = point_line(point);
        match &self.bar {
            Some(bar) => {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
                bar.set_message(line);
            }
            None => eprintln!("io [{done}/{total}] {line}"),
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

fn kind_name(kind: IoKind) -> &'static str {
    match kind {
        IoKind::Read => "read",
        IoKind::Write => "write",
    }
}

fn point_line(point: &MeasuredPoint) -> String {
    let entry = &point.entry;
    let mut line = format!(
        "{} sm_budget={} (CPU workers {}) iocb_count={}: {:.1} us for {} KiB ({:.2} GB/s)",
        kind_name(entry.kind),
        entry.sm_budget,
        entry.sm_budget,
        entry.iocb_count,
        point.median_us,
        entry.bytes >> 10,
        entry.bytes as f64 / (point.median_us * 1e3)
    );
    if point.raised() {
        line.push_str(&format!(" (table keeps the smaller count's {:.1} us)", entry.duration_us));
    }
    line
}

/// The rows as measured, on stdout.
fn print_rows(points: &[MeasuredPoint]) -> Result<()> {
    outln!(
        "{:<6} {:>9} {:>11} {:>10} {:>12} {:>14} {:>9}",
        "kind",
        "sm_budget",
        "cpu_workers",
        "iocb_count",
        "bytes",
        "duration_us",
        "GB/s"
    )?;
    for point in points {
        let entry = &point.entry;
        outln!(
            "{:<6} {:>9} {:>11} {:>10} {:>12} {:>14.1} {:>9.2}{}",
            kind_name(entry.kind),
            entry.sm_budget,
            entry.sm_budget,
            entry.iocb_count,
            entry.bytes,
            entry.duration_us,
            entry.bytes as f64 / (point.median_us * 1e3),
            if point.raised() { format!("  (median {:.1} us)", point.median_us) } else { String::new() }
        )?;
    }
    Ok(())
}

/// Host name, CPU model and core count, for the table's provenance.
fn host_description() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_else(|_| "unknown".into());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| text.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string()))
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    // The 1-minute load average: on a shared machine it says how much of the cores the samples
    // competed for.
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next().map(str::to_string))
        .map_or_else(String::new, |load| format!(", load average {load}"));
    format!("{name}, {cpu}, {cores} cores available{load}")
}
