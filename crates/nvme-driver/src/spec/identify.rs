//! Identify data (§5.17.2): the controller and namespace fields the driver relies on.
//!
//! Identify data comes from the device and is untrusted: parsing checks every field the driver
//! later computes with (LBA size, format index, MDTS) and returns [`IdentifyError`] rather than
//! panicking or producing nonsense sizes.

use super::IDENTIFY_BYTES;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IdentifyError {
    #[error("identify data is {actual} bytes, expected {IDENTIFY_BYTES}")]
    WrongLength { actual: usize },
    #[error("namespace formatted with LBA format {index} but only {count} formats are defined")]
    FormatIndexOutOfRange { index: u8, count: u8 },
    #[error("LBA format {index} has data size 2^{lbads}, outside the 2^9..=2^16 the driver supports")]
    UnsupportedLbaSize { index: u8, lbads: u8 },
    #[error("namespace size {size_blocks} blocks exceeds its capacity field or is zero")]
    BadNamespaceSize { size_blocks: u64 },
    #[error("I/O queue entry sizes SQES {sqes:#x} / CQES {cqes:#x} do not allow 64-byte SQ and 16-byte CQ entries")]
    UnsupportedEntrySizes { sqes: u8, cqes: u8 },
}

fn u16_at(bytes: &[u8], offset: usize) -> u16 {
    u16::from_le_bytes([bytes[offset], bytes[offset + 1]])
}

fn u32_at(bytes: &[u8], offset: usize) -> u32 {
    u32::from_le_bytes([bytes[offset], bytes[offset + 1], bytes[offset + 2], bytes[offset + 3]])
}

fn u64_at(bytes: &[u8], offset: usize) -> u64 {
    u64::from(u32_at(bytes, offset)) | u64::from(u32_at(bytes, offset + 4)) << 32
}

fn ascii(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| if b.is_ascii_graphic() || b == b' ' { b as char } else { '?' }).collect::<String>().trim().to_string()
}

/// SGL support bits (SGLS, Figure 275 bytes 539:536).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SglSupport(pub u32);

impl SglSupport {
    /// SGLS bits 1:0 = 01b (any alignment) or 10b (dword aligned): SGLs supported for the NVM
    /// command set. 11b is reserved: it says nothing the driver can rely on, so it reads as
    /// unsupported (PRPs under Auto), as 00b does.
    pub fn supported(self) -> bool {
        matches!(self.0 & 0x3, 0x1 | 0x2)
    }
    /// SGLS bits 1:0 == 10b: SGL data blocks must be dword aligned.
    pub fn dword_alignment_required(self) -> bool {
        self.0 & 0x3 == 0x2
    }
}

/// Identify Controller (CNS 01h, Figure 275), the fields we use.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IdentifyController {
    /// vid: PCI vendor id.
    pub vendor_id: u16,
    /// sn: serial number.
    pub serial_number: String,
    /// mn: model number.
    pub model_number: String,
    /// fr: firmware revision.
    pub firmware_revision: String,
    /// mdts: maximum data transfer size as a power of two of the minimum page size; 0 = no limit.
    pub mdts: u8,
    /// cntlid: controller id.
    pub controller_id: u16,
    /// ver: version (may be 0 on 1.0 controllers).
    pub version: u32,
    /// oacs: optional admin command support (see [`IdentifyController::OACS_DOORBELL_BUFFER_CONFIG`]).
    pub optional_admin_commands: u16,
    /// sqes / cqes: required and maximum entry sizes.
    pub sqes: u8,
    pub cqes: u8,
    /// nn: number of namespaces (highest valid NSID).
    pub namespace_count: u32,
    /// oncs: optional NVM command support.
    pub optional_nvm_commands: u16,
    /// vwc: volatile write cache present (bit 0).
    pub volatile_write_cache: bool,
    /// sgls
    pub sgl_support: SglSupport,
}

impl IdentifyController {
    /// OACS bit 8: the controller supports Doorbell Buffer Config (shadow doorbells).
    pub const OACS_DOORBELL_BUFFER_CONFIG: u16 = 1 << 8;

    /// Whether Doorbell Buffer Config may be sent.
    pub fn supports_doorbell_buffer_config(&self) -> bool {
        self.optional_admin_commands & Self::OACS_DOORBELL_BUFFER_CONFIG != 0
    }

