//! The 64-byte submission queue entry (§4.2) and the admin and NVM commands the driver issues.

use crate::types::{BlockCount, CommandId, Lba, NamespaceId};

/// Admin command opcodes (§5, Figure 28).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum AdminOpcode {
    DeleteIoSubmissionQueue = 0x00,
    CreateIoSubmissionQueue = 0x01,
    GetLogPage = 0x02,
    DeleteIoCompletionQueue = 0x04,
    CreateIoCompletionQueue = 0x05,
    Identify = 0x06,
    Abort = 0x08,
    SetFeatures = 0x09,
    GetFeatures = 0x0A,
    /// Doorbell Buffer Config (§5.7, NVMe 1.3): for emulated controllers only.
    DoorbellBufferConfig = 0x7C,
}

impl AdminOpcode {
    pub fn from_u8(value: u8) -> Option<Self> {
        Some(match value {
            0x00 => Self::DeleteIoSubmissionQueue,
            0x01 => Self::CreateIoSubmissionQueue,
            0x02 => Self::GetLogPage,
            0x04 => Self::DeleteIoCompletionQueue,
            0x05 => Self::CreateIoCompletionQueue,
            0x06 => Self::Identify,
            0x08 => Self::Abort,
            0x09 => Self::SetFeatures,
            0x0A => Self::GetFeatures,
            0x7C => Self::DoorbellBufferConfig,
            _ => return None,
        })
    }
}

/// NVM command set I/O opcodes (NVM §3, Figure 16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum NvmOpcode {
    Flush = 0x00,
    Write = 0x01,
    Read = 0x02,
    WriteZeroes = 0x08,
    DatasetManagement = 0x09,
}

impl NvmOpcode {
    pub fn from_u8(value: u8) -> Option<Self> {
        Some(match value {
            0x00 => Self::Flush,
            0x01 => Self::Write,
            0x02 => Self::Read,
            0x08 => Self::WriteZeroes,
            0x09 => Self::DatasetManagement,
            _ => return None,
        })
    }

    /// Whether the command moves data from host to controller (opcode bits 1:0 = 01b).
    pub fn host_to_device(self) -> bool {
        self as u8 & 0x3 == 0x1
    }
}

/// Feature identifiers used by the driver (§5.27.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FeatureId {
    Arbitration = 0x01,
    VolatileWriteCache = 0x06,
    NumberOfQueues = 0x07,
}

/// Log page identifiers (§5.16.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum LogPageId {
    ErrorInformation = 0x01,
    SmartHealth = 0x02,
}

/// Identify CNS values (§5.17.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum IdentifyCns {
    Namespace = 0x00,
    Controller = 0x01,
    ActiveNamespaceList = 0x02,
    /// I/O Command Set specific Identify Controller; the command set is CSI (CDW11 31:24),
    /// which [`SubmissionEntry::identify`] leaves 00h: the NVM command set.
    IoCommandSetController = 0x06,
}

/// PSDT (CDW0 bits 15:14): how DPTR is to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPointerKind {
    /// PRP1 / PRP2.
    Prp,
    /// SGL1 is a 16-byte descriptor; MPTR, if used, is a contiguous buffer.
    Sgl,
}

/// Force Unit Access: CDW12 bit 30 of Read/Write (NVM §3.2.6).
pub const FORCE_UNIT_ACCESS: u32 = 1 << 30;
/// Deallocate attribute of Dataset Management: CDW11 bit 2 (NVM §3.2.3).
pub const DSM_DEALLOCATE: u32 = 1 << 2;
/// Write Zeroes deallocate hint: CDW12 bit 25 (NVM §3.2.8).
pub const WRITE_ZEROES_DEALLOCATE: u32 = 1 << 25;

/// The common command format (§4.2, Figure 88). `#[repr(C)]` with the spec's field order; it
/// crosses the seam only as 64 little-endian bytes through [`SubmissionEntry::to_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct SubmissionEntry {
    /// cdw0: opcode (7:0), fuse (9:8), psdt (15:14), command identifier (31:16).
    pub cdw0: u32,
    /// nsid: namespace identifier.
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    /// mptr: metadata pointer.
    pub mptr: u64,
    /// dptr: PRP1+PRP2 or SGL1 (16 bytes).
    pub dptr: [u64; 2],
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
}

const _: () = assert!(std::mem::size_of::<SubmissionEntry>() == 64);

impl SubmissionEntry {
    #[inline]
    fn with_opcode(opcode: u8, nsid: u32) -> Self {
        Self { cdw0: u32::from(opcode), nsid, ..Self::default() }
    }

