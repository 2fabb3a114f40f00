//! Recovery from a wait that timed out on a CPU executor: a completion the device lost, or a
//! device that stopped answering. Waiting longer cannot end such a layer, and `finish` refuses
//! a request with a layer in flight (the device might still move its bytes), so without this
//! only dropping the store would free the request.

use std::time::{Duration, Instant};

use gio_uring::QueuePairReset;
use nvme_driver::IoQueuePair;

use super::data::StoreData;
use super::KvStore;
use crate::error::{ObjstoreError, Result};

/// Every IOCB the executor reset ended has its completion posted already; this only bounds
/// the reaping of them.
const REAP_TIMEOUT: Duration = Duration::from_secs(1);

impl<E: QueuePairReset> KvStore<E> {
    /// Ends every layer in flight, of every request: the executor's queue pairs are deleted on
    /// the controllers (which aborts or finishes their commands, so none of them moves data
    /// afterwards) and replaced by fresh ones of the same depth. Returns how many layers were
    /// abandoned. Their requests stay prepared: issue the layers again, or `finish` them.
    ///
    /// For after a [`KvStore::wait`] timed out. It ends healthy layers of other requests too
    /// (reissue them). If a controller fails to delete a queue pair the error says so, and the
    /// layers stay in flight: that controller must be reset before the memory is reused. An
    /// error after the reset, while reaping the completions it posted (a TIMEOUT CQE not posted
    /// yet and the poll failing), may have abandoned some layers and not others: the requests
    /// reaped before it have no layer in flight any more (ended unfilled: their layers are not
    /// done and must be issued again), the others still do, and the error does not say which:
    /// ask [`KvStore::layers_in_flight`]. The GPU executor needs none of this: it resets its
    /// queue pairs itself when a kernel times out, and its layers then complete with a timeout
    /// failure.
    pub fn abandon_in_flight(&mut self) -> Result<usize> {
        let served = self.data.queue().executor().served_queue_depths();
        let mut fresh = Vec::with_capacity(served.len());
        for (device, depth) in served {
            let controller = &self.control.pool().target(device).controller;
            match controller.create_io_queue_pair(depth) {
                Ok(queue) => fresh.push(queue),
                Err(nvme_driver::NvmeError::NoQueueAvailable { granted }) => {
                    return Err(ObjstoreError::QueuePairs {
                        device,
                        granted,
                        needed: usize::from(granted) + 1,
                        reason: "abandon_in_flight creates each replacement queue pair before it deletes the old one (whose commands \
                                 must end first), so it needs a free queue pair per device served: reset the controller instead"
                            .into(),
                    })
                }
                Err(error) => return Err(error.into()),
            }
        }
        self.data.abandon_in_flight(fresh)
    }
}

impl<E: QueuePairReset> StoreData<E> {
    /// Ends every layer in flight by replacing the executor's queue pairs with `fresh` ones
    /// (one per queue pair it serves, in `served_queue_depths` order, made by whoever holds
    /// the controllers), and reaps the completions the reset posted. Returns how many layers
    /// were abandoned; see [`KvStore::abandon_in_flight`], also for an error while reaping:
    /// requests are reaped one at a time and lanes within a request one at a time, so those
    /// before the error have nothing in flight any more, the one it came in has lost the lanes
    /// reaped before it, and those after it still have their layers in flight (ask
    /// [`KvStore::layers_in_flight`] per layer; waiting again on a lane reaped in part returns
    /// its reaped IOCBs' completions at once).
    pub fn abandon_in_flight(&mut self, fresh: Vec<IoQueuePair>) -> Result<usize> {
        // Through the queue, which also forgets the poll errors it kept for a later call: they were
        // about the pairs being replaced, and would fail the first wait after the reissue.
        let ended = self.queue.reset_queue_pairs(fresh)?;
        let mut abandoned = 0;
        for index in 0..self.requests.len() {
            // Consume each in-flight lane's IOCB completions (a timeout posted by the reset, or
            // the result it had before), so that the IOCBs can be issued again. Lanes not in
            // flight were never issued or already reaped.
            while let Some(&(_, lane)) = self.requests[index].in_flight.front() {
                let per_lane = self.requests[index].iocbs_per_lane;
                for i in lane * per_lane..(lane + 1) * per_lane {
                    let id = self.requests[index].iocbs[i];
                    self.queue.wait_cqe(id, Instant::now() + REAP_TIMEOUT)?;
                }
                self.requests[index].in_flight.pop_front();
                abandoned += 1;
            }
        }
        tracing::warn!(abandoned, iocbs_ended = ended, "objstore: abandoned the layers in flight and replaced the NVMe queue pairs");
        Ok(abandoned)
    }
}