    pub fn parse(bytes: &[u8]) -> Result<Self, IdentifyError> {
        if bytes.len() != IDENTIFY_BYTES {
            return Err(IdentifyError::WrongLength { actual: bytes.len() });
        }
        let sqes = bytes[512];
        let cqes = bytes[513];
        // Required size (bits 3:0) must be <= 64/16 bytes and the maximum (7:4) at least that.
        let sq_ok = sqes & 0xF <= 6 && sqes >> 4 >= 6;
        let cq_ok = cqes & 0xF <= 4 && cqes >> 4 >= 4;
        if !(sq_ok && cq_ok) {
            return Err(IdentifyError::UnsupportedEntrySizes { sqes, cqes });
        }
        Ok(Self {
            vendor_id: u16_at(bytes, 0),
            serial_number: ascii(&bytes[4..24]),
            model_number: ascii(&bytes[24..64]),
            firmware_revision: ascii(&bytes[64..72]),
            mdts: bytes[77],
            controller_id: u16_at(bytes, 78),
            version: u32_at(bytes, 80),
            optional_admin_commands: u16_at(bytes, 256),
            sqes,
            cqes,
            namespace_count: u32_at(bytes, 516),
            optional_nvm_commands: u16_at(bytes, 520),
            volatile_write_cache: bytes[525] & 1 == 1,
            sgl_support: SglSupport(u32_at(bytes, 536)),
        })
    }

    /// rtd3e (bytes 91:88 of Identify Controller data, §5.17.2.1): RTD3 Entry Latency, how
    /// long the controller expects a normal shutdown (CC.SHN = 01b) to take, in microseconds; 0
    /// when not reported, and 0 for data shorter than the field. Read from the raw data rather
    /// than kept in [`IdentifyController`], whose fields the software controller builds by name.
    pub fn rtd3_entry_latency_us(bytes: &[u8]) -> u32 {
        bytes.get(88..92).and_then(|field| field.try_into().ok()).map_or(0, u32::from_le_bytes)
    }

    /// Maximum bytes per command given the controller's minimum page size, or `None` if unlimited.
    pub fn max_transfer_bytes(&self, min_page_size_bytes: u64) -> Option<u64> {
        (self.mdts != 0).then(|| min_page_size_bytes << self.mdts.min(20))
    }

    /// oncs bit 2: Dataset Management supported.
    pub fn supports_dataset_management(&self) -> bool {
        self.optional_nvm_commands >> 2 & 1 == 1
    }
    /// oncs bit 3: Write Zeroes supported.
    pub fn supports_write_zeroes(&self) -> bool {
        self.optional_nvm_commands >> 3 & 1 == 1
    }

    /// Serialises the fields we model (for the software controller; the rest stays zero).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; IDENTIFY_BYTES];
        let put_ascii = |bytes: &mut [u8], text: &str| {
            for (index, slot) in bytes.iter_mut().enumerate() {
                *slot = *text.as_bytes().get(index).unwrap_or(&b' ');
            }
        };
        bytes[0..2].copy_from_slice(&self.vendor_id.to_le_bytes());
        bytes[2..4].copy_from_slice(&self.vendor_id.to_le_bytes());
        put_ascii(&mut bytes[4..24], &self.serial_number);
        put_ascii(&mut bytes[24..64], &self.model_number);
        put_ascii(&mut bytes[64..72], &self.firmware_revision);
        bytes[77] = self.mdts;
        bytes[78..80].copy_from_slice(&self.controller_id.to_le_bytes());
        bytes[80..84].copy_from_slice(&self.version.to_le_bytes());
        bytes[256..258].copy_from_slice(&self.optional_admin_commands.to_le_bytes());
        bytes[512] = self.sqes;
        bytes[513] = self.cqes;
        bytes[516..520].copy_from_slice(&self.namespace_count.to_le_bytes());
        bytes[520..522].copy_from_slice(&self.optional_nvm_commands.to_le_bytes());
        bytes[525] = u8::from(self.volatile_write_cache);
        bytes[536..540].copy_from_slice(&self.sgl_support.0.to_le_bytes());
        bytes
    }
}

/// One LBA format (Figure 280): metadata size and data size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LbaFormat {
    /// ms: metadata bytes per LBA.
    pub metadata_bytes: u16,
    /// lbads: LBA data size as a power of two.
    pub lbads: u8,
    /// rp: relative performance (0 best).
    pub relative_performance: u8,
}

impl LbaFormat {
    pub fn block_size_bytes(&self) -> u32 {
        1u32 << self.lbads
    }
}

/// I/O Command Set specific Identify Controller for the NVM command set (CNS 06h, CSI 00h;
/// NVM Command Set Specification §4.1.5.1), the fields we use. Default: nothing reported (a
/// controller that does not implement it), no limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NvmIdentifyController {
    /// wzsl (byte 1): Write Zeroes Size Limit, the most data one Write Zeroes may cover, as a
    /// power of two of the minimum page size (CAP.MPSMIN), as MDTS is; 0 = no limit.
    pub write_zeroes_size_limit: u8,
}

