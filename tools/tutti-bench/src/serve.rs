//! `--workload=serve`: a stream of requests served by the live runtime (`tutti-runtime` over the
//! object store on the software controller), one policy after another on the same stream, each
//! next to the simulator's prediction for the requests it served.
//!
//! - [`stream`]: the deterministic request stream (sessions, shared system prompts, arrivals);
//! - [`model`]: the profile table (analytic roofline + the undilated SSD model's cost rows) and
//!   the slow-motion factor taken from `--emu-timing`;
//! - [`live`]: one policy on a fresh stack, compute stood in for by dilated sleeps;
//! - [`report`]: figures per policy, the prediction, text, JSON and the sweep's SVG.

mod live;
mod model;
mod report;
mod stream;

use std::path::{Path, PathBuf};

use anyhow::Context;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args};
use tutti_cli::outln;
use tutti_runtime::PolicyChoice;

use crate::args::{Cli, OutputFormat};
use crate::usage;

/// Serve-only options (clap ids): any of them selects the serve workload.
pub const OPTIONS: [&str; 12] = [
    "policy",
    "repeat",
    "sessions",
    "turns",
    "system_prompts",
    "system_prompt_tokens",
    "decode_steps",
    "arrivals",
    "arrival_rate",
    "sweep_hit_rates",
    "sweep_svg",
    "gpu",
];

/// Prompt length and hit rate of serve when `--prompt-tokens` / `--hit-rate` are not given
/// (the kv workload's defaults, 8192 and 1, would take minutes per policy in slow motion).
pub const PROMPT_TOKENS_DEFAULT: u64 = 2048;
pub const HIT_RATE_DEFAULT: f64 = 0.5;

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// serve: slack-aware, naive, no-overlap, or all (side by side on the same stream, a fresh
    /// pool each).
    #[arg(long, default_value = "all")]
    pub policy: String,

    /// serve: runs of each policy on the same stream at each hit rate, interleaved (all
    /// policies once, then again), each on a fresh stack; figures are reported as medians over
    /// the runs, with every run's value in the JSON.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=32))]
    pub repeat: u32,

    /// serve: conversations; each turn's prompt starts with its session's earlier context.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub sessions: u32,

    /// serve: turns per session (requests = sessions × turns, round-robin over sessions).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub turns: u32,

    /// serve: distinct system prompts the sessions share (session s uses prompt s mod N).
    #[arg(long = "system-prompts", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub system_prompts: u32,

    /// serve: tokens of a system prompt (default: a quarter of the prompt; never more than the
    /// cached part, --hit-rate × --prompt-tokens).
    #[arg(long = "system-prompt-tokens", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    pub system_prompt_tokens: Option<u64>,

    /// serve: decode steps after each prefill (their slack takes deferred writes).
    #[arg(long = "decode-steps", default_value_t = 4, value_parser = clap::value_parser!(u32).range(0..=4096))]
    pub decode_steps: u32,

    /// serve: closed (the next request arrives when the previous one finished decoding) or
    /// poisson (exponential gaps at --arrival-rate; requests queue behind the one running).
    #[arg(long, value_enum, default_value_t = Arrivals::Closed)]
    pub arrivals: Arrivals,

    /// serve: requests per second of the modelled (real-speed) system, for --arrivals=poisson.
    /// The run waits for arrivals in real time (× the SSD model's slow motion): a rate whose
    /// arrivals are expected to span more than an hour of real time is refused.
    #[arg(long = "arrival-rate", default_value_t = 10.0, value_parser = parse_rate)]
    pub arrival_rate: f64,

    /// serve: run the stream at each of these hit rates (e.g. 0.25,0.5,0.75,0.9) and write an
    /// SVG of compute and bubble per policy, live beside predicted (--sweep-svg).
    #[arg(long = "sweep-hit-rates", value_delimiter = ',', value_parser = parse_hit_rate)]
    pub sweep_hit_rates: Vec<f64>,

    /// serve: where the sweep's SVG goes (only with --sweep-hit-rates; its directory is checked
    /// before anything runs).
    #[arg(long = "sweep-svg", default_value = "serve-sweep.svg")]
    pub sweep_svg: PathBuf,

    /// serve: the GPU whose roofline stands in for compute (h100, h200).
    #[arg(long, default_value = "h100")]
    pub gpu: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Arrivals {
    Closed,
    Poisson,
}

fn parse_rate(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate > 0.0 && rate <= 1e6 => Ok(rate),
        _ => Err(format!("'{text}' is not a rate; accepted: requests per second, a number in (0, 1e6]")),
    }
}

