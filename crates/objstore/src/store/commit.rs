//! Commit of a store: every layer completed, the devices written are flushed, payload CRCs
//! recorded (read back from the engine's memory) if the pool keeps them, slot headers staged
//! Valid and written with FUA; only then do the blocks enter the index.

use gio_uring::Executor;

use super::{Direction, KvStore, RequestHandle};
use crate::error::{KvKind, ObjstoreError, Result};
use crate::format::{BlockRecord, SlotState, FLAG_PAYLOAD_CRC};
use crate::index::BlockLocation;

impl<E: Executor> KvStore<E> {
    /// Makes a store durable and visible: every layer must have completed. Flushes the devices
    /// written, records payload CRCs if the pool keeps them, writes the slot headers with FUA,
    /// then enters the blocks into the index. Finishes the handle.
    pub fn commit_store(&mut self, handle: RequestHandle) -> Result<usize> {
        let index = self.request_index(handle)?;
        let request = &self.requests[index];
        if request.direction != Some(Direction::Store) {
            return Err(ObjstoreError::HandleState { handle: handle.0, reason: "not a store".into() });
        }
        if request.layer_in_flight.is_some() || request.layers_done.iter().any(|done| !done) {
            let missing = request.layers_done.iter().filter(|done| !**done).count();
            return Err(ObjstoreError::HandleState {
                handle: handle.0,
                reason: format!("{missing} layers not stored yet (in flight: {:?})", request.layer_in_flight),
            });
        }
        let mut used = vec![false; self.pool.device_count()];
        for &(device, _, _) in &request.slots {
            used[usize::from(device)] = true;
        }
        let result = self
            .pool
            .flush(&used, &mut self.queue)
            .and_then(|()| self.stage_valid_headers(index))
            .and_then(|()| self.pool.sync_headers(&mut self.queue));
        if let Err(error) = result {
            // Headers staged Valid must not reach the disk for slots that go back to the free
            // list (their data may not be durable): stage them Empty again; the next
            // `sync_headers` (always before new data is issued) writes them.
            for s in 0..self.requests[index].slots.len() {
                let (device, slot, _) = self.requests[index].slots[s];
                let _ = self.pool.stage_header(device, slot, SlotState::Empty, &[]);
            }
            self.release(index);
            return Err(error);
        }
        let stored = self.requests[index].blocks.len();
        let slots = std::mem::take(&mut self.requests[index].slots);
        let blocks = std::mem::take(&mut self.requests[index].blocks);
        let mut start = 0;
        for &(device, slot, used) in &slots {
            // A slot's blocks are contiguous in `blocks` (prepare_store fills one slot at a time).
            let range = start..start + usize::from(used);
            start = range.end;
            self.keys.clear();
            self.keys.extend(blocks[range].iter().map(|(_, _, key)| *key));
            let generation = self.pool.generation;
            self.pool.index.commit(device, slot, &self.keys, generation);
        }
        self.requests[index].slots = slots;
        self.requests[index].blocks = blocks;
        self.requests[index].slots.clear(); // committed: nothing left to release
        self.release(index);
        Ok(stored)
    }

    fn stage_valid_headers(&mut self, index: usize) -> Result<()> {
        let slots = std::mem::take(&mut self.requests[index].slots);
        let blocks = std::mem::take(&mut self.requests[index].blocks);
        let result = self.stage_valid_headers_of(&slots, &blocks);
        self.requests[index].slots = slots;
        self.requests[index].blocks = blocks;
        result
    }

    fn stage_valid_headers_of(&mut self, slots: &[(u16, u32, u16)], blocks: &[(BlockLocation, u32, u64)]) -> Result<()> {
        let block_tokens = self.pool.geometry().block_tokens;
        let crc = self.pool.superblock(0).flags & FLAG_PAYLOAD_CRC != 0;
        let mut start = 0;
        for &(device, slot, used) in slots {
            let range = start..start + usize::from(used);
            start = range.end;
            self.records.clear();
            for &(_, engine_block, key) in &blocks[range] {
                let payload_crc = if crc { self.payload_crc(engine_block)? } else { 0 };
                self.records.push(BlockRecord { key, token_count: block_tokens, payload_crc });
            }
            self.pool.stage_header(device, slot, SlotState::Valid, &self.records)?;
        }
        Ok(())
    }

    /// CRC32 of one block's payload in disk order (`for l: K then V`), read from engine block
    /// `engine_block` (memory that must be host-visible through `dma`).
    fn payload_crc(&mut self, engine_block: u32) -> Result<u32> {
        let mut crc = crc32fast::Hasher::new();
        for layer in 0..self.pool.geometry().layers {
            self.fold_layer(&mut crc, layer, engine_block)?;
        }
        Ok(crc.finalize())
    }

    /// Adds layer `layer` of engine block `engine_block` (K, then V) to `crc`.
    pub(super) fn fold_layer(&mut self, crc: &mut crc32fast::Hasher, layer: u32, engine_block: u32) -> Result<()> {
        let object = self.pool.geometry().object_bytes() as usize;
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