    #[inline]
    pub fn opcode(&self) -> u8 {
        self.cdw0 as u8
    }

    /// cdw0.fuse
    pub fn fuse(&self) -> u8 {
        (self.cdw0 >> 8 & 0x3) as u8
    }

    /// cdw0.psdt (0 = PRP, 1 = SGL with contiguous metadata, 2 = SGL with metadata SGL, 3 reserved).
    pub fn psdt(&self) -> u8 {
        (self.cdw0 >> 14 & 0x3) as u8
    }

    pub fn command_id(&self) -> CommandId {
        CommandId((self.cdw0 >> 16) as u16)
    }

    #[inline]
    pub fn set_command_id(&mut self, id: CommandId) {
        self.cdw0 = self.cdw0 & 0xFFFF | u32::from(id.0) << 16;
    }

    #[inline]
    pub fn set_data_pointer_kind(&mut self, kind: DataPointerKind) {
        let psdt = match kind {
            DataPointerKind::Prp => 0,
            DataPointerKind::Sgl => 1,
        };
        self.cdw0 = self.cdw0 & !(0x3 << 14) | psdt << 14;
    }

    /// Serialises to the wire format (little endian, §1.5 conventions).
    #[inline]
    pub fn to_bytes(&self) -> [u8; 64] {
        let mut bytes = [0u8; 64];
        let dwords = [
            self.cdw0,
            self.nsid,
            self.cdw2,
            self.cdw3,
            self.mptr as u32,
            (self.mptr >> 32) as u32,
            self.dptr[0] as u32,
            (self.dptr[0] >> 32) as u32,
            self.dptr[1] as u32,
            (self.dptr[1] >> 32) as u32,
            self.cdw10,
            self.cdw11,
            self.cdw12,
            self.cdw13,
            self.cdw14,
            self.cdw15,
        ];
        for (chunk, dword) in bytes.chunks_exact_mut(4).zip(dwords) {
            chunk.copy_from_slice(&dword.to_le_bytes());
        }
        bytes
    }

    /// Parses the wire format (any 64 bytes are a syntactically valid entry).
    pub fn from_bytes(bytes: &[u8; 64]) -> Self {
        let dword = |index: usize| {
            let start = index * 4;
            u32::from_le_bytes([bytes[start], bytes[start + 1], bytes[start + 2], bytes[start + 3]])
        };
        let qword = |index: usize| u64::from(dword(index)) | u64::from(dword(index + 1)) << 32;
        Self {
            cdw0: dword(0),
            nsid: dword(1),
            cdw2: dword(2),
            cdw3: dword(3),
            mptr: qword(4),
            dptr: [qword(6), qword(8)],
            cdw10: dword(10),
            cdw11: dword(11),
            cdw12: dword(12),
            cdw13: dword(13),
            cdw14: dword(14),
            cdw15: dword(15),
        }
    }

    // ---- Admin commands -------------------------------------------------------------------

    /// Identify (§5.17): `cns` in CDW10 bits 7:0; data into one 4 KiB page at PRP1.
    pub fn identify(cns: IdentifyCns, nsid: u32, prp1: u64) -> Self {
        let mut entry = Self::with_opcode(AdminOpcode::Identify as u8, nsid);
        entry.dptr[0] = prp1;
        entry.cdw10 = cns as u32;
        entry
    }

    /// Create I/O Completion Queue (§5.4): physically contiguous, interrupts disabled (we poll).
    pub fn create_io_completion_queue(queue_id: u16, entries: u32, prp1: u64) -> Self {
        let mut entry = Self::with_opcode(AdminOpcode::CreateIoCompletionQueue as u8, 0);
        entry.dptr[0] = prp1;
        entry.cdw10 = u32::from(queue_id) | (entries.saturating_sub(1) & 0xFFFF) << 16;
        entry.cdw11 = 1; // PC: physically contiguous; IEN = 0.
        entry
    }

    /// Create I/O Submission Queue (§5.5): contiguous, bound to `completion_queue_id`. QPRIO
    /// (CDW11 bits 2:1) is 00b, Urgent: it matters only under weighted round robin, and the
    /// driver enables with round robin (CC.AMS = 000b), where every queue is served alike.
    pub fn create_io_submission_queue(queue_id: u16, entries: u32, prp1: u64, completion_queue_id: u16) -> Self {
        let mut entry = Self::with_opcode(AdminOpcode::CreateIoSubmissionQueue as u8, 0);
        entry.dptr[0] = prp1;
        entry.cdw10 = u32::from(queue_id) | (entries.saturating_sub(1) & 0xFFFF) << 16;
        entry.cdw11 = 1 | u32::from(completion_queue_id) << 16;
        entry
    }

