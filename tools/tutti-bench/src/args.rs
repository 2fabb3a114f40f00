//! Command line: fio's vocabulary for raw workloads, KV-cache vocabulary for the layer workload,
//! and which workload a command line selects. Sizes and device strings are `tutti-devices`'s,
//! the model geometry options `tutti-cli`'s.
//!
//! Every parser returns a one-line message that says what was wrong and what is accepted; the
//! binary turns it into exit status 2.

use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, Parser, ValueEnum};
use tutti_cli::GeometryArgs;
pub use tutti_devices::{format_size, DeviceSpec};
use tutti_devices::{parse_size, DeviceKind};

/// fio-like benchmark of the raw NVMe path and of layer-wise KV store/retrieve.
///
/// With no arguments (or only --output-format, --keep, --directory, --emu-timing, --lock-dir,
/// --executor=cpu): a temporary pool file on the local disk (the system temp directory, or
/// /var/tmp when that is in memory, lacks room for the pool or cannot be written), the software
/// NVMe controller and the CPU executor run the embedded default KV workload, then the file is
/// removed.
#[derive(Debug, Parser, Clone)]
#[command(name = "tutti-bench", version, about, long_about = None, after_long_help = exit_status_help())]
pub struct Cli {
    /// What to run: raw device I/O (fio-like) or KV store/retrieve through the object store.
    /// Default: kv when a KV option is given, raw when a raw option or a device is given, the
    /// embedded default otherwise.
    #[arg(long, value_enum)]
    pub workload: Option<Workload>,

    /// I/O pattern (raw workload).
    #[arg(long, value_enum, default_value_t = Pattern::Read)]
    pub rw: Pattern,

    /// Block size per I/O: 4k, 128KiB, 1m (k/m/g/t are powers of 1024, like fio); not zero.
    #[arg(long, value_parser = parse_block_size_arg, default_value = "4k")]
    pub bs: u64,

    /// I/Os in flight per job.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub iodepth: u32,

    /// Jobs: one thread and one I/O queue pair per device each.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub numjobs: u32,

    /// Bytes each job covers, from --offset (with --verify: the region the jobs split between
    /// them; default: the device from --offset to its end).
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,

    /// Stop after this long (10, 10s, 500ms, 2m). Without --time_based a job also stops after
    /// one pass over --size.
    #[arg(long, value_parser = parse_duration_arg)]
    pub runtime: Option<Duration>,

    /// Keep going over the region until --runtime expires.
    #[arg(long = "time_based", alias = "time-based")]
    pub time_based: bool,

    /// Stop each job after this many I/Os (fio's number_ios): independent of --size, so a run
    /// may wrap around the region; --runtime still stops it earlier. Gives a fixed amount of
    /// work, e.g. for counting instructions per I/O under callgrind.
    #[arg(long = "number_ios", alias = "number-ios", value_parser = clap::value_parser!(u64).range(1..))]
    pub number_ios: Option<u64>,

    /// Stamp 8 bytes of every 4 KiB of a write's buffer before each write (1, fio's
    /// `scramble_buffers` default), so that writes from one buffer do not deduplicate; 0 writes
    /// each slot's pseudorandom bytes unchanged (as SPDK's perf writes its fixed buffers:
    /// tools/vm-bench.sh compares with it so).
    #[arg(long = "scramble_buffers", alias = "scramble-buffers", default_value = "1", value_parser = parse_fio_bool, action = clap::ArgAction::Set)]
    pub scramble_buffers: bool,

    /// Percentage of reads in a randrw mix.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub rwmixread: u8,

    /// Byte offset where the region starts (a multiple of --bs).
    #[arg(long, value_parser = parse_size, default_value = "0")]
    pub offset: u64,

    /// Write a known pattern, read it back and compare (names the first mismatch).
    #[arg(long)]
    pub verify: bool,

    #[arg(long = "output-format", value_enum, default_value_t = OutputFormat::Normal)]
    pub output_format: OutputFormat,

    /// emu:PATH (software controller over a file, created when missing), emu:mem:SIZE (refused
    /// when larger than the memory this machine can spare), emu:null:SIZE (no-storage mode:
    /// commands complete without moving data; no memory is allocated), vfio:BDF (e.g. vfio:0000:00:04.0), uring:PATH
    /// (io_uring + O_DIRECT). Repeat to stripe.
    #[arg(long = "device", value_parser = parse_device_arg)]
    pub devices: Vec<DeviceSpec>,

