//! The runtime's machinery below the engine-facing calls: reaping completions, committing
//! finished stores, the read/write barrier and issuing what may go (`pump`), bounded waits, and
//! the write queue's bounds (`make_room`), and ending requests whose I/O may still be in flight
//! (retiring them: see `crate::writes`).

use std::time::Instant;

use gio_uring::{Executor, IocbFailure, SmBudget};
use objstore::{ObjstoreError, RequestHandle};
use scheduler::policy::Issue;
use scheduler::table::IoKind;

use super::{Prefill, PrefillId, Reads, Runtime};
use crate::config::IO_TIMEOUT_MAX;
use crate::error::{store_error, Result, RuntimeError};
use crate::events::{IoDirection, IoEvent, IoEventKind};
use crate::writes::WriteQueue;

/// The operation of the `Store` error `advance` returns for an executor error no live I/O took
/// (`retire_ended` met it; writes in flight).
pub(super) const POLL_THE_EXECUTOR: &str = "poll the executor";

impl<E: Executor> Runtime<E> {
    pub(super) fn prefill_of(&mut self, call: &'static str, id: PrefillId) -> Result<&mut Prefill> {
        let active = self.prefill.as_ref().map(|p| p.id);
        match self.prefill.as_mut() {
            Some(prefill) if prefill.id == id.0 => Ok(prefill),
            _ => Err(RuntimeError::StaleRequest { call, request: id.0, active }),
        }
    }

    /// One `io_timeout` from now: the deadline of a bounded wait. `Runtime::new` keeps
    /// `io_timeout` within `IO_TIMEOUT_MAX` (a day), so the sum fits an `Instant`; were it not to,
    /// the wait gets that day rather than a panic.
    pub(super) fn io_deadline(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(self.config.io_timeout).or_else(|| now.checked_add(IO_TIMEOUT_MAX)).unwrap_or(now)
    }

    /// Applies one issue of a plan.
    pub(super) fn apply(&mut self, issue: &Issue) {
        match (issue.kind, issue.layer) {
            (IoKind::Read, Some(layer)) => self.decide_read(layer, issue.sm_budget.clamp(1, self.read_budget.0)),
            (IoKind::Read, None) => {}
            (IoKind::Write, _) => {
                // The policy's budget for this grant (a window's free SMs, at most the table's
                // largest): the executor gets it with every layer the grant releases (and no
                // other: `PendingStore::layer_budgets`), and the grant is worth what the table says that many IOCBs take on that budget.
                let budget = issue.sm_budget.clamp(1, self.write_budget.0);
                let profile = &self.profile;
                // A table without write rows for the budget: the count itself, for grants and
                // layers alike (the IOCB-counting rule, latency not included).
                let cost_us = |iocbs| profile.io_duration_us(IoKind::Write, iocbs, budget).unwrap_or(f64::from(iocbs));
                if !issue.after_reads {
                    // A flush (naive, no-overlap: the whole queue, whatever else the device
                    // does), not a grant priced into a window: everything ready goes.
                    self.writes.flush(budget);
                } else if issue.iocb_count == 0 {
                    // A window where not one IOCB fits: its time joins the carry.
                    self.writes.decide_time(issue.slack_us, budget, cost_us);
                } else {
                    self.writes.decide(issue.iocb_count, budget, cost_us);
                }
            }
        }
    }

    /// The policy issued (some of) layer `layer`'s reads on `budget` SMs (`Reads::decide`).
    pub(super) fn decide_read(&mut self, layer: u32, budget: u32) {
        self.reads.decide(layer, budget);
    }

    pub(super) fn barrier(&self) -> bool {
        self.config.policy.read_write_barrier()
    }

    /// Whether a read of the running prefill is pending: in flight, waiting to be handed over,
    /// or not issued by the policy yet. Under the barrier no write is handed over meanwhile: the
    /// policy grants writes only once every read of the request is issued, to start after those
    /// reads complete (`scheduler::policy::SlackAware`, rule 4). Layers released earlier (by a
    /// decode step, one handed over at a time) wait too; before, they went whenever reads were
    /// momentarily idle, between one layer's read completing and the next one's issue.
    pub(super) fn reads_pending(&self) -> bool {
        self.reads.in_flight.is_some()
            || !self.reads.waiting.is_empty()
            || (self.prefill.is_some() && self.reads.done.iter().any(|&done| !done))
    }

    /// The running prefill's first read not handed over yet (waiting, or not issued by the
    /// policy yet), if it has one and none is in flight.
    fn read_to_come(&self) -> Option<u32> {
        if self.reads.in_flight.is_some() || self.prefill.as_ref().is_none_or(|p| p.retrieve.is_none()) {
            return None;
        }
        let undone = || self.reads.done.iter().position(|&done| !done).and_then(|layer| u32::try_from(layer).ok());
        self.reads.waiting.front().copied().or_else(undone)
    }

    pub(super) fn record(&mut self, request: u64, direction: IoDirection, layer: u32, kind: IoEventKind, sm_budget: Option<SmBudget>) {
        self.log.record(IoEvent { at: Instant::now(), request, direction, layer, kind, sm_budget });
    }

    /// Reaps completions, retires what ended, commits finished stores, issues what may go.
    pub(super) fn progress(&mut self) -> Result<()> {
        self.advance(true)
    }

