//! The registrar: the one thread of a cluster node that talks to etcd.
//!
//! Each pass (woken by a committed store, or every tick):
//! 1. **Local, under the pool lock** (microseconds): the index's departed block keys drop the
//!    held segments they broke; each committed store's full segments whose blocks are all still
//!    committed become held. Then, without the lock, the manifest records both.
//! 2. **etcd, without any lock**, when no backoff is pending: before the first join, delete the
//!    entries of segments the manifest listed but the pool no longer holds, at start or evicted
//!    since (a wiped pool, or evictions before the join: the previous process's lease may still
//!    claim them), only while the node id's member key is absent or under the lease the
//!    manifest recorded — never a live process's that holds the id; the passes delete those
//!    stale at the first pass's first read of the queue, then join (what breaks after that read
//!    is queued for deletion under the new lease); join, recording the lease in the manifest,
//!    which the first join then rewrites without the stale segments' dropped records, their
//!    deletes made (or rejoin after a lost lease: a new lease has no registrations, so every
//!    held segment is registered again); update the member record
//!    when the set of models changed; once after each join or rejoin, list the members and
//!    compare their pools' key secret tags with this node's (a diagnostic: members of another
//!    secret share nothing with it; logged and counted; one call of T, tried again at the next
//!    passes, up to [`KEY_SECRET_CHECK_TRIES`] per join, should it fail); unregister broken segments and register held ones,
//!    taking turns while both wait, one transaction per `txn_ops_max` − 1 segments of one model
//!    space, at most [`TRANSACTIONS_PER_PASS`] together per pass so departures are not kept
//!    waiting. Before each call but the join, step 1 runs again on the commits queued
//!    meanwhile (local work); a registration drops the deletes still queued for its segments
//!    (queued when each broke, before it was held again: its put replaced the key), so a
//!    segment broken and held again is never deleted after its new put, and one broken again
//!    after it is deleted: a pass may wait on etcd for up to 64 transactions of T each (and, after a join, the
//!    member listing and a record update, T each), and a
//!    commit the full queue refuses is never journalled, so never registered for the life of
//!    the pool. A single call (a join, up to 4 T + 1 s; a rejoin, up to 6 T) is left to the
//!    queue's bound (`commits_queued_max`, default 1,024 commits), as is the first join's
//!    rewrite of the manifest (local: every held record and two fsyncs), the queue read
//!    between the two. A compaction of the manifest (the same work) is followed by a read of
//!    the queue, and stands for the first join's rewrite when the read after the join made one.
//!
//! A failed call is counted, remembered for status, and retried after a backoff (100 ms
//! doubling to at most 5 s or half the lease); segments wait meanwhile. Every call is bounded
//! (T, the registry's request timeout: a transaction T, a join 3 T (4 T when it failed and
//! revokes its new lease once more, and up to 1 s more as a failed join's client shuts its
//! runtime down), a rejoin 6 T; the cluster crate lists them) and the stop is checked between
//! calls, so the thread sees the daemon's stop within a tick plus one call (a join up to
//! 4 T + 1 s, or a rejoin up to 6 T). Then it leaves the cluster at once
//! (revoking the lease, its segments vanishing: T, and 1 s for the client's runtime; up to
//! 3 T + 1 s when rejoins' revokes of old leases failed, which are revoked too): the data plane stops serving
//! within a tick of the stop, and a node still listed would send peers' fetches to an address
//! that refuses them. Then, without etcd, it journals every commit still queued and those the
//! connection threads hand over while they finish their last request, until the server says
//! they have all ended (at most [`LAST_COMMITS_WAIT_MAX`]): a commit left out of the manifest
//! is never registered for the life of the pool (its blocks are not committed again); the next
//! start registers what it journalled. A leave that revoked every lease of the node that may
//! hold entries then rewrites the manifest with the held segments alone, when it holds a dropped
//! record: those of deletes made while joined (or queued, their entries gone with the lease)
//! would otherwise have the next start delete them all again before its first join.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tutti_cluster::layout::FINGERPRINTS_MAX;
use tutti_cluster::{
    segments_of, ClusterClient, ClusterConfig, ClusterError, ClusterNode, MemberRecord, Members, ModelSpace, Rejoined, Segment,
};

use super::fetched::FetchedCopies;
use super::held::{HeldSegment, HeldSegments};
use super::manifest::Manifest;
use super::{AgentState, ClusterMetrics, Committed, Inbox};
use crate::server::StopHandle;
use crate::session::StoreState;

