//! KV memory the daemon reaches only by copies (docs/tuttid.md, "GPU memory"), through the real
//! daemon and its software controller, with the host-backed stand-in for GPU memory: a client's
//! sealed memfd registered as device memory (`tuttid --device-memory memfd`). The daemon maps
//! it nowhere a controller could translate into: every byte a command moves goes through the
//! `CopiedMemory` copies, the route CUDA IPC memory takes on a GPU machine
//! (`tuttid-gpu-check`). Client processes are this test binary run again
//! (`device_child_entry`). Every wait is bounded.

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use gio_uring::SmBudget;
use nvme_driver::hw::{DmaAllocator, DmaPool, DmaRegion, SharedMemory};
use objstore::{KvRequest, LayerKvStore};
use tutti_daemon::client::{DeviceKvMemory, RemoteConfig, RemoteKvStore};
use tutti_daemon::protocol::{DeviceMemoryKind, Prepare, RegisterMemory, Reply, Request, StatusReply};
use tutti_daemon::{DaemonError, ErrorCode};

mod common;
use common::{hello, spawn_child, wait_bounded, Daemon, WAIT};

const CHILD_ENV: &str = "TUTTID_DEVICE_CHILD";
/// Blocks each prompt stores; engine blocks 0..BLOCKS are stored from, BLOCKS..2*BLOCKS
/// retrieved into.
const BLOCKS: usize = 5;
/// Where the KV range starts in the "allocation" (not at its base, as in a real KV pool carved
/// out of a larger allocation).
const KV_OFFSET_BYTES: u64 = 3 * 4096;
/// The whole "allocation": the KV range and room around it.
const ALLOCATION_BYTES: usize = 2 << 20;

fn device_daemon(directory: &Path) -> Daemon {
    Daemon::start(directory, "emu:mem:64m", &["--format", "--device-memory", "memfd"])
}

fn prompt(seed: u32, block_tokens: u32) -> Vec<u32> {
    (0..(BLOCKS as u32 * block_tokens + 5)).map(|token| token.wrapping_mul(2_246_822_519) ^ seed).collect()
}

fn pattern_byte(seed: u32, block: usize, offset: usize) -> u8 {
    let mixed = (offset as u32).wrapping_mul(0x9E37_79B1) ^ (block as u32).wrapping_mul(0x85EB_CA6B) ^ seed.wrapping_mul(0x27D4_EB2F);
    (mixed >> 11) as u8 ^ (mixed as u8)
}

/// The engine's "device memory": a sealed memfd, and this process's own view of it.
struct EngineMemory {
    memory: Arc<SharedMemory>,
    view: DmaRegion,
}

impl EngineMemory {
    fn new() -> EngineMemory {
        let memory = SharedMemory::create("device-kv", ALLOCATION_BYTES).unwrap();
        // The engine's own mapping, in a DMA space no device uses: plain copies.
        let view = DmaPool::identity().map_shared(&memory).unwrap();
        EngineMemory { memory, view }
    }

    /// The KV range as a registration: from KV_OFFSET_BYTES to the end.
    fn export(&self) -> DeviceKvMemory {
        DeviceKvMemory::memfd(&self.memory, KV_OFFSET_BYTES, ALLOCATION_BYTES as u64 - KV_OFFSET_BYTES).unwrap()
    }

    fn block_at(block: u32, block_bytes: usize) -> usize {
        KV_OFFSET_BYTES as usize + block as usize * block_bytes
    }
}

fn connect(socket: &Path, engine: &EngineMemory) -> RemoteKvStore {
    let config = RemoteConfig { kv_blocks: 2 * BLOCKS as u32, ..RemoteConfig::default() };
    RemoteKvStore::connect_with_device_memory(socket, &hello(0, 1, "device-memory"), &config, &engine.export())
        .expect("attach with device memory")
}

fn layers(store: &mut RemoteKvStore) -> u32 {
    store.data_mut().shape().geometry.layers
}

