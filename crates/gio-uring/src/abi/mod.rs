//! The CPU/GPU shared ABI: bindgen's output for `kernels/gio_abi.h` plus typed views of its codes.
//!
//! `bindings.rs` is generated and checked in (tools/check-bindings.sh regenerates and diffs it); it
//! carries bindgen's own layout assertions. The assertions below repeat the facts the rest of this
//! crate relies on, so a header change that breaks them fails the build here, by name.

#[allow(non_camel_case_types, non_upper_case_globals, dead_code, clippy::all)]
mod bindings;

pub use bindings::*;

use core::mem::{offset_of, size_of};

/// Cache line the ABI separates producer- and consumer-written fields by.
pub const CACHE_LINE_BYTES: usize = GIO_CACHE_LINE_BYTES as usize;
/// The compile-time upper bound of IOCTXs per IOCB (Tutti §3.2).
pub const MAX_IOCTX_PER_IOCB: u32 = GIO_MAX_IOCTX_PER_IOCB;
/// The version of the header these bindings were generated from.
pub const ABI_VERSION: u32 = GIO_ABI_VERSION;

const _: () = {
    assert!(ABI_VERSION == 3, "update the Rust side for the new ABI version");
    assert!(MAX_IOCTX_PER_IOCB == 2048);
    assert!(size_of::<gio_ioctx>() == 48);
    assert!(size_of::<gio_iocb>() == 2 * CACHE_LINE_BYTES);
    assert!(offset_of!(gio_iocb, status) == CACHE_LINE_BYTES);
    assert!(offset_of!(gio_iocb, user_data) == 32);
    assert!(offset_of!(gio_iocb, failed_nvme_status) == 76);
    assert!(size_of::<gio_cqe>() == 16);
    assert!(size_of::<gio_ring_header>() == 4 * CACHE_LINE_BYTES);
    assert!(offset_of!(gio_ring_header, head) == 0);
    assert!(offset_of!(gio_ring_header, tail) == CACHE_LINE_BYTES);
    assert!(offset_of!(gio_ring_header, mask) == 2 * CACHE_LINE_BYTES);
    assert!(offset_of!(gio_ring_header, producer_lock) == 3 * CACHE_LINE_BYTES);
    assert!(offset_of!(gio_ring_header, producer_claimed) == 3 * CACHE_LINE_BYTES + 4);
    assert!(offset_of!(gio_ring_header, overflow_count) == 3 * CACHE_LINE_BYTES + 8);
    assert!(offset_of!(gio_ring_header, reset_requests) == 3 * CACHE_LINE_BYTES + 12);
    assert!(offset_of!(gio_nvme_qp, controller_faults) == 3 * CACHE_LINE_BYTES + 8);
    assert!(size_of::<gio_nvme_slot>() == 32);
    assert!(size_of::<gio_nvme_qp>() == 5 * CACHE_LINE_BYTES);
    assert!(size_of::<gio_launch_params>() == 80);
    // Command ids are the low 16 bits of a free-running ticket: every depth must divide 2^16.
    assert!(GIO_RING_DEPTH_MAX == 1 << 16);
};

/// NVMe opcode of every IOCTX in an IOCB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opcode {
    Read,
    Write,
}

impl Opcode {
    pub fn to_abi(self) -> u8 {
        match self {
            Opcode::Read => GIO_OPCODE_READ as u8,
            Opcode::Write => GIO_OPCODE_WRITE as u8,
        }
    }

    pub fn from_abi(raw: u8) -> Option<Self> {
        match u32::from(raw) {
            GIO_OPCODE_READ => Some(Opcode::Read),
            GIO_OPCODE_WRITE => Some(Opcode::Write),
            _ => None,
        }
    }
}

/// `gio_ioctx.descriptor_kind`: how the controller finds an IOCTX's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DescriptorKind {
    /// An SGL Data Block inline in the command, or a Last Segment at `desc_iova`.
    Sgl,
    /// PRP1 = `data_iova`, PRP2 = `desc_iova`.
    Prp,
}

