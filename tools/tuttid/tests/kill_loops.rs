//! Kill -9 loops with counts (issue 14, item 5): client processes (this test binary run again,
//! `kill_loop_child_entry`) store and retrieve a seeded mix of prompts through tuttid while
//! the loop SIGKILLs, at a seeded random moment, either a client or the daemon itself.
//!
//! - **clients**: after each kill the daemon must hold no session, no pinned or writing slot,
//!   no leaked queue pair, and a verifying client must find every committed prompt whole,
//!   byte-exact, and nothing of a store that was not committed.
//! - **daemon**: tuttid is killed and restarted on the same pool file (`emu:PATH`); the clients
//!   see a typed error, reconnect and go on; at the end every committed prompt reads back
//!   byte-exact and nothing uncommitted is visible.
//!
//! The tests run a few iterations (each test well under 20 s); `cargo test -p tuttid --test
//! kill_loops -- --ignored --nocapture` runs the long loops (`TUTTI_KILL_ITERATIONS`, default
//! 200 each) and prints the counts docs/tuttid.md quotes. Every wait is bounded.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Child;
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use gio_uring::SmBudget;
use objstore::{KvRequest, LayerKvStore, ObjstoreError};
use tutti_daemon::client::{RemoteConfig, RemoteKvStore};
use tutti_daemon::protocol::StatusReply;

mod common;
use common::{hello, spawn_child, wait_bounded, Daemon, WAIT};

const CHILD_ENV: &str = "TUTTID_KILL_CHILD";
/// Blocks of every prompt.
const BLOCKS: u32 = 6;
/// Prompts a client draws from: prompt ids `client * PROMPTS + 0..PROMPTS`. Many, so stores
/// stay frequent through a long loop (a prompt found whole is retrieved instead); few enough
/// that all of them fit the pool (no eviction: a committed prompt must stay whole).
const PROMPTS: u32 = 512;
/// The pool: 256 MiB holds ~16k slots of 16 KiB blocks, over the 2 x 512 x 6 blocks needed.
const POOL_SIZE: &str = "256m";
/// The longest a layer may take; short, so a client whose daemon died gives up soon.
const LAYER_WAIT: Duration = Duration::from_secs(3);

/// splitmix64: the loops' seeded randomness (kill moments, the clients' mix).
fn next_random(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut mixed = *state;
    mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    mixed ^ (mixed >> 31)
}

/// Prompt `id`'s tokens: `BLOCKS` full blocks, no block shared with another prompt.
fn prompt(id: u32, block_tokens: u32) -> Vec<u32> {
    (0..BLOCKS * block_tokens).map(|token| token.wrapping_mul(2_654_435_761) ^ id.wrapping_mul(0x85EB_CA6B) ^ 0x1234_5678).collect()
}

/// The byte at `offset` of block `block` of prompt `id`: a function of the three alone, so any
/// process can check any prompt.
fn pattern_byte(id: u32, block: u32, offset: usize) -> u8 {
    let mixed = (offset as u32).wrapping_mul(0x9E37_79B1) ^ block.wrapping_mul(0xC2B2_AE35) ^ id.wrapping_mul(0x27D4_EB2F);
    (mixed >> 11) as u8 ^ (mixed as u8)
}

fn connect(socket: &Path, name: &str) -> Result<RemoteKvStore, ObjstoreError> {
    let config = RemoteConfig { kv_blocks: 2 * BLOCKS, queue_depth: 16, ..RemoteConfig::default() };
    RemoteKvStore::connect(socket, &hello(0, 1, name), &config)
}

