//! The VFIO container: group attachment, the type1v2 IOMMU, its IOVA window, and DMA mappings.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::error::{map_dma_error, open_error, VfioError};
use super::sys;
use super::uapi::*;
use crate::hw::{HwError, IommuMapper};
use crate::types::Iova;

/// The x86 MSI doorbell window: device writes here are interrupts, never memory (Intel VT-d
/// §3.13, AMD IOMMU §2.1.4); an IOVA in it must never back a DMA buffer.
pub const MSI_WINDOW_START: u64 = 0xFEE0_0000;
pub const MSI_WINDOW_END_EXCLUSIVE: u64 = 0xFEF0_0000;
/// IOVAs below 1 MiB are left unused so that a zeroed or truncated descriptor never names
/// mapped memory.
pub const IOVA_FLOOR: u64 = 1 << 20;
/// When the kernel reports no IOVA ranges (before Linux 5.4), assume a 39-bit address width,
/// the smallest any VT-d or AMD-Vi implementation offers.
const FALLBACK_IOVA_END_INCLUSIVE: u64 = (1 << 39) - 1;
/// A window smaller than this cannot hold the driver's queues and buffers.
const WINDOW_MIN_BYTES: u64 = 2 << 20;
/// Upper bound on capability-chain entries walked (the kernel defines a handful).
const CAPABILITIES_MAX: usize = 64;
/// 4 KiB, the page size every mapping uses.
const SMALL_PAGE_BYTES: u64 = 4096;

/// What `VFIO_IOMMU_GET_INFO` told us.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IommuInfo {
    /// Bitmap of supported page sizes (bit n = 2^n bytes), 0 if not reported.
    pub page_sizes: u64,
    /// Usable IOVA ranges, `(start, end_inclusive)`; empty if the kernel reported none.
    pub ranges: Vec<(u64, u64)>,
    /// Number of further DMA mappings the kernel will accept, if reported.
    pub mappings_available: Option<u32>,
}

fn u16_at(bytes: &[u8], offset: usize) -> Option<u16> {
    Some(u16::from_le_bytes(bytes.get(offset..offset.checked_add(2)?)?.try_into().ok()?))
}
fn u32_at(bytes: &[u8], offset: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(offset..offset.checked_add(4)?)?.try_into().ok()?))
}
fn u64_at(bytes: &[u8], offset: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(offset..offset.checked_add(8)?)?.try_into().ok()?))
}

/// Parses a `vfio_iommu_type1_info` buffer including its capability chain. The buffer comes
/// from the kernel but is still checked: every offset in bounds, the chain strictly forward.
pub fn parse_iommu_info(buffer: &[u8]) -> Result<IommuInfo, VfioError> {
    let bad = |reason| VfioError::BadCapabilityChain { reason };
    let header_bytes = std::mem::size_of::<vfio_iommu_type1_info>();
    let flags = IommuInfoFlags::from_bits_retain(u32_at(buffer, 4).ok_or(bad("info shorter than its header"))?);
    let mut info = IommuInfo { page_sizes: u64_at(buffer, 8).ok_or(bad("info shorter than its header"))?, ..IommuInfo::default() };
    if !flags.contains(IommuInfoFlags::CAPS) {
        return Ok(info);
    }
    let mut offset = u32_at(buffer, 16).ok_or(bad("info shorter than its header"))? as usize;
    for _ in 0..CAPABILITIES_MAX {
        if offset == 0 {
            return Ok(info);
        }
        if offset < header_bytes {
            return Err(bad("capability overlaps the info header"));
        }
        let id = u32::from(u16_at(buffer, offset).ok_or(bad("capability header out of bounds"))?);
        let next = u32_at(buffer, offset + 4).ok_or(bad("capability header out of bounds"))? as usize;
        match id {
            VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE => {
                let count = u32_at(buffer, offset + CAP_HEADER_BYTES).ok_or(bad("IOVA range count out of bounds"))? as usize;
                let first = offset + CAP_HEADER_BYTES + 8;
                if count.checked_mul(IOVA_RANGE_BYTES).and_then(|len| len.checked_add(first)).is_none_or(|end| end > buffer.len()) {
                    return Err(bad("IOVA ranges run past the buffer"));
                }
                for index in 0..count {
                    let at = first + index * IOVA_RANGE_BYTES;
                    let start = u64_at(buffer, at).ok_or(bad("IOVA range out of bounds"))?;
                    let end = u64_at(buffer, at + 8).ok_or(bad("IOVA range out of bounds"))?;
                    if end < start {
                        return Err(bad("IOVA range ends before it starts"));
                    }
                    info.ranges.push((start, end));
                }
            }
            VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL => {
                info.mappings_available = Some(u32_at(buffer, offset + CAP_HEADER_BYTES).ok_or(bad("DMA_AVAIL out of bounds"))?);
            }
            _ => {} // Capabilities we do not use (migration, ...).
        }
        if next != 0 && next <= offset {
            return Err(bad("capability chain does not move forward"));
        }
        offset = next;
    }
    Err(bad("capability chain too long"))
}

