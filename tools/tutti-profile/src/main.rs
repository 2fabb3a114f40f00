//! `tutti-profile`: builds the slack profile tables Tutti's scheduler reads (Tutti §3.3) and runs
//! the pipeline simulator over them (the model counterpart of Tutti §4.2.5, Fig. 13).
//!
//! - `analytic`: a table from a model config and a GPU spec (roofline; modelled, not measured);
//! - `import`: a table from a measured per-layer kernel timeline (format in
//!   `scheduler::import`);
//! - `io`: the I/O cost table measured on a live backend (gio-uring's CPU executor over the
//!   software controller or a VFIO device; see `measure_io`);
//! - `simulate`: hit-rate and prefix-length sweeps of every policy, CSV + SVG, crossover figures;
//! - `check`: validates a table file.
//!
//! Exit status (`tutti_cli::exit`): 0 done, 1 a measurement or simulation failed or `check`
//! found the table invalid, 2 unusable input (bad flags, device, model geometry, GPU spec, or an
//! input table/file that cannot be read or is invalid), 141 standard output closed.
#![forbid(unsafe_code)]

mod measure_io;
mod simulate;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use scheduler::analytic::{build_table, AnalyticGrid, GpuSpec, ModelConfig};
use scheduler::import::import_timeline;
use scheduler::ssd::SsdModel;
use scheduler::table::{IoCostEntry, Profile};
use tutti_cli::{exit, outln, GeometryArgs};

#[derive(Parser, Debug)]
#[command(
    name = "tutti-profile",
    version,
    about = "Profile tables and pipeline simulation for Tutti's slack-aware I/O scheduler",
    after_long_help = tutti_cli::exit::help_text(true)
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Build a table from a model config and a GPU spec with a roofline model (not measured).
    Analytic(AnalyticArgs),
    /// Build a table from a measured per-layer kernel timeline (CSV; see docs/scheduler.md).
    Import(ImportArgs),
    /// Measure the I/O cost table on the live backend.
    Io(measure_io::IoArgs),
    /// Run the pipeline simulator: sweeps, crossover figures, CSV and SVG.
    Simulate(simulate::SimulateArgs),
    /// Validate a table file (optionally against the model and GPU in use).
    Check(CheckArgs),
}

/// Model and GPU: the model's geometry options (a preset, a config.json, or flags) and a GPU
/// preset or spec file.
#[derive(Args, Debug, Clone)]
pub(crate) struct TargetArgs {
    /// The model: --model llama3-8b|qwen3-32b (default llama3-8b), --model-config FILE (a
    /// Hugging Face config.json, or this tool's ModelConfig JSON), and flags overriding its KV
    /// geometry (--layers, --kv-heads, --head-dim, --dtype, --tokens-per-block).
    #[command(flatten)]
    geometry: GeometryArgs,
    /// GPU preset: h100 or h200.
    #[arg(long, default_value = "h100")]
    gpu: String,
    /// JSON file with a full GPU spec (overrides --gpu).
    #[arg(long)]
    gpu_spec: Option<PathBuf>,
}

impl TargetArgs {
    /// The model for the roofline side: the KV geometry from the options; hidden size, attention
    /// heads and intermediate size from the config file or, failing that, the scheduler's preset
    /// of the same name.
    pub(crate) fn model(&self) -> Result<ModelConfig> {
        let choice = self.geometry.resolve(Some(tutti_cli::geometry::DEFAULT_MODEL)).map_err(|error| unusable(error.to_string()))?;
        let preset = choice.base.as_deref().and_then(ModelConfig::preset);
        let compute = |from_file: Option<u32>, from_preset: fn(&ModelConfig) -> u32, key: &str| {
            from_file.or(preset.as_ref().map(from_preset)).ok_or_else(|| {
                unusable(format!(
                    "model {}: the roofline model needs {key}, which neither the options nor a preset (llama3-8b, qwen3-32b) give; \
                     pass --model-config with a config.json that has hidden_size, num_attention_heads and intermediate_size",
                    choice.name
                ))
            })
        };
        let geometry = choice.geometry;
        let model = ModelConfig {
            name: choice.name.clone(),
            layer_count: geometry.layers,
            hidden_size: compute(choice.compute.hidden_size, |preset| preset.hidden_size, "hidden_size")?,
            head_count: compute(choice.compute.attention_heads, |preset| preset.head_count, "num_attention_heads")?,
            kv_head_count: geometry.kv_heads,
            head_dim: geometry.head_dim,
            intermediate_size: compute(choice.compute.intermediate_size, |preset| preset.intermediate_size, "intermediate_size")?,
            dtype_bytes: geometry.dtype_bytes,
        };
        model.validate().map_err(|error| unusable(format!("model {}: {error}", choice.name)))?;
        Ok(model)
    }

