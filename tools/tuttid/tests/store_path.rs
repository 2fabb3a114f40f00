//! The store path through tuttid, across processes: client processes (this test binary run
//! again, see `store_child_entry`) store and retrieve KV blocks through their own queue pairs
//! while the daemon owns the pool; tensor-parallel ranks stay apart and the scheduler's
//! all-ranks lookup sees a prefix only once every rank has it; a client killed with SIGKILL
//! loses only its own uncommitted work; bad requests get typed errors; a stray command is
//! refused by the software controller. Every wait is bounded.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use std::os::fd::AsFd;

use gio_uring::SmBudget;
use nvme_driver::hw::SharedMemory;
use nvme_driver::spec::status::{codes, StatusCodeType};
use nvme_driver::spec::NvmeStatus;
use nvme_driver::{DataSegment, DmaAllocator, Iova, Lba, NamespaceId, NvmeError};
use objstore::{KvRequest, LayerKvStore, Transferred};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::protocol::{AttachQueues, Commit, Prepare, RegisterMemory, Reply, Request, RingOffsets, StatusReply, PREPARE_BLOCKS_MAX};
use tutti_daemon::{DaemonError, ErrorCode};

mod common;
use common::{hello, pattern_byte, spawn_child, wait_bounded, Daemon, WAIT};

const CHILD_ENV: &str = "TUTTID_STORE_CHILD";
/// Blocks each test prompt stores.
const BLOCKS: usize = 6;

fn memory_daemon(directory: &Path) -> Daemon {
    Daemon::start(directory, "emu:mem:64m", &["--format"])
}

/// The tokens of prompt `seed`: `BLOCKS` full blocks of `block_tokens` and a partial one.
fn prompt(seed: u32, block_tokens: u32) -> Vec<u32> {
    common::prompt(seed, BLOCKS, block_tokens)
}

fn connect(socket: &Path, rank: u32, world: u32) -> RemoteKvStore {
    let config = RemoteConfig { kv_blocks: 2 * BLOCKS as u32, ..RemoteConfig::default() };
    RemoteKvStore::connect(socket, &hello(rank, world, &format!("rank-{rank}-of-{world}")), &config).expect("attach a remote store")
}

fn layers(store: &mut RemoteKvStore) -> u32 {
    store.data_mut().shape().geometry.layers
}

/// Stores prompt `seed`'s blocks from engine blocks 0..BLOCKS with rank `rank`'s pattern,
/// layer by layer; checks no request went to the daemon per layer. Returns the plan's new
/// blocks; commits unless `commit` is false (then returns with the store prepared).
fn store_prompt(store: &mut RemoteKvStore, seed: u32, rank: u32, stop_before: Option<&str>) -> usize {
    let plan = prepare_prompt(store, seed, rank);
    if stop_before == Some("prepared") {
        return plan.new_blocks;
    }
    let sent = store.requests_sent();
    let deadline = Instant::now() + WAIT;
    for layer in 0..layers(store) {
        store.store_layer(plan.handle, layer, SmBudget(1)).expect("store_layer");
        if stop_before == Some("layer-in-flight") {
            return plan.new_blocks;
        }
        assert_eq!(store.wait(plan.handle, deadline).expect("wait"), Some(layer));
    }
    assert_eq!(store.requests_sent(), sent, "the per-layer path sent requests to the daemon");
    assert_eq!(store.commit_store(plan.handle).expect("commit"), plan.new_blocks);
    plan.new_blocks
}

/// Writes prompt `seed`'s blocks into engine blocks 0..BLOCKS and prepares their store.
fn prepare_prompt(store: &mut RemoteKvStore, seed: u32, rank: u32) -> objstore::StorePlan {
    let block_tokens = store.hello_reply().shape.block_tokens;
    let tokens = prompt(seed, block_tokens);
    let block_bytes = store.block_bytes() as usize;
    for block in 0..BLOCKS {
        let bytes: Vec<u8> = (0..block_bytes).map(|offset| pattern_byte(seed, rank, block, offset)).collect();
        store.write_block(block as u32, 0, &bytes).unwrap();
    }
    let block_ids: Vec<u32> = (0..BLOCKS as u32).collect();
    store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &block_ids }).expect("prepare_store")
}

