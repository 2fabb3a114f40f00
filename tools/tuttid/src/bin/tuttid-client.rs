//! tuttid-client: one engine-like client process of a running tuttid, for the VM stage and the
//! relay's process test: attaches its own queue pairs (`RemoteKvStore`), then either stores a
//! prompt's KV blocks layer by layer with a pattern that depends on the seed, the rank, the
//! block and the byte offset, or looks the prompt up, retrieves it into other engine blocks and
//! checks every byte against that pattern. Prints one line (`stored N blocks`, `retrieved N
//! blocks, B bytes checked`) and exits 0; any refusal, timeout or wrong byte is an error (exit
//! status from `tutti_cli::exit`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};
use gio_uring::SmBudget;
use objstore::{KvRequest, LayerKvStore};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::protocol::Hello;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Role {
    Store,
    Retrieve,
}

/// Stores or retrieves-and-checks one prompt through a running tuttid.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// What to do.
    #[arg(value_enum)]
    role: Role,
    /// The daemon's socket.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// Picks the prompt's tokens and the bytes' pattern.
    #[arg(long, default_value_t = 1)]
    seed: u32,
    /// Full engine blocks in the prompt.
    #[arg(long, default_value_t = 4)]
    blocks: u32,
    /// Tensor-parallel rank and world size of this client.
    #[arg(long, default_value_t = 0)]
    rank: u32,
    #[arg(long, default_value_t = 1)]
    world: u32,
    /// The longest wait for the whole store or retrieve.
    #[arg(long, default_value = "60", value_name = "SECONDS", value_parser = tutti_cli::timeout::parse_timeout_s)]
    timeout_seconds: Duration,
}

fn main() -> ExitCode {
    tutti_cli::init_stderr_logging();
    let cli = Cli::parse();
    match run(&cli) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("tuttid-client: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// The prompt's tokens: `blocks` full blocks and a partial one.
fn prompt(seed: u32, blocks: u32, block_tokens: u32) -> Vec<u32> {
    (0..(blocks * block_tokens + 3)).map(|token| token.wrapping_mul(2_654_435_761) ^ seed).collect()
}

/// The byte at `offset` of prompt block `block` as rank `rank` stores it.
fn pattern_byte(seed: u32, rank: u32, block: u32, offset: usize) -> u8 {
    let mixed = (offset as u32).wrapping_mul(0x9E37_79B1) ^ block.wrapping_mul(0x85EB_CA6B) ^ rank.wrapping_mul(0xC2B2_AE35) ^ seed;
    (mixed >> 13) as u8 ^ (mixed as u8)
}

fn run(cli: &Cli) -> Result<String> {
    ensure!(cli.blocks > 0 && cli.world > 0 && cli.rank < cli.world, "--blocks and --world must be positive and --rank below --world");
    let hello = Hello {
        model_fingerprint: [0x5a; 32],
        tp_rank: cli.rank,
        tp_world: cli.world,
        client_name: format!("tuttid-client-{}-of-{}", cli.rank, cli.world),
    };
    // Blocks 0..B are stored from, B..2B retrieved into.
    let config = RemoteConfig { kv_blocks: 2 * cli.blocks, ..RemoteConfig::default() };
    let mut store = RemoteKvStore::connect(&cli.socket, &hello, &config).context("attaching to tuttid")?;
    let block_tokens = store.hello_reply().shape.block_tokens;
    let layers = store.hello_reply().shape.layers;
    let block_bytes = usize::try_from(store.block_bytes()).context("block size")?;
    let tokens = prompt(cli.seed, cli.blocks, block_tokens);
    let deadline = Instant::now() + cli.timeout_seconds;
    match cli.role {
        Role::Store => {
            for block in 0..cli.blocks {
                let bytes: Vec<u8> = (0..block_bytes).map(|offset| pattern_byte(cli.seed, cli.rank, block, offset)).collect();
                store.write_block(block, 0, &bytes)?;
            }
            let block_ids: Vec<u32> = (0..cli.blocks).collect();
            let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &block_ids })?;
            for layer in 0..layers {
                store.store_layer(plan.handle, layer, SmBudget(1))?;
                ensure!(store.wait(plan.handle, deadline)? == Some(layer), "layer {layer} was not stored by the deadline");
            }
            let stored = store.commit_store(plan.handle)?;
            Ok(format!("stored {stored} blocks"))
        }
        Role::Retrieve => {
            let cached = store.lookup(&tokens);
            if cached != cli.blocks as usize {
                bail!("{cached} of the prompt's {} blocks are cached", cli.blocks);
            }
            let block_ids: Vec<u32> = (cli.blocks..2 * cli.blocks).collect();
            for &block in &block_ids {
                store.write_block(block, 0, &vec![0u8; block_bytes])?;
            }
            let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &block_ids })?;
            for layer in 0..layers {
                store.retrieve_layer(handle, layer, SmBudget(1))?;
                ensure!(store.wait(handle, deadline)? == Some(layer), "layer {layer} was not retrieved by the deadline");
            }
            store.finish(handle)?;
            let mut bytes = vec![0u8; block_bytes];
            let mut wrong = 0usize;
            for (prompt_block, &engine_block) in block_ids.iter().enumerate() {
                store.read_block(engine_block, 0, &mut bytes)?;
                wrong += bytes
                    .iter()
                    .enumerate()
                    .filter(|&(offset, &byte)| byte != pattern_byte(cli.seed, cli.rank, prompt_block as u32, offset))
                    .count();
            }
            ensure!(wrong == 0, "{wrong} wrong bytes retrieved");
            Ok(format!("retrieved {} blocks, {} bytes checked", block_ids.len(), block_ids.len() * block_bytes))
        }
    }
}
