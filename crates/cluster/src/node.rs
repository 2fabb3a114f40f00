//! A node's membership: its record under a lease it keeps alive, and the registration of the
//! segments it stores (attached to the same lease, so a dead node's segments vanish with it).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, EventType, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn, TxnOp, WatchOptions, WatchResponse, WatchStream,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::instrument::WithSubscriber;

use crate::client::{ClusterClient, Lookup, Members};
use crate::config::ClusterConfig;
use crate::connection::{attempt_timeout, is_too_large, Members as EtcdMembers, RETRY_PAUSE_FIRST, RETRY_PAUSE_MAX};
use crate::error::{ClusterError, Result};
use crate::layout::{MemberRecord, SegmentRecord};
use crate::names::{ModelSpace, NodeId};
use crate::segments::Segment;

/// The lease as the keep-alive loop last saw it; read by every registration.
#[derive(Debug)]
struct LeaseState {
    lease_id: AtomicI64,
    /// Set when etcd said the lease is gone (a renewal answered with TTL 0, a registration
    /// refused for an unknown lease, or the member key seen deleted or put under another lease
    /// by the keep-alive's watch). Cleared only by `rejoin`.
    lost: AtomicBool,
    renewals: AtomicU64,
    renewal_failures: AtomicU64,
    /// Milliseconds since `origin` of the last renewal etcd confirmed.
    renewed_at_ms: AtomicU64,
    origin: Instant,
}

impl LeaseState {
    fn mark_renewed(&self) {
        self.renewals.fetch_add(1, Ordering::Relaxed);
        self.renewed_at_ms.store(self.origin.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

/// What the keep-alive loop has seen, for health reports and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseHealth {
    pub lease_id: i64,
    pub lost: bool,
    pub renewals: u64,
    pub renewal_failures: u64,
    /// Time since etcd last confirmed the lease (or since it was granted).
    pub since_renewal: Duration,
}

/// What [`ClusterNode::rejoin`] did with the node's old leases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejoined {
    /// The lease the node last joined under: every registration and record update since that
    /// join went under it. Not a lease a failed rejoin granted and could not revoke after its
    /// member transaction's answer was lost (an orphan, the node's last lease then): at most
    /// the member key is under that one, never a segment.
    pub old_lease_id: i64,
    /// Whether that lease is gone (revoked by this rejoin or by a failed one since that join,
    /// or etcd no longer knew it): every entry put under it went with it. False when it may
    /// live, its revoke failed (or, tried and failed by rejoins past the two leases a node
    /// keeps, it was no longer tried).
    pub old_lease_revoked: bool,
    /// The leases of the node that may live, each with the entries under it until it expires:
    /// those this rejoin tried and could not revoke, newest first (the old lease among them
    /// when this rejoin tried it and failed), then those earlier rejoins gave up revoking
    /// (past the two a node keeps to revoke again, logged then) less than a TTL ago, newest
    /// first. An unrenewed lease lives at most a TTL past its last renewal, which came before
    /// it was given up — unless a new etcd leader took over since (or the members restarted):
    /// etcd then extends every lease by a TTL from that moment, and a lease given up may live
    /// past the TTL it is listed here for. Empty when no lease of the node may live.
    pub left: Vec<i64>,
}

struct KeepAlive {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// A live member of the cluster. Dropping it stops the keep-alive and revokes the lease (one
/// request timeout, and up to 1 s for its runtime's shutdown; up to 3 T + 1 s after rejoins
/// whose revokes failed, those leases revoked too), so its record and segments vanish at once;
/// a node that dies without dropping it vanishes when the lease expires.
///
/// Bounds, T the request timeout: `join` ≤ 3 T (grant, member transaction, and the revoke of
/// the new lease when that fails; 4 T when the transaction failed with any error but an
/// answer too large, and that revoke failed: the transaction may have been applied, its answer
/// lost, so the lease may hold the member key, and the dropped node revokes it once more);
/// `rejoin` ≤ 6 T (the revokes of the node's last lease and of up to two whose revoke failed
/// before, then the grant, the member transaction and the new lease's revoke: a lease that
/// revoke leaves is the node's, revoked by the next rejoin or the drop); `leave` or
/// drop ≤ T + 1 s (up to 3 T + 1 s after rejoins whose revokes failed: those leases, at most
/// two, are revoked too); `register` and `unregister` T per `txn_ops_max` − 1 segments;
/// `update_record` T. Threads may call `register` and `unregister` at once, but their
/// transactions go one at a time (the fence's lock): one made while another is in flight first
/// waits for it (up to T), then has its own T. The lock is not fair: with several callers one
/// may be overtaken and wait longer (`Unavailable::waited` leaves out that wait); tuttid's
/// registrar is the one caller and writes one at a time.
pub struct ClusterNode {
    client: ClusterClient,
    record: MemberRecord,
    lease: Arc<LeaseState>,
    keep_alive: Option<KeepAlive>,
    /// Leases of this node whose revoke failed in a rejoin and none has confirmed since,
    /// newest first: each may live (and keep the member key or segments under it listed) until
    /// it expires, and the member key under one refuses every join under another lease. Each
    /// rejoin tries them again; `shut_down` revokes them (a rejoin that failed leaves no
    /// keep-alive, so it would revoke nothing without them). At most [`UNREVOKED_KEPT`]: an
    /// older one was left unrenewed more rejoins ago and expires first, and goes to `given_up`
    /// — except the lease a rejoin found holding the member key: kept first (its member
    /// transaction won, so newer leases' failed the compare and hold no member key), the
    /// newest dropped instead, or no rejoin would try it again and each would answer
    /// NodeIdTaken (blaming another process) until it expired.
    unrevoked: Vec<i64>,
    /// Leases of this node a rejoin stopped revoking (past `UNREVOKED_KEPT`), newest first,
    /// each with the time it was given up plus the longest TTL etcd granted (`lease_ttl`): the
    /// latest it lives unrenewed, its last renewal having come before — unless a new etcd
    /// leader took over since, which extends every lease by a TTL (then it may live past
    /// that). Not revoked again (a rejoin's bound stays 6 T); within that deadline a rejoin
    /// still reports it (`Rejoined::left`: entries may live under it) and counts a member key
    /// under it as the node's own ([`ClusterError::OwnLeaseHolds`], and kept in `unrevoked`
    /// again). Two per rejoin at most (one past the two kept, one the key's holder displaced),
    /// each dropped past its deadline.
    given_up: Vec<(i64, Instant)>,
    /// The longest TTL etcd granted this node's leases: the configured one, or more (etcd
    /// raises a TTL below its minimum, which follows its election timeout).
    lease_ttl: Duration,
    /// A lease a failed `establish` granted whose member transaction may have been applied
    /// (it failed other than with an answer too large: the answer may have been lost) and
    /// whose revoke failed: it may hold the member key, and nothing
    /// renews it. It is made the node's lease too, so the next rejoin revokes it as the old one
    /// (a join under another lease found the key taken by it, blamed on another process, for
    /// up to a TTL); `shut_down` revokes it.
    orphaned: Option<i64>,
    /// The lease of the last join that succeeded (`establish`), under which the owner put its
    /// entries since, and whether a revoke (or etcd not knowing it) has confirmed it gone. A
    /// failed rejoin may leave an orphan as the node's lease: the entries are not under that.
    joined: i64,
    joined_gone: bool,
    /// The member key's mod revision after this node's last write of it (the join's member
    /// transaction, then every guarded write, which puts the key too): each guarded write is
    /// applied only while the key is still at it, so an attempt of an earlier write that etcd
    /// applies late (a timed-out attempt sent again to the next member, or a failed call the
    /// owner sends again later, while the first one sat in a stalled member) is refused rather
    /// than undoing the writes since. The lock also keeps guarded writes one at a time.
    fence: Mutex<i64>,
    /// Tests only: the last transaction `guarded` sent, to send again as a late attempt.
    #[cfg(test)]
    last_guarded: Mutex<Option<Txn>>,
    /// Tests only: called after the member transaction was applied, whose answer is then taken
    /// as lost (`Unavailable`), as a member that stalls right after applying it would make it.
    #[cfg(test)]
    lose_member_answer: Option<Box<dyn FnMut() + Send + Sync>>,
    /// Tests only: leases whose revoke fails (as with etcd out of reach), sent to no one.
    #[cfg(test)]
    fail_revoke: Vec<i64>,
}

impl ClusterNode {
    /// Connects, grants a lease and registers `record` under it, refusing a node id another
    /// live lease holds ([`ClusterError::NodeIdTaken`]: after a crash, the restarted node waits
    /// for the old lease to expire). Then starts the keep-alive. At most three requests of one
    /// request timeout each: the grant, the member transaction, and the new lease's revoke
    /// when the transaction fails — and one more when that revoke fails after a transaction
    /// error other than an answer too large (the transaction may have been applied with its
    /// answer lost, so the lease may hold the member key: revoked as the node is dropped).
    /// Each keep-alive (this join's, each rejoin's) logs to the `tracing` subscriber current
    /// at that call, captured then: set logging up before joining, or the keep-alive logs
    /// nothing.
    pub fn join(config: ClusterConfig, record: MemberRecord) -> Result<ClusterNode> {
        // The lease's settings too: `connect` checks only what a client without a lease uses.
        config.validate()?;
        record.encode(&config.cluster).map_err(refused_record)?;
        let lease_ttl = config.lease_ttl;
        let client = ClusterClient::connect(config)?;
        let lease = Arc::new(LeaseState {
            lease_id: AtomicI64::new(0),
            lost: AtomicBool::new(true),
            renewals: AtomicU64::new(0),
            renewal_failures: AtomicU64::new(0),
            renewed_at_ms: AtomicU64::new(0),
            origin: Instant::now(),
        });
        let mut node = ClusterNode {
            client,
            record,
            lease,
            keep_alive: None,
            unrevoked: Vec::new(),
            given_up: Vec::new(),
            lease_ttl,
            orphaned: None,
            joined: 0,
            joined_gone: true,
            fence: Mutex::new(0),
            #[cfg(test)]
            last_guarded: Mutex::new(None),
            #[cfg(test)]
            lose_member_answer: None,
            #[cfg(test)]
            fail_revoke: Vec::new(),
        };
        node.establish(&[])?;
        Ok(node)
    }