    /// Bytes of one KV object of the model (a layer's K or V of one block): one IOCTX.
    pub(crate) fn object_bytes(&self) -> Result<u64> {
        let choice = self.geometry.resolve(Some(tutti_cli::geometry::DEFAULT_MODEL)).map_err(|error| unusable(error.to_string()))?;
        Ok(choice.geometry.object_bytes())
    }

    pub(crate) fn gpu(&self) -> Result<GpuSpec> {
        if let Some(path) = &self.gpu_spec {
            let spec: GpuSpec = read_json(path)?;
            spec.validate().map_err(|error| unusable(format!("--gpu-spec {}: {error}", path.display())))?;
            return Ok(spec);
        }
        GpuSpec::preset(&self.gpu).ok_or_else(|| unusable(format!("unknown GPU preset `{}` (h100, h200)", self.gpu)))
    }
}

/// Input the command cannot use: exit status 2.
pub(crate) use tutti_cli::exit::Unusable;

pub(crate) fn unusable(message: impl Into<String>) -> anyhow::Error {
    Unusable(message.into()).into()
}

/// The SSD model behind analytic I/O costs (defaults: Tutti's two-SSD set-up).
#[derive(Args, Debug, Clone)]
struct SsdArgs {
    #[arg(long, default_value_t = 2)]
    ssd_count: u32,
    /// Read bandwidth per SSD, GB/s.
    #[arg(long, default_value_t = 14.5)]
    ssd_read_gb_per_s: f64,
    /// Write bandwidth per SSD, GB/s.
    #[arg(long, default_value_t = 6.0)]
    ssd_write_gb_per_s: f64,
    /// Share of solo bandwidth each direction keeps under mixed read/write traffic.
    #[arg(long, default_value_t = 0.4)]
    mixed_bandwidth_fraction: f64,
    /// Latency of an I/O kernel's first command from an idle queue, µs.
    #[arg(long, default_value_t = 50.0)]
    command_latency_us: f64,
    /// Bytes per second one I/O SM can drive, GB/s.
    #[arg(long, default_value_t = 10.0)]
    io_gb_per_s_per_sm: f64,
    /// Bytes one IOCB moves.
    #[arg(long, default_value_t = scheduler::sweep::PRESET_IOCB_BYTES)]
    iocb_bytes: u64,
    /// Largest IOCB count in the cost table.
    #[arg(long, default_value_t = 256)]
    iocb_count_max: u32,
}

impl SsdArgs {
    fn model(&self) -> Result<SsdModel> {
        let ssd = SsdModel {
            device_count: self.ssd_count,
            read_bytes_per_s_per_device: self.ssd_read_gb_per_s * 1e9,
            write_bytes_per_s_per_device: self.ssd_write_gb_per_s * 1e9,
            mixed_bandwidth_fraction: self.mixed_bandwidth_fraction,
            command_latency_us: self.command_latency_us,
            io_bytes_per_s_per_sm: self.io_gb_per_s_per_sm * 1e9,
        };
        ssd.validate()?;
        Ok(ssd)
    }

    fn cost_table(&self, io_sms: u32) -> Result<(Vec<IoCostEntry>, String)> {
        let ssd = self.model()?;
        let rows = ssd.cost_table(self.iocb_bytes, self.iocb_count_max, &[io_sms])?;
        let source = format!(
            "analytic-ssd-model (not measured): {} SSDs, {} GB/s read and {} GB/s write each, \
             mixed fraction {}, latency {} us, {} GB/s per I/O SM, {} bytes per IOCB",
            ssd.device_count,
            self.ssd_read_gb_per_s,
            self.ssd_write_gb_per_s,
            ssd.mixed_bandwidth_fraction,
            ssd.command_latency_us,
            self.io_gb_per_s_per_sm,
            self.iocb_bytes
        );
        Ok((rows, source))
    }
}

