//! Verified retrieves (`StoreConfig::verify_retrieves`): each block's bytes, as they landed in
//! the engine's memory, are checked against the payload CRC recorded in its slot header at
//! commit, before the retrieve's last layer is reported complete.
//!
//! The CRC covers a block's layers in disk order (`for l: K then V`), so it is computed
//! incrementally: each completed layer is folded in (in layer order; a layer that completes
//! early waits for the ones before it), and the comparison happens in the `wait` that completes
//! the last missing layer. A layer issued again after it was folded unfolds the request (the
//! re-read replaces the bytes the CRCs covered): every layer is folded again, and compared,
//! once the re-read and all others are done. Earlier layers are reported complete before
//! their block is verified; an engine that must not compute on unverified KV uses the blocks
//! only once every layer's latest `wait` succeeded: a layer whose read failed stays missing
//! until it is issued again and completes, and while one is missing no `wait` compares (the
//! last layer's included). A mismatching
//! block is named in `ObjstoreError::PayloadMismatch` and its slot is evicted by the control
//! half (`StoreControl::evict_mismatched`): out of the index at once (no lookup finds it
//! again), its header made Empty on disk (a reopen does not serve it either), the slot reused
//! once no retrieve pins it. The request's other blocks are delivered.
//!
//! The data half (here) folds and compares: it holds the memory. The control half supplies the
//! recorded CRCs (`StoreControl::recorded_payload_crcs`) and evicts.
//!
//! The expected CRCs are copied from the header mirror when the request is prepared (its slots
//! are pinned from then on): another request's mismatch in a shared slot (k > 1) rewrites that
//! slot's mirror entry Empty, and comparing against those bytes would condemn good blocks. A
//! failed verification is sticky: until `finish`, `wait` and `poll` return it again and no
//! layer is issued, so an engine that polls never sees the request complete.

use std::sync::Arc;

use gio_uring::Executor;
use nvme_driver::DmaAllocator;

use super::data::StoreData;
use super::shape::PoolShape;
use super::RequestHandle;
use crate::error::{KvKind, MismatchedBlock, ObjstoreError, Result};
use crate::registration::KvRegistration;

/// The checks, at construction, of what reads the KV memory on the CPU: a pool that records
/// payload CRCs computes them at every commit from that memory, and `verify_retrieves` (which
/// also needs such a pool) recomputes them at every retrieve. The memory must then be
/// host-visible through `dma` (GPU memory is not): refused here, rather than every commit
/// failing after its reservation evicted cached blocks. As the tuttid client refuses it.
pub(super) fn check_verifiable(
    shape: &PoolShape,
    registration: &KvRegistration,
    dma: &Arc<dyn DmaAllocator>,
    verify_retrieves: bool,
) -> Result<()> {
    if verify_retrieves && !shape.payload_crcs {
        return Err(ObjstoreError::BadRequest {
            reason: "verify_retrieves needs a pool that records payload CRCs: format it with FormatParams::payload_crc (`tutti pool \
                     format --payload-crc`)"
                .into(),
        });
    }
    if !shape.payload_crcs {
        return Ok(());
    }
    let object = registration.geometry().object_bytes() as usize;
    let address = registration.object_address(0, KvKind::Key, 0)?;
    dma.translate(address, object).map_err(|error| {
        let reader = if verify_retrieves {
            "verify_retrieves and the payload CRCs each commit records"
        } else {
            "the payload CRCs each commit records"
        };
        ObjstoreError::InvalidRegistration {
            reason: format!(
                "the pool records payload CRCs, which are computed on the CPU from the KV memory ({reader}), but it is not host-visible \
                 through this DMA allocator (device memory?): {error}; use host memory, or a pool formatted without payload_crc"
            ),
        }
    })?;
    Ok(())
}

/// Why a verified retrieve failed, kept on the request until `finish`.
#[derive(Debug)]
pub(super) enum VerifyFailure {
    /// Blocks whose bytes did not match (their slots are to be evicted).
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

impl<E: Executor> StoreData<E> {
    /// The blocks a verified retrieve found damaged (empty when none did, or for an unknown
    /// handle): what a client of tuttid reports at release, so that the daemon, which holds
    /// the index, evicts their slots (in one process, `KvStore::wait` does it at once).
    pub fn mismatched_blocks(&self, handle: RequestHandle) -> &[MismatchedBlock] {
        match self.index_of(handle).ok().and_then(|index| self.requests[index].verify_failure.as_ref()) {
            Some(VerifyFailure::Mismatch(blocks)) => blocks,
            _ => &[],
        }
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
        let layers = self.shape.geometry.layers;
        let before = self.requests[index].crc_layers;
        let mut crcs = std::mem::take(&mut self.requests[index].crcs);
        let mut folded = Ok(());
        let mut layer = before;
        while layer < layers && self.requests[index].layers_done[layer as usize] && folded.is_ok() {
            for (i, crc) in crcs.iter_mut().enumerate() {
                let engine_block = self.requests[index].placements[i].engine_block;
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

    fn compare_crcs(&self, index: usize, handle: RequestHandle) -> Result<()> {
        let request = &self.requests[index];
        let mut mismatched = Vec::new();
        for (i, crc) in request.crcs.iter().enumerate() {
            let placement = request.placements[i];
            let expected = request.expected_crcs[i];
            let computed = crc.clone().finalize();
            if computed != expected {
                mismatched.push(MismatchedBlock {
                    position: i,
                    engine_block: placement.engine_block,
                    device: placement.location.device,
                    slot: placement.location.slot,
                    expected_crc: expected,
                    computed_crc: computed,
                });
            }
        }
        if mismatched.is_empty() {
            return Ok(());
        }
        Err(ObjstoreError::PayloadMismatch { handle: handle.0, blocks: mismatched })
    }
}