    /// Grants a lease, puts the member record under it if the id is free, starts the keep-alive.
    /// `own`: leases of this node that may live (a rejoin's failed revokes, all of them, not
    /// only the ones it keeps): a member key under one refuses the join as
    /// [`ClusterError::OwnLeaseHolds`], as does one under the lease last joined under while no
    /// revoke confirmed it gone.
    fn establish(&mut self, own: &[i64]) -> Result<()> {
        let ttl_s = self.client.config.lease_ttl.as_secs() as i64;
        // etcd starts the lease's TTL when it grants it, not later than this: the keep-alive's
        // first renewal is timed from here, so the member transaction's time counts against it.
        let granted_at = Instant::now();
        let value = self.record.encode(self.client.layout.cluster()).map_err(refused_record)?;
        let granted = self.client.connection.call_lease("grant a lease", |mut lease| async move { lease.grant(ttl_s, None).await })?;
        let lease_id = granted.id();
        self.lease_ttl = self.lease_ttl.max(granted_ttl(granted.ttl()));
        let key = self.client.layout.member_key(&self.record.node);
        let answer = self.client.connection.call_kv("register the member", |mut client| {
            let transaction = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key.clone(), value.clone(), Some(PutOptions::new().with_lease(lease_id)))])
                .or_else([TxnOp::get(key.clone(), None)]);
            async move { client.txn(transaction).await }
        });
        #[cfg(test)]
        let answer = match (answer, self.lose_member_answer.as_mut()) {
            (Ok(_), Some(lose)) => {
                lose();
                Err(ClusterError::Unavailable {
                    operation: "register the member",
                    waited: Duration::ZERO,
                    last_error: "lost (test)".into(),
                })
            }
            (answer, _) => answer,
        };
        let answer = match answer {
            Ok(answer) => answer,
            Err(error) if is_too_large(&error) => {
                // Only the read of a taken key answers at length: the put was not applied, and
                // a value that long is no member record (as `member()` refuses it). Its lease
                // is in the answer the client refused to decode.
                let _ = self.revoke(lease_id);
                return Err(ClusterError::MemberKeyBlocked {
                    node: self.record.node.to_string(),
                    key,
                    lease_id: 0,
                    reason: "a value larger than an answer may be, its lease unread",
                });
            }
            Err(error) => {
                // The transaction may have been applied with its answer lost: the new lease may
                // hold the member key.
                if !self.revoke(lease_id) {
                    self.lease.lease_id.store(lease_id, Ordering::Relaxed);
                    self.orphaned = Some(lease_id);
                }
                return Err(error);
            }
        };
        if !answer.succeeded() {
            // The id is taken, unless the holder is this very lease (an answer lost on the way
            // back and the retry found our own put).
            let holder = answer.op_responses().into_iter().find_map(|response| match response {
                etcd_client::TxnOpResponse::Get(range) => range.kvs().first().map(|entry| (entry.lease(), entry.value().to_vec())),
                _ => None,
            });
            if holder.as_ref().map(|(holder_lease, _)| *holder_lease) != Some(lease_id) {
                // The put was not applied, so nothing is under the new lease: a failed revoke
                // leaves an empty lease to expire.
                let _ = self.revoke(lease_id);
                // A rejoin's revoke of a lease of this node failed and it still holds the key:
                // not another process (which NodeIdTaken would blame).
                let own_lease = |lease_id: &i64| own.contains(lease_id) || (!self.joined_gone && *lease_id == self.joined);
                if let Some(&(holder_lease, _)) = holder.as_ref().filter(|(holder_lease, _)| own_lease(holder_lease)) {
                    return Err(ClusterError::OwnLeaseHolds { node: self.record.node.to_string(), lease_id: holder_lease });
                }
                return Err(self.taken_by(key, holder));
            }
        }
        // The member key was under this lease at this revision (the put's, or the read that
        // found our own put): the keep-alive's watch starts right after it.
        let seen_at = answer.header().map(|header| header.revision()).filter(|&revision| revision > 0);
        // The first guarded write is applied only while the key is as this join left it: its
        // mod revision is the transaction's revision when the put was applied (every write of
        // a transaction takes the revision its answer's header names), the one read otherwise
        // (our own put, found by a retry). Unknown (0: no header), the first guarded write is
        // refused, finds the key under this lease and takes the fence from it.
        let fence = if answer.succeeded() { seen_at.unwrap_or(0) } else { member_entry(&answer).map_or(0, |(_, revision)| revision) };
        *self.fence.get_mut().unwrap_or_else(PoisonError::into_inner) = fence;
        self.lease.lease_id.store(lease_id, Ordering::Relaxed);
        self.lease.lost.store(false, Ordering::Relaxed);
        self.joined = lease_id;
        self.joined_gone = false;
        let granted_at_ms = granted_at.saturating_duration_since(self.lease.origin).as_millis() as u64;
        self.lease.renewed_at_ms.store(granted_at_ms, Ordering::Relaxed);
        let (stop, stopped) = watch::channel(false);
        let interval = self.client.config.lease_ttl / 3;
        let renewal = RenewalLoop {
            members: self.client.connection.members(),
            member: 0,
            lease: self.lease.clone(),
            lease_id,
            member_key: key,
            watch_from: seen_at.map(|revision| revision + 1),
            interval,
            failures: FailureLog::new(self.client.config.lease_ttl),
            first_wait: first_renewal_wait(interval, granted_at.elapsed()),
            request_timeout: self.client.config.request_timeout,
        };
        // Its events go where the join's do (the subscriber current here), not only to the
        // global default: a runtime thread has no subscriber of its own. Captured now, for the
        // task's life: with no subscriber set here (none scoped, no global default yet) that is
        // the no-op one, and the keep-alive logs nothing even after a global default is set
        // later. The owner sets its logging up before it joins (tuttid does so first thing).
        let task = self.client.connection.runtime().spawn(renewal.run(stopped).with_current_subscriber());
        self.keep_alive = Some(KeepAlive { stop, task });
        Ok(())
    }

    /// Why the member key (`key`, holding `holder`'s lease and value, None when the key was
    /// gone again by the time it was read) refused this node. A live holder puts a member
    /// record under its lease; a value under no lease never expires and one that does not
    /// decode was not put by a member, so neither is waited out as a holder: the error names
    /// the key an operator must delete.
    fn taken_by(&self, key: String, holder: Option<(i64, Vec<u8>)>) -> ClusterError {
        let cluster = self.client.layout.cluster();
        let node = self.record.node.to_string();
        let Some((lease_id, value)) = holder else {
            return ClusterError::NodeIdTaken { cluster: cluster.to_string(), node, lease_id: 0 };
        };
        let reason = if lease_id == 0 {
            "a value under no lease"
        } else if MemberRecord::decode(&value, cluster, &self.record.node).is_err() {
            "a value that is no member record of this cluster"
        } else {
            return ClusterError::NodeIdTaken { cluster: cluster.to_string(), node, lease_id };
        };
        ClusterError::MemberKeyBlocked { node, key, lease_id, reason }
    }

    /// Revokes `lease_id`, bounded; a failure leaves the lease to expire by itself. Whether it
    /// is gone now (revoked, or etcd no longer knew it).
    fn revoke(&self, lease_id: i64) -> bool {
        #[cfg(test)]
        if self.fail_revoke.contains(&lease_id) {
            tracing::warn!(lease_id, "could not revoke the lease (test); it expires by itself");
            return false;
        }
        let result = self.client.connection.call_lease("revoke the lease", |mut lease| async move { lease.revoke(lease_id).await });
        match revoked(result) {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(lease_id, %error, "could not revoke the lease; it expires by itself");
                false
            }
        }
    }

    /// Stops the keep-alive loop at once: a renewal in flight (up to a third of the request
    /// timeout on a stalled member) is abandoned, not waited for — the lease is revoked or
    /// replaced next.
    fn stop_keep_alive(&mut self) {
        if let Some(keep_alive) = self.keep_alive.take() {
            let _ = keep_alive.stop.send(true);
            keep_alive.task.abort();
            // An aborted task ends at its next await; bounded all the same.
            let wait = self.client.config.request_timeout;
            let task = keep_alive.task;
            let finished = self.client.connection.runtime().block_on(async { tokio::time::timeout(wait, task).await });
            if finished.is_err() {
                tracing::warn!("the lease keep-alive did not stop in {wait:?}");
            }
        }
    }

    /// After [`ClusterError::LeaseLost`]: a new lease and member record. The node's segments
    /// vanished with the old lease; the owner registers what it still holds again. At most
    /// six request timeouts: the revokes of the old lease and of up to two earlier ones whose
    /// revoke failed (`UNREVOKED_KEPT`), then a join's grant, member transaction and revoke.
    /// Until the new lease is in place the node has none (the keep-alive is stopped and the
    /// old lease revoked): it is marked lost first, so a failed rejoin — one asked for with the
    /// lease still live (the registrar's unregister queue overflowed) included — leaves it
    /// reporting lost, its writes refused, not joined under a revoked lease. A member key still
    /// under a lease of the node whose revoke failed refuses the join with
    /// [`ClusterError::OwnLeaseHolds`] (not `NodeIdTaken`: no other process holds the id).
    /// The answer names the leases it could not revoke, and those earlier rejoins gave up
    /// revoking that may still live: the entries under each live on until it expires (a TTL
    /// at most, unless a new etcd leader extended it), and an owner that meant to delete some
    /// of them must still do so (under the new lease: the keys name the node, not the lease).
    pub fn rejoin(&mut self) -> Result<Rejoined> {
        self.lease.lost.store(true, Ordering::Relaxed);
        self.stop_keep_alive();
        let old_lease_id = self.lease.lease_id.load(Ordering::Relaxed);
        // Every lease of the node that may live: the last one (an orphaned lease is it) and
        // those whose revoke failed before. Revoking only the last one left the member key
        // under an earlier one, which refused this join (NodeIdTaken, blamed on another
        // process) until it expired.
        let mut held = vec![old_lease_id];
        held.extend(self.unrevoked.iter().copied().filter(|&lease_id| lease_id != old_lease_id));
        let mut failed: Vec<i64> = held.iter().copied().filter(|&lease_id| !self.revoke(lease_id)).collect();
        // The owner's entries are under the lease it last joined under, not under an orphan a
        // failed rejoin left as the node's lease (which holds the member key at most): the
        // answer says whether that lease is gone. One no longer tracked (past
        // `UNREVOKED_KEPT`) is not tried and may live.
        if held.contains(&self.joined) && !failed.contains(&self.joined) {
            self.joined_gone = true;
        }
        let (joined, joined_gone) = (self.joined, self.joined_gone);
        // Entries of the node live on under any lease left, not only under the last one: the
        // owner must delete what it meant to (`Rejoined::left`).
        let mut left = failed.clone();
        let now = Instant::now();
        // A lease given up and tried here again (the old one) is revoked or kept now.
        self.given_up.retain(|&(lease_id, until)| until > now && !held.contains(&lease_id));
        if failed.len() > UNREVOKED_KEPT {
            tracing::warn!(leases = ?&failed[UNREVOKED_KEPT..], "no longer revoked by this node: they expire by themselves");
            let until = now + self.lease_ttl;
            for &lease_id in failed[UNREVOKED_KEPT..].iter().rev() {
                self.given_up.insert(0, (lease_id, until));
            }
            failed.truncate(UNREVOKED_KEPT);
        }
        // Given up, it may still hold entries and the member key: the owner keeps what it
        // meant to delete (an earlier lease dropped from tracking while entries were under it
        // was left out, and the registrar dropped its unregister queue).
        let given_up: Vec<i64> = self.given_up.iter().map(|&(lease_id, _)| lease_id).filter(|lease_id| !left.contains(lease_id)).collect();
        left.extend(given_up);
        self.unrevoked = failed;
        // An orphaned lease was the node's lease, the old one just handled: revoked, or kept as
        // unrevoked.
        self.orphaned = None;
        if let Err(error) = self.establish(&left) {
            if let ClusterError::OwnLeaseHolds { lease_id, .. } = error {
                self.keep_to_revoke(lease_id);
            }
            return Err(error);
        }
        Ok(Rejoined { old_lease_id: joined, old_lease_revoked: joined_gone, left })
    }

    /// Keeps `lease_id`, found holding the member key, among the leases the next rejoin
    /// revokes (first), should the rejoin that failed to revoke it have given it up: that next
    /// rejoin would otherwise not try it and answer NodeIdTaken, blaming another process, until
    /// it expired. The newest lease kept makes room (it went into the member transaction after
    /// the holder's won, so it holds no member key; the node's last lease, often that one, is
    /// tried all the same) and is given up in its stead.
    fn keep_to_revoke(&mut self, lease_id: i64) {
        if self.unrevoked.contains(&lease_id) {
            return;
        }
        self.given_up.retain(|&(given_up, _)| given_up != lease_id);
        self.unrevoked.insert(0, lease_id);
        if self.unrevoked.len() > UNREVOKED_KEPT {
            let dropped = self.unrevoked.remove(1);
            tracing::warn!(
                lease_id = dropped,
                holder = lease_id,
                "no longer revoked by this node, the lease holding the member key kept instead: it expires by itself"
            );
            self.given_up.insert(0, (dropped, Instant::now() + self.lease_ttl));
        }
    }

    /// Leaves the cluster now: the member record and every segment vanish (one request
    /// timeout for the revoke, up to 1 s for the runtime's shutdown; up to 3 T + 1 s after
    /// rejoins whose revokes failed: those leases, at most two, are revoked too). Whether every
    /// lease of the node that may hold its entries is gone now: each revoke succeeded (or etcd
    /// no longer knew the lease), and no lease a rejoin gave up revoking may still live. When
    /// false, entries of the node may stay listed until their lease expires, and an owner that
    /// meant to delete some of them must still do so (at its next start, say).
    pub fn leave(mut self) -> bool {
        self.shut_down()
    }

    fn shut_down(&mut self) -> bool {
        let lease_id = self.lease.lease_id.load(Ordering::Relaxed);
        let mut gone = true;
        if self.keep_alive.is_some() {
            self.stop_keep_alive();
            gone &= self.revoke(lease_id);
        }
        // After a join or rejoin that failed leaving its new lease unrevoked (never with a
        // keep-alive: one revoke either way).
        if let Some(orphaned) = self.orphaned.take() {
            gone &= self.revoke(orphaned);
        }
        // After rejoins whose revokes failed (and, when the last rejoin failed too, the node's
        // only leases): revoked now rather than left listed until they expire.
        for unrevoked in std::mem::take(&mut self.unrevoked) {
            gone &= self.revoke(unrevoked);
        }
        // Given up by a rejoin (not revoked again): may live until its deadline.
        let now = Instant::now();
        gone && self.given_up.iter().all(|&(_, until)| until <= now)
    }

    /// Replaces the member record (e.g. a model fingerprint the node now serves), under the
    /// node's lease and only while the key is still this lease's: otherwise the lease is gone
    /// ([`ClusterError::LeaseLost`]; `rejoin` puts the record again). The node id stays.
    pub fn update_record(&mut self, record: MemberRecord) -> Result<()> {
        if record.node != self.record.node {
            return Err(ClusterError::InvalidSetting(format!("a member record of node {} for node {}", record.node, self.record.node)));
        }
        let value = record.encode(self.client.layout.cluster()).map_err(refused_record)?;
        let lease_id = self.live_lease()?;
        // The guarded write puts the member key anyway: with the new record.
        self.guarded("update the member record", lease_id, Vec::new(), value)?;
        self.record = record;
        Ok(())
    }

    pub fn record(&self) -> &MemberRecord {
        &self.record
    }

    pub fn client(&self) -> &ClusterClient {
        &self.client
    }

    pub fn health(&self) -> LeaseHealth {
        let renewed_at = Duration::from_millis(self.lease.renewed_at_ms.load(Ordering::Relaxed));
        LeaseHealth {
            lease_id: self.lease.lease_id.load(Ordering::Relaxed),
            lost: self.lease.lost.load(Ordering::Relaxed),
            renewals: self.lease.renewals.load(Ordering::Relaxed),
            renewal_failures: self.lease.renewal_failures.load(Ordering::Relaxed),
            since_renewal: self.lease.origin.elapsed().saturating_sub(renewed_at),
        }
    }

    /// The node's lease, unless etcd said it is gone (lost stays lost until `rejoin`). Not
    /// judged by the time since the last renewal: etcd extends every lease when a new leader
    /// takes over (or the members restart), so a lease unconfirmed for a TTL may well live;
    /// each write checks the lease itself (`guarded`).
    fn live_lease(&self) -> Result<i64> {
        let lease_id = self.lease.lease_id.load(Ordering::Relaxed);
        if self.lease.lost.load(Ordering::Relaxed) {
            return Err(ClusterError::LeaseLost { lease_id });
        }
        Ok(lease_id)
    }

    /// Applies `operations` in one transaction only while the node's member key is still under
    /// `lease_id` (etcd compares the key's lease: 0 for a key that is gone) and at the mod
    /// revision of this node's last write (`fence`), putting the key again (`member_value`,
    /// under the lease) so that the fence moves on with each write. Every write of a node goes
    /// through here: once its lease lapsed — expired during a partition before the keep-alive
    /// noticed — a successor process may have joined under the same node id and registered the
    /// same segments, and a plain delete (unlike a put, which names the lease) would remove the
    /// successor's entries. The fence refuses an attempt of an earlier write applied late: a
    /// timed-out attempt is sent again to the next member (`Connection::run`) and a failed call
    /// again by the owner, while the first may sit in a member stalled on its disk and be
    /// applied seconds later — a registration after the delete that followed it listed an
    /// evicted segment again (until the lease ended), a delete after the put that followed it
    /// unlisted a held one. Refused only once a later write of the node has moved the key: an
    /// attempt of a failed call that arrives before the node's next write still holds the fence
    /// and is applied (what that call asked, which its owner sends again anyway).
    ///
    /// A refusal with the key still under the lease at another revision means another attempt
    /// of this node's writes was applied since the fence was taken (no one else writes a key
    /// under this lease): this call's own first attempt, or one of an earlier call that failed
    /// (`Unavailable`, its answer lost) and was applied all the same. Which one cannot be told,
    /// so taking it as this call's (and answering Ok) could drop this call's writes; instead
    /// they are sent again under the new fence, which every older attempt now fails: applied
    /// twice, a put of the same entry or a delete changes nothing, and they land after
    /// whatever moved the key. Any other refusal marks the node lost.
    fn guarded(&self, operation: &'static str, lease_id: i64, operations: Vec<TxnOp>, member_value: Vec<u8>) -> Result<()> {
        let key = self.client.layout.member_key(&self.record.node);
        let mut fence = self.fence.lock().unwrap_or_else(PoisonError::into_inner);
        // Taken once the lock is held: a write that waited for the one in flight (up to T) still
        // has its own T, rather than finding its deadline spent and sending nothing.
        let deadline = Instant::now() + self.client.config.request_timeout;
        // Each round after the first follows an attempt of this node's applied since the fence
        // was taken: one or two in practice, more only with attempts of several calls applied
        // late at once; the deadline bounds them too.
        for _ in 0..GUARDED_ROUNDS_MAX {
            let transaction = fenced(&key, &member_value, lease_id, *fence, operations.clone());
            #[cfg(test)]
            {
                *self.last_guarded.lock().unwrap_or_else(PoisonError::into_inner) = Some(transaction.clone());
            }
            let answer = self
                .client
                .connection
                .call_kv_by(operation, deadline, |mut client| {
                    let transaction = transaction.clone();
                    async move { client.txn(transaction).await }
                })
                .map_err(|error| self.lease_refused(error, lease_id))?;
            if answer.succeeded() {
                // The member key's mod revision is now the transaction's, which its answer's
                // header names (0 without one: the next write is refused and reads it).
                *fence = answer.header().map_or(0, |header| header.revision());
                return Ok(());
            }
            match member_entry(&answer) {
                Some((holder, revision)) if holder == lease_id && revision != *fence => {
                    tracing::debug!(
                        lease_id,
                        operation,
                        fence = *fence,
                        revision,
                        "an earlier attempt of this node's writes was applied: sent again"
                    );
                    *fence = revision;
                }
                _ => {
                    tracing::warn!(lease_id, operation, "the member key is no longer under this node's lease: the lease is lost");
                    self.lease.lost.store(true, Ordering::Relaxed);
                    return Err(ClusterError::LeaseLost { lease_id });
                }
            }
        }
        Err(ClusterError::Unavailable {
            operation,
            waited: self.client.config.request_timeout.saturating_sub(deadline.saturating_duration_since(Instant::now())),
            last_error: format!("refused {GUARDED_ROUNDS_MAX} times, the member key moved on by this node's late attempts each time"),
        })
    }

    /// How many segments one guarded transaction registers or unregisters: `txn_ops_max` less
    /// the member key's put each carries (at least one: `ClusterConfig::validate` refuses a
    /// `txn_ops_max` under 2).
    pub fn segments_per_transaction(&self) -> usize {
        self.client.config.txn_ops_max.saturating_sub(1).max(1)
    }

    /// A refusal naming an unknown lease means etcd expired it.
    fn lease_refused(&self, error: ClusterError, lease_id: i64) -> ClusterError {
        if let ClusterError::Etcd { source: etcd_client::Error::GRpcStatus(status), .. } = &error {
            if status.code() == tonic::Code::NotFound {
                self.lease.lost.store(true, Ordering::Relaxed);
                return ClusterError::LeaseLost { lease_id };
            }
        }
        error
    }

    /// Registers `segments` (newly committed, in `space`) as held by this node: one etcd
    /// transaction per [`ClusterNode::segments_per_transaction`] segments, every key attached to the node's lease and
    /// written only while the node's member key is under that lease (else
    /// [`ClusterError::LeaseLost`]). Returns the number of transactions.
    pub fn register(&self, space: &ModelSpace, segments: &[Segment]) -> Result<usize> {
        let lease_id = self.live_lease()?;
        let layout = &self.client.layout;
        let member_value = self.record.encode(layout.cluster()).map_err(refused_record)?;
        let mut transactions = 0;
        for chunk in segments.chunks(self.segments_per_transaction()) {
            let puts: Vec<TxnOp> = chunk
                .iter()
                .map(|segment| {
                    let record = SegmentRecord {
                        node: self.record.node.clone(),
                        space: *space,
                        key: segment.key,
                        index: segment.index,
                        segment_blocks: self.client.config.segment_blocks,
                    };
                    let key = layout.segment_key(space, segment.key, &self.record.node);
                    TxnOp::put(key, record.encode(layout.cluster()), Some(PutOptions::new().with_lease(lease_id)))
                })
                .collect();
            self.guarded("register segments", lease_id, puts, member_value.clone())?;
            transactions += 1;
        }
        Ok(transactions)
    }

    /// Removes this node's registration of `segments` (evicted locally): one transaction per
    /// [`ClusterNode::segments_per_transaction`] segments, applied only while the node's member key is under its lease
    /// (else [`ClusterError::LeaseLost`]: the entries under this node id may be a successor
    /// process's). Deleting a segment that was not registered is not an error.
    pub fn unregister(&self, space: &ModelSpace, segments: &[Segment]) -> Result<usize> {
        let lease_id = self.live_lease()?;
        let member_value = self.record.encode(self.client.layout.cluster()).map_err(refused_record)?;
        let mut transactions = 0;
        for chunk in segments.chunks(self.segments_per_transaction()) {
            let deletes = chunk
                .iter()
                .map(|segment| TxnOp::delete(self.client.layout.segment_key(space, segment.key, &self.record.node), None))
                .collect();
            self.guarded("unregister segments", lease_id, deletes, member_value.clone())?;
            transactions += 1;
        }
        Ok(transactions)
    }

    /// See [`ClusterClient::lookup`].
    pub fn lookup(&self, space: &ModelSpace, segments: &[Segment]) -> Result<Lookup> {
        self.client.lookup(space, segments)
    }

    /// See [`ClusterClient::members`].
    pub fn members(&self) -> Result<Members> {
        self.client.members()
    }

    /// See [`ClusterClient::member`].
    pub fn member(&self, node: &NodeId) -> Result<Option<MemberRecord>> {
        self.client.member(node)
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        let _ = self.shut_down();
    }
}

