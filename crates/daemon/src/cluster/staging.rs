//! The daemon's own data half, for the data plane: one segment's worth of DMA memory in the
//! pool's address space (block-major: a block's bytes are contiguous, in the disk order the
//! payload CRC covers), an objstore `StoreData` over it and one queue pair per pool device
//! (tuttid starts its software controllers with one more pair in a cluster). A holder reads a
//! segment's blocks into it to send them; an asker writes a fetched segment from it into its
//! own pool. One segment at a time (the caller holds it behind a mutex).
//!
//! The memory is never freed while a command may still write it: a layer left in flight by a
//! failure (a wait that timed out, a failed queue pair) retires the whole staging area ([`Staging::retire`]): the executor's queue pairs are deleted,
//! and if a deletion fails the memory is leaked rather than freed: logged at error level with its
//! size, not counted in the daemon's leak counters (`Status`'s `leaked_*`, kept by the server,
//! which the data plane does not reach). An asker's store reservation kept with it is counted
//! (`ClusterMetrics::kept_reservations`, on `/metrics`). A retired
//! staging area serves nothing more (`None` in the caller) until the daemon restarts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::{CpuExecutor, SmBudget};
use nvme_driver::hw::{DmaAllocator, DmaRegion};
use nvme_driver::DataPointerMode;
use objstore::{
    cpu_executor_for, Direction, KvLayout, KvRegistration, ObjstoreError, Placement, Pool, RequestHandle, StoreConfig, StoreData,
};

/// NVMe queue depth of the staging area's queue pairs.
const QUEUE_DEPTH: u32 = 64;
/// The longest one layer of a segment may take on the devices.
pub const LAYER_TIMEOUT: Duration = Duration::from_secs(10);

/// See the module docs.
pub struct Staging {
    /// `None` only while being closed (`Drop`, `retire`).
    data: Option<StoreData<CpuExecutor>>,
    /// Freed only after the queue pairs that could write it are gone (`close`).
    memory: Option<DmaRegion>,
    block_bytes: usize,
    blocks: u32,
    layers: u32,
}

/// A staging operation that failed; `retire` says whether the staging area must be retired (a
/// layer may still be in flight); `stopped`, that it was the daemon's drain, met between two
/// layers (`error` then says how many were done), not a failure of the devices.
#[derive(Debug)]
pub struct StagingError {
    pub error: ObjstoreError,
    pub retire: bool,
    pub stopped: bool,
}

impl StagingError {
    /// A failure that leaves nothing in flight: the staging area is kept.
    pub fn keep(error: ObjstoreError) -> StagingError {
        StagingError { error, retire: false, stopped: false }
    }
}