fn parse_hit_rate(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(rate) if (0.0..1.0).contains(&rate) => Ok(rate),
        _ => Err(format!("'{text}' is not a hit rate; accepted: numbers in 0..1 separated by commas, e.g. 0.25,0.5,0.75,0.9")),
    }
}

/// Everything one serve run needs, checked.
#[derive(Debug, Clone)]
pub struct ServePlan {
    pub policies: Vec<PolicyChoice>,
    pub model: model::ServeModel,
    pub stream: stream::StreamShape,
    pub hit_rates: Vec<f64>,
    pub sweep_svg: Option<PathBuf>,
    pub seed: u64,
    pub repeat: u32,
}

fn policies(text: &str) -> anyhow::Result<Vec<PolicyChoice>> {
    if text == "all" {
        return Ok(PolicyChoice::ALL.to_vec());
    }
    match PolicyChoice::parse(text) {
        Some(policy) => Ok(vec![policy]),
        None => usage(format!("--policy={text} is not a policy; accepted: slack-aware, naive, no-overlap, all")),
    }
}

impl ServePlan {
    pub fn from_cli(cli: &Cli, matches: &ArgMatches) -> anyhow::Result<Self> {
        let given = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
        if !cli.devices.is_empty() {
            return usage("--workload=serve builds a fresh in-memory software controller per policy; --device is not accepted (drop it)");
        }
        if cli.executor != crate::args::Executor::Cpu || cli.keep_pool || cli.retrieve_only || cli.verify {
            return usage("--workload=serve runs the CPU executor on a fresh pool; --keep-pool, --retrieve-only and --verify do not apply");
        }
        let args = &cli.serve;
        let policies = policies(&args.policy)?;
        let model = model::ServeModel::from_cli(cli)?;
        let prompt_tokens = if given("prompt_tokens") { cli.prompt_tokens } else { PROMPT_TOKENS_DEFAULT };
        let hit_rate = if given("hit_rate") { cli.hit_rate } else { HIT_RATE_DEFAULT };
        if given("hit_rate") && !args.sweep_hit_rates.is_empty() {
            return usage("--hit-rate and --sweep-hit-rates exclude each other: give one");
        }
        if given("sweep_svg") && args.sweep_hit_rates.is_empty() {
            return usage(
                "--sweep-svg names where a sweep's SVG goes: give --sweep-hit-rates too (e.g. 0.25,0.5,0.75,0.9), or drop --sweep-svg",
            );
        }
        if !args.sweep_hit_rates.is_empty() {
            check_writable(&args.sweep_svg)?;
        }
        let hit_rates = if args.sweep_hit_rates.is_empty() { vec![hit_rate] } else { args.sweep_hit_rates.clone() };
        if hit_rates.iter().any(|rate| !(0.0..1.0).contains(rate)) {
            return usage(format!("--hit-rate={hit_rate}: serve needs new tokens to compute; accepted: 0 <= hit rate < 1"));
        }
        let stream = stream::StreamShape::new(
            prompt_tokens,
            u64::from(model.choice.geometry.block_tokens),
            args.sessions,
            args.turns,
            args.system_prompts,
            args.system_prompt_tokens,
            args.decode_steps,
            args.arrivals,
            args.arrival_rate,
        )?;
        model.check_prompt(stream.prompt_tokens)?;
        if args.arrivals == Arrivals::Poisson {
            check_arrival_span(stream.requests(), args.arrival_rate, model.dilation)?;
        }
        Ok(Self {
            policies,
            model,
            stream,
            sweep_svg: (!args.sweep_hit_rates.is_empty()).then(|| args.sweep_svg.clone()),
            hit_rates,
            seed: cli.seed,
            repeat: args.repeat,
        })
    }
}

/// Refuses a sweep SVG path that cannot be written (its directory missing, not a directory or
/// not writable; the path a directory) before anything runs: a sweep takes minutes, and its
/// results must not be lost at the end for want of a file.
fn check_writable(path: &Path) -> anyhow::Result<()> {
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let refused = |why: String| usage(format!("--sweep-svg {}: {why}; accepted: a file in a writable directory", path.display()));
    if path.is_dir() {
        return refused("is a directory".to_string());
    }
    if !directory.is_dir() {
        return refused(format!("{} is not a directory", directory.display()));
    }
    if let Err(errno) = nix::unistd::access(directory, nix::unistd::AccessFlags::W_OK) {
        return refused(format!("cannot create a file in {}: {errno}", directory.display()));
    }
    Ok(())
}