/// How many leases whose revoke failed a node keeps to revoke again: a rejoin tries the node's
/// last lease and these (each a request timeout), and keeps the newest that failed again.
/// Two cover a rejoin whose revoke of the old lease failed and whose new lease was orphaned.
const UNREVOKED_KEPT: usize = 2;

/// A guarded write's transaction (`ClusterNode::guarded`): `operations` and the member key
/// (`key`) put again as `member_value` under `lease_id`, while that key is under that lease at
/// mod revision `fence`; otherwise a read of the key.
fn fenced(key: &str, member_value: &[u8], lease_id: i64, fence: i64, mut operations: Vec<TxnOp>) -> Txn {
    operations.push(TxnOp::put(key, member_value, Some(PutOptions::new().with_lease(lease_id))));
    Txn::new()
        .when([Compare::lease(key, CompareOp::Equal, lease_id), Compare::mod_revision(key, CompareOp::Equal, fence)])
        .and_then(operations)
        .or_else([TxnOp::get(key, None)])
}

/// Most transactions one guarded write sends (`ClusterNode::guarded`): the first, and one more
/// for each late attempt of this node's found applied since the fence was taken.
const GUARDED_ROUNDS_MAX: usize = 4;

/// The member key's lease and mod revision in a refused transaction's answer (its `or_else`
/// read of the key); None when the key is gone.
fn member_entry(answer: &etcd_client::TxnResponse) -> Option<(i64, i64)> {
    answer.op_responses().into_iter().find_map(|response| match response {
        etcd_client::TxnOpResponse::Get(range) => range.kvs().first().map(|entry| (entry.lease(), entry.mod_revision())),
        _ => None,
    })
}