/// The descriptor-kind rule of `kernels/gio_abi.h` (`gio_descriptor_kind_is_valid`): the valid
/// kinds are `0..GIO_DESCRIPTOR_KIND_COUNT`. Every executor refuses any other value (the IOCTX
/// fails as invalid); `tests/gpu_rules.rs` checks that this and the C rule agree on all 256 values.
pub fn descriptor_kind_is_valid(raw: u8) -> bool {
    u32::from(raw) < GIO_DESCRIPTOR_KIND_COUNT
}

/// The most logical blocks one IOCTX moves (`GIO_IOCTX_BLOCK_COUNT_MAX` of
/// kernels/gio_kernel_rules.h): NLB is a 0-based 16-bit count.
pub const IOCTX_BLOCK_COUNT_MAX: u32 = 65536;
const _: () = assert!(IOCTX_BLOCK_COUNT_MAX == nvme_driver::BlockCount::MAX);

/// The CPU-written fields of an IOCB that the IOCTX command rule reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IocbLayer {
    /// `gio_iocb.opcode`, unchecked.
    pub opcode: u8,
    /// The layer of the current issue.
    pub layer: u32,
    pub lba_stride_blocks: u64,
    pub mem_stride_bytes: u64,
    pub desc_stride_bytes: u64,
}

/// A command [`ioctx_command`] accepted: what it is and where layer `layer` reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoctxCommand {
    pub opcode: Opcode,
    pub descriptor_kind: DescriptorKind,
    pub block_count: nvme_driver::BlockCount,
    /// `start_lba + layer × lba_stride_blocks`.
    pub lba: u64,
    /// `data_iova + layer × mem_stride_bytes`.
    pub data_iova: u64,
    /// 0, or `desc_iova + layer × desc_stride_bytes`.
    pub desc_iova: u64,
}

/// The IOCTX command rule of `kernels/gio_kernel_rules.h` (`gio_ioctx_command`): `None` unless the
/// opcode is Read or Write, the block count is in `1..=IOCTX_BLOCK_COUNT_MAX`, the descriptor kind
/// is valid and every per-layer address is computed without overflow. Every executor refuses an
/// IOCTX this refuses (it fails as invalid, no command is built): a corrupted opcode byte must
/// never become Write Zeroes or Dataset Management, nor a bad count a wrapped NLB.
/// `tests/gpu_rules.rs` checks that this and the C rule agree.
pub fn ioctx_command(iocb: &IocbLayer, ioctx: &gio_ioctx) -> Option<IoctxCommand> {
    let opcode = Opcode::from_abi(iocb.opcode)?;
    let block_count = nvme_driver::BlockCount::new(ioctx.block_count)?;
    let descriptor_kind = DescriptorKind::from_abi(ioctx.descriptor_kind)?;
    let layer = u64::from(iocb.layer);
    let lba = ioctx.start_lba.checked_add(layer.checked_mul(iocb.lba_stride_blocks)?)?;
    let data_iova = ioctx.data_iova.checked_add(layer.checked_mul(iocb.mem_stride_bytes)?)?;
    let desc_iova = if ioctx.desc_iova == 0 { 0 } else { ioctx.desc_iova.checked_add(layer.checked_mul(iocb.desc_stride_bytes)?)? };
    Some(IoctxCommand { opcode, descriptor_kind, block_count, lba, data_iova, desc_iova })
}

impl DescriptorKind {
    pub fn to_abi(self) -> u8 {
        match self {
            DescriptorKind::Sgl => GIO_DESCRIPTOR_SGL as u8,
            DescriptorKind::Prp => GIO_DESCRIPTOR_PRP as u8,
        }
    }

