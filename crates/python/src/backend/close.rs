//! Ending a store: its requests, its queue pairs, then its memory, given back only once no
//! command can move its bytes (kept for good otherwise).

use std::time::{Duration, Instant};

use objstore::RequestHandle;

use super::{Backend, LeftInFlight, Settling, StoreState};
use crate::device_memory;
use crate::ffi::QueuesGone;

/// How long `close` (or a failed registration) waits at least for tuttid to end a session
/// that registered device memory; `close` counts it from the connection's close.
pub(super) const DEVICE_RELEASE_WAIT: Duration = Duration::from_secs(5);

impl StoreState {
    /// Ends every request (its layers in flight are waited for until `deadline`), then the store:
    /// queue pairs deleted before the registered memory is let go; kept for good if one could
    /// not be. Returns how many tensors were kept for good. What keeps released memory alive
    /// goes to `released` (dropped once the lock is let go).
    ///
    /// Attached stores: the queue pairs are tuttid's to delete, when the session ends (the
    /// connection closes here). A layer still in flight at the deadline (or after a wait that
    /// failed without ending it) may move bytes until then, so its memory (tuttid's window for
    /// `allocate_kv`, device memory) is only given back once tuttid no longer lists the
    /// session and counted no new leaked queue pair (tuttid deletes a session's pairs,
    /// confirmed by the controller, before it drops the session; a pair it could not delete is
    /// counted in `leaked_queue_pairs`); otherwise it is kept for good and counted in
    /// `leaked_registrations`.
    pub fn close(&mut self, deadline: Instant) -> usize {
        let handles: Vec<u64> = self.requests.keys().copied().collect();
        // Whether every layer in flight completed: device memory's bytes are moved by tuttid's
        // copies, which only a command in flight makes. Every layer of every request is waited
        // for (in issue order), not only the oldest: each may still move bytes.
        let mut settled = true;
        // The issues still in flight at the deadline: not done, unless the close proves below
        // that no command of theirs is left (`left_in_flight_at_close`).
        let mut left_in_flight = Vec::new();
        for handle in handles {
            loop {
                match self.settle_step(handle, deadline) {
                    Settling::Continue => continue,
                    Settling::Settled => break,
                    Settling::Unsettled => {
                        settled = false;
                        if let Some(request) = self.requests.get(&handle) {
                            left_in_flight.extend(request.issues.in_flight().map(|(layer, issue)| LeftInFlight {
                                request: handle,
                                layer,
                                issue,
                            }));
                        }
                        break;
                    }
                }
            }
            let bits = RequestHandle::from_bits(handle);
            if let Ok(store) = self.layer_store() {
                if let Err(error) = store.finish(bits) {
                    tracing::warn!(%error, "tutti: finishing request {handle:#x} at close");
                }
            }
        }
        self.requests.clear();
        self.orphans.clear();
        let remote = matches!(self.backend, Backend::Remote { .. });
        // Before the connection closes: tuttid's count of leaked queue pairs, to tell a session
        // that ended cleanly from one whose pair could not be deleted.
        let leaks_before = match (&self.daemon, remote && !settled) {
            (Some(daemon), true) => device_memory::leaked_queue_pairs(daemon, deadline.max(Instant::now() + DEVICE_RELEASE_WAIT)),
            _ => device_memory::LeakCount::NoAnswer,
        };
        // Forgotten while still open (no other file can have their numbers yet); those the
        // drop below leaves open (kept for good with a queue pair) are recorded again after it.
        let recorded: Vec<_> =
            std::mem::take(&mut self.closed_in_forked_children).into_iter().map(|fd| (fd, crate::ffi::fd_identity(fd))).collect();
        crate::process::forget_from_forked_children(&recorded.iter().map(|&(fd, _)| fd).collect::<Vec<_>>());
        let backend = std::mem::replace(&mut self.backend, Backend::Closed);
        let deleted = match backend {
            Backend::Local { store, emulators, locks } => {
                let deleted = store.close();
                drop(emulators);
                drop(locks);
                deleted
            }
            // The client's pairs are the daemon's to delete (when the session ends, after this
            // drop closes the connection); its window stays mapped by the daemon until then.
            Backend::Remote { store } => {
                drop(store);
                true
            }
            other => {
                drop(other);
                true
            }
        };
        let still_open: Vec<_> = recorded
            .into_iter()
            .filter(|&(fd, identity)| identity.is_some() && crate::ffi::fd_identity(fd) == identity)
            .map(|(fd, _)| fd)
            .collect();
        crate::process::keep_from_forked_children(&still_open);
        // Counted from here, once the store is closed: an attached store's drop retires its
        // queue pairs first, which waits (bounded, gio-uring's ATTACHED_RETIRE_WAIT) for
        // commands still in flight, and only then closes the connection, which is what makes
        // tuttid end the session. Counted before, that wait came out of tuttid's window to
        // confirm the end, and memory it would have given back was kept for good.
        let release_wait = deadline.max(Instant::now() + DEVICE_RELEASE_WAIT);
        // A layer left in flight through tuttid: nothing may be given back before the session
        // ended cleanly.
        let ended_cleanly = match (&self.daemon, self.daemon_session, leaks_before) {
            (_, _, device_memory::LeakCount::NoDaemon) => true,
            (Some(daemon), Some(session), device_memory::LeakCount::Counted(before)) => {
                device_memory::session_ended_cleanly(daemon, session, before, release_wait)
            }
            _ => false,
        };
        // A layer left in flight ended (its commands done or aborted, none left to move bytes)
        // once its queue pairs are deleted: the software controller's or VFIO's, confirmed by
        // the close; tuttid's, once the session ended cleanly. Otherwise nothing says it ended.
        let queues_gone = if remote { ended_cleanly } else { deleted };
        if !queues_gone {
            self.left_in_flight_at_close = left_in_flight;
        }
        let memory = std::mem::take(&mut self.caller_memory);
        let mut leaked = 0;
        match QueuesGone::after_close(deleted) {
            Some(proof) => {
                for memory in memory {
                    self.released.extend(memory.release(&proof));
                }
            }
            None => {
                leaked = memory.len();
                // Before the memory is leaked: no other store of this process registers it
                // then (through any object over it).
                if !memory.is_empty() {
                    if let Some(registered) = &self.registered {
                        for tensor in &registered.tensors {
                            crate::memory::record_kept_for_good(tensor.address, tensor.extent_bytes);
                        }
                    }
                }
                drop(memory); // leaks each (CallerMemory's drop)
            }
        }
        let window_reachable = remote && !settled && !ended_cleanly;
        if let Some(allocation) = self.allocation.take() {
            if !deleted || (window_reachable && self.device_memory.is_none()) {
                tracing::error!(
                    regions = allocation.regions.len(),
                    "tutti: the KV memory is kept for good: a layer was still in flight and the devices may still reach it"
                );
                leaked += allocation.regions.len();
                // Before the regions: no other store registers the KvBuffers over them, nor
                // any view of that memory, then.
                allocation.kept_for_good.set();
                for region in &allocation.regions {
                    crate::memory::record_kept_for_good(region.host_address() as u64, region.len() as u64);
                }
                allocation.regions.into_iter().for_each(|region| {
                    region.leak();
                });
            }
        }
        if let Some(hold) = self.device_memory.take() {
            // The connection is closed (the store dropped above): tuttid ends the session.
            let (kept, keeps) = hold.release(settled || ended_cleanly, release_wait);
            leaked += kept;
            self.released.extend(keeps);
        }
        self.leaked_tensors += leaked;
        leaked
    }
}

impl Drop for StoreState {
    fn drop(&mut self) {
        if !self.is_closed() {
            self.close(Instant::now() + Duration::from_secs(5));
        }
    }
}