    /// `progress`, handing waiting layers to the executor only if `issue`.
    pub(super) fn advance(&mut self, issue: bool) -> Result<()> {
        // gio-uring reports an executor error (a stopped worker, a lasting doorbell fault) once,
        // to whichever poll meets it first, and the retiring requests are polled first. Kept
        // (`Runtime::executor_failure`, with one kept by an earlier call: met with no live
        // I/O, or by the poll starting the layers a call handed over), it goes to the live I/O
        // polled below, as though its own poll had met it: otherwise no wait of it ever saw
        // the error, and each waited a whole `io_timeout` to fail as `WaitTimeout`, which
        // points the engine at `abandon_in_flight` and not the executor. Only a claim takes
        // it: a read failing or completing on its own leaves it for the writes, and with no
        // live I/O it waits for the next (or `begin_prefill`). (Failing a read still drops the
        // prefill's store, which waits for its write in flight: see `read_failed`.)
        self.retire_ended();
        self.reap_read()?;
        // A failed write drops its store only: the pass goes on (the other writes polled, what
        // finished committed, the executor's error handed on), and the first such error is
        // returned at its end.
        let mut write_failure = None;
        let mut index = 0;
        while index < self.writes.stores.len() {
            let store = &self.writes.stores[index];
            if store.in_flight.is_none() {
                index += 1;
                continue;
            }
            match self.store.poll(store.handle) {
                Ok(true) => {
                    self.complete_write(index);
                    index += 1;
                }
                Ok(false) => index += 1,
                // The store left the queue (finished or retiring): `index` is the next one's.
                Err(source) => {
                    if let Err(error) = self.write_failed(index, &source) {
                        write_failure.get_or_insert(error);
                    }
                }
            }
        }
        self.commit_written()?;
        // No read in flight took it: the writes still in flight would not see it either. Their
        // stores stay queued (their own layers did not fail, as far as anyone knows); the error
        // says the executor failed.
        if self.writes.any_in_flight() {
            if let Some(source) = self.executor_failure.take() {
                if let Some(error) = write_failure {
                    tracing::warn!(%error, "runtime: a failed store could not be finished (the executor's error is returned)");
                }
                // The running prefill's read still to come waits behind them (the barrier) and
                // goes to the same executor: it fails as it does behind a write whose wait timed
                // out (`wait_for_reads`), the prefill ended and its targets free. Returned as
                // `Store`, the prefill kept running, holding them, and `begin_prefill` refused
                // until `abort_prefill`.
                if let Some(blocked) = self.read_to_come() {
                    return Err(self.read_failed(blocked, source));
                }
                return Err(RuntimeError::Store { operation: POLL_THE_EXECUTOR, source });
            }
        }
        if let Some(error) = write_failure {
            return Err(error);
        }
        if issue {
            self.pump()?;
            // An executor error kept now (the poll starting the layers just handed over met
            // it) or still kept (no live I/O took it above) goes to those layers in this call,
            // by one more pass that hands nothing over (so it ends): the read just handed over
            // fails with it (`ReadFailed`), or the writes in flight return it (`Store` "poll
            // the executor"). Left for the next call, the caller's own wait came first: a
            // read's wait (`wait_for_reads`), a forced store's or a drain's (`wait_writes`)
            // ran a whole `io_timeout` on the failed executor, to fail as `WaitTimeout` (the
            // kept error then forgotten by the `abandon_in_flight` that points the engine at)
            // or, for a forced store, `WriteQueueFull`.
            if self.executor_failure.is_some() {
                return self.advance(false);
            }
        }
        Ok(())
    }

    /// The executor error kept for the live I/O (`Runtime::executor_failure`), taken and
    /// returned as a `Store` error ("poll the executor"); `Ok` when none is kept.
    pub(super) fn claim_executor_failure(&mut self) -> Result<()> {
        match self.executor_failure.take() {
            Some(source) => Err(RuntimeError::Store { operation: POLL_THE_EXECUTOR, source }),
            None => Ok(()),
        }
    }

    /// The running prefill's read in flight: its layer and the retrieve's handle.
    fn read_in_flight(&self) -> Option<(u32, RequestHandle)> {
        Some((self.reads.in_flight?, self.prefill.as_ref()?.retrieve?))
    }

    /// Polls the running prefill's read in flight, if any: completed, it is done; failed, or
    /// still in flight with an executor error kept (`Runtime::executor_failure`, which it
    /// claims: its own polls would never see it), the prefill ends (`read_failed`).
    fn reap_read(&mut self) -> Result<()> {
        let Some((layer, handle)) = self.read_in_flight() else { return Ok(()) };
        // `poll` answers `Ok(true)` whenever nothing of the request is in flight, including a
        // layer that never was or was ended unfilled without the runtime hearing of it (the
        // shape of the partial-abandon bug): only one the object store still holds can
        // complete here.
        if !self.device_holds_layer(handle, layer) {
            return Err(self.read_failed(layer, read_not_in_flight(handle, layer, None)));
        }
        match self.store.poll(handle) {
            Ok(true) => self.complete_read(layer),
            Ok(false) => {
                if let Some(source) = self.executor_failure.take() {
                    return Err(self.read_failed(layer, source));
                }
            }
            Err(source) => return Err(self.read_failed(layer, source)),
        }
        Ok(())
    }