    /// Make the software controller (emu: devices) complete I/O no sooner than a modelled SSD
    /// would: `tutti-ssd` (one of Tutti's evaluation SSDs in 32x slow motion), `tutti-ssd:xN`, or
    /// `read=SIZE,write=SIZE,mixed=FRACTION,latency=DURATION` (bandwidths per second). Every
    /// figure of such a run is the model's, not hardware's; the output says so.
    #[arg(long = "emu-timing", value_parser = parse_timing_arg)]
    pub emu_timing: Option<nvme_emu::TimingModel>,

    /// Use shadow doorbells (NVMe Doorbell Buffer Config) where the controller offers them:
    /// QEMU's emulated NVMe controller and the software controller (emu:). Each I/O doorbell
    /// value goes to a page in memory and becomes an MMIO write only when the controller asks
    /// for one, which in a VM guest saves a trip out of the guest per doorbell. Raw workload;
    /// a controller that does not offer the command keeps MMIO doorbells (the output says which).
    #[arg(long = "shadow-doorbells")]
    pub shadow_doorbells: bool,

    /// CPUs every job thread may run on (fio's cpus_allowed, shared policy): 0, 0,2, 1-3.
    /// Raw workload.
    #[arg(long = "cpus_allowed", alias = "cpus-allowed", value_parser = parse_cpus_arg)]
    pub cpus_allowed: Option<crate::cpus::CpuList>,

    /// Who issues the NVMe commands.
    #[arg(long, value_enum, default_value_t = Executor::Cpu)]
    pub executor: Executor,

    /// The model whose KV geometry the kv workload uses (default llama3-8b, 16 tokens per block).
    #[command(flatten)]
    pub geometry: GeometryArgs,

    /// Prompt length in tokens (kv workload).
    #[arg(long = "prompt-tokens", default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    pub prompt_tokens: u64,

    /// Fraction of the prompt found in the cache (kv workload), 0..=1.
    #[arg(long = "hit-rate", default_value_t = 1.0, value_parser = parse_fraction_arg)]
    pub hit_rate: f64,

    /// Use the pool already on the devices instead of formatting a new one (kv workload): blocks
    /// an earlier run stored with the same --seed are found by lookup.
    #[arg(long = "keep-pool")]
    pub keep_pool: bool,

    /// Check a pool an earlier run stored (after a crash or a move; implies --keep-pool): look the
    /// whole prompt up, retrieve it layer by layer and compare every byte with the pattern of
    /// --seed. Exit status 1 when a block is missing or a byte differs.
    #[arg(long = "retrieve-only", conflicts_with = "hit_rate")]
    pub retrieve_only: bool,

    /// Seed of the kv workload's tokens and data pattern: the same seed, model and prompt give
    /// the same blocks and bytes on every run.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Layers of a request the kv workload keeps in flight (in-process store): with 2 (the
    /// default) layer l + 1 is issued before layer l is waited for, so the device's queue does
    /// not drain at every layer boundary; 1 issues and waits one layer at a time. 1..=4.
    #[arg(long = "layers-in-flight", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=i64::from(objstore::LAYERS_IN_FLIGHT_LIMIT)))]
    pub layers_in_flight: u32,

    /// Engine blocks per pool slot when the kv workload formats a pool (1..=1024). A slot holds
    /// its blocks layer-major, so a layer of a request's consecutive blocks in one slot is one
    /// command of up to K blocks (the software controller's MDTS is raised to hold it, up to the
    /// driver's 2 MiB per command: beyond, several commands) instead of K commands of one
    /// block; space is allocated K blocks at a time. The default, 16 blocks of 16 tokens, is a
    /// 256-token slot (LMCache's default chunk). A kept pool, or tuttid's, has the K it was
    /// formatted with (a kept emu: pool's MDTS is sized for it).
    #[arg(long = "blocks-per-slot", default_value_t = 16, conflicts_with_all = ["attach", "keep_pool", "retrieve_only"], value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub blocks_per_slot: u32,

    /// Run the kv workload through tuttid listening on SOCKET instead of opening devices: the
    /// daemon owns the pool, each client process attaches with its own queue pairs (tuttid's
    /// client library, `RemoteKvStore`). The pool geometry is the daemon's: give the same model
    /// options it was started with.
    #[arg(long, value_name = "SOCKET")]
    pub attach: Option<PathBuf>,

    /// Client processes of an --attach run (each its own connection, queue pairs and KV memory,
    /// its prompt seeded --seed + its index); phases start together, figures are aggregated.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64), requires = "attach")]
    pub clients: u32,