/// Writes prompt `seed`'s pattern into engine blocks 0..BLOCKS of the device memory, stores and
/// commits them. Returns the blocks stored.
fn store_prompt(store: &mut RemoteKvStore, engine: &EngineMemory, seed: u32) -> usize {
    let tokens = prompt(seed, store.hello_reply().shape.block_tokens);
    let block_bytes = store.block_bytes() as usize;
    for block in 0..BLOCKS {
        let bytes: Vec<u8> = (0..block_bytes).map(|offset| pattern_byte(seed, block, offset)).collect();
        engine.view.write(EngineMemory::block_at(block as u32, block_bytes), &bytes).unwrap();
    }
    let block_ids: Vec<u32> = (0..BLOCKS as u32).collect();
    let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &block_ids }).expect("prepare_store");
    let sent = store.requests_sent();
    let deadline = Instant::now() + WAIT;
    for layer in 0..layers(store) {
        store.store_layer(plan.handle, layer, SmBudget(1)).expect("store_layer");
        assert_eq!(store.wait(plan.handle, deadline).expect("wait"), Some(layer));
    }
    assert_eq!(store.requests_sent(), sent, "the per-layer path sent requests to the daemon");
    store.commit_store(plan.handle).expect("commit")
}

/// Retrieves prompt `seed` into engine blocks 2B-1 down to B of the device memory (zeroed
/// first) and counts the bytes that differ from the pattern.
fn retrieve_prompt(store: &mut RemoteKvStore, engine: &EngineMemory, seed: u32) -> usize {
    let tokens = prompt(seed, store.hello_reply().shape.block_tokens);
    assert_eq!(store.lookup(&tokens), BLOCKS, "the whole prompt is cached");
    let block_bytes = store.block_bytes() as usize;
    let block_ids: Vec<u32> = (0..BLOCKS as u32).map(|i| 2 * BLOCKS as u32 - 1 - i).collect();
    for &block in &block_ids {
        engine.view.fill(EngineMemory::block_at(block, block_bytes), block_bytes, 0).unwrap();
    }
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &block_ids }).expect("prepare_retrieve");
    let deadline = Instant::now() + WAIT;
    for layer in 0..layers(store) {
        store.retrieve_layer(handle, layer, SmBudget(1)).expect("retrieve_layer");
        assert_eq!(store.wait(handle, deadline).expect("wait"), Some(layer));
    }
    store.finish(handle).expect("finish");
    let mut wrong = 0;
    let mut bytes = vec![0u8; block_bytes];
    for (prompt_block, &engine_block) in block_ids.iter().enumerate() {
        engine.view.read(EngineMemory::block_at(engine_block, block_bytes), &mut bytes).unwrap();
        wrong += bytes.iter().enumerate().filter(|&(offset, &byte)| byte != pattern_byte(seed, prompt_block, offset)).count();
    }
    wrong
}

/// A client process, selected by `TUTTID_DEVICE_CHILD` = "ROLE SOCKET SEED"; a no-op as an
/// ordinary test. Prints one `CHILD ...` line.
#[test]
fn device_child_entry() {
    let Ok(role) = std::env::var(CHILD_ENV) else { return };
    let words: Vec<&str> = role.split(' ').collect();
    let socket = Path::new(words[1]);
    let seed: u32 = words[2].parse().unwrap();
    let engine = EngineMemory::new();
    let mut store = connect(socket, &engine);
    assert!(store.write_block(0, 0, &[1]).is_err(), "the window holds no KV blocks: the engine copies its own");
    match words[0] {
        "store" => println!("CHILD stored {}", store_prompt(&mut store, &engine, seed)),
        "retrieve" => println!("CHILD wrong {}", retrieve_prompt(&mut store, &engine, seed)),
        other => panic!("unknown child role {other}"),
    }
}

fn run_child(socket: &Path, role: &str, seed: u32) -> String {
    let mut child = spawn_child("device_child_entry", CHILD_ENV, &format!("{role} {} {seed}", socket.display()));
    let mut output = String::new();
    use std::io::Read;
    child.stdout.take().unwrap().read_to_string(&mut output).unwrap();
    let status = wait_bounded(&mut child);
    assert!(status.success(), "child {role} exited with {status}: {output}");
    let line = output.lines().find_map(|line| line.find("CHILD ").map(|at| line[at + 6..].to_string()));
    line.unwrap_or_else(|| panic!("child {role} printed no CHILD line: {output}"))
}