    /// Whether the object store has a layer of `handle` in flight: the device may still move its
    /// bytes, so the request cannot be finished and its engine blocks must stay held.
    pub(super) fn device_holds(&self, handle: RequestHandle) -> bool {
        self.store.layers_in_flight(handle).is_ok_and(|mut layers| layers.next().is_some())
    }

    /// Whether the object store has layer `layer` of `handle` in flight: after an issue that
    /// failed, whether its commands were published all the same (`GioError::SubmitFailed`);
    /// after `abandon_in_flight` failed, whether it was reaped before the error.
    pub(super) fn device_holds_layer(&self, handle: RequestHandle, layer: u32) -> bool {
        self.store.layers_in_flight(handle).is_ok_and(|mut layers| layers.any(|in_flight| in_flight == layer))
    }

    /// Finishes the retiring requests whose layer in flight ended, releasing their engine
    /// blocks. Never blocks: each is polled once. A finish refused although nothing of the
    /// request is in flight is logged, not returned: its blocks are released all the same (the
    /// device no longer moves them), and the call that happened to retire it (another
    /// prefill's `before_layer`, a decode step) did not fail. An executor error a poll meets
    /// (`executor_error`; logged) is kept in `Runtime::executor_failure`: reported once, it is
    /// the live I/O's as much as theirs, and `advance` hands it on. Only the first is kept
    /// until claimed: the later ones (logged) most likely follow from it.
    pub(super) fn retire_ended(&mut self) {
        let mut index = 0;
        // Bounded: each round keeps one entry (index moves on) or removes it.
        while index < self.writes.retiring.len() {
            let handle = self.writes.retiring[index].handle;
            // A failed layer has ended as surely as a completed one (the request is dropped either
            // way), so the poll's outcome only matters through `device_holds`, unless it is the
            // executor's own (`executor_error`).
            if let Err(error) = self.store.poll(handle) {
                if executor_error(&error) {
                    tracing::warn!(%error, "runtime: the executor failed while a retiring request was polled");
                    self.executor_failure.get_or_insert(error);
                } else {
                    tracing::debug!(%error, "runtime: polling a retiring request");
                }
            }
            if self.device_holds(handle) {
                index += 1;
                continue;
            }
            let finished = self.store.finish(handle);
            if let Some(entry) = self.writes.remove_retiring(index) {
                tracing::info!(request = entry.request, "runtime: a retiring request's layer ended; its engine blocks are released");
                // Its issue is closed in the event log as the counters stop counting beside it
                // (`WriteQueue::retiring_in`).
                if let Some(layer) = entry.layer {
                    let direction = if entry.read { IoDirection::Read } else { IoDirection::Write };
                    self.record(entry.request, direction, layer, IoEventKind::Completed, None);
                }
                if let Err(error) = finished {
                    tracing::error!(request = entry.request, %error, "runtime: finishing a retiring request with nothing in flight was refused");
                }
                self.writes.recycle(entry.engine_blocks);
            }
        }
    }

    /// Waits, until one `io_timeout` from now for all of them together, for the retiring
    /// requests' layers to end, then retires those that did.
    pub(super) fn wait_retiring(&mut self) -> Result<()> {
        let deadline = self.io_deadline();
        for index in 0..self.writes.retiring.len() {
            let handle = self.writes.retiring[index].handle;
            match self.store.wait(handle, deadline) {
                Err(error) if executor_error(&error) => {
                    tracing::warn!(%error, "runtime: the executor failed while a retiring request was waited for");
                    self.executor_failure.get_or_insert(error);
                }
                Err(error) => tracing::debug!(%error, "runtime: waiting for a retiring request"),
                Ok(_) => {}
            }
        }
        // Only `drain` waits for them, once it has waited for the writes (or one timed out):
        // an executor error met here, as one met by the waits above, is logged and kept for
        // the next live I/O or `begin_prefill`, and the drain answers with what is left
        // (`DrainIncomplete`).
        self.retire_ended();
        Ok(())
    }

    pub(super) fn complete_read(&mut self, layer: u32) {
        self.reads.in_flight = None;
        self.reads.done[layer as usize] = true;
        let request = self.prefill.as_ref().map_or(0, |p| p.id);
        self.record(request, IoDirection::Read, layer, IoEventKind::Completed, None);
    }

    pub(super) fn complete_write(&mut self, index: usize) {
        let store = &mut self.writes.stores[index];
        let layer = store.written_layers;
        store.in_flight = None;
        store.written_layers += 1;
        let request = store.request;
        self.record(request, IoDirection::Write, layer, IoEventKind::Completed, None);
    }

