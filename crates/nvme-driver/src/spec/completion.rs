//! The 16-byte completion queue entry (§4.6, Figure 92).

use super::status::NvmeStatus;
use crate::types::{CommandId, QueueId};

/// A completion queue entry. `#[repr(C)]` in the spec's order; crosses the seam as bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct CompletionEntry {
    /// dw0: command specific (e.g. Number of Queues allocated).
    pub dw0: u32,
    /// dw1: command specific.
    pub dw1: u32,
    /// sqhd: submission queue head pointer as consumed by the controller.
    pub sq_head: u16,
    /// sqid: the submission queue the command came from.
    pub sq_id: u16,
    /// cid: the command identifier.
    pub command_id: u16,
    /// Status field (bits 15:1) and phase tag (bit 0).
    pub status_and_phase: u16,
}

const _: () = assert!(std::mem::size_of::<CompletionEntry>() == 16);

impl CompletionEntry {
    /// Byte offset of dword 3 (cid + status + phase): the dword a poller loads with Acquire.
    pub const DWORD3_OFFSET: usize = 12;

    pub fn phase(&self) -> bool {
        self.status_and_phase & 1 == 1
    }

    pub fn command_id(&self) -> CommandId {
        CommandId(self.command_id)
    }

    pub fn queue_id(&self) -> QueueId {
        QueueId(self.sq_id)
    }

    /// The raw 15-bit status field (without the phase bit).
    pub fn status_field(&self) -> u16 {
        self.status_and_phase >> 1
    }

    /// The decoded status; `Ok(())` for successful completion.
    pub fn status(&self) -> Result<(), NvmeStatus> {
        NvmeStatus::from_status_field(self.status_field())
    }

    pub fn to_bytes(&self) -> [u8; 16] {
        let mut bytes = [0u8; 16];
        bytes[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        bytes[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        bytes[8..10].copy_from_slice(&self.sq_head.to_le_bytes());
        bytes[10..12].copy_from_slice(&self.sq_id.to_le_bytes());
        bytes[12..14].copy_from_slice(&self.command_id.to_le_bytes());
        bytes[14..16].copy_from_slice(&self.status_and_phase.to_le_bytes());
        bytes
    }

    #[inline]
    pub fn from_bytes(bytes: &[u8; 16]) -> Self {
        let u16_at = |start: usize| u16::from_le_bytes([bytes[start], bytes[start + 1]]);
        let u32_at = |start: usize| u32::from_le_bytes([bytes[start], bytes[start + 1], bytes[start + 2], bytes[start + 3]]);
        Self { dw0: u32_at(0), dw1: u32_at(4), sq_head: u16_at(8), sq_id: u16_at(10), command_id: u16_at(12), status_and_phase: u16_at(14) }
    }

    /// Decodes dword 3 as loaded atomically: (command id, status field, phase).
    #[inline]
    pub fn decode_dword3(dword3: u32) -> (CommandId, u16, bool) {
        let status_and_phase = (dword3 >> 16) as u16;
        (CommandId(dword3 as u16), status_and_phase >> 1, status_and_phase & 1 == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_dword3() {
        let entry = CompletionEntry { dw0: 7, dw1: 0, sq_head: 12, sq_id: 3, command_id: 0x0102, status_and_phase: 0x80 << 1 | 1 };
        let bytes = entry.to_bytes();
        assert_eq!(CompletionEntry::from_bytes(&bytes), entry);
        let dword3 = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
        assert_eq!(CompletionEntry::decode_dword3(dword3), (CommandId(0x0102), 0x80, true));
        assert!(entry.status().is_err());
    }
}
