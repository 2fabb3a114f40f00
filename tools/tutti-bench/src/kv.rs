//! The KV workload: store and retrieve a prompt's KV cache layer by layer through the object
//! store's layer API (`crates/objstore`).

use crate::args::Cli;

/// Runs `--workload=kv`. The object store's layer API has not landed in this build, so this
/// refuses rather than print numbers that were not measured.
pub fn run(cli: &Cli) -> anyhow::Result<()> {
    let model = cli.model.unwrap_or(crate::args::MODELS[0]);
    let half_layer_bytes = model.bytes_per_token_per_layer_half() * cli.block_tokens;
    crate::usage(format!(
        "--workload=kv (model {}: {} KiB of KV per token, {} KiB per K or V block of {} tokens) needs the object store's layer API (crates/objstore), which this build does not have yet; accepted now: --workload=raw",
        model.name,
        model.bytes_per_token() / 1024,
        half_layer_bytes / 1024,
        cli.block_tokens
    ))
}

/// Whether the KV workload can run in this build.
pub fn available() -> bool {
    false
}
