//! Fuzzes the software NVMe controller's command parser: one arbitrary 64-byte submission entry
//! plus arbitrary host memory (PRP lists, SGL segments, DSM ranges, data) must always produce an
//! NVMe status, never a panic, hang or out-of-bounds access.
//!
//! Input layout: byte 0 = flags (bit 0: admin command; bit 1: rebase DPTR qword 0 (PRP1 or
//! the SGL1 address) into the mapped memory; bit 2: rebase DPTR qword 1 (PRP2; leave it clear
//! for SGLs, where it holds length and type)), bytes 1..65 = the entry, the rest = memory mapped
//! at `nvme_emu::fuzzing::FUZZ_MEMORY_IOVA`. Seeds that reach PRP lists, SGL chains, DSM and
//! admin data transfers are in `fuzz/seeds/emu_commands/`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvme_emu::fuzzing::process_input;

fuzz_target!(|data: &[u8]| {
    // `None` (too short, setup failure) is not a finding; a panic is.
    let _ = process_input(data);
});
