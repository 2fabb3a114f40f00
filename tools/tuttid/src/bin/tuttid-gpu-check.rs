//! tuttid-gpu-check: GPU memory through tuttid, end to end, on a machine with a GPU (built with
//! the `cuda` feature; `tools/gpu/run-all.sh ipc` runs it; docs/tuttid.md, "GPU memory").
//!
//! 1. starts `tuttid --device emu:mem:… --format --device-memory cuda` (the software controller
//!    runs inside the daemon and reaches client GPU memory by CUDA copies of the imported pointer);
//! 2. runs a **store** client process (this binary again): `cuMemAlloc`s its KV memory, fills
//!    engine blocks with a pattern (`cuMemcpyHtoD`), exports the range (CUDA IPC handle, plus a
//!    dma-buf where the driver gives one), registers it with `RegisterDeviceMemory`, stores the
//!    prompt layer by layer through its own queue pair and commits;
//! 3. runs a **retrieve** client process: another `cuMemAlloc`, zeroed, registered the same way;
//!    looks the prompt up, retrieves it into other engine blocks, copies them back to the host
//!    (`cuMemcpyDtoH`) and compares every byte with the pattern;
//! 4. stops the daemon (SIGTERM: drain, exit 0).
//!
//! `--memory memfd` runs the same processes and steps with the software stand-in for GPU memory
//! (a sealed memfd, `tuttid --device-memory memfd`), touching no CUDA: how this program itself is
//! checked on a machine without a GPU (`cargo test -p tuttid --features cuda --test gpu_check`).
//!
//! Prints what it found (GPU, driver, dma-buf or why not) and ends with one line, `PASS …` (exit
//! 0) or `FAIL …` (exit 1) naming the step and the CUDA call or daemon refusal that failed. Every
//! wait is bounded. A client frees its GPU memory only after the daemon ended its session (the
//! daemon's `cuIpcCloseMemHandle` must come first: CUDA leaves freeing earlier undefined).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};
use gio_uring::SmBudget;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use nvme_driver::hw::{DmaAllocator, DmaPool, DmaRegion, SharedMemory};
use objstore::{KvRequest, LayerKvStore};
use tutti_cuda_ipc::{format_uuid, DeviceBuffer, Gpu};
use tutti_daemon::client::{DeviceKvMemory, RemoteConfig, RemoteKvStore};
use tutti_daemon::protocol::Hello;
use tutti_daemon::Client;

/// Where the KV range starts in each client's allocation: not its base, page aligned (a dma-buf
/// range must be).
const KV_OFFSET_BYTES: usize = 64 << 10;
/// Room after the KV range in each allocation.
const TAIL_BYTES: usize = 1 << 20;

/// Where the clients keep their KV memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Memory {
    /// GPU memory (`cuMemAlloc`), registered through CUDA IPC.
    Cuda,
    /// A sealed memfd the daemon reaches by copies (no GPU needed).
    Memfd,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Role {
    Store,
    Retrieve,
}

/// GPU memory through tuttid, end to end (see the file's documentation).
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// The tuttid binary (default: next to this one).
    #[arg(long)]
    tuttid: Option<PathBuf>,
    /// Where the clients keep their KV memory.
    #[arg(long, value_enum, default_value = "cuda")]
    memory: Memory,
    /// The GPU (CUDA ordinal) the clients allocate on.
    #[arg(long, default_value_t = 0)]
    gpu: i32,
    /// Full engine blocks in the prompt.
    #[arg(long, default_value_t = 16)]
    blocks: u32,
    /// Model shape of the pool: layers, KV heads, head dimension (bf16, 16-token blocks).
    #[arg(long, default_value_t = 8)]
    layers: u32,
    #[arg(long, default_value_t = 8)]
    kv_heads: u32,
    #[arg(long, default_value_t = 128)]
    head_dim: u32,
    /// The longest wait for any one step.
    #[arg(long, default_value = "60", value_name = "SECONDS", value_parser = tutti_cli::timeout::parse_timeout_s)]
    timeout_seconds: Duration,
    /// Internal: run as a client process.
    #[arg(long, value_enum, requires = "socket")]
    role: Option<Role>,
    /// Internal: the daemon's socket (with --role).
    #[arg(long)]
    socket: Option<PathBuf>,
}

