//! `tutti-profile simulate`: runs the three policies over a hit-rate sweep and a prefix-length
//! sweep, writes CSV, an SVG and a JSON summary, and prints the crossover figures.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use scheduler::plot::render_svg;
use scheduler::policy::PolicyKind;
use scheduler::sweep::{
    analytic_bound, hit_rate_sweep, prefix_length_sweep, preset, preset_names, summarize, to_csv, PolicySummary, Preset,
};
use serde::Serialize;
use tutti_cli::outln;

/// The most decode steps `--decode-steps` takes.
const DECODE_STEPS_MAX: i64 = 100_000;

#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// Experiment preset: {llama3-8b,qwen3-32b}-{h100,h200}-{32k,128k}.
    #[arg(long, default_value = "llama3-8b-h100-32k")]
    preset: String,
    /// Use this table (JSON) instead of the preset's analytic one; it must match the preset's
    /// model and GPU and contain the preset's prompt length.
    #[arg(long)]
    table: Option<PathBuf>,
    /// Output directory for CSV, SVG and summary (default: target/tutti-profile/PRESET).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// Decode steps simulated after the first token (where deferred writes go): 0..=100000.
    /// Each step is about one simulator event, and a sweep simulates every point, so the bound
    /// keeps a run well inside the simulator's event budget and minutes of time.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=DECODE_STEPS_MAX))]
    decode_steps: Option<u32>,
    /// Hit rate of the prefix-length sweep across input lengths.
    #[arg(long)]
    prefix_sweep_hit_rate: Option<f64>,
    /// List the presets and exit.
    #[arg(long)]
    list_presets: bool,
}

#[derive(Serialize)]
struct Report<'a> {
    preset: &'a Preset,
    /// Where the numbers come from; they are model outputs, not measurements.
    compute_source: &'a str,
    io_cost_source: &'a str,
    note: &'static str,
    analytic_bound_hit_rate: Option<f64>,
    policies: Vec<PolicySummary>,
    files: Vec<String>,
}

pub fn run(args: &SimulateArgs) -> Result<()> {
    if args.list_presets {
        for name in preset_names() {
            outln!("{name}")?;
        }
        return Ok(());
    }
    let mut experiment = preset(&args.preset)
        .ok_or_else(|| crate::unusable(format!("unknown preset `{}`; known: {}", args.preset, preset_names().join(", "))))?;
    if let Some(steps) = args.decode_steps {
        experiment.decode_step_count = steps;
    }
    if let Some(rate) = args.prefix_sweep_hit_rate {
        experiment.prefix_sweep_hit_rate = rate;
    }
    let profile = match &args.table {
        Some(path) => {
            let profile = crate::load_table(path)?;
            profile
                .check_identity(&experiment.model.identity(), &experiment.gpu.identity())
                .map_err(|error| crate::unusable(format!("table {} does not fit preset {}: {error}", path.display(), experiment.name)))?;
            // The policy counts I/O in the table's IOCBs and prices them with its rows: a table
            // measured with 2 MiB IOCBs simulated with the preset's 8 MiB counts priced every
            // kernel at a quarter of its bytes. The report says which size ran.
            experiment.iocb_bytes = profile.iocb_bytes();
            profile
        }
        None => experiment.build_profile()?,
    };

    let policies = PolicyKind::ALL;
    let sweep =
        hit_rate_sweep(&profile, &experiment.ssd, experiment.input_tokens, experiment.iocb_bytes, experiment.decode_step_count, &policies)?;
    let prefix_sweep = prefix_length_sweep(
        &profile,
        &experiment.ssd,
        experiment.prefix_sweep_hit_rate,
        experiment.iocb_bytes,
        experiment.decode_step_count,
        &policies,
    )?;
    let bound = analytic_bound(&profile, &experiment.ssd, experiment.input_tokens)?;
    let summaries = summarize(&sweep);

    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("target").join("tutti-profile").join(&experiment.name));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let title = format!(
        "{}: compute vs bubble, {} tokens, {} SSDs ({:.0} GB/s read, {:.0} GB/s write) — simulated",
        experiment.name,
        experiment.input_tokens,
        experiment.ssd.device_count,
        experiment.ssd.bandwidth_bytes_per_s(scheduler::table::IoKind::Read) / 1e9,
        experiment.ssd.bandwidth_bytes_per_s(scheduler::table::IoKind::Write) / 1e9,
    );
    let files = [
        ("hit_rate_sweep.csv", to_csv(&sweep)),
        ("prefix_length_sweep.csv", to_csv(&prefix_sweep)),
        ("hit_rate.svg", render_svg(&title, &sweep, &summaries, bound)),
    ];
    let mut written = Vec::new();
    for (name, contents) in files {
        let path = out.join(name);
        std::fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))?;
        written.push(path.display().to_string());
    }

    let report = Report {
        preset: &experiment,
        compute_source: &profile.table().compute_source,
        io_cost_source: &profile.table().io_cost_source,
        note: "simulated from an analytic/roofline or imported profile and an SSD model; not measured",
        analytic_bound_hit_rate: bound,
        policies: summaries,
        files: written.clone(),
    };
    let summary_path = out.join("summary.json");
    let json = serde_json::to_string_pretty(&report)?;
    std::fs::write(&summary_path, &json).with_context(|| format!("writing {}", summary_path.display()))?;

    if args.json {
        outln!("{json}")?;
    } else {
        outln!("{} (simulated; not measured)", experiment.name)?;
        outln!("  analytic bound (per-layer read = compute): {}", percent(bound))?;
        for s in &report.policies {
            outln!(
                "  {:<15} crossover {}  bubble>compute {}  max bubble below crossover {:.2}% of TTFT ({:.2}% beyond the pipeline fill)",
                s.policy,
                percent(s.crossover_hit_rate),
                percent(s.bubble_exceeds_compute_hit_rate),
                s.max_bubble_share_below_crossover * 100.0,
                s.max_excess_bubble_share_below_crossover * 100.0
            )?;
        }
        for path in written.iter().chain(std::iter::once(&summary_path.display().to_string())) {
            outln!("  wrote {path}")?;
        }
    }
    Ok(())
}

fn percent(value: Option<f64>) -> String {
    value.map_or_else(|| "none".to_string(), |v| format!("{:.2}%", v * 100.0))
}
