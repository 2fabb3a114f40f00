//! Fuzzes the software NVMe controller's command parser: one arbitrary 64-byte submission entry
//! plus arbitrary host memory (PRP lists, SGL segments, DSM ranges, data) must always produce an
//! NVMe status, never a panic, hang or out-of-bounds access.
//!
//! Input layout: byte 0 = flags (bit 0: admin command; bit 1: rebase PRP1/PRP2 into the
//! mapped memory so deeper paths are reached), bytes 1..65 = the entry, the rest = memory
//! mapped at `nvme_emu::fuzzing::FUZZ_MEMORY_IOVA`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvme_emu::fuzzing::{process_raw, FUZZ_MEMORY_IOVA};

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else { return };
    let Some((entry_bytes, memory)) = rest.split_first_chunk::<64>() else { return };
    let mut entry = *entry_bytes;
    if flags & 2 != 0 {
        let span = memory.len().max(1) as u64;
        for start in [24usize, 32] {
            let mut qword = [0u8; 8];
            qword.copy_from_slice(&entry[start..start + 8]);
            let rebased = FUZZ_MEMORY_IOVA + u64::from_le_bytes(qword) % span;
            entry[start..start + 8].copy_from_slice(&rebased.to_le_bytes());
        }
    }
    // Setup errors (allocation) are not findings; panics are.
    let _ = process_raw(flags & 1 != 0, &entry, memory);
});