    /// `None` exactly when [`descriptor_kind_is_valid`] is false (untrusted input from shared
    /// memory): an unknown kind is never read as PRP or SGL.
    pub fn from_abi(raw: u8) -> Option<Self> {
        if !descriptor_kind_is_valid(raw) {
            return None;
        }
        match u32::from(raw) {
            GIO_DESCRIPTOR_SGL => Some(DescriptorKind::Sgl),
            GIO_DESCRIPTOR_PRP => Some(DescriptorKind::Prp),
            // The rule admits a kind this enum does not name: the header grew a kind and this
            // function was not updated; the unit test below catches that.
            _ => None,
        }
    }
}

/// `gio_iocb.status` / `gio_cqe.status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IocbStatus {
    Idle,
    Issued,
    Success,
    NvmeError,
    InvalidIoctx,
    Timeout,
    /// A controller posted an impossible completion (GPU executor): one naming another SQ, an SQ
    /// head outside what was published, or one for a command not yet published or fetched.
    /// Nothing it reports is trusted until the queue pairs are reset.
    ControllerFault,
}

impl IocbStatus {
    pub fn to_abi(self) -> u32 {
        match self {
            IocbStatus::Idle => GIO_IOCB_STATUS_IDLE,
            IocbStatus::Issued => GIO_IOCB_STATUS_ISSUED,
            IocbStatus::Success => GIO_IOCB_STATUS_SUCCESS,
            IocbStatus::NvmeError => GIO_IOCB_STATUS_NVME_ERROR,
            IocbStatus::InvalidIoctx => GIO_IOCB_STATUS_INVALID_IOCTX,
            IocbStatus::Timeout => GIO_IOCB_STATUS_TIMEOUT,
            IocbStatus::ControllerFault => GIO_IOCB_STATUS_CONTROLLER_FAULT,
        }
    }

    /// `None` for a value no executor may write (untrusted input from shared memory).
    pub fn from_abi(raw: u32) -> Option<Self> {
        match raw {
            GIO_IOCB_STATUS_IDLE => Some(IocbStatus::Idle),
            GIO_IOCB_STATUS_ISSUED => Some(IocbStatus::Issued),
            GIO_IOCB_STATUS_SUCCESS => Some(IocbStatus::Success),
            GIO_IOCB_STATUS_NVME_ERROR => Some(IocbStatus::NvmeError),
            GIO_IOCB_STATUS_INVALID_IOCTX => Some(IocbStatus::InvalidIoctx),
            GIO_IOCB_STATUS_TIMEOUT => Some(IocbStatus::Timeout),
            GIO_IOCB_STATUS_CONTROLLER_FAULT => Some(IocbStatus::ControllerFault),
            _ => None,
        }
    }

    /// Whether the executor's queue pairs must be reset before reuse after an IOCB ended so: they
    /// may hold commands the executor no longer tracks.
    pub fn requires_queue_pair_reset(self) -> bool {
        matches!(self, IocbStatus::Timeout | IocbStatus::ControllerFault)
    }

    /// Whether this status ends an issue (may appear in a CQE).
    pub fn is_terminal(self) -> bool {
        !matches!(self, IocbStatus::Idle | IocbStatus::Issued)
    }
}

/// The NVMe status field of a completion (CQE DW3 bits 31:17, here with the phase tag cleared):
/// Status Code Type, Status Code, More, Do Not Retry (NVMe Base Spec 2.0 Fig. 101).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmeStatus(pub u16);

impl NvmeStatus {
    pub const SUCCESS: NvmeStatus = NvmeStatus(0);

    /// Builds the field from a status code type and status code.
    pub fn new(status_code_type: u8, status_code: u8) -> Self {
        NvmeStatus((u16::from(status_code_type & 0x7) << 9) | (u16::from(status_code) << 1))
    }
    pub fn status_code(self) -> u8 {
        (self.0 >> 1) as u8
    }
    pub fn status_code_type(self) -> u8 {
        ((self.0 >> 9) & 0x7) as u8
    }
    pub fn do_not_retry(self) -> bool {
        self.0 & 0x8000 != 0
    }
    pub fn is_success(self) -> bool {
        self.status_code() == 0 && self.status_code_type() == 0
    }
}