fn status_when(daemon: &Daemon, what: &str, done: impl Fn(&StatusReply) -> bool) -> StatusReply {
    let deadline = Instant::now() + WAIT;
    loop {
        let status = daemon.client().status().unwrap();
        if done(&status) {
            return status;
        }
        assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}: {status:?}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn assert_idle(status: &StatusReply) {
    assert!(status.clients.is_empty(), "sessions left: {:?}", status.clients);
    assert_eq!(status.leaked_queue_pairs, 0, "{status:?}");
    assert_eq!((status.pool.pinned_slots, status.pool.writing_slots), (0, 0), "{status:?}");
}

#[test]
fn device_memory_round_trips_byte_exact_across_processes() {
    // Goal: process A stores a prompt from its device memory (a memfd the daemon reaches only by
    // copies), process B retrieves it into other blocks of its own device memory, byte-exact;
    // no request per layer; then nothing is held, and the daemon drains with exit 0.
    let directory = tempfile::tempdir().unwrap();
    let daemon = device_daemon(directory.path());
    assert_eq!(run_child(&daemon.socket, "store", 7), format!("stored {BLOCKS}"));
    assert_eq!(run_child(&daemon.socket, "retrieve", 7), "wrong 0");
    assert_idle(&status_when(&daemon, "both sessions gone", |status| status.clients.is_empty()));
    let (exit, stderr) = daemon.terminate();
    assert!(exit.success(), "tuttid exited with {exit}: {stderr}");
}

fn refusal(client: &mut tutti_daemon::Client, request: &Request, fds: &[std::os::fd::BorrowedFd<'_>]) -> (ErrorCode, String) {
    match client.call_with_fds(request, fds) {
        Err(DaemonError::Remote { code, message }) => (code, message),
        other => panic!("{:?} was not refused: {other:?}", request.kind()),
    }
}

fn refused_with(refusal: (ErrorCode, String), code: ErrorCode, says: &str) {
    assert_eq!(refusal.0, code, "{}", refusal.1);
    assert!(refusal.1.contains(says), "{:?} should say {says:?}", refusal.1);
}

fn raw_client(daemon: &Daemon, name: &str) -> tutti_daemon::Client {
    let mut client = daemon.client();
    client.hello(&hello(0, 1, name)).unwrap();
    client
}

#[test]
fn bad_device_memory_registrations_get_typed_errors_and_the_daemon_serves_on() {
    // Goal: every bad registration of device memory is refused with its own typed error and
    // holds nothing: no or the wrong descriptor, a memfd smaller than claimed, a range outside
    // the allocation, KV blocks that do not fit, a kind this daemon does not import, a range
    // overlapping one of the session (BadRequest) or of another session (NotYours: memory
    // another client registered), a registration after the queue pairs, prepares naming blocks
    // outside it or another session's registration; a session's end gives its range back; and
    // a client then stores and retrieves through device memory byte-exact.
    let directory = tempfile::tempdir().unwrap();
    let daemon = device_daemon(directory.path());
    let engine = EngineMemory::new();
    let good = engine.export();
    let register = |export: &DeviceKvMemory, kv_blocks: u32| Request::RegisterDeviceMemory(export.request(kv_blocks));

    let mut unattached = daemon.client();
    refused_with(refusal(&mut unattached, &register(&good, 1), &[engine.memory.fd()]), ErrorCode::NotAttached, "Hello");

    let mut raw = raw_client(&daemon, "raw");
    refused_with(refusal(&mut raw, &register(&good, 1), &[]), ErrorCode::BadRequest, "one descriptor");
    let file = tempfile::tempfile().unwrap();
    file.set_len(ALLOCATION_BYTES as u64).unwrap();
    refused_with(refusal(&mut raw, &register(&good, 1), &[file.as_fd()]), ErrorCode::BadRequest, "device memory descriptor");
    let small = SharedMemory::create("too-small", 64 << 10).unwrap();
    refused_with(refusal(&mut raw, &register(&good, 1), &[small.fd()]), ErrorCode::BadRequest, "device memory descriptor");
    let outside = DeviceKvMemory { offset_bytes: ALLOCATION_BYTES as u64 - 4096, length_bytes: 8192, ..engine.export() };
    refused_with(refusal(&mut raw, &register(&outside, 0), &[engine.memory.fd()]), ErrorCode::BadRequest, "0 KV blocks");
    let outside = DeviceKvMemory { offset_bytes: u64::MAX - 4095, length_bytes: 1 << 20, ..engine.export() };
    refused_with(refusal(&mut raw, &register(&outside, 1), &[engine.memory.fd()]), ErrorCode::BadRequest, "do not lie in the allocation");
    refused_with(refusal(&mut raw, &register(&good, 1 << 20), &[engine.memory.fd()]), ErrorCode::BadRequest, "do not fit");
    let cuda = DeviceKvMemory { kind: DeviceMemoryKind::CudaIpc, descriptor: None, ..engine.export() };
    refused_with(refusal(&mut raw, &register(&cuda, 1), &[]), ErrorCode::Unsupported, "not CudaIpc");
    let nothing_held = daemon.client().status().unwrap();
    assert_eq!(nothing_held.clients.iter().find(|client| client.name == "raw").unwrap().registrations, 0);

    // A real registration of the first half; the same bytes again overlap, the second half not.
    let half = (ALLOCATION_BYTES / 2) as u64;
    let first = DeviceKvMemory { offset_bytes: 0, length_bytes: half, ..engine.export() };
    let Ok((Reply::Registered(registered), _)) = raw.call_with_fds(&register(&first, 4), &[engine.memory.fd()]) else {
        panic!("registering device memory")
    };
    let overlapping = DeviceKvMemory { offset_bytes: half - 4096, length_bytes: 1 << 16, ..engine.export() };
    refused_with(refusal(&mut raw, &register(&overlapping, 1), &[engine.memory.fd()]), ErrorCode::BadRequest, "of this session");
    let second = DeviceKvMemory { offset_bytes: half, length_bytes: half, ..engine.export() };
    assert!(matches!(raw.call_with_fds(&register(&second, 4), &[engine.memory.fd()]), Ok((Reply::Registered(_), _))));
    // Another session: the same memory is someone else's.
    let mut other = raw_client(&daemon, "other");
    refused_with(refusal(&mut other, &register(&first, 1), &[engine.memory.fd()]), ErrorCode::NotYours, "another client registered");
    let tokens = prompt(1, daemon.client().status().unwrap().shape.block_tokens);
    let prepare = |registration, block_ids: Vec<u32>| {
        Request::PrepareStore(Prepare { registration, tokens: tokens.clone(), block_ids, first_block: 0 })
    };
    refused_with(refusal(&mut other, &prepare(registered.registration, vec![0]), &[]), ErrorCode::NotYours, "not one this session made");
    refused_with(refusal(&mut raw, &prepare(registered.registration, vec![0, 4]), &[]), ErrorCode::BadRequest, "outside registration");
    let held = daemon.client().status().unwrap();
    assert_eq!(held.clients.iter().find(|client| client.name == "raw").unwrap().registrations, 2);

    // The raw session ends: its ranges are free for another session.
    drop(raw);
    status_when(&daemon, "the raw session gone", |status| !status.clients.iter().any(|client| client.name == "raw"));
    assert!(matches!(other.call_with_fds(&register(&first, 4), &[engine.memory.fd()]), Ok((Reply::Registered(_), _))));
    drop(other);
    status_when(&daemon, "the other session gone", |status| status.clients.is_empty());

    // A store with device memory: registering more after its queue pairs exist is refused; it
    // stores and retrieves byte-exact.
    let mut store = connect(&daemon.socket, &engine);
    let spare = SharedMemory::create("spare", 1 << 20).unwrap();
    let late = DeviceKvMemory::memfd(&spare, 0, 1 << 20).unwrap();
    refused_with(refusal(store.client(), &register(&late, 1), &[spare.fd()]), ErrorCode::BadRequest, "before AttachQueues");
    assert_eq!(store_prompt(&mut store, &engine, 3), BLOCKS);
    assert_eq!(retrieve_prompt(&mut store, &engine, 3), 0, "wrong bytes retrieved");
    drop(store);
    assert_idle(&status_when(&daemon, "the store's session gone", |status| status.clients.is_empty()));
}

#[test]
fn a_window_memfd_is_nobody_elses_device_memory_or_window() {
    // Goal: windows take part in the overlap check with device memory, keyed alike (the memfd's
    // device and inode), so one memfd is never two registrations at once: client a's window M
    // registered by client b as device memory is NotYours (it used to be Registered, and b's
    // retrieves would have written a's rings and mapping table), by client c as its own window
    // NotYours too, by a itself as device memory BadRequest (its own registration); a device
    // memfd D of b's is nobody's window either. A session's end gives its memfd back.
    let directory = tempfile::tempdir().unwrap();
    let daemon = device_daemon(directory.path());
    let window_bytes = 1u64 << 20;
    let window = SharedMemory::create("window", window_bytes as usize).unwrap();
    let as_window = Request::RegisterMemory(RegisterMemory { window_bytes, kv_blocks: 0 });
    let as_device = |memory: &Arc<SharedMemory>| {
        Request::RegisterDeviceMemory(DeviceKvMemory::memfd(memory, 0, memory.len() as u64).unwrap().request(1))
    };
    let registered = |client: &mut tutti_daemon::Client, request: &Request, memory: &Arc<SharedMemory>| match client
        .call_with_fds(request, &[memory.fd()])
    {
        Ok((Reply::Registered(_), _)) => {}
        other => panic!("{:?} was not registered: {other:?}", request.kind()),
    };

    let mut a = raw_client(&daemon, "a");
    registered(&mut a, &as_window, &window);
    let mut b = raw_client(&daemon, "b");
    refused_with(refusal(&mut b, &as_device(&window), &[window.fd()]), ErrorCode::NotYours, "another client registered");
    let mut c = raw_client(&daemon, "c");
    refused_with(refusal(&mut c, &as_window, &[window.fd()]), ErrorCode::NotYours, "another client registered");
    refused_with(refusal(&mut a, &as_device(&window), &[window.fd()]), ErrorCode::BadRequest, "of this session");
    refused_with(refusal(&mut a, &as_window, &[window.fd()]), ErrorCode::BadRequest, "of this session");

    // The other way round: b's device memory is not c's window.
    let device = SharedMemory::create("device", window_bytes as usize).unwrap();
    registered(&mut b, &as_device(&device), &device);
    refused_with(refusal(&mut c, &as_window, &[device.fd()]), ErrorCode::NotYours, "another client registered");
    let held = daemon.client().status().unwrap();
    let registrations = |name: &str| held.clients.iter().find(|client| client.name == name).unwrap().registrations;
    assert_eq!((registrations("a"), registrations("b"), registrations("c")), (1, 1, 0));

    // a's session ends: its window is free for b's device memory, b's for c's window.
    drop(a);
    status_when(&daemon, "a's session gone", |status| !status.clients.iter().any(|client| client.name == "a"));
    registered(&mut b, &as_device(&window), &window);
    drop(b);
    status_when(&daemon, "b's session gone", |status| !status.clients.iter().any(|client| client.name == "b"));
    registered(&mut c, &as_window, &device);
    drop(c);
    assert_idle(&status_when(&daemon, "every session gone", |status| status.clients.is_empty()));
}

#[test]
fn device_memory_is_refused_where_the_daemon_does_not_import_it() {
    // Goal: a daemon started without --device-memory refuses a registration as Unsupported,
    // naming the option, and then attaches the same client with host memory as ever.
    let directory = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(directory.path(), "emu:mem:64m", &["--format"]);
    let engine = EngineMemory::new();
    let config = RemoteConfig { kv_blocks: 2 * BLOCKS as u32, ..RemoteConfig::default() };
    let refused = RemoteKvStore::connect_with_device_memory(&daemon.socket, &hello(0, 1, "refused"), &config, &engine.export());
    let message = refused.err().expect("device memory refused").to_string();
    assert!(message.contains("Unsupported") && message.contains("--device-memory"), "{message}");
    let mut store = RemoteKvStore::connect(&daemon.socket, &hello(0, 1, "host"), &config).expect("host memory attaches");
    assert_eq!(layers(&mut store), 2);
}
