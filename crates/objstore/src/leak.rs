//! DMA memory the store gives up for good because a controller may still use it: the buffers of
//! metadata commands on a queue pair whose deletion failed (header mirrors among them), and the
//! mapping table when the executor could not delete one of its queue pairs, or does not say
//! whether it did while a layer is in flight. Freeing such memory would hand its IOVA to the
//! next allocation while a late command still reads or writes it.
//! Every leak is logged at error level and counted here, for the whole process.

use std::sync::atomic::{AtomicU64, Ordering};

use nvme_driver::{DmaRegion, IoQueuePair, NvmeError};

static LEAKED_BYTES: AtomicU64 = AtomicU64::new(0);
static LEAKED_REGIONS: AtomicU64 = AtomicU64::new(0);

/// Bytes of DMA memory the object store leaked so far in this process (see the module docs).
pub fn leaked_dma_bytes() -> u64 {
    LEAKED_BYTES.load(Ordering::Relaxed)
}

/// DMA regions the object store leaked so far in this process.
pub fn leaked_dma_regions() -> u64 {
    LEAKED_REGIONS.load(Ordering::Relaxed)
}

#[cfg(test)]
thread_local! {
    /// What this thread leaked: each test runs on a thread of its own, so a test counts its
    /// own leaks here, unaffected by tests leaking in parallel.
    static LEAKED_REGIONS_HERE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// DMA regions leaked by the calling thread (tests: by the calling test alone).
#[cfg(test)]
pub(crate) fn leaked_dma_regions_on_this_thread() -> u64 {
    LEAKED_REGIONS_HERE.with(std::cell::Cell::get)
}

/// Keeps `regions` for good (a leaked clone keeps the whole allocation, whatever happens to the
/// other handles), counted and logged with `why`.
pub(crate) fn leak_regions(regions: &[&DmaRegion], why: &str) {
    for region in regions {
        let iova = region.iova();
        let bytes = (*region).clone().leak();
        LEAKED_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
        LEAKED_REGIONS.fetch_add(1, Ordering::Relaxed);
        #[cfg(test)]
        LEAKED_REGIONS_HERE.with(|leaked| leaked.set(leaked.get() + 1));
        tracing::error!(%iova, bytes, why, "objstore: DMA memory kept for good (leaked): a controller may still use it");
    }
}

/// Deletes `queue`, whose commands may name `buffers`. If the controller does not confirm the
/// deletion while commands were in flight on it (a timeout), those commands may still move
/// data, so `buffers` are leaked along with the pair's rings (the driver leaks those), and the
/// error is returned. `Ok`: none of its commands moves data any more.
pub(crate) fn retire_queue_pair(queue: IoQueuePair, buffers: &[&DmaRegion]) -> Result<(), NvmeError> {
    let in_flight = queue.in_flight();
    match queue.delete() {
        Ok(()) => Ok(()),
        Err(undeleted) => {
            if in_flight > 0 {
                leak_regions(buffers, "a metadata queue pair with commands in flight could not be deleted");
            }
            let source = undeleted.source;
            drop(undeleted.pair); // tries once more, else leaks its rings
            Err(source)
        }
    }
}