/// The store's queue ids as one word (`3,7`).
fn queue_list(store: &RemoteKvStore) -> String {
    store.queue_ids().iter().map(u16::to_string).collect::<Vec<_>>().join(",")
}

/// Looks prompt `seed` up and retrieves it into engine blocks in reverse order; checks every
/// byte against rank `rank`'s pattern and that no request went to the daemon per layer.
fn retrieve_prompt(store: &mut RemoteKvStore, seed: u32, rank: u32) -> usize {
    let block_tokens = store.hello_reply().shape.block_tokens;
    let tokens = prompt(seed, block_tokens);
    let cached = store.lookup(&tokens);
    assert_eq!(cached, BLOCKS, "rank {rank}: the whole prompt is cached");
    let block_bytes = store.block_bytes() as usize;
    // Engine blocks 2B-1 down to B: other blocks than the ones stored from, cleared first.
    let block_ids: Vec<u32> = (0..BLOCKS as u32).map(|i| 2 * BLOCKS as u32 - 1 - i).collect();
    for &block in &block_ids {
        store.write_block(block, 0, &vec![0u8; block_bytes]).unwrap();
    }
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &block_ids }).expect("prepare_retrieve");
    let sent = store.requests_sent();
    let deadline = Instant::now() + WAIT;
    for layer in 0..layers(store) {
        store.retrieve_layer(handle, layer, SmBudget(1)).expect("retrieve_layer");
        assert_eq!(store.wait(handle, deadline).expect("wait"), Some(layer));
    }
    assert_eq!(store.requests_sent(), sent, "the per-layer path sent requests to the daemon");
    store.finish(handle).expect("finish");
    let mut wrong = 0usize;
    let mut bytes = vec![0u8; block_bytes];
    for (prompt_block, &engine_block) in block_ids.iter().enumerate() {
        store.read_block(engine_block, 0, &mut bytes).unwrap();
        wrong += bytes.iter().enumerate().filter(|&(offset, &byte)| byte != pattern_byte(seed, rank, prompt_block, offset)).count();
    }
    assert_eq!(wrong, 0, "rank {rank}: {wrong} wrong bytes retrieved");
    BLOCKS
}

/// A client process's part, selected by `TUTTID_STORE_CHILD` = "ROLE SOCKET RANK WORLD SEED";
/// a no-op as an ordinary test. Prints one `CHILD ...` line when done (or parked).
#[test]
fn store_child_entry() {
    let Ok(role) = std::env::var(CHILD_ENV) else { return };
    let words: Vec<&str> = role.split(' ').collect();
    let socket = Path::new(words[1]);
    let (rank, world, seed): (u32, u32, u32) = (words[2].parse().unwrap(), words[3].parse().unwrap(), words[4].parse().unwrap());
    let mut store = connect(socket, rank, world);
    match words[0] {
        "store" => println!("CHILD stored {}", store_prompt(&mut store, seed, rank, None)),
        "retrieve" => println!("CHILD retrieved {}", retrieve_prompt(&mut store, seed, rank)),
        "lookup" => {
            let tokens = prompt(seed, store.hello_reply().shape.block_tokens);
            println!("CHILD cached {}", store.lookup(&tokens));
        }
        "scheduler" => {
            let tokens = prompt(seed, store.hello_reply().shape.block_tokens);
            println!("CHILD all-ranks {}", store.lookup_all_ranks(&tokens, 0).unwrap());
        }
        "store-on-queues" => {
            let stored = store_prompt(&mut store, seed, rank, None);
            println!("CHILD stored {stored} on {}", queue_list(&store));
        }
        "outlive-lease" => {
            // Prepares a store, says which queues it has, then waits (bounded) for the parent's
            // go file: past its lease by then, it runs the store's layers on its queues as an
            // engine that did not notice would, and tries to commit.
            let plan = prepare_prompt(&mut store, seed, rank).handle;
            println!("CHILD parked on {}", queue_list(&store));
            use std::io::Write;
            std::io::stdout().flush().unwrap();
            let go = socket.with_file_name(format!("go-{seed}"));
            let deadline = Instant::now() + WAIT;
            while !go.exists() {
                assert!(Instant::now() < deadline, "no go file within {WAIT:?}");
                std::thread::sleep(Duration::from_millis(10));
            }
            let mut layers_done = 0;
            for layer in 0..layers(&mut store) {
                store.store_layer(plan, layer, SmBudget(1)).expect("store_layer");
                if store.wait(plan, Instant::now() + WAIT).expect("wait") == Some(layer) {
                    layers_done += 1;
                }
            }
            let commit = if store.commit_store(plan).is_ok() { "committed" } else { "refused" };
            println!("CHILD rang {layers_done}-layers-{commit}");
            // Then it closes its store (and with it the socket) and runs on, parked until the
            // parent kills it (bounded).
            drop(store);
            println!("CHILD closed");
            std::io::stdout().flush().unwrap();
            std::thread::sleep(WAIT);
        }
        stop @ ("prepared" | "layer-in-flight") => {
            store_prompt(&mut store, seed, rank, Some(stop));
            println!("CHILD parked");
            use std::io::Write;
            std::io::stdout().flush().unwrap();
            // Parked until the parent kills it; bounded so a lost parent cannot leave it behind.
            std::thread::sleep(WAIT);
        }
        other => panic!("unknown child role {other}"),
    }
}

