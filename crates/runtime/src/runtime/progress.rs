//! The runtime's machinery below the engine-facing calls: reaping completions, committing
//! finished stores, the read/write barrier and issuing what may go (`pump`), bounded waits, and
//! the write queue's bounds (`make_room`).

use std::time::Instant;

use gio_uring::{Executor, SmBudget};
use objstore::ObjstoreError;
use scheduler::policy::Issue;
use scheduler::table::IoKind;

use super::{Prefill, PrefillId, Reads, Runtime};
use crate::error::{store_error, Result, RuntimeError};
use crate::events::{IoDirection, IoEvent, IoEventKind};
use crate::writes::WriteQueue;

impl<E: Executor> Runtime<E> {
    pub(super) fn prefill_of(&mut self, call: &'static str, id: PrefillId) -> Result<&mut Prefill> {
        let active = self.prefill.as_ref().map(|p| p.id);
        match self.prefill.as_mut() {
            Some(prefill) if prefill.id == id.0 => Ok(prefill),
            _ => Err(RuntimeError::StaleRequest { call, request: id.0, active }),
        }
    }

    pub(super) fn outstanding_read_iocbs(&self) -> u32 {
        self.reads.outstanding_iocbs()
    }

    pub(super) fn apply(&mut self, issue: &Issue) {
        match (issue.kind, issue.layer) {
            (IoKind::Read, Some(layer)) => self.decide_read(layer, issue.sm_budget.clamp(1, self.read_budget.0)),
            (IoKind::Read, None) => {}
            (IoKind::Write, _) => {
                // The policy's budget for this grant (a window's free SMs, at most the table's
                // largest): the executor gets it with every layer the grant releases, and the
                // grant is worth what the table says that many IOCBs take on that budget.
                let budget = issue.sm_budget.clamp(1, self.write_budget.0);
                let profile = &self.profile;
                // A table without write rows for the budget: the count itself, for grants and
                // layers alike (the IOCB-counting rule, latency not included).
                self.writes.decide(issue.iocb_count, budget, |iocbs| {
                    profile.io_duration_us(IoKind::Write, iocbs, budget).unwrap_or(f64::from(iocbs))
                });
            }
        }
    }

    /// The policy issued (some of) layer `layer`'s reads on `budget` SMs: the whole layer waits
    /// to be handed over, with the largest budget any of its issues asked for.
    pub(super) fn decide_read(&mut self, layer: u32, budget: u32) {
        let index = layer as usize;
        let Some(unissued) = self.reads.unissued_iocbs.get_mut(index) else { return };
        if *unissued > 0 {
            *unissued = 0;
            self.reads.waiting.push_back(layer);
            self.reads.budgets[index] = budget;
        } else if self.reads.waiting.contains(&layer) {
            self.reads.budgets[index] = self.reads.budgets[index].max(budget);
        }
    }

    pub(super) fn barrier(&self) -> bool {
        self.config.policy.read_write_barrier()
    }

    pub(super) fn reads_pending(&self) -> bool {
        self.reads.in_flight.is_some() || !self.reads.waiting.is_empty()
    }

    pub(super) fn record(&mut self, request: u64, direction: IoDirection, layer: u32, kind: IoEventKind, sm_budget: Option<SmBudget>) {
        self.log.record(IoEvent { at: Instant::now(), request, direction, layer, kind, sm_budget });
    }