    /// Internal: this process is client INDEX of an --attach run (the bench runs itself).
    #[arg(long = "attach-client", hide = true, requires = "attach")]
    pub attach_client: Option<u32>,

    /// Let the kv workload format a pool over a device that holds something other than a tutti
    /// pool (a file system, a partition table, any non-zero bytes in a file's first MiB; a block
    /// device or a vfio: SSD whose first MiB is not a tutti pool's, blank included), destroying
    /// it, as `tutti pool format --overwrite` does. Without it such a device is refused, naming
    /// what it holds. Not with --attach: tuttid formats its own pool (`tuttid --format
    /// --overwrite`), nor with --keep-pool or --retrieve-only, which never format.
    #[arg(long, conflicts_with_all = ["attach", "keep_pool", "retrieve_only"])]
    pub overwrite: bool,

    /// Where `vfio:` devices' lock files live: tuttid's `--lock-dir`, so that a run is refused
    /// on a device tuttid or `tutti pool` is using (emu: files are locked themselves). Not
    /// with --attach (tuttid locks its pool, under its own --lock-dir) or --workload=serve (an
    /// in-memory pool per policy, no device to lock).
    #[arg(long = "lock-dir", default_value = tutti_devices::DEFAULT_LOCK_DIR)]
    pub lock_dir: PathBuf,

    /// Keep the temporary pool file of a run without --device (the default run's, a raw or kv
    /// run's); refused with --device, --attach or --workload=serve, which make none.
    #[arg(long)]
    pub keep: bool,

    /// Where a run without --device puts its temporary pool file (default: the system temp
    /// directory, or /var/tmp when that is tmpfs or ramfs, lacks room for the pool or cannot be
    /// written). A directory given here is used as it is: on tmpfs or ramfs the run goes on,
    /// and the device line says the file is memory, not a disk. Refused with --device, --attach
    /// or --workload=serve, which make no such file.
    #[arg(long)]
    pub directory: Option<PathBuf>,

    /// Options of `--workload=serve` (docs/tutti-bench.md, "serve").
    #[command(flatten)]
    pub serve: crate::serve::ServeArgs,
}

fn exit_status_help() -> String {
    format!(
        "{}
130: interrupted (SIGINT/SIGTERM); the files the run created were removed (--keep or not, unless the run had finished).",
        tutti_cli::exit::help_text(false)
    )
}

/// What a command line runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selected {
    /// The embedded default: a temporary pool, the KV store + retrieve with verification.
    Default,
    Raw,
    Kv,
    Serve,
}

/// Options that shape only the raw workload, and only the kv workload (by clap id).
const RAW_OPTIONS: [&str; 13] = [
    "rw",
    "scramble_buffers",
    "bs",
    "iodepth",
    "numjobs",
    "size",
    "runtime",
    "time_based",
    "number_ios",
    "rwmixread",
    "offset",
    "shadow_doorbells",
    "cpus_allowed",
];
const KV_OPTIONS: [&str; 17] = [
    "model",
    "model_config",
    "layers",
    "kv_heads",
    "head_dim",
    "dtype",
    "tokens_per_block",
    "prompt_tokens",
    "hit_rate",
    "keep_pool",
    "retrieve_only",
    "seed",
    "layers_in_flight",
    "blocks_per_slot",
    "attach",
    "clients",
    "overwrite",
];

/// The workload a command line selects. Presentation options (--output-format, --keep,
/// --directory), --emu-timing, --lock-dir and --executor never change it: with nothing else, the embedded default runs
/// (under the timing model and in the directory, which its printed equivalent command names
/// too).
pub fn select_workload(matches: &ArgMatches, cli: &Cli) -> Selected {
    let given = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    match cli.workload {
        Some(Workload::Raw) => Selected::Raw,
        Some(Workload::Kv) => Selected::Kv,
        Some(Workload::Serve) => Selected::Serve,
        None if crate::serve::OPTIONS.iter().any(|id| given(id)) => Selected::Serve,
        None if RAW_OPTIONS.iter().any(|id| given(id)) => Selected::Raw,
        None if KV_OPTIONS.iter().any(|id| given(id)) => Selected::Kv,
        None if !cli.devices.is_empty() || cli.verify => Selected::Raw,
        None => Selected::Default,
    }
}

/// Names of the kv-only options given on the command line (refused with the raw workload).
pub fn kv_options_given(matches: &ArgMatches) -> Vec<String> {
    options_given(&KV_OPTIONS, matches)
}