    /// A read failed (or its wait timed out, or the executor failed): the prefill ends, its
    /// retrieve and store are dropped (retiring if a layer of them is still in flight) and the
    /// error says so. Dropping the store waits (`drop_store`, one `io_timeout` at most) for its
    /// write in flight, if any: so a read failed with an executor's error is not always failed
    /// at once. Under `Naive` (no barrier) the prefill's own store can have a write in flight
    /// while its reads are still to come, and on a stopped executor that wait runs the whole
    /// `io_timeout` before `ReadFailed` comes back (the store then retiring); under the
    /// barrier policies no write of the prefill's is in flight while a read is. A read the device failed with a media error status (`is_media_error`)
    /// also evicts the retrieve's cached blocks (later lookups miss them and the prefix is
    /// stored again).
    pub(super) fn read_failed(&mut self, layer: u32, source: ObjstoreError) -> RuntimeError {
        // A read blocked behind a write (never handed over) has no issue to close in the log.
        let was_in_flight = self.reads.in_flight.take() == Some(layer);
        let request = self.prefill.as_ref().map_or(0, |p| p.id);
        let ended = self.prefill.as_ref().and_then(|p| p.retrieve).is_none_or(|handle| !self.device_holds(handle));
        if was_in_flight && ended {
            self.record(request, IoDirection::Read, layer, IoEventKind::Completed, None);
        }
        // The device failed a read with a media error (an unreadable LBA, say), not a wait that
        // timed out: the cached blocks are evicted before the retrieve ends, as blocks a
        // verification found damaged are. Left cached, every later request with this prefix
        // would hit them and fail the same way, and its store would be dropped each time. Any
        // other status (Namespace Not Ready, Internal Error, a host DMA fault, an abort) says
        // nothing of the media: the prefix stays cached.
        let media = matches!(&source, ObjstoreError::LayerIo { failure: IocbFailure::Nvme { status, .. }, .. } if is_media_error(*status));
        if let (true, Some(handle)) = (media, self.prefill.as_ref().and_then(|p| p.retrieve)) {
            match self.store.evict_retrieve(handle, self.io_deadline()) {
                Ok(blocks) => tracing::warn!(request, layer, blocks, "runtime: a cached prefix the device failed to read is evicted"),
                Err(error) => tracing::warn!(request, layer, %error, "runtime: evicting a cached prefix the device failed to read"),
            }
        }
        // Both always run: a retrieve left in flight must not keep the store queued (it would
        // never commit, and the queue limit would force it forever).
        let reads = self.end_reads();
        let store = self.drop_store(request);
        for error in [reads, store].into_iter().filter_map(Result::err) {
            tracing::warn!(%error, "runtime: ending the prefill after a failed read");
        }
        RuntimeError::ReadFailed { layer, source }
    }

    /// Ends the running prefill and its retrieve: finished now, or, with a layer still in flight
    /// (its wait timed out), retiring with its target engine blocks held (`StillInFlight`).
    pub(super) fn end_reads(&mut self) -> Result<()> {
        self.reads.waiting.clear();
        self.reads.unissued_iocbs.fill(0);
        self.reads.in_flight = None;
        let Some(prefill) = self.prefill.take() else { return Ok(()) };
        let Some(handle) = prefill.retrieve else {
            self.writes.release_targets(prefill.read_targets);
            return Ok(());
        };
        match self.store.finish(handle) {
            Ok(()) => {
                self.writes.release_targets(prefill.read_targets);
                Ok(())
            }
            Err(refusal) if self.device_holds(handle) => {
                // Its target blocks, held since `begin_prefill`, stay held while it retires.
                tracing::warn!(
                    request = prefill.id,
                    blocks = prefill.read_targets.len(),
                    "runtime: a retrieve ended with a layer in flight; it retires when the device ends it, its target blocks held"
                );
                let layer = self.store.layers_in_flight(handle).ok().and_then(|mut layers| layers.next());
                self.writes.retire_retrieve(prefill.id, handle, prefill.read_targets, layer);
                Err(RuntimeError::StillInFlight { request: prefill.id, operation: "finish the retrieve", source: refusal })
            }
            Err(source) => {
                self.writes.release_targets(prefill.read_targets);
                Err(RuntimeError::Store { operation: "finish the retrieve", source })
            }
        }
    }

    /// Takes the store at `index` off the queue uncommitted: finished, its engine blocks
    /// released, when nothing of it is in flight; otherwise retiring with its blocks held, and
    /// the error says so (`StillInFlight`, naming `cause`, the failed wait, when there was one).
    pub(super) fn end_store(&mut self, index: usize, operation: &'static str, cause: Option<ObjstoreError>) -> Result<()> {
        let Some(store) = self.writes.stores.get(index) else { return Ok(()) };
        let (request, handle, in_flight) = (store.request, store.handle, store.in_flight);
        match self.store.finish(handle) {
            // Its layer in flight is closed in the event log when the device ends it
            // (`retire_ended`).
            Err(refusal) if self.device_holds(handle) => {
                self.writes.retire(index);
                tracing::warn!(
                    request,
                    "runtime: a store ended with a layer in flight; it retires when the device ends it, its engine blocks held"
                );
                Err(RuntimeError::StillInFlight { request, operation, source: cause.unwrap_or(refusal) })
            }
            finished => {
                // The layer it had in flight ended (completed or failed, the wait of
                // `drop_store` or `write_failed`'s poll or wait collected it).
                if let Some(layer) = in_flight {
                    self.record(request, IoDirection::Write, layer, IoEventKind::Completed, None);
                }
                if let Some(store) = self.writes.remove(index) {
                    self.writes.recycle(store.engine_blocks);
                }
                finished.map_err(store_error(operation))
            }
        }
    }

