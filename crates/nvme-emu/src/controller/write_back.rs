//! Write-back of the volatile write cache to the backing store (Flush, VWC = 0, shutdown,
//! function reset, a full cache, and part of it at a power loss in
//! [`crate::PowerLossMode::PartialWriteBack`]), and the cached blocks of a FUA Read's range
//! (`read_write` in `io.rs`). A FUA Write writes nothing back: it writes its own data to the store
//! and drops the cached copies of its blocks (`store_blocks` in `io.rs`, `landed` in `batch.rs`).

use std::collections::BTreeMap;

use nvme_driver::spec::status::codes;
use nvme_driver::spec::NvmeStatus;

use super::{media, ControllerCore, WRITE_BACK_CHUNK_BYTES};

impl ControllerCore {
    /// Writes every dirty cached block of one namespace (or all) to the backing store,
    /// coalescing consecutive blocks into writes of up to `WRITE_BACK_CHUNK_BYTES`.
    pub(crate) fn write_back(&mut self, only_namespace: Option<usize>) -> Result<(), NvmeStatus> {
        if self.cache.is_empty() {
            return Ok(());
        }
        self.refuse_write_back_if_fenced()?;
        let blocks = self.cache.take(only_namespace);
        self.write_back_taken(blocks)
    }

    /// Writes the dirty cached blocks of `start_lba..start_lba+blocks` of one namespace back
    /// (a FUA Read commits its blocks to media before it reads them), as [`Self::write_back`]
    /// does; other cached blocks stay cached.
    pub(crate) fn write_back_range(&mut self, namespace_index: usize, start_lba: u64, blocks: u64) -> Result<(), NvmeStatus> {
        if !self.cache.holds_any(namespace_index, start_lba, blocks) {
            return Ok(());
        }
        self.refuse_write_back_if_fenced()?;
        let taken = self.cache.take_range(namespace_index, start_lba, blocks);
        self.write_back_taken(taken)
    }

    fn refuse_write_back_if_fenced(&self) -> Result<(), NvmeStatus> {
        if self.store.is_fenced() {
            // Keep the blocks cached (still served to reads): the store takes nothing now.
            tracing::error!("cache write-back refused: the backing store is fenced");
            return Err(media(codes::WRITE_FAULT));
        }
        Ok(())
    }

    /// Writes blocks taken out of the cache to the store; on a failure they, and those not
    /// tried yet, go back into the cache.
    fn write_back_taken(&mut self, mut blocks: BTreeMap<(usize, u64), Box<[u8]>>) -> Result<(), NvmeStatus> {
        // Runs of consecutive blocks, each at most WRITE_BACK_CHUNK_BYTES: (namespace index,
        // first LBA, blocks).
        let mut runs: Vec<(usize, u64, u64)> = Vec::new();
        let mut run_bytes = 0usize;
        for (&(namespace_index, lba), data) in &blocks {
            match runs.last_mut() {
                Some((index, start, count))
                    if *index == namespace_index && *start + *count == lba && run_bytes + data.len() <= WRITE_BACK_CHUNK_BYTES =>
                {
                    *count += 1;
                    run_bytes += data.len();
                }
                _ => {
                    runs.push((namespace_index, lba, 1));
                    run_bytes = data.len();
                }
            }
        }
        let mut pending: Vec<u8> = Vec::with_capacity(WRITE_BACK_CHUNK_BYTES);
        for (namespace_index, start, count) in runs {
            let range = (namespace_index, start)..(namespace_index, start + count);
            pending.clear();
            blocks.range(range.clone()).for_each(|(_, data)| pending.extend_from_slice(data));
            if let Err(status) = self.write_run(namespace_index, start, &pending) {
                // The blocks of this run and of every run not tried yet stay dirty in the cache
                // (reads still see them): a later Flush tries them again and fails while the
                // store does, instead of succeeding over writes that never reached it.
                self.cache.restore(blocks);
                return Err(status);
            }
            for lba in start..start + count {
                if let Some(data) = blocks.remove(&(namespace_index, lba)) {
                    self.cache.recycle(data);
                }
            }
        }
        Ok(())
    }

    /// A power loss in [`crate::PowerLossMode::PartialWriteBack`]: writes a pseudorandom subset
    /// of the dirty cached blocks (each with even odds, drawn from `seed`) to the backing store,
    /// one whole block at a time, as a drive that had written part of its cache back, in its own
    /// order, before the cut. The rest stays in the cache for the cut to discard. A block whose
    /// write fails is lost like the rest (the failure is logged): power is going, nothing retries.
    /// While the store is fenced (the kernel may still land a write an abandoned ring kept)
    /// nothing is written back, as in `DiscardCache`; the fence is looked at first, as a
    /// shutdown and a function reset do, so one whose writes were given back no longer counts.
    pub(crate) fn write_back_some(&mut self, seed: u64) {
        if self.cache.is_empty() {
            return;
        }
        self.refresh_store_fence();
        if self.store.is_fenced() {
            tracing::error!("partial write-back at the power loss skipped: the backing store is fenced");
            return;
        }
        let blocks = self.cache.take(None);
        let mut state = seed;
        for ((namespace_index, lba), data) in blocks {
            if split_mix(&mut state) & 1 == 1 {
                // `write_run` logs a failure; the block is then lost, as the unchosen ones are.
                let _ = self.write_run(namespace_index, lba, &data);
            }
            self.cache.recycle(data);
        }
    }

    fn write_run(&mut self, namespace_index: usize, start_lba: u64, data: &[u8]) -> Result<(), NvmeStatus> {
        let Some(namespace) = self.namespaces.get(namespace_index).copied() else { return Ok(()) };
        let offset = namespace.base_offset_bytes + start_lba * u64::from(namespace.block_size_bytes);
        #[cfg(test)]
        if self.fail_write_backs_for_tests {
            tracing::error!(offset, "cache write-back failed (injected by a test)");
            return Err(media(codes::WRITE_FAULT));
        }
        if let Err(error) = self.store.write(offset, data) {
            tracing::error!(%error, offset, "cache write-back failed");
            return Err(media(codes::WRITE_FAULT));
        }
        self.counters.totals.cache_writeback_bytes += data.len() as u64;
        Ok(())
    }
}

/// SplitMix64: a small, well-mixed generator, so that neighbouring seeds (a test's iteration
/// numbers) still pick unrelated subsets.
fn split_mix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