    /// Reaps completions, commits finished stores, issues what may go.
    pub(super) fn progress(&mut self) -> Result<()> {
        if let (Some(layer), Some(handle)) = (self.reads.in_flight, self.prefill.as_ref().and_then(|p| p.retrieve)) {
            match self.store.poll(handle) {
                Ok(true) => self.complete_read(layer),
                Ok(false) => {}
                Err(source) => return Err(self.read_failed(layer, source)),
            }
        }
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
                Err(source) => self.write_failed(index, &source)?,
            }
        }
        self.commit_written()?;
        self.pump()
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

    /// A read failed: the prefill ends (its retrieve and store are dropped) and the error says so.
    pub(super) fn read_failed(&mut self, layer: u32, source: ObjstoreError) -> RuntimeError {
        self.reads.in_flight = None;
        let request = self.prefill.as_ref().map_or(0, |p| p.id);
        self.record(request, IoDirection::Read, layer, IoEventKind::Completed, None);
        if let Err(error) = self.end_reads().and_then(|()| self.drop_store(request)) {
            tracing::warn!(%error, "runtime: cleaning up after a failed read");
        }
        RuntimeError::ReadFailed { layer, source }
    }

    /// Finishes the running prefill's retrieve (nothing of it may be in flight) and ends it.
    pub(super) fn end_reads(&mut self) -> Result<()> {
        self.reads.waiting.clear();
        self.reads.unissued_iocbs.fill(0);
        if let Some(handle) = self.prefill.take().and_then(|p| p.retrieve) {
            self.store.finish(handle).map_err(store_error("finish the retrieve"))?;
        }
        Ok(())
    }

    /// A write of the store at `index` failed: the store is dropped (its blocks never become
    /// visible, its engine blocks are released); the others continue.
    pub(super) fn write_failed(&mut self, index: usize, source: &ObjstoreError) -> Result<()> {
        let Some(store) = self.writes.remove(index) else { return Ok(()) };
        let layer = store.written_layers;
        tracing::warn!(request = store.request, layer, error = %source, "runtime: a deferred write failed; the store is dropped");
        self.record(store.request, IoDirection::Write, layer, IoEventKind::Completed, None);
        self.counters.stores_failed += 1;
        // The failed wait ended the layer: nothing of the store is in flight.
        let finished = self.store.finish(store.handle).map_err(store_error("finish a failed store"));
        self.writes.recycle(store.engine_blocks);
        finished
    }

    /// Drops the store of `request` if queued (waiting for its write in flight first).
    pub(super) fn drop_store(&mut self, request: u64) -> Result<()> {
        let Some(index) = self.writes.index_of(request) else { return Ok(()) };
        if self.writes.stores[index].in_flight.is_some() {
            let handle = self.writes.stores[index].handle;
            // Its outcome does not matter: the store is dropped either way.
            let _ = self.store.wait(handle, Instant::now() + self.config.io_timeout);
        }
        if let Some(store) = self.writes.remove(index) {
            self.store.finish(store.handle).map_err(store_error("finish a dropped store"))?;
            self.writes.recycle(store.engine_blocks);
        }
        Ok(())
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
                    self.counters.stores_committed += 1;
                    self.counters.blocks_committed += blocks as u64;
                }
                Err(error) => {
                    // The store released its slots: the blocks never become visible.
                    tracing::warn!(request = store.request, %error, "runtime: commit failed; the store is dropped");
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
            self.store
                .queue_mut()
                .peek_cqe()
                .map_err(|error| RuntimeError::Store { operation: "start issued I/O", source: error.into() })?;
        }
        Ok(())
    }

    pub(super) fn pump_layers(&mut self) -> Result<()> {
        let barrier = self.barrier();
        if self.reads.in_flight.is_none() && !(barrier && self.writes.any_in_flight()) {
            if let (Some(&layer), Some(handle)) = (self.reads.waiting.front(), self.prefill.as_ref().and_then(|p| p.retrieve)) {
                let budget = SmBudget(self.reads.budgets[layer as usize]);
                self.store.retrieve_layer(handle, layer, budget).map_err(store_error("retrieve_layer"))?;
                self.reads.waiting.pop_front();
                self.reads.in_flight = Some(layer);
                self.counters.read_layers_issued += 1;
                if self.writes.any_in_flight() {
                    self.counters.mixed_issues += 1;
                }
                let request = self.prefill.as_ref().map_or(0, |p| p.id);
                self.record(request, IoDirection::Read, layer, IoEventKind::Issued, Some(budget));
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
            let budget = SmBudget(store.sm_budget);
            self.store.store_layer(handle, layer, budget).map_err(store_error("store_layer"))?;
            self.writes.stores[index].in_flight = Some(layer);
            self.counters.write_layers_issued += 1;
            if deferred {
                self.counters.write_layers_deferred += 1;
            }
            if self.reads.in_flight.is_some() {
                self.counters.mixed_issues += 1;
            }
            self.record(request, IoDirection::Write, layer, IoEventKind::Issued, Some(budget));
        }
        Ok(())
    }

    pub(super) fn wait_read(&mut self) -> Result<()> {
        let (Some(layer), Some(handle)) = (self.reads.in_flight, self.prefill.as_ref().and_then(|p| p.retrieve)) else { return Ok(()) };
        match self.store.wait(handle, Instant::now() + self.config.io_timeout) {
            Ok(_) => {
                self.complete_read(layer);
                Ok(())
            }
            Err(source) => Err(self.read_failed(layer, source)),
        }
    }

    pub(super) fn wait_writes(&mut self) -> Result<()> {
        let mut index = 0;
        while index < self.writes.stores.len() {
            if self.writes.stores[index].in_flight.is_none() {
                index += 1;
                continue;
            }
            let handle = self.writes.stores[index].handle;
            match self.store.wait(handle, Instant::now() + self.config.io_timeout) {
                Ok(_) => {
                    self.complete_write(index);
                    index += 1;
                }
                Err(ObjstoreError::Gio(timeout @ gio_uring::GioError::WaitTimeout { .. })) => {
                    return Err(RuntimeError::Store { operation: "wait for a write", source: ObjstoreError::Gio(timeout) })
                }
                Err(source) => self.write_failed(index, &source)?,
            }
        }
        Ok(())
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
                // Under the barrier a read waits for the writes in flight.
                self.wait_writes()?;
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

    /// Makes room for `incoming` blocks in the write queue, as configured.
    pub(super) fn make_room(&mut self, incoming: usize) -> Result<()> {
        let (limit_blocks, limit_stores) = (self.config.write_queue_limit_blocks, self.config.write_queue_limit_stores);
        let over = |writes: &WriteQueue| writes.queued_blocks + incoming > limit_blocks || writes.stores.len() + 1 > limit_stores;
        let full = |writes: &WriteQueue, action: &'static str| RuntimeError::WriteQueueFull {
            queued_blocks: writes.queued_blocks,
            queued_stores: writes.stores.len(),
            incoming_blocks: incoming,
            limit_blocks,
            limit_stores,
            action,
        };
        if !over(&self.writes) {
            return Ok(());
        }
        let action = self.config.on_write_queue_full;
        if action == crate::config::WriteQueueFullAction::Refuse || incoming > limit_blocks {
            self.counters.stores_refused += 1;
            return Err(full(&self.writes, if incoming > limit_blocks { "larger than the whole queue" } else { action.name() }));
        }
        while over(&self.writes) && !self.writes.stores.is_empty() {
            self.force_oldest()?;
            self.counters.stores_forced += 1;
        }
        Ok(())
    }

    /// Writes and commits the oldest queued store now (no prefill runs: no read is pending).
    pub(super) fn force_oldest(&mut self) -> Result<()> {
        let Some(oldest) = self.writes.stores.front_mut() else { return Ok(()) };
        oldest.decided_layers = oldest.ready_layers;
        oldest.sm_budget = self.write_budget.0;
        let request = oldest.request;
        for _ in 0..self.layers as usize + 2 {
            self.progress()?;
            if self.writes.index_of(request).is_none() {
                return Ok(());
            }
            self.wait_writes()?;
        }
        self.progress()
    }
}