    /// A write of the store at `index` failed: the store is dropped (its blocks never become
    /// visible; its engine blocks are released once nothing of it is in flight); the others
    /// continue.
    pub(super) fn write_failed(&mut self, index: usize, source: &ObjstoreError) -> Result<()> {
        let Some(store) = self.writes.stores.get(index) else { return Ok(()) };
        let (request, layer) = (store.request, store.written_layers);
        tracing::warn!(request, layer, error = %source, "runtime: a deferred write failed; the store is dropped");
        // `end_store` closes its layer in the event log (now, or when a retiring one ends).
        self.counters.stores_failed += 1;
        match self.end_store(index, "finish a failed store", None) {
            // Retiring (logged): dropped as far as the queue goes, its blocks held meanwhile.
            Err(RuntimeError::StillInFlight { .. }) => Ok(()),
            other => other,
        }
    }

    /// Drops the store of `request` if queued, waiting (bounded) for its write in flight first.
    /// A write still in flight after the wait leaves it retiring (`StillInFlight`).
    pub(super) fn drop_store(&mut self, request: u64) -> Result<()> {
        let Some(index) = self.writes.index_of(request) else { return Ok(()) };
        let store = &self.writes.stores[index];
        // A failed wait ends the layer as well as a completion (the store is dropped either
        // way); one that timed out leaves it in flight, and then says why.
        let cause = match store.in_flight {
            Some(_) => {
                let handle = store.handle;
                self.store.wait(handle, self.io_deadline()).err()
            }
            None => None,
        };
        self.end_store(index, "drop a store", cause)
    }

    /// Commits every store whose layers are all written, when no read is pending (a commit
    /// flushes and writes slot headers: writes, under the barrier).
    pub(super) fn commit_written(&mut self) -> Result<()> {
        if self.barrier() && self.reads_pending() {
            return Ok(());
        }
        let mut index = 0;
        while index < self.writes.stores.len() {
            let store = &self.writes.stores[index];
            if store.written_layers < self.layers || store.in_flight.is_some() {
                index += 1;
                continue;
            }
            let Some(store) = self.writes.remove(index) else { break };
            match self.store.commit_store(store.handle) {
                Ok(blocks) => {
                    if self.forcing == Some(store.request) {
                        self.counters.stores_forced += 1;
                    }
                    self.counters.stores_committed += 1;
                    self.counters.blocks_committed += blocks as u64;
                }
                Err(error) => {
                    // The blocks never become visible. A commit that began ended the handle
                    // either way; one refused before it began (objstore's `HandleState`: a layer
                    // not stored) leaves the request held, its slots reserved, until `finish`.
                    // Nothing of it is in flight (checked above), so finishing it is safe; for a
                    // handle the commit already ended, finish answers UnknownHandle, ignored.
                    tracing::warn!(request = store.request, %error, "runtime: commit failed; the store is dropped");
                    if let Err(refusal) = self.store.finish(store.handle) {
                        tracing::debug!(request = store.request, %refusal, "runtime: finishing a store whose commit failed");
                    }
                    self.counters.stores_failed += 1;
                }
            }
            self.writes.recycle(store.engine_blocks);
        }
        Ok(())
    }

    /// Hands waiting layers to the executor: the next read when the previous one completed (and,
    /// under the barrier, no write is in flight); released writes when no read is pending.
    pub(super) fn pump(&mut self) -> Result<()> {
        let issued_before = self.counters.read_layers_issued + self.counters.write_layers_issued;
        self.pump_layers()?;
        if self.counters.read_layers_issued + self.counters.write_layers_issued != issued_before {
            // A caller-driven executor (the CPU one) turns issued IOCBs into device commands only
            // when polled: start them now rather than at the next boundary. Peeking consumes no
            // completion.
            if let Err(error) = self.store.queue_mut().peek_cqe() {
                // Every error of this poll is the executor's or its queue's (a stopped worker, a
                // lasting doorbell fault, a corrupt ring: `executor_error`; only a wait returns
                // `WaitTimeout`, and `peek_cqe` does not wait), reported once and here often by
                // the first poll since the layers were handed over: it is theirs, and their own
                // polls will not see it. Kept (`Runtime::executor_failure`),
                // `advance` fails them with it in this call (its pass after `pump`); a call
                // that hands over last, calling `pump` itself (`begin_layer`, `decode_step`,
                // `abandon_in_flight`), leaves it to the next call, which fails them with it
                // before any wait of theirs (`advance`, `wait_read`). Returned, it was gone once
                // the caller had it (`ObjstoreError` cannot be both kept and returned), and a
                // read just handed over waited a whole `io_timeout` to fail as `WaitTimeout`.
                // The layers were handed over: the call goes on.
                let source = ObjstoreError::from(error);
                tracing::warn!(error = %source, "runtime: the executor failed starting the layers handed over; kept for them");
                self.executor_failure.get_or_insert(source);
            }
        }
        Ok(())
    }