impl Staging {
    /// `blocks` blocks of staging memory over `pool`'s devices; data-half requests are keyed by
    /// the control half's handles, of which there are `requests_max`.
    pub fn new(pool: &Pool, blocks: u32, requests_max: usize) -> Result<Staging, ObjstoreError> {
        let dma: Arc<dyn DmaAllocator> = Arc::clone(pool.target(0).controller.dma());
        for device in 1..pool.device_count() {
            if pool.target(device).controller.dma().address_space() != dma.address_space() {
                return Err(ObjstoreError::InvalidRegistration { reason: "the pool's devices are in several DMA spaces".into() });
            }
        }
        let geometry = *pool.geometry();
        let block_bytes = 2 * u64::from(geometry.layers) * geometry.object_bytes();
        let bytes = usize::try_from(block_bytes * u64::from(blocks))
            .map_err(|_| ObjstoreError::AddressOverflow { what: format!("{blocks} staging blocks of {block_bytes} bytes") })?;
        let memory = dma.allocate(bytes)?;
        let sgl = (0..pool.device_count()).all(|device| pool.target(device).controller.data_pointer_mode() == DataPointerMode::Sgl);
        let mode = if sgl { DataPointerMode::Sgl } else { DataPointerMode::Prp };
        let layout = KvLayout::BlockMajor { base: memory.iova(), block_stride_bytes: block_bytes };
        let registration = KvRegistration::new(geometry, blocks, layout, mode)?;
        let config = StoreConfig { requests_max: requests_max.max(1), ..StoreConfig::default() };
        let executor = cpu_executor_for(pool, QUEUE_DEPTH, &config)?;
        let data = StoreData::new(pool.shape()?, registration, dma, executor, config)?;
        Ok(Staging { data: Some(data), memory: Some(memory), block_bytes: block_bytes as usize, blocks, layers: geometry.layers })
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Moves every layer of `placements` (engine block i = staging block i) between the pool's
    /// devices and the staging memory, in `direction`, for the control half's request `handle`.
    ///
    /// No layer is issued past `deadline` (the caller's: a segment's or a fetch's): the transfer
    /// then ends with `DeadlinePassed`, its request finished, nothing in flight. Nor once
    /// `stopped` (the daemon's drain, asked between layers): the same, told by
    /// [`StagingError::stopped`], so a drain waits for one layer, not the rest. A layer already
    /// issued is waited for up to [`LAYER_TIMEOUT`], deadline or not — abandoning it would
    /// retire the staging area for a device that is merely slow — so a transfer ends by
    /// `deadline` plus one layer's timeout. Before, only `LAYER_TIMEOUT × layers` bounded it
    /// (800 s for 80 layers), far past the 60 s a holder's serve and the 120 s a `FetchRemote`
    /// promise.
    pub fn transfer(
        &mut self,
        handle: RequestHandle,
        direction: Direction,
        placements: &[Placement],
        deadline: Instant,
        stopped: &dyn Fn() -> bool,
    ) -> Result<(), StagingError> {
        let keep = StagingError::keep;
        let layers = self.layers;
        let data = self.data_mut().map_err(keep)?;
        data.prepare(handle, direction, placements, None).map_err(keep)?;
        let deadline = deadline.min(Instant::now() + LAYER_TIMEOUT * layers);
        for layer in 0..layers {
            let drained = stopped();
            if drained || Instant::now() >= deadline {
                // Between layers: nothing is in flight, so the request can be finished and the
                // staging area kept.
                let finished = data.finish(handle).is_ok();
                let what =
                    if drained { "the staging transfer's layers before the daemon's drain" } else { "the staging transfer's layers" };
                let error = ObjstoreError::DeadlinePassed { what, done: u64::from(layer) };
                return Err(StagingError { error, retire: !finished, stopped: drained });
            }
            let issued = match direction {
                Direction::Retrieve => data.retrieve_layer(handle, layer, SmBudget(1)),
                Direction::Store => data.store_layer(handle, layer, SmBudget(1)),
            };
            let result = issued.and_then(|()| data.wait(handle, Instant::now() + LAYER_TIMEOUT));
            if let Err(error) = result {
                // A layer still in flight (a wait that timed out, a submission published before
                // it failed, a queue pair failed under a command whose outcome is unknown) may
                // still write the memory: the staging area is retired. So is one whose request
                // cannot be finished (its handle would be held for good). Asked of the store,
                // not guessed from the error's kind.
                let in_flight = data.layers_in_flight(handle).map_or(true, |mut layers| layers.next().is_some());
                let finished = !in_flight && data.finish(handle).is_ok();
                return Err(StagingError { error, retire: !finished, stopped: false });
            }
        }
        if direction == Direction::Retrieve {
            data.finish(handle).map_err(keep)?;
        }
        Ok(())
    }

    /// Prepares `handle`'s request and issues its first layer, not waited for: a layer left in
    /// flight, as a bug's panic mid-`transfer` would leave it.
    #[cfg(test)]
    pub fn issue_first_layer(
        &mut self,
        handle: RequestHandle,
        direction: Direction,
        placements: &[Placement],
    ) -> Result<(), ObjstoreError> {
        let data = self.data_mut()?;
        data.prepare(handle, direction, placements, None)?;
        match direction {
            Direction::Retrieve => data.retrieve_layer(handle, 0, SmBudget(1)),
            Direction::Store => data.store_layer(handle, 0, SmBudget(1)),
        }
    }

    /// After a store's `transfer`: the payload CRCs of its blocks (in placement order) if the
    /// pool records them, for the commit; the request's data half is finished either way.
    pub fn finish_store(&mut self, handle: RequestHandle, records_crcs: bool, crcs: &mut Vec<u32>) -> Result<(), ObjstoreError> {
        let data = self.data_mut()?;
        let result = if records_crcs { data.payload_crcs(handle, crcs) } else { data.check_stored(handle) };
        let finished = data.finish(handle);
        result.and(finished)
    }

    fn data_mut(&mut self) -> Result<&mut StoreData<CpuExecutor>, ObjstoreError> {
        self.data.as_mut().ok_or_else(|| ObjstoreError::BadRequest { reason: "the staging area is closed".into() })
    }

    fn memory(&self) -> Result<&DmaRegion, ObjstoreError> {
        self.memory.as_ref().ok_or_else(|| ObjstoreError::BadRequest { reason: "the staging area is closed".into() })
    }

    /// Copies staging block `block` out (its layers in disk order).
    pub fn read_block(&self, block: u32, out: &mut [u8]) -> Result<(), ObjstoreError> {
        self.check(block, out.len())?;
        Ok(self.memory()?.read(block as usize * self.block_bytes, out)?)
    }

    /// Copies a block's bytes into staging block `block`.
    pub fn write_block(&self, block: u32, bytes: &[u8]) -> Result<(), ObjstoreError> {
        self.check(block, bytes.len())?;
        Ok(self.memory()?.write(block as usize * self.block_bytes, bytes)?)
    }

    fn check(&self, block: u32, len: usize) -> Result<(), ObjstoreError> {
        if block >= self.blocks || len != self.block_bytes {
            return Err(ObjstoreError::BadRequest {
                reason: format!("staging block {block} of {len} bytes (there are {} of {} bytes)", self.blocks, self.block_bytes),
            });
        }
        Ok(())
    }

    /// Ends the staging area after a layer that may still be in flight: deletes the queue pairs
    /// (which ends their commands); if the controller would not, the memory is leaked, never
    /// freed. Returns whether the memory could be freed.
    pub fn retire(mut self) -> bool {
        self.close()
    }

    fn close(&mut self) -> bool {
        let Some(data) = self.data.take() else { return true };
        if data.close() {
            self.memory = None;
            true
        } else if let Some(memory) = self.memory.take() {
            tracing::error!(bytes = memory.len(), "a staging queue pair could not be deleted: its memory is leaked, never freed");
            std::mem::forget(memory);
            false
        } else {
            false
        }
    }
}

impl Drop for Staging {
    /// The queue pairs first; the memory only if they are gone.
    fn drop(&mut self) {
        self.close();
    }
}
