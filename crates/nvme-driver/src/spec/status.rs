//! Completion status (§4.6.1): Status Code Type, Status Code, and the names of the ones we meet.

use std::fmt;

/// Status Code Type (§4.6.1.1, Figure 94).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusCodeType {
    Generic,
    CommandSpecific,
    MediaAndDataIntegrity,
    PathRelated,
    VendorSpecific,
    Reserved(u8),
}

impl StatusCodeType {
    pub fn from_u8(value: u8) -> Self {
        match value {
            0 => Self::Generic,
            1 => Self::CommandSpecific,
            2 => Self::MediaAndDataIntegrity,
            3 => Self::PathRelated,
            7 => Self::VendorSpecific,
            other => Self::Reserved(other),
        }
    }

    pub fn as_u8(self) -> u8 {
        match self {
            Self::Generic => 0,
            Self::CommandSpecific => 1,
            Self::MediaAndDataIntegrity => 2,
            Self::PathRelated => 3,
            Self::VendorSpecific => 7,
            Self::Reserved(other) => other,
        }
    }
}

/// A non-success completion status: SCT and SC plus the Do Not Retry and More bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmeStatus {
    pub code_type: StatusCodeType,
    pub code: u8,
    /// dnr: the same command will fail again if retried.
    pub do_not_retry: bool,
    /// m: more information in the Error Information log.
    pub more: bool,
}

/// Status codes the driver and the software controller name (§4.6.1.2).
pub mod codes {
    // Generic Command Status (Figure 95).
    pub const SUCCESS: u8 = 0x00;
    pub const INVALID_OPCODE: u8 = 0x01;
    pub const INVALID_FIELD: u8 = 0x02;
    pub const COMMAND_ID_CONFLICT: u8 = 0x03;
    pub const DATA_TRANSFER_ERROR: u8 = 0x04;
    pub const ABORTED_POWER_LOSS: u8 = 0x05;
    pub const INTERNAL_ERROR: u8 = 0x06;
    pub const ABORTED_BY_REQUEST: u8 = 0x07;
    pub const ABORTED_SQ_DELETION: u8 = 0x08;
    pub const INVALID_NAMESPACE: u8 = 0x0B;
    pub const COMMAND_SEQUENCE_ERROR: u8 = 0x0C;
    pub const INVALID_SGL_SEGMENT_DESCRIPTOR: u8 = 0x0D;
    pub const INVALID_SGL_DESCRIPTOR_COUNT: u8 = 0x0E;
    pub const DATA_SGL_LENGTH_INVALID: u8 = 0x0F;
    pub const SGL_DESCRIPTOR_TYPE_INVALID: u8 = 0x11;
    pub const INVALID_PRP_OFFSET: u8 = 0x13;
    pub const SGL_OFFSET_INVALID: u8 = 0x16;
    pub const LBA_OUT_OF_RANGE: u8 = 0x80;
    pub const CAPACITY_EXCEEDED: u8 = 0x81;
    // Command Specific Status (Figure 96).
    pub const COMPLETION_QUEUE_INVALID: u8 = 0x00;
    pub const INVALID_QUEUE_IDENTIFIER: u8 = 0x01;
    pub const INVALID_QUEUE_SIZE: u8 = 0x02;
    pub const INVALID_LOG_PAGE: u8 = 0x09;
    pub const FEATURE_NOT_CHANGEABLE: u8 = 0x0E;
    pub const INVALID_QUEUE_DELETION: u8 = 0x0C;
    pub const FEATURE_NOT_SAVEABLE: u8 = 0x0D;
    // Media and Data Integrity Errors (Figure 97).
    pub const WRITE_FAULT: u8 = 0x80;
    pub const UNRECOVERED_READ_ERROR: u8 = 0x81;
    pub const ACCESS_DENIED: u8 = 0x86;
}

impl NvmeStatus {
    /// Decodes the 15-bit status field (completion dword 3 bits 31:17): `Ok(())` on success.
    #[inline]
    pub fn from_status_field(field: u16) -> Result<(), NvmeStatus> {
        let code = field as u8;
        let code_type = StatusCodeType::from_u8((field >> 8 & 0x7) as u8);
        if code == 0 && code_type == StatusCodeType::Generic {
            return Ok(());
        }
        Err(NvmeStatus { code_type, code, more: field >> 13 & 1 == 1, do_not_retry: field >> 14 & 1 == 1 })
    }

    /// A status the software controller returns, with Do Not Retry set (the same command would
    /// fail again); build the struct directly for a retryable status.
    pub fn new(code_type: StatusCodeType, code: u8) -> Self {
        Self { code_type, code, do_not_retry: true, more: false }
    }

    pub fn generic(code: u8) -> Self {
        Self::new(StatusCodeType::Generic, code)
    }