/// Names of the raw-only options given on the command line (refused with the kv and serve
/// workloads).
pub fn raw_options_given(matches: &ArgMatches) -> Vec<String> {
    options_given(&RAW_OPTIONS, matches)
}

/// Names of the serve-only options given on the command line (refused with the raw and kv
/// workloads, which would run once, on their own stream, without a word about them).
pub fn serve_options_given(matches: &ArgMatches) -> Vec<String> {
    options_given(&crate::serve::OPTIONS, matches)
}

/// The kv options the serve workload has no use for: it formats a fresh in-memory pool of one
/// block per slot per policy (nothing there to overwrite) and keeps its store's default layers
/// in flight. (--keep-pool, --retrieve-only, --attach and --clients are refused on their own.)
const KV_OPTIONS_SERVE_IGNORES: [&str; 3] = ["blocks_per_slot", "layers_in_flight", "overwrite"];

/// Names of the kv options given on the command line that the serve workload would ignore.
pub fn kv_options_serve_ignores_given(matches: &ArgMatches) -> Vec<String> {
    options_given(&KV_OPTIONS_SERVE_IGNORES, matches)
}

/// Those of `ids` given on the command line, as the user spells them (fio's `--time_based`,
/// `--number_ios`, `--cpus_allowed`, `--scramble_buffers` keep their underscores).
fn options_given(ids: &[&str], matches: &ArgMatches) -> Vec<String> {
    ids.iter()
        .filter(|id| matches.value_source(id) == Some(ValueSource::CommandLine))
        .map(|id| match *id {
            "time_based" | "number_ios" | "cpus_allowed" | "scramble_buffers" => format!("--{id}"),
            id => format!("--{}", id.replace('_', "-")),
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    Raw,
    Kv,
    /// A stream of requests served by the runtime (tutti-runtime) on the software controller,
    /// every policy side by side, next to the simulator's prediction.
    Serve,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Pattern {
    Read,
    Write,
    Randread,
    Randwrite,
    Randrw,
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Read => "read",
            Pattern::Write => "write",
            Pattern::Randread => "randread",
            Pattern::Randwrite => "randwrite",
            Pattern::Randrw => "randrw",
        }
    }

    pub fn is_random(self) -> bool {
        matches!(self, Pattern::Randread | Pattern::Randwrite | Pattern::Randrw)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Normal,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Executor {
    Cpu,
    Cuda,
}

/// The longest duration an option takes: a deadline `Instant::now() + duration` must not
/// overflow the clock, and no run or wait of this tool is meant to last longer.
const DURATION_MAX: Duration = Duration::from_secs(30 * 24 * 3600);

/// Parses a duration like fio's runtime (plain seconds, or with us/ms/s/m/h); zero and more than
/// 30 days are refused.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let duration = tutti_devices::parse_duration(text).map_err(|error| error.to_string())?;
    if duration.is_zero() {
        return Err(format!("duration '{text}' is zero; {}", tutti_devices::duration::ACCEPTED));
    }
    if duration > DURATION_MAX {
        return Err(format!("duration '{text}' is longer than 30 days; {}", tutti_devices::duration::ACCEPTED));
    }
    Ok(duration)
}

/// A block size: a size that is not zero (every stripe and region is counted in blocks of it).
/// fio's boolean spelling: 0 or 1 (also true / false).
fn parse_fio_bool(text: &str) -> Result<bool, String> {
    match text {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        other => Err(format!("{other:?}: expected 0 or 1")),
    }
}

fn parse_block_size_arg(text: &str) -> Result<u64, String> {
    match parse_size(text).map_err(|error| error.to_string())? {
        0 => Err(format!("block size '{text}' is zero; accepted: a multiple of 512 bytes up to 64 MiB, e.g. 4k, 128k, 1m")),
        bytes => Ok(bytes),
    }
}

fn parse_timing_arg(text: &str) -> Result<nvme_emu::TimingModel, String> {
    tutti_devices::parse_timing(text).map_err(|error| error.to_string())
}

fn parse_duration_arg(text: &str) -> Result<Duration, String> {
    parse_duration(text)
}

fn parse_cpus_arg(text: &str) -> Result<crate::cpus::CpuList, String> {
    crate::cpus::CpuList::parse(text)
}

fn parse_fraction_arg(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(value) if (0.0..=1.0).contains(&value) => Ok(value),
        _ => Err(format!("'{text}' is not a fraction; accepted: a number in 0..=1, e.g. 0.9")),
    }
}

fn parse_device_arg(text: &str) -> Result<DeviceSpec, String> {
    DeviceSpec::parse(text, &DeviceKind::ALL).map_err(|error| error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches};

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("0").is_err());
        assert!(parse_duration("ten").is_err());
        // Past 30 days, a deadline (Instant + runtime) could overflow the clock.
        assert_eq!(parse_duration("720h"), Ok(Duration::from_secs(720 * 3600)));
        for huge in ["721h", "18446744073709551615", "18446744073709551615h"] {
            assert!(parse_duration(huge).is_err(), "{huge}");
        }
    }

    #[test]
    fn an_output_flag_alone_is_the_embedded_default() {
        // Goal (issue 17): adding --output-format (or --keep, --directory) to the bare command
        // must not turn the default KV run into a raw 4 KiB read.
        let selected = |arguments: &[&str]| {
            let matches = Cli::command().try_get_matches_from(std::iter::once("tutti-bench").chain(arguments.iter().copied())).unwrap();
            select_workload(&matches, &Cli::from_arg_matches(&matches).unwrap())
        };
        assert_eq!(selected(&[]), Selected::Default);
        assert_eq!(selected(&["--output-format", "json"]), Selected::Default);
        assert_eq!(selected(&["--output-format=json", "--keep", "--directory", "/tmp"]), Selected::Default);
        assert_eq!(selected(&["--bs", "4k"]), Selected::Raw);
        assert_eq!(selected(&["--device", "emu:mem:16m"]), Selected::Raw);
        assert_eq!(selected(&["--device", "emu:mem:16m", "--workload=kv"]), Selected::Kv);
        assert_eq!(selected(&["--prompt-tokens", "160"]), Selected::Kv);
        assert_eq!(selected(&["--layers", "4", "--kv-heads", "1", "--head-dim", "64"]), Selected::Kv);
        assert_eq!(selected(&["--retrieve-only", "--device", "emu:/x"]), Selected::Kv);
        assert_eq!(selected(&["--workload=raw"]), Selected::Raw);
        assert_eq!(selected(&["--attach", "/run/tuttid.sock"]), Selected::Kv);
        assert_eq!(selected(&["--attach", "/run/tuttid.sock", "--clients", "4"]), Selected::Kv);
    }

    #[test]
    fn the_docs_name_every_option_the_default_run_keeps_and_help_says_verify_splits_size() {
        // Goal: the docs' no-argument section names every option with which the default run
        // still runs (it named four; --lock-dir and --executor=cpu keep it too), and --size's
        // help does not say each job covers it where --verify splits it between the jobs.
        let selected = |arguments: &[&str]| {
            let matches = Cli::command().try_get_matches_from(std::iter::once("tutti-bench").chain(arguments.iter().copied())).unwrap();
            select_workload(&matches, &Cli::from_arg_matches(&matches).unwrap())
        };
        let docs = include_str!("../../../docs/tutti-bench.md");
        let section = docs.split("## The no-argument default").nth(1).and_then(|rest| rest.split("\n1. ").next()).unwrap();
        // Every option no workload claims, less those that select one themselves (in the order
        // declared).
        let selects = ["workload", "devices", "verify", "attach_client", "help", "version"];
        let command = Cli::command();
        let keeping: Vec<_> = command
            .get_arguments()
            .filter(|arg| {
                let id = arg.get_id().as_str();
                ![&RAW_OPTIONS[..], &KV_OPTIONS[..], &crate::serve::OPTIONS[..], &selects[..]].concat().contains(&id)
            })
            .map(|arg| format!("--{}", arg.get_long().unwrap()))
            .collect();
        let given: [(&str, &[&str]); 6] = [
            ("--output-format", &["--output-format=json"]),
            ("--emu-timing", &["--emu-timing=tutti-ssd"]),
            ("--executor", &["--executor=cpu"]),
            ("--lock-dir", &["--lock-dir=/x"]),
            ("--keep", &["--keep"]),
            ("--directory", &["--directory=/x"]),
        ];
        assert_eq!(keeping, given.iter().map(|(name, _)| name.to_string()).collect::<Vec<_>>());
        for (name, arguments) in given {
            assert_eq!(selected(arguments), Selected::Default, "{arguments:?}");
            assert!(section.contains(&format!("`{name}")), "the docs' no-argument section does not name {name}: {section}");
        }
        let size = command.get_arguments().find(|arg| arg.get_id() == "size").unwrap().get_help().unwrap().to_string();
        assert!(size.contains("--verify"), "{size}");
    }
}
