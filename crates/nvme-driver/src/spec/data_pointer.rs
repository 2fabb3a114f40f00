//! Data pointers: PRP entries and lists (§4.1.1) and SGL descriptors (§4.1.2).

/// Bytes per SGL descriptor (§4.1.2.1).
pub const SGL_DESCRIPTOR_BYTES: usize = 16;
/// Bytes per PRP entry.
pub const PRP_ENTRY_BYTES: usize = 8;

/// SGL descriptor type, byte 15 bits 7:4 (Figure 116).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SglDescriptorType {
    DataBlock,
    BitBucket,
    Segment,
    LastSegment,
    KeyedDataBlock,
    TransportDataBlock,
    Other(u8),
}

impl SglDescriptorType {
    pub fn from_u8(value: u8) -> Self {
        match value {
            0x0 => Self::DataBlock,
            0x1 => Self::BitBucket,
            0x2 => Self::Segment,
            0x3 => Self::LastSegment,
            0x4 => Self::KeyedDataBlock,
            0x5 => Self::TransportDataBlock,
            other => Self::Other(other),
        }
    }

    pub fn as_u8(self) -> u8 {
        match self {
            Self::DataBlock => 0x0,
            Self::BitBucket => 0x1,
            Self::Segment => 0x2,
            Self::LastSegment => 0x3,
            Self::KeyedDataBlock => 0x4,
            Self::TransportDataBlock => 0x5,
            Self::Other(other) => other,
        }
    }
}

/// A 16-byte SGL descriptor: address, length, and the identifier byte (type << 4 | subtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct SglDescriptor {
    pub address: u64,
    pub length: u32,
    pub reserved: [u8; 3],
    /// SGL identifier: type (7:4) and sub type (3:0); sub type 0 = address.
    pub identifier: u8,
}

const _: () = assert!(std::mem::size_of::<SglDescriptor>() == SGL_DESCRIPTOR_BYTES);

impl SglDescriptor {
    #[inline]
    pub fn new(kind: SglDescriptorType, address: u64, length: u32) -> Self {
        Self { address, length, reserved: [0; 3], identifier: kind.as_u8() << 4 }
    }

    /// A Data Block descriptor: `length` bytes at `address`.
    #[inline]
    pub fn data_block(address: u64, length: u32) -> Self {
        Self::new(SglDescriptorType::DataBlock, address, length)
    }

    /// A Last Segment descriptor pointing to `count` descriptors at `address`.
    pub fn last_segment(address: u64, count: u32) -> Self {
        Self::new(SglDescriptorType::LastSegment, address, count * SGL_DESCRIPTOR_BYTES as u32)
    }

    /// A Segment descriptor pointing to `count` descriptors (the last of which chains on).
    pub fn segment(address: u64, count: u32) -> Self {
        Self::new(SglDescriptorType::Segment, address, count * SGL_DESCRIPTOR_BYTES as u32)
    }

    pub fn kind(&self) -> SglDescriptorType {
        SglDescriptorType::from_u8(self.identifier >> 4)
    }

    pub fn subtype(&self) -> u8 {
        self.identifier & 0xF
    }

    #[inline]
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut bytes = [0u8; 16];
        bytes[0..8].copy_from_slice(&self.address.to_le_bytes());
        bytes[8..12].copy_from_slice(&self.length.to_le_bytes());
        bytes[15] = self.identifier;
        bytes
    }

    pub fn from_bytes(bytes: &[u8; 16]) -> Self {
        let mut address = [0u8; 8];
        address.copy_from_slice(&bytes[0..8]);
        let mut length = [0u8; 4];
        length.copy_from_slice(&bytes[8..12]);
        Self {
            address: u64::from_le_bytes(address),
            length: u32::from_le_bytes(length),
            reserved: [bytes[12], bytes[13], bytes[14]],
            identifier: bytes[15],
        }
    }

    /// The two dwords pairs as they sit in DPTR (SGL1).
    #[inline]
    pub fn to_dptr(&self) -> [u64; 2] {
        let bytes = self.to_bytes();
        let mut low = [0u8; 8];
        let mut high = [0u8; 8];
        low.copy_from_slice(&bytes[0..8]);
        high.copy_from_slice(&bytes[8..16]);
        [u64::from_le_bytes(low), u64::from_le_bytes(high)]
    }

    pub fn from_dptr(dptr: [u64; 2]) -> Self {
        let mut bytes = [0u8; 16];
        bytes[0..8].copy_from_slice(&dptr[0].to_le_bytes());
        bytes[8..16].copy_from_slice(&dptr[1].to_le_bytes());
        Self::from_bytes(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_layout() {
        let descriptor = SglDescriptor::last_segment(0xdead_b000, 3);
        assert_eq!(descriptor.kind(), SglDescriptorType::LastSegment);
        assert_eq!(descriptor.length, 48);
        let bytes = descriptor.to_bytes();
        assert_eq!(bytes[15], 0x30);
        assert_eq!(SglDescriptor::from_dptr(descriptor.to_dptr()), descriptor);
        assert_eq!(SglDescriptor::from_bytes(&bytes), descriptor);
    }
}