#[derive(Args, Debug)]
struct AnalyticArgs {
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    ssd: SsdArgs,
    /// SMs reserved for the I/O green context (at least 1: the analytic I/O cost rows run on
    /// them).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    io_sms: u32,
    /// Input-length step of the grid, tokens.
    #[arg(long, default_value_t = 4096)]
    input_step: u32,
    /// Number of input-length steps (the longest input is step × count).
    #[arg(long, default_value_t = 8)]
    input_count: u32,
    /// Prefix-length step of the grid, tokens (Tutti uses one warp's worth of tokens; coarser
    /// steps keep the file small).
    #[arg(long, default_value_t = 256)]
    prefix_step: u32,
    /// Output file (JSON).
    #[arg(long, short)]
    out: PathBuf,
    /// Indent the JSON (several times larger).
    #[arg(long)]
    pretty: bool,
}

#[derive(Args, Debug)]
struct ImportArgs {
    /// Kernel timeline CSV.
    #[arg(long)]
    timeline: PathBuf,
    #[command(flatten)]
    target: TargetArgs,
    /// I/O cost rows: a profile table (e.g. written by `io`; its rows and their provenance are
    /// taken) or a JSON array of io_costs entries. Without it the analytic SSD model fills them
    /// in and the table says so.
    #[arg(long)]
    io_costs: Option<PathBuf>,
    #[command(flatten)]
    ssd: SsdArgs,
    /// SMs reserved for the I/O green context: each kernel's SMs are clamped to the GPU's SMs
    /// less these (as the analytic model runs compute), and the analytic I/O cost rows' budget
    /// (at least 1).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    io_sms: u32,
    /// The GPU's green-context SM granularity: a partition is granted in multiples of this many
    /// SMs (8 on compute capability 9.x: cuDevSmResourceSplitByCount rounds a request of 4 up to
    /// 8). Given, an --io-sms the GPU cannot grant is refused: the table would model compute on
    /// SMs the I/O partition really takes. Default 1: not checked (nor with --io-sm-minimum 1).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    io_sm_granularity: u32,
    /// The smallest partition the GPU grants, SMs (a multiple of --io-sm-granularity; default:
    /// one multiple). It can be more than one: compute capability 8.x grants at least 4 SMs in
    /// multiples of 2, so --io-sms 2 would be granted 4. A smaller --io-sms is refused.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    io_sm_minimum: Option<u32>,
    /// Output file (JSON).
    #[arg(long, short)]
    out: PathBuf,
    /// Indent the JSON (several times larger).
    #[arg(long)]
    pretty: bool,
}

/// Refuses an I/O partition of `io_sms` SMs that a GPU granting them in multiples of
/// `granularity`, at least `minimum` (None: one multiple), cannot make (it would grant the next
/// multiple or the minimum, and compute would run on fewer SMs than the table says).
fn check_io_partition(io_sms: u32, granularity: u32, minimum: Option<u32>) -> Result<()> {
    if let Some(minimum) = minimum {
        if !minimum.is_multiple_of(granularity) {
            return Err(unusable(format!(
                "--io-sm-minimum {minimum} with --io-sm-granularity {granularity}: the smallest partition is a \
                 whole number of multiples"
            )));
        }
        if io_sms < minimum {
            return Err(unusable(format!(
                "--io-sms {io_sms} with --io-sm-minimum {minimum}: the GPU grants I/O partitions of at least \
                 {minimum} SMs, so it would reserve {minimum}; pass --io-sms {minimum}"
            )));
        }
    }
    if !io_sms.is_multiple_of(granularity) {
        let granted = io_sms.div_ceil(granularity).saturating_mul(granularity);
        return Err(unusable(format!(
            "--io-sms {io_sms} with --io-sm-granularity {granularity}: the GPU grants I/O partitions in multiples of \
             {granularity} SMs, so it would reserve {granted}; pass --io-sms {granted}"
        )));
    }
    Ok(())
}

#[derive(Args, Debug)]
struct CheckArgs {
    /// Table file (JSON).
    table: PathBuf,
    /// Also check the table against this model and GPU.
    #[arg(long)]
    against_target: bool,
    #[command(flatten)]
    target: TargetArgs,
}