    pub(super) fn pump_layers(&mut self) -> Result<()> {
        let barrier = self.barrier();
        if self.reads.in_flight.is_none() && !(barrier && self.writes.any_in_flight()) {
            if let (Some(&layer), Some(handle)) = (self.reads.waiting.front(), self.prefill.as_ref().and_then(|p| p.retrieve)) {
                let budget = SmBudget(self.reads.budgets[layer as usize]);
                let issued = self.store.retrieve_layer(handle, layer, budget);
                // An issue that failed once its commands were published (`SubmitFailed`) left
                // the layer in flight in the object store: it is recorded as in flight here as
                // well, so that the next call collects it (completed, or failed through
                // `read_failed`) and no write goes under it. Left waiting, it was handed over
                // again at every call and refused as "already in flight", for good.
                if issued.is_err() && !self.device_holds_layer(handle, layer) {
                    return issued.map_err(store_error("retrieve_layer"));
                }
                self.reads.waiting.pop_front();
                self.reads.in_flight = Some(layer);
                self.counters.read_layers_issued += 1;
                // Beside a write in flight, or a retiring store's the device still holds.
                if self.writes.any_in_flight() || self.writes.retiring_in(false) {
                    self.counters.mixed_issues += 1;
                }
                let request = self.prefill.as_ref().map_or(0, |p| p.id);
                self.record(request, IoDirection::Read, layer, IoEventKind::Issued, Some(budget));
                issued.map_err(store_error("retrieve_layer"))?;
            }
        }
        if barrier && self.reads_pending() {
            return Ok(());
        }
        // One write layer in flight at a time, oldest store first. The device serves a
        // direction FIFO, so handing over several stores' layers at once moves no byte sooner;
        // it only queues them on the device, where a read that arrives must wait for all of
        // them under the barrier (no-overlap's first read waited for one layer of each queued
        // store: ~4 ms at hit rate 0.75, docs/scheduler.md "Live vs simulated"). The simulator
        // runs a direction's kernels one after another, each paying the command latency.
        if self.writes.any_in_flight() {
            return Ok(());
        }
        if let Some(index) = self.writes.stores.iter().position(|store| store.written_layers < store.decided_layers) {
            let store = &self.writes.stores[index];
            let (handle, layer, request, deferred) = (store.handle, store.written_layers, store.request, store.prefill_ended);
            // The budget of the grant that released this layer (`PendingStore::layer_budgets`),
            // which `hand_over` records as the one it is priced on while in flight.
            let budget = SmBudget(store.layer_budget(layer));
            let issued = self.store.store_layer(handle, layer, budget);
            // As for a read: a layer the object store holds in flight after a failed issue is
            // in flight here too, so that the next call collects it (through `write_failed` if
            // it failed) and reads keep waiting for it under the barrier.
            if issued.is_err() && !self.device_holds_layer(handle, layer) {
                return issued.map_err(store_error("store_layer"));
            }
            self.writes.hand_over(index, layer);
            self.counters.write_layers_issued += 1;
            if deferred {
                self.counters.write_layers_deferred += 1;
            }
            // Beside a read in flight, or a retiring retrieve's the device still holds (its wait
            // timed out: `end_reads` took it off `reads.in_flight`).
            if self.reads.in_flight.is_some() || self.writes.retiring_in(true) {
                self.counters.mixed_issues += 1;
            }
            self.record(request, IoDirection::Write, layer, IoEventKind::Issued, Some(budget));
            issued.map_err(store_error("store_layer"))?;
        }
        Ok(())
    }

    pub(super) fn wait_read(&mut self) -> Result<()> {
        // A kept executor error is this read's if it is still in flight (`reap_read`), as in
        // `advance`: a call that handed it over last and did not advance after (`begin_layer`,
        // then `abort_prefill`) left it kept, and the wait below would never see it.
        if self.executor_failure.is_some() {
            self.reap_read()?;
        }
        let Some((layer, handle)) = self.read_in_flight() else { return Ok(()) };
        match self.store.wait(handle, self.io_deadline()) {
            Ok(Some(waited)) if waited == layer => {
                self.complete_read(layer);
                Ok(())
            }
            // Nothing in flight (`None`), or another layer: this read did not land, whatever
            // happened to it. Taken as landed, its layer's wait returned on blocks the device
            // may never have filled.
            Ok(other) => Err(self.read_failed(layer, read_not_in_flight(handle, layer, other))),
            Err(source) => Err(self.read_failed(layer, source)),
        }
    }

    /// Waits (one `io_timeout` each) for the write layers in flight. `Ok(Some(timeout))` when a
    /// wait timed out: that layer is still in flight and its store queued, and the caller says
    /// what that means for it (a read waiting behind it fails, `ReadFailed`; a drain is
    /// incomplete; a forced store leaves the queue full). A write that failed drops its store
    /// (`write_failed`).
    pub(super) fn wait_writes(&mut self) -> Result<Option<ObjstoreError>> {
        let mut index = 0;
        while index < self.writes.stores.len() {
            if self.writes.stores[index].in_flight.is_none() {
                index += 1;
                continue;
            }
            let handle = self.writes.stores[index].handle;
            match self.store.wait(handle, self.io_deadline()) {
                Ok(_) => {
                    self.complete_write(index);
                    index += 1;
                }
                Err(ObjstoreError::Gio(timeout @ gio_uring::GioError::WaitTimeout { .. })) => return Ok(Some(ObjstoreError::Gio(timeout))),
                Err(source) => self.write_failed(index, &source)?,
            }
        }
        Ok(None)
    }