/// Stores prompt `id` from engine blocks 0..BLOCKS, layer by layer, and commits.
fn store_prompt(store: &mut RemoteKvStore, id: u32, before_commit: impl FnOnce()) -> Result<(), ObjstoreError> {
    let tokens = prompt(id, store.hello_reply().shape.block_tokens);
    let block_bytes = store.block_bytes() as usize;
    let mut bytes = vec![0u8; block_bytes];
    for block in 0..BLOCKS {
        bytes.iter_mut().enumerate().for_each(|(offset, byte)| *byte = pattern_byte(id, block, offset));
        store.write_block(block, 0, &bytes)?;
    }
    let block_ids: Vec<u32> = (0..BLOCKS).collect();
    let plan = store.prepare_store(&KvRequest { tokens: &tokens, block_ids: &block_ids })?;
    for layer in 0..store.data_mut().shape().geometry.layers {
        store.store_layer(plan.handle, layer, SmBudget(1))?;
        store.wait(plan.handle, Instant::now() + LAYER_WAIT)?;
    }
    before_commit();
    store.commit_store(plan.handle)?;
    Ok(())
}

/// Retrieves the first `cached` blocks of prompt `id` into engine blocks BLOCKS.. (cleared
/// first) and returns how many bytes differ from the prompt's pattern.
fn retrieve_prompt(store: &mut RemoteKvStore, id: u32, cached: u32) -> Result<u64, ObjstoreError> {
    let tokens = prompt(id, store.hello_reply().shape.block_tokens);
    let block_bytes = store.block_bytes() as usize;
    let block_ids: Vec<u32> = (BLOCKS..BLOCKS + cached).collect();
    for &block in &block_ids {
        store.write_block(block, 0, &vec![0u8; block_bytes])?;
    }
    let handle = store.prepare_retrieve(&KvRequest { tokens: &tokens, block_ids: &block_ids })?;
    for layer in 0..store.data_mut().shape().geometry.layers {
        store.retrieve_layer(handle, layer, SmBudget(1))?;
        store.wait(handle, Instant::now() + LAYER_WAIT)?;
    }
    store.finish(handle)?;
    let mut wrong = 0u64;
    let mut bytes = vec![0u8; block_bytes];
    for (block, &engine_block) in block_ids.iter().enumerate() {
        store.read_block(engine_block, 0, &mut bytes)?;
        wrong += bytes.iter().enumerate().filter(|&(offset, &byte)| byte != pattern_byte(id, block as u32, offset)).count() as u64;
    }
    Ok(wrong)
}

fn say(line: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "CHILD {line}");
    let _ = stdout.flush();
}

/// A client process, selected by `TUTTID_KILL_CHILD` = "SOCKET CLIENT SEED LIFETIME_S"; a no-op
/// as an ordinary test. It loops (for at most LIFETIME_S, so a lost parent cannot leave it
/// behind) over a seeded mix of its prompts: a prompt
/// found whole is retrieved and checked, one not found is stored and committed. It reports
/// each step on standard output, so the loop knows what was committed and what was in flight
/// when the kill came; on an error it reports it and reconnects (bounded).
#[test]
fn kill_loop_child_entry() {
    let Ok(role) = std::env::var(CHILD_ENV) else { return };
    let words: Vec<&str> = role.split(' ').collect();
    let socket = Path::new(words[0]);
    let client: u32 = words[1].parse().unwrap();
    let mut random: u64 = words[2].parse().unwrap();
    let ends = Instant::now() + Duration::from_secs(words[3].parse().unwrap());
    let mut store: Option<RemoteKvStore> = None;
    while Instant::now() < ends {
        let Some(attached) = store.as_mut() else {
            match connect(socket, &format!("kill-loop-{client}")) {
                Ok(connected) => {
                    store = Some(connected);
                    say("connected");
                }
                // The daemon is restarting: try again soon.
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
            continue;
        };
        let id = client * PROMPTS + (next_random(&mut random) % u64::from(PROMPTS)) as u32;
        let tokens = prompt(id, attached.hello_reply().shape.block_tokens);
        let cached = attached.lookup(&tokens) as u32;
        let step = if cached == 0 {
            say(&format!("storing {id}"));
            store_prompt(attached, id, || say(&format!("committing {id}"))).map(|()| format!("committed {id}"))
        } else {
            retrieve_prompt(attached, id, cached.min(BLOCKS)).map(|wrong| format!("verified {id} {wrong}"))
        };
        match step {
            Ok(line) => say(&line),
            Err(error) => {
                say(&format!("error {error:?}"));
                // Dropping the store leaks what a dead daemon's queue may still hold (its rings).
                store = None;
            }
        }
    }
}

/// What became of a prompt's store, as far as its client knows; a later outcome replaces an
/// earlier one only if it is stronger (committed > uncertain > abandoned): a store attempted
/// again because its lookup failed (a dead daemon answers 0) says nothing about the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// Given up before its commit was sent (an error, or the kill): nothing of it may be visible.
    Abandoned,
    /// The commit was sent, its answer never came: it may be visible (in part, after a daemon
    /// crash mid-commit), and what is visible must be exact.
    Uncertain,
    /// Committed: must be found whole and exact.
    Committed,
}