fn main() -> std::process::ExitCode {
    tutti_cli::init_stderr_logging();
    use std::process::ExitCode;
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return ExitCode::from(exit::report_parse_error(&error)),
    };
    // Print the error chain ourselves: a user error is not a crash and needs no backtrace.
    match run(cli).and_then(|()| Ok(tutti_cli::stdout::flush()?)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if tutti_cli::is_stdout_closed(error.as_ref()) => ExitCode::from(exit::STDOUT_CLOSED),
        Err(error) => {
            let _ = tutti_cli::stdout::flush();
            eprintln!("error: {}", exit::error_line(error.as_ref()));
            let unusable = exit::is_unusable(error.as_ref())
                || error.chain().any(|cause| {
                    matches!(
                        cause.downcast_ref::<scheduler::SchedulerError>(),
                        Some(
                            scheduler::SchedulerError::InvalidConfig { .. }
                                | scheduler::SchedulerError::Timeline { .. }
                                | scheduler::SchedulerError::ImportedTable { .. }
                                | scheduler::SchedulerError::IoReservation { .. }
                        )
                    )
                });
            ExitCode::from(if unusable { exit::UNUSABLE_INPUT } else { exit::FAILURE })
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Analytic(args) => analytic(&args),
        Command::Import(args) => import(&args),
        Command::Io(args) => measure_io::run(&args),
        Command::Simulate(args) => simulate::run(&args),
        Command::Check(args) => check(&args),
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|error| unusable(format!("reading {}: {error}", path.display())))?;
    serde_json::from_str(&text).map_err(|error| unusable(format!("{}: {}", path.display(), describe_json_error(&text, &error))))
}

/// A JSON parse error in words: the parser's message and position, what stands there, and why
/// it is not JSON when it is a non-finite number (serde_json writes NaN and infinities as null,
/// but hand-edited or Python-written files carry `NaN`, `Infinity`).
pub(crate) fn describe_json_error(text: &str, error: &serde_json::Error) -> String {
    let (line, column) = (error.line(), error.column());
    let offset = text.split_inclusive('\n').take(line.saturating_sub(1)).map(str::len).sum::<usize>() + column.saturating_sub(1);
    let found: String = text.get(offset..).unwrap_or("").chars().take(16).take_while(|c| !c.is_whitespace() && *c != ',').collect();
    let field = text.get(..offset).and_then(|before| {
        let colon = before.trim_end().strip_suffix(':')?;
        let key = colon.trim_end().strip_suffix('"')?;
        key.rfind('"').map(|start| key[start + 1..].to_string())
    });
    let place = match &field {
        Some(field) => format!("field `{field}`"),
        None => "a value".to_string(),
    };
    let non_finite = ["NaN", "-NaN", "Infinity", "-Infinity", "inf", "-inf", "nan"].iter().any(|word| found.starts_with(word));
    if non_finite {
        format!(
            "{place} at line {line} column {column} holds `{found}`, which is not a number JSON can hold; \
             every figure in a table must be a finite number"
        )
    } else if found.is_empty() {
        format!("not valid JSON: {error}")
    } else {
        format!("not valid JSON at {place} (line {line} column {column}, `{found}`): {error}")
    }
}

pub(crate) fn write_file(path: &Path, contents: &str) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}

/// Loads and validates a table file given as input (an invalid one is unusable input).
pub(crate) fn load_table(path: &Path) -> Result<Profile> {
    let text = std::fs::read_to_string(path).map_err(|error| unusable(format!("reading {}: {error}", path.display())))?;
    parse_table(path, &text).map_err(|error| unusable(format!("{error:#}")))
}

/// Parses and validates a table's text, parse errors in words.
fn parse_table(path: &Path, text: &str) -> Result<Profile> {
    match Profile::from_json(text) {
        Ok(profile) => Ok(profile),
        Err(scheduler::SchedulerError::Parse(error)) => {
            anyhow::bail!("loading profile table {}: {}", path.display(), describe_json_error(text, &error))
        }
        Err(error) => Err(anyhow::Error::new(error).context(format!("loading profile table {}", path.display()))),
    }
}

