//! Which namespaces the driver does I/O on, decided from untrusted Identify Namespace data.
//!
//! The driver moves data only: a command's data pointer covers NLB × (LBA data size) bytes. A
//! format with metadata would make the controller move NLB × (data + metadata) bytes through
//! that pointer (an extended LBA, FLBAS bit 4) or to the metadata pointer, which we leave zero
//! (a separate buffer); protection information needs metadata and PRACT/PRCHK settings we do not
//! send. Either way the controller would read or write memory the command does not own, so such
//! namespaces are refused with a typed error naming their format, not used.

use std::fmt;

use crate::error::NvmeError;
use crate::spec::identify::IdentifyError;
use crate::spec::{IdentifyNamespace, NvmeStatus};
use crate::types::NamespaceId;

/// One active namespace: what I/O needs to know about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Namespace {
    pub id: NamespaceId,
    pub block_size_bytes: u32,
    pub size_blocks: u64,
}

impl Namespace {
    /// Size in bytes (validated at bring-up not to overflow).
    pub fn size_bytes(&self) -> u64 {
        self.size_blocks.saturating_mul(u64::from(self.block_size_bytes))
    }
}

/// Why the driver does no I/O on a namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NamespaceRefusal {
    /// The LBA format in use has `metadata_bytes` of metadata per block, interleaved with the
    /// data (`extended_lba`, FLBAS bit 4) or in a separate buffer.
    Metadata { metadata_bytes: u16, extended_lba: bool },
    /// End-to-end protection information is enabled (DPS bits 2:0).
    ProtectionInformation { protection_type: u8 },
    /// One block is larger than the largest transfer the controller accepts (MDTS).
    BlockLargerThanTransfer { max_transfer_bytes: u64 },
    /// NSZE × block size does not fit in 64 bits.
    SizeOverflow { size_blocks: u64 },
    /// Identify Namespace data the driver cannot compute with (a format index past the defined
    /// formats, a block size outside 2^9..=2^16, NSZE = 0 or NCAP > NSZE).
    Malformed(IdentifyError),
    /// Identify Namespace completed with this error status: the driver knows nothing about
    /// the namespace's format, so it does no I/O on it (the rest of the controller is used).
    IdentifyFailed(NvmeStatus),
}

/// A namespace the controller reports but the driver refuses (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefusedNamespace {
    pub id: NamespaceId,
    /// The LBA format in use (FLBAS).
    pub format_index: u8,
    pub block_size_bytes: u32,
    pub refusal: NamespaceRefusal,
}

impl fmt::Display for RefusedNamespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let NamespaceRefusal::Malformed(error) = self.refusal {
            return write!(f, "{} reports Identify Namespace data the driver cannot use ({error}); the driver does no I/O on it", self.id);
        }
        if let NamespaceRefusal::IdentifyFailed(status) = self.refusal {
            return write!(f, "{}: Identify Namespace failed ({status}); the driver does no I/O on it", self.id);
        }
        write!(f, "{} uses LBA format {} ({}-byte blocks) ", self.id, self.format_index, self.block_size_bytes)?;
        match self.refusal {
            NamespaceRefusal::Metadata { metadata_bytes, extended_lba: true } => {
                write!(f, "with {metadata_bytes} metadata bytes per block interleaved (extended LBA)")?
            }
            NamespaceRefusal::Metadata { metadata_bytes, extended_lba: false } => {
                write!(f, "with {metadata_bytes} metadata bytes per block in a separate buffer")?
            }
            NamespaceRefusal::ProtectionInformation { protection_type } => {
                write!(f, "with end-to-end protection information type {protection_type}")?
            }
            NamespaceRefusal::BlockLargerThanTransfer { max_transfer_bytes } => {
                write!(f, "whose blocks exceed the controller's {max_transfer_bytes}-byte transfer limit (MDTS)")?
            }
            NamespaceRefusal::SizeOverflow { size_blocks } => write!(f, "with {size_blocks} blocks, more bytes than 64 bits count")?,
            NamespaceRefusal::Malformed(_) | NamespaceRefusal::IdentifyFailed(_) => {} // returned above
        }
        write!(f, ": the driver supports data-only formats; reformat the namespace without metadata or protection to use it")
    }
}

/// The usable namespace `id`, or why not: refused (with its format) or unknown.
pub(crate) fn find(usable: &[Namespace], refused: &[RefusedNamespace], id: NamespaceId) -> Result<Namespace, NvmeError> {
    if let Some(namespace) = usable.iter().find(|namespace| namespace.id == id) {
        return Ok(*namespace);
    }
    match refused.iter().find(|refused| refused.id == id) {
        Some(refused) => Err(NvmeError::UnsupportedNamespaceFormat(*refused)),
        None => Err(NvmeError::UnknownNamespace { namespace: id }),
    }
}