/// The most real time a Poisson stream's arrivals may be expected to span: the run waits for
/// each arrival in real time (the model's gaps × its slow motion), so a tiny rate would sleep
/// for hours per request with nothing to show.
const ARRIVALS_REAL_SECONDS_MAX: f64 = 3600.0;

/// Refuses an --arrival-rate whose `requests` arrivals are expected (`requests − 1` mean gaps
/// of 1/rate modelled seconds, stretched `dilation` times) to take more than
/// [`ARRIVALS_REAL_SECONDS_MAX`] of real time, naming the smallest rate accepted.
fn check_arrival_span(requests: usize, rate: f64, dilation: u32) -> anyhow::Result<()> {
    let gaps = requests.saturating_sub(1) as f64;
    let real_seconds = gaps / rate * f64::from(dilation);
    if real_seconds.is_finite() && real_seconds <= ARRIVALS_REAL_SECONDS_MAX {
        return Ok(());
    }
    let smallest = gaps * f64::from(dilation) / ARRIVALS_REAL_SECONDS_MAX;
    usage(format!(
        "--arrival-rate={rate:?}: {requests} Poisson arrivals at {rate:?}/s are expected to span {} s of real time at the SSD model's {dilation}x slow motion; the limit is {ARRIVALS_REAL_SECONDS_MAX} s of real time (accepted: --arrival-rate of at least {smallest:.3e} for this stream, or fewer --sessions/--turns)",
        format_seconds(real_seconds)
    ))
}

fn format_seconds(seconds: f64) -> String {
    if seconds < 1e6 {
        format!("{seconds:.0}")
    } else if seconds.is_finite() {
        format!("{seconds:.2e}")
    } else {
        "unboundedly many".into()
    }
}

/// What to change when a serve run's memory does not fit.
const HOST_MEMORY_ACCEPTED: &str = "a smaller --prompt-tokens or model, or fewer --sessions/--turns";

/// Refuses, before anything is printed or allocated, a plan whose per-policy stack (the
/// engine's KV memory beside the in-memory pool) does not fit the host: unchecked, the run got
/// as far as opening its pool (or allocating the engine) before it failed.
fn check_host_memory(plan: &ServePlan) -> anyhow::Result<()> {
    let asked = live::host_memory(plan);
    crate::memory::check_host_memory(&asked.what, asked.engine_bytes, std::slice::from_ref(&asked.pool), HOST_MEMORY_ACCEPTED)?;
    Ok(())
}

/// `--workload=serve` from the command line.
pub fn run(cli: &Cli, matches: &ArgMatches) -> anyhow::Result<()> {
    let plan = ServePlan::from_cli(cli, matches)?;
    check_host_memory(&plan)?;
    let json = cli.output_format == OutputFormat::Json;
    let say = crate::run::narrator(cli.output_format);
    say(report::header(&plan))?;
    let profile = plan.model.profile(plan.stream.prompt_tokens)?;
    let mut points = Vec::with_capacity(plan.hit_rates.len());
    for &hit_rate in &plan.hit_rates {
        let requests = stream::build(&plan.stream, hit_rate, plan.seed);
        let mut runs: Vec<Vec<report::PolicyResult>> = plan.policies.iter().map(|_| Vec::with_capacity(plan.repeat as usize)).collect();
        for run in 1..=plan.repeat {
            for (&policy, policy_runs) in plan.policies.iter().zip(&mut runs) {
                if !json {
                    outln!(
                        "serve: hit rate {hit_rate}, policy {} ({} requests), run {run} of {} ...",
                        policy.name(),
                        requests.len(),
                        plan.repeat
                    )?;
                }
                let live = live::serve(&plan, &profile, policy, &requests, hit_rate)?;
                let predicted = report::predict(&plan, &profile, policy, &requests, &live)?;
                policy_runs.push(report::PolicyResult::new(policy, live, predicted));
            }
        }
        let results = runs.into_iter().map(report::PolicyRuns::new).collect();
        let point = report::SweepPoint { hit_rate, requests: requests.len(), policies: results };
        if !json {
            outln!("{}", report::text(&plan, &point))?;
        }
        points.push(point);
    }
    // The results first: an SVG that cannot be written after all (checked before the run) must
    // not take them with it.
    if json {
        outln!("{}", serde_json::to_string_pretty(&report::json(&plan, &points))?)?;
    } else if points.len() > 1 {
        outln!("{}", report::sweep_table(&points))?;
    }
    if let Some(path) = &plan.sweep_svg {
        let svg = report::sweep_svg(&plan, &points);
        std::fs::write(path, svg).with_context(|| format!("cannot write the sweep SVG {}", path.display()))?;
        say(format!("serve: sweep SVG written to {}", path.display()))?;
    }
    Ok(())
}