/// A member record that `MemberRecord::encode` refuses, as a setting error.
fn refused_record(reason: &'static str) -> ClusterError {
    ClusterError::InvalidSetting(format!("member record: {reason}"))
}

/// A revoke's answer, with etcd's NotFound taken as done: etcd no longer knows the lease —
/// expired, or revoked by an earlier attempt whose answer was lost on the way back (the call
/// retries then) — and a lease gone is what a revoke asks for.
fn revoked<T>(result: Result<T>) -> Result<()> {
    match result {
        Ok(_) => Ok(()),
        Err(ClusterError::Etcd { source: etcd_client::Error::GRpcStatus(status), .. }) if status.code() == tonic::Code::NotFound => Ok(()),
        Err(error) => Err(error),
    }
}

/// How long the keep-alive waits before its first renewal when it starts `since_grant` after the
/// lease was granted: what is left of the first interval. The member transaction runs between
/// the grant and the start, for up to a request timeout and its retries (2/3 of the TTL at the
/// most `ClusterConfig::validate` allows): waiting a whole TTL/3 after it could put the first
/// renewal past the lease's expiry (10 s TTL, 6.6 s transaction: renewal at 9.9 s, sent to
/// land by 16.5 s).
fn first_renewal_wait(interval: Duration, since_grant: Duration) -> Duration {
    interval.saturating_sub(since_grant)
}

/// Whether the keep-alive opens its watch before the first renewal, due `first_wait` after it
/// starts: only when the opening, bounded by one attempt (a third of the request timeout: its
/// confirmation and a check on a stalled member), ends before then. Opened first regardless,
/// a slow member transaction (`first_renewal_wait` near zero) and a stalled member could put
/// the first renewal a third of the request timeout late, past what the lease's TTL allows
/// for.
fn watch_before_first_renewal(first_wait: Duration, request_timeout: Duration) -> bool {
    first_wait >= attempt_timeout(request_timeout)
}

/// Renews one lease every `interval` until told to stop or etcd says the lease is gone.
struct RenewalLoop {
    /// The etcd members; the stream is opened on the preferred one, and a failure on it moves
    /// the preference on (as every other request's does).
    members: Arc<EtcdMembers>,
    /// The member the current stream is open on.
    member: usize,
    lease: Arc<LeaseState>,
    lease_id: i64,
    /// The node's member key, watched (`watch_member_key`).
    member_key: String,
    /// Where the first watch starts: right after the join's revision, so a change between the
    /// join and the watch is replayed; None after that (a watch opened again starts now and
    /// is followed by one check of the key).
    watch_from: Option<i64>,
    interval: Duration,
    /// When failed renewals are logged.
    failures: FailureLog,
    /// Before the first renewal: the first interval less the time since the grant.
    first_wait: Duration,
    request_timeout: Duration,
}

/// When the keep-alive logs failed renewals. It retries every 20..250 ms plus the attempt while
/// etcd is out of reach (some 2,900 times an hour with the defaults), each a warning before:
/// now the first failure of a run, then at most one line per lease TTL while the run lasts
/// (with the count so far), and one when a renewal succeeds again. `renewal_failures` still
/// counts every attempt.
#[derive(Debug)]
struct FailureLog {
    every: Duration,
    /// Failed renewals since the last one that succeeded.
    failed: u64,
    /// When the current run was last logged; None before its first failure.
    logged_at: Option<tokio::time::Instant>,
}

impl FailureLog {
    fn new(every: Duration) -> FailureLog {
        FailureLog { every, failed: 0, logged_at: None }
    }

    /// One more failure at `now`: the failures of the run so far when it is to be logged.
    fn failed(&mut self, now: tokio::time::Instant) -> Option<u64> {
        self.failed += 1;
        let due = self.logged_at.is_none_or(|logged_at| now.saturating_duration_since(logged_at) >= self.every);
        if due {
            self.logged_at = Some(now);
        }
        due.then_some(self.failed)
    }

    /// A renewal succeeded: the failures of the run that ends (0: none).
    fn renewed(&mut self) -> u64 {
        self.logged_at = None;
        std::mem::take(&mut self.failed)
    }
}

/// What woke the keep-alive.
enum Woken {
    Stopped,
    RenewalDue,
    Watch(std::result::Result<Option<WatchResponse>, etcd_client::Error>),
}