    /// Delete I/O Submission Queue (§5.7).
    pub fn delete_io_submission_queue(queue_id: u16) -> Self {
        let mut entry = Self::with_opcode(AdminOpcode::DeleteIoSubmissionQueue as u8, 0);
        entry.cdw10 = u32::from(queue_id);
        entry
    }

    /// Delete I/O Completion Queue (§5.6).
    pub fn delete_io_completion_queue(queue_id: u16) -> Self {
        let mut entry = Self::with_opcode(AdminOpcode::DeleteIoCompletionQueue as u8, 0);
        entry.cdw10 = u32::from(queue_id);
        entry
    }

    /// Set Features (§5.27) with the feature's CDW11 value.
    pub fn set_features(feature: FeatureId, cdw11: u32) -> Self {
        let mut entry = Self::with_opcode(AdminOpcode::SetFeatures as u8, 0);
        entry.cdw10 = feature as u32;
        entry.cdw11 = cdw11;
        entry
    }

    /// Get Features (§5.15), current value.
    pub fn get_features(feature: FeatureId) -> Self {
        let mut entry = Self::with_opcode(AdminOpcode::GetFeatures as u8, 0);
        entry.cdw10 = feature as u32;
        entry
    }

    /// Number of Queues (§5.27.1.5): requested I/O SQs and CQs, 0's based.
    pub fn set_number_of_queues(submission_queues: u16, completion_queues: u16) -> Self {
        let cdw11 = u32::from(submission_queues.max(1) - 1) | u32::from(completion_queues.max(1) - 1) << 16;
        Self::set_features(FeatureId::NumberOfQueues, cdw11)
    }

    /// Doorbell Buffer Config (§5.7): PRP1 is the shadow doorbell page, PRP2 the EventIdx page,
    /// each one memory page, page aligned (see `spec::registers::shadow_doorbell_offset`).
    pub fn doorbell_buffer_config(shadow_doorbells: u64, event_indexes: u64) -> Self {
        let mut entry = Self::with_opcode(AdminOpcode::DoorbellBufferConfig as u8, 0);
        entry.dptr = [shadow_doorbells, event_indexes];
        entry
    }

    /// Get Log Page (§5.16): `dwords` 1-based count of dwords into PRP1 (at most one page here).
    pub fn get_log_page(log: LogPageId, nsid: u32, dwords: u32, prp1: u64) -> Self {
        let mut entry = Self::with_opcode(AdminOpcode::GetLogPage as u8, nsid);
        entry.dptr[0] = prp1;
        let numd = dwords.max(1) - 1;
        entry.cdw10 = log as u32 | (numd & 0xFFFF) << 16;
        entry.cdw11 = numd >> 16;
        entry
    }

    // ---- NVM commands ---------------------------------------------------------------------

    #[inline]
    fn read_write(opcode: NvmOpcode, nsid: NamespaceId, start: Lba, blocks: BlockCount, force_unit_access: bool) -> Self {
        let mut entry = Self::with_opcode(opcode as u8, nsid.0);
        entry.cdw10 = start.0 as u32;
        entry.cdw11 = (start.0 >> 32) as u32;
        entry.cdw12 = u32::from(blocks.zero_based());
        if force_unit_access {
            entry.cdw12 |= FORCE_UNIT_ACCESS;
        }
        entry
    }

    /// Read (NVM §3.2.4) of `blocks` (a [`BlockCount`]: 1..=65536 by construction); the data
    /// pointer is set separately.
    #[inline]
    pub fn read(nsid: NamespaceId, start: Lba, blocks: BlockCount) -> Self {
        Self::read_write(NvmOpcode::Read, nsid, start, blocks, false)
    }

    /// Write (NVM §3.2.6), optionally with Force Unit Access.
    #[inline]
    pub fn write(nsid: NamespaceId, start: Lba, blocks: BlockCount, force_unit_access: bool) -> Self {
        Self::read_write(NvmOpcode::Write, nsid, start, blocks, force_unit_access)
    }

    /// Flush (NVM §3.2.2).
    pub fn flush(nsid: NamespaceId) -> Self {
        Self::with_opcode(NvmOpcode::Flush as u8, nsid.0)
    }

    /// Write Zeroes (NVM §3.2.8).
    pub fn write_zeroes(nsid: NamespaceId, start: Lba, blocks: BlockCount, deallocate: bool) -> Self {
        let mut entry = Self::read_write(NvmOpcode::WriteZeroes, nsid, start, blocks, false);
        if deallocate {
            entry.cdw12 |= WRITE_ZEROES_DEALLOCATE;
        }
        entry
    }

