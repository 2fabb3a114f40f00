//! `tutti`: administration of NVMe devices and pools.
use clap::Parser;

/// tutti administration tool.
#[derive(Parser)]
#[command(version, about)]
enum Command {}

fn main() -> anyhow::Result<()> {
    match Command::parse() {}
}