/// Runs a client process to its `CHILD` line and its exit; returns the line's last word.
fn run_child(socket: &Path, role: &str, rank: u32, world: u32, seed: u32) -> String {
    let mut child = start_child(socket, role, rank, world, seed);
    let answer = child_line(&mut child);
    let status = wait_bounded(&mut child);
    assert!(status.success(), "child {role} rank {rank}/{world} exited with {status}");
    answer
}

fn start_child(socket: &Path, role: &str, rank: u32, world: u32, seed: u32) -> Child {
    spawn_child("store_child_entry", CHILD_ENV, &format!("{role} {} {rank} {world} {seed}", socket.display()))
}

/// The last word of the child's `CHILD` line (bounded: a child that dies first fails the test).
fn child_line(child: &mut Child) -> String {
    child_lines(child).recv_timeout(WAIT).expect("the child printed no CHILD line")
}

/// The last word of each of the child's `CHILD` lines, as they come.
fn child_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let stdout = child.stdout.take().unwrap();
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // libtest may print "test store_child_entry ... " before it on the same line.
            match line.find("CHILD ").map(|at| &line[at + "CHILD ".len()..]) {
                Some(rest) => {
                    let _ = sender.send(rest.rsplit(' ').next().unwrap_or_default().to_string());
                }
                // The child's own test output (a failure's message): shown with the parent's.
                None => eprintln!("child: {line}"),
            }
        }
    });
    receiver
}

fn status(daemon: &Daemon) -> StatusReply {
    daemon.client().status().unwrap()
}