impl NvmIdentifyController {
    pub fn parse(bytes: &[u8]) -> Result<Self, IdentifyError> {
        if bytes.len() != IDENTIFY_BYTES {
            return Err(IdentifyError::WrongLength { actual: bytes.len() });
        }
        Ok(Self { write_zeroes_size_limit: bytes[1] })
    }

    /// Most bytes one Write Zeroes may cover given the controller's minimum page size, or
    /// `None` if unlimited. The exponent is capped as MDTS's is: 2^20 pages is past what any
    /// command's 16-bit NLB can cover, and the shift stays inside 64 bits.
    pub fn write_zeroes_max_bytes(&self, min_page_size_bytes: u64) -> Option<u64> {
        (self.write_zeroes_size_limit != 0).then(|| min_page_size_bytes << self.write_zeroes_size_limit.min(20))
    }
}

/// Identify Namespace (CNS 00h, NVM Figure 97), the fields we use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentifyNamespace {
    /// nsze: namespace size in logical blocks.
    pub size_blocks: u64,
    /// ncap: namespace capacity in logical blocks.
    pub capacity_blocks: u64,
    /// nuse: namespace utilisation.
    pub utilization_blocks: u64,
    /// flbas bits 3:0 (and 6:5): the LBA format in use.
    pub format_index: u8,
    /// flbas bit 4: metadata is transferred at the end of each LBA's data (an extended LBA)
    /// rather than in a separate buffer at MPTR. Only meaningful when the format has metadata.
    pub extended_lba: bool,
    /// dps: end-to-end data protection settings; bits 2:0 are the protection type (0 = off).
    pub protection_settings: u8,
    /// lbaf0..: the defined formats (nlbaf + 1 of them).
    pub formats: Vec<LbaFormat>,
}

impl IdentifyNamespace {
    pub fn parse(bytes: &[u8]) -> Result<Self, IdentifyError> {
        if bytes.len() != IDENTIFY_BYTES {
            return Err(IdentifyError::WrongLength { actual: bytes.len() });
        }
        let count = bytes[25].min(63) + 1;
        let flbas = bytes[26];
        let format_index = (flbas & 0xF) | (flbas >> 5 & 0x3) << 4;
        let formats: Vec<LbaFormat> = (0..usize::from(count))
            .map(|index| {
                let raw = u32_at(bytes, 128 + 4 * index);
                LbaFormat { metadata_bytes: raw as u16, lbads: (raw >> 16) as u8, relative_performance: (raw >> 24 & 0x3) as u8 }
            })
            .collect();
        let Some(format) = formats.get(usize::from(format_index)) else {
            return Err(IdentifyError::FormatIndexOutOfRange { index: format_index, count });
        };
        if !(9..=16).contains(&format.lbads) {
            return Err(IdentifyError::UnsupportedLbaSize { index: format_index, lbads: format.lbads });
        }
        let size_blocks = u64_at(bytes, 0);
        let capacity_blocks = u64_at(bytes, 8);
        if size_blocks == 0 || capacity_blocks > size_blocks {
            return Err(IdentifyError::BadNamespaceSize { size_blocks });
        }
        Ok(Self {
            size_blocks,
            capacity_blocks,
            utilization_blocks: u64_at(bytes, 16),
            format_index,
            extended_lba: flbas >> 4 & 1 == 1,
            protection_settings: bytes[29],
            formats,
        })
    }

    /// dps bits 2:0: the end-to-end protection type enabled (0 = protection information off).
    pub fn protection_type(&self) -> u8 {
        self.protection_settings & 0x7
    }

    /// The LBA format in use (always present in parsed data; `None` only for a hand-built
    /// value whose index names no format).
    pub fn format(&self) -> Option<LbaFormat> {
        self.formats.get(usize::from(self.format_index)).copied()
    }

    /// Bytes per logical block of the format in use (`None` as for [`IdentifyNamespace::format`]).
    pub fn block_size_bytes(&self) -> Option<u32> {
        self.format().map(|format| format.block_size_bytes())
    }

    /// Serialises (for the software controller).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; IDENTIFY_BYTES];
        bytes[0..8].copy_from_slice(&self.size_blocks.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.capacity_blocks.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.utilization_blocks.to_le_bytes());
        bytes[25] = (self.formats.len().clamp(1, 64) - 1) as u8;
        bytes[26] = self.format_index & 0xF | u8::from(self.extended_lba) << 4 | (self.format_index >> 4 & 0x3) << 5;
        bytes[29] = self.protection_settings;
        for (index, format) in self.formats.iter().take(64).enumerate() {
            let raw = u32::from(format.metadata_bytes) | u32::from(format.lbads) << 16 | u32::from(format.relative_performance & 0x3) << 24;
            bytes[128 + 4 * index..132 + 4 * index].copy_from_slice(&raw.to_le_bytes());
        }
        bytes
    }
}