    /// Waits until layer `layer`'s reads (all reads with `None`) completed, issuing waiting
    /// layers as the ones before them complete.
    pub(super) fn wait_for_reads(&mut self, layer: Option<u32>) -> Result<()> {
        let done = |reads: &Reads| match layer {
            Some(layer) => reads.done[layer as usize],
            None => reads.done.iter().all(|&done| done),
        };
        // Each pass completes a read or a write, or fails: bounded by the layers in flight.
        let bound = 2 * (self.layers as usize + self.writes.stores.len()) + 4;
        for _ in 0..bound {
            self.progress()?;
            if done(&self.reads) {
                return Ok(());
            }
            if self.reads.in_flight.is_some() {
                self.wait_read()?;
            } else if !self.reads.waiting.is_empty() && self.writes.any_in_flight() {
                // Under the barrier a read waits for the writes in flight. One that timed out
                // (its completion lost, say) fails the read waiting behind it as a read of its
                // own would: `ReadFailed`, the prefill ended. Nothing of that read was handed
                // over, so its targets are free at once. Before, the timeout came up as
                // `Store { "wait for a write" }` with the prefill still running, holding its
                // targets, and `begin_prefill` refused until the engine called `abort_prefill`.
                if let Some(source) = self.wait_writes()? {
                    let blocked = self.reads.waiting.front().copied().or(layer).unwrap_or(0);
                    return Err(self.read_failed(blocked, source));
                }
            } else if self.reads.waiting.is_empty() {
                break;
            }
        }
        if done(&self.reads) {
            return Ok(());
        }
        Err(RuntimeError::ReadsNeverIssued {
            policy: self.config.policy.name(),
            layer: layer.unwrap_or(self.layers),
            unissued: self.reads.unissued_iocbs.clone(),
        })
    }

    /// Makes room for a new store of `incoming` blocks in the write queue, as configured, and
    /// among the object store's request slots for it and, if `retrieve`, the request's retrieve.
    /// Queued stores and retiring requests hold slots too; forcing can end the former, never the
    /// latter. Returns whether the store goes ahead: when the retiring requests alone leave no
    /// slot for it beside the retrieve, it is skipped at once (nothing forced; counted in
    /// `stores_skipped_no_request_slot`) and the retrieve runs. Otherwise, under `ForceOldest`
    /// the oldest stores whose prefill ended are written and committed (each forced once at
    /// most); if that does not make room, or for `Refuse`, `WriteQueueFull`, naming the bound.
    pub(super) fn make_room(&mut self, incoming: usize, retrieve: bool) -> Result<bool> {
        let (limit_blocks, limit_stores) = (self.config.write_queue_limit_blocks, self.config.write_queue_limit_stores);
        // A retiring request (a layer in flight the device has not ended) holds an object-store
        // request slot as a queued store does: the queued and retiring ones, the new store and
        // the new request's retrieve (one only on a hit) must fit `requests_max`. Uncounted, at
        // the deepest queue allowed (`requests_max` − 1) the new store took the last slot and the
        // retrieve was refused (`TooManyRequests`).
        let requests_max = self.store.config().requests_max;
        let retrieve_slots = usize::from(retrieve);
        let mut store = incoming > 0;
        if store && self.writes.retiring.len().saturating_add(1 + retrieve_slots) > requests_max {
            // No forcing can make room: skip the store rather than fail the request's retrieve
            // (or, on a miss with every slot retiring, the prefill).
            tracing::warn!(
                retiring = self.writes.retiring.len(),
                requests_max,
                "runtime: retiring requests leave no request slot for the new store; its new KV is not stored"
            );
            self.counters.stores_skipped_no_request_slot += 1;
            store = false;
        }
        let incoming = if store { incoming } else { 0 };
        let cause = |writes: &WriteQueue| {
            if store && writes.queued_blocks + incoming > limit_blocks {
                Some("the block limit")
            } else if store && writes.stores.len() + 1 > limit_stores {
                Some("the store limit")
            } else if writes.stores.len() + writes.retiring.len() + usize::from(store) + retrieve_slots > requests_max {
                Some("the object store's request slots")
            } else {
                None
            }
        };
        let full = |writes: &WriteQueue, cause: &'static str, action: &'static str| RuntimeError::WriteQueueFull {
            queued_blocks: writes.queued_blocks,
            queued_stores: writes.stores.len(),
            retiring_requests: writes.retiring.len(),
            incoming_blocks: incoming,
            limit_blocks,
            limit_stores,
            requests_max,
            cause,
            action,
        };
        let Some(first) = cause(&self.writes) else { return Ok(store) };
        let action = self.config.on_write_queue_full;
        if action == crate::config::WriteQueueFullAction::Refuse || incoming > limit_blocks {
            self.counters.stores_refused += 1;
            return Err(full(&self.writes, first, if incoming > limit_blocks { "larger than the whole queue" } else { action.name() }));
        }
        // Bounded: each round forces one store off the queue (or fails); there are no more
        // rounds than stores.
        for _ in 0..self.writes.stores.len() {
            // Only a store whose prefill ended can complete (every layer ready). While no prefill
            // runs every queued store is one; anything else would never commit, so it is skipped
            // rather than forced forever.
            let Some(index) = self.writes.stores.iter().position(|store| store.prefill_ended) else { break };
            // Counted in `stores_forced` by `commit_written` if it commits (a store whose forced
            // write failed leaves the queue as well, counted in `stores_failed` only).
            let request = self.writes.stores[index].request;
            self.forcing = Some(request);
            let forced = self.force_store(index);
            self.forcing = None;
            if let Err(error) = forced {
                return Err(match error {
                    // The forced store stays queued (a write timed out): no room is made.
                    RuntimeError::WriteQueueFull { action, .. } => {
                        self.counters.stores_refused += 1;
                        full(&self.writes, cause(&self.writes).unwrap_or(first), action)
                    }
                    other => other,
                });
            }
            if cause(&self.writes).is_none() {
                return Ok(store);
            }
        }
        self.counters.stores_refused += 1;
        Err(full(&self.writes, cause(&self.writes).unwrap_or(first), "no queued store could be forced out"))
    }

