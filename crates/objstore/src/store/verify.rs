//! Verified retrieves (`StoreConfig::verify_retrieves`): each block's bytes, as they landed in
//! the engine's memory, are checked against the payload CRC recorded in its slot header at
//! commit, before the retrieve's last layer is reported complete.
//!
//! The CRC covers a block's layers in disk order (`for l: K then V`), so it is computed
//! incrementally: each completed layer is folded in (in layer order; a layer that completes
//! early waits for the ones before it), and the comparison happens in the `wait` that completes
//! the last missing layer. Earlier layers are reported complete before their block is verified;
//! an engine that must not compute on unverified KV waits for the last layer. A mismatching
//! block is named in `ObjstoreError::PayloadMismatch` and its slot is evicted: out of the index
//! at once (no lookup finds it again), its header made Empty on disk (a reopen does not serve
//! it either), the slot reused once no retrieve pins it. The request's other blocks are
//! delivered.
//!
//! The expected CRCs are copied from the header mirror when the request is prepared (its slots
//! are pinned from then on): another request's mismatch in a shared slot (k > 1) rewrites that
//! slot's mirror entry Empty, and comparing against those bytes would condemn good blocks. A
//! failed verification is sticky: until `finish`, `wait` and `poll` return it again and no
//! layer is issued, so an engine that polls never sees the request complete.

use std::sync::Arc;

use gio_uring::Executor;
use nvme_driver::DmaAllocator;

use super::{KvStore, RequestHandle};
use crate::error::{KvKind, MismatchedBlock, ObjstoreError, Result};
use crate::format::{payload_crc_offset, SlotState, FLAG_PAYLOAD_CRC};
use crate::pool::Pool;
use crate::registration::KvRegistration;

/// `KvStore::new`'s check for `verify_retrieves`: the pool records payload CRCs, and the KV
/// memory is host-visible through `dma` (GPU memory is not).
pub(super) fn check_verifiable(pool: &Pool, registration: &KvRegistration, dma: &Arc<dyn DmaAllocator>) -> Result<()> {
    if pool.superblock(0).flags & FLAG_PAYLOAD_CRC == 0 {
        return Err(ObjstoreError::BadRequest {
            reason: "verify_retrieves needs a pool that records payload CRCs: format it with FormatParams::payload_crc (`tutti pool \
                     format --payload-crc`)"
                .into(),
        });
    }
    let object = registration.geometry().object_bytes() as usize;
    let address = registration.object_address(0, KvKind::Key, 0)?;
    dma.translate(address, object).map_err(|error| ObjstoreError::InvalidRegistration {
        reason: format!("verify_retrieves reads the KV memory on the CPU, but it is not host-visible through this DMA allocator: {error}"),
    })?;
    Ok(())
}

/// Why a verified retrieve failed, kept on the request until `finish`.
#[derive(Debug)]
pub(super) enum VerifyFailure {
    /// Blocks whose bytes did not match (their slots were evicted).
    Mismatch(Vec<MismatchedBlock>),
    /// The bytes could not be checked (the first error, as text).
    Unverified(String),
}

impl VerifyFailure {
    /// The error `wait`, `poll` and the issue calls return for the failed request.
    pub(super) fn to_error(&self, handle: RequestHandle) -> ObjstoreError {
        match self {
            VerifyFailure::Mismatch(blocks) => ObjstoreError::PayloadMismatch { handle: handle.0, blocks: blocks.clone() },
            VerifyFailure::Unverified(reason) => ObjstoreError::HandleState {
                handle: handle.0,
                reason: format!("its verification failed, so the retrieved blocks are not to be used (finish it): {reason}"),
            },
        }
    }
}

impl<E: Executor> KvStore<E> {
    /// Copies the payload CRC recorded for each of the request's blocks out of the mirror (at
    /// `prepare_retrieve`, once the slots are pinned).
    pub(super) fn snapshot_expected_crcs(&mut self, index: usize) -> Result<()> {
        let mut expected = std::mem::take(&mut self.requests[index].expected_crcs);
        expected.clear();
        let mut result = Ok(());
        for &(location, _, _) in &self.requests[index].blocks {
            match self.pool.recorded_payload_crc(location.device, location.slot, payload_crc_offset(usize::from(location.index))) {
                Ok(crc) => expected.push(crc),
                Err(error) => {
                    result = Err(error);
                    break;
                }
            }
        }
        self.requests[index].expected_crcs = expected;
        result
    }

    /// Folds in the layers completed so far and, once all are, compares; a failure is recorded
    /// on the request (sticky until `finish`) and returned.
    pub(super) fn verify_layers(&mut self, index: usize, handle: RequestHandle) -> Result<()> {
        let result = self.fold_and_compare(index, handle);
        if let Err(error) = &result {
            self.requests[index].verify_failure = Some(match error {
                ObjstoreError::PayloadMismatch { blocks, .. } => VerifyFailure::Mismatch(blocks.clone()),
                other => VerifyFailure::Unverified(other.to_string()),
            });
        }
        result
    }

    /// Folds every completed layer not yet folded (in order from layer 0) into the request's
    /// per-block CRCs, and once all layers are in, compares them with the recorded ones.
    fn fold_and_compare(&mut self, index: usize, handle: RequestHandle) -> Result<()> {
        let layers = self.pool.geometry().layers;
        let before = self.requests[index].crc_layers;
        let mut crcs = std::mem::take(&mut self.requests[index].crcs);
        let mut folded = Ok(());
        let mut layer = before;
        while layer < layers && self.requests[index].layers_done[layer as usize] && folded.is_ok() {
            for (i, crc) in crcs.iter_mut().enumerate() {
                let engine_block = self.requests[index].blocks[i].1;
                folded = self.fold_layer(crc, layer, engine_block);
                if folded.is_err() {
                    break;
                }
            }
            layer += 1;
        }
        self.requests[index].crcs = crcs;
        folded?;
        self.requests[index].crc_layers = layer;
        if layer < layers || before == layers {
            return Ok(());
        }
        self.compare_crcs(index, handle)
    }

    fn compare_crcs(&mut self, index: usize, handle: RequestHandle) -> Result<()> {
        let mut mismatched = Vec::new();
        for (i, crc) in self.requests[index].crcs.iter().enumerate() {
            let (location, engine_block, _) = self.requests[index].blocks[i];
            let expected = self.requests[index].expected_crcs[i];
            let computed = crc.clone().finalize();
            if computed != expected {
                mismatched.push(MismatchedBlock {
                    prefix_index: i,
                    engine_block,
                    device: location.device,
                    slot: location.slot,
                    expected_crc: expected,
                    computed_crc: computed,
                });
            }
        }
        if mismatched.is_empty() {
            return Ok(());
        }
        for block in &mismatched {
            tracing::warn!(%block, "payload CRC mismatch on retrieve: the slot is evicted");
            self.pool.index.condemn(block.device, block.slot);
            // Idempotent for a slot with several bad blocks: the entry is already Empty. Refused
            // on a fenced device, whose slots are not reused before a reopen anyway.
            if let Err(error) = self.pool.stage_header(block.device, block.slot, SlotState::Empty, &[]) {
                tracing::warn!(%error, "staging the evicted slot's header Empty failed");
            }
        }
        if let Err(error) = self.pool.sync_headers(&mut self.queue) {
            // The mismatch is the news: the Empty entries stay dirty and go out with the next
            // sync, which comes before any data is issued into these slots.
            tracing::warn!(%error, "writing the evicted slots' headers Empty failed; they stay staged for the next sync");
        }
        Err(ObjstoreError::PayloadMismatch { handle: handle.0, blocks: mismatched })
    }
}