    pub fn command_specific(code: u8) -> Self {
        Self::new(StatusCodeType::CommandSpecific, code)
    }

    /// Encodes back into the 15-bit status field.
    pub fn to_status_field(self) -> u16 {
        u16::from(self.code)
            | u16::from(self.code_type.as_u8() & 0x7) << 8
            | u16::from(self.more) << 13
            | u16::from(self.do_not_retry) << 14
    }

    pub fn is(self, code_type: StatusCodeType, code: u8) -> bool {
        self.code_type == code_type && self.code == code
    }

    /// The spec's name for this status, where we know it.
    pub fn name(self) -> &'static str {
        use codes::*;
        match (self.code_type, self.code) {
            (StatusCodeType::Generic, INVALID_OPCODE) => "Invalid Command Opcode",
            (StatusCodeType::Generic, INVALID_FIELD) => "Invalid Field in Command",
            (StatusCodeType::Generic, COMMAND_ID_CONFLICT) => "Command ID Conflict",
            (StatusCodeType::Generic, DATA_TRANSFER_ERROR) => "Data Transfer Error",
            (StatusCodeType::Generic, ABORTED_POWER_LOSS) => "Commands Aborted due to Power Loss Notification",
            (StatusCodeType::Generic, INTERNAL_ERROR) => "Internal Error",
            (StatusCodeType::Generic, ABORTED_BY_REQUEST) => "Command Abort Requested",
            (StatusCodeType::Generic, ABORTED_SQ_DELETION) => "Command Aborted due to SQ Deletion",
            (StatusCodeType::Generic, INVALID_NAMESPACE) => "Invalid Namespace or Format",
            (StatusCodeType::Generic, COMMAND_SEQUENCE_ERROR) => "Command Sequence Error",
            (StatusCodeType::Generic, INVALID_SGL_SEGMENT_DESCRIPTOR) => "Invalid SGL Segment Descriptor",
            (StatusCodeType::Generic, INVALID_SGL_DESCRIPTOR_COUNT) => "Invalid Number of SGL Descriptors",
            (StatusCodeType::Generic, DATA_SGL_LENGTH_INVALID) => "Data SGL Length Invalid",
            (StatusCodeType::Generic, SGL_DESCRIPTOR_TYPE_INVALID) => "SGL Descriptor Type Invalid",
            (StatusCodeType::Generic, INVALID_PRP_OFFSET) => "Invalid PRP Offset",
            (StatusCodeType::Generic, SGL_OFFSET_INVALID) => "SGL Offset Invalid",
            (StatusCodeType::Generic, LBA_OUT_OF_RANGE) => "LBA Out of Range",
            (StatusCodeType::Generic, CAPACITY_EXCEEDED) => "Capacity Exceeded",
            (StatusCodeType::CommandSpecific, COMPLETION_QUEUE_INVALID) => "Completion Queue Invalid",
            (StatusCodeType::CommandSpecific, INVALID_QUEUE_IDENTIFIER) => "Invalid Queue Identifier",
            (StatusCodeType::CommandSpecific, INVALID_QUEUE_SIZE) => "Invalid Queue Size",
            (StatusCodeType::CommandSpecific, INVALID_LOG_PAGE) => "Invalid Log Page",
            (StatusCodeType::CommandSpecific, INVALID_QUEUE_DELETION) => "Invalid Queue Deletion",
            (StatusCodeType::CommandSpecific, FEATURE_NOT_CHANGEABLE) => "Feature Not Changeable",
            (StatusCodeType::CommandSpecific, FEATURE_NOT_SAVEABLE) => "Feature Identifier Not Saveable",
            (StatusCodeType::MediaAndDataIntegrity, WRITE_FAULT) => "Write Fault",
            (StatusCodeType::MediaAndDataIntegrity, ACCESS_DENIED) => "Access Denied",
            (StatusCodeType::MediaAndDataIntegrity, UNRECOVERED_READ_ERROR) => "Unrecovered Read Error",
            _ => "unnamed status",
        }
    }
}

impl fmt::Display for NvmeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (sct {:#x}, sc {:#04x}{})",
            self.name(),
            self.code_type.as_u8(),
            self.code,
            if self.do_not_retry { ", dnr" } else { "" }
        )
    }
}

impl std::error::Error for NvmeStatus {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_names_and_round_trips() {
        assert_eq!(NvmeStatus::from_status_field(0), Ok(()));
        let status = NvmeStatus::generic(codes::LBA_OUT_OF_RANGE);
        let decoded = NvmeStatus::from_status_field(status.to_status_field()).unwrap_err();
        assert_eq!(decoded, status);
        assert_eq!(decoded.name(), "LBA Out of Range");
        assert!(decoded.to_string().contains("LBA Out of Range"));
        // SC 0 with a non-generic type is not success.
        assert!(NvmeStatus::from_status_field(1 << 8).is_err());
    }
}