/// Picks the IOVA window `[base, limit)` for a DMA pool: the largest piece of the usable ranges
/// after removing the first MiB and the MSI window. `None` if nothing of useful size remains.
pub fn choose_iova_window(ranges: &[(u64, u64)]) -> Option<(u64, u64)> {
    let fallback = [(0, FALLBACK_IOVA_END_INCLUSIVE)];
    let ranges = if ranges.is_empty() { &fallback[..] } else { ranges };
    let forbidden = [(0, IOVA_FLOOR), (MSI_WINDOW_START, MSI_WINDOW_END_EXCLUSIVE)];
    let mut best: Option<(u64, u64)> = None;
    for &(start, end_inclusive) in ranges {
        // Half-open pieces; an end of u64::MAX loses its last byte, which nobody will miss.
        let mut pieces = vec![(start, end_inclusive.saturating_add(1))];
        for &(hole_start, hole_end) in &forbidden {
            pieces = pieces
                .into_iter()
                .flat_map(|(piece_start, piece_end)| {
                    let below = (piece_start, piece_end.min(hole_start));
                    let above = (piece_start.max(hole_end), piece_end);
                    [below, above].into_iter().filter(|(low, high)| low < high)
                })
                .collect();
        }
        for (piece_start, piece_end) in pieces {
            // Align the base up to 2 MiB so huge-page mappings can use large IOMMU pages.
            let Some(base) = piece_start.checked_next_multiple_of(2 << 20) else { continue };
            let limit = piece_end & !(SMALL_PAGE_BYTES - 1);
            if base >= limit || limit - base < WINDOW_MIN_BYTES {
                continue;
            }
            if best.is_none_or(|(best_base, best_limit)| limit - base > best_limit - best_base) {
                best = Some((base, limit));
            }
        }
    }
    best
}

/// A container with one or more groups attached and the type1v2 IOMMU set: one IOVA space for
/// every device in those groups. Closing it (the last `Arc`) removes every DMA mapping the
/// process made through it.
#[derive(Debug)]
pub struct Container {
    /// Declared before `groups` so it closes first: the kernel then tears down mappings while
    /// the groups are still attached (either order works, this one is the tidy one).
    container: OwnedFd,
    /// (group id, group fd), in attach order; never empty.
    groups: Mutex<Vec<(u32, Arc<OwnedFd>)>>,
}