/// What one client process reported.
#[derive(Default)]
struct Ledger {
    outcomes: BTreeMap<u32, Outcome>,
    /// The store under way: its prompt, and whether its commit was sent.
    storing: Option<(u32, bool)>,
    wrong_bytes: u64,
    verified: u64,
    commits: u64,
    errors: u64,
    connects: u64,
}

impl Ledger {
    fn settle(&mut self, id: u32, outcome: Outcome) {
        let entry = self.outcomes.entry(id).or_insert(outcome);
        *entry = (*entry).max(outcome);
    }

    fn hear(&mut self, line: &str) {
        let words: Vec<&str> = line.splitn(3, ' ').collect();
        let id = || words[1].parse::<u32>().unwrap();
        match words[0] {
            "connected" => self.connects += 1,
            "storing" => self.storing = Some((id(), false)),
            "committing" => self.storing = Some((id(), true)),
            "committed" => {
                self.commits += 1;
                self.settle(id(), Outcome::Committed);
                self.storing = None;
            }
            "verified" => {
                self.verified += 1;
                self.wrong_bytes += words[2].parse::<u64>().unwrap();
            }
            "error" => {
                self.errors += 1;
                self.interrupted();
            }
            other => panic!("unknown child line {other}"),
        }
    }

    /// The store under way ended without its answer (an error or the kill); returns what it was.
    fn interrupted(&mut self) -> Option<Outcome> {
        let (id, commit_sent) = self.storing.take()?;
        let outcome = if commit_sent { Outcome::Uncertain } else { Outcome::Abandoned };
        self.settle(id, outcome);
        Some(outcome)
    }

    fn merge(&mut self, other: &Ledger) {
        for (&id, &outcome) in &other.outcomes {
            self.settle(id, outcome);
        }
    }
}

/// A client process and the lines it printed, read by a thread (so a wait can be bounded).
struct Clientele {
    child: Child,
    lines: Receiver<Option<String>>,
    ledger: Ledger,
}

