//! `--attach SOCKET [--clients N]`: the kv workload through tuttid. The bench runs itself N
//! times as client processes (`--attach-client INDEX`, hidden); each attaches with tuttid's
//! client library (`RemoteKvStore`: its own connection, memfd KV window and queue pairs, no
//! socket traffic per layer) and runs the same phases as the in-process path
//! (`kv_workload::run_phases`), on its own prompt (seed `--seed` + INDEX), with the same byte
//! check. The parent lines the clients up before each phase, so their phases overlap, and
//! aggregates what they report.
//!
//! Parent ↔ client: the client's standard output carries only lines starting with
//! `tutti-bench-client `: `barrier NAME` (then it waits for a line on standard input) and,
//! last, `result JSON`. Its standard error is the parent's, so a client's refusal or failure
//! is printed in its own words. Every wait of the parent is bounded (`STEP_TIMEOUT`); a client
//! whose parent is gone sees end of file on standard input and stops.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use objstore::{KvKind, LayerKvStore, StoreConfig};
use serde_json::{json, Value};
use tutti_cli::outln;
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::protocol::{Hello, StatusReply, BODY_BYTES_MAX};
use tutti_daemon::Client;

use crate::args::{format_size, Cli, OutputFormat};
use crate::kv::{KvPlan, PoolMode};
use crate::kv_workload::{json_report, prompt_tokens, run_phases, KvTarget, LayerPhase};
use crate::{usage, Unusable};

/// The longest the parent waits for every client to reach the next barrier (a phase of a
/// large prompt on a slow device) or to exit.
const STEP_TIMEOUT: Duration = Duration::from_secs(600);
/// The longest wait for one daemon reply (a commit flushes and writes headers with FUA).
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// Entries of each client queue pair: the in-process run's executor depth.
const QUEUE_DEPTH: u32 = 1024;
/// A prepare's fields besides its tokens and block ids (registration, counts), generously.
const PREPARE_HEADER_BYTES: u64 = 64;
/// What a client's protocol lines start with.
const LINE_PREFIX: &str = "tutti-bench-client ";

/// `--attach` (kv.rs dispatches here once the plan is valid).
pub fn run(cli: &Cli, plan: &KvPlan) -> anyhow::Result<()> {
    let socket = cli.attach.as_deref().ok_or_else(|| anyhow!("attach mode without --attach"))?;
    if let Some(spec) = cli.devices.first() {
        return usage(format!(
            "--attach runs through tuttid, which owns the devices: drop --device {spec} (the daemon's --device names them)"
        ));
    }
    if plan.pool != PoolMode::Format {
        return usage("--keep-pool and --retrieve-only name devices the bench opens; with --attach the pool is the daemon's: drop them");
    }
    if cli.emu_timing.is_some() {
        return usage("--emu-timing configures a software controller the bench starts; with --attach it runs inside tuttid: drop it");
    }
    match cli.attach_client {
        Some(index) => run_client(socket, plan, index),
        None => run_parent(socket, plan, cli.clients, cli.output_format),
    }
}

/// A client process: its store, and the engine memory in its window.
struct Attached {
    store: RemoteKvStore,
    layers: u32,
    object_bytes: usize,
}

impl Attached {
    /// Where object (layer, kind) starts inside an engine block (`KvLayout::BlockMajor`:
    /// all layers of a block contiguous, layer l's K then its V).
    fn object_offset(&self, layer: u32, kind: KvKind) -> usize {
        (2 * layer as usize + usize::from(kind == KvKind::Value)) * self.object_bytes
    }
}

impl KvTarget for Attached {
    type Store = RemoteKvStore;

    fn store(&mut self) -> &mut RemoteKvStore {
        &mut self.store
    }

    fn layers(&self) -> u32 {
        self.layers
    }

    fn object_bytes(&self) -> usize {
        self.object_bytes
    }

    fn write_object(&self, layer: u32, kind: KvKind, block: u32, bytes: &[u8]) -> anyhow::Result<()> {
        Ok(self.store.write_block(block, self.object_offset(layer, kind), bytes)?)
    }