impl Container {
    /// Opens `/dev/vfio/vfio` and `group_path`, checks viability, attaches, selects type1v2.
    /// `describe_blockers` is asked for the offending group members when the group is not viable.
    pub fn open(group_path: &Path, group_id: u32, describe_blockers: impl FnOnce() -> String) -> Result<Self, VfioError> {
        let container_path = PathBuf::from("/dev/vfio/vfio");
        let container = sys::open_read_write(&container_path).map_err(|source| open_error(container_path, group_id, source))?;
        let version = sys::api_version(&container).map_err(|source| VfioError::Kernel { operation: "VFIO_GET_API_VERSION", source })?;
        if i64::from(version) != i64::from(VFIO_API_VERSION) {
            return Err(VfioError::ApiVersion { version });
        }
        // CHECK_EXTENSION answers 1 when the IOMMU model is available, 0 when not.
        if sys::check_extension(&container, VFIO_TYPE1v2_IOMMU).unwrap_or(0) != 1 {
            return Err(VfioError::NoType1v2);
        }
        let group = attach_group(&container, group_path, group_id, describe_blockers)?;
        sys::set_iommu(&container, VFIO_TYPE1v2_IOMMU)
            .map_err(|source| VfioError::Kernel { operation: "VFIO_SET_IOMMU(type1v2)", source })?;
        Ok(Self { container, groups: Mutex::new(vec![(group_id, Arc::new(group))]) })
    }

    /// Attaches another group, so its devices share this container's IOVA space (a group
    /// already attached is fine: several functions may share one). Done before any DMA
    /// mapping: the caller queries [`Container::info`] afterwards, when the reserved ranges of
    /// every attached group are known.
    pub fn attach(&self, group_path: &Path, group_id: u32, describe_blockers: impl FnOnce() -> String) -> Result<(), VfioError> {
        let mut groups = self.groups.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if groups.iter().any(|(id, _)| *id == group_id) {
            return Ok(());
        }
        let group = attach_group(&self.container, group_path, group_id, describe_blockers)?;
        groups.push((group_id, Arc::new(group)));
        Ok(())
    }

    /// The first group attached.
    pub fn group_id(&self) -> u32 {
        self.groups.lock().unwrap_or_else(|poisoned| poisoned.into_inner())[0].0
    }

    /// The fd of attached group `group_id`.
    pub(super) fn group_fd(&self, group_id: u32) -> Option<Arc<OwnedFd>> {
        let groups = self.groups.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        groups.iter().find(|(id, _)| *id == group_id).map(|(_, fd)| Arc::clone(fd))
    }

    /// Queries the IOMMU: page sizes, IOVA ranges, mapping slots left.
    pub fn info(&self) -> Result<IommuInfo, VfioError> {
        let query = |len: usize| -> Result<Vec<u8>, VfioError> {
            let mut buffer = vec![0u8; len];
            // `len` is bounded below by the caller (at most a few KiB); it fits argsz.
            buffer[0..4].copy_from_slice(&(len as u32).to_le_bytes());
            sys::iommu_info(&self.container, &mut buffer)
                .map_err(|source| VfioError::Kernel { operation: "VFIO_IOMMU_GET_INFO", source })?;
            Ok(buffer)
        };
        let header_bytes = std::mem::size_of::<vfio_iommu_type1_info>();
        let mut buffer = query(header_bytes)?;
        // With capabilities, the kernel raises argsz to the size it needs; ask again with that.
        let needed = u32_at(&buffer, 0).unwrap_or(0) as usize;
        if let Some(len) = capability_query_bytes(needed, header_bytes)? {
            buffer = query(len)?;
        } else {
            // Only the fixed header was filled: drop a capability offset that points past it.
            let flags = IommuInfoFlags::from_bits_retain(u32_at(&buffer, 4).unwrap_or(0)).difference(IommuInfoFlags::CAPS);
            buffer[4..8].copy_from_slice(&flags.bits().to_le_bytes());
        }
        parse_iommu_info(&buffer)
    }
}

/// The most IOMMU information (header and capability chain) asked of the kernel: a few
/// hundred bytes in practice (one reserved-range entry is 16 bytes).
const IOMMU_INFO_BYTES_MAX: usize = 1 << 20;