/// Committed requests taken per pass (the rest wait in the queue for the next).
const COMMITS_PER_PASS: usize = 256;
/// etcd transactions of (un)registration per pass.
pub const TRANSACTIONS_PER_PASS: usize = 32;
/// Members of another key secret one warning names at most (it counts them all).
const OTHER_SECRET_NODES_NAMED: usize = 8;
/// Passes that try the members' key secret comparison after a join before it is given up (its
/// gauge then reads -1 until the next join).
const KEY_SECRET_CHECK_TRIES: u32 = 3;
/// Broken segments waiting to be unregistered at most; past it the node rejoins instead (a
/// new lease: the old one's registrations vanish with it when it is revoked or expires).
const UNREGISTER_QUEUE_MAX: usize = 1 << 16;
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
/// The longest the stopped registrar waits for the connection threads to end (the server
/// ends each within a tick, one request and a frame timeout, and says so once they all have):
/// past it, a commit still to come is counted as dropped.
pub const LAST_COMMITS_WAIT_MAX: Duration = Duration::from_secs(30);
/// Passes of [`COMMITS_PER_PASS`] one drain takes at most before it looks at the clock again.
const DRAIN_PASSES_MAX: usize = 64;
const BACKOFF_MAX: Duration = Duration::from_secs(5);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How [`Registrar::drain`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drained {
    /// The queue is empty.
    Empty,
    /// Every sender is gone (the queue is empty, and stays so).
    Disconnected,
    /// Its bound on passes came first: more may be queued.
    More,
}

/// What the daemon's start recovered for the registrar (`ClusterAgent::start`).
pub(super) struct Recovered {
    /// Segments the manifest listed whose blocks the pool still holds.
    pub held: HeldSegments,
    /// The manifest, rewritten with those and `stale` (as dropped records).
    pub manifest: Manifest,
    /// Segments the manifest listed that the pool no longer holds (their registrations, if
    /// any, are deleted before the first join).
    pub stale: Vec<(ModelSpace, Segment)>,
    /// The lease the previous process recorded in the manifest (0: none): `stale` is deleted
    /// only while the member key is absent or under it.
    pub previous_lease: i64,
}

/// See the module docs.
pub(crate) struct Registrar {
    config: ClusterConfig,
    record: MemberRecord,
    inbox: Inbox,
    metrics: ClusterMetrics,
    state: Arc<AgentState>,
    held: HeldSegments,
    /// `None` once a write failed (logged and counted; the next start rewrites it).
    manifest: Option<Manifest>,
    node: Option<ClusterNode>,
    /// Deletes to make under the current lease: broken segments it may still list, and, from the
    /// first join, the stale entries found after the first pass's first read (the previous
    /// process's registrations: `stale`). The join needed the member key absent, so the previous
    /// main lease was gone by then; a rejoin that clears the queue clears those too.
    to_unregister: Vec<(ModelSpace, Segment)>,
    /// Before the first join: segments the previous process may have registered that this pool
    /// no longer holds (from the manifest, and those evicted since), to delete first (those
    /// found after the first pass's first read: the join moves them to `to_unregister`).
    stale: Vec<(ModelSpace, Segment)>,
    /// `stale[..n]` are the deletes still owed before the first join: what was stale at the
    /// first `forget_stale`'s first read, less those made (`None` until that read, and again
    /// after a failed join, so the next pass counts what was evicted while the join waited).
    /// Kept across passes until a join is tried: counted again at each pass, it took in what
    /// the previous pass had found broken after its first read, so evictions breaking
    /// `txn_ops_max` segments per delete held a backlog longer than one pass at its size and
    /// the node never joined.
    stale_owed: Option<usize>,
    /// Fetched segments not registered (`fetched.rs`): a commit's segments among them are not
    /// held nor registered. Locked under the pool's lock.
    fetched: Arc<Mutex<FetchedCopies>>,
    /// The previous process's lease, from the manifest (0: none).
    previous_lease: i64,
    /// The manifest holds dropped records of `stale` (the start's rewrite keeps them, and an
    /// eviction before the first join journals one): rewritten without them at the first
    /// join, once they are deleted ([`Registrar::rewrite_manifest`]), or by a compaction in the
    /// read of the queue just after the join, which then stands in for that rewrite.
    stale_journalled: bool,
    /// Rewrites of the manifest made (compactions, the first join's, a clean stop's): the first
    /// join's is not made again when the read between the join and it compacted.
    manifest_rewrites: u64,
    /// The unregister queue overflowed: rejoin rather than unregister one by one.
    rejoin_needed: bool,
    /// Entries of this node may be under a lease a rejoin left (its revoke failed): queued
    /// deletes, and held segments not yet registered under the current lease. Set by a rejoin
    /// that left the lease the node last joined under (`Rejoined::old_lease_id`: everything of
    /// the node was under it, never under a lease a failed rejoin orphaned), kept by one that left
    /// only earlier leases while set (`Rejoined::left`: those it could not revoke, and those an
    /// earlier rejoin gave up revoking, past the two a node keeps, less than a TTL ago — longer
    /// lived if a new etcd leader extended them, which this cannot see); cleared once the queue
    /// is empty and every held segment is registered under the current lease (a put under it
    /// moved each key off the old lease).
    left_may_hold: bool,
    /// A rejoin was attempted and has not succeeded yet. `ClusterNode::rejoin` marks the node
    /// lost before it tries, and a failed attempt leaves it so: that is this process's doing,
    /// not a loss etcd reported, so it is not counted again (nor at all for a rejoin asked for
    /// with the lease still live, `rejoin_needed`).
    rejoining: bool,
    /// Passes left to try comparing the members' key secret tags with this node's
    /// ([`Registrar::compare_key_secrets`]): [`KEY_SECRET_CHECK_TRIES`] after a join or rejoin,
    /// 0 once compared or given up.
    key_secret_tries_left: u32,
    backoff: Duration,
    next_attempt: Instant,
    /// Scratch.
    departed: Vec<u64>,
    removed: Vec<HeldSegment>,
    segments: Vec<Segment>,
    ids: Vec<u32>,
}

impl Registrar {
    pub(super) fn new(
        config: ClusterConfig,
        record: MemberRecord,
        inbox: Inbox,
        metrics: ClusterMetrics,
        state: Arc<AgentState>,
        recovered: Recovered,
        fetched: Arc<Mutex<FetchedCopies>>,
    ) -> Registrar {
        let Recovered { held, manifest, stale, previous_lease } = recovered;
        let stale_journalled = !stale.is_empty();
        Registrar {
            config,
            record,
            inbox,
            metrics,
            state,
            held,
            manifest: Some(manifest),
            node: None,
            to_unregister: Vec::new(),
            stale,
            stale_owed: None,
            fetched,
            previous_lease,
            stale_journalled,
            manifest_rewrites: 0,
            rejoin_needed: false,
            left_may_hold: false,
            rejoining: false,
            key_secret_tries_left: 0,
            backoff: BACKOFF_FIRST,
            next_attempt: Instant::now(),
            departed: Vec::new(),
            removed: Vec::new(),
            segments: Vec::new(),
            ids: Vec::new(),
        }
    }

    /// Runs until `stop`, leaves the cluster, then journals the last commits
    /// ([`Registrar::finish`]).
    pub(crate) fn run(mut self, store: &Mutex<StoreState>, stop: &StopHandle, tick: Duration) {
        let mut commits = Vec::with_capacity(COMMITS_PER_PASS);
        loop {
            match self.inbox.recv_timeout(tick) {
                Ok(commit) => commits.push(commit),
                Err(RecvTimeoutError::Timeout) => {}
                // Every sender is gone: the daemon is going away.
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if stop.is_stopped() {
                break;
            }
            while commits.len() < COMMITS_PER_PASS {
                match self.inbox.try_recv() {
                    Ok(commit) => commits.push(commit),
                    Err(_) => break,
                }
            }
            let compacted = self.update_local(store, &commits);
            commits.clear();
            if compacted {
                // Not the compaction and the pass's first call both on the queue alone.
                self.take_commits(store);
            }
            if Instant::now() >= self.next_attempt {
                match self.talk_to_etcd(store, stop) {
                    Ok(()) => {
                        self.backoff = BACKOFF_FIRST;
                        self.state.failing.store(false, Ordering::Relaxed);
                    }
                    Err(error) => self.failed(error),
                }
            }
            self.publish();
        }
        self.stopped(store, tick, commits, LAST_COMMITS_WAIT_MAX);
    }

    /// After the stop: leaves the cluster, journals the last commits ([`Registrar::finish`],
    /// `commits`, and those handed over for up to `wait_max`), and writes the manifest out.
    fn stopped(&mut self, store: &Mutex<StoreState>, tick: Duration, commits: Vec<Committed>, wait_max: Duration) {
        // Leave first: the data plane stops serving within a tick of the stop, so a node still
        // listed would send peers' fetches to an address that refuses them, for as long as
        // the journalling below waits on a connection thread (a frame timeout, up to
        // LAST_COMMITS_WAIT_MAX). Journalling is local and needs no lease.
        let nothing_listed = self.leave();
        self.after_leave(nothing_listed, store, tick, commits, wait_max);
    }

    /// [`Registrar::stopped`] after its leave, which answered `nothing_listed`
    /// ([`Registrar::leave`]; a test calls the leave itself, to see that answer).
    fn after_leave(
        &mut self,
        nothing_listed: bool,
        store: &Mutex<StoreState>,
        tick: Duration,
        commits: Vec<Committed>,
        wait_max: Duration,
    ) {
        self.finish(store, tick, commits, wait_max);
        if nothing_listed {
            // Every entry of the node went with its leases: the deletes still queued, and the
            // dropped records of those made (each eviction while joined journals one, which
            // only a compaction removed), would have the next start delete them all again
            // before its first join. A rewrite with the held segments instead (every held
            // record, then fsyncs of the file and its directory: ~38 MB for 125k segments), so
            // only when the file holds a dropped record: without one, it says that already.
            self.to_unregister.clear();
            self.stale.clear();
            if self.manifest.as_ref().is_some_and(|manifest| manifest.dropped_records() > 0) {
                self.rewrite_manifest();
            }
        }
        self.flush_manifest();
    }

    /// After the stop and the leave, without etcd: journals `commits` and every commit queued,
    /// then those handed over until the server says the connection threads have ended, or
    /// `wait_max` passed; then closes the queue ([`Registrar::close_inbox`]). The next start
    /// registers them from the manifest.
    fn finish(&mut self, store: &Mutex<StoreState>, tick: Duration, mut commits: Vec<Committed>, wait_max: Duration) {
        let deadline = Instant::now() + wait_max;
        loop {
            // Read before the queue is emptied: every commit handed over before the flag was
            // set is in the queue by then (Acquire, against the server's Release).
            let ended = self.state.connections_ended.load(Ordering::Acquire);
            match self.drain(store, &mut commits) {
                Drained::Disconnected => break,
                Drained::Empty if ended => break,
                Drained::Empty | Drained::More => {}
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    waited = ?wait_max,
                    "the connection threads did not end in time: a commit after this is not journalled (counted as dropped)"
                );
                break;
            }
            if !ended {
                match self.inbox.recv_timeout(tick) {
                    Ok(commit) => commits.push(commit),
                    Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {}
                }
            }
        }
        self.close_inbox(store, &mut commits);
        self.publish();
    }

    /// Closes the queue, so that a commit handed over from now on is refused as disconnected
    /// (`ClusterAgent::hand_over` counts it in `commits_dropped` and logs it): one accepted into
    /// a queue nobody reads would be dropped with the registrar, neither journalled nor counted.
    /// A receiver whose sender is gone replaces the queue's; what the old one holds is journalled
    /// until a read finds it empty (at most [`DRAIN_PASSES_MAX`] passes: past it, what is left
    /// is logged) before it is dropped. Only a commit handed over between that last read and the
    /// drop, a few instructions, can still be lost uncounted.
    fn close_inbox(&mut self, store: &Mutex<StoreState>, commits: &mut Vec<Committed>) {
        let (_, closed) = std::sync::mpsc::sync_channel(0);
        let inbox = std::mem::replace(&mut self.inbox, closed);
        let mut passes = 0;
        loop {
            while commits.len() < COMMITS_PER_PASS {
                match inbox.try_recv() {
                    Ok(commit) => commits.push(commit),
                    Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => break,
                }
            }
            if commits.is_empty() {
                return;
            }
            self.update_local(store, commits);
            commits.clear();
            passes += 1;
            // Until a read finds it empty: more may have come during the journalling.
            if passes >= DRAIN_PASSES_MAX {
                tracing::warn!("commits still came after the wait for the connection threads: those queued now are not journalled");
                return;
            }
        }
    }

    /// Journals `commits` and what is queued, [`COMMITS_PER_PASS`] at a time, for at most
    /// [`DRAIN_PASSES_MAX`] passes.
    fn drain(&mut self, store: &Mutex<StoreState>, commits: &mut Vec<Committed>) -> Drained {
        for _ in 0..DRAIN_PASSES_MAX {
            let mut drained = Drained::More;
            while commits.len() < COMMITS_PER_PASS {
                match self.inbox.try_recv() {
                    Ok(commit) => commits.push(commit),
                    Err(TryRecvError::Empty) => {
                        drained = Drained::Empty;
                        break;
                    }
                    Err(TryRecvError::Disconnected) => {
                        drained = Drained::Disconnected;
                        break;
                    }
                }
            }
            let mut compacted = false;
            if !commits.is_empty() {
                compacted = self.update_local(store, commits);
                commits.clear();
            }
            // After a compaction, read again: what came during it is not left to the queue
            // together with the etcd call that follows.
            if drained != Drained::More && !compacted {
                return drained;
            }
        }
        Drained::More
    }

    /// Step 1 (module docs). Whether it compacted the manifest (every held record, then two
    /// fsyncs: ~38 MB for 125k segments), after which the queue is read again before any etcd
    /// call, so that the queue alone never covers both.
    fn update_local(&mut self, store: &Mutex<StoreState>, commits: &[Committed]) -> bool {
        let per_segment = usize::from(self.config.segment_blocks.get());
        let mut added: Vec<(ModelSpace, u32, usize, usize)> = Vec::new();
        {
            let mut store = lock(store);
            let complete = store.control.take_departures(&mut self.departed);
            let index = store.control.pool().index();
            let mut whole = |keys: &[u64]| keys.iter().all(|&key| index.get(key).is_some());
            let mut fetched = lock(&self.fetched);
            // Under the pool lock, as the fetch path's additions: a departure in a later batch
            // than an entry's window is the copy's own (`fetched.rs`).
            fetched.batch_taken();
            let mut present = |key: u64| index.get(key).is_some();
            if complete {
                for &key in &self.departed {
                    self.held.block_departed(key, &mut whole, &mut self.removed);
                    fetched.departed(key, &mut present);
                }
            } else {
                tracing::warn!("more blocks left the pool than were recorded: checking every held segment");
                self.held.recheck_all(&mut whole, &mut self.removed);
                fetched.recheck_all(&mut present);
            }
            for (position, commit) in commits.iter().enumerate() {
                if segments_of(&commit.keys, self.config.segment_blocks, &mut self.segments).is_err() {
                    continue;
                }
                for segment in &self.segments {
                    // `segment.index` counts within `commit.keys`; the prompt's starts earlier
                    // for a fetched segment handed over alone.
                    let start = segment.index as usize * per_segment;
                    let keys = &commit.keys[start..start + per_segment];
                    let Some(index) = commit.first_segment.checked_add(segment.index) else { continue };
                    // A fetched copy left unregistered stays so when a commit of a longer prompt
                    // (from block 0) includes it; a heavy hitter's was taken out of `fetched`.
                    if fetched.contains(&commit.space, segment.key) {
                        continue;
                    }
                    if !self.held.contains(&commit.space, segment.key) && whole(keys) && self.held.insert(commit.space, index, keys) {
                        added.push((commit.space, index, position, start));
                    }
                }
            }
        }
        self.queue_removed();
        for (space, index, position, start) in added {
            if let Some(manifest) = self.manifest.as_mut() {
                if let Err(error) = manifest.held(&space, index, &commits[position].keys[start..start + per_segment]) {
                    manifest_failed(&mut self.manifest, &self.metrics, error);
                }
            }
        }
        if let Some(manifest) = self.manifest.as_mut() {
            let pending = self.to_unregister.len() + self.stale.len();
            if manifest.records() > 2 * (self.held.len() + pending) as u64 + 4096 {
                // Compaction: the journal outgrew what it describes.
                let records = manifest.records();
                self.rewrite_manifest();
                tracing::debug!(records, "compacted the segment manifest");
                return true;
            } else if let Err(error) = manifest.flush() {
                manifest_failed(&mut self.manifest, &self.metrics, error);
            }
        }
        false
    }

    /// Rewrites the manifest with the held segments, the lease last recorded, and a dropped
    /// record for each delete still to make (queued, or stale before the first join), so a
    /// successor after a crash still makes them (a segment held again since is registered
    /// instead: left out). Deletes made are left out, so no later start makes them again.
    fn rewrite_manifest(&mut self) {
        let Some(manifest) = self.manifest.as_mut() else { return };
        let held = &self.held;
        let departed = self.to_unregister.iter().chain(&self.stale).filter(|(space, segment)| !held.contains(space, segment.key));
        let result = Manifest::rewrite_keeping(manifest.path(), manifest.segment_blocks(), manifest.lease_id(), held.iter(), departed)
            .map(|fresh| *manifest = fresh);
        match result {
            Ok(()) => self.manifest_rewrites += 1,
            Err(error) => manifest_failed(&mut self.manifest, &self.metrics, error),
        }
    }

    /// Journals the segments `update_local` found broken and queues their registrations for
    /// deletion: once joined, to unregister under this node's lease (a rejoin instead when the
    /// queue is full); before the first join, to forget with the stale ones — a segment
    /// recovered from the manifest may be registered under the previous process's lease (a
    /// restart within it after a SIGKILL), which would otherwise claim it until that lease
    /// expires. Past the queue's bound a stale one is left to that expiry (at most one TTL).
    fn queue_removed(&mut self) {
        let joined = self.node.is_some();
        for removed in self.removed.drain(..) {
            if let Some(manifest) = self.manifest.as_mut() {
                if let Err(error) = manifest.dropped(&removed.space, removed.segment.key) {
                    manifest_failed(&mut self.manifest, &self.metrics, error);
                }
            }
            let entry = (removed.space, removed.segment);
            if joined {
                if self.to_unregister.len() < UNREGISTER_QUEUE_MAX {
                    self.to_unregister.push(entry);
                } else {
                    self.rejoin_needed = true;
                }
            } else {
                // Its dropped record, written above, is one of the first join's to leave out.
                self.stale_journalled = true;
                if self.stale.len() < UNREGISTER_QUEUE_MAX {
                    self.stale.push(entry);
                }
            }
        }
    }

    /// Between two etcd calls of a pass: journals the commits queued (local work, no etcd).
    /// One pass may wait on etcd call after call (up to [`TRANSACTIONS_PER_PASS`] of
    /// unregistrations and registrations together, and as many deletes of stale segments
    /// before the first join, each up to T): a queue read only between passes filled
    /// meanwhile, and a commit refused by a full queue is never journalled, so never
    /// registered for the life of the pool. Only a single call (a join, up to 4 T + 1 s; a
    /// rejoin, up to 6 T), or the first join's rewrite of the manifest, is left to the queue's
    /// bound (`commits_queued_max`): a read that compacted the manifest reads again.
    fn take_commits(&mut self, store: &Mutex<StoreState>) {
        let mut commits = Vec::new();
        // `Drained::More` (over 16,384 queued, past any queue's bound in practice) leaves the
        // rest to the next read; `Disconnected` to the run loop's.
        self.drain(store, &mut commits);
        // The lease's last confirmation too: published only between passes, a long pass
        // against a slow etcd (dozens of calls, each up to T) read as a registry gone silent
        // although the keep-alive renewed the lease all along.
        self.publish();
    }

    /// Step 2 (module docs). The queue is read before each call ([`Registrar::take_commits`]).
    fn talk_to_etcd(&mut self, store: &Mutex<StoreState>, stop: &StopHandle) -> Result<(), ClusterError> {
        let fingerprints: Vec<[u8; 32]> = self.held.fingerprints().take(FINGERPRINTS_MAX).copied().collect();
        // More than a pass's share (or a stop): the next pass goes on before joining.
        if self.node.is_none() && !self.stale.is_empty() && !self.forget_stale(store, stop)? {
            return Ok(());
        }
        // Between calls: a stop is seen after the call in flight, not after the whole pass.
        if stop.is_stopped() {
            return Ok(());
        }
        if self.node.is_none() {
            // The run loop read the queue before the pass, and `forget_stale` (when called)
            // after its client's drop: only the join is left to the queue's bound.
            let record = MemberRecord { fingerprints: fingerprints.clone(), ..self.record.clone() };
            let node = match ClusterNode::join(self.config.clone(), record) {
                Ok(node) => node,
                Err(error) => {
                    // The next pass counts the stale entries again: a segment evicted while the
                    // join waits (NodeIdTaken for up to a TTL after a SIGKILL, the dead
                    // process's lease alive; or etcd away) may be registered under the previous
                    // lease, and is deleted before the next join rather than left listed until
                    // that lease expires. Any failure, not only NodeIdTaken: each means another
                    // pass before the join, with the same evictions to forget. The count is taken
                    // again only after the owed deletes were made and a join tried, so a steady
                    // eviction still cannot keep the node from joining.
                    self.stale_owed = None;
                    return Err(error);
                }
            };
            tracing::info!(node = %self.record.node, lease_id = node.health().lease_id, "joined the cluster");
            self.answered();
            self.record_lease(node.health().lease_id);
            self.joined_anew();
            // What `forget_stale` found broken after the first pass's first read (it deleted only
            // what was stale then, so that steady eviction cannot hold the join back pass after
            // pass):
            // deleted under this node's lease instead, as any unregistration. The join
            // succeeded, so no live process holds the id; a delete names the node, not the lease.
            self.to_unregister.append(&mut self.stale);
            self.node = Some(node);
            // Read before the rewrite below (every held record, then two fsyncs: ~38 MB for
            // 125k segments), so the queue alone covers the join or the rewrite, never both.
            // Joined now, a segment it finds broken is queued for deletion under the new lease
            // and kept as a dropped record by the rewrite.
            let rewrites = self.manifest_rewrites;
            self.take_commits(store);
            // A compaction in that read wrote what the rewrite below would (the node set, the
            // stale entries moved to `to_unregister`): not written again.
            if std::mem::take(&mut self.stale_journalled) && self.manifest_rewrites == rewrites {
                // The stale deletes are made, but for those queued (kept by the rewrite as
                // dropped records until made): the others' dropped records (the start's rewrite
                // kept them for a successor should this process die first) would have every
                // later start make them again before its first join, until a compaction a node
                // of little churn may never reach. A rewrite that fails leaves the file as it
                // was, with this join's lease (recorded above); the manifest is then no longer
                // written.
                self.rewrite_manifest();
            }
            // A node lost right after its join would rejoin next: a second call.
            if stop.is_stopped() {
                return Ok(());
            }
        }
        let Some(node) = self.node.as_mut() else { return Ok(()) };
        if node.health().lost || self.rejoin_needed {
            // Counted once per loss: a failed rejoin leaves the node marked lost, and the
            // next pass's attempt is the same loss's.
            if node.health().lost && !self.rejoining {
                self.metrics.lease_losses.inc();
                tracing::warn!(lease_id = node.health().lease_id, "the cluster lease is lost; rejoining");
            }
            self.rejoining = true;
            self.take_commits(store);
            let Some(node) = self.node.as_mut() else { return Ok(()) };
            let rejoined = node.rejoin()?;
            // `answered`, with `node` still borrowed from `self.node`.
            self.state.failing.store(false, Ordering::Relaxed);
            self.rejoining = false;
            tracing::info!(lease_id = node.health().lease_id, "rejoined the cluster");
            let lease_id = node.health().lease_id;
            if let Some(manifest) = self.manifest.as_mut() {
                if let Err(error) = manifest.lease(lease_id) {
                    manifest_failed(&mut self.manifest, &self.metrics, error);
                }
            }
            self.rejoin_needed = false;
            self.held.unregister_all();
            self.rejoined(rejoined);
            self.metrics.joins.inc();
            self.key_secret_tries_left = KEY_SECRET_CHECK_TRIES;
        }
        let Some(node) = self.node.as_mut() else { return Ok(()) };
        self.state.lease_id.store(node.health().lease_id, Ordering::Relaxed);
        if stop.is_stopped() {
            return Ok(());
        }
        if node.record().fingerprints != fingerprints {
            let record = MemberRecord { fingerprints, ..node.record().clone() };
            self.take_commits(store);
            let Some(node) = self.node.as_mut() else { return Ok(()) };
            node.update_record(record)?;
            self.answered();
        }
        if self.key_secret_tries_left > 0 {
            if stop.is_stopped() {
                return Ok(());
            }
            self.take_commits(store);
            let Some(node) = self.node.as_ref() else { return Ok(()) };
            // A diagnostic, not part of the registry's state: a failure fails nothing (not
            // counted as a registry error); the gauge reads -1 (unknown) until a later pass's
            // try succeeds, up to KEY_SECRET_CHECK_TRIES per join.
            match node.members() {
                Ok(members) => {
                    self.answered();
                    self.key_secret_tries_left = 0;
                    self.compare_key_secrets(&members);
                }
                Err(error) => {
                    self.key_secret_tries_left -= 1;
                    self.metrics.members_other_key_secret.set(-1);
                    tracing::warn!(
                        %error,
                        tries = KEY_SECRET_CHECK_TRIES - self.key_secret_tries_left,
                        gave_up = self.key_secret_tries_left == 0,
                        "could not list the cluster's members to compare their key secrets with this node's (`tutti cluster status` shows them)"
                    );
                }
            }
        }
        // One transaction per batch: each also puts the member key (the node's fence).
        let Some(batch_max) = self.node.as_ref().map(ClusterNode::segments_per_transaction) else { return Ok(()) };
        let mut transactions = 0;
        // One loop, deletes and registrations taking turns while both wait: the queue read
        // before each call may queue a delete, and on a busy node with a full pool (a commit
        // evicting a held segment per etcd round trip) deletes first, always, left no turn
        // to registrations. The order per segment is kept instead: segment A registered, found
        // broken (its delete queued) and held again before the next call must not have that
        // delete sent after its new put (A held and counted as registered, gone from the
        // registry), so a registration takes the queued deletes of its segments out of the
        // queue (`superseded`). A delete still queued when its segment's put goes out was
        // queued before it, and the put replaced the key; one queued after (A broken again)
        // goes out.
        let mut delete_turn = true;
        while transactions < TRANSACTIONS_PER_PASS && !stop.is_stopped() {
            self.take_commits(store);
            let Some(node) = self.node.as_ref() else { break };
            if delete_turn && !self.to_unregister.is_empty() {
                let within = self.to_unregister.len();
                let (space, batch) = take_batch(&mut self.to_unregister, within, batch_max);
                if let Err(error) = node.unregister(&space, &batch) {
                    self.to_unregister.extend(batch.into_iter().map(|segment| (space, segment)));
                    return Err(error);
                }
                self.answered();
                tracing::debug!(segments = batch.len(), "unregistered segments");
                self.metrics.unregistered_segments.inc_by(batch.len() as u64);
                transactions += 1;
                delete_turn = false;
                continue;
            }
            delete_turn = true;
            let Some(space) = self.held.next_to_register(batch_max, &mut self.ids, &mut self.segments) else {
                if self.to_unregister.is_empty() {
                    break;
                }
                continue;
            };
            match node.register(&space, &self.segments) {
                Ok(sent) => {
                    self.answered();
                    self.held.registered_now(&self.ids);
                    superseded(&mut self.to_unregister, &space, &self.segments);
                    self.metrics.registered_segments.inc_by(self.segments.len() as u64);
                    self.metrics.registration_transactions.inc_by(sent as u64);
                    tracing::debug!(segments = self.segments.len(), "registered segments");
                    transactions += sent;
                }
                Err(error) => {
                    self.held.register_later(&self.ids);
                    return Err(error);
                }
            }
        }
        self.settled();
        Ok(())
    }

    /// Nothing of the node is under a lease a rejoin left once no delete is queued and every
    /// held segment is registered under the current lease (`left_may_hold`).
    fn settled(&mut self) {
        if self.to_unregister.is_empty() && self.held.registered() == self.held.len() {
            self.left_may_hold = false;
        }
    }

    /// Deletes this node id's entries of the segments stale at the first pass's first read of
    /// the queue (since the last failed join: `stale_owed`; up to [`TRANSACTIONS_PER_PASS`]
    /// transactions per pass), before the first join and so before any registration of this
    /// process: nothing it registers itself is deleted. Only while the member key is absent or
    /// under the previous process's lease: a live process holding the id (another tuttid
    /// started with it) keeps its entries, and the stale list is dropped (whatever the previous
    /// process registered vanishes with its lease). Whether those are all deleted, so the pass
    /// may join: segments later reads find broken wait in `stale` behind them, and the join
    /// queues them for deletion under its lease. Deleting them here too let a busy node (a
    /// commit evicting a held segment per etcd round trip) spend every pass on deletes and never
    /// join.
    fn forget_stale(&mut self, store: &Mutex<StoreState>, stop: &StopHandle) -> Result<bool, ClusterError> {
        if self.stale_owed == Some(0) {
            return Ok(true);
        }
        let client = ClusterClient::connect(self.config.clone())?;
        let batch_max = self.config.txn_ops_max;
        let mut transactions = 0;
        self.take_commits(store);
        // `stale[..owed]`: stale at the first pass's first read and not deleted yet. A later
        // read appends; a failed batch goes back in front.
        let mut owed = *self.stale_owed.get_or_insert(self.stale.len());
        while owed > 0 && transactions < TRANSACTIONS_PER_PASS && !stop.is_stopped() {
            if transactions > 0 {
                self.take_commits(store);
            }
            let (space, batch) = take_batch(&mut self.stale, owed, batch_max);
            match client.forget(&self.record.node, self.previous_lease, &space, &batch) {
                Ok(_) => self.answered(),
                Err(error @ ClusterError::NodeIdTaken { .. }) => {
                    tracing::warn!(%error, segments = batch.len() + self.stale.len(), "another process holds this node id: its registrations are not deleted");
                    self.stale.clear();
                    self.stale_owed = Some(0);
                    return Err(error);
                }
                Err(error) => {
                    self.stale.splice(0..0, batch.into_iter().map(|segment| (space, segment)));
                    return Err(error);
                }
            }
            owed -= batch.len();
            self.stale_owed = Some(owed);
            tracing::info!(segments = batch.len(), "deleted registrations of segments this pool no longer holds");
            self.metrics.unregistered_segments.inc_by(batch.len() as u64);
            transactions += 1;
        }
        // The client's drop shuts its runtime down (up to 1 s), then the join follows with no
        // read of the queue before it: the queue is read after the drop, so the join alone
        // (up to 4 T + 1 s) is left to the queue's bound. A segment that read finds broken
        // joins `stale`, queued for deletion by the join.
        drop(client);
        self.take_commits(store);
        Ok(owed == 0)
    }

    /// Records the lease joined under in the manifest, for a successor after a crash.
    fn record_lease(&mut self, lease_id: i64) {
        if let Some(manifest) = self.manifest.as_mut() {
            if let Err(error) = manifest.lease(lease_id) {
                manifest_failed(&mut self.manifest, &self.metrics, error);
            }
        }
    }

    /// After a rejoin: the old lease's registrations vanished with it, so the unregister queue
    /// has nothing left to do — unless a lease that may hold queued entries lives on: the old
    /// lease (the one the node last joined under, whichever lease a failed rejoin left as the
    /// node's since), its revoke failed, or an earlier one is left (the rejoin tried it again and
    /// failed, or an earlier rejoin gave it up less than a TTL ago: `Rejoined::left`) while
    /// entries may still be under it (`left_may_hold`). Then they live until it expires (up
    /// to a TTL), listing segments this pool no longer holds, and the queue is kept: this pass
    /// deletes them under the new lease (a guarded delete of the key, which names the node, not
    /// the lease). Clearing it regardless left them claimed for that TTL; keeping it whenever an
    /// earlier lease was left kept a full queue (the rejoin's reason) whose entries had all
    /// gone with the revoked old lease.
    fn rejoined(&mut self, rejoined: Rejoined) {
        self.left_may_hold = !rejoined.old_lease_revoked || (self.left_may_hold && !rejoined.left.is_empty());
        if !self.left_may_hold {
            self.to_unregister.clear();
        } else if !self.to_unregister.is_empty() {
            tracing::warn!(
                leases = ?rejoined.left,
                segments = self.to_unregister.len(),
                "leases of this node were not revoked: their registrations of segments no longer held are deleted under the new one"
            );
        }
    }

    /// A new lease: nothing of this node is registered under it.
    fn joined_anew(&mut self) {
        self.held.unregister_all();
        self.to_unregister.clear();
        self.rejoin_needed = false;
        self.left_may_hold = false;
        self.metrics.joins.inc();
        self.key_secret_tries_left = KEY_SECRET_CHECK_TRIES;
    }

    /// After a join: the members whose pools have another key secret than this node's share
    /// nothing with it (the same prompt has other block keys on each side), and nothing else
    /// would show it. Counted in `cluster_members_other_key_secret` and logged, naming up to
    /// [`OTHER_SECRET_NODES_NAMED`] of them. A member that joins later is seen at its own join.
    /// (Past `tutti_cluster::MEMBERS_MAX` members the list is cut short, and so is the count.)
    fn compare_key_secrets(&self, members: &Members) {
        let own = self.record.key_secret_tag;
        let others: Vec<&MemberRecord> =
            members.nodes.iter().filter(|member| member.node != self.record.node && member.key_secret_tag != own).collect();
        self.metrics.members_other_key_secret.set(others.len() as i64);
        if others.is_empty() {
            return;
        }
        let named: Vec<String> =
            others.iter().take(OTHER_SECRET_NODES_NAMED).map(|member| format!("{} ({})", member.node, member.key_secret_tag)).collect();
        tracing::warn!(
            members = others.len(),
            // Past `MEMBERS_MAX` members the list read was cut short: the count is partial.
            members_list_truncated = members.truncated,
            key_secret = %own,
            nodes = %named.join(", "),
            "cluster members whose pools have another key secret than this node's share no segments with it (the same prompt has other block keys on each side); format every node's pool with the cluster's one --key-secret-file"
        );
    }

    /// An etcd call of a pass succeeded: the registry answers again, told at once rather than
    /// at the end of the pass (dozens of calls later, each up to T, read as unavailable).
    fn answered(&self) {
        self.state.failing.store(false, Ordering::Relaxed);
    }

    fn failed(&mut self, error: ClusterError) {
        self.metrics.registry_errors.inc();
        self.state.failing.store(true, Ordering::Relaxed);
        tracing::warn!(%error, retry_in = ?self.backoff, "cluster registry call failed");
        *lock(&self.state.last_error) = error.to_string();
        self.next_attempt = Instant::now() + self.backoff;
        let most = BACKOFF_MAX.min(self.config.lease_ttl / 2);
        self.backoff = (self.backoff * 2).min(most);
    }

    fn publish(&self) {
        if let Some(node) = self.node.as_ref() {
            let health = node.health();
            let since_ms = u64::try_from(health.since_renewal.as_millis()).unwrap_or(u64::MAX);
            self.state.confirmed_at_ms.store(self.state.now_ms().saturating_sub(since_ms), Ordering::Relaxed);
        }
        let joined = self.node.as_ref().is_some_and(|node| !node.health().lost);
        self.metrics.joined.set(i64::from(joined));
        self.metrics.segments_held.set(self.held.len() as i64);
        // A lost lease took its registrations with it (they are registered again once
        // rejoined): none are listed meanwhile, whatever `held` recorded under the old lease.
        let registered = if joined { self.held.registered() } else { 0 };
        self.metrics.segments_registered.set(registered as i64);
    }

    /// Leaves the cluster: the lease is revoked, so this node's record and segments vanish now
    /// rather than a TTL later (bounded by the request timeout T, and 1 s for the client's
    /// runtime to shut down; up to 3 T + 1 s after rejoins whose revokes failed, those leases
    /// revoked too). Whether nothing of this node is listed now: it had joined, every lease of
    /// it that may hold entries is gone (`ClusterNode::leave`), and no lease a rejoin left may
    /// hold any (`left_may_hold`). Never joined, the stale segments may still be listed.
    fn leave(&mut self) -> bool {
        let mut nothing_listed = false;
        if let Some(node) = self.node.take() {
            nothing_listed = node.leave() && !self.left_may_hold;
            tracing::info!("left the cluster");
        }
        self.metrics.joined.set(0);
        self.metrics.segments_registered.set(0);
        nothing_listed
    }

    /// The manifest's last write, once nothing more is journalled.
    fn flush_manifest(&mut self) {
        if let Some(manifest) = self.manifest.as_mut() {
            if let Err(error) = manifest.flush() {
                manifest_failed(&mut self.manifest, &self.metrics, error);
            }
        }
    }
}

/// After `segments` of `space` were registered: their deletes still queued are dropped. Each
/// was queued when its segment broke, before the segment was held again and so before this
/// put, which replaced the key under the current lease (off any lease a rejoin left too): sent
/// now, it would delete the registration of a segment this node holds. A delete queued after
/// the put (the segment broken again) is not here yet, and goes out.
fn superseded(to_unregister: &mut Vec<(ModelSpace, Segment)>, space: &ModelSpace, segments: &[Segment]) {
    if to_unregister.is_empty() {
        return;
    }
    let keys: std::collections::HashSet<_> = segments.iter().map(|segment| segment.key).collect();
    to_unregister.retain(|(other, segment)| other != space || !keys.contains(&segment.key));
}

fn manifest_failed(manifest: &mut Option<Manifest>, metrics: &ClusterMetrics, error: std::io::Error) {
    metrics.manifest_errors.inc();
    tracing::error!(%error, "writing the segment manifest failed; it is not written again until restart");
    *manifest = None;
}

/// Takes one transaction's batch off the front of `queue`: up to `batch_max` segments of the
/// first entry's model space among its first `within` entries, in order; the rest stay, in
/// order. `queue` must not be empty.
fn take_batch(queue: &mut Vec<(ModelSpace, Segment)>, within: usize, batch_max: usize) -> (ModelSpace, Vec<Segment>) {
    let space = queue[0].0;
    let mut batch = Vec::with_capacity(batch_max.min(within));
    let mut position = 0;
    queue.retain(|&(other, segment)| {
        let taken = position < within && other == space && batch.len() < batch_max;
        position += 1;
        if taken {
            batch.push(segment);
        }
        !taken
    });
    (space, batch)
}

#[cfg(test)]
mod tests {
    use tutti_cluster::{ClusterId, NodeId, SegmentBlocks, SegmentKey};

    use super::*;
    use crate::test_tracing::{EventSubscriber, OnEvent};

    /// Node "a"'s member record, as the tests' registrars and the processes they stand for write it.
    fn record_of_a() -> MemberRecord {
        record_of("a", [1; 4])
    }

    /// Node `node`'s member record, its pool's key secret tag `tag`.
    fn record_of(node: &str, tag: [u8; 4]) -> MemberRecord {
        MemberRecord {
            node: NodeId::new(node).unwrap(),
            key_secret_tag: tutti_cluster::KeySecretTag::new(tag),
            address: "127.0.0.1:9".into(),
            capacity_bytes: 0,
            fingerprints: Vec::new(),
        }
    }

    /// A one-device pool on a software controller, as the daemon's store.
    fn store() -> Mutex<StoreState> {
        use nvme_driver::{Controller, ControllerConfig, NamespaceId};
        use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};
        use objstore::{format_pool, FormatParams, ModelGeometry, Pool, PoolTarget, StoreControl};

        let config =
            EmuConfig::default().with_backing(Backing::Memory { bytes: 8 << 20 }).with_namespaces(vec![NamespaceConfig::new(4096, None)]);
        let device = EmuDevice::start(config).unwrap();
        let controller = Arc::new(Controller::init(device.clone(), ControllerConfig::default()).unwrap());
        let targets = vec![PoolTarget { controller, namespace: NamespaceId(1) }];
        let geometry = ModelGeometry { layers: 1, kv_heads: 8, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let params = FormatParams { slot_count_max: Some(64), ..FormatParams::new(geometry) };
        format_pool(&targets, &params).unwrap();
        let (pool, _) = Pool::open(targets, Some(&geometry)).unwrap();
        let control = StoreControl::new(pool, 16).unwrap();
        let relay = crate::relay::DoorbellRelay::start(crate::relay::RelayConfig::default()).unwrap();
        Mutex::new(StoreState { control, emulators: vec![Some(device)], relay })
    }

    /// Points `registrar` at the local `etcd`, each request within 1 s.
    fn use_etcd(registrar: &mut Registrar, etcd: &tutti_cluster::local_etcd::LocalEtcd) {
        registrar.config.endpoints = etcd.endpoints();
        registrar.config.request_timeout = Duration::from_secs(1);
    }

    /// A registrar of node "a" in cluster `cluster` (16-block segments, etcd unreachable), over
    /// a manifest in `directory` holding `held` under `previous_lease`, as recovered at a start.
    fn registrar_of(
        directory: &std::path::Path,
        cluster: &str,
        held: HeldSegments,
        previous_lease: i64,
        inbox: std::sync::mpsc::Receiver<Committed>,
    ) -> Registrar {
        registrar_recovered(directory, cluster, held, Vec::new(), previous_lease, inbox)
    }

    /// [`registrar_of`], with `stale` recovered too (kept in the manifest as dropped records,
    /// as the start's rewrite does).
    fn registrar_recovered(
        directory: &std::path::Path,
        cluster: &str,
        held: HeldSegments,
        stale: Vec<(ModelSpace, Segment)>,
        previous_lease: i64,
        inbox: std::sync::mpsc::Receiver<Committed>,
    ) -> Registrar {
        let blocks = SegmentBlocks::new(16).unwrap();
        let config = ClusterConfig::new(vec!["http://127.0.0.1:9".into()], ClusterId::new(cluster).unwrap(), blocks);
        let record = record_of_a();
        let manifest = Manifest::rewrite_keeping(&directory.join("segments"), blocks, previous_lease, held.iter(), stale.iter()).unwrap();
        let recovered = Recovered { held, manifest, stale, previous_lease };
        let fetched = Arc::new(Mutex::new(FetchedCopies::new(16)));
        Registrar::new(config, record, inbox, ClusterMetrics::default(), Arc::new(super::super::AgentState::new()), recovered, fetched)
    }

    /// Commits `keys` (blocks 0.. of a prompt) to `store`'s index, as a client's store would.
    fn commit(store: &Mutex<StoreState>, keys: &[u64]) {
        let mut store = lock(store);
        let engine_blocks: Vec<u32> = (0..keys.len() as u32).collect();
        let plan = store.control.reserve_store(keys, &engine_blocks, &mut objstore::NoLender).unwrap();
        store.control.commit_store(plan.handle, None, &mut objstore::NoLender).unwrap();
    }

    /// Node "a"'s registrar after the pass that committed the 48-block prompt `keys` (1..=48),
    /// of which this node fetched segments 0 and 1 (not heavy hitters: replicas in waiting):
    /// only segment 2, computed here, is held. Fields drop in the order the tests' locals did.
    struct FetchedPrompt {
        store: Mutex<StoreState>,
        keys: Vec<u64>,
        space: ModelSpace,
        registrar: Registrar,
        _sender: std::sync::mpsc::SyncSender<Committed>,
        _directory: tempfile::TempDir,
    }

    impl FetchedPrompt {
        fn new(cluster: &str) -> Self {
            let directory = tempfile::tempdir().unwrap();
            let (sender, inbox) = std::sync::mpsc::sync_channel(1);
            let mut registrar = registrar_of(directory.path(), cluster, HeldSegments::default(), 0, inbox);
            let store = store();
            let space = ModelSpace::new([1; 32], 0, 1).unwrap();
            let keys: Vec<u64> = (1..=48).collect();
            commit(&store, &keys);
            {
                let mut fetched = lock(&registrar.fetched);
                fetched.fetched(&space, SegmentKey::new(16).unwrap());
                fetched.fetched(&space, SegmentKey::new(32).unwrap());
            }
            registrar.update_local(&store, &[Committed { space, keys: keys.clone(), first_segment: 0 }]);
            let held: Vec<u32> = registrar.held.iter().map(|held| held.segment.index).collect();
            assert_eq!(held, [2], "the fetched segments 0 and 1 were held (to be registered) from a later commit");
            Self { store, keys, space, registrar, _sender: sender, _directory: directory }
        }

        /// Another prompt fills the pool, departures tracked: the fetched copies leave it.
        fn evict_the_fetched_copies(&self) {
            lock(&self.store).control.track_departures(1024);
            let other: Vec<u64> = (1001..=1064).collect();
            commit(&self.store, &other);
            assert!(lock(&self.store).control.pool().index().get(16).is_none(), "the test needs the fetched copies evicted");
        }

        /// The prompt, computed here, is committed again: this node's own work, so the pass
        /// must hold (to register) all three segments.
        fn commit_again_and_see_all_held(&mut self) {
            commit(&self.store, &self.keys);
            self.registrar.update_local(&self.store, &[Committed { space: self.space, keys: self.keys.clone(), first_segment: 0 }]);
            let mut held: Vec<u32> = self.registrar.held.iter().map(|held| held.segment.index).collect();
            held.sort_unstable();
            assert_eq!(held, [0, 1, 2], "segments computed here after the fetched copies left were not registered");
        }
    }

    #[test]
    fn members_of_another_key_secret_are_counted_and_this_node_never() {
        // Goal: after a join the registrar counts the members whose pools have another key
        // secret than its own (they share nothing with it) in
        // `cluster_members_other_key_secret`: not those of its own secret, and never this
        // node, even under a record of another tag (a previous process's, formatted anew);
        // the next join's count replaces the last.
        let directory = tempfile::tempdir().unwrap();
        let (_sender, inbox) = std::sync::mpsc::sync_channel(1);
        let registrar = registrar_of(directory.path(), "secrets", HeldSegments::default(), 0, inbox);
        let members = |nodes: Vec<MemberRecord>| Members { nodes, ..Members::default() };
        registrar.compare_key_secrets(&members(vec![
            record_of("a", [9; 4]),
            record_of("b", [2; 4]),
            record_of("c", [1; 4]),
            record_of("d", [3; 4]),
        ]));
        assert_eq!(registrar.metrics.members_other_key_secret.get(), 2);
        registrar.compare_key_secrets(&members(vec![record_of_a(), record_of("c", [1; 4])]));
        assert_eq!(registrar.metrics.members_other_key_secret.get(), 0);
    }

    #[test]
    fn a_join_compares_the_members_key_secrets_and_a_failed_listing_is_tried_again_then_given_up() {
        // Goal: the pass that joins lists the members once and counts those of another key
        // secret (here b); a listing that fails (etcd stalled) fails nothing, reads -1 on the
        // gauge and is tried at the next passes, then given up after KEY_SECRET_CHECK_TRIES;
        // a listing that succeeds is not repeated by later passes.
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let (_sender, inbox) = std::sync::mpsc::sync_channel(1);
        let mut registrar = registrar_of(directory.path(), "compare", HeldSegments::default(), 0, inbox);
        use_etcd(&mut registrar, &etcd);
        let _b = ClusterNode::join(registrar.config.clone(), record_of("b", [2; 4])).unwrap();
        let store = store();
        let stop = StopHandle::default();
        registrar.talk_to_etcd(&store, &stop).unwrap();
        assert!(registrar.node.is_some(), "a joined");
        assert_eq!((registrar.metrics.members_other_key_secret.get(), registrar.key_secret_tries_left), (1, 0));
        let ranges = etcd.requests_started(0, "Range").unwrap();
        registrar.talk_to_etcd(&store, &stop).unwrap();
        assert_eq!(etcd.requests_started(0, "Range").unwrap(), ranges, "a later pass listed the members again");

        // As after a rejoin, with etcd stalled.
        registrar.key_secret_tries_left = KEY_SECRET_CHECK_TRIES;
        etcd.pause(0).unwrap();
        for tries in 1..=KEY_SECRET_CHECK_TRIES {
            registrar.talk_to_etcd(&store, &stop).expect("the failed listing failed the pass");
            assert_eq!(registrar.metrics.members_other_key_secret.get(), -1);
            assert_eq!(registrar.key_secret_tries_left, KEY_SECRET_CHECK_TRIES - tries, "try {tries}");
        }
        etcd.resume(0).unwrap();
        assert_eq!(registrar.metrics.registry_errors.get(), 0, "a failed listing counted as a registry error");
        registrar.leave();
    }

    #[test]
    fn a_commit_of_a_longer_prompt_leaves_the_fetched_segments_in_it_unregistered() {
        // Goal: this node fetched segments 0 and 1 of a prompt (not heavy hitters: replicas in
        // waiting) and its client then stored the prompt plus a segment it computed. A store
        // hands the registrar its whole prefix from block 0; the segments this node fetched
        // are neither held nor registered from it (nor journalled), only the one it computed.
        // Before, every whole segment of the commit was registered, so under
        // `--cluster-replicate-after 0` ("never") fetched copies became replicas anyway.
        let mut prompt = FetchedPrompt::new("fetched");

        // The copies leave the pool (another prompt fills it) and the prompt is computed and
        // stored again: this node's own work, registered as any commit.
        prompt.evict_the_fetched_copies();
        prompt.registrar.update_local(&prompt.store, &[]);
        assert_eq!(lock(&prompt.registrar.fetched).len(), 0, "evicted copies are still remembered as fetched");
        prompt.commit_again_and_see_all_held();
    }

    #[test]
    fn a_fetched_copy_evicted_and_computed_again_between_two_passes_is_registered() {
        // Goal: as above, but the fetched copies leave the pool and the prompt is computed and
        // committed here again before the registrar's next pass: the departure of the copies'
        // last blocks is in that pass's batch, and the copies were remembered a batch before
        // it, so they left after they were remembered; the blocks present again are this
        // node's own work, registered with the commit. Before, an entry whose block was present
        // again was kept, and the computed segments were never registered.
        let mut prompt = FetchedPrompt::new("fetched-again");
        prompt.evict_the_fetched_copies();
        prompt.commit_again_and_see_all_held();
        assert_eq!(lock(&prompt.registrar.fetched).len(), 0);
    }

    #[test]
    fn a_commit_after_the_stopped_registrar_gave_up_waiting_meets_a_closed_queue() {
        // Goal: once the stopped registrar has finished journalling (here past its bound on
        // the wait for the connection threads, which never said they ended), a commit handed
        // over after it is refused as disconnected, so `ClusterAgent::hand_over` counts it in
        // `commits_dropped` and logs it. Before, the queue stayed open while the registrar
        // left the cluster (T + 1 s, up to 3 T + 1 s): such a commit was accepted, then dropped
        // with the registrar, neither journalled nor counted.
        let directory = tempfile::tempdir().unwrap();
        let (sender, inbox) = std::sync::mpsc::sync_channel(4);
        let mut registrar = registrar_of(directory.path(), "closed", HeldSegments::default(), 0, inbox);
        let store = store();
        let started = Instant::now();
        registrar.finish(&store, Duration::from_millis(10), Vec::new(), Duration::from_millis(50));
        assert!(started.elapsed() < Duration::from_secs(5), "the wait is bounded: {:?}", started.elapsed());
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let late = Committed { space, keys: (1..=16).collect(), first_segment: 0 };
        match sender.try_send(late) {
            Err(std::sync::mpsc::TrySendError::Disconnected(_)) => {}
            Ok(()) => panic!("a commit after the registrar finished was accepted into a queue nobody reads"),
            Err(other) => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_segment_evicted_before_the_first_join_is_forgotten_with_the_stale_ones() {
        // Goal: a segment recovered from the manifest (so perhaps registered under the previous
        // process's lease, still alive after a SIGKILL) and evicted before this process joined
        // is queued with the stale segments, whose registrations are deleted before the join —
        // not dropped because nothing is registered under this process's lease yet, which left
        // it claimed until the old lease expired.
        let directory = tempfile::tempdir().unwrap();
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let keys: Vec<u64> = (1..=16).collect();
        let mut held = HeldSegments::default();
        assert!(held.insert(space, 0, &keys));
        let (_sender, inbox) = std::sync::mpsc::sync_channel(1);
        let mut registrar = registrar_of(directory.path(), "evict", held, 0x77, inbox);
        registrar.held.block_departed(5, &mut |_| false, &mut registrar.removed);
        assert_eq!(registrar.removed.len(), 1, "the segment's block left the pool");
        registrar.queue_removed();
        let segment = Segment { index: 0, key: SegmentKey::new(16).unwrap() };
        assert_eq!(registrar.stale, vec![(space, segment)], "not queued for the forget before the join");
        assert!(registrar.to_unregister.is_empty());
    }

    #[test]
    fn a_segment_journalled_as_dropped_is_stale_for_a_successor_after_a_crash() {
        // Goal: a segment journalled as held (so perhaps registered) whose block then left the
        // pool is journalled as dropped at once, while its unregister waits for the next etcd
        // call (perhaps a backoff of 5 s). A process killed in between left its registration
        // under the old lease, and the successor's manifest no longer listed the segment: it
        // could not delete the entry, which sent peers here (to be refused) until the old lease
        // expired, up to a TTL. Now a dropped segment is stale at the next start, like one whose
        // blocks the pool lost.
        let directory = tempfile::tempdir().unwrap();
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let keys: Vec<u64> = (1..=16).collect();
        let mut held = HeldSegments::default();
        assert!(held.insert(space, 0, &keys));
        let (_sender, inbox) = std::sync::mpsc::sync_channel(1);
        let mut registrar = registrar_of(directory.path(), "dropped", held, 0x77, inbox);
        let store = store();
        registrar.held.block_departed(5, &mut |_| false, &mut registrar.removed);
        assert_eq!(registrar.removed.len(), 1, "the segment's block left the pool");
        // The pass's local step journals the drop; the process dies before any etcd call.
        registrar.update_local(&store, &[]);
        drop(registrar);

        let loaded = super::super::manifest::load(&directory.path().join("segments"), SegmentBlocks::new(16).unwrap()).unwrap();
        let (held, stale) = super::super::recover_segments(&loaded, |key| key != 5);
        assert_eq!(held.len(), 0);
        let segment = Segment { index: 0, key: SegmentKey::new(16).unwrap() };
        assert_eq!(stale, vec![(space, segment)], "the dropped segment's registration is not deleted at the next start");
    }

    #[test]
    fn a_compaction_keeps_the_segments_whose_registrations_are_still_to_delete() {
        // Goal: the journal's compaction (a rewrite with the held segments) while deletes are
        // still queued — unregistrations, or stale segments before the first join (etcd away
        // while the cache churned) — keeps them as dropped records, so a successor after a
        // crash still deletes their registrations. Before, the rewrite left them out and only
        // the old lease's expiry (up to a TTL) removed the entries.
        let directory = tempfile::tempdir().unwrap();
        let (_sender, inbox) = std::sync::mpsc::sync_channel(1);
        let mut registrar = registrar_of(directory.path(), "compaction", HeldSegments::default(), 0x77, inbox);
        let store = store();
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let queued = (space, Segment { index: 0, key: SegmentKey::new(16).unwrap() });
        let stale = (space, Segment { index: 1, key: SegmentKey::new(32).unwrap() });
        registrar.to_unregister.push(queued);
        registrar.stale.push(stale);
        // Records enough for a compaction at the next pass.
        let manifest = registrar.manifest.as_mut().unwrap();
        for key in 1000..6000 {
            manifest.dropped(&space, SegmentKey::new(key).unwrap()).unwrap();
        }
        registrar.update_local(&store, &[]);
        let records = registrar.manifest.as_ref().unwrap().records();
        assert!(records < 10, "no compaction: {records} records");
        drop(registrar);
        let loaded = super::super::manifest::load(&directory.path().join("segments"), SegmentBlocks::new(16).unwrap()).unwrap();
        let mut departed = loaded.departed.clone();
        departed.sort_by_key(|(_, segment)| segment.key.get());
        assert_eq!(departed, [(space, Segment { index: 0, ..queued.1 }), (space, Segment { index: 0, ..stale.1 })]);
    }

    #[test]
    fn a_rejoin_whose_old_lease_was_not_revoked_keeps_the_unregister_queue() {
        // Goal: segments broken while joined wait in the unregister queue. A rejoin whose revoke
        // of the old lease succeeded (or found it gone) drops the queue: the entries vanished
        // with the lease. One whose revoke failed keeps it, so the entries (alive until the
        // old lease expires) are deleted under the new lease this pass instead of lingering
        // for a TTL, listing segments the pool no longer holds.
        let directory = tempfile::tempdir().unwrap();
        let (_sender, inbox) = std::sync::mpsc::sync_channel(1);
        let mut registrar = registrar_of(directory.path(), "rejoin", HeldSegments::default(), 0, inbox);
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let queued = vec![(space, Segment { index: 0, key: SegmentKey::new(16).unwrap() })];
        registrar.to_unregister = queued.clone();
        registrar.rejoined(Rejoined { old_lease_id: 0x77, old_lease_revoked: false, left: vec![0x77] });
        assert_eq!(registrar.to_unregister, queued, "dropped though the old lease's entries live on");
        registrar.rejoined(Rejoined { old_lease_id: 0x77, old_lease_revoked: true, left: Vec::new() });
        assert!(registrar.to_unregister.is_empty(), "kept though the old lease's entries are gone");
    }

    #[test]
    fn a_rejoin_that_revoked_the_last_lease_drops_the_queue_though_an_earlier_lease_was_left() {
        // Goal: a rejoin for a full unregister queue revoked the last lease, under which every
        // queued entry was registered (so all are gone), but an earlier lease's revoke failed
        // again: the queue, 65,536 deletes to send one transaction at a time, was kept — the
        // cost the rejoin exists to avoid. It is dropped unless an entry may be under a lease
        // left: the last lease was, or an earlier one was and entries of the node may still be
        // under it (queued, or held and not yet registered under the lease since).
        let directory = tempfile::tempdir().unwrap();
        let (_sender, inbox) = std::sync::mpsc::sync_channel(1);
        let mut registrar = registrar_of(directory.path(), "overflow", HeldSegments::default(), 0, inbox);
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let queued = vec![(space, Segment { index: 0, key: SegmentKey::new(16).unwrap() }); UNREGISTER_QUEUE_MAX];
        registrar.to_unregister = queued.clone();
        registrar.rejoined(Rejoined { old_lease_id: 0x78, old_lease_revoked: true, left: vec![0x77] });
        assert!(registrar.to_unregister.is_empty(), "kept though every queued entry went with the revoked lease");

        // A rejoin left its old lease 0x78: the queue's entries live under it. The next one
        // revokes its old lease but leaves 0x78 again: they still do, the queue is kept.
        registrar.to_unregister = queued.clone();
        registrar.rejoined(Rejoined { old_lease_id: 0x78, old_lease_revoked: false, left: vec![0x78] });
        registrar.rejoined(Rejoined { old_lease_id: 0x79, old_lease_revoked: true, left: vec![0x78] });
        assert_eq!(registrar.to_unregister.len(), UNREGISTER_QUEUE_MAX, "dropped though its entries live under 0x78");
        // Once those are deleted (and every held segment registered under the current lease),
        // nothing is under 0x78: a queue filled after that went with the revoked lease.
        registrar.to_unregister.clear();
        registrar.settled();
        registrar.to_unregister = queued;
        registrar.rejoined(Rejoined { old_lease_id: 0x7a, old_lease_revoked: true, left: vec![0x78] });
        assert!(registrar.to_unregister.is_empty(), "kept though nothing of the node was under the lease left");

        // Rejoins whose revokes fail leave 0x71, then 0x72 and 0x71, then 0x73, 0x72 and 0x71,
        // the node giving 0x71 up (past the two it keeps to revoke again). The next rejoin
        // revokes 0x74, 0x73 and 0x72 and reports 0x71 still left: the queue's entries under it
        // may live, the queue is kept.
        registrar.to_unregister = vec![(space, Segment { index: 0, key: SegmentKey::new(16).unwrap() })];
        registrar.rejoined(Rejoined { old_lease_id: 0x71, old_lease_revoked: false, left: vec![0x71] });
        registrar.rejoined(Rejoined { old_lease_id: 0x72, old_lease_revoked: false, left: vec![0x72, 0x71] });
        registrar.rejoined(Rejoined { old_lease_id: 0x73, old_lease_revoked: false, left: vec![0x73, 0x72, 0x71] });
        registrar.rejoined(Rejoined { old_lease_id: 0x74, old_lease_revoked: true, left: vec![0x71] });
        assert_eq!(registrar.to_unregister.len(), 1, "dropped though its entries may live under the lease given up");
    }

    /// At each of the registrar's "deleted registrations" events (one per transaction of
    /// `forget_stale`), hands the next of `commits` over to the registrar's queue as a
    /// connection thread would (never blocking), counting those a full queue refused.
    struct HandOverPerTransaction {
        sender: Mutex<std::sync::mpsc::SyncSender<Committed>>,
        commits: Mutex<Vec<Committed>>,
        dropped: std::sync::atomic::AtomicUsize,
    }

    #[derive(Default)]
    struct MessageOf(String);

    impl tracing::field::Visit for MessageOf {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }

    impl OnEvent for HandOverPerTransaction {
        fn on_event(&self, event: &tracing::Event<'_>) {
            let mut message = MessageOf::default();
            event.record(&mut message);
            if message.0 != "deleted registrations of segments this pool no longer holds" {
                return;
            }
            let Some(commit) = lock(&self.commits).pop() else { return };
            if let Err(std::sync::mpsc::TrySendError::Full(_)) = lock(&self.sender).try_send(commit) {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    #[test]
    fn commits_handed_over_while_a_pass_waits_on_etcd_are_journalled() {
        // Goal: a pass of the registrar calls etcd transaction after transaction (here the
        // deletes of stale segments before the first join, two per transaction; registrations
        // and unregistrations alike), each up to T. The queue was read only between passes, so
        // commits the connection threads handed over meanwhile filled it and the rest were
        // dropped: never journalled, so never registered for the life of the pool. Now the
        // queue is read (and journalled, local work only) before each call.
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        // A queue of one commit; three transactions (of two deletes: `txn_ops_max` 2, the least
        // a node's writes allow), one commit handed over during each.
        let (sender, inbox) = std::sync::mpsc::sync_channel(1);
        let mut registrar = registrar_of(directory.path(), "queue-during-pass", HeldSegments::default(), 0, inbox);
        use_etcd(&mut registrar, &etcd);
        registrar.config.txn_ops_max = 2;
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        registrar.stale = (0..6).map(|i| (space, Segment { index: 0, key: SegmentKey::new(1000 + i).unwrap() })).collect();
        let store = store();
        let prompts: Vec<Vec<u64>> = (0..3u64).map(|i| (1..=16).map(|block| 100 * (i + 1) + block).collect()).collect();
        for keys in &prompts {
            commit(&store, keys);
        }
        for keys in &prompts {
            assert!(lock(&store).control.pool().index().get(keys[15]).is_some(), "the test needs every prompt in the pool");
        }
        let commits = prompts.iter().map(|keys| Committed { space, keys: keys.clone(), first_segment: 0 }).collect();
        let subscriber =
            Arc::new(HandOverPerTransaction { sender: Mutex::new(sender), commits: Mutex::new(commits), dropped: Default::default() });
        let stop = StopHandle::default();
        let dispatch = tracing::Dispatch::new(EventSubscriber(Arc::clone(&subscriber)));
        tracing::dispatcher::with_default(&dispatch, || registrar.talk_to_etcd(&store, &stop)).unwrap();
        assert!(registrar.stale.is_empty(), "the stale segments were not all deleted this pass");
        assert!(lock(&subscriber.commits).is_empty(), "a transaction did not hand its commit over");
        assert_eq!(subscriber.dropped.load(Ordering::Relaxed), 0, "commits handed over during the pass's calls were dropped");
        // The last one, handed over during the last transaction, was read before the pass's next
        // call (or its end): all three are journalled without a later read of the queue.
        registrar.leave();
        registrar.flush_manifest();
        let loaded = super::super::manifest::load(&directory.path().join("segments"), registrar.config.segment_blocks).unwrap();
        let mut journalled: Vec<u64> = loaded.segments.iter().map(|segment| segment.keys[15]).collect();
        journalled.sort_unstable();
        assert_eq!(journalled, [116, 216, 316], "a commit handed over was not journalled");
    }

    #[test]
    fn the_first_join_drops_the_deletes_made_from_the_manifest() {
        // Goal: the start rewrites the manifest with its stale segments as dropped records, so
        // that a start dying before the registrar deleted them leaves them for the next. Once
        // they are deleted (before the first join) they must leave the file: kept, every
        // later start deleted them again before its first join (a transaction per
        // `txn_ops_max` of them, the join waiting behind) until a compaction, which a node of
        // little churn may never reach.
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let (_sender, inbox) = std::sync::mpsc::sync_channel(1);
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let keys: Vec<u64> = (1..=16).collect();
        let mut held = HeldSegments::default();
        assert!(held.insert(space, 0, &keys));
        // As the start leaves the manifest: the held segment, the stale ones as dropped records.
        let stale = (0..3).map(|i| (space, Segment { index: 1, key: SegmentKey::new(1000 + i).unwrap() })).collect();
        let mut registrar = registrar_recovered(directory.path(), "first-join", held, stale, 0x77, inbox);
        use_etcd(&mut registrar, &etcd);
        let blocks = registrar.config.segment_blocks;
        let path = directory.path().join("segments");
        assert_eq!(super::super::manifest::load(&path, blocks).unwrap().departed.len(), 3);
        let store = store();
        registrar.talk_to_etcd(&store, &StopHandle::default()).unwrap();
        assert!(registrar.node.is_some() && registrar.stale.is_empty(), "the test needs the stale segments deleted and the node joined");
        let lease_id = registrar.node.as_ref().unwrap().health().lease_id;
        registrar.leave();
        registrar.flush_manifest();
        let loaded = super::super::manifest::load(&path, blocks).unwrap();
        assert_eq!(loaded.departed, [], "the deletes made before the first join are still in the manifest, made again at every start");
        assert_eq!((loaded.segments.len(), loaded.lease_id), (1, lease_id));
    }

    /// At each of the registrar's "registered segments" events (one per registration
    /// transaction), runs the next of `steps` (none left: nothing), as the connection threads
    /// and the pool's evictions would act while the pass waits on etcd.
    struct AtEachRegistration {
        steps: Mutex<std::collections::VecDeque<Box<dyn FnOnce() + Send>>>,
    }

    impl OnEvent for AtEachRegistration {
        fn on_event(&self, event: &tracing::Event<'_>) {
            let mut message = MessageOf::default();
            event.record(&mut message);
            if message.0 != "registered segments" {
                return;
            }
            let step = lock(&self.steps).pop_front();
            if let Some(step) = step {
                step();
            }
        }
    }

    #[test]
    fn a_segment_broken_and_stored_again_during_a_pass_stays_registered() {
        // Goal: the queue is read before each call of a pass, so a registered segment A can be
        // found broken (queued for deletion) and then held again (waiting to register) within
        // one pass. A registration that went out before the queued delete was undone by it the
        // next pass: A stayed held and counted as registered, gone from the registry (peers
        // never sent here for it). Now a registration drops the queued deletes of its segments
        // (`superseded`; deletes and registrations take turns, so here A's delete, its turn
        // first, goes out before its put; `a_segment_broken_and_held_again_keeps_its_registration_
        // whichever_goes_first` pins either order).
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let (sender, inbox) = std::sync::mpsc::sync_channel(4);
        let mut registrar = registrar_of(directory.path(), "broken-during-pass", HeldSegments::default(), 0, inbox);
        use_etcd(&mut registrar, &etcd);
        registrar.config.txn_ops_max = 2;
        let store = Arc::new(store());
        assert_eq!(lock(&store).control.counts().slots, 64, "the test fills a pool of 64 one-block slots");
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let stop = StopHandle::default();
        let a: Vec<u64> = (1..=16).collect();
        let committed = move |keys: &[u64]| Committed { space, keys: keys.to_vec(), first_segment: 0 };
        // Pass 1: A is registered.
        commit(&store, &a);
        registrar.update_local(&store, &[committed(&a)]);
        registrar.talk_to_etcd(&store, &stop).unwrap();
        assert_eq!(registrar.held.registered(), 1);
        // B1..B3 fill the pool (A the least recently used) and wait to be registered.
        let b: Vec<Vec<u64>> = (1..=3u64).map(|i| (1..=16).map(|block| 100 * i + block).collect()).collect();
        for keys in &b {
            commit(&store, keys);
        }
        lock(&store).control.track_departures(1024);
        registrar.update_local(&store, &b.iter().map(|keys| committed(keys)).collect::<Vec<_>>());
        // Pass 2: during its first registration C evicts A (C's commit handed over, so the next
        // read of the queue takes A's departure); during its second A is stored again
        // (evicting B1) and handed over.
        let c: Vec<u64> = (1001..=1016).collect();
        let evict_a: Box<dyn FnOnce() + Send> = {
            let (store, sender, c) = (Arc::clone(&store), sender.clone(), c.clone());
            Box::new(move || {
                commit(&store, &c);
                assert!(lock(&store).control.pool().index().get(16).is_none(), "the test needs A evicted");
                sender.try_send(committed(&c)).unwrap();
            })
        };
        let store_a_again: Box<dyn FnOnce() + Send> = {
            let (store, sender, a) = (Arc::clone(&store), sender.clone(), a.clone());
            Box::new(move || {
                commit(&store, &a);
                assert!(lock(&store).control.pool().index().get(116).is_none(), "the test needs B1 evicted");
                sender.try_send(committed(&a)).unwrap();
            })
        };
        let subscriber = Arc::new(AtEachRegistration { steps: Mutex::new([evict_a, store_a_again].into()) });
        let dispatch = tracing::Dispatch::new(EventSubscriber(Arc::clone(&subscriber)));
        tracing::dispatcher::with_default(&dispatch, || registrar.talk_to_etcd(&store, &stop)).unwrap();
        assert!(lock(&subscriber.steps).is_empty(), "the pass made fewer than two registrations");
        // The queue was read between the pass's calls, and what it found was done this pass:
        // C (handed over during the first registration) held and registered, B1 (evicted during
        // the second) dropped and its registration deleted.
        let node = registrar.node.as_ref().unwrap();
        let (key_b1, key_c) = (SegmentKey::new(116).unwrap(), SegmentKey::new(1016).unwrap());
        assert!(registrar.held.contains(&space, key_c), "a commit handed over during the pass was not held by it");
        assert!(!registrar.held.contains(&space, key_b1), "an eviction during the pass was not seen by it");
        assert_eq!(registrar.held.registered(), registrar.held.len(), "a segment held during the pass was not registered by it");
        let lookup = node.lookup(&space, &[Segment { index: 0, key: key_b1 }]).unwrap();
        assert!(lookup.holders.is_empty(), "a segment broken during the pass was not unregistered by it: {:?}", lookup.holders);
        // Pass 3: what the queue still holds (nothing, now) is deleted.
        registrar.update_local(&store, &[]);
        registrar.talk_to_etcd(&store, &stop).unwrap();
        let key_a = SegmentKey::new(16).unwrap();
        assert!(registrar.held.contains(&space, key_a), "A, stored again, is not held");
        let node = registrar.node.as_ref().unwrap();
        let lookup = node.lookup(&space, &[Segment { index: 0, key: key_a }]).unwrap();
        assert_eq!(lookup.holders, [vec![NodeId::new("a").unwrap()]], "A is held and counted as registered, but not in the registry");
        assert_eq!(registrar.held.registered(), registrar.held.len());
        registrar.leave();
    }

    /// At the registrar's "joined the cluster" event (the join done, its pass going on):
    /// revokes the new lease behind the node's back, as an expiry during a partition would,
    /// waits (at most 10 s) until the node's keep-alive has marked it lost, and stops the
    /// daemon. The keep-alive's events come here too (its task logs where the join did), each
    /// logged after the node is marked lost.
    struct StopAtJoin {
        etcd: Arc<tutti_cluster::local_etcd::LocalEtcd>,
        stop: StopHandle,
        /// The lease joined under (0 before the join).
        joined: std::sync::atomic::AtomicI64,
        /// The keep-alive marked that lease lost.
        lost: std::sync::atomic::AtomicBool,
    }

    #[derive(Default)]
    struct JoinedEvent {
        joined: bool,
        lost: bool,
        lease_id: i64,
    }

    /// What the node's keep-alive logs once it has marked its lease lost.
    const LEASE_LOST_MESSAGES: [&str; 2] =
        ["the member key is no longer under this node's lease: the lease is lost", "etcd says the node's lease expired"];

    impl tracing::field::Visit for JoinedEvent {
        fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
            if field.name() == "lease_id" {
                self.lease_id = value;
            }
        }
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                let message = format!("{value:?}");
                self.joined |= message == "joined the cluster";
                self.lost |= LEASE_LOST_MESSAGES.contains(&message.as_str());
            }
        }
    }

    impl OnEvent for StopAtJoin {
        fn on_event(&self, event: &tracing::Event<'_>) {
            let mut seen = JoinedEvent::default();
            event.record(&mut seen);
            if seen.lost && seen.lease_id != 0 && seen.lease_id == self.joined.load(Ordering::Acquire) {
                self.lost.store(true, Ordering::Release);
            }
            if seen.joined && !self.stop.is_stopped() {
                self.joined.store(seen.lease_id, Ordering::Release);
                self.etcd.revoke_lease(seen.lease_id).unwrap();
                // The pass must find the node lost once this returns: a loss seen only later
                // would let a pass that skips the stop check pass too.
                let deadline = Instant::now() + Duration::from_secs(10);
                while !self.lost.load(Ordering::Acquire) {
                    assert!(Instant::now() < deadline, "the node did not mark its lease lost within 10 s of its revoke");
                    std::thread::sleep(Duration::from_millis(10));
                }
                self.stop.stop();
            }
        }
    }

    #[test]
    fn a_stop_during_the_join_ends_the_pass_before_a_rejoin() {
        // Goal: the registrar sees the daemon's stop within one call (a join up to 4 T + 1 s,
        // or a rejoin up to 6 T) plus a tick. A pass that joined went on to the rejoin check
        // without looking at the stop, so a node lost right after its join (its watch saw the
        // member key deleted) rejoined first: a join and a rejoin, up to 10 T + 1 s.
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let etcd = Arc::new(etcd);
        let directory = tempfile::tempdir().unwrap();
        let (_sender, inbox) = std::sync::mpsc::sync_channel(1);
        let mut registrar = registrar_of(directory.path(), "stop-at-join", HeldSegments::default(), 0, inbox);
        use_etcd(&mut registrar, &etcd);
        let stop = StopHandle::default();
        let subscriber = StopAtJoin { etcd: etcd.clone(), stop: stop.clone(), joined: Default::default(), lost: Default::default() };
        let store = store();
        let result = tracing::subscriber::with_default(EventSubscriber(subscriber), || registrar.talk_to_etcd(&store, &stop));
        result.unwrap();
        assert!(stop.is_stopped(), "the join was not seen");
        assert_eq!(registrar.metrics.lease_losses.get(), 0, "rejoined after the stop");
        assert!(!registrar.rejoining);
        assert!(registrar.node.as_ref().is_some_and(|node| node.health().lost), "the test needs the node lost after its join");
    }

    /// At each of the registrar's events whose message is `message`, runs `step` again, as the
    /// connection threads and the pool's evictions would act while the pass waits on etcd.
    struct AtEachEvent {
        message: &'static str,
        step: Mutex<Box<dyn FnMut() + Send>>,
        /// Times `step` ran.
        ran: std::sync::atomic::AtomicUsize,
    }

    impl OnEvent for AtEachEvent {
        fn on_event(&self, event: &tracing::Event<'_>) {
            let mut message = MessageOf::default();
            event.record(&mut message);
            if message.0 == self.message {
                (lock(&self.step))();
                self.ran.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    #[test]
    fn the_registry_reads_answered_within_a_pass_once_a_call_succeeded() {
        // Goal: `ClusterStatus.registry` follows the pass call by call. The lease's last
        // confirmation was published only between passes and `failing` cleared only at a
        // pass's end: a pass of dozens of calls against a slow etcd (each up to T) read as
        // Unavailable though the lease was renewed and every call succeeded. Here a pass after
        // a failed one (failing set, nothing confirmed as far as the status knows) registers
        // three segments, one call each: the status reads Answered after each.
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let (_sender, inbox) = std::sync::mpsc::sync_channel(1);
        let mut registrar = registrar_of(directory.path(), "status-during-pass", HeldSegments::default(), 0, inbox);
        use_etcd(&mut registrar, &etcd);
        registrar.config.txn_ops_max = 2;
        let store = store();
        let stop = StopHandle::default();
        registrar.talk_to_etcd(&store, &stop).unwrap();
        assert!(registrar.node.is_some(), "the first pass joins");
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let prompts: Vec<Vec<u64>> = (1..=3u64).map(|i| (1..=16).map(|block| 100 * i + block).collect()).collect();
        for keys in &prompts {
            commit(&store, keys);
        }
        let committed: Vec<Committed> = prompts.iter().map(|keys| Committed { space, keys: keys.clone(), first_segment: 0 }).collect();
        registrar.update_local(&store, &committed);
        registrar.state.failing.store(true, Ordering::Relaxed);
        registrar.state.confirmed_at_ms.store(super::super::NEVER_CONFIRMED, Ordering::Relaxed);
        let bound = registrar.config.lease_ttl / 3 + registrar.config.request_timeout;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let step: Box<dyn FnMut() + Send> = {
            let (state, seen) = (Arc::clone(&registrar.state), Arc::clone(&seen));
            Box::new(move || lock(&seen).push(state.registry_answer(bound)))
        };
        let subscriber = Arc::new(AtEachEvent { message: "registered segments", step: Mutex::new(step), ran: Default::default() });
        let dispatch = tracing::Dispatch::new(EventSubscriber(Arc::clone(&subscriber)));
        tracing::dispatcher::with_default(&dispatch, || registrar.talk_to_etcd(&store, &stop)).unwrap();
        let answered = crate::protocol::RegistryAnswer::Answered;
        assert_eq!(*lock(&seen), [answered; 3], "the status after each registration of the pass");
    }

    /// Four 16-block prompts fill the 64 one-block slots of `store`, departures tracked, and
    /// become `registrar`'s held segments (waiting to be registered).
    fn fill_the_pool(registrar: &mut Registrar, store: &Mutex<StoreState>, space: ModelSpace) {
        assert_eq!(lock(store).control.counts().slots, 64, "the test fills a pool of 64 one-block slots");
        let prompts: Vec<Vec<u64>> = (1..=4u64).map(|i| (1..=16).map(|block| 100 * i + block).collect()).collect();
        for keys in &prompts {
            commit(store, keys);
        }
        lock(store).control.track_departures(1024);
        let commits: Vec<Committed> = prompts.iter().map(|keys| Committed { space, keys: keys.clone(), first_segment: 0 }).collect();
        registrar.update_local(store, &commits);
        assert_eq!(registrar.held.len(), 4, "the test needs the four prompts held");
    }

    /// A step that commits a fresh 16-block prompt to the full pool, evicting the least recently
    /// used held one, and hands it over, as a busy node's clients do.
    fn evicting_commits(
        store: &Arc<Mutex<StoreState>>,
        sender: std::sync::mpsc::SyncSender<Committed>,
        space: ModelSpace,
    ) -> Box<dyn FnMut() + Send> {
        let store = Arc::clone(store);
        let mut next = 0u64;
        Box::new(move || {
            next += 1;
            let keys: Vec<u64> = (1..=16).map(|block| 1_000_000 * next + block).collect();
            commit(&store, &keys);
            sender.try_send(Committed { space, keys, first_segment: 0 }).unwrap();
        })
    }

    #[test]
    fn steady_evictions_before_the_first_join_do_not_keep_the_node_from_joining() {
        // Goal: before the first join, a held segment an eviction breaks is stale (the previous
        // process may have registered it). The pass joined only once a read of the queue found
        // the stale list empty, and the queue is read before each delete: on a busy node with a
        // full pool, a commit per etcd round trip refilled it every time, and every pass spent
        // its budget on deletes and never joined. Now a pass deletes what was stale at its
        // first read, then joins; what broke later is deleted after the join.
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let (sender, inbox) = std::sync::mpsc::sync_channel(4);
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let stale = vec![(space, Segment { index: 0, key: SegmentKey::new(999_999).unwrap() })];
        let mut registrar = registrar_recovered(directory.path(), "evicting-before-join", HeldSegments::default(), stale, 0, inbox);
        use_etcd(&mut registrar, &etcd);
        registrar.config.txn_ops_max = 2;
        let store = Arc::new(store());
        fill_the_pool(&mut registrar, &store, space);
        let subscriber = Arc::new(AtEachEvent {
            message: "deleted registrations of segments this pool no longer holds",
            step: Mutex::new(evicting_commits(&store, sender, space)),
            ran: Default::default(),
        });
        let dispatch = tracing::Dispatch::new(EventSubscriber(Arc::clone(&subscriber)));
        let stop = StopHandle::default();
        for _ in 0..3 {
            tracing::dispatcher::with_default(&dispatch, || registrar.talk_to_etcd(&store, &stop)).unwrap();
        }
        assert!(subscriber.ran.load(Ordering::Relaxed) > 0, "the test needs evictions during the deletes");
        assert!(registrar.node.is_some(), "not joined after three passes, {} deletes", subscriber.ran.load(Ordering::Relaxed));
        // What broke after the first read was deleted under the new lease, this pass.
        assert!(registrar.stale.is_empty() && registrar.to_unregister.is_empty());
        assert_eq!(registrar.metrics.unregistered_segments.get(), 2, "the stale segment, then the one its delete's eviction broke");
        assert_eq!(registrar.held.registered(), registrar.held.len());
        registrar.leave();
    }

    #[test]
    fn a_stale_backlog_longer_than_a_pass_is_deleted_once_under_steady_evictions() {
        // Goal: a pass deleted what was stale at its own first read. With more stale entries
        // than one pass deletes, the next pass's first read counted again what the previous
        // pass's reads had found broken after its first (meant for the join to queue): under
        // evictions breaking a segment per delete the backlog never shrank and the node never
        // joined. Now only what was stale at the first pass's first read is deleted before
        // the join, across as many passes as it takes.
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let (sender, inbox) = std::sync::mpsc::sync_channel(4);
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        // 80 stale, two per delete (`txn_ops_max` 2, the least a node's writes allow): 40
        // transactions, more than one pass sends.
        let stale: Vec<_> = (1..=80u64).map(|n| (space, Segment { index: 0, key: SegmentKey::new(900_000 + n).unwrap() })).collect();
        let mut registrar = registrar_recovered(directory.path(), "stale-backlog", HeldSegments::default(), stale, 0, inbox);
        use_etcd(&mut registrar, &etcd);
        registrar.config.txn_ops_max = 2;
        let store = Arc::new(store());
        fill_the_pool(&mut registrar, &store, space);
        let subscriber = Arc::new(AtEachEvent {
            message: "deleted registrations of segments this pool no longer holds",
            step: Mutex::new(evicting_commits(&store, sender, space)),
            ran: Default::default(),
        });
        let dispatch = tracing::Dispatch::new(EventSubscriber(Arc::clone(&subscriber)));
        let stop = StopHandle::default();
        for _ in 0..3 {
            tracing::dispatcher::with_default(&dispatch, || registrar.talk_to_etcd(&store, &stop)).unwrap();
        }
        let deletes = subscriber.ran.load(Ordering::Relaxed);
        assert!(registrar.node.is_some(), "not joined after three passes, {deletes} deletes before the join");
        assert_eq!(deletes, 40, "the deletes before the join are those of the 80 stale at the first read, no more");
        registrar.leave();
    }

    #[test]
    fn a_segment_evicted_while_the_old_lease_holds_the_id_is_forgotten_before_the_next_join() {
        // Goal: a restart after a SIGKILL, the dead process's lease L0 alive: the first pass
        // deletes the stale entries, then its join fails (NodeIdTaken) until L0 expires, up to a
        // TTL. A held segment (registered under L0) evicted meanwhile was stale, but its delete
        // was owed only at the first pass's count: later passes, owing none, went straight to the
        // join, and the entry stayed listed (peers sent here, refused) until L0 expired. Now a
        // failed join lets the next pass count the stale entries again.
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let cluster = "evicted-while-taken";
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let segment = |key: u64| Segment { index: 0, key: SegmentKey::new(key).unwrap() };
        // The dead process, as etcd still sees it: node "a" under L0, with the four segments
        // `fill_the_pool` holds and one the pool no longer holds.
        let mut config = ClusterConfig::new(etcd.endpoints(), ClusterId::new(cluster).unwrap(), SegmentBlocks::new(16).unwrap());
        config.request_timeout = Duration::from_secs(1);
        let record = record_of_a();
        let dead = ClusterNode::join(config.clone(), record).unwrap();
        let old_lease = dead.health().lease_id;
        let stale_key = 999_999;
        dead.register(&space, &[116, 216, 316, 416, stale_key].map(segment)).unwrap();
        let listed = |key: u64| dead.lookup(&space, &[segment(key)]).unwrap().holders.concat().contains(&NodeId::new("a").unwrap());

        let directory = tempfile::tempdir().unwrap();
        let (sender, inbox) = std::sync::mpsc::sync_channel(4);
        let mut registrar =
            registrar_recovered(directory.path(), cluster, HeldSegments::default(), vec![(space, segment(stale_key))], old_lease, inbox);
        registrar.config = config;
        let store = Arc::new(store());
        fill_the_pool(&mut registrar, &store, space);
        let stop = StopHandle::default();
        // Pass 1: the stale entry is deleted (the member key is under L0, the manifest's
        // lease), then the join is refused.
        let error = registrar.talk_to_etcd(&store, &stop).unwrap_err();
        assert!(matches!(error, ClusterError::NodeIdTaken { lease_id, .. } if lease_id == old_lease), "{error}");
        assert!(!listed(stale_key), "the test needs the first pass's delete");
        // A commit evicts a held segment (prompt 1, the least recently used: key 116).
        evicting_commits(&store, sender, space)();
        assert!(lock(&store).control.pool().index().get(116).is_none(), "the test needs 116 evicted");
        // The run loop's read before the pass.
        registrar.take_commits(&store);
        assert_eq!(registrar.stale, [(space, segment(116))], "the test needs 116 stale");
        // Pass 2: L0 still holds the id, so the join is refused again; the evicted segment's
        // entry, under L0, was deleted before it.
        let error = registrar.talk_to_etcd(&store, &stop).unwrap_err();
        assert!(matches!(error, ClusterError::NodeIdTaken { .. }), "{error}");
        assert!(!listed(116), "a segment evicted while the join waited for the old lease is still listed under it");
        assert!(listed(216), "a held segment's entry was deleted");
        dead.leave();
    }

    /// Pads `registrar`'s manifest with dropped records past the compaction's threshold (for
    /// at most a few held segments and deletes), so the next local step compacts it.
    fn outgrow_the_manifest(registrar: &mut Registrar, space: ModelSpace) {
        let manifest = registrar.manifest.as_mut().unwrap();
        for n in 0..5000u64 {
            manifest.dropped(&space, SegmentKey::new(800_000 + n).unwrap()).unwrap();
        }
    }

    #[test]
    fn the_queue_is_read_again_after_a_compaction_of_the_manifest() {
        // Goal: a compaction (every held record, then two fsyncs) ran in the local step of a
        // read of the queue, followed straight by an etcd call: the queue alone covered both.
        // Now a read that compacted reads the queue again.
        let directory = tempfile::tempdir().unwrap();
        let (sender, inbox) = std::sync::mpsc::sync_channel(4);
        let mut registrar = registrar_of(directory.path(), "read-after-compaction", HeldSegments::default(), 0, inbox);
        let store = Arc::new(store());
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        fill_the_pool(&mut registrar, &store, space);
        outgrow_the_manifest(&mut registrar, space);
        let mut step = evicting_commits(&store, sender, space);
        step();
        // During the compaction a commit is handed over.
        let subscriber =
            Arc::new(AtEachEvent { message: "compacted the segment manifest", step: Mutex::new(step), ran: Default::default() });
        let dispatch = tracing::Dispatch::new(EventSubscriber(Arc::clone(&subscriber)));
        tracing::dispatcher::with_default(&dispatch, || registrar.take_commits(&store));
        assert_eq!(subscriber.ran.load(Ordering::Relaxed), 1, "the test needs one compaction");
        assert!(registrar.inbox.try_recv().is_err(), "the commit handed over during the compaction was left in the queue");
        assert_eq!(registrar.held.len(), 4);
        assert_eq!(registrar.to_unregister.len() + registrar.stale.len(), 2, "the two commits evicted two held segments");
    }

    #[test]
    fn a_compaction_in_the_read_after_the_first_join_stands_for_its_rewrite() {
        // Goal: the read between the first join and its rewrite of the manifest may compact
        // the manifest, which writes what that rewrite would: the rewrite after it wrote it all
        // again (every held record, then two fsyncs).
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let (sender, inbox) = std::sync::mpsc::sync_channel(4);
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let stale = vec![(space, Segment { index: 0, key: SegmentKey::new(999_999).unwrap() })];
        let mut registrar = registrar_recovered(directory.path(), "compaction-after-join", HeldSegments::default(), stale, 0, inbox);
        use_etcd(&mut registrar, &etcd);
        let store = Arc::new(store());
        fill_the_pool(&mut registrar, &store, space);
        outgrow_the_manifest(&mut registrar, space);
        // During the join a commit evicting a held segment is handed over: the read after the
        // join compacts.
        let subscriber = Arc::new(AtEachEvent {
            message: "joined the cluster",
            step: Mutex::new(evicting_commits(&store, sender, space)),
            ran: Default::default(),
        });
        let dispatch = tracing::Dispatch::new(EventSubscriber(Arc::clone(&subscriber)));
        tracing::dispatcher::with_default(&dispatch, || registrar.talk_to_etcd(&store, &StopHandle::default())).unwrap();
        assert_eq!(subscriber.ran.load(Ordering::Relaxed), 1, "the test needs the join");
        assert_eq!(registrar.manifest_rewrites, 1, "the compaction, then the first join's rewrite of the same");
        // The compaction's records: the lease, the held segments, the evicted one's delete.
        assert_eq!(registrar.manifest.as_ref().unwrap().records(), 1 + 4 + 1);
        let loaded = super::super::manifest::load(&directory.path().join("segments"), registrar.config.segment_blocks).unwrap();
        assert_eq!(loaded.departed.len(), 1, "the stale segment's delete, made, is dropped; the evicted one's is kept");
        registrar.leave();
    }

    #[test]
    fn steady_evictions_during_a_pass_leave_registrations_their_turn() {
        // Goal: every eviction of a held segment queues a delete, and the queue is read before
        // each call. A registration went out only when that read found no delete waiting: on a
        // busy node with a full pool, a commit evicting a held segment per etcd round trip
        // made every pass all deletes, and what it stored was never registered. Now deletes
        // and registrations take turns while both wait.
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let (sender, inbox) = std::sync::mpsc::sync_channel(4);
        let mut registrar = registrar_of(directory.path(), "evicting-during-pass", HeldSegments::default(), 0, inbox);
        use_etcd(&mut registrar, &etcd);
        registrar.config.txn_ops_max = 2;
        let store = Arc::new(store());
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let stop = StopHandle::default();
        // Joined, the pool full of held segments waiting, one delete queued.
        registrar.talk_to_etcd(&store, &stop).unwrap();
        assert!(registrar.node.is_some());
        fill_the_pool(&mut registrar, &store, space);
        let mut step = evicting_commits(&store, sender, space);
        step();
        registrar.take_commits(&store);
        assert_eq!(registrar.to_unregister.len(), 1, "the test needs a delete queued");
        let subscriber = Arc::new(AtEachEvent { message: "unregistered segments", step: Mutex::new(step), ran: Default::default() });
        let dispatch = tracing::Dispatch::new(EventSubscriber(Arc::clone(&subscriber)));
        tracing::dispatcher::with_default(&dispatch, || registrar.talk_to_etcd(&store, &stop)).unwrap();
        let (deletes, registrations) = (subscriber.ran.load(Ordering::Relaxed), registrar.metrics.registration_transactions.get());
        assert!(deletes > 1, "the test needs evictions during the pass");
        assert!(registrations as usize >= TRANSACTIONS_PER_PASS / 4, "{deletes} deletes, {registrations} registrations in a pass");
        registrar.leave();
    }

    #[test]
    fn a_segment_broken_and_held_again_keeps_its_registration_whichever_goes_first() {
        // Goal: with deletes and registrations taking turns, a segment A broken (its delete
        // queued) and held again may be registered before or after that delete goes out. Its
        // delete must never follow its new put (A held and counted as registered, gone from the
        // registry), and a delete queued after that put (A broken again) must go out.
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let (_sender, inbox) = std::sync::mpsc::sync_channel(1);
        let mut registrar = registrar_of(directory.path(), "order-per-segment", HeldSegments::default(), 0, inbox);
        use_etcd(&mut registrar, &etcd);
        registrar.config.txn_ops_max = 2;
        let store = store();
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let stop = StopHandle::default();
        let prompt = |n: u64| -> Vec<u64> { (1..=16).map(|block| 100 * n + block).collect() };
        let a = prompt(0);
        // Commits `prompts` (each evicting the least recently used prompt of a full pool), then
        // the registrar's local step reads them.
        let commit_all = |registrar: &mut Registrar, prompts: &[Vec<u64>]| {
            for keys in prompts {
                commit(&store, keys);
            }
            let commits: Vec<Committed> = prompts.iter().map(|keys| Committed { space, keys: keys.clone(), first_segment: 0 }).collect();
            registrar.update_local(&store, &commits);
        };
        let present = |keys: &[u64]| lock(&store).control.pool().index().get(keys[15]).is_some();
        let listed = |registrar: &Registrar| {
            let lookup = registrar.node.as_ref().unwrap().lookup(&space, &[Segment { index: 0, key: SegmentKey::new(16).unwrap() }]);
            !lookup.unwrap().holders.is_empty()
        };
        lock(&store).control.track_departures(1024);
        commit_all(&mut registrar, &[a.clone(), prompt(1), prompt(2), prompt(3)]);
        registrar.talk_to_etcd(&store, &stop).unwrap();
        assert!(listed(&registrar) && registrar.held.registered() == 4);

        // A broken, then held again before the pass: its delete goes first, then its put.
        commit_all(&mut registrar, &[prompt(4)]);
        assert!(!present(&a), "the test needs A evicted");
        commit_all(&mut registrar, std::slice::from_ref(&a));
        assert!(!present(&prompt(1)) && registrar.to_unregister.len() == 2, "the test needs A's delete and B1's queued");
        registrar.talk_to_etcd(&store, &stop).unwrap();
        assert!(listed(&registrar), "A, deleted then registered again, is not in the registry");

        // A broken and held again, its delete queued behind others: its registration comes
        // first, and its delete is not sent after it.
        let (x, y) = (SegmentKey::new(900_016).unwrap(), SegmentKey::new(900_032).unwrap());
        registrar.to_unregister.extend([(space, Segment { index: 0, key: x }), (space, Segment { index: 0, key: y })]);
        commit_all(&mut registrar, &[prompt(5), prompt(6), prompt(7), prompt(8)]);
        assert!(!present(&a), "the test needs A evicted");
        commit_all(&mut registrar, std::slice::from_ref(&a));
        assert!(!present(&prompt(5)), "the test needs E1 evicted");
        registrar.talk_to_etcd(&store, &stop).unwrap();
        assert!(registrar.to_unregister.is_empty());
        assert_eq!(registrar.held.registered(), registrar.held.len());
        assert!(listed(&registrar), "A's delete, queued before its registration, was sent after it");

        // A broken again: that delete, queued after A's put, goes out.
        commit_all(&mut registrar, &[prompt(9), prompt(10), prompt(11), prompt(12)]);
        assert!(!present(&a), "the test needs A evicted");
        registrar.talk_to_etcd(&store, &stop).unwrap();
        assert!(!listed(&registrar), "A, broken again after its registration, is still in the registry");
        registrar.leave();
    }

    #[test]
    fn a_clean_leave_drops_the_deletes_made_while_joined_from_the_manifest() {
        // Goal: each eviction while joined journals a dropped record, which only a compaction
        // removed: the next start deleted every such segment again before its first join (up to
        // the held segments and 2,048 more, a transaction per `txn_ops_max`, the join waiting
        // behind), though a leave whose revoke succeeded took every entry of the node with its
        // lease. Now such a leave rewrites the manifest with the held segments alone.
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let (sender, inbox) = std::sync::mpsc::sync_channel(4);
        let mut registrar = registrar_of(directory.path(), "clean-leave", HeldSegments::default(), 0, inbox);
        use_etcd(&mut registrar, &etcd);
        let store = Arc::new(store());
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let stop = StopHandle::default();
        fill_the_pool(&mut registrar, &store, space);
        registrar.talk_to_etcd(&store, &stop).unwrap();
        assert_eq!(registrar.held.registered(), 4);
        // A commit evicts a registered segment; the next pass unregisters it.
        evicting_commits(&store, sender, space)();
        registrar.take_commits(&store);
        assert_eq!(registrar.to_unregister.len(), 1, "the test needs a registered segment evicted");
        registrar.talk_to_etcd(&store, &stop).unwrap();
        assert!(registrar.to_unregister.is_empty());
        registrar.state.connections_ended.store(true, Ordering::Release);
        registrar.stopped(&store, Duration::from_millis(10), Vec::new(), Duration::from_secs(1));
        let loaded = super::super::manifest::load(&directory.path().join("segments"), registrar.config.segment_blocks).unwrap();
        assert_eq!(loaded.departed, [], "a delete made while joined is made again by the next start");
        assert_eq!(loaded.segments.len(), 4);
    }

    #[test]
    fn a_clean_stop_with_nothing_dropped_leaves_the_manifest_as_it_is() {
        // Goal: every clean stop rewrote the whole manifest (every held record, then fsyncs of
        // the file and its directory: ~38 MB for 125k segments, the daemon's stop waiting on
        // it), though with no dropped record in the file the rewrite writes what it says.
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let (_sender, inbox) = std::sync::mpsc::sync_channel(4);
        let mut registrar = registrar_of(directory.path(), "clean-stop-nothing-dropped", HeldSegments::default(), 0, inbox);
        use_etcd(&mut registrar, &etcd);
        let store = Arc::new(store());
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        fill_the_pool(&mut registrar, &store, space);
        registrar.talk_to_etcd(&store, &StopHandle::default()).unwrap();
        assert_eq!(registrar.held.registered(), 4);
        let path = directory.path().join("segments");
        let inode = |path: &std::path::Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(path).unwrap());
        let before = inode(&path);
        registrar.state.connections_ended.store(true, Ordering::Release);
        // The stop's steps, to see the leave's answer: a revoke timed out (a loaded machine)
        // skips the rewrite whatever the file holds, and the test would pass for that reason.
        let nothing_listed = registrar.leave();
        assert!(nothing_listed, "the test needs a leave that revoked every lease");
        registrar.after_leave(nothing_listed, &store, Duration::from_millis(10), Vec::new(), Duration::from_secs(1));
        assert_eq!(registrar.manifest_rewrites, 0, "a clean stop with nothing dropped rewrote the manifest");
        assert_eq!(inode(&path), before);
        let loaded = super::super::manifest::load(&path, registrar.config.segment_blocks).unwrap();
        assert_eq!((loaded.segments.len(), loaded.departed.len()), (4, 0));
    }

    #[test]
    fn the_queue_is_read_between_the_first_join_and_its_rewrite_of_the_manifest() {
        // Goal: the first join's rewrite of the manifest (every held record, then two fsyncs:
        // ~38 MB for 125k segments) ran right after the join with no read of the queue between,
        // so the queue alone covered both. Now the queue is read once after the join, before
        // the rewrite, which then holds what that read journalled (no record after it here).
        let Some(etcd) = tutti_cluster::local_etcd::LocalEtcd::start_or_skip(1) else { return };
        let directory = tempfile::tempdir().unwrap();
        let (sender, inbox) = std::sync::mpsc::sync_channel(4);
        let space = ModelSpace::new([1; 32], 0, 1).unwrap();
        let stale = vec![(space, Segment { index: 0, key: SegmentKey::new(999_999).unwrap() })];
        let mut registrar = registrar_recovered(directory.path(), "read-after-join", HeldSegments::default(), stale, 0, inbox);
        use_etcd(&mut registrar, &etcd);
        let store = Arc::new(store());
        fill_the_pool(&mut registrar, &store, space);
        // During the join a commit evicts a held segment and is handed over.
        let subscriber = Arc::new(AtEachEvent {
            message: "joined the cluster",
            step: Mutex::new(evicting_commits(&store, sender, space)),
            ran: Default::default(),
        });
        let dispatch = tracing::Dispatch::new(EventSubscriber(Arc::clone(&subscriber)));
        tracing::dispatcher::with_default(&dispatch, || registrar.talk_to_etcd(&store, &StopHandle::default())).unwrap();
        assert_eq!(subscriber.ran.load(Ordering::Relaxed), 1, "the test needs the join");
        assert_eq!(registrar.held.len(), 4, "the commit handed over during the join was not read this pass");
        // The rewrite's records (the lease, the held segments, the evicted one's delete, queued
        // when it ran) and none after it.
        let records = registrar.manifest.as_ref().unwrap().records();
        assert_eq!(records, 1 + 4 + 1, "the commit handed over during the join was journalled after the rewrite, not read before it");
        registrar.leave();
    }
}