impl RenewalLoop {
    /// Renews the lease and watches the member key. Renewals go by lease id and succeed
    /// whatever the lease holds: without the watch, a node learned that its member key was
    /// deleted behind its back (an operator's `etcdctl del`) only from its next guarded write,
    /// and an idle node makes none — it stayed unlisted while its segments stayed listed, and
    /// peers chose it only to find no data address for it. A watch (a stream, no request per
    /// interval) sees the delete at once; the owner's rejoin repairs the node.
    async fn run(mut self, mut stopped: watch::Receiver<bool>) {
        let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
        // After a failure the next attempt comes soon (another member may answer), not a whole
        // interval later: the lease must be renewed before it runs out.
        let mut renew_at = tokio::time::Instant::now() + self.first_wait;
        let mut watching: Option<WatchStream> = None;
        // Opened first only when it cannot hold the first renewal up; otherwise right after
        // that renewal (as a broken watch is), from the join's revision all the same: a change
        // meanwhile is seen later, not missed.
        if watch_before_first_renewal(self.first_wait, self.request_timeout) && !self.open_watch(&mut watching).await {
            return;
        }
        let mut retry_pause = RETRY_PAUSE_FIRST;
        loop {
            let woken = tokio::select! {
                // A change, or the owner gone: stop either way.
                _ = stopped.changed() => Woken::Stopped,
                _ = tokio::time::sleep_until(renew_at) => Woken::RenewalDue,
                message = next_message(&mut watching) => Woken::Watch(message),
            };
            match woken {
                Woken::Stopped => return,
                Woken::Watch(message) => {
                    if !self.watched(message, &mut watching) {
                        return;
                    }
                    continue;
                }
                Woken::RenewalDue => {}
            }
            let outcome = match tokio::time::timeout(attempt_timeout(self.request_timeout), self.renew(&mut stream)).await {
                Ok(Ok(ttl_s)) if ttl_s > 0 => Ok(()),
                Ok(Ok(_)) => {
                    // Marked before it is logged: whoever sees the event sees the node lost.
                    self.lease.lost.store(true, Ordering::Relaxed);
                    tracing::error!(lease_id = self.lease_id, "etcd says the node's lease expired");
                    return;
                }
                Ok(Err(error)) => Err(error.to_string()),
                Err(_) => Err("timed out".to_owned()),
            };
            match outcome {
                Ok(()) => {
                    self.lease.mark_renewed();
                    let failed = self.failures.renewed();
                    if failed > 0 {
                        tracing::info!(lease_id = self.lease_id, failed, "lease renewed again after failed renewals");
                    }
                    renew_at = tokio::time::Instant::now() + self.interval;
                    retry_pause = RETRY_PAUSE_FIRST;
                    // A watch that broke is opened again once etcd answers (here, at most once
                    // per renewal).
                    if watching.is_none() && !self.open_watch(&mut watching).await {
                        return;
                    }
                }
                Err(error) => {
                    self.lease.renewal_failures.fetch_add(1, Ordering::Relaxed);
                    match self.failures.failed(tokio::time::Instant::now()) {
                        Some(1) => tracing::warn!(
                            lease_id = self.lease_id,
                            %error,
                            "lease renewal failed; retrying (logged again at most once per lease TTL while it fails)"
                        ),
                        Some(failed) => tracing::warn!(lease_id = self.lease_id, %error, failed, "lease renewal still failing; retrying"),
                        None => {}
                    }
                    stream = None;
                    self.members.failed(self.member);
                    renew_at = tokio::time::Instant::now() + retry_pause;
                    retry_pause = (retry_pause * 2).min(RETRY_PAUSE_MAX);
                }
            }
        }
    }

    /// One message of the member key's watch. False when it says the key is no longer under
    /// this lease (deleted, or put under another: the node is marked lost); a broken or
    /// cancelled watch is dropped, to be opened again after the next renewal.
    fn watched(
        &mut self,
        message: std::result::Result<Option<WatchResponse>, etcd_client::Error>,
        watching: &mut Option<WatchStream>,
    ) -> bool {
        let response = match message {
            Ok(Some(response)) => response,
            Ok(None) => {
                tracing::warn!(lease_id = self.lease_id, "the member key's watch ended; watching again after the next renewal");
                *watching = None;
                return true;
            }
            Err(error) => {
                tracing::warn!(lease_id = self.lease_id, %error, "the member key's watch failed; watching again after the next renewal");
                *watching = None;
                return true;
            }
        };
        for event in response.events() {
            let ours = event.event_type() == EventType::Put && event.kv().is_some_and(|entry| entry.lease() == self.lease_id);
            if !ours {
                self.lease.lost.store(true, Ordering::Relaxed);
                tracing::error!(lease_id = self.lease_id, key = %self.member_key, "the member key is no longer under this node's lease: the lease is lost");
                return false;
            }
        }
        if response.canceled() {
            // Compacted past where it started, the member lost its leader, or etcd cancelled it.
            tracing::warn!(
                lease_id = self.lease_id,
                reason = response.cancel_reason(),
                "etcd cancelled the member key's watch; watching again after the next renewal"
            );
            *watching = None;
            self.watch_from = None;
        }
        true
    }

    /// Opens the member key's watch, bounded by one attempt; a failure leaves `watching` None
    /// (tried again after the next renewal). A watch that does not start at `watch_from`
    /// misses what happened before it, so the key is then checked once (a transaction that
    /// compares its lease and writes nothing). False when that check finds the key gone.
    async fn open_watch(&mut self, watching: &mut Option<WatchStream>) -> bool {
        let opened = tokio::time::timeout(attempt_timeout(self.request_timeout), self.watch_member_key()).await;
        match opened {
            Ok(Ok(Some(stream))) => {
                *watching = Some(stream);
                // From here on the watch sees every change: it is never started at the join's
                // revision again (etcd may have compacted it).
                self.watch_from = None;
                true
            }
            Ok(Ok(None)) => {
                self.lease.lost.store(true, Ordering::Relaxed);
                tracing::error!(lease_id = self.lease_id, key = %self.member_key, "the member key is no longer under this node's lease: the lease is lost");
                false
            }
            Ok(Err(error)) => {
                tracing::warn!(lease_id = self.lease_id, %error, "could not watch the member key; trying again after the next renewal");
                true
            }
            Err(_) => {
                tracing::warn!(lease_id = self.lease_id, "watching the member key timed out; trying again after the next renewal");
                true
            }
        }
    }

    /// The watch, once etcd confirmed it (None: the key was found gone when checked).
    async fn watch_member_key(&self) -> std::result::Result<Option<WatchStream>, etcd_client::Error> {
        let (_, client) = self.members.current();
        let mut watch_client = client.watch;
        let mut options = WatchOptions::new();
        if let Some(revision) = self.watch_from {
            options = options.with_start_revision(revision);
        }
        let mut watching = watch_client.watch(self.member_key.clone(), Some(options)).await?;
        // etcd confirms a watch before any event: past this, nothing after it goes unseen.
        match watching.message().await? {
            Some(response) if response.created() && !response.canceled() => {}
            Some(response) => {
                return Err(etcd_client::Error::WatchError(format!("etcd refused the watch: {}", response.cancel_reason())));
            }
            None => return Err(etcd_client::Error::WatchError("the watch ended before it started".into())),
        }
        if self.watch_from.is_none() {
            let mut kv = client.kv;
            let transaction = Txn::new().when([Compare::lease(self.member_key.clone(), CompareOp::Equal, self.lease_id)]);
            if !kv.txn(transaction).await?.succeeded() {
                return Ok(None);
            }
        }
        Ok(Some(watching))
    }

    /// One renewal over the keep-alive stream (opened again after a failure): the TTL etcd
    /// granted, 0 when the lease no longer exists.
    async fn renew(&mut self, stream: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>) -> std::result::Result<i64, etcd_client::Error> {
        if stream.is_none() {
            let (member, client) = self.members.current();
            let mut lease = client.lease;
            self.member = member;
            match lease.keep_alive(self.lease_id).await {
                Ok(opened) => *stream = Some(opened),
                // etcd-client refuses to open the stream when etcd's first answer has TTL 0
                // (the lease is gone) and says so only in words: ask etcd itself (TTL −1 for a
                // lease it does not know).
                Err(etcd_client::Error::LeaseKeepAliveError(words)) => {
                    let ttl_s = lease.time_to_live(self.lease_id, None).await?.ttl();
                    if ttl_s > 0 {
                        return Err(etcd_client::Error::LeaseKeepAliveError(words));
                    }
                    return Ok(0);
                }
                Err(error) => return Err(error),
            }
        }
        let Some((keeper, responses)) = stream.as_mut() else {
            return Err(etcd_client::Error::LeaseKeepAliveError("no keep-alive stream".into()));
        };
        keeper.keep_alive().await?;
        match responses.message().await? {
            Some(response) => Ok(response.ttl()),
            None => Err(etcd_client::Error::LeaseKeepAliveError("the keep-alive stream ended".into())),
        }
    }
}

/// The next message of the watch, or never when there is none.
async fn next_message(watching: &mut Option<WatchStream>) -> std::result::Result<Option<WatchResponse>, etcd_client::Error> {
    match watching {
        Some(stream) => stream.message().await,
        None => std::future::pending().await,
    }
}