/// How large a second `VFIO_IOMMU_GET_INFO` must be when the first (header only) answered that
/// `needed` bytes hold everything: `None` when the header was all there is. More than
/// [`IOMMU_INFO_BYTES_MAX`] is an error: dropping the capabilities then would lose the
/// reserved IOVA ranges and guess a window that may overlap them.
fn capability_query_bytes(needed: usize, header_bytes: usize) -> Result<Option<usize>, VfioError> {
    if needed <= header_bytes {
        Ok(None)
    } else if needed <= IOMMU_INFO_BYTES_MAX {
        Ok(Some(needed))
    } else {
        Err(VfioError::BadCapabilityChain { reason: "the kernel asks for more than 1 MiB of IOMMU information" })
    }
}

/// Opens a group, checks it is viable, and attaches it to `container`.
fn attach_group(
    container: &OwnedFd,
    group_path: &Path,
    group_id: u32,
    describe_blockers: impl FnOnce() -> String,
) -> Result<OwnedFd, VfioError> {
    let group = sys::open_read_write(group_path).map_err(|source| open_error(group_path.to_path_buf(), group_id, source))?;
    let mut status = vfio_group_status { argsz: argsz::<vfio_group_status>(), flags: 0 };
    sys::group_status(&group, &mut status).map_err(|source| VfioError::Kernel { operation: "VFIO_GROUP_GET_STATUS", source })?;
    if !GroupFlags::from_bits_retain(status.flags).contains(GroupFlags::VIABLE) {
        return Err(VfioError::GroupNotViable { group: group_id, others: describe_blockers() });
    }
    sys::group_set_container(&group, container).map_err(|source| VfioError::Kernel { operation: "VFIO_GROUP_SET_CONTAINER", source })?;
    Ok(group)
}

/// Programs the container's IOMMU for a [`crate::hw::DmaPool`].
#[derive(Debug)]
pub struct VfioMapper {
    container: Arc<Container>,
}

impl VfioMapper {
    pub fn new(container: Arc<Container>) -> Self {
        Self { container }
    }
}

impl IommuMapper for VfioMapper {
    unsafe fn map(&self, host: *mut u8, len: usize, iova: Iova) -> Result<(), HwError> {
        if len == 0 {
            return Err(HwError::ZeroLength);
        }
        if !(len as u64).is_multiple_of(SMALL_PAGE_BYTES) {
            return Err(VfioError::UnalignedDmaLength { len_bytes: len }.into());
        }
        let request = vfio_iommu_type1_dma_map {
            argsz: argsz::<vfio_iommu_type1_dma_map>(),
            flags: (DmaMapFlags::READ | DmaMapFlags::WRITE).bits(),
            vaddr: host as u64,
            iova: iova.0,
            size: len as u64,
        };
        // SAFETY: `host..host+len` is memory our caller keeps valid (and never frees) until it is
        // unmapped: exactly `IommuMapper::map`'s contract, which is `iommu_map_dma`'s.
        unsafe { sys::iommu_map_dma(&self.container.container, &request) }
            .map_err(|source| map_dma_error(source, iova.0, len, sys::memlock_limit_bytes()))?;
        Ok(())
    }