fn main() -> ExitCode {
    tutti_cli::init_stderr_logging();
    let cli = Cli::parse();
    match cli.role {
        Some(role) => match client(&cli, role) {
            Ok(line) => {
                println!("CHILD {line}");
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("tuttid-gpu-check {role:?}: {error:#}");
                ExitCode::FAILURE
            }
        },
        None => match check(&cli) {
            Ok(line) => {
                println!("PASS {line}");
                ExitCode::SUCCESS
            }
            Err(error) => {
                println!("FAIL gpu ipc: {error:#}");
                ExitCode::FAILURE
            }
        },
    }
}

/// The prompt's tokens: `blocks` full blocks of `block_tokens` and a partial one.
fn prompt(blocks: u32, block_tokens: u32) -> Vec<u32> {
    (0..(blocks * block_tokens + 7)).map(|token| token.wrapping_mul(2_654_435_761) ^ 0x6770_7531).collect()
}

fn pattern_byte(block: u32, offset: usize) -> u8 {
    let mixed = (offset as u32).wrapping_mul(0x9E37_79B1) ^ block.wrapping_mul(0x85EB_CA6B) ^ 0x2545_F491;
    (mixed >> 13) as u8 ^ (mixed as u8)
}

/// The parent: daemon, store process, retrieve process, drain.
fn check(cli: &Cli) -> Result<String> {
    let started = Instant::now();
    if cli.memory == Memory::Cuda {
        let gpu = Gpu::open(cli.gpu).context("opening the GPU (is a CUDA driver installed?)")?;
        println!(
            "gpu {} '{}' {} driver {} dma-buf {}",
            gpu.ordinal(),
            gpu.name(),
            format_uuid(&gpu.uuid()),
            gpu.driver_version(),
            if gpu.dma_buf_supported() { "supported" } else { "not supported" }
        );
    }
    let tuttid = match &cli.tuttid {
        Some(path) => path.clone(),
        None => std::env::current_exe()?.parent().context("this binary's directory")?.join("tuttid"),
    };
    ensure!(tuttid.is_file(), "no tuttid binary at {} (--tuttid PATH)", tuttid.display());
    let directory = std::env::temp_dir().join(format!("tuttid-gpu-check-{}", std::process::id()));
    std::fs::create_dir_all(&directory)?;
    let socket = directory.join("tuttid.sock");
    let mut daemon = Daemon::start(cli, &tuttid, &directory, &socket)?;
    let result = (|| {
        let stored = run_client(cli, &socket, Role::Store)?;
        ensure!(stored == format!("stored {}", cli.blocks), "the store client answered '{stored}'");
        let retrieved = run_client(cli, &socket, Role::Retrieve)?;
        ensure!(retrieved.starts_with("wrong 0 "), "the retrieve client answered '{retrieved}'");
        Ok(retrieved)
    })();
    let drained = daemon.terminate(cli);
    let _ = std::fs::remove_dir_all(&directory);
    let retrieved = result?;
    drained?;
    let what = match cli.memory {
        Memory::Cuda => "gpu ipc: GPU memory through CUDA IPC",
        Memory::Memfd => "gpu ipc orchestration, memfd stand-in (no CUDA)",
    };
    Ok(format!(
        "{what}: {} blocks stored by one process and retrieved into another's, {retrieved}; daemon drained (exit 0); {:.1} s",
        cli.blocks,
        started.elapsed().as_secs_f64()
    ))
}

struct Daemon {
    child: Option<Child>,
}