fn analytic(args: &AnalyticArgs) -> Result<()> {
    let model = args.target.model()?;
    let gpu = args.target.gpu()?;
    let grid = AnalyticGrid {
        input_step_tokens: args.input_step,
        input_step_count: args.input_count,
        prefix_step_tokens: args.prefix_step,
        io_sms: args.io_sms,
        decode_step_tokens: args.input_step,
    };
    let (io_costs, io_source) = args.ssd.cost_table(args.io_sms)?;
    let table = build_table(&model, &gpu, &grid, io_costs, &io_source)?;
    let profile = Profile::from_table(table).context("the analytic table failed its own validation")?;
    write_file(&args.out, &if args.pretty { profile.to_json_pretty()? } else { profile.to_json()? })?;
    eprintln!(
        "wrote {} ({} buckets, {} layers, model {}, GPU {}; analytic roofline, not measured)",
        args.out.display(),
        profile.table().buckets.len(),
        profile.layer_count(),
        model.name,
        gpu.name
    );
    Ok(())
}

fn import(args: &ImportArgs) -> Result<()> {
    let model = args.target.model()?;
    let gpu = args.target.gpu()?;
    check_io_partition(args.io_sms, args.io_sm_granularity, args.io_sm_minimum)?;
    // The table records whether the reservation was checked against the GPU's partitions.
    // Granularity 1 with minimum 1 (what run-all passes where the compute capability is unknown)
    // allows any count: nothing was checked, so no claim.
    let granularity = match (args.io_sm_granularity, args.io_sm_minimum) {
        (1, None | Some(1)) => String::new(),
        (unit, None) => format!(" (a partition this GPU grants: multiples of {unit} SMs)"),
        (unit, Some(minimum)) => {
            format!(" (a partition this GPU grants: multiples of {unit} SMs, at least {minimum})")
        }
    };
    let text =
        std::fs::read_to_string(&args.timeline).map_err(|error| unusable(format!("reading {}: {error}", args.timeline.display())))?;
    let (io_costs, io_source) = match &args.io_costs {
        Some(path) => io_costs_from(path)?,
        None => args.ssd.cost_table(args.io_sms)?,
    };
    let profile = import_timeline(
        &text,
        model.identity(),
        gpu.identity(),
        args.io_sms,
        io_costs,
        &format!("imported-timeline: {}; --io-sms {}{granularity}", args.timeline.display(), args.io_sms),
        &io_source,
    )
    .with_context(|| format!("importing {}", args.timeline.display()))?;
    write_file(&args.out, &if args.pretty { profile.to_json_pretty()? } else { profile.to_json()? })?;
    eprintln!("wrote {} ({} buckets from {})", args.out.display(), profile.table().buckets.len(), args.timeline.display());
    Ok(())
}