    fn unmap(&self, iova: Iova, len: usize) -> Result<(), HwError> {
        let mut request = vfio_iommu_type1_dma_unmap {
            argsz: argsz::<vfio_iommu_type1_dma_unmap>(),
            flags: 0,
            iova: iova.0,
            size: len as u64,
            ..vfio_iommu_type1_dma_unmap::default()
        };
        sys::iommu_unmap_dma(&self.container.container, &mut request).map_err(|source| VfioError::UnmapDma {
            iova: iova.0,
            len_bytes: len,
            source,
        })?;
        if request.size != len as u64 {
            return Err(VfioError::PartialUnmap { iova: iova.0, len_bytes: len, unmapped_bytes: request.size }.into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds an info buffer as the kernel lays it out: header, then the capability chain.
    fn info_buffer(page_sizes: u64, ranges: &[(u64, u64)], dma_avail: Option<u32>) -> Vec<u8> {
        let mut buffer = vec![0u8; 24];
        buffer[8..16].copy_from_slice(&page_sizes.to_le_bytes());
        let mut caps: Vec<(u16, Vec<u8>)> = Vec::new();
        if !ranges.is_empty() {
            let mut body = (ranges.len() as u32).to_le_bytes().to_vec();
            body.extend_from_slice(&[0; 4]);
            for (start, end) in ranges {
                body.extend_from_slice(&start.to_le_bytes());
                body.extend_from_slice(&end.to_le_bytes());
            }
            caps.push((VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE as u16, body));
        }
        caps.push((2, vec![0; 24])); // migration capability: skipped
        if let Some(avail) = dma_avail {
            caps.push((VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL as u16, avail.to_le_bytes().to_vec()));
        }
        buffer[4..8].copy_from_slice(&(IommuInfoFlags::PAGE_SIZES | IommuInfoFlags::CAPS).bits().to_le_bytes());
        buffer[16..20].copy_from_slice(&24u32.to_le_bytes());
        let count = caps.len();
        for (index, (id, body)) in caps.into_iter().enumerate() {
            let offset = buffer.len();
            let next = if index + 1 == count { 0 } else { offset + 8 + body.len() };
            buffer.extend_from_slice(&id.to_le_bytes());
            buffer.extend_from_slice(&1u16.to_le_bytes());
            buffer.extend_from_slice(&(next as u32).to_le_bytes());
            buffer.extend_from_slice(&body);
        }
        let len = buffer.len() as u32;
        buffer[0..4].copy_from_slice(&len.to_le_bytes());
        buffer
    }

    #[test]
    fn capability_chain_yields_ranges_and_slots() {
        // Goal: the parser reads what an intel-iommu guest reports (39-bit space minus MSI).
        let ranges = [(0, MSI_WINDOW_START - 1), (MSI_WINDOW_END_EXCLUSIVE, (1 << 39) - 1)];
        let buffer = info_buffer(0x4020_1000, &ranges, Some(65535));
        let info = parse_iommu_info(&buffer).unwrap();
        assert_eq!(info.page_sizes, 0x4020_1000);
        assert_eq!(info.ranges, ranges);
        assert_eq!(info.mappings_available, Some(65535));
    }

    #[test]
    fn iommu_information_past_the_cap_is_an_error_not_a_guessed_window() {
        // Goal: a kernel answer asking for more capability data than read (64 KiB used to be
        // the limit) was taken as "no capabilities", dropping the reserved ranges for a guessed
        // window; now up to 1 MiB is read and more is refused.
        assert!(matches!(capability_query_bytes(24, 24), Ok(None)));
        assert!(matches!(capability_query_bytes(0, 24), Ok(None)));
        assert!(matches!(capability_query_bytes(70_000, 24), Ok(Some(70_000))));
        assert!(matches!(capability_query_bytes(IOMMU_INFO_BYTES_MAX + 1, 24), Err(VfioError::BadCapabilityChain { .. })));
    }

    #[test]
    fn malformed_chains_are_rejected() {
        // Goal: offsets out of bounds, loops and overlong range lists are errors, not panics.
        let good = info_buffer(0x1000, &[(0, 1 << 30)], None);
        let mut looped = good.clone();
        looped[16..20].copy_from_slice(&24u32.to_le_bytes());
        looped[24 + 4..24 + 8].copy_from_slice(&24u32.to_le_bytes()); // next points at itself
        assert!(matches!(parse_iommu_info(&looped), Err(VfioError::BadCapabilityChain { .. })));
        let mut overlong = good.clone();
        overlong[32..36].copy_from_slice(&1000u32.to_le_bytes()); // 1000 ranges claimed
        assert!(parse_iommu_info(&overlong).is_err());
        let mut outside = good.clone();
        outside[16..20].copy_from_slice(&4096u32.to_le_bytes());
        assert!(parse_iommu_info(&outside).is_err());
        let mut into_header = good;
        into_header[16..20].copy_from_slice(&8u32.to_le_bytes());
        assert!(parse_iommu_info(&into_header).is_err());
        assert!(parse_iommu_info(&[0u8; 10]).is_err());
        let mut reversed = info_buffer(0x1000, &[(1 << 30, 1 << 20)], None);
        assert!(parse_iommu_info(&reversed).is_err());
        reversed[4..8].copy_from_slice(&0u32.to_le_bytes()); // without the CAPS flag the chain is ignored
        assert_eq!(parse_iommu_info(&reversed).unwrap().ranges, vec![]);
    }

    proptest::proptest! {
        /// Goal: whatever the kernel reports, the window lies inside one reported range, misses
        /// the MSI window and the first MiB, is 2 MiB aligned and at least 2 MiB long.
        #[test]
        fn chosen_window_is_always_usable(raw in proptest::collection::vec((0u64..1 << 40, 0u64..1 << 36), 0..6)) {
            let ranges: Vec<(u64, u64)> = raw.iter().map(|&(start, len)| (start, start + len)).collect();
            if let Some((base, limit)) = choose_iova_window(&ranges) {
                proptest::prop_assert!(base % (2 << 20) == 0 && limit - base >= 2 << 20);
                proptest::prop_assert!(base >= IOVA_FLOOR);
                proptest::prop_assert!(limit <= MSI_WINDOW_START || base >= MSI_WINDOW_END_EXCLUSIVE);
                let inside = |&(start, end): &(u64, u64)| base >= start && limit - 1 <= end;
                if ranges.is_empty() {
                    proptest::prop_assert!(limit <= 1 << 39);
                } else {
                    proptest::prop_assert!(ranges.iter().any(inside), "{base:#x}..{limit:#x} not in {ranges:x?}");
                }
            }
        }

        /// Goal: arbitrary bytes from the kernel never make the parser panic or loop.
        #[test]
        fn parser_survives_arbitrary_bytes(mut bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256), offset in 0u32..300) {
            if bytes.len() >= 20 {
                bytes[4..8].copy_from_slice(&IommuInfoFlags::CAPS.bits().to_le_bytes());
                bytes[16..20].copy_from_slice(&offset.to_le_bytes());
            }
            let _ = parse_iommu_info(&bytes);
        }
    }

    #[test]
    fn window_avoids_msi_and_low_memory() {
        // Goal: the chosen window never contains the MSI window or the first MiB, is 2 MiB
        // aligned, and is the largest usable piece.
        let (base, limit) = choose_iova_window(&[(0, u64::MAX)]).unwrap();
        assert_eq!(base, MSI_WINDOW_END_EXCLUSIVE.next_multiple_of(2 << 20));
        assert!(limit > 1 << 40);
        let (base, limit) = choose_iova_window(&[(0, 0xFFFF_FFFF)]).unwrap();
        assert_eq!((base, limit), (IOVA_FLOOR.next_multiple_of(2 << 20), MSI_WINDOW_START), "below MSI is larger");
        let (base, limit) = choose_iova_window(&[(0, MSI_WINDOW_START - 1), (MSI_WINDOW_END_EXCLUSIVE, (1 << 39) - 1)]).unwrap();
        assert!(base >= MSI_WINDOW_END_EXCLUSIVE && limit == 1 << 39);
        // Fallback without reported ranges: 39-bit space above the MSI window.
        assert_eq!(choose_iova_window(&[]).unwrap().1, 1 << 39);
        // Too small to be useful.
        assert_eq!(choose_iova_window(&[(0, 0x1F_FFFF)]), None);
        assert_eq!(choose_iova_window(&[(MSI_WINDOW_START, MSI_WINDOW_END_EXCLUSIVE - 1)]), None);
        for ranges in [&[(0x1234_5000u64, 0x2_0000_0fffu64)][..], &[(0xFE00_0000, 0xFFFF_FFFF)][..]] {
            if let Some((base, limit)) = choose_iova_window(ranges) {
                assert!(limit <= MSI_WINDOW_START || base >= MSI_WINDOW_END_EXCLUSIVE, "{base:#x}..{limit:#x}");
                assert_eq!(base % (2 << 20), 0);
                assert!(base >= ranges[0].0 && limit - 1 <= ranges[0].1);
            }
        }
    }
}