/// The refusal of namespace `id` whose Identify Namespace data did not parse.
pub(crate) fn refuse_malformed(id: NamespaceId, error: IdentifyError) -> RefusedNamespace {
    let format_index = match error {
        IdentifyError::FormatIndexOutOfRange { index, .. } | IdentifyError::UnsupportedLbaSize { index, .. } => index,
        _ => 0,
    };
    RefusedNamespace { id, format_index, block_size_bytes: 0, refusal: NamespaceRefusal::Malformed(error) }
}

/// The refusal of namespace `id` whose Identify Namespace completed with error `status` (its
/// format is unknown: index and block size read 0).
pub(crate) fn refuse_identify_failed(id: NamespaceId, status: NvmeStatus) -> RefusedNamespace {
    RefusedNamespace { id, format_index: 0, block_size_bytes: 0, refusal: NamespaceRefusal::IdentifyFailed(status) }
}

/// Decides whether the driver can do I/O on namespace `id` as Identify describes it.
pub(crate) fn classify(id: NamespaceId, identify: &IdentifyNamespace, max_transfer_bytes: u64) -> Result<Namespace, RefusedNamespace> {
    // `parse` guarantees the format in use exists; a missing one reads as 0 bytes and is refused.
    let format = identify.format();
    let block_size_bytes = format.map_or(0, |format| format.block_size_bytes());
    let refuse = |refusal| RefusedNamespace { id, format_index: identify.format_index, block_size_bytes, refusal };
    let metadata_bytes = format.map_or(0, |format| format.metadata_bytes);
    if metadata_bytes != 0 {
        return Err(refuse(NamespaceRefusal::Metadata { metadata_bytes, extended_lba: identify.extended_lba }));
    }
    if identify.protection_type() != 0 {
        return Err(refuse(NamespaceRefusal::ProtectionInformation { protection_type: identify.protection_type() }));
    }
    if block_size_bytes == 0 || u64::from(block_size_bytes) > max_transfer_bytes {
        return Err(refuse(NamespaceRefusal::BlockLargerThanTransfer { max_transfer_bytes }));
    }
    if identify.size_blocks.checked_mul(u64::from(block_size_bytes)).is_none() {
        return Err(refuse(NamespaceRefusal::SizeOverflow { size_blocks: identify.size_blocks }));
    }
    Ok(Namespace { id, block_size_bytes, size_blocks: identify.size_blocks })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::LbaFormat;

    fn identify(metadata_bytes: u16, extended_lba: bool, protection_settings: u8) -> IdentifyNamespace {
        IdentifyNamespace {
            size_blocks: 1024,
            capacity_blocks: 1024,
            utilization_blocks: 0,
            format_index: 0,
            extended_lba,
            protection_settings,
            formats: vec![LbaFormat { metadata_bytes, lbads: 12, relative_performance: 0 }],
        }
    }

    #[test]
    fn formats_with_metadata_or_protection_are_refused_by_name() {
        // Goal: metadata (extended or separate), protection information, a block above MDTS and
        // an overflowing size are refused with the format named; a data-only format is used.
        let id = NamespaceId(3);
        assert_eq!(classify(id, &identify(0, false, 0), 1 << 20), Ok(Namespace { id, block_size_bytes: 4096, size_blocks: 1024 }));
        let extended = classify(id, &identify(8, true, 0), 1 << 20).unwrap_err();
        assert_eq!(extended.refusal, NamespaceRefusal::Metadata { metadata_bytes: 8, extended_lba: true });
        assert!(extended.to_string().contains("LBA format 0 (4096-byte blocks) with 8 metadata bytes per block interleaved"), "{extended}");
        let separate = classify(id, &identify(64, false, 0), 1 << 20).unwrap_err();
        assert_eq!(separate.refusal, NamespaceRefusal::Metadata { metadata_bytes: 64, extended_lba: false });
        let protected = classify(id, &identify(0, false, 0x2), 1 << 20).unwrap_err();
        assert_eq!(protected.refusal, NamespaceRefusal::ProtectionInformation { protection_type: 2 });
        let large = classify(id, &identify(0, false, 0), 2048).unwrap_err();
        assert_eq!(large.refusal, NamespaceRefusal::BlockLargerThanTransfer { max_transfer_bytes: 2048 });
        let huge = IdentifyNamespace { size_blocks: u64::MAX, capacity_blocks: 0, ..identify(0, false, 0) };
        assert!(matches!(classify(id, &huge, 1 << 20), Err(RefusedNamespace { refusal: NamespaceRefusal::SizeOverflow { .. }, .. })));
    }
}