    /// Dataset Management with the Deallocate attribute (NVM §3.2.3): `ranges` range entries of
    /// 16 bytes each at the data pointer.
    pub fn deallocate(nsid: NamespaceId, ranges: u32) -> Self {
        let mut entry = Self::with_opcode(NvmOpcode::DatasetManagement as u8, nsid.0);
        entry.cdw10 = (ranges.max(1) - 1) & 0xFF;
        entry.cdw11 = DSM_DEALLOCATE;
        entry
    }

    /// Starting LBA of a Read/Write/Write Zeroes (CDW10, CDW11).
    pub fn starting_lba(&self) -> Lba {
        Lba(u64::from(self.cdw10) | u64::from(self.cdw11) << 32)
    }

    /// Number of logical blocks of a Read/Write/Write Zeroes (CDW12 bits 15:0, 0's based).
    pub fn block_count(&self) -> u32 {
        (self.cdw12 & 0xFFFF) + 1
    }

    pub fn force_unit_access(&self) -> bool {
        self.cdw12 & FORCE_UNIT_ACCESS != 0
    }
}

/// One Dataset Management range (NVM §3.2.3, Figure 39): 16 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DatasetRange {
    pub context_attributes: u32,
    pub blocks: u32,
    pub start: Lba,
}

impl DatasetRange {
    pub const BYTES: usize = 16;

    #[inline]
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut bytes = [0u8; 16];
        bytes[0..4].copy_from_slice(&self.context_attributes.to_le_bytes());
        bytes[4..8].copy_from_slice(&self.blocks.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.start.0.to_le_bytes());
        bytes
    }

    pub fn from_bytes(bytes: &[u8; 16]) -> Self {
        let mut dword = [0u8; 4];
        dword.copy_from_slice(&bytes[0..4]);
        let context_attributes = u32::from_le_bytes(dword);
        dword.copy_from_slice(&bytes[4..8]);
        let blocks = u32::from_le_bytes(dword);
        let mut qword = [0u8; 8];
        qword.copy_from_slice(&bytes[8..16]);
        Self { context_attributes, blocks, start: Lba(u64::from_le_bytes(qword)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(count: u32) -> BlockCount {
        BlockCount::new(count).expect("a valid block count")
    }

    #[test]
    fn the_largest_block_count_is_encoded_whole() {
        // Goal: 65536 blocks encode as NLB 0xFFFF and decode back (nothing is masked).
        let entry = SubmissionEntry::read(NamespaceId(1), Lba(0), blocks(65536));
        assert_eq!(entry.cdw12 & 0xFFFF, 0xFFFF);
        assert_eq!(entry.block_count(), 65536);
        let zeroes = SubmissionEntry::write_zeroes(NamespaceId(1), Lba(0), blocks(65536), true);
        assert_eq!(zeroes.block_count(), 65536);
    }

    #[test]
    fn read_encodes_lba_count_and_round_trips() {
        let mut entry = SubmissionEntry::read(NamespaceId(1), Lba(0x1_2345_6789), blocks(8));
        entry.set_command_id(CommandId(0xBEEF));
        entry.set_data_pointer_kind(DataPointerKind::Sgl);
        assert_eq!(entry.opcode(), 0x02);
        assert_eq!(entry.psdt(), 1);
        assert_eq!(entry.command_id(), CommandId(0xBEEF));
        assert_eq!(entry.starting_lba(), Lba(0x1_2345_6789));
        assert_eq!(entry.block_count(), 8);
        let bytes = entry.to_bytes();
        assert_eq!(bytes[0], 0x02);
        assert_eq!(&bytes[2..4], &0xBEEFu16.to_le_bytes());
        assert_eq!(SubmissionEntry::from_bytes(&bytes), entry);
    }

    #[test]
    fn write_sets_fua_and_queue_commands_are_zero_based() {
        assert!(SubmissionEntry::write(NamespaceId(1), Lba(0), blocks(1), true).force_unit_access());
        assert!(!SubmissionEntry::write(NamespaceId(1), Lba(0), blocks(1), false).force_unit_access());
        let create = SubmissionEntry::create_io_submission_queue(3, 1024, 0x1000, 3);
        assert_eq!(create.cdw10, 3 | 1023 << 16);
        assert_eq!(create.cdw11 >> 16, 3);
        let queues = SubmissionEntry::set_number_of_queues(4, 4);
        assert_eq!(queues.cdw11, 3 | 3 << 16);
        assert!(NvmOpcode::Write.host_to_device());
        assert!(!NvmOpcode::Read.host_to_device());
    }
}