/// I/O cost rows from a profile table (keeping its provenance) or from a bare JSON array.
fn io_costs_from(path: &Path) -> Result<(Vec<IoCostEntry>, String)> {
    let text = std::fs::read_to_string(path).map_err(|error| unusable(format!("reading {}: {error}", path.display())))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|error| unusable(format!("{}: {}", path.display(), describe_json_error(&text, &error))))?;
    if let serde_json::Value::Array(items) = value {
        // Valid JSON of the wrong shape: say which row and what a row is (a value's error carries
        // no position in the text).
        let rows = items
            .into_iter()
            .enumerate()
            .map(|(index, item)| {
                serde_json::from_value::<IoCostEntry>(item).map_err(|error| {
                    unusable(format!(
                        "{}: row {index} of the array is not an io_costs row ({error}); expected an array of \
                         {{\"kind\": \"read\"|\"write\", \"iocb_count\": N, \"sm_budget\": N, \"duration_us\": X, \"bytes\": N}}, \
                         or a table written by tutti-profile io",
                        path.display()
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        return Ok((rows, format!("imported from {}", path.display())));
    }
    let profile = load_table(path)?;
    let table = profile.table();
    Ok((table.io_costs.clone(), format!("{} (from {})", table.io_cost_source, path.display())))
}

fn check(args: &CheckArgs) -> Result<()> {
    // The checker's verdict: an invalid table is what it looks for (exit status 1), an unreadable
    // file is unusable input (2).
    let text = std::fs::read_to_string(&args.table).map_err(|error| unusable(format!("reading {}: {error}", args.table.display())))?;
    let profile = parse_table(&args.table, &text)?;
    if args.against_target {
        let model = args.target.model()?;
        let gpu = args.target.gpu()?;
        profile.check_identity(&model.identity(), &gpu.identity())?;
    }
    // The slack-aware runtime refuses a table whose decode steps could never write (the same
    // predicate): valid here and refused there was no verdict.
    profile.check_decode_steps_can_write().with_context(|| format!("{} is unusable by the slack-aware runtime", args.table.display()))?;
    let t = profile.table();
    outln!(
        "{}: valid (format {}, model {}, GPU {}, {} buckets, inputs up to {} tokens, compute: {}, io costs: {})",
        args.table.display(),
        t.format_version,
        t.model.name,
        t.gpu.name,
        t.buckets.len(),
        profile.input_tokens_max(),
        t.compute_source,
        t.io_cost_source
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A timeline of two buckets measured with every kernel on all 132 SMs (what slack-profile.py
    /// writes), imported for the h100 preset with `extra` flags; the table's JSON.
    fn import_all_sm_timeline(name: &str, extra: &[&str]) -> Result<serde_json::Value> {
        let dir = std::env::temp_dir().join(format!("tutti-profile-unit-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let timeline = dir.join("timeline.csv");
        let mut csv = String::from("phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used\n");
        for (input, prefix) in [(4096, 0), (4096, 4096)] {
            for layer in 0..32 {
                let t = f64::from(layer) * 1000.0;
                csv.push_str(&format!("prefill,{input},{prefix},{layer},qkv,{t},{},132\n", t + 100.0));
                csv.push_str(&format!("prefill,{input},{prefix},{layer},attn,{},{},132\n", t + 100.0, t + 1000.0));
            }
        }
        csv.push_str("decode,4096,,,step,0,3000,132\n");
        std::fs::write(&timeline, csv).unwrap();
        let out = dir.join("table.json");
        let arguments = [
            &["tutti-profile", "import", "--timeline", timeline.to_str().unwrap(), "--gpu", "h100", "--out", out.to_str().unwrap()][..],
            extra,
        ]
        .concat();
        let Command::Import(args) = Cli::try_parse_from(arguments).unwrap().command else { unreachable!("an import") };
        let result = import(&args).map(|()| serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
        result
    }

    /// Goal: a Hopper green context grants I/O SMs in multiples of 8 (at least 8): told so, the
    /// import refuses a reservation of 4 (status 2, naming both flags), which would model compute
    /// on 128 SMs where the hardware leaves 124.
    #[test]
    fn an_io_partition_the_gpu_cannot_grant_is_refused() {
        let error = import_all_sm_timeline("refused", &["--io-sms", "4", "--io-sm-granularity", "8"]).unwrap_err();
        let text = format!("{error:#}");
        assert!(text.contains("--io-sms 4") && text.contains("--io-sm-granularity 8"), "{text}");
        assert!(exit::is_unusable(error.as_ref()), "unusable input: {text}");
    }

    /// Goal: on compute capability 8.x a green context grants at least 4 SMs, in multiples of
    /// 2: told the minimum too, the import refuses 2 (a multiple of the granularity the GPU
    /// would still round up to 4), status 2 naming the flags; 4 and 6 pass. Without
    /// --io-sm-minimum the minimum is one multiple, as before.
    #[test]
    fn an_io_partition_below_the_gpus_minimum_is_refused() {
        let refused = ["--io-sms", "2", "--io-sm-granularity", "2", "--io-sm-minimum", "4"];
        let error = import_all_sm_timeline("below-minimum", &refused).unwrap_err();
        let text = format!("{error:#}");
        assert!(text.contains("--io-sms 2") && text.contains("--io-sm-minimum 4") && text.contains("pass --io-sms 4"), "{text}");
        assert!(exit::is_unusable(error.as_ref()), "unusable input: {text}");
        for io_sms in ["4", "6"] {
            let granted = ["--io-sms", io_sms, "--io-sm-granularity", "2", "--io-sm-minimum", "4"];
            let table = import_all_sm_timeline(&format!("at-minimum-{io_sms}"), &granted).unwrap();
            let source = table["compute_source"].as_str().unwrap();
            assert!(source.contains("at least 4"), "{source}");
        }
        import_all_sm_timeline("one-multiple", &["--io-sms", "2", "--io-sm-granularity", "2"]).unwrap();
        // A minimum that is not a whole number of multiples is itself refused.
        let odd = ["--io-sms", "6", "--io-sm-granularity", "2", "--io-sm-minimum", "5"];
        let error = import_all_sm_timeline("odd-minimum", &odd).unwrap_err();
        assert!(exit::is_unusable(error.as_ref()), "{error:#}");
    }

    /// Goal: granularity 1 with minimum 1 is what run-all passes where the compute capability is
    /// unknown: nothing was checked, so the table claims no granted partition (as without the
    /// flags). Before, --io-sm-minimum 1 wrote "a partition this GPU grants" into compute_source.
    #[test]
    fn a_granularity_and_minimum_of_one_claim_no_granted_partition() {
        for (name, extra) in [
            ("unchecked-both", &["--io-sms", "4", "--io-sm-granularity", "1", "--io-sm-minimum", "1"][..]),
            ("unchecked-none", &["--io-sms", "4"][..]),
        ] {
            let table = import_all_sm_timeline(name, extra).unwrap();
            let source = table["compute_source"].as_str().unwrap();
            assert!(source.contains("--io-sms 4") && !source.contains("grants"), "{source}");
        }
    }

    /// Goal: `--io-costs` rows measured only above `--io-sms` (8 SMs against a reservation of
    /// 4), on a timeline whose kernels fill the compute SMs (decode steps leave 4 free): the
    /// refusal (status 2) names that mismatch, `io_sms` against the rows' smallest `sm_budget`.
    /// Before, it named only `decode_steps.free_sms`, as though the timeline were at fault.
    #[test]
    fn io_costs_rows_only_above_io_sms_are_named_in_the_refusal() {
        let costs = std::env::temp_dir().join(format!("tutti-profile-unit-costs-at-8-{}.json", std::process::id()));
        let rows: Vec<IoCostEntry> = [scheduler::table::IoKind::Read, scheduler::table::IoKind::Write]
            .into_iter()
            .flat_map(|kind| {
                [1u32, 2, 4].map(|iocb_count| IoCostEntry {
                    kind,
                    iocb_count,
                    sm_budget: 8,
                    duration_us: 100.0 * f64::from(iocb_count),
                    bytes: u64::from(iocb_count) << 20,
                })
            })
            .collect();
        std::fs::write(&costs, serde_json::to_string(&rows).unwrap()).unwrap();
        let error = import_all_sm_timeline("costs-at-8", &["--io-sms", "4", "--io-costs", costs.to_str().unwrap()]).unwrap_err();
        std::fs::remove_file(&costs).unwrap();
        let text = format!("{error:#}");
        assert!(text.contains("io_sms 4") && text.contains("smallest read sm_budget 8") && text.contains("write sm_budget 8"), "{text}");
        // Status 2 (`main`): the scheduler's `IoReservation`, with the imported table's refusal
        // behind it as its source.
        // A boxed source is the box as the error.
        fn as_scheduler_error<'e>(cause: &'e (dyn std::error::Error + 'static)) -> Option<&'e scheduler::SchedulerError> {
            cause.downcast_ref().or_else(|| cause.downcast_ref::<Box<scheduler::SchedulerError>>().map(|boxed| &**boxed))
        }
        let causes: Vec<&scheduler::SchedulerError> = error.chain().filter_map(as_scheduler_error).collect();
        assert!(
            matches!(
                causes.as_slice(),
                [scheduler::SchedulerError::IoReservation { io_sms: 4, .. }, scheduler::SchedulerError::ImportedTable { .. }, ..]
            ),
            "unusable input: {text}"
        );
    }

    /// Goal: the granted partition is what the table reserves (compute on 132 − 8 = 124 SMs), and
    /// the table says how the count was checked.
    #[test]
    fn the_granted_io_partition_is_reserved() {
        let table = import_all_sm_timeline("granted", &["--io-sms", "8", "--io-sm-granularity", "8"]).unwrap();
        let source = table["compute_source"].as_str().unwrap();
        assert!(source.contains("clamped to 124"), "{source}");
        assert!(source.contains("multiples of 8"), "{source}");
        for step in table["decode_steps"].as_array().unwrap() {
            assert_eq!(step["free_sms"].as_u64(), Some(8), "{step}");
        }
    }
}
