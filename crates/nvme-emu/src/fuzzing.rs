//! Entry points for fuzzing the command parser (used by `fuzz/fuzz_targets/emu_commands.rs`).
//!
//! [`process_raw`] builds a fresh controller (memory backed, two namespaces with 512 B and
//! 4 KiB LBAs, MDTS 5, SGL on, write cache on) with `memory` copied into one DMA region at
//! [`FUZZ_MEMORY_IOVA`], and executes one 64-byte submission entry against it as an admin or
//! an I/O command. Addresses in the entry or in PRP lists / SGL segments inside `memory` that
//! fall in `FUZZ_MEMORY_IOVA..FUZZ_MEMORY_IOVA + memory.len()` (rounded up to 4 KiB) reach that
//! region; every other address is unmapped. The controller must answer every input with an
//! NVMe status and never panic.

use std::sync::Arc;

use nvme_driver::hw::{DmaAllocator, DmaPool};
use nvme_driver::spec::registers::{self, Capabilities, ControllerConfiguration};
use nvme_driver::spec::SubmissionEntry;

use crate::config::{Backing, EmuConfig, NamespaceConfig};
use crate::controller::ControllerCore;
use crate::registers::RegisterFile;
use crate::EmuError;

/// Where `process_raw` maps the fuzzer's memory: the first IOVA a fresh identity pool hands out.
pub const FUZZ_MEMORY_IOVA: u64 = 1 << 32;
/// Most bytes of `memory` used (larger inputs are truncated).
pub const FUZZ_MEMORY_MAX_BYTES: usize = 1 << 20;

/// What the controller answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawOutcome {
    /// The 15-bit status field (0 = success).
    pub status_field: u16,
    /// Completion dword 0.
    pub dw0: u32,
}

/// Executes one raw submission entry (see the module documentation). `admin` selects the admin
/// command set; otherwise the entry runs as an I/O command from queue 1.
pub fn process_raw(admin: bool, entry: &[u8; 64], memory: &[u8]) -> Result<RawOutcome, EmuError> {
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 1 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, Some(256 << 10)), NamespaceConfig::new(4096, None)])
        .with_io_queue_pairs_max(4)
        .with_write_cache_bytes(64 << 10);
    let capabilities = Capabilities::build(config.max_queue_entries, 1, 0, 0, 0);
    let registers = Arc::new(RegisterFile::new(capabilities.0, 0, config.io_queue_pairs_max, false)?);
    // Queue creation checks the entry sizes the host configured.
    nvme_driver::hw::RegisterIo::write32(&*registers, registers::CC, ControllerConfiguration::for_enable().0 & !1);
    let dma = DmaPool::identity();
    let used = memory.get(..FUZZ_MEMORY_MAX_BYTES).unwrap_or(memory);
    let region = dma.allocate(used.len().max(1))?;
    region.write(0, used)?;
    let mut core = ControllerCore::new(config, registers, dma)?;
    // Takes that CC write as the controller thread's first poll would: untaken, its EN = 0
    // reads as a reset the host asked for, and a long command (a deallocate) gives way to it.
    core.react_to_configuration();
    let entry = SubmissionEntry::from_bytes(entry);
    let result = core.execute(if admin { 0 } else { 1 }, &entry);
    // A long zeroing runs here, not a slice per poll: no poll follows.
    let result = core.finish_started_zeroing(result);
    // A write-back after the command exercises the cache paths too.
    let _ = core.write_back(None);
    drop(region);
    Ok(match result {
        Ok(dw0) => RawOutcome { status_field: 0, dw0 },
        Err(status) => RawOutcome { status_field: status.to_status_field(), dw0: 0 },
    })
}

/// Decodes one fuzzer input and runs it with [`process_raw`]: byte 0 = flags (bit 0: admin
/// command; bit 1: rebase DPTR qword 0 (PRP1 or the SGL1 address) into the mapped memory;
/// bit 2: rebase DPTR qword 1 (PRP2; leave it clear for SGLs, where it holds length and type)),
/// bytes 1..65 = the entry, the rest = memory at [`FUZZ_MEMORY_IOVA`]. `None` for inputs too
/// short to hold an entry, or when the controller could not be set up.
pub fn process_input(data: &[u8]) -> Option<RawOutcome> {
    let (&flags, rest) = data.split_first()?;
    let (entry_bytes, memory) = rest.split_first_chunk::<64>()?;
    let mut entry = *entry_bytes;
    let span = memory.len().max(1) as u64;
    for (bit, start) in [(2u8, 24usize), (4, 32)] {
        if flags & bit != 0 {
            let mut qword = [0u8; 8];
            qword.copy_from_slice(&entry[start..start + 8]);
            let rebased = FUZZ_MEMORY_IOVA + u64::from_le_bytes(qword) % span;
            entry[start..start + 8].copy_from_slice(&rebased.to_le_bytes());
        }
    }
    process_raw(flags & 1 != 0, &entry, memory).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme_driver::spec::data_pointer::SglDescriptor;
    use nvme_driver::spec::status::codes;
    use nvme_driver::spec::NvmeStatus;
    use nvme_driver::{Lba, NamespaceId};

    #[test]
    fn memory_is_mapped_where_documented() {
        // Goal: the documented IOVA really reaches the fuzzer's memory (else fuzzing is blind).
        let mut write = SubmissionEntry::write(NamespaceId(2), Lba(0), nvme_driver::BlockCount::ONE, false);
        write.set_data_pointer_kind(nvme_driver::spec::command::DataPointerKind::Sgl);
        write.dptr = SglDescriptor::data_block(FUZZ_MEMORY_IOVA, 4096).to_dptr();
        let outcome = process_raw(false, &write.to_bytes(), &[0xAB; 4096]).unwrap();
        assert_eq!(outcome.status_field, 0);
        write.dptr = SglDescriptor::data_block(FUZZ_MEMORY_IOVA + 4096, 4096).to_dptr();
        let outcome = process_raw(false, &write.to_bytes(), &[0xAB; 4096]).unwrap();
        assert_eq!(outcome.status_field, NvmeStatus::generic(codes::DATA_TRANSFER_ERROR).to_status_field());
    }

    #[test]
    fn fuzz_seeds_reach_successful_completions() {
        // Goal: the committed seeds really exercise the deep paths (PRP lists, SGL chains, DSM,
        // admin transfers): each must complete successfully, so a regression shows up here.
        let directory = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/emu_commands");
        let mut seen = 0;
        for file in std::fs::read_dir(&directory).expect("seed directory") {
            let path = file.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let outcome = process_input(&data).expect("seed decodes");
            assert_eq!(outcome.status_field, 0, "seed {} failed with status {:#x}", path.display(), outcome.status_field);
            seen += 1;
        }
        assert!(seen >= 7, "{seen} seeds found");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        #[test]
        fn arbitrary_entries_never_panic(flags in 0u8..8, entry in proptest::collection::vec(proptest::prelude::any::<u8>(), 64), memory in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..8192)) {
            // Goal: any entry and memory contents get a status, never a panic.
            let mut input = vec![flags];
            input.extend_from_slice(&entry);
            input.extend_from_slice(&memory);
            proptest::prop_assert!(process_input(&input).is_some());
        }
    }
}