/// The longest a lease etcd granted may live unrenewed, as far as the given-up leases' deadlines
/// go: its answer's TTL, bounded by the longest TTL this crate asks for (3600 s; etcd raises a
/// request only to its own minimum, seconds), so that an answer out of bounds (a broken server or
/// proxy) cannot push a deadline past any instant (`Instant + Duration` panics on overflow) or
/// keep given-up leases for good.
fn granted_ttl(ttl_s: i64) -> Duration {
    const GRANTED_TTL_MAX_S: u64 = 3600;
    Duration::from_secs(u64::try_from(ttl_s).unwrap_or(0).min(GRANTED_TTL_MAX_S))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_granted_ttl_out_of_bounds_is_bounded() {
        // Goal: etcd's answer is untrusted: a TTL near i64::MAX (which would overflow
        // `Instant + Duration` at the next given-up lease's deadline) or a negative one is kept
        // within 0..=3600 s; an ordinary one is taken as it is.
        assert_eq!(granted_ttl(i64::MAX), Duration::from_secs(3600));
        assert_eq!(granted_ttl(3601), Duration::from_secs(3600));
        assert_eq!(granted_ttl(-1), Duration::ZERO);
        assert_eq!(granted_ttl(30), Duration::from_secs(30));
        let _ = Instant::now() + granted_ttl(i64::MAX);
    }

    #[test]
    fn a_revoke_of_a_lease_etcd_no_longer_knows_is_done() {
        // Goal: a revoke retried after its answer was lost gets NotFound (the first attempt
        // revoked the lease), as does the revoke of an expired lease: both are the lease gone,
        // not a failure to log as "could not revoke"; other refusals stay errors.
        let refused = |status: tonic::Status| -> Result<()> {
            Err(ClusterError::Etcd { operation: "revoke the lease", source: etcd_client::Error::GRpcStatus(status) })
        };
        assert!(revoked(refused(tonic::Status::not_found("etcdserver: requested lease not found"))).is_ok());
        assert!(revoked(Ok(())).is_ok());
        assert!(revoked(refused(tonic::Status::permission_denied("etcdserver: permission denied"))).is_err());
        let unavailable: Result<()> =
            Err(ClusterError::Unavailable { operation: "revoke the lease", waited: Duration::from_secs(1), last_error: String::new() });
        assert!(matches!(revoked(unavailable), Err(ClusterError::Unavailable { .. })));
    }

    #[test]
    fn failed_renewals_are_logged_once_then_once_per_ttl() {
        // Goal: a keep-alive retrying every 20..250 ms while etcd is down logged a warning per
        // attempt (~2,900 an hour): now the first failure, then one line per lease TTL with
        // the count, and the next run of failures is logged from its first again.
        let start = tokio::time::Instant::now();
        let mut log = FailureLog::new(Duration::from_secs(10));
        let at = |ms: u64| start + Duration::from_millis(ms);
        assert_eq!(log.failed(at(0)), Some(1), "the first failure");
        let quiet = (1..40).filter_map(|attempt| log.failed(at(attempt * 250))).count();
        assert_eq!(quiet, 0, "nothing more within the TTL");
        assert_eq!(log.failed(at(10_000)), Some(41), "a summary once a TTL passed");
        assert_eq!(log.failed(at(10_250)), None);
        assert_eq!(log.renewed(), 42);
        assert_eq!(log.renewed(), 0, "a renewal with no failure before it");
        assert_eq!(log.failed(at(10_500)), Some(1), "a new run is logged from its first failure");
    }

    #[test]
    fn the_first_renewal_counts_from_the_grant() {
        // Goal: the keep-alive started after a slow member transaction renews within the first
        // TTL/3 of the grant, not a whole TTL/3 after it started (a 10 s lease whose transaction
        // took 6.6 s was renewed at 9.9 s, with 0.1 s left for the renewal itself).
        let interval = Duration::from_secs(10) / 3;
        assert_eq!(first_renewal_wait(interval, Duration::ZERO), interval);
        assert_eq!(first_renewal_wait(interval, Duration::from_secs(1)), interval - Duration::from_secs(1));
        assert_eq!(first_renewal_wait(interval, Duration::from_millis(6600)), Duration::ZERO, "overdue: renew at once");
    }

    #[test]
    fn the_watch_never_holds_the_first_renewal_up() {
        // Goal: the member key's watch, whose opening may take one attempt (T/3), is opened
        // before the first renewal only when that renewal is due later than that; otherwise
        // after it. Before, it was always opened first: with the renewal due at once (a slow
        // member transaction) and a stalled member, the renewal went T/3 late.
        let request_timeout = Duration::from_secs(3);
        assert!(watch_before_first_renewal(Duration::from_secs(10) / 3, request_timeout), "a fresh join: room to open it first");
        assert!(watch_before_first_renewal(Duration::from_secs(1), request_timeout), "exactly one attempt's room");
        assert!(!watch_before_first_renewal(Duration::from_millis(999), request_timeout));
        assert!(!watch_before_first_renewal(Duration::ZERO, request_timeout), "the renewal is due at once");
    }
}

/// Set-up shared by the rejoin tests against a local etcd below.
#[cfg(test)]
mod rejoin_test_support {
    use super::*;
    use crate::local_etcd::LocalEtcd;
    use crate::names::{ClusterId, KeySecretTag};
    use crate::segments::SegmentBlocks;
    use std::sync::Mutex;

    /// One local etcd member, shared with the hooks that kill it; None: no etcd binary here
    /// (the test is skipped).
    pub(super) fn start_etcd() -> Option<Arc<Mutex<LocalEtcd>>> {
        LocalEtcd::start_or_skip(1).map(|etcd| Arc::new(Mutex::new(etcd)))
    }

    /// Node "a" joined to cluster `cluster` on `etcd`, and the config it joined with.
    pub(super) fn join_node_a(etcd: &Arc<Mutex<LocalEtcd>>, cluster: &str) -> (ClusterNode, ClusterConfig) {
        let endpoints = etcd.lock().unwrap().endpoints();
        let mut config = ClusterConfig::new(endpoints, ClusterId::new(cluster).unwrap(), SegmentBlocks::new(16).unwrap());
        // Long enough that no lease here expires by itself during the test.
        config.lease_ttl = Duration::from_secs(30);
        config.request_timeout = Duration::from_secs(1);
        let record = MemberRecord {
            node: NodeId::new("a").unwrap(),
            key_secret_tag: KeySecretTag::new([0x5e; 4]),
            address: "127.0.0.1:7001".into(),
            capacity_bytes: 1 << 40,
            fingerprints: vec![[7; 32]],
        };
        let node = ClusterNode::join(config.clone(), record).unwrap();
        (node, config)
    }

    /// Deletes `node`'s member key by hand (as the keep-alive's watch sees): the lease it was
    /// under lives on without it, so a rejoin goes ahead under a new lease even when that old
    /// lease's revoke fails.
    pub(super) fn delete_member_key(node: &ClusterNode) {
        let key = node.client.layout.member_key(&node.record.node);
        node.client
            .connection
            .call_kv("delete the member key", |mut kv| {
                let key = key.clone();
                async move { kv.delete(key, None).await }
            })
            .unwrap();
    }

    /// A rejoin whose member transaction is applied and its answer lost: etcd is killed as it
    /// answers (the member crashed right after), then restarted. Asserts that the rejoin
    /// failed as Unavailable.
    pub(super) fn rejoin_losing_the_member_answer(node: &mut ClusterNode, etcd: &Arc<Mutex<LocalEtcd>>) {
        let crashed = etcd.clone();
        node.lose_member_answer = Some(Box::new(move || crashed.lock().unwrap().kill(0).unwrap()));
        let failed = node.rejoin();
        node.lose_member_answer = None;
        etcd.lock().unwrap().restart(0).unwrap();
        assert!(matches!(failed, Err(ClusterError::Unavailable { .. })), "{:?}", failed.map(|_| ()));
    }
}

#[cfg(test)]
mod lease_orphan_tests {
    use super::rejoin_test_support::{delete_member_key, join_node_a, rejoin_losing_the_member_answer, start_etcd};
    use super::*;
    use crate::local_etcd::LocalEtcd;
    use std::sync::Mutex;

    /// The lease etcd holds `node`'s member key under (0: none), read through `client`.
    fn member_key_lease(client: &ClusterClient, node: &NodeId) -> i64 {
        let key = client.layout.member_key(node);
        let answer = client
            .connection
            .call_kv("read the member key", |mut kv| {
                let key = key.clone();
                async move { kv.get(key, None).await }
            })
            .unwrap();
        answer.kvs().first().map_or(0, |entry| entry.lease())
    }

    /// etcd's TTL left on `lease_id`: −1 for a lease it does not know.
    fn ttl_left(client: &ClusterClient, lease_id: i64) -> i64 {
        client
            .connection
            .call_lease("lease time to live", |mut lease| async move { lease.time_to_live(lease_id, None).await })
            .unwrap()
            .ttl()
    }

    /// A rejoin whose member transaction was applied, its answer lost (the member crashed right
    /// after) and its new lease's revoke failed (etcd down): once etcd is back the member key
    /// is under that lease, which nothing renews.
    fn rejoin_orphaning_a_lease(node: &mut ClusterNode, etcd: &Arc<Mutex<LocalEtcd>>) -> i64 {
        rejoin_losing_the_member_answer(node, etcd);
        let orphan = member_key_lease(&node.client, &node.record.node);
        let ttl = ttl_left(&node.client, orphan);
        assert!(orphan != 0 && ttl > 0, "the member key is under a live lease: lease {orphan:#x}, TTL {ttl}");
        orphan
    }

    #[test]
    fn a_lease_a_failed_join_could_not_revoke_is_revoked_by_the_next_rejoin_and_by_the_drop() {
        // Goal: a member transaction applied with its answer lost, then the new lease's revoke
        // failing, left the member key under a lease nobody renewed or tracked: the next rejoin
        // answered NodeIdTaken (blaming another process) for up to a TTL, and dropping the node
        // revoked nothing. Now that lease is the node's: the next rejoin revokes it (as its old
        // lease) and joins, and a drop revokes it.
        let Some(etcd) = start_etcd() else { return };
        let (mut node, config) = join_node_a(&etcd, "orphan");
        let id = node.record.node.clone();

        let joined = node.health().lease_id;
        let orphan = rejoin_orphaning_a_lease(&mut node, &etcd);
        let rejoined = node.rejoin().expect("the rejoin after revokes the orphaned lease");
        // The lease joined under went with the failed rejoin's revoke.
        assert_eq!(rejoined, Rejoined { old_lease_id: joined, old_lease_revoked: true, left: Vec::new() });
        assert_eq!(ttl_left(&node.client, orphan), -1, "the orphaned lease is gone");
        let lease_id = node.health().lease_id;
        assert_eq!(member_key_lease(&node.client, &id), lease_id);
        assert!(!node.health().lost);

        let orphan = rejoin_orphaning_a_lease(&mut node, &etcd);
        let reader = ClusterClient::connect(config).unwrap();
        drop(node);
        assert_eq!(ttl_left(&reader, orphan), -1, "the drop revoked the orphaned lease");
        assert_eq!(member_key_lease(&reader, &id), 0, "the member key went with it");
    }

    #[test]
    fn a_rejoin_revokes_the_lease_an_earlier_rejoin_could_not_as_well_as_the_orphan() {
        // Goal: a rejoin whose revoke of the old lease L0 failed, then whose member transaction's
        // answer was lost and whose new lease L1's revoke failed too, left the member key under
        // L0 (alive) and L1 as the node's lease. The next rejoin revoked only L1 and answered
        // NodeIdTaken{L0} — blaming another process — until L0 expired (up to a TTL). Now it
        // revokes every lease of the node that may live, L0 included, and joins.
        let Some(etcd) = start_etcd() else { return };
        let (mut node, _) = join_node_a(&etcd, "unrevoked");
        let first = node.health().lease_id;

        node.fail_revoke = vec![first];
        let holder = rejoin_orphaning_a_lease(&mut node, &etcd);
        node.fail_revoke = Vec::new();
        assert_eq!(holder, first, "the member key stayed under the lease whose revoke failed");
        let second = node.health().lease_id;
        assert_ne!(second, first, "the failed rejoin's new lease is the node's");
        assert!(ttl_left(&node.client, second) > 0, "its revoke failed: it lives");

        let rejoined = node.rejoin().expect("the rejoin revokes both leases and joins");
        assert_eq!(ttl_left(&node.client, first), -1, "the lease the first rejoin could not revoke is gone");
        assert_eq!(ttl_left(&node.client, second), -1, "the orphaned lease is gone");
        assert_eq!(rejoined.old_lease_id, first, "the lease joined under, not the orphan");
        assert!(rejoined.old_lease_revoked);
        assert!(rejoined.left.is_empty(), "{:?}", rejoined.left);
        assert_eq!(member_key_lease(&node.client, &node.record.node), node.health().lease_id);
        assert!(!node.health().lost);
    }