    /// Writes and commits the queued store at `index` now (no prefill runs: no read is
    /// pending); it leaves the queue committed, or dropped after a failure. `WriteQueueFull` if
    /// it cannot (a write that timed out: the layer stays in flight, the store queued) or did
    /// not within its bound.
    pub(super) fn force_store(&mut self, index: usize) -> Result<()> {
        let Some(store) = self.writes.stores.get_mut(index) else { return Ok(()) };
        // Every layer not yet handed over goes on the table's largest, those an earlier grant
        // released included: the store is on a critical path now.
        store.set_budgets(store.written_layers..store.ready_layers, self.write_budget.0);
        store.decided_layers = store.ready_layers;
        let request = store.request;
        // Each pass completes a write layer (of this store, or of one ahead of it: one layer is
        // in flight at a time, oldest first) or fails.
        let bound = (index + 1) * (self.layers as usize + 2);
        for _ in 0..bound {
            self.progress()?;
            if self.writes.index_of(request).is_none() {
                return Ok(());
            }
            if let Some(timeout) = self.wait_writes()? {
                tracing::warn!(request, error = %timeout, "runtime: a forced store's write timed out; it stays queued");
                return Err(self.forced_store_stuck("a forced write timed out"));
            }
        }
        self.progress()?;
        if self.writes.index_of(request).is_none() {
            return Ok(());
        }
        Err(self.forced_store_stuck("a forced store did not complete"))
    }

    fn forced_store_stuck(&self, action: &'static str) -> RuntimeError {
        RuntimeError::WriteQueueFull {
            queued_blocks: self.writes.queued_blocks,
            queued_stores: self.writes.stores.len(),
            retiring_requests: self.writes.retiring.len(),
            incoming_blocks: 0,
            limit_blocks: self.config.write_queue_limit_blocks,
            limit_stores: self.config.write_queue_limit_stores,
            requests_max: self.store.config().requests_max,
            cause: "a forced store did not leave the queue",
            action,
        }
    }
}

/// The failure of read `layer`, in flight in the runtime, when the object store does not hold it
/// in flight (`found`: `None`) or collected another layer of the retrieve (`Some`). A retrieve
/// has at least one block, so every layer it issues has IOCBs and is in flight until collected;
/// the runtime has one read in flight at a time and collects it only through `advance`'s poll or
/// `wait_read`, so this is a bug's shape (an ended layer not requeued), not a device's.
fn read_not_in_flight(handle: RequestHandle, layer: u32, found: Option<u32>) -> ObjstoreError {
    let found = match found {
        None => "holds no layer of it in flight".to_string(),
        Some(other) => format!("collected layer {other} instead"),
    };
    ObjstoreError::HandleState {
        handle: handle.to_bits(),
        reason: format!("layer {layer}'s read is in flight in the runtime, but the object store {found}: it did not land"),
    }
}

/// Whether an error a retiring request's poll or wait returned is the executor's (or its queue's)
/// rather than its own layer's: any `ObjstoreError::Gio` but a wait that timed out (what a retiring
/// layer's wait is expected to do). The layer's own failure comes back as `LayerIo` (or a
/// verification's `PayloadMismatch`) and ends only that request: debug. An executor error
/// (gio-uring's `WorkerStopped`, a lasting doorbell fault, a corrupt ring) is reported once, to
/// whichever wait polls first, and concerns every request: at debug it was lost at the default
/// level when a retiring request happened to meet it. A warning, and met by a poll of
/// `retire_ended` it goes on to the live I/O (`advance`), whose own polls will not see it. (A
/// `Gio` error naming the layer's own IOCB, `WrongState` or `UnknownIocb`, would be a bug: a
/// warning too, and handed on the same way.)
fn executor_error(error: &ObjstoreError) -> bool {
    matches!(error, ObjstoreError::Gio(error) if !matches!(error, gio_uring::GioError::WaitTimeout { .. }))
}

/// Status Code Type of the Media and Data Integrity Errors (NVMe base specification, 2h).
const STATUS_CODE_TYPE_MEDIA: u8 = 2;

/// Whether a read failed with `status` found its LBAs unreadable: a Media and Data Integrity
/// status (an unrecovered read error, a CRC or end-to-end check failure), the one kind the
/// object store's payload check (`objstore::pool`'s private `is_media_error`, behind
/// `Pool::check_payloads`) treats as damaged data. Any other status (Namespace Not Ready,
/// Internal Error, a Data Transfer Error from a host DMA fault, an abort) may read fine later.
fn is_media_error(status: gio_uring::abi::NvmeStatus) -> bool {
    status.status_code_type() == STATUS_CODE_TYPE_MEDIA
}