impl Daemon {
    fn start(cli: &Cli, tuttid: &Path, directory: &Path, socket: &Path) -> Result<Daemon> {
        let mut command = Command::new(tuttid);
        command
            .args(["--device", "emu:mem:512m", "--format", "--metrics", "off"])
            .args(["--device-memory", &format!("{:?}", cli.memory).to_lowercase()])
            .arg("--socket")
            .arg(socket)
            .arg("--lock-dir")
            .arg(directory.join("locks"))
            .args(["--layers", &cli.layers.to_string(), "--kv-heads", &cli.kv_heads.to_string()])
            .args(["--head-dim", &cli.head_dim.to_string(), "--clients-max", "4"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let child = command.spawn().with_context(|| format!("starting {}", tuttid.display()))?;
        let mut daemon = Daemon { child: Some(child) };
        let deadline = Instant::now() + cli.timeout_seconds;
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            if let Some(status) = daemon.child_mut().try_wait()? {
                bail!("tuttid exited with {status} before listening: {}", daemon.stderr());
            }
            ensure!(Instant::now() < deadline, "tuttid did not listen within {:?}", cli.timeout_seconds);
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(daemon)
    }

    fn child_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("the daemon runs until terminate")
    }

    fn stderr(&mut self) -> String {
        let mut text = String::new();
        if let Some(stderr) = self.child.as_mut().and_then(|child| child.stderr.as_mut()) {
            let _ = stderr.read_to_string(&mut text);
        }
        text
    }

    /// SIGTERM, then a bounded wait for exit 0 (its standard error shown either way).
    fn terminate(&mut self, cli: &Cli) -> Result<()> {
        let pid = Pid::from_raw(self.child_mut().id() as i32);
        kill(pid, Signal::SIGTERM).context("signalling tuttid")?;
        let status = wait_bounded(self.child_mut(), cli.timeout_seconds)?;
        let stderr = self.stderr();
        self.child = None;
        println!("tuttid's log:\n{}", stderr.trim_end());
        ensure!(status.success(), "tuttid exited with {status} after SIGTERM");
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn wait_bounded(child: &mut Child, timeout: Duration) -> Result<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("process {} did not exit within {} s (killed)", child.id(), timeout.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs this binary as a client process; its `CHILD` line's text.
fn run_client(cli: &Cli, socket: &Path, role: Role) -> Result<String> {
    let mut command = Command::new(std::env::current_exe()?);
    command
        .args(["--role", &format!("{role:?}").to_lowercase(), "--gpu", &cli.gpu.to_string(), "--blocks", &cli.blocks.to_string()])
        .args(["--memory", &format!("{:?}", cli.memory).to_lowercase()])
        .args(["--timeout-seconds", &cli.timeout_seconds.as_secs().to_string()])
        .arg("--socket")
        .arg(socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = command.spawn().context("starting a client process")?;
    let mut stdout = child.stdout.take().context("the client's output")?;
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let status = wait_bounded(&mut child, cli.timeout_seconds)?;
    let output = reader.join().unwrap_or_default();
    print!("{output}");
    ensure!(status.success(), "the {role:?} client exited with {status}");
    output
        .lines()
        .find_map(|line| line.strip_prefix("CHILD ").map(str::to_string))
        .with_context(|| format!("the {role:?} client printed no result"))
}

/// One client process: its own GPU memory, registered with the daemon, a store or a retrieve.
fn client(cli: &Cli, role: Role) -> Result<String> {
    let socket = cli.socket.as_deref().context("--socket")?;
    let timeout = cli.timeout_seconds;
    let hello = Hello { model_fingerprint: [0x67; 32], tp_rank: 0, tp_world: 1, client_name: format!("gpu-check-{role:?}").to_lowercase() };
    // The pool's shape, for the block size (the store checks it again at connect).
    let shape = {
        let mut probe = Client::connect(socket, timeout).context("connecting to tuttid")?;
        probe.hello(&hello).context("attaching to tuttid")?.shape
    };
    let block_bytes = 2
        * shape.layers as usize
        * shape.kv_heads as usize
        * shape.head_dim as usize
        * shape.dtype_bytes as usize
        * shape.block_tokens as usize;
    let kv_blocks = 2 * cli.blocks;
    let kv_bytes = kv_blocks as usize * block_bytes;
    let memory = EngineMemory::allocate(cli, KV_OFFSET_BYTES + kv_bytes + TAIL_BYTES)?;
    let block_at = |block: u32| KV_OFFSET_BYTES + block as usize * block_bytes;
    match role {
        Role::Store => {
            for block in 0..cli.blocks {
                let bytes: Vec<u8> = (0..block_bytes).map(|offset| pattern_byte(block, offset)).collect();
                memory.write(block_at(block), &bytes).with_context(|| format!("filling engine block {block}"))?;
            }
        }
        Role::Retrieve => memory.fill(0).context("zeroing the KV memory")?,
    }
    let export = memory.export(role, KV_OFFSET_BYTES, kv_bytes)?;
    let config = RemoteConfig { kv_blocks, timeout, ..RemoteConfig::default() };
    let mut store = RemoteKvStore::connect_with_device_memory(socket, &hello, &config, &export)
        .context("attaching with device memory (RegisterDeviceMemory)")?;
    ensure!(store.block_bytes() as usize == block_bytes, "the store's block is {} bytes, expected {block_bytes}", store.block_bytes());
    let session = store.hello_reply().session;
    let tokens = prompt(cli.blocks, shape.block_tokens);
    let deadline = Instant::now() + timeout;
    let answer = match role {
        Role::Store => {
            let block_ids: Vec<u32> = (0..cli.blocks).collect();
            let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &block_ids })?;
            let started = Instant::now();
            for layer in 0..shape.layers {
                store.store_layer(plan.handle, layer, SmBudget(1)).with_context(|| format!("storing layer {layer}"))?;
                ensure!(store.wait(plan.handle, deadline)? == Some(layer), "layer {layer} was not stored by the deadline");
            }
            let layers_took = started.elapsed();
            let stored = store.commit_store(plan.handle).context("committing")?;
            println!("store: {stored} blocks, {} bytes in {:.1} ms of layers", cli.blocks as usize * block_bytes, ms(layers_took));
            format!("stored {stored}")
        }
        Role::Retrieve => {
            let cached = store.lookup(&tokens);
            ensure!(cached == cli.blocks as usize, "{cached} of the prompt's {} blocks are cached", cli.blocks);
            // Other engine blocks than the store used, in reverse order.
            let block_ids: Vec<u32> = (0..cli.blocks).map(|i| kv_blocks - 1 - i).collect();
            let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &block_ids })?;
            let started = Instant::now();
            for layer in 0..shape.layers {
                store.retrieve_layer(handle, layer, SmBudget(1)).with_context(|| format!("retrieving layer {layer}"))?;
                ensure!(store.wait(handle, deadline)? == Some(layer), "layer {layer} was not retrieved by the deadline");
            }
            let layers_took = started.elapsed();
            store.finish(handle)?;
            let mut bytes = vec![0u8; block_bytes];
            let mut wrong = 0usize;
            for (prompt_block, &engine_block) in block_ids.iter().enumerate() {
                memory.read(block_at(engine_block), &mut bytes).with_context(|| format!("reading engine block {engine_block} back"))?;
                wrong += bytes.iter().enumerate().filter(|&(offset, &byte)| byte != pattern_byte(prompt_block as u32, offset)).count();
            }
            println!("retrieve: {} bytes in {:.1} ms of layers", cli.blocks as usize * block_bytes, ms(layers_took));
            format!("wrong {wrong} of {} bytes compared", block_ids.len() * block_bytes)
        }
    };
    // The daemon closes its import when the session ends; only then may the memory be freed.
    drop(store);
    if let Err(error) = wait_session_gone(socket, session, timeout) {
        // Kept for good (its queue pairs may still write the memory), or not known gone: the
        // memory is never freed, whatever happens next.
        std::mem::forget(memory);
        return Err(error);
    }
    drop(memory);
    Ok(answer)
}

/// A client's KV memory: GPU memory, or the memfd stand-in.
enum EngineMemory {
    Gpu(DeviceBuffer),
    Memfd { memory: std::sync::Arc<SharedMemory>, view: DmaRegion },
}

impl EngineMemory {
    fn allocate(cli: &Cli, len: usize) -> Result<EngineMemory> {
        Ok(match cli.memory {
            Memory::Cuda => {
                let gpu = Gpu::open(cli.gpu).context("opening the GPU")?;
                EngineMemory::Gpu(DeviceBuffer::allocate(&gpu, len).context("cuMemAlloc of the KV memory")?)
            }
            Memory::Memfd => {
                let memory = SharedMemory::create("gpu-check-kv", len).context("creating the memfd")?;
                // This process's own view, in a DMA space no device uses: plain copies.
                let view = DmaPool::identity().map_shared(&memory).context("mapping the memfd")?;
                EngineMemory::Memfd { memory, view }
            }
        })
    }