    #[test]
    fn a_rejoin_reports_the_leases_of_the_node_it_left() {
        // Goal: the answer tells the owner which leases of the node may live on with entries
        // under them (the registrar then keeps its unregister queue to delete them under the
        // new one, and names them). A rejoin whose revoke of L0 failed, then a rejoin revoking
        // L1 but failing L0's revoke again, answered "revoked" for L1 though L0 and its
        // registrations lived on; then it said only "not revoked", and the registrar's warning
        // named L1, the lease that was gone.
        let Some(etcd) = start_etcd() else { return };
        let (mut node, _) = join_node_a(&etcd, "left");
        let first = node.health().lease_id;
        // The member key deleted by hand (as the keep-alive's watch sees): L0 lives on without
        // it, so a rejoin under a new lease succeeds while L0 cannot be revoked.
        delete_member_key(&node);
        node.fail_revoke = vec![first];
        let rejoined = node.rejoin().expect("joins under a new lease");
        assert_eq!(rejoined, Rejoined { old_lease_id: first, old_lease_revoked: false, left: vec![first] });
        let second = node.health().lease_id;

        let rejoined = node.rejoin().expect("joins under a new lease again");
        assert_eq!(rejoined.old_lease_id, second);
        assert_eq!(ttl_left(&node.client, second), -1);
        assert!(ttl_left(&node.client, first) > 0, "the hook kept the first lease alive");
        assert_eq!(
            rejoined,
            Rejoined { old_lease_id: second, old_lease_revoked: true, left: vec![first] },
            "the first lease and its entries live"
        );

        node.fail_revoke = Vec::new();
        let rejoined = node.rejoin().expect("joins once more");
        assert!(rejoined.old_lease_revoked);
        assert_eq!(rejoined.left, Vec::<i64>::new(), "every lease of the node is gone now");
        assert_eq!(ttl_left(&node.client, first), -1);
    }
    #[test]
    fn a_rejoin_reports_a_lease_given_up_past_the_two_kept_while_it_may_live() {
        // Goal: Rejoined::left names every lease of the node that may live with entries under
        // it. Joined under L1, rejoins whose revokes fail join under L2, L3 and L4 (the member
        // key deleted by hand each time); the third gives L1 up (past the two kept: not tried
        // again). A rejoin that then revoked L4, L3 and L2 answered {L4, revoked, left: []}:
        // the registrar dropped its unregister queue, though entries under L1 live until L1
        // expires.
        let Some(etcd) = start_etcd() else { return };
        let (mut node, _) = join_node_a(&etcd, "given-up");
        let first = node.health().lease_id;
        for _ in 0..3 {
            delete_member_key(&node);
            node.fail_revoke.push(node.health().lease_id);
            let rejoined = node.rejoin().expect("joins under a new lease");
            assert!(!rejoined.old_lease_revoked);
            assert!(rejoined.left.contains(&first), "{rejoined:?}");
        }
        assert!(!node.unrevoked.contains(&first), "the test needs the first lease past the two kept: {:?}", node.unrevoked);
        assert!(ttl_left(&node.client, first) > 0);

        node.fail_revoke = Vec::new();
        let rejoined = node.rejoin().expect("revokes the leases it kept and joins");
        assert!(rejoined.old_lease_revoked, "{rejoined:?}");
        assert!(ttl_left(&node.client, first) > 0, "the lease given up lives");
        assert_eq!(rejoined.left, vec![first], "the entries under the lease given up may live");
    }

    #[test]
    fn a_rejoin_after_one_that_orphaned_its_lease_reports_the_lease_joined_under() {
        // Goal: the answer says whether the lease the node's entries were put under is gone.
        // Joined under L1, a rejoin whose revoke of L1 failed (the member key deleted by hand:
        // its join goes ahead) had its member transaction's answer lost and could not revoke
        // its new lease O: O became the node's lease. The next rejoin revoked O, failed L1's
        // revoke again and answered {old: O, revoked, left: [L1]}: the registrar took the
        // entries as gone and dropped its unregister queue, though they live under L1.
        let Some(etcd) = start_etcd() else { return };
        let (mut node, _) = join_node_a(&etcd, "joined");
        let first = node.health().lease_id;
        delete_member_key(&node);

        node.fail_revoke = vec![first];
        let orphan = rejoin_orphaning_a_lease(&mut node, &etcd);
        assert_eq!(orphan, node.health().lease_id, "the failed rejoin's new lease holds the member key and is the node's");
        assert_ne!(orphan, first);

        let rejoined = node.rejoin().expect("revokes the orphan and joins");
        assert_eq!(ttl_left(&node.client, orphan), -1, "the orphan is gone");
        assert!(ttl_left(&node.client, first) > 0, "the lease joined under lives");
        assert_eq!(
            rejoined,
            Rejoined { old_lease_id: first, old_lease_revoked: false, left: vec![first] },
            "the entries put under the lease joined under live"
        );
        node.fail_revoke = Vec::new();
    }
}

#[cfg(test)]
mod own_lease_tests {
    use super::rejoin_test_support::{delete_member_key, join_node_a, rejoin_losing_the_member_answer, start_etcd};
    use super::*;

    #[test]
    fn a_rejoin_refused_by_the_nodes_own_unrevoked_lease_does_not_blame_another_process() {
        // Goal: a rejoin asked for with the lease live (the registrar's unregister queue full)
        // whose revoke of that lease failed found the member key under it and answered
        // NodeIdTaken, "is another tuttid running with this id?", shown as the registrar's last
        // error. The key is under this node's own old lease: the error says so (it expires by
        // itself, or the next rejoin revokes it).
        let Some(etcd) = start_etcd() else { return };
        let (mut node, _) = join_node_a(&etcd, "own");
        let first = node.health().lease_id;

        node.fail_revoke = vec![first];
        let error = node.rejoin().map(|_| ()).expect_err("the member key is still under the first lease");
        assert!(!matches!(error, ClusterError::NodeIdTaken { .. }), "blamed on another process: {error}");
        assert!(error.to_string().contains(&format!("{first:#x}")), "names the lease: {error}");
        assert!(matches!(error, ClusterError::OwnLeaseHolds { lease_id, .. } if lease_id == first), "{error:?}");

        node.fail_revoke = Vec::new();
        node.rejoin().expect("the next rejoin revokes the old lease and joins");
        assert!(!node.health().lost);
    }

    #[test]
    fn a_rejoin_refused_by_an_own_lease_past_the_two_kept_does_not_blame_another_process() {
        // Goal: a rejoin that fails three revokes keeps the newest two to revoke again; the
        // member key may be under the third (here the lease the first failed rejoin orphaned
        // after its member transaction was applied, its answer lost). The holder was checked
        // only against the two kept, so that rejoin answered NodeIdTaken, blaming another
        // process, for the node's own lease. Then (answered OwnLeaseHolds) the next rejoin,
        // with etcd answering revokes again, tried only the two kept, not the holder, and
        // answered NodeIdTaken until the holder expired: the holder is kept to revoke again.
        let Some(etcd) = start_etcd() else { return };
        let (mut node, _) = join_node_a(&etcd, "own-past");
        let first = node.health().lease_id;
        // The member key deleted by hand: the first failed rejoin's transaction puts it under
        // its new lease.
        delete_member_key(&node);

        // Three rejoins fail every revoke, and each orphans its new lease (an answer lost as
        // etcd stops): the member key stays under the first orphan.
        node.fail_revoke = vec![first];
        for _ in 0..3 {
            rejoin_losing_the_member_answer(&mut node, &etcd);
            node.fail_revoke.push(node.health().lease_id);
        }
        let holder = node.fail_revoke[1];
        // The next rejoin tries the last orphan and the two kept, and fails all three.
        assert_eq!(node.unrevoked, vec![node.fail_revoke[2], holder]);
        assert_eq!(node.health().lease_id, node.fail_revoke[3]);

        let error = node.rejoin().map(|_| ()).expect_err("the member key is still under the first orphan");
        assert!(matches!(error, ClusterError::OwnLeaseHolds { lease_id, .. } if lease_id == holder), "{error:?}");

        // etcd answers revokes again: the next rejoin revokes the holder too (the rejoin that
        // found it kept it to revoke again) and joins. It tried only the two it kept, and
        // answered NodeIdTaken{holder}, blaming another process, until the holder expired.
        node.fail_revoke = Vec::new();
        node.rejoin().expect("the next rejoin revokes the lease holding the member key and joins");
        assert!(!node.health().lost);
        assert!(node.unrevoked.is_empty(), "{:?}", node.unrevoked);
    }

    #[test]
    fn a_leave_says_whether_the_nodes_leases_are_gone() {
        // Goal: the owner rewrites its journal of deletes still to make only once every entry
        // of the node went with its lease: leave says whether each revoke succeeded.
        let Some(etcd) = start_etcd() else { return };
        let (node, _) = join_node_a(&etcd, "leave-revoked");
        let lease_id = node.health().lease_id;
        assert!(node.leave(), "the lease was revoked");
        let (node, _) = join_node_a(&etcd, "leave-revoked");
        assert_ne!(node.health().lease_id, lease_id);
        let (mut node, _) = join_node_a(&etcd, "leave-failed");
        node.fail_revoke = vec![node.health().lease_id];
        assert!(!node.leave(), "the revoke failed: the lease and its entries live on");
    }
}

#[cfg(test)]
mod fence_tests {
    use super::rejoin_test_support::{join_node_a, start_etcd};
    use super::*;
    use crate::names::SegmentKey;

    fn space() -> ModelSpace {
        ModelSpace::new([7; 32], 0, 1).unwrap()
    }