/// Parses an Active Namespace ID list (CNS 02h): ascending NSIDs, zero-terminated.
pub fn parse_active_namespaces(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|chunk| u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]])).take_while(|&nsid| nsid != 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn controller() -> IdentifyController {
        IdentifyController {
            vendor_id: 0x1b36,
            serial_number: "SN1".into(),
            model_number: "model".into(),
            firmware_revision: "1.0".into(),
            mdts: 5,
            controller_id: 1,
            version: 0x10400,
            optional_admin_commands: 0,
            sqes: 0x66,
            cqes: 0x44,
            namespace_count: 2,
            optional_nvm_commands: 0b1100,
            volatile_write_cache: true,
            sgl_support: SglSupport(1),
        }
    }

    #[test]
    fn controller_round_trips() {
        let parsed = IdentifyController::parse(&controller().to_bytes()).unwrap();
        assert_eq!(parsed, controller());
        assert_eq!(parsed.max_transfer_bytes(4096), Some(128 * 1024));
        assert!(parsed.supports_write_zeroes() && parsed.supports_dataset_management());
        assert!(parsed.sgl_support.supported());
    }

    #[test]
    fn rtd3_entry_latency_is_read_from_bytes_91_to_88() {
        let mut bytes = controller().to_bytes();
        assert_eq!(IdentifyController::rtd3_entry_latency_us(&bytes), 0);
        bytes[88..92].copy_from_slice(&8_000_000u32.to_le_bytes());
        assert_eq!(IdentifyController::rtd3_entry_latency_us(&bytes), 8_000_000);
        assert_eq!(IdentifyController::rtd3_entry_latency_us(&bytes[..90]), 0);
    }

    #[test]
    fn bad_identify_data_is_an_error() {
        assert!(matches!(IdentifyController::parse(&[0u8; 100]), Err(IdentifyError::WrongLength { .. })));
        assert!(matches!(IdentifyController::parse(&[0u8; 4096]), Err(IdentifyError::UnsupportedEntrySizes { .. })));
        let mut namespace = vec![0u8; 4096];
        namespace[0] = 10;
        namespace[26] = 5; // format 5 of 1
        assert!(matches!(IdentifyNamespace::parse(&namespace), Err(IdentifyError::FormatIndexOutOfRange { .. })));
        namespace[26] = 0; // format 0 with lbads 0
        assert!(matches!(IdentifyNamespace::parse(&namespace), Err(IdentifyError::UnsupportedLbaSize { .. })));
        namespace[128 + 2] = 12;
        assert_eq!(IdentifyNamespace::parse(&namespace).unwrap().block_size_bytes(), Some(4096));
    }

    #[test]
    fn metadata_settings_are_parsed_and_round_trip() {
        // Goal: FLBAS bit 4 (extended LBA), DPS and the format's metadata size reach the driver,
        // which refuses such namespaces; serialising keeps them.
        let mut bytes = vec![0u8; 4096];
        bytes[0] = 64; // nsze
        bytes[25] = 1; // two formats
        bytes[26] = 1 | 1 << 4; // format 1, extended LBA
        bytes[29] = 0x9; // protection type 1, first eight bytes
        bytes[128 + 4..128 + 8].copy_from_slice(&(8u32 | 12 << 16).to_le_bytes()); // 4096 + 8
        let namespace = IdentifyNamespace::parse(&bytes).unwrap();
        assert!(namespace.extended_lba);
        assert_eq!(namespace.protection_type(), 1);
        assert_eq!(namespace.format().map(|format| format.metadata_bytes), Some(8));
        assert_eq!(IdentifyNamespace::parse(&namespace.to_bytes()).unwrap(), namespace);
    }

    #[test]
    fn sgl_support_is_01b_or_10b_only() {
        // Goal: the reserved value 11b is not SGL support; 10b is, with dword alignment.
        let support = |bits| (SglSupport(bits).supported(), SglSupport(bits).dword_alignment_required());
        assert_eq!(support(0), (false, false));
        assert_eq!(support(1), (true, false));
        assert_eq!(support(2), (true, true));
        assert_eq!(support(3), (false, false));
        assert_eq!(support(0xFFFF_FFFD), (true, false));
    }

    #[test]
    fn namespace_list() {
        let mut bytes = vec![0u8; 4096];
        bytes[0] = 1;
        bytes[4] = 2;
        assert_eq!(parse_active_namespaces(&bytes), vec![1, 2]);
    }
}