    fn write(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        match self {
            EngineMemory::Gpu(buffer) => Ok(buffer.write(offset, bytes)?),
            EngineMemory::Memfd { view, .. } => Ok(view.write(offset, bytes)?),
        }
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        match self {
            EngineMemory::Gpu(buffer) => Ok(buffer.read(offset, out)?),
            EngineMemory::Memfd { view, .. } => Ok(view.read(offset, out)?),
        }
    }

    fn fill(&self, byte: u8) -> Result<()> {
        match self {
            EngineMemory::Gpu(buffer) => Ok(buffer.fill(byte)?),
            EngineMemory::Memfd { view, .. } => Ok(view.fill(0, view.len(), byte)?),
        }
    }

    /// The registration of `len` bytes at `offset`, and what was sent with it.
    fn export(&self, role: Role, offset: usize, len: usize) -> Result<DeviceKvMemory> {
        let export = match self {
            EngineMemory::Gpu(buffer) => {
                let export = buffer.export(offset, len).context("exporting the KV memory (cuIpcGetMemHandle)")?;
                let dma_buf = match (&export.dma_buf, &export.dma_buf_refusal) {
                    (Some(_), _) => "sent".to_string(),
                    (None, Some(reason)) => format!("none ({reason})"),
                    (None, None) => "none".to_string(),
                };
                println!(
                    "{role:?}: CUDA IPC export of {len} bytes at offset {offset} of a {}-byte allocation, dma-buf {dma_buf}",
                    export.allocation_bytes
                );
                DeviceKvMemory::cuda(export)
            }
            EngineMemory::Memfd { memory, .. } => {
                println!("{role:?}: memfd of {} bytes, {len} bytes at offset {offset}", memory.len());
                DeviceKvMemory::memfd(memory, offset as u64, len as u64)?
            }
        };
        Ok(export)
    }
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// Polls the daemon's status until `session` is gone (bounded). A session the daemon kept for
/// good (`kept`: its queue pairs are not known deleted) never goes: an error at once, and the
/// caller must never free the session's memory.
fn wait_session_gone(socket: &Path, session: u64, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut client = Client::connect(socket, timeout).context("connecting for status")?;
    loop {
        let status = client.status().context("status")?;
        match status.clients.iter().find(|client| client.session == session) {
            None => return Ok(()),
            Some(listed) if listed.kept => {
                bail!("the daemon kept session {session} for good (its queue pairs are not known deleted): its memory is never freed")
            }
            Some(_) => {}
        }
        ensure!(Instant::now() < deadline, "the daemon did not end session {session} within {} s", timeout.as_secs());
        std::thread::sleep(Duration::from_millis(10));
    }
}
