//! The end of a store: the executor's queue pairs are deleted before anything their commands
//! name is freed; if one cannot be, or the executor does not say while a layer is in flight,
//! the mapping table is leaked and the engine is told to keep its KV memory.

use gio_uring::Executor;

use super::data::StoreData;
use super::KvStore;

impl<E: Executor> Drop for StoreData<E> {
    fn drop(&mut self) {
        self.retire_queue_pairs();
    }
}

impl<E: Executor> StoreData<E> {
    /// Ends the data half: deletes the executor's queue pairs and says whether the engine may
    /// free its registered KV memory. `false` when the executor reports a queue pair it could
    /// not delete (a controller that stopped answering, after a layer was abandoned or left in
    /// flight), and when it does not say (see `gio_uring::Executor::retire_queue_pairs`) while
    /// a layer of some request is still in flight (issued, never reaped by a `wait`): that
    /// layer's commands may still write the KV memory (a retrieve) or read it (a store), and
    /// read the mapping table, so the table is leaked and the engine must keep its KV memory
    /// registered and allocated for good. `true` when every pair is known deleted, or the
    /// executor does not say and nothing is in flight. Dropping it does the same, without the
    /// answer.
    pub fn close(mut self) -> bool {
        self.retire_queue_pairs()
    }

    /// Retires the queue pairs (see [`StoreData::close`]); `true`: nothing the executor issued
    /// can still touch the KV memory or the mapping table.
    pub(super) fn retire_queue_pairs(&mut self) -> bool {
        match self.retire_reporting() {
            Some(deleted) => deleted,
            // Read after the retirement as before it: only a `wait` reaps a layer, and none
            // comes after (close, drop and `into_pool` consume the store).
            None => !self.layer_in_flight(),
        }
    }

    /// Retires the executor's queue pairs (once; a later call gives the same answer) and
    /// returns what the executor said: `Some(true)` every pair known deleted, `Some(false)`
    /// one not, `None` it does not say. The mapping table is leaked on `Some(false)`, and on
    /// `None` while a layer is in flight: its commands may still be on a live pair.
    pub(super) fn retire_reporting(&mut self) -> Option<bool> {
        if let Some(answer) = self.retired {
            return answer;
        }
        let answer = self.queue.executor_mut().retire_queue_pairs();
        let why = match answer {
            Some(false) => Some("the mapping table: an executor queue pair could not be deleted"),
            None if self.layer_in_flight() => {
                Some("the mapping table: a layer is in flight and the executor does not say whether its queue pairs are gone")
            }
            _ => None,
        };
        if let Some(why) = why {
            if let Some(region) = self.table.region() {
                crate::leak::leak_regions(&[region], why);
            }
            tracing::error!(why, "objstore: the engine's KV memory must not be freed");
        }
        self.retired = Some(answer);
        answer
    }

    /// Whether a layer of some request is in flight (issued, not reaped by a `wait`): its
    /// commands may still move data until the executor's queue pairs are known deleted.
    pub(super) fn layer_in_flight(&self) -> bool {
        self.requests.iter().any(|request| !request.in_flight.is_empty())
    }

    /// Per request index (a handle's, the control half's too): whether a layer of it is in
    /// flight.
    pub(super) fn requests_in_flight(&self) -> Vec<bool> {
        self.requests.iter().map(|request| !request.in_flight.is_empty()).collect()
    }
}

impl<E: Executor> KvStore<E> {
    /// Ends the store: deletes the executor's queue pairs (before the pool, whose targets may
    /// hold the last references to the controllers) and says whether the engine may free its
    /// registered KV memory (see [`StoreData::close`]: not when the executor does not say
    /// whether its pairs are gone and a layer is still in flight). Header entries still staged
    /// (the Empty headers of an eviction no sync wrote since) are then written as the pool is
    /// dropped, best effort, within one metadata timeout for all devices, none on a
    /// controller that reads fatal, not ready or gone (see `Pool`'s `Drop`).
    /// Dropping the store does the same, without the answer.
    pub fn close(self) -> bool {
        let KvStore { data, control, .. } = self;
        let safe = data.close();
        drop(control);
        safe
    }
}
