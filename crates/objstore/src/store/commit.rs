//! Commit of a store: every layer completed (the data half says so), payload CRCs computed
//! from the engine's memory (by the data half, which holds it) if the pool keeps them, then the
//! control half flushes the devices written, stages the slot headers Valid and writes them with
//! FUA; only then do the blocks enter the index.

use gio_uring::Executor;

use super::data::StoreData;
use super::{Direction, KvStore, RequestHandle};
use crate::error::{KvKind, ObjstoreError, Result};

impl<E: Executor> KvStore<E> {
    /// Makes a store durable and visible: every layer must have completed. Flushes the devices
    /// written, records payload CRCs if the pool keeps them, writes the slot headers with FUA,
    /// then enters the blocks into the index. Once begun it finishes the handle, whether it
    /// succeeds or fails.
    ///
    /// Refused before it begins (`HandleState`: `handle` is a retrieve, or a layer is not
    /// stored: never issued, in flight, or its latest write failed), it leaves the request as
    /// it was, with its request slot, pins and claimed keys: the caller stores the missing
    /// layers and commits again, or ends it with [`KvStore::finish`]. Released here, a request
    /// whose layer is still in flight would free memory and slots the device may still write,
    /// and one whose layer failed could not be stored again.
    pub fn commit_store(&mut self, handle: RequestHandle) -> Result<usize> {
        // The refusals before the commit begins leave the request to the caller (see above).
        if self.control.direction(handle)? != Direction::Store {
            return Err(ObjstoreError::HandleState { handle: handle.0, reason: "not a store".into() });
        }
        self.data.check_stored(handle)?;
        let crcs = if self.control.records_payload_crcs() {
            if let Err(error) = self.data.payload_crcs(handle, &mut self.crcs) {
                self.release(handle);
                return Err(error);
            }
            Some(&self.crcs[..])
        } else {
            None
        };
        let result = self.control.commit_store(handle, crcs, self.data.lender());
        if let Err(error) = self.data.finish(handle) {
            // Every layer completed (checked above), so nothing is in flight.
            tracing::warn!(%error, "finishing a committed store's data path");
        }
        if result.is_err() {
            // A refusal before anything was written leaves the reservation: release it too.
            let _ = self.control.release(handle);
        }
        result
    }
}

impl<E: Executor> StoreData<E> {
    /// Checks that `handle` is a store whose every layer completed (none in flight): what the
    /// data half reports to the control half before a commit.
    pub fn check_stored(&self, handle: RequestHandle) -> Result<()> {
        let index = self.index_of(handle)?;
        let request = &self.requests[index];
        if request.direction != Some(Direction::Store) {
            return Err(ObjstoreError::HandleState { handle: handle.0, reason: "not a store".into() });
        }
        // The commit rule: a block becomes visible only once every layer is durable, so a layer
        // still queued or in flight (even one issued again after it completed), or one whose
        // latest write failed (its LBAs may be torn), refuses it.
        if !request.in_flight.is_empty() || request.layers_done.iter().any(|done| !done) {
            let missing: Vec<usize> = request.layers_done.iter().enumerate().filter(|(_, done)| !**done).map(|(layer, _)| layer).collect();
            let in_flight: Vec<u32> = request.in_flight.iter().map(|&(layer, _)| layer).collect();
            return Err(ObjstoreError::HandleState {
                handle: handle.0,
                reason: format!(
                    "layers {missing:?} not stored (never issued, in flight, or their latest write failed: store them again); in \
                     flight: {in_flight:?}"
                ),
            });
        }
        Ok(())
    }

    /// The payload CRC of each block of a completed store, in placement order, into `out`, read
    /// from the engine's memory (which must be host-visible through the store's DMA allocator).
    pub fn payload_crcs(&mut self, handle: RequestHandle, out: &mut Vec<u32>) -> Result<()> {
        self.check_stored(handle)?;
        let index = self.index_of(handle)?;
        out.clear();
        for i in 0..self.requests[index].placements.len() {
            let engine_block = self.requests[index].placements[i].engine_block;
            let mut crc = crc32fast::Hasher::new();
            for layer in 0..self.shape.geometry.layers {
                self.fold_layer(&mut crc, layer, engine_block)?;
            }
            out.push(crc.finalize());
        }
        Ok(())
    }

    /// Adds layer `layer` of engine block `engine_block` (K, then V: the disk order) to `crc`.
    pub(super) fn fold_layer(&mut self, crc: &mut crc32fast::Hasher, layer: u32, engine_block: u32) -> Result<()> {
        let object = self.shape.geometry.object_bytes() as usize;
        self.crc_scratch.resize(object, 0);
        for kind in [KvKind::Key, KvKind::Value] {
            let address = self.table.registration().object_address(layer, kind, engine_block)?;
            let region = self.dma.translate(address, object)?;
            region.read(0, &mut self.crc_scratch)?;
            crc.update(&self.crc_scratch);
        }
        Ok(())
    }
}