impl Clientele {
    fn start(socket: &Path, client: u32, seed: u64, lifetime: Duration) -> Clientele {
        let role = format!("{} {client} {seed} {}", socket.display(), lifetime.as_secs().max(1));
        let mut child = spawn_child("kill_loop_child_entry", CHILD_ENV, &role);
        let stdout = child.stdout.take().unwrap();
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest may print "test kill_loop_child_entry ... " before it on the same line.
                match line.find("CHILD ").map(|at| line[at + "CHILD ".len()..].to_string()) {
                    Some(rest) => {
                        if sender.send(Some(rest)).is_err() {
                            return;
                        }
                    }
                    None => eprintln!("child: {line}"),
                }
            }
            let _ = sender.send(None);
        });
        Clientele { child, lines, ledger: Ledger::default() }
    }

    /// Takes in every line printed so far.
    fn drain(&mut self) {
        while let Ok(Some(line)) = self.lines.try_recv() {
            self.ledger.hear(&line);
        }
    }

    /// Takes in lines until `done` holds of the ledger (bounded).
    fn until(&mut self, what: &str, done: impl Fn(&Ledger) -> bool) {
        let deadline = Instant::now() + WAIT;
        while !done(&self.ledger) {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(Some(line)) => self.ledger.hear(&line),
                Ok(None) => panic!("{what}: the client process ended: {:?}", self.child.try_wait()),
                Err(_) => panic!("{what}: not within {WAIT:?}"),
            }
        }
    }

    /// SIGKILL, then every line it printed before it died; what became of a store under way.
    fn kill(&mut self) -> Option<Outcome> {
        self.child.kill().unwrap();
        wait_bounded(&mut self.child);
        let deadline = Instant::now() + WAIT;
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(Some(line)) => self.ledger.hear(&line),
                Ok(None) => break,
                Err(_) => panic!("the killed client's output did not end within {WAIT:?}"),
            }
        }
        self.ledger.interrupted()
    }
}