    fn segment(key: u64) -> Segment {
        Segment { index: 0, key: SegmentKey::new(key).unwrap() }
    }

    /// Sends `transaction` as one more attempt through the node's connection (as a member
    /// stalled on its disk applies an attempt it held): whether etcd applied it.
    fn send_late(node: &ClusterNode, transaction: Txn) -> bool {
        node.client
            .connection
            .call_kv("a late attempt", |mut kv| {
                let transaction = transaction.clone();
                async move { kv.txn(transaction).await }
            })
            .unwrap()
            .succeeded()
    }

    fn kept(node: &ClusterNode) -> Txn {
        node.last_guarded.lock().unwrap().clone().expect("a guarded write was sent")
    }

    fn listed(node: &ClusterNode, key: u64) -> bool {
        !node.lookup(&space(), &[segment(key)]).unwrap().holders.is_empty()
    }

    #[test]
    fn a_registration_applied_late_after_its_delete_is_refused() {
        // Goal: a registration's attempt that etcd applies late (sent again to the next member
        // after it timed out, the first one held by a member stalled on its disk) after the
        // delete that followed it listed the evicted segment again, until the lease ended: the
        // only guard was the member key's lease, the same for both. Each guarded write is now
        // fenced on the member key's mod revision, which every write moves on.
        let Some(etcd) = start_etcd() else { return };
        let (node, _) = join_node_a(&etcd, "fence-late-put");
        node.register(&space(), &[segment(11)]).unwrap();
        let registration = kept(&node);
        node.unregister(&space(), &[segment(11)]).unwrap();
        assert!(!listed(&node, 11));

        assert!(!send_late(&node, registration), "the late registration was applied");
        assert!(!listed(&node, 11), "the evicted segment is listed again");
        assert!(!node.health().lost, "the node's own writes moved the key: not a takeover");
    }

    #[test]
    fn the_fence_is_the_member_keys_revision_after_each_write() {
        // Goal: the fence a guarded write takes from its answer's header is the member key's
        // mod revision (etcd gives every write of a transaction the revision its header names),
        // so the next write is not refused and sent twice.
        let Some(etcd) = start_etcd() else { return };
        let (node, _) = join_node_a(&etcd, "fence-revision");
        let key = node.client.layout.member_key(&node.record.node);
        let mod_revision = || {
            let key = key.clone();
            let answer = node.client.connection.call_kv("read the member key", |mut kv| {
                let key = key.clone();
                async move { kv.get(key, None).await }
            });
            answer.unwrap().kvs()[0].mod_revision()
        };
        assert_eq!(*node.fence.lock().unwrap(), mod_revision(), "after the join");
        node.register(&space(), &[segment(21), segment(22)]).unwrap();
        assert_eq!(*node.fence.lock().unwrap(), mod_revision(), "after a registration");
        node.unregister(&space(), &[segment(21)]).unwrap();
        assert_eq!(*node.fence.lock().unwrap(), mod_revision(), "after a delete");
        assert!(listed(&node, 22) && !listed(&node, 21));
    }

    #[test]
    fn a_write_after_an_earlier_calls_late_attempt_is_still_applied() {
        // Goal: a refused write that finds the key under its lease at a newer revision cannot
        // tell whether its own attempt moved it or a late attempt of an earlier call that failed
        // (its answer lost, the owner to send it again). Taking it as its own answered Ok and
        // dropped its writes: here the delete of segment 31 after a failed registration of 32
        // applied late. Its writes are sent again under the new fence instead.
        let Some(etcd) = start_etcd() else { return };
        let (node, _) = join_node_a(&etcd, "fence-earlier-call");
        node.register(&space(), &[segment(31)]).unwrap();
        // A registration of 32 whose call failed (no answer, the node's fence unchanged): its
        // attempt, under the node's fence, applied late, before the node's next write.
        let key = node.client.layout.member_key(&node.record.node);
        let value = node.record.encode(node.client.layout.cluster()).unwrap();
        let lease_id = node.health().lease_id;
        let put = TxnOp::put(
            node.client.layout.segment_key(&space(), segment(32).key, &node.record.node),
            SegmentRecord {
                node: node.record.node.clone(),
                space: space(),
                key: segment(32).key,
                index: 0,
                segment_blocks: node.client.config.segment_blocks,
            }
            .encode(node.client.layout.cluster()),
            Some(PutOptions::new().with_lease(lease_id)),
        );
        let late = fenced(&key, &value, lease_id, *node.fence.lock().unwrap(), vec![put]);
        assert!(send_late(&node, late), "the late attempt holds the fence the node has");
        assert!(listed(&node, 32));

        node.unregister(&space(), &[segment(31)]).expect("the delete is sent again under the new fence");
        assert!(!listed(&node, 31), "the delete was dropped, taken as applied");
        assert!(!node.health().lost);
    }

    #[test]
    fn a_write_that_waited_for_the_one_in_flight_still_has_its_own_timeout() {
        // Goal: guarded writes go one at a time (the fence's lock). The deadline was taken
        // before the lock: a write made while another hung on etcd (up to T) found its deadline
        // spent once it got the lock, sent nothing and answered Unavailable. Here A's
        // registration hangs on a paused etcd for T, B's unregistration waits for it, and etcd
        // is back soon after A gave up: B succeeds within its own T.
        let Some(etcd) = start_etcd() else { return };
        let (node, config) = join_node_a(&etcd, "fence-wait");
        node.register(&space(), &[segment(51), segment(52)]).unwrap();
        etcd.lock().unwrap().pause(0).unwrap();
        *node.last_guarded.lock().unwrap() = None;
        let (a, b) = std::thread::scope(|scope| {
            let a = scope.spawn(|| node.register(&space(), &[segment(53)]));
            // B starts once A holds the fence's lock (A records its transaction under it just
            // before sending): not after a fixed sleep, which a loaded machine could outrun.
            let waiting_since = Instant::now();
            while node.last_guarded.lock().unwrap().is_none() {
                assert!(waiting_since.elapsed() < Duration::from_secs(10), "A never sent its write");
                std::thread::sleep(Duration::from_millis(1));
            }
            let b = scope.spawn(|| node.unregister(&space(), &[segment(52)]));
            let a = a.join().unwrap();
            // B holds the lock now; etcd comes back well within a T from there.
            std::thread::sleep(config.request_timeout / 10);
            etcd.lock().unwrap().resume(0).unwrap();
            (a, b.join().unwrap())
        });
        assert!(matches!(a, Err(ClusterError::Unavailable { .. })), "{a:?}");
        assert_eq!(b.expect("the write that waited has its own timeout"), 1);
        assert!(!listed(&node, 52) && listed(&node, 51));
        assert!(!node.health().lost);
    }

    #[test]
    fn a_write_after_the_member_key_was_deleted_marks_the_node_lost() {
        // Goal: only a key still under the node's lease is taken as moved by the node's own
        // late attempts: a member key gone (deleted by hand) marks the node lost at its next
        // write, as before the fence.
        let Some(etcd) = start_etcd() else { return };
        let (node, _) = join_node_a(&etcd, "fence-lost");
        node.register(&space(), &[segment(41)]).unwrap();
        super::rejoin_test_support::delete_member_key(&node);
        assert!(matches!(node.register(&space(), &[segment(42)]), Err(ClusterError::LeaseLost { .. })));
        assert!(node.health().lost);
    }
}

#[cfg(test)]
mod keep_alive_log_tests {
    use super::rejoin_test_support::start_etcd;
    use super::*;
    use crate::names::{ClusterId, KeySecretTag};
    use crate::segments::SegmentBlocks;
    use std::sync::atomic::AtomicU64;
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Level, Metadata, Subscriber};

    /// Counts the warnings whose message speaks of a lease renewal.
    struct RenewalWarnings(Arc<AtomicU64>);

    struct Message(String);

    impl Visit for Message {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }

    impl Subscriber for RenewalWarnings {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, event: &Event<'_>) {
            let mut message = Message(String::new());
            event.record(&mut message);
            if *event.metadata().level() == Level::WARN && message.0.contains("lease renewal") {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    #[test]
    fn a_keep_alive_retrying_while_etcd_is_down_warns_once_per_ttl() {
        // Goal: with etcd down the keep-alive retries every 20..250 ms plus the attempt, and
        // each retry logged a warning (~2,900 an hour with the defaults). Now the first failure
        // is logged and then at most one line per lease TTL; every attempt is still counted in
        // `renewal_failures`.
        let Some(etcd) = start_etcd() else { return };
        let endpoints = etcd.lock().unwrap().endpoints();
        let mut config = ClusterConfig::new(endpoints, ClusterId::new("quiet").unwrap(), SegmentBlocks::new(16).unwrap());
        // Renewals every second, a summary every 3 s at most.
        config.lease_ttl = Duration::from_secs(3);
        config.request_timeout = Duration::from_secs(1);
        let record = MemberRecord {
            node: NodeId::new("a").unwrap(),
            key_secret_tag: KeySecretTag::new([0x5e; 4]),
            address: "127.0.0.1:7001".into(),
            capacity_bytes: 1 << 40,
            fingerprints: vec![],
        };
        let warnings = Arc::new(AtomicU64::new(0));
        // A second dispatcher alive for the whole test: with only one registered, tracing-core
        // 0.1 caches a call site's interest from whichever thread reaches it first
        // (tokio-rs/tracing#3611), so another test's keep-alive, with no subscriber, could
        // leave the warning cached as disabled and nothing would be counted here.
        let _second_dispatch = tracing::Dispatch::new(RenewalWarnings(Arc::new(AtomicU64::new(0))));
        // The keep-alive logs to the subscriber current at the join.
        let node = tracing::subscriber::with_default(RenewalWarnings(warnings.clone()), || ClusterNode::join(config, record).unwrap());
        etcd.lock().unwrap().kill(0).unwrap();
        let started = Instant::now();
        while node.health().renewal_failures < 6 {
            assert!(started.elapsed() < Duration::from_secs(20), "renewals kept failing too slowly: {:?}", node.health());
            std::thread::sleep(Duration::from_millis(50));
        }
        let failures = node.health().renewal_failures;
        // The first failure came at most a renewal interval (1 s) after the kill.
        let logged_max = 1 + started.elapsed().as_secs() / 3;
        let logged = warnings.load(Ordering::Relaxed);
        assert!((1..=logged_max).contains(&logged), "{logged} warnings for {failures} failed renewals in {:?}", started.elapsed());
    }
}