/// Polls status until `done` holds (bounded), and returns it.
fn status_when(daemon: &Daemon, what: &str, done: impl Fn(&StatusReply) -> bool) -> StatusReply {
    let deadline = Instant::now() + WAIT;
    loop {
        let status = status(daemon);
        if done(&status) {
            return status;
        }
        assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}: {status:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Nothing held: no session but the status query's, no pinned or writing slot, no request in
/// flight, no leaked queue pair.
fn assert_idle(status: &StatusReply) {
    assert!(status.clients.is_empty(), "sessions left: {:?}", status.clients);
    // Leaked pairs first: a session whose queue deletion failed keeps its reservations on
    // purpose, and the pinned/writing counts would then hide the cause.
    assert_eq!(status.leaked_queue_pairs, 0, "{status:?}");
    assert_eq!((status.pool.pinned_slots, status.pool.writing_slots), (0, 0), "{status:?}");
}

#[test]
fn blocks_stored_by_one_process_are_retrieved_byte_exact_by_another() {
    // Goal: process A stores a prompt's blocks (a pattern per block, layer and byte) through
    // its own queue pair and commits; process B (same rank, another process) finds them all
    // and retrieves them byte-exact into other engine blocks; neither sends a request per
    // layer; afterwards nothing is pinned or held and both sessions are gone.
    let directory = tempfile::tempdir().unwrap();
    let daemon = memory_daemon(directory.path());
    assert_eq!(run_child(&daemon.socket, "store", 0, 1, 11), BLOCKS.to_string());
    let after_store = status(&daemon);
    assert_eq!(after_store.pool.cached_blocks, BLOCKS as u64);
    assert_eq!(run_child(&daemon.socket, "retrieve", 0, 1, 11), BLOCKS.to_string());
    assert_idle(&status_when(&daemon, "both sessions gone", |status| status.clients.is_empty()));
}

#[test]
fn a_client_killed_before_commit_leaves_nothing_behind() {
    // Goal: a client killed with SIGKILL after prepare_store (its slots reserved) and one killed
    // with a layer in flight: the daemon notices (EOF), deletes its queue pairs (none leaked),
    // releases its reservation (no slot pinned or being written), nothing of its store is
    // visible, and another client then stores the same prompt in full and reads it back. The
    // daemon serves 3 clients, so its controller has 3 + 2 queue pairs: had the four killed
    // clients' pairs not been deleted, the later clients could not attach.
    let directory = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(directory.path(), "emu:mem:64m", &["--format", "--clients-max", "3"]);
    for (round, stop) in ["prepared", "layer-in-flight", "prepared", "layer-in-flight"].into_iter().enumerate() {
        let seed = 20 + round as u32;
        let mut child = start_child(&daemon.socket, stop, 0, 1, seed);
        assert_eq!(child_line(&mut child), "parked", "{stop}");
        let held = status(&daemon);
        assert_eq!(held.clients.len(), 1, "{stop}: {held:?}");
        assert_eq!((held.clients[0].queue_pairs, held.clients[0].requests_in_flight), (1, 1), "{stop}");
        assert!(held.pool.writing_slots > 0, "{stop}: the store's slots are reserved: {:?}", held.pool);
        child.kill().unwrap();
        let _ = child.wait();
        let after = status_when(&daemon, "the killed client's session ends", |status| status.clients.is_empty());
        assert_idle(&after);
        assert_eq!(after.pool.cached_blocks, (round * BLOCKS) as u64, "{stop}: nothing of the killed store is visible");
        assert_eq!(run_child(&daemon.socket, "lookup", 0, 1, seed), "0", "{stop}");
        assert_eq!(run_child(&daemon.socket, "store", 0, 1, seed), BLOCKS.to_string(), "{stop}: stored again, in full");
        assert_eq!(run_child(&daemon.socket, "retrieve", 0, 1, seed), BLOCKS.to_string(), "{stop}");
    }
    assert_idle(&status_when(&daemon, "all sessions gone", |status| status.clients.is_empty()));
}

#[test]
fn ranks_store_apart_and_the_scheduler_sees_a_prefix_only_on_every_rank() {
    // Goal: for TP 2 and TP 4, each rank's process stores the same prompt (its own slice of
    // the KV heads, its own pattern); before the last rank has stored, the scheduler process's
    // all-ranks lookup answers 0 and a rank that has not stored finds nothing of the others'
    // (rank 1's lookup of rank 0's prompt is 0); after, it answers the whole prompt and each
    // rank retrieves its own bytes exactly.
    let directory = tempfile::tempdir().unwrap();
    let daemon = memory_daemon(directory.path());
    for world in [2u32, 4] {
        let seed = 30 + world;
        for rank in 0..world {
            assert_eq!(run_child(&daemon.socket, "scheduler", 0, world, seed), "0", "TP {world} before rank {rank} stored");
            assert_eq!(run_child(&daemon.socket, "lookup", rank, world, seed), "0", "TP {world} rank {rank} sees others' blocks");
            assert_eq!(run_child(&daemon.socket, "store", rank, world, seed), BLOCKS.to_string());
        }
        for rank in 0..world {
            // The scheduler may attach with any rank of the world.
            assert_eq!(run_child(&daemon.socket, "scheduler", rank, world, seed), BLOCKS.to_string(), "TP {world}");
            assert_eq!(run_child(&daemon.socket, "retrieve", rank, world, seed), BLOCKS.to_string(), "TP {world} rank {rank}");
        }
        // Another world size of the same model sees none of it.
        assert_eq!(run_child(&daemon.socket, "lookup", 0, world * 2, seed), "0");
    }
    assert_idle(&status_when(&daemon, "all sessions gone", |status| status.clients.is_empty()));
}

/// A raw connection attached as rank 0 of 1.
fn raw_client(daemon: &Daemon) -> tutti_daemon::Client {
    let mut client = daemon.client();
    client.hello(&hello(0, 1, "raw")).unwrap();
    client
}

/// The code of the daemon's refusal of `request` (sent with `fds`).
fn refusal(client: &mut tutti_daemon::Client, request: &Request, fds: &[std::os::fd::BorrowedFd<'_>]) -> (ErrorCode, String) {
    match client.call_with_fds(request, fds) {
        Err(DaemonError::Remote { code, message }) => (code, message),
        other => panic!("{:?} was not refused: {other:?}", request.kind()),
    }
}

#[test]
fn requests_naming_what_the_session_does_not_own_are_refused_and_the_daemon_serves_on() {
    // Goal: another session's handle (release, commit), another session's registration
    // (attach, prepare), engine blocks outside the session's registration, rings outside its
    // window, and window descriptors that are not a sealed memfd of the claimed size are each
    // a typed error; the session that owns the request then completes and commits it.
    let directory = tempfile::tempdir().unwrap();
    let daemon = memory_daemon(directory.path());
    let mut owner = connect(&daemon.socket, 0, 1);
    let block_tokens = owner.hello_reply().shape.block_tokens;
    let tokens = prompt(50, block_tokens);
    let block_ids: Vec<u32> = (0..BLOCKS as u32).collect();
    let plan = owner.prepare_store(&KvRequest { tokens: &tokens, block_ids: &block_ids }).unwrap();
    let handle = plan.handle.to_bits();
    let mut other = raw_client(&daemon);
    let not_yours = |(code, message): (ErrorCode, String)| assert_eq!(code, ErrorCode::NotYours, "{message}");
    let release = Request::Release { handle, transferred: Transferred::default(), corrupt_blocks: Vec::new() };
    not_yours(refusal(&mut other, &release, &[]));
    not_yours(refusal(&mut other, &Request::Commit(Commit { handle, payload_crcs: None, transferred: Transferred::default() }), &[]));
    let rings = vec![RingOffsets { submission_offset: 0, completion_offset: 4096 }];
    let attach = |registration| Request::AttachQueues(AttachQueues { registration, depth: 64, rings: rings.clone() });
    not_yours(refusal(&mut other, &attach(owner.registration()), &[]));
    let prepare = |registration, block_ids: Vec<u32>| Prepare { registration, tokens: tokens.clone(), block_ids, first_block: 0 };
    not_yours(refusal(&mut other, &Request::PrepareStore(prepare(owner.registration(), vec![0])), &[]));
    not_yours(refusal(&mut other, &Request::PrepareRetrieve(prepare(12345, vec![0])), &[]));

    // Window descriptors: none, a regular file, a memfd smaller than claimed.
    let register = Request::RegisterMemory(RegisterMemory { window_bytes: 1 << 20, kv_blocks: 4 });
    let bad_request = |(code, message): (ErrorCode, String), expect: &str| {
        assert_eq!(code, ErrorCode::BadRequest, "{message}");
        assert!(message.contains(expect), "{message:?} should say {expect:?}");
    };
    bad_request(refusal(&mut other, &register, &[]), "takes one descriptor");
    let file = tempfile::tempfile().unwrap();
    file.set_len(1 << 20).unwrap();
    bad_request(refusal(&mut other, &register, &[file.as_fd()]), "the window descriptor");
    let small = SharedMemory::create("too-small", 64 << 10).unwrap();
    bad_request(refusal(&mut other, &register, &[small.fd()]), "the window descriptor");
    // A real window of 4 blocks: block 4 is outside it, rings past its end are refused.
    let window = SharedMemory::create("raw-window", 1 << 20).unwrap();
    let Ok((Reply::Registered(registered), _)) = other.call_with_fds(&register, &[window.fd()]) else { panic!("registering") };
    bad_request(refusal(&mut other, &Request::PrepareStore(prepare(registered.registration, vec![0, 4])), &[]), "outside registration");
    // More blocks than a reply can place: refused before anything is reserved (in a pool of
    // 1–3 tokens per block such a request is otherwise valid, and its reply would not fit).
    let too_many = vec![0; PREPARE_BLOCKS_MAX + 1];
    bad_request(refusal(&mut other, &Request::PrepareStore(prepare(registered.registration, too_many.clone())), &[]), "at most");
    bad_request(refusal(&mut other, &Request::PrepareRetrieve(prepare(registered.registration, too_many)), &[]), "at most");
    // A store starts at the prefix's first block; a retrieve's blocks end within the tokens.
    let from = |first_block| Prepare { registration: registered.registration, tokens: tokens.clone(), block_ids: vec![0], first_block };
    bad_request(refusal(&mut other, &Request::PrepareStore(from(1)), &[]), "starts at the prefix's first block");
    bad_request(refusal(&mut other, &Request::PrepareRetrieve(from(BLOCKS as u32)), &[]), "from block");
    bad_request(refusal(&mut other, &Request::PrepareRetrieve(from(u32::MAX)), &[]), "from block");
    let past_end = Request::AttachQueues(AttachQueues {
        registration: registered.registration,
        depth: 64,
        rings: vec![RingOffsets { submission_offset: 1 << 20, completion_offset: 0 }],
    });
    bad_request(refusal(&mut other, &past_end, &[]), "outside the window");
    let held = status(&daemon);
    let other_status = held.clients.iter().find(|client| client.name == "raw").unwrap();
    assert_eq!((other_status.registrations, other_status.queue_pairs, other_status.requests_in_flight), (1, 0, 0));

    // The owner's request is untouched: it completes and commits.
    let deadline = Instant::now() + WAIT;
    for layer in 0..layers(&mut owner) {
        owner.store_layer(plan.handle, layer, SmBudget(1)).unwrap();
        owner.wait(plan.handle, deadline).unwrap();
    }
    assert_eq!(owner.commit_store(plan.handle).unwrap(), BLOCKS);
    assert_eq!(other.lookup(&tokens).unwrap() as usize, BLOCKS);
    drop(owner);
    drop(other);
    assert_idle(&status_when(&daemon, "both sessions gone", |status| status.clients.is_empty()));
}

#[test]
fn a_retrieve_from_a_first_block_fills_only_the_blocks_from_there() {
    // Goal: an engine holding the first blocks of a cached prefix itself looks up and retrieves
    // the rest through tuttid (`first_block` in `Lookup`, `LookupAllRanks` and
    // `PrepareRetrieve`): the lookups answer where the cached run from there ends, the daemon
    // places only those blocks, they land byte-exact, and the engine's own blocks are neither
    // read into nor written.
    const FIRST: usize = 2;
    let directory = tempfile::tempdir().unwrap();
    let daemon = memory_daemon(directory.path());
    let mut store = connect(&daemon.socket, 0, 1);
    assert_eq!(store_prompt(&mut store, 60, 0, None), BLOCKS);
    // The trait reports the data half's limit on layers in flight (an engine issues that far ahead).
    assert_eq!(LayerKvStore::layers_in_flight_max(&store), 1);
    store.data_mut().set_layers_in_flight_max(2).unwrap();
    assert_eq!(LayerKvStore::layers_in_flight_max(&store), 2);
    let block_tokens = store.hello_reply().shape.block_tokens;
    let tokens = prompt(60, block_tokens);
    let block_bytes = store.block_bytes() as usize;
    // Lookups from FIRST (Lookup and LookupAllRanks carry it): the run ends at the prompt's end,
    // and at the stored blocks' end for a longer prompt.
    let mut longer = tokens[..BLOCKS * block_tokens as usize].to_vec();
    longer.extend((0..2 * block_tokens).map(|token| token + 7_000_000));
    assert_eq!(store.lookup_from(&tokens, FIRST), BLOCKS);
    assert_eq!(store.lookup_from(&longer, FIRST), BLOCKS);
    assert_eq!(store.lookup_from(&longer, BLOCKS + 1), BLOCKS + 1, "nothing cached from an uncached block");
    assert_eq!(store.lookup_all_ranks(&longer, FIRST).unwrap(), BLOCKS);
    assert_eq!(store.client().lookup_from(&longer, u32::MAX).unwrap() as usize, BLOCKS + 2, "a start past the prompt is its end");
    // Engine blocks B..2B receive the prompt; the first FIRST of them are the engine's own.
    let targets: Vec<u32> = (BLOCKS as u32..2 * BLOCKS as u32).collect();
    for (index, &block) in targets.iter().enumerate() {
        store.write_block(block, 0, &vec![if index < FIRST { 0x5A } else { 0 }; block_bytes]).unwrap();
    }
    let handle =
        store.prepare_retrieve_from(&KvRequest { tokens: &tokens, block_ids: &targets[FIRST..] }, FIRST).expect("prepare from FIRST");
    let placed: Vec<u32> = store.placements(handle).unwrap().iter().map(|placement| placement.engine_block).collect();
    assert_eq!(placed, targets[FIRST..], "tuttid places only the blocks from FIRST");
    let deadline = Instant::now() + WAIT;
    for layer in 0..layers(&mut store) {
        store.retrieve_layer(handle, layer, SmBudget(1)).expect("retrieve_layer");
        assert_eq!(store.wait(handle, deadline).expect("wait"), Some(layer));
    }
    store.finish(handle).expect("finish");
    let mut bytes = vec![0u8; block_bytes];
    for (prompt_block, &engine_block) in targets.iter().enumerate() {
        store.read_block(engine_block, 0, &mut bytes).unwrap();
        let wrong = if prompt_block < FIRST {
            bytes.iter().filter(|&&byte| byte != 0x5A).count()
        } else {
            bytes.iter().enumerate().filter(|&(offset, &byte)| byte != pattern_byte(60, 0, prompt_block, offset)).count()
        };
        assert_eq!(wrong, 0, "prompt block {prompt_block} (engine block {engine_block}): {wrong} wrong bytes");
    }
    drop(store);
    assert_idle(&status_when(&daemon, "the session gone", |status| status.clients.is_empty()));
}

#[test]
fn a_stray_command_on_a_client_queue_is_refused_by_the_software_controller() {
    // Goal: commands hand-written into a client's own queue pair that name memory outside its
    // window (a read into it, a write from it) or blocks outside the pool's data region (the
    // superblock at LBA 0) complete with an error, move nothing, and are counted in status; the
    // queue then serves an ordinary store.
    let directory = tempfile::tempdir().unwrap();
    let daemon = memory_daemon(directory.path());
    let mut store = connect(&daemon.socket, 0, 1);
    let shape = store.data_mut().shape().clone();
    let (nsid, data_lba) = (NamespaceId(shape.devices[0].nsid), shape.devices[0].addressing.data_lba);
    let window = store.window().clone();
    let inside = window.allocate(4096).unwrap();
    let outside = Iova(window.iova_base().0 + window.memory().len() as u64 + (1 << 20));
    let before = status(&daemon).devices[0].refused_commands;
    {
        let pair = store.data_mut().lender().lend(0, Instant::now() + WAIT).unwrap().expect("the executor lends its pair");
        let timeout = Duration::from_secs(5);
        let transfer_error = NvmeStatus::generic(codes::DATA_TRANSFER_ERROR);
        let stray = [DataSegment::new(outside, 4096)];
        let read = pair.read(nsid, Lba(data_lba), &stray, timeout);
        assert!(matches!(read, Err(NvmeError::Command { status, .. }) if status == transfer_error), "{read:?}");
        let write = pair.write(nsid, Lba(data_lba), &stray, true, timeout);
        assert!(matches!(write, Err(NvmeError::Command { status, .. }) if status == transfer_error), "{write:?}");
        let superblock = [DataSegment::new(inside.iova(), 4096)];
        let denied = pair.write(nsid, Lba(0), &superblock, true, timeout);
        let access_denied = NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, codes::ACCESS_DENIED);
        assert!(matches!(denied, Err(NvmeError::Command { status, .. }) if status == access_denied), "{denied:?}");
        pair.read(nsid, Lba(data_lba), &superblock, timeout).expect("inside the window and the pool: allowed");
    }
    assert_eq!(status(&daemon).devices[0].refused_commands - before, 3);
    assert_eq!(store_prompt(&mut store, 60, 0, None), BLOCKS);
    drop(store);
    let after = status_when(&daemon, "the session ends", |status| status.clients.is_empty());
    assert_idle(&after);
    assert_eq!(after.pool.cached_blocks, BLOCKS as u64);
}

#[test]
fn a_client_running_past_its_lease_keeps_its_queues_until_it_exits() {
    // Goal: a session the daemon ends (here its lease) while its client process still runs
    // keeps its queue pairs, window and reservation until that process exits. The client rings
    // its doorbells in the software controller's shared register page and does not know its
    // session ended, so a queue id given to the next client meanwhile would take the old
    // client's doorbells: the next client gets other queues, the old one's layers run on its
    // own (moving only its own slots), its commit is refused, and once it closes its store
    // (the process still running) everything it held goes back, nothing of its store visible,
    // the next client's prompt intact.
    let directory = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::start(directory.path(), "emu:mem:64m", &["--format", "--lease", "1s", "--metrics", "127.0.0.1:0"]);
    let metrics = daemon.metrics_url();
    let mut stale = start_child(&daemon.socket, "outlive-lease", 0, 1, 80);
    let stale_lines = child_lines(&mut stale);
    let stale_queues = stale_lines.recv_timeout(WAIT).expect("the stale client's queues");
    let deadline = Instant::now() + WAIT;
    while !common::scrape(&metrics).contains("tuttid_sessions_awaiting_exit 1") {
        assert!(Instant::now() < deadline, "the stale session's lease did not expire: {}", common::scrape(&metrics));
        std::thread::sleep(Duration::from_millis(20));
    }
    let held = status(&daemon);
    assert_eq!(held.clients.len(), 1, "{held:?}");
    assert!(held.clients[0].awaiting_exit, "{held:?}");
    assert_eq!((held.clients[0].queue_pairs, held.clients[0].requests_in_flight), (1, 1), "its pair and store are kept");
    assert!(held.pool.writing_slots > 0, "its slots stay reserved: {:?}", held.pool);
    let mut next = start_child(&daemon.socket, "store-on-queues", 0, 1, 81);
    let next_queues = child_line(&mut next);
    assert!(wait_bounded(&mut next).success());
    assert_ne!(next_queues, stale_queues, "the next client got the stale one's queues");
    std::fs::write(directory.path().join("go-80"), b"").unwrap();
    assert_eq!(stale_lines.recv_timeout(WAIT).expect("the stale client's outcome"), "2-layers-refused");
    assert_eq!(stale_lines.recv_timeout(WAIT).expect("the stale client's close"), "closed");
    let after = status_when(&daemon, "the stale client's session ends with its close", |status| status.clients.is_empty());
    assert!(stale.try_wait().unwrap().is_none(), "the stale client still runs");
    stale.kill().unwrap();
    let _ = stale.wait();
    assert_idle(&after);
    assert_eq!(after.pool.cached_blocks, BLOCKS as u64, "only the next client's prompt");
    assert!(common::scrape(&metrics).contains("tuttid_sessions_awaiting_exit 0"));
    assert_eq!(run_child(&daemon.socket, "lookup", 0, 1, 80), "0", "the stale store is not visible");
    assert_eq!(run_child(&daemon.socket, "retrieve", 0, 1, 81), BLOCKS.to_string(), "the next client's prompt is intact");
}

#[test]
fn a_drain_releases_a_sessions_store_without_committing_it() {
    // Goal: a client holding a store with a layer in flight when the daemon is told to stop
    // (SIGTERM) does not stop the drain, and the pool reopened afterwards holds only what was
    // committed (one committed prompt), with no damaged header. (A lease's expiry:
    // `a_client_running_past_its_lease_keeps_its_queues_until_it_exits`.)
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("pool.img");
    let device = format!("emu:{}", image.display());
    let daemon = Daemon::start(directory.path(), &device, &["--format", "--emu-create-bytes", "64m", "--lease", "1s"]);
    assert_eq!(run_child(&daemon.socket, "store", 0, 1, 70), BLOCKS.to_string());

    let mut in_flight = start_child(&daemon.socket, "layer-in-flight", 0, 1, 72);
    assert_eq!(child_line(&mut in_flight), "parked");
    let (exit, stderr) = daemon.terminate();
    assert!(exit.success(), "{exit}: {stderr}");
    in_flight.kill().unwrap();
    let _ = in_flight.wait();
    let reopened = Daemon::start(directory.path(), &device, &[]);
    let status = status(&reopened);
    assert_eq!((status.pool.cached_blocks, status.pool.valid_slots), (BLOCKS as u64, BLOCKS as u64), "{:?}", status.pool);
    assert_eq!(run_child(&reopened.socket, "retrieve", 0, 1, 70), BLOCKS.to_string(), "the committed prompt survives");
    assert_eq!(run_child(&reopened.socket, "lookup", 0, 1, 72), "0", "the drained store is not visible");
    let (exit, stderr) = reopened.terminate();
    assert!(exit.success() && stderr.contains("0 corrupt headers"), "{exit}: {stderr}");
}