impl Drop for Clientele {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The daemon's status. A connection of a client just ended may still count against
/// `--clients-max` for a moment (the daemon has not read its end yet): `Busy` is retried, bounded.
fn status(daemon: &Daemon) -> StatusReply {
    let deadline = Instant::now() + WAIT;
    loop {
        match daemon.client().status() {
            Ok(status) => return status,
            Err(error) => assert!(Instant::now() < deadline, "status: {error}"),
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls status until no session is left (bounded), and returns it.
fn status_without_sessions(daemon: &Daemon) -> StatusReply {
    let deadline = Instant::now() + WAIT;
    loop {
        let status = status(daemon);
        if status.clients.is_empty() {
            return status;
        }
        assert!(Instant::now() < deadline, "sessions left after {WAIT:?}: {:?}", status.clients);
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The loops' counts (the figures docs/tuttid.md quotes).
#[derive(Debug, Default)]
struct Counts {
    iterations: u64,
    /// Client-side steps seen: stores committed, retrieves verified, typed errors, reconnects.
    commits: u64,
    verified_retrieves: u64,
    client_errors: u64,
    reconnects: u64,
    /// Kills (of the client, or of the daemon under it) during a store before its commit was
    /// sent, and after it was sent but before its answer.
    kills_mid_store: u64,
    kills_mid_commit: u64,
    wrong_bytes: u64,
    /// Blocks visible to lookups of prompts whose store was abandoned before its commit, or
    /// never attempted.
    uncommitted_visible_blocks: u64,
    /// Committed prompts not found whole.
    committed_missing: u64,
    pinned_or_writing_left: u64,
    queue_pairs_leaked: u64,
    sessions_left: u64,
}

impl Counts {
    fn assert_clean(&self, what: &str) {
        println!("kill loop ({what}): {self:?}");
        assert_eq!(
            (
                self.wrong_bytes,
                self.uncommitted_visible_blocks,
                self.committed_missing,
                self.pinned_or_writing_left,
                self.queue_pairs_leaked,
                self.sessions_left
            ),
            (0, 0, 0, 0, 0, 0),
            "{what}: {self:?}"
        );
    }
}

/// A verifying client's pass over prompts `ids`: committed ones must be whole, nothing of
/// abandoned or never-attempted ones visible, every visible byte the pattern's.
fn verify_pool(socket: &Path, ids: impl Iterator<Item = u32>, ledger: &Ledger, counts: &mut Counts) {
    // Retried, bounded, for the same reason as `status`.
    let deadline = Instant::now() + WAIT;
    let mut verifier = loop {
        match connect(socket, "verifier") {
            Ok(verifier) => break verifier,
            Err(error) => assert!(Instant::now() < deadline, "the verifying client attaches: {error}"),
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let block_tokens = verifier.hello_reply().shape.block_tokens;
    for id in ids {
        let cached = verifier.lookup(&prompt(id, block_tokens)) as u32;
        match ledger.outcomes.get(&id) {
            Some(Outcome::Committed) if cached != BLOCKS => counts.committed_missing += 1,
            Some(Outcome::Abandoned) | None => counts.uncommitted_visible_blocks += u64::from(cached),
            _ => {}
        }
        if cached > 0 {
            counts.wrong_bytes += retrieve_prompt(&mut verifier, id, cached.min(BLOCKS)).expect("the verifier retrieves");
        }
    }
}

fn count_interrupted(counts: &mut Counts, outcome: Option<Outcome>) {
    match outcome {
        Some(Outcome::Abandoned) => counts.kills_mid_store += 1,
        Some(Outcome::Uncertain) => counts.kills_mid_commit += 1,
        _ => {}
    }
}

fn iterations(default: u64) -> u64 {
    std::env::var("TUTTI_KILL_ITERATIONS").ok().and_then(|text| text.parse().ok()).unwrap_or(default)
}

/// (a): `iterations` clients, one at a time, each SIGKILLed at a seeded moment 0..400 ms after
/// it attached.
fn client_kill_loop(iterations: u64, seed: u64) -> Counts {
    let directory = tempfile::tempdir().unwrap();
    // 2 clients at most (the loop's and the verifier): 4 queue pairs on the controller, so
    // pairs leaked by killed clients would soon refuse later attaches.
    let daemon = Daemon::start(directory.path(), &format!("emu:mem:{POOL_SIZE}"), &["--format", "--clients-max", "2"]);
    let mut random = seed;
    let mut counts = Counts::default();
    // Every iteration's client draws from the same prompts (client 0's), so later clients
    // retrieve what earlier, killed ones committed.
    let mut ledger = Ledger::default();
    for _ in 0..iterations {
        let mut client = Clientele::start(&daemon.socket, 0, next_random(&mut random), WAIT);
        client.until("the client attaches", |ledger| ledger.connects > 0);
        std::thread::sleep(Duration::from_millis(next_random(&mut random) % 400));
        let in_flight = client.ledger.storing.map(|(id, _)| id);
        count_interrupted(&mut counts, client.kill());
        counts.commits += client.ledger.commits;
        counts.verified_retrieves += client.ledger.verified;
        counts.wrong_bytes += client.ledger.wrong_bytes;
        counts.client_errors += client.ledger.errors;
        ledger.merge(&client.ledger);
        let after = status_without_sessions(&daemon);
        counts.pinned_or_writing_left += after.pool.pinned_slots + after.pool.writing_slots;
        counts.queue_pairs_leaked = after.leaked_queue_pairs;
        // The store the kill interrupted, now (a later client may store that prompt again).
        verify_pool(&daemon.socket, in_flight.into_iter(), &ledger, &mut counts);
        counts.iterations += 1;
    }
    verify_pool(&daemon.socket, 0..PROMPTS, &ledger, &mut counts);
    let after = status_without_sessions(&daemon);
    counts.pinned_or_writing_left += after.pool.pinned_slots + after.pool.writing_slots;
    counts.queue_pairs_leaked = after.leaked_queue_pairs;
    counts.sessions_left = status_without_sessions(&daemon).clients.len() as u64;
    counts
}

/// (b): two clients run their mixes while tuttid is SIGKILLed at a seeded moment 100..600 ms
/// into each iteration and restarted on the same pool file.
fn daemon_kill_loop(iterations: u64, seed: u64) -> Counts {
    let directory = tempfile::tempdir().unwrap();
    let device = format!("emu:{}", directory.path().join("pool.img").display());
    let mut daemon = Daemon::start(directory.path(), &device, &["--format", "--emu-create-bytes", POOL_SIZE]);
    let mut random = seed;
    // The clients live through the whole loop: at most ~1 s of mix and a restart per iteration.
    let lifetime = WAIT + Duration::from_secs(5) * iterations as u32;
    let mut clients: Vec<Clientele> =
        (0..2).map(|client| Clientele::start(&daemon.socket, client, next_random(&mut random), lifetime)).collect();
    for client in &mut clients {
        client.until("the client attaches", |ledger| ledger.connects > 0);
    }
    let mut counts = Counts::default();
    for iteration in 0..iterations {
        std::thread::sleep(Duration::from_millis(100 + next_random(&mut random) % 500));
        drop(daemon);
        for client in &mut clients {
            client.drain();
            match client.ledger.storing {
                Some((_, false)) => counts.kills_mid_store += 1,
                Some((_, true)) => counts.kills_mid_commit += 1,
                None => {}
            }
        }
        daemon = Daemon::start(directory.path(), &device, &[]);
        // Each client saw its daemon go (a typed error) and attached to the new one.
        for client in &mut clients {
            let connects = iteration + 2;
            client.until("the client reconnects", |ledger| ledger.connects >= connects);
            assert!(client.ledger.errors > iteration, "the client saw no error when its daemon died");
        }
        counts.iterations += 1;
    }
    let mut ledger = Ledger::default();
    for client in &mut clients {
        let _ = client.kill();
        counts.commits += client.ledger.commits;
        counts.verified_retrieves += client.ledger.verified;
        counts.wrong_bytes += client.ledger.wrong_bytes;
        counts.client_errors += client.ledger.errors;
        counts.reconnects += client.ledger.connects.saturating_sub(1);
        ledger.merge(&client.ledger);
    }
    let after = status_without_sessions(&daemon);
    counts.pinned_or_writing_left += after.pool.pinned_slots + after.pool.writing_slots;
    verify_pool(&daemon.socket, 0..2 * PROMPTS, &ledger, &mut counts);
    let after = status_without_sessions(&daemon);
    counts.pinned_or_writing_left += after.pool.pinned_slots + after.pool.writing_slots;
    counts.queue_pairs_leaked = after.leaked_queue_pairs;
    counts.sessions_left = after.clients.len() as u64;
    counts
}

#[test]
fn clients_killed_at_random_moments_leave_nothing_behind() {
    // Goal: 12 clients, each SIGKILLed at a seeded random moment of its store/retrieve mix
    // (mid-store, mid-retrieve, between prepare and commit): afterwards no session, no pinned
    // or writing slot, no leaked queue pair; every committed prompt whole and byte-exact,
    // nothing of an uncommitted store visible; the clients' own retrieves found no wrong byte.
    let counts = client_kill_loop(12, 0x5eed_0001);
    counts.assert_clean("clients");
    assert_eq!(counts.iterations, 12);
    assert!(counts.commits > 0, "the clients committed nothing: {counts:?}");
}

#[test]
fn a_daemon_killed_at_random_moments_recovers_every_committed_block() {
    // Goal: tuttid SIGKILLed 4 times at seeded random moments while two clients store and
    // retrieve, restarted on the same pool file each time: the clients see a typed error and
    // reconnect; at the end every prompt a client saw committed reads back whole and
    // byte-exact, nothing uncommitted is visible, nothing is pinned, no pair leaked.
    let counts = daemon_kill_loop(4, 0x5eed_0002);
    counts.assert_clean("daemon");
    assert_eq!(counts.iterations, 4);
    assert!(counts.commits > 0 && counts.client_errors >= 8, "{counts:?}");
}

#[test]
#[ignore = "long: the figures of docs/tuttid.md (TUTTI_KILL_ITERATIONS, default 200)"]
fn kill_loops_long() {
    let clients = client_kill_loop(iterations(200), 0x5eed_1001);
    clients.assert_clean("clients");
    let daemon = daemon_kill_loop(iterations(200), 0x5eed_1002);
    daemon.assert_clean("daemon");
}
