//! The KV workload: store and retrieve a prompt's KV cache layer by layer through the object
//! store's layer API (`crates/objstore`).

use crate::args::Cli;

/// Runs `--workload=kv`. The object store's layer API has not landed in this build, so this
/// refuses rather than print numbers that were not measured.
pub fn run(cli: &Cli) -> anyhow::Result<()> {
    let model = cli.model.map_or("llama3-8b", |model| model.name);
    crate::usage(format!(
        "--workload=kv (model {model}) needs the object store's layer API (crates/objstore), which this build does not have yet; accepted now: --workload=raw"
    ))
}

/// Whether the KV workload can run in this build.
pub fn available() -> bool {
    false
}