    fn read_object(&self, layer: u32, kind: KvKind, block: u32, out: &mut [u8]) -> anyhow::Result<()> {
        Ok(self.store.read_block(block, self.object_offset(layer, kind), out)?)
    }
}

/// The model fingerprint the bench attaches with: a hash of the model's name and geometry, so
/// every client of every run with the same model shares one key space and another model does
/// not (never all zero: the daemon refuses that).
fn model_fingerprint(plan: &KvPlan) -> [u8; 32] {
    let identity = format!("tutti-bench {} {}", plan.model.name, plan.geometry());
    let mut fingerprint = [0u8; 32];
    let mut state = 0xcbf2_9ce4_8422_2325u64;
    for (index, chunk) in fingerprint.chunks_mut(8).enumerate() {
        for byte in identity.bytes().chain([index as u8]) {
            state = (state ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
        chunk.copy_from_slice(&(state | 1).to_le_bytes());
    }
    fingerprint
}

fn unreachable_daemon(socket: &Path, error: impl std::fmt::Display) -> anyhow::Error {
    Unusable(format!("--attach {}: no tuttid answers there ({error}); start one (docs/tuttid.md) or name its --socket", socket.display()))
        .into()
}

fn say(line: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{LINE_PREFIX}{line}")?;
    Ok(stdout.flush()?)
}

/// Tells the parent this client reached `name`, and waits for its go.
fn barrier(name: &str) -> anyhow::Result<()> {
    say(&format!("barrier {name}"))?;
    let mut line = String::new();
    if std::io::stdin().read_line(&mut line)? == 0 {
        return Err(anyhow!("the parent tutti-bench went away before phase {name}"));
    }
    Ok(())
}

fn run_client(socket: &Path, plan: &KvPlan, index: u32) -> anyhow::Result<()> {
    let mut plan = plan.clone();
    plan.seed = plan.seed.wrapping_add(u64::from(index));
    let blocks = u32::try_from(plan.blocks()).map_err(|_| anyhow!("too many blocks"))?;
    let hello = Hello { model_fingerprint: model_fingerprint(&plan), tp_rank: 0, tp_world: 1, client_name: format!("tutti-bench-{index}") };
    let config = RemoteConfig { kv_blocks: blocks, queue_depth: QUEUE_DEPTH, store: StoreConfig::default(), timeout: REPLY_TIMEOUT };
    let mut store =
        RemoteKvStore::connect(socket, &hello, &config).with_context(|| format!("attaching to tuttid at {}", socket.display()))?;
    // The data half runs in this process: it keeps as many layers in flight as the in-process
    // store would (the daemon only reserves and commits).
    store.data_mut().set_layers_in_flight_max(plan.layers_in_flight).context("setting the layers in flight")?;
    let shape = store.data_mut().shape().clone();
    if shape.geometry != plan.geometry() {
        return usage(format!(
            "the daemon's pool is formatted for {}; this run asks for {} ({}): give the model options tuttid was started with",
            shape.geometry,
            plan.geometry(),
            plan.model.name
        ));
    }
    let mut target = Attached { layers: plan.geometry().layers, object_bytes: plan.geometry().object_bytes() as usize, store };
    let tokens = prompt_tokens(plan.seed, plan.blocks() * plan.block_tokens());
    let found = target.store.lookup(&tokens);
    if found > 0 {
        return usage(format!(
            "the daemon's pool already holds {found} blocks of client {index}'s prompt (an earlier run with --seed={}): \
             a store would share them and move no bytes; use another --seed (clients take --seed + their index) or a fresh pool",
            plan.seed.wrapping_sub(u64::from(index))
        ));
    }
    barrier("attached")?;
    let phases = run_phases(&mut target, &plan, &mut barrier)?;
    let result = json!({
        "client": index,
        "seed": plan.seed,
        "session": target.store.hello_reply().session,
        "requests_sent": target.store.requests_sent(),
        "phases": phases.iter().map(LayerPhase::json).collect::<Vec<_>>(),
    });
    say(&format!("result {result}"))
}

/// One line from a client, or its end.
enum Heard {
    Line(String),
    Closed,
}

/// Passes the lines client `index` prints on `output` to `sender` as [`Heard`], from a thread
/// of `builder` (a test fails it); one the system refuses is an error naming the client.
fn listen(
    index: u32,
    output: impl Read + Send + 'static,
    sender: mpsc::Sender<(usize, Heard)>,
    builder: &dyn Fn() -> std::io::Result<std::thread::Builder>,
) -> anyhow::Result<()> {
    let index = index as usize;
    builder()
        .and_then(|builder| {
            builder.spawn(move || {
                for line in BufReader::new(output).lines() {
                    let Ok(line) = line else { break };
                    if let Some(message) = line.strip_prefix(LINE_PREFIX) {
                        if sender.send((index, Heard::Line(message.to_string()))).is_err() {
                            return;
                        }
                    }
                }
                let _ = sender.send((index, Heard::Closed));
            })
        })
        .map(drop)
        .with_context(|| format!("starting the thread that reads client process {index}'s output"))
}

/// The client processes of a run; any still running when this is dropped are killed.
struct Clients {
    children: Vec<Child>,
    inputs: Vec<ChildStdin>,
    heard: Receiver<(usize, Heard)>,
}

impl Clients {
    fn start(clients: u32) -> anyhow::Result<Clients> {
        let program = std::env::current_exe().context("finding this program to run its client processes")?;
        let arguments: Vec<OsString> = std::env::args_os().skip(1).collect();
        let (sender, heard) = mpsc::channel();
        let mut started = Clients { children: Vec::new(), inputs: Vec::new(), heard };
        for index in 0..clients {
            let mut child = Command::new(&program)
                .args(&arguments)
                .arg("--attach-client")
                .arg(index.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .with_context(|| format!("starting client process {index}"))?;
            let input = child.stdin.take().ok_or_else(|| anyhow!("client {index} has no standard input"))?;
            let output = child.stdout.take().ok_or_else(|| anyhow!("client {index} has no standard output"))?;
            started.children.push(child);
            started.inputs.push(input);
            // Refused (a pids cgroup, RLIMIT_NPROC): the run fails naming the client, and
            // `started`, dropped, kills the clients already started.
            listen(index, output, sender.clone(), &|| Ok(std::thread::Builder::new().name(format!("client{index}"))))?;
        }
        Ok(started)
    }

    /// The next line of every client (bounded); a client that ended first fails the run with
    /// its exit status (2 from a client is a refusal of the input, kept as such).
    fn next_lines(&mut self) -> anyhow::Result<Vec<String>> {
        let mut lines: Vec<Option<String>> = vec![None; self.children.len()];
        let deadline = Instant::now() + STEP_TIMEOUT;
        while lines.iter().any(Option::is_none) {
            let timeout = deadline.saturating_duration_since(Instant::now());
            match self.heard.recv_timeout(timeout) {
                Ok((index, Heard::Line(line))) => {
                    if lines[index].replace(line).is_some() {
                        return Err(anyhow!("client {index} went on past a barrier without its go"));
                    }
                }
                // A client ends right after its result: its end may arrive before the others' lines.
                Ok((index, Heard::Closed)) if lines[index].is_some() => {}
                Ok((index, Heard::Closed)) => return Err(self.ended(index)),
                Err(RecvTimeoutError::Timeout) => {
                    let late: Vec<usize> = (0..lines.len()).filter(|&index| lines[index].is_none()).collect();
                    return Err(anyhow!("client process(es) {late:?} reached no barrier within {STEP_TIMEOUT:?}"));
                }
                Err(RecvTimeoutError::Disconnected) => return Err(anyhow!("every client process ended")),
            }
        }
        Ok(lines.into_iter().flatten().collect())
    }

    fn ended(&mut self, index: usize) -> anyhow::Error {
        let status = wait_bounded(&mut self.children[index]);
        match status {
            Ok(status) if status.code() == Some(tutti_cli::exit::UNUSABLE_INPUT.into()) => {
                Unusable(format!("client process {index} refused the run (its message is above)")).into()
            }
            Ok(status) => anyhow!("client process {index} ended early ({status}; its message is above)"),
            Err(error) => error,
        }
    }

    fn go(&mut self) -> anyhow::Result<()> {
        for (index, input) in self.inputs.iter_mut().enumerate() {
            input.write_all(b"go\n").and_then(|()| input.flush()).with_context(|| format!("telling client {index} to go"))?;
        }
        Ok(())
    }

    fn finish(mut self) -> anyhow::Result<()> {
        for (index, child) in self.children.iter_mut().enumerate() {
            let status = wait_bounded(child)?;
            if !status.success() {
                return Err(anyhow!("client process {index} exited with {status} after its result"));
            }
        }
        self.children.clear();
        Ok(())
    }
}

impl Drop for Clients {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn wait_bounded(child: &mut Child) -> anyhow::Result<std::process::ExitStatus> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            return Err(anyhow!("client process {} did not exit within {STEP_TIMEOUT:?}", child.id()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn run_parent(socket: &Path, plan: &KvPlan, clients: u32, output: OutputFormat) -> anyhow::Result<()> {
    let status =
        Client::connect(socket, REPLY_TIMEOUT).and_then(|mut client| client.status()).map_err(|error| unreachable_daemon(socket, error))?;
    // A prepare carries the prompt's tokens and block ids (4 bytes each) in one frame.
    let prepare_bytes = (plan.blocks() * plan.block_tokens() + plan.blocks()).saturating_mul(4).saturating_add(PREPARE_HEADER_BYTES);
    if prepare_bytes > u64::from(BODY_BYTES_MAX) {
        let tokens_max = (u64::from(BODY_BYTES_MAX) - PREPARE_HEADER_BYTES) / 4 * plan.block_tokens() / (plan.block_tokens() + 1);
        return usage(format!(
            "--prompt-tokens={} does not fit one request to tuttid (a frame body is at most {} bytes); accepted with --attach: up to {tokens_max} tokens",
            plan.prompt_tokens,
            BODY_BYTES_MAX
        ));
    }
    // Each client stores its own prompt, in slots of the pool's blocks per slot (`tuttid --format
    // --blocks-per-slot K`): the cached prefix and the rest each round up to whole slots, as
    // in-process (KvPlan::slots_needed).
    let blocks_per_slot = u64::from(status.shape.blocks_per_slot.max(1));
    let slots_per_client = plan.slots_needed(blocks_per_slot);
    let needed = slots_per_client.saturating_mul(u64::from(clients));
    if status.pool.slots < needed {
        return usage(format!(
            "{clients} client(s) x {} blocks need {needed} slots of {blocks_per_slot} block(s) ({slots_per_client} per client: the cached prefix and the rest in slots of their own); the daemon's pool has {}: fewer --clients or --prompt-tokens, or a larger pool",
            plan.blocks(),
            status.pool.slots
        ));
    }
    let mut processes = Clients::start(clients)?;
    let mut results = Vec::new();
    loop {
        let lines = processes.next_lines()?;
        if lines.iter().all(|line| line.starts_with("barrier ")) {
            if lines.iter().any(|line| *line != lines[0]) {
                return Err(anyhow!("client processes out of step: {lines:?}"));
            }
            processes.go()?;
            continue;
        }
        for (index, line) in lines.iter().enumerate() {
            let report = line.strip_prefix("result ").ok_or_else(|| anyhow!("client processes out of step: {lines:?}"))?;
            let report: Value = serde_json::from_str(report).with_context(|| format!("client {index}'s result"))?;
            let phases = report["phases"]
                .as_array()
                .and_then(|phases| phases.iter().map(LayerPhase::from_json).collect::<Option<Vec<_>>>())
                .ok_or_else(|| anyhow!("client {index}'s result has malformed phases"))?;
            results.push((report, phases));
        }
        break;
    }
    processes.finish()?;
    let phases = aggregate(results.iter().map(|(_, phases)| phases).collect())?;
    report(socket, plan, clients, &status, &results, &phases, output)
}

/// One phase over every client.
struct AttachedPhase<'a> {
    clients: Vec<&'a LayerPhase>,
}

fn aggregate(per_client: Vec<&Vec<LayerPhase>>) -> anyhow::Result<Vec<AttachedPhase<'_>>> {
    let count = per_client.first().map_or(0, |phases| phases.len());
    if per_client.iter().any(|phases| phases.len() != count) {
        return Err(anyhow!("client processes reported different numbers of phases"));
    }
    Ok((0..count).map(|phase| AttachedPhase { clients: per_client.iter().map(|phases| &phases[phase]).collect() }).collect())
}

impl AttachedPhase<'_> {
    fn io_bytes(&self) -> u64 {
        self.clients.iter().map(|phase| phase.bytes_per_layer * phase.layer_latencies.len() as u64).sum()
    }

    /// The slowest client's own time in its layers (reported beside the span; not a bound on
    /// when the bytes moved: the clients' phases start at the barrier's release, but each
    /// process is scheduled when the machine gets to it).
    fn layer_time(&self) -> Duration {
        self.clients.iter().map(|phase| phase.layer_time()).max().unwrap_or_default()
    }

    /// From the first client's first layer issue to the last client's last completion, on the
    /// system-wide monotonic clock every client process read: every byte moved within it. Over
    /// the slowest client's own layer time instead, clients that started apart claimed up to
    /// N times the rate. Without every client's span (a clock that could not be read), the sum
    /// of their layer times: never shorter than the time in which some client had a layer in
    /// flight (the union of the clients' spans, however they overlap), so the rate is never
    /// above what that time gives; it is shorter than the span by any gap between the clients'
    /// phases, in which no layer was in flight.
    fn layers_span(&self) -> Duration {
        let spans: Option<Vec<(u64, u64)>> = self.clients.iter().map(|phase| phase.layers_span_ns).collect();
        let span_ns = spans.and_then(|spans| {
            let start = spans.iter().map(|&(start, _)| start).min()?;
            let end = spans.iter().map(|&(_, end)| end).max()?;
            end.checked_sub(start)
        });
        match span_ns {
            Some(nanos) => Duration::from_nanos(nanos),
            None => self.clients.iter().map(|phase| phase.layer_time()).sum(),
        }
    }

    fn wall(&self) -> Duration {
        self.clients.iter().map(|phase| phase.wall).max().unwrap_or_default()
    }

    fn gb_per_second(&self) -> f64 {
        let seconds = self.layers_span().as_secs_f64();
        if seconds > 0.0 {
            self.io_bytes() as f64 / seconds / 1e9
        } else {
            0.0
        }
    }

    fn latencies(&self) -> Vec<Duration> {
        let mut all: Vec<Duration> = self.clients.iter().flat_map(|phase| phase.layer_latencies.iter().copied()).collect();
        all.sort();
        all
    }

    fn verified(&self) -> Option<u64> {
        self.clients.iter().map(|phase| phase.verified).sum()
    }

    fn text(&self) -> String {
        let ms = |duration: Duration| duration.as_secs_f64() * 1e3;
        let first = self.clients[0];
        let sorted = self.latencies();
        let mut lines = vec![
            format!("{} [attach: {} client process(es)]", first.label, self.clients.len()),
            format!(
                "  aggregate: {} blocks, {}, {:.2} GB/s (every client's bytes over {:.3}s from the first client's first layer issue to the last client's last completion; the slowest client's own layer time {:.3}s), wall {:.3}s with prepare/commit",
                self.clients.iter().map(|phase| phase.blocks).sum::<u64>(),
                format_size(self.io_bytes()),
                self.gb_per_second(),
                self.layers_span().as_secs_f64(),
                self.layer_time().as_secs_f64(),
                self.wall().as_secs_f64()
            ),
            format!(
                "  per-layer latency (ms, every client's layers): min={:.3}, max={:.3}, p50={:.3}, p90={:.3}, p99={:.3}",
                ms(sorted.first().copied().unwrap_or_default()),
                ms(sorted.last().copied().unwrap_or_default()),
                ms(LayerPhase::quantile(&sorted, 0.5)),
                ms(LayerPhase::quantile(&sorted, 0.9)),
                ms(LayerPhase::quantile(&sorted, 0.99)),
            ),
        ];
        let per_client: Vec<String> =
            self.clients.iter().enumerate().map(|(index, phase)| format!("{index}:{:.2}GB/s", phase.gb_per_second())).collect();
        lines.push(format!("  clients {}", per_client.join("  ")));
        if let Some(bytes) = self.verified() {
            lines.push(format!("  verify: {} compared byte for byte in the client processes, no mismatch", format_size(bytes)));
        }
        lines.join("\n")
    }

    fn json(&self) -> Value {
        let ns = |duration: Duration| duration.as_nanos() as u64;
        let sorted = self.latencies();
        json!({
            "phase": self.clients[0].label,
            "mode": "attach",
            "clients": self.clients.len(),
            "blocks": self.clients.iter().map(|phase| phase.blocks).sum::<u64>(),
            "io_bytes": self.io_bytes(),
            "bw_bytes": (self.gb_per_second() * 1e9).round() as u64,
            "layers_span_ns": ns(self.layers_span()),
            "layer_time_ns": ns(self.layer_time()),
            "wall_ns": ns(self.wall()),
            "lat_ns": {
                "min": ns(sorted.first().copied().unwrap_or_default()),
                "max": ns(sorted.last().copied().unwrap_or_default()),
                "percentile": {
                    "50.000000": ns(LayerPhase::quantile(&sorted, 0.5)),
                    "90.000000": ns(LayerPhase::quantile(&sorted, 0.9)),
                    "99.000000": ns(LayerPhase::quantile(&sorted, 0.99)),
                },
            },
            "verified_bytes": self.verified(),
            "per_client": self.clients.iter().map(|phase| phase.json()).collect::<Vec<_>>(),
        })
    }
}

fn report(
    socket: &Path,
    plan: &KvPlan,
    clients: u32,
    status: &StatusReply,
    results: &[(Value, Vec<LayerPhase>)],
    phases: &[AttachedPhase<'_>],
    output: OutputFormat,
) -> anyhow::Result<()> {
    let geometry = plan.geometry();
    let requests_sent: Vec<u64> = results.iter().map(|(report, _)| report["requests_sent"].as_u64().unwrap_or_default()).collect();
    let config = json!({
        "workload": "kv",
        "mode": "attach",
        "clients": clients,
        "socket": socket.display().to_string(),
        "daemon_pid": status.daemon_pid,
        "model": plan.model.name,
        "geometry": geometry.to_string(),
        "prompt_tokens": plan.prompt_tokens,
        "block_tokens": geometry.block_tokens,
        "blocks_per_client": plan.blocks(),
        "cached_blocks_per_client": plan.cached_blocks(),
        "hit_rate": plan.hit_rate,
        "verify": plan.verify,
        "seeds": (0..u64::from(clients)).map(|index| plan.seed.wrapping_add(index)).collect::<Vec<_>>(),
        "executor": "cpu",
        "queue_depth": QUEUE_DEPTH,
        "layers_in_flight": plan.layers_in_flight,
        "device": status.devices.iter().map(|device| device.spec.as_str()).collect::<Vec<_>>().join(","),
        "device_description": status.devices.iter().map(|device| device.description.as_str()).collect::<Vec<_>>().join("; "),
        "pool_slots": status.pool.slots,
        // The daemon's (`tuttid --format --blocks-per-slot K`): the run's, as in-process.
        "blocks_per_slot": status.shape.blocks_per_slot,
        "pool_valid_slots_at_start": status.pool.valid_slots,
        "requests_sent_per_client": requests_sent,
    });
    match output {
        OutputFormat::Normal => {
            outln!(
                "tutti-bench: workload=kv mode=attach clients={clients} through tuttid at {} (pid {}), model={} ({}), prompt={} tokens = {} blocks ({} of KV) per client, hit-rate={} ({} cached blocks), verify={}, seeds {}..={}, executor=cpu, layers-in-flight={}",
                socket.display(),
                status.daemon_pid,
                plan.model.name,
                geometry,
                plan.prompt_tokens,
                plan.blocks(),
                format_size(plan.blocks() * geometry.block_bytes()),
                plan.hit_rate,
                plan.cached_blocks(),
                plan.verify,
                plan.seed,
                plan.seed.wrapping_add(u64::from(clients) - 1),
                plan.layers_in_flight
            )?;
            for device in &status.devices {
                outln!("  device {} (the daemon's): {}", device.spec, device.description)?;
            }
            outln!(
                "  pool of {} slots of {} block(s), {} valid at start; each client: its own connection, memfd KV window and queue pair per device; requests to the daemon per client: {:?} (none per layer)",
                status.pool.slots,
                status.shape.blocks_per_slot,
                status.pool.valid_slots,
                requests_sent
            )?;
            for phase in phases {
                outln!("{}", phase.text())?;
            }
        }
        OutputFormat::Json => {
            let out = json_report("attach", Some(clients), config, phases.iter().map(AttachedPhase::json).collect());
            outln!("{}", serde_json::to_string_pretty(&out)?)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_thread_the_system_refuses_is_an_error_naming_the_client() {
        // Goal: where the OS refuses one more thread (a pids cgroup, RLIMIT_NPROC), the run
        // fails naming the client whose output would go unread, instead of panicking in
        // `std::thread::spawn` with the clients left to the unwinding.
        let (sender, _heard) = mpsc::channel();
        let refused = || Err(std::io::Error::from_raw_os_error(libc::EAGAIN));
        let error = listen(3, std::io::empty(), sender.clone(), &refused).unwrap_err();
        assert!(format!("{error:#}").contains("client process 3"), "{error:#}");
        let (sender, heard) = mpsc::channel();
        listen(1, &b"tutti-bench-client barrier x\nnoise\n"[..], sender, &|| Ok(std::thread::Builder::new())).unwrap();
        assert!(matches!(heard.recv_timeout(Duration::from_secs(5)), Ok((1, Heard::Line(line))) if line == "barrier x"));
        assert!(matches!(heard.recv_timeout(Duration::from_secs(5)), Ok((1, Heard::Closed))));
    }

    /// A client's phase as its process reports it: 1 GB in 10 layers of 100 ms, its layers
    /// running from `start_ns` on the system's monotonic clock for one second.
    fn one_gigabyte_in_one_second(start_ns: u64) -> LayerPhase {
        let layers: Vec<Value> = (0..10).map(|layer| json!({"layer": layer, "lat_ns": 100_000_000u64})).collect();
        LayerPhase::from_json(&json!({
            "phase": "retrieve",
            "blocks": 1,
            "bytes_per_layer": 100_000_000u64,
            "layers": layers,
            "wall_ns": 1_000_000_000u64,
            "cpu_user_ns": 0,
            "cpu_system_ns": 0,
            "verified_bytes": null,
            "layers_start_monotonic_ns": start_ns,
            "layers_end_monotonic_ns": start_ns + 1_000_000_000,
        }))
        .expect("a well-formed client report")
    }

    #[test]
    fn clients_that_ran_one_after_the_other_aggregate_to_one_clients_bandwidth() {
        // Goal: the aggregate divides every client's bytes by the span from the first client's
        // first issue to the last client's last completion; over the slowest client's own layer
        // time, two clients that ran back to back (staggered starts) claimed twice the rate.
        let first = one_gigabyte_in_one_second(5_000_000_000);
        let second = one_gigabyte_in_one_second(6_000_000_000);
        let back_to_back = AttachedPhase { clients: vec![&first, &second] };
        assert!(back_to_back.gb_per_second() <= 1.0 + 1e-9, "{} GB/s", back_to_back.gb_per_second());
        // Overlapping exactly, the two did move 2 GB in one second.
        let together = AttachedPhase { clients: vec![&first, &first] };
        assert!((together.gb_per_second() - 2.0).abs() < 1e-9, "{} GB/s", together.gb_per_second());
    }

    #[test]
    fn an_instant_maps_onto_the_system_monotonic_clock() {
        // Goal: the spans client processes report are on CLOCK_MONOTONIC, the clock Instant
        // reads: an Instant taken between two readings maps between them.
        let before = crate::uring::monotonic_now_ns().expect("CLOCK_MONOTONIC reads");
        let at = Instant::now();
        let mapped = crate::kv_workload::monotonic_ns(at).expect("a past Instant maps");
        let after = crate::uring::monotonic_now_ns().expect("CLOCK_MONOTONIC reads");
        assert!(before <= mapped && mapped <= after, "{before} <= {mapped} <= {after}");
    }
}