impl core::fmt::Display for NvmeStatus {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "SCT {:#x} SC {:#04x}{}", self.status_code_type(), self.status_code(), if self.do_not_retry() { " DNR" } else { "" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_codes_are_rejected() {
        for status in [
            IocbStatus::Idle,
            IocbStatus::Issued,
            IocbStatus::Success,
            IocbStatus::NvmeError,
            IocbStatus::InvalidIoctx,
            IocbStatus::Timeout,
            IocbStatus::ControllerFault,
        ] {
            assert_eq!(IocbStatus::from_abi(status.to_abi()), Some(status));
        }
        assert_eq!(IocbStatus::from_abi(7), None);
        assert_eq!(Opcode::from_abi(Opcode::Read.to_abi()), Some(Opcode::Read));
        assert_eq!(Opcode::from_abi(Opcode::Write.to_abi()), Some(Opcode::Write));
        assert_eq!(Opcode::from_abi(0x09), None);
    }

    #[test]
    fn every_valid_descriptor_kind_has_a_name_and_every_other_value_is_refused() {
        // Goal: the typed view accepts exactly what the header's rule accepts, and names it.
        for raw in 0..=u8::MAX {
            let kind = DescriptorKind::from_abi(raw);
            assert_eq!(kind.is_some(), descriptor_kind_is_valid(raw), "kind {raw}");
            if let Some(kind) = kind {
                assert_eq!(kind.to_abi(), raw);
            }
        }
        assert_eq!(DescriptorKind::from_abi(GIO_DESCRIPTOR_PRP as u8), Some(DescriptorKind::Prp));
        assert_eq!(DescriptorKind::from_abi(GIO_DESCRIPTOR_SGL as u8), Some(DescriptorKind::Sgl));
        assert_eq!(DescriptorKind::from_abi(2), None);
        assert_eq!(DescriptorKind::from_abi(u8::MAX), None);
    }

    #[test]
    fn the_slot_tracker_comment_names_the_command_id_rule_and_depth_limit_in_force() {
        // Goal: gio_abi.h's description of gio_nvme_slot follows the rules the kernel applies
        // (kernels/gio_kernel_rules.h): the command id is gio_command_id(ticket), never FFFFh,
        // and the deepest pair is GIO_SQ_DEPTH_MAX = 16384; it said ticket & 0xFFFF and 32768.
        let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../kernels/gio_abi.h")).unwrap();
        let start = header.find(" * Per-slot tracker of an NVMe submission queue").expect("the slot tracker's comment");
        let end = start + header[start..].find("typedef struct gio_nvme_slot").expect("gio_nvme_slot");
        let comment = &header[start..end];
        assert!(comment.contains("gio_command_id(ticket)") && comment.contains("never FFFFh"), "{comment}");
        assert!(comment.contains("16384") && comment.contains("GIO_SQ_DEPTH_MAX"), "{comment}");
        assert!(!comment.contains("32768"), "{comment}");
    }

    #[test]
    fn nvme_status_fields_match_the_cqe_layout() {
        // LBA Out of Range: SCT 0 (generic), SC 0x80.
        let status = NvmeStatus::new(0, 0x80);
        assert_eq!(status.0, 0x100);
        assert_eq!(status.status_code(), 0x80);
        assert_eq!(status.status_code_type(), 0);
        assert!(!status.is_success());
        let media = NvmeStatus(NvmeStatus::new(2, 0x81).0 | 0x8000);
        assert_eq!(media.status_code_type(), 2);
        assert!(media.do_not_retry());
        assert!(NvmeStatus::SUCCESS.is_success());
    }
}
