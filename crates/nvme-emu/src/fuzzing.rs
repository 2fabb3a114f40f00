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
    let registers = Arc::new(RegisterFile::new(capabilities.0, 0, config.io_queue_pairs_max)?);
    // Queue creation checks the entry sizes the host configured.
    nvme_driver::hw::RegisterIo::write32(&*registers, registers::CC, ControllerConfiguration::for_enable().0 & !1);
    let dma = DmaPool::identity();
    let used = memory.get(..FUZZ_MEMORY_MAX_BYTES).unwrap_or(memory);
    let region = dma.allocate(used.len().max(1))?;
    region.write(0, used)?;
    let mut core = ControllerCore::new(config, registers, dma)?;
    let entry = SubmissionEntry::from_bytes(entry);
    let result = core.execute(if admin { 0 } else { 1 }, &entry);
    // A write-back after the command exercises the cache paths too.
    let _ = core.write_back(None);
    drop(region);
    Ok(match result {
        Ok(dw0) => RawOutcome { status_field: 0, dw0 },
        Err(status) => RawOutcome { status_field: status.to_status_field(), dw0: 0 },
    })
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
        let mut write = SubmissionEntry::write(NamespaceId(2), Lba(0), 1, false);
        write.set_data_pointer_kind(nvme_driver::spec::command::DataPointerKind::Sgl);
        write.dptr = SglDescriptor::data_block(FUZZ_MEMORY_IOVA, 4096).to_dptr();
        let outcome = process_raw(false, &write.to_bytes(), &[0xAB; 4096]).unwrap();
        assert_eq!(outcome.status_field, 0);
        write.dptr = SglDescriptor::data_block(FUZZ_MEMORY_IOVA + 4096, 4096).to_dptr();
        let outcome = process_raw(false, &write.to_bytes(), &[0xAB; 4096]).unwrap();
        assert_eq!(outcome.status_field, NvmeStatus::generic(codes::DATA_TRANSFER_ERROR).to_status_field());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        #[test]
        fn arbitrary_entries_never_panic(admin: bool, entry in proptest::collection::vec(proptest::prelude::any::<u8>(), 64), memory in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..8192), rebase: bool) {
            // Goal: any entry and memory contents get a status, never a panic.
            let mut raw = [0u8; 64];
            raw.copy_from_slice(&entry);
            if rebase {
                // Point PRP1/PRP2 into the mapped memory so deeper paths are reached.
                let span = memory.len().max(1) as u64;
                for index in 0..2 {
                    let start = 24 + index * 8;
                    let mut qword = [0u8; 8];
                    qword.copy_from_slice(&raw[start..start + 8]);
                    let value = FUZZ_MEMORY_IOVA + u64::from_le_bytes(qword) % span;
                    raw[start..start + 8].copy_from_slice(&value.to_le_bytes());
                }
            }
            process_raw(admin, &raw, &memory).unwrap();
        }
    }
}
