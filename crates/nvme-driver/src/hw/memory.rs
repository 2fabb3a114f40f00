//! DMA memory: host pages, their device-visible addresses, and the only accessors allowed on them.
//!
//! A device writes DMA memory concurrently with the CPU, so no `&T` or `&[u8]` ever points into it.
//! Data moves by copying (`read`/`write`/`fill`/`copy_from`, whose callers own the range by
//! protocol: a buffer is read only after the completion that ends the device's access was
//! observed with Acquire ordering) or through atomic loads and stores (queue entries, phase tags,
//! ring indices).
//!
//! # The hazard the copies carry
//!
//! The copies are plain, non-atomic `memcpy`s, and they are safe functions: nothing in their
//! types stops a caller from copying a range while the other party is writing it (reading a
//! read buffer before its completion was reaped, refilling a write buffer while the command is
//! in flight, two clones of one region used from two threads). What such a caller gets depends
//! on who the other party is:
//!
//! - a PCIe device (VFIO): its DMA is outside the Rust abstract machine; the copy returns a mix
//!   of old and new bytes (torn data), which is wrong data but not undefined behaviour;
//! - the software controller (`nvme-emu`), or another thread of this process through a clone
//!   or [`DmaAllocator::translate`]: the other party is a Rust thread doing its own non-atomic
//!   copy, and two unsynchronised non-atomic accesses to the same bytes, one of them a write, are
//!   a data race — undefined behaviour in Rust's memory model, reachable from safe code.
//!
//! We accept that hole rather than hide it (openvmm's `MemoryBlock` makes the same trade):
//! making every copy atomic would forbid `memcpy`'s wide loads on the bulk data path, and the
//! protocol that prevents the race — the queue pair owns a buffer from submission until its
//! completion is reaped, the caller owns it otherwise — is kept by the driver's own paths and
//! checked by the conformance suite. That includes a command that timed out: its slot, and the
//! slot's scratch page (PRP list, SGL segment, DSM ranges), stay busy until its late completion
//! is reaped or a reset saw the controller stop; and the controller's Identify / log page
//! buffer is zeroed and read only while the admin queue is held with nothing in flight, so after
//! an admin timeout every admin command is refused (`NvmeError::QueueBusy`) until the late one
//! completes. Callers outside the driver must keep the protocol too, for the data buffers they
//! pass: after a timeout, the device may still read or write them.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use super::copied::{CopiedInner, CopiedMemory, CopiedRegion, DataRegion};
use super::mapper::{IdentityMapper, IommuMapper, MapObserver, ObservedIdentityMapper};
use super::shared::SharedMemory;
use super::{AddressSpaceId, DmaAllocator, HwError};
use crate::types::Iova;

/// The page size every DMA region is aligned to and rounded up to.
pub const PAGE_SIZE_BYTES: usize = 4096;
const HUGE_PAGE_SIZE_BYTES: usize = 2 << 20;

/// Whether an allocation of `len` bytes tries 2 MiB hugetlbfs pages first: only with
/// `prefer_huge`, and only from one huge page up.
///
/// Why the threshold: a hugetlbfs allocation is a whole number of huge pages, so a 4 KiB
/// scratch page, a shadow doorbell page or a 1 KiB admin CQ would each take a 2 MiB page (and a
/// 2 MiB IOMMU mapping) out of the reserved pool — about 6 MiB per I/O queue pair — and the KV
/// buffers the pool is reserved for would fall back to 4 KiB pages. What a huge page saves a
/// small allocation (a few IOMMU entries for rings and scratch that no bulk transfer streams
/// through) is worth less than the page. From 2 MiB up, less than half of what is taken is
/// rounding.
fn tries_huge_pages(len: usize, prefer_huge: bool) -> bool {
    prefer_huge && len >= HUGE_PAGE_SIZE_BYTES
}

/// The `mmap` flags of a resident private anonymous mapping of `kind` pages.
///
/// A hugetlbfs mapping names its page size (`MAP_HUGE_2MB`): without one the kernel takes the
/// default huge page size, 1 GiB on a host booted with `default_hugepagesz=1G` (common where
/// SPDK or DPDK run). A 2 MiB allocation then took a whole 1 GiB page, and Drop's `munmap` of
/// the 2 MiB recorded could not split it, so the page stayed mapped for good. Everything here
/// (rounding, IOVA alignment, the length Drop unmaps) assumes 2 MiB pages; where the 2 MiB pool
/// is empty the mapping fails and the allocation falls back to 4 KiB pages.
fn mmap_flags(kind: PageKind) -> libc::c_int {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE;
    match kind {
        PageKind::Huge2MiB => flags | libc::MAP_HUGETLB | libc::MAP_HUGE_2MB,
        PageKind::Small4KiB => flags,
    }
}

/// What backs a host allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageKind {
    /// 2 MiB hugetlbfs pages (fewer IOMMU entries, no TLB pressure).
    Huge2MiB,
    /// Ordinary 4 KiB pages.
    Small4KiB,
}

/// An anonymous, page-aligned host allocation, unmapped on drop.
#[derive(Debug)]
pub struct HostMemory {
    ptr: NonNull<u8>,
    len: usize,
    kind: PageKind,
}

// SAFETY: HostMemory owns its mapping exclusively; the pointer is only dereferenced through the
// accessors of DmaRegion, which are themselves safe to call from any thread.
unsafe impl Send for HostMemory {}
// SAFETY: as above; shared access goes through atomic or copying accessors only.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Allocates `len` bytes rounded up to a page, zeroed and resident. With `prefer_huge` and a
    /// `len` of 2 MiB or more, tries 2 MiB pages first (rounding up to a whole number of them;
    /// they need 2 MiB huge pages reserved: `vm.nr_hugepages` where 2 MiB is the default huge
    /// page size, `/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages` where it is not, see
    /// `mmap_flags`) and falls back to 4 KiB pages; smaller allocations
    /// always take 4 KiB pages (see `tries_huge_pages`). 4 KiB-page memory of 2 MiB or more
    /// starts on a 2 MiB boundary and asks the kernel for transparent huge pages (see
    /// `mmap_transparent_huge`).
    ///
    /// Resident (`MAP_POPULATE`): memory a device moves data into must be there before the first
    /// command, as VFIO's DMA map makes it by pinning. A lazily faulted page would cost its
    /// first toucher a fault inside the data path: the software controller's copies ran at half
    /// speed into engine KV blocks touched for the first time (docs/scheduler.md).
    pub fn allocate(len: usize, prefer_huge: bool) -> Result<Self, HwError> {
        if len == 0 {
            return Err(HwError::ZeroLength);
        }
        if let (true, Some(huge_len)) = (tries_huge_pages(len, prefer_huge), round_up(len, HUGE_PAGE_SIZE_BYTES)) {
            if let Ok(memory) = Self::mmap(huge_len, PageKind::Huge2MiB) {
                return Ok(memory);
            }
        }
        let kind = PageKind::Small4KiB;
        let small_len = round_up(len, PAGE_SIZE_BYTES).ok_or(HwError::Mmap {
            len,
            kind,
            source: std::io::Error::other("the length rounded up to a page overflows"),
        })?;
        Self::mmap(small_len, kind)
    }

    fn mmap(len: usize, kind: PageKind) -> Result<Self, HwError> {
        if kind == PageKind::Small4KiB && len >= HUGE_PAGE_SIZE_BYTES {
            return Self::mmap_transparent_huge(len);
        }
        let ptr = Self::map_anonymous(len, mmap_flags(kind), kind)?;
        Ok(Self { ptr, len, kind })
    }

    /// A fresh private read-write anonymous mapping of `len` bytes with `flags`; errors name
    /// `len` and `kind`.
    fn map_anonymous(len: usize, flags: libc::c_int, kind: PageKind) -> Result<NonNull<u8>, HwError> {
        // SAFETY: an anonymous mapping with a null hint has no preconditions; the result is
        // checked for MAP_FAILED before use.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(HwError::Mmap { len, kind, source: std::io::Error::last_os_error() });
        }
        NonNull::new(ptr.cast::<u8>()).ok_or(HwError::Mmap { len, kind, source: std::io::Error::other("mmap returned null") })
    }

    /// 4 KiB-page memory of at least 2 MiB that the kernel is asked to back with transparent
    /// 2 MiB pages (`MADV_HUGEPAGE`), starting on a 2 MiB boundary as those pages must, and
    /// made resident before it is returned (as `MAP_POPULATE` makes the rest).
    ///
    /// Why: physically contiguous memory is what a DMA engine and the block layer want. Into
    /// scattered 4 KiB pages a 1 MiB transfer is 256 segments; the development machine's virtio
    /// disk takes 254 per request, so the software controller's 1 MiB `O_DIRECT` transfers of
    /// host memory became two requests each (docs/nvme-emu.md, "Host memory in huge pages");
    /// under VFIO contiguous runs also take fewer IOMMU entries. Where transparent huge pages
    /// are off or none is free, the kernel gives 4 KiB pages: the same memory, without the gain.
    fn mmap_transparent_huge(len: usize) -> Result<Self, HwError> {
        let kind = PageKind::Small4KiB;
        let reserved_len = len.checked_add(HUGE_PAGE_SIZE_BYTES).ok_or(HwError::Mmap {
            len,
            kind,
            source: std::io::Error::other("length overflows with the 2 MiB alignment slack"),
        })?;
        let reserved = Self::map_anonymous(reserved_len, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, kind)?;
        // A mapping's address plus 2 MiB never overflows (user addresses end far below), and
        // if it did the mapping would be refused rather than misplaced.
        let Some(aligned) = round_up(reserved.as_ptr() as usize, HUGE_PAGE_SIZE_BYTES) else {
            // SAFETY: unmapping the mapping just made, which nothing else refers to.
            unsafe { libc::munmap(reserved.as_ptr().cast(), reserved_len) };
            return Err(HwError::Mmap { len, kind, source: std::io::Error::other("a 2 MiB-aligned start overflows") });
        };
        let head_len = aligned - reserved.as_ptr() as usize;
        let tail_len = reserved_len - head_len - len;
        // SAFETY: `head_len < HUGE_PAGE_SIZE_BYTES = reserved_len - len`, so the start stays
        // inside the mapping just made.
        let ptr = unsafe { reserved.add(head_len) };
        let start = ptr.as_ptr();
        // SAFETY: the head and the tail cut away are parts of the mapping just made that nothing
        // uses; what stays is exactly `start..start+len`, which Drop unmaps.
        unsafe {
            if head_len > 0 {
                libc::munmap(reserved.as_ptr().cast(), head_len);
            }
            if tail_len > 0 {
                libc::munmap(start.add(len).cast(), tail_len);
            }
        }
        // From here on dropping `memory` unmaps what stays.
        let memory = Self { ptr, len, kind };
        // SAFETY: advice on a mapping this function owns; it changes which pages back it, not
        // what it holds (zeroes). A kernel without transparent huge pages refuses, harmlessly.
        unsafe {
            libc::madvise(start.cast(), len, libc::MADV_HUGEPAGE);
        }
        // SAFETY: populating (write faults; the contents stay zero) a mapping this function owns.
        let populated = unsafe { libc::madvise(start.cast(), len, libc::MADV_POPULATE_WRITE) };
        if populated != 0 {
            let error = std::io::Error::last_os_error();
            if error.raw_os_error() != Some(libc::EINVAL) {
                // No memory for it.
                return Err(HwError::Mmap { len, kind, source: error });
            }
            // EINVAL: a kernel before 5.14 has no MADV_POPULATE_WRITE: touch each page.
            for offset in (0..len).step_by(PAGE_SIZE_BYTES) {
                // SAFETY: `offset < len`, inside the mapping; no device and no other thread has
                // the memory yet, and writing a zero leaves it as mapped (zeroed).
                unsafe { start.add(offset).write_volatile(0) };
            }
        }
        Ok(memory)
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn kind(&self) -> PageKind {
        self.kind
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe exactly the mapping created in `mmap` (or, in one test, a
        // start that is not page-aligned, which munmap refuses with EINVAL touching nothing),
        // and every DmaRegion that could access it holds an Arc to its owner, so none is alive
        // any more.
        let result = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if result != 0 {
            // Only a mapping that is not what `mmap` made can fail here (a huge page of another
            // size than the 2 MiB recorded, as before `mmap_flags` named the size). It stays
            // mapped for good: safe, since memory a device may have written is never reused
            // while mapped, but the leak is said, not hidden.
            let error = std::io::Error::last_os_error();
            tracing::error!(len = self.len, kind = ?self.kind, %error, "munmap of DMA host memory failed: the mapping is leaked");
        }
    }
}

pub(super) enum Backing {
    Owned(#[allow(dead_code)] HostMemory),
    External,
    /// A shared-memory mapping: the region keeps it mapped (see `shared.rs`, "Who unmaps").
    Shared(#[allow(dead_code)] Arc<SharedMemory>),
}

pub(super) struct RegionInner {
    ptr: NonNull<u8>,
    len: usize,
    iova: Iova,
    _backing: Backing,
    pool: Weak<PoolShared>,
    /// Set by the first [`DmaRegion::leak`] of any window onto this allocation, which reports
    /// its bytes; later leaks report 0 (the allocation is counted once).
    leaked: AtomicBool,
}

// SAFETY: the pointer refers to memory owned by (or, for external regions, guaranteed alive for)
// this RegionInner; all access goes through copying or atomic accessors.
unsafe impl Send for RegionInner {}
// SAFETY: as above.
unsafe impl Sync for RegionInner {}

impl Drop for RegionInner {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            if !pool.release(self.iova, self.len) {
                // The IOMMU may still translate the IOVA to these pages: freeing them would let
                // the device write into whatever reuses them (`IommuMapper::map`'s contract). The
                // backing is leaked with the IOVA range, for the rest of the process.
                let backing = std::mem::replace(&mut self._backing, Backing::External);
                if !matches!(backing, Backing::External) {
                    tracing::error!(iova = %self.iova, len = self.len, "IOMMU unmap failed; host memory behind the IOVA range leaked");
                }
                std::mem::forget(backing);
            }
        }
    }
}

/// A window onto DMA memory: device-visible address, length, and copying/atomic accessors.
///
/// Cloning is cheap and shares the memory; the mapping is removed when the last clone drops
/// (unless a clone was [leaked](DmaRegion::leak)). The copying accessors carry a hazard that
/// their safe signatures do not show: see the module documentation.
#[derive(Clone)]
pub struct DmaRegion {
    inner: Arc<RegionInner>,
    offset: usize,
    len: usize,
    /// `inner.iova + offset`, computed (checked) when the window is made.
    iova: Iova,
}

impl std::fmt::Debug for DmaRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaRegion").field("iova", &self.iova()).field("len", &self.len).finish()
    }
}

impl DmaRegion {
    /// Device-visible address of the first byte of this window.
    #[inline]
    pub fn iova(&self) -> Iova {
        self.iova
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The host virtual address of the first byte, as an integer: for registering the memory
    /// with another agent (e.g. `cuMemHostRegister`). Never dereference it in Rust.
    #[inline]
    pub fn host_address(&self) -> usize {
        self.inner.ptr.as_ptr() as usize + self.offset
    }

    /// A sub-window `offset..offset+len` of this region.
    pub fn subregion(&self, offset: usize, len: usize) -> Result<DmaRegion, HwError> {
        self.check(offset, len, 1)?;
        // Inside the region (checked above), so neither sum can overflow; checked all the same.
        let out_of_range = || HwError::OutOfRange { offset, access_len: len, region_len: self.len };
        let iova = self.iova.checked_add_usize(offset).ok_or_else(out_of_range)?;
        let inner_offset = self.offset.checked_add(offset).ok_or_else(out_of_range)?;
        Ok(DmaRegion { inner: Arc::clone(&self.inner), offset: inner_offset, len, iova })
    }

    #[inline]
    fn check(&self, offset: usize, len: usize, align: usize) -> Result<(), HwError> {
        let end = offset.checked_add(len);
        if end.is_none_or(|end| end > self.len) {
            return Err(HwError::OutOfRange { offset, access_len: len, region_len: self.len });
        }
        if !(self.host_address() + offset).is_multiple_of(align) {
            return Err(HwError::Misaligned { offset, align });
        }
        Ok(())
    }

    #[inline]
    fn pointer(&self, offset: usize) -> *mut u8 {
        // SAFETY: callers have checked `offset + access <= len` (with `check`, or `prefetch`'s own
        // bound), so the result stays inside the allocation this region refers to.
        unsafe { self.inner.ptr.as_ptr().add(self.offset + offset) }
    }

    /// Copies `destination.len()` bytes out of the region with a plain (non-atomic) copy.
    ///
    /// Correct only while nobody else writes the range: e.g. a read buffer after its completion
    /// was reaped, or a completion entry after its phase tag was loaded with Acquire ordering.
    /// Nothing enforces that; a caller that breaks it races with the device — torn bytes from
    /// hardware, undefined behaviour against the software controller. See the module
    /// documentation, "The hazard the copies carry".
    #[inline]
    pub fn read(&self, offset: usize, destination: &mut [u8]) -> Result<(), HwError> {
        self.check(offset, destination.len(), 1)?;
        // SAFETY: the range is inside the live allocation (checked above) and cannot overlap
        // `destination`, which is ordinary Rust memory. This does NOT exclude a concurrent
        // writer of the range: that is the caller's protocol, not a guarantee (module docs).
        unsafe {
            std::ptr::copy_nonoverlapping(self.pointer(offset), destination.as_mut_ptr(), destination.len());
        }
        Ok(())
    }

    /// Copies `source` into the region with a plain copy. Correct only while nobody else reads
    /// or writes the range (a buffer not referenced by any command in flight, an SQ slot the
    /// controller has not been told about); the same unenforced hazard as [`DmaRegion::read`].
    #[inline]
    pub fn write(&self, offset: usize, source: &[u8]) -> Result<(), HwError> {
        self.check(offset, source.len(), 1)?;
        // SAFETY: in bounds of the live allocation (checked above), non-overlapping with
        // `source`. A concurrent reader or writer of the range is excluded only by the caller's
        // protocol (module docs), not by this function.
        unsafe {
            std::ptr::copy_nonoverlapping(source.as_ptr(), self.pointer(offset), source.len());
        }
        Ok(())
    }

    /// Copies one 64-byte submission entry into the region at `offset` (16-byte aligned; SQ
    /// slots are 64) with non-temporal stores where the target has them: the line goes to
    /// memory without first being read for ownership, so writing a slot the device (or a
    /// software controller on another CPU) read last does not wait for that line to come back.
    /// SPDK copies its commands the same way. The stores are weakly ordered: the caller must
    /// issue [`crate::hw::fence_before_submission_doorbell`] before it tells the device about
    /// the entry. The same unenforced hazard as [`DmaRegion::write`].
    #[inline]
    pub fn write_entry_streaming(&self, offset: usize, entry: &[u8; 64]) -> Result<(), HwError> {
        self.check(offset, entry.len(), 16)?;
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
            let destination = self.pointer(offset).cast::<__m128i>();
            let source = entry.as_ptr().cast::<__m128i>();
            // Concurrent access to the range is excluded only by the caller's protocol (module
            // docs); SSE2 is part of the x86_64 baseline.
            // SAFETY: `destination` is 16-byte aligned and in bounds (checked above), so the four
            // 16-byte stores are aligned and inside the live allocation; `source` is 64 bytes.
            unsafe {
                for index in 0..4 {
                    _mm_stream_si128(destination.add(index), _mm_loadu_si128(source.add(index)));
                }
            }
            Ok(())
        }
        #[cfg(not(target_arch = "x86_64"))]
        self.write(offset, entry)
    }

    /// Asks the CPU to start bringing the cache lines of `offset..offset + len` toward this core,
    /// without waiting for them and without reading anything into Rust: a hint, which the CPU may
    /// drop. The part of the range outside the region is ignored. For completion entries about
    /// to be read in a row (each miss would otherwise be waited for in turn). x86_64 only; a
    /// no-op elsewhere.
    #[inline]
    pub fn prefetch(&self, offset: usize, len: usize) {
        let end = offset.saturating_add(len).min(self.len);
        if offset >= end {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        for within in prefetch_offsets(self.host_address(), offset, end) {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            // `within < end <= self.len` (`prefetch_offsets`) is the bound `pointer` relies on,
            // established here rather than by `check`. SSE is part of the x86_64 baseline.
            // SAFETY: the address is inside the live allocation; a prefetch reads nothing into
            // the program and cannot fault, so a concurrent writer of the line is no data race.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(self.pointer(within).cast_const().cast()) };
        }
    }

    /// Sets `len` bytes at `offset` to `byte` with plain stores; the same unenforced hazard as
    /// [`DmaRegion::write`].
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<(), HwError> {
        self.check(offset, len, 1)?;
        // SAFETY: in bounds of the live allocation (checked above). A concurrent access to the
        // range is excluded only by the caller's protocol (module docs).
        unsafe {
            std::ptr::write_bytes(self.pointer(offset), byte, len);
        }
        Ok(())
    }

    /// Copies `len` bytes from `source` at `source_offset` into this region at `offset`
    /// (the software controller's DMA between two regions, without a bounce buffer). Plain
    /// copies on both sides: the hazard of [`DmaRegion::read`] and [`DmaRegion::write`] at once.
    pub fn copy_from(&self, offset: usize, source: &DmaRegion, source_offset: usize, len: usize) -> Result<(), HwError> {
        self.check(offset, len, 1)?;
        source.check(source_offset, len, 1)?;
        // SAFETY: both ranges are in bounds of live allocations (checked above); `copy`
        // tolerates overlap in case both windows view the same memory. Concurrent access to
        // either range is excluded only by the DMA protocol (module docs).
        unsafe {
            std::ptr::copy(source.pointer(source_offset), self.pointer(offset), len);
        }
        Ok(())
    }

    /// Gives up this handle without ever freeing what it refers to: the memory stays mapped
    /// and its IOVA range stays reserved for the rest of the process, even after every other
    /// clone is dropped. For memory a device may still write (a queue whose deletion failed, a
    /// controller that could not be disabled): freeing it would let the device write into
    /// whatever reuses the memory or the IOVA. For an external mapping ([`DmaAllocator::map_external`])
    /// only the mapping is kept; the caller still owns the memory behind it and must keep it
    /// too.
    ///
    /// Returns the bytes this call newly leaked, for the caller's accounting: what is kept is the
    /// whole allocation this window belongs to, not just the window (a 4 KiB sub-window of a
    /// 64 KiB allocation pins the 64 KiB; an allocation in huge pages, 2 MiB or more, is a
    /// whole number of them), so the first leak of any window onto an allocation reports the
    /// allocation's length and later ones report 0. Summing the results of several leaks counts
    /// each allocation once.
    pub fn leak(self) -> usize {
        let first = !self.inner.leaked.swap(true, Ordering::Relaxed);
        let bytes = if first { self.inner.len } else { 0 };
        std::mem::forget(self);
        bytes
    }

    pub fn load_u16(&self, offset: usize, order: Ordering) -> Result<u16, HwError> {
        self.check(offset, 2, 2)?;
        // SAFETY: in bounds and 2-byte aligned (checked); the memory lives as long as `self`;
        // an atomic view is valid for memory another agent accesses concurrently.
        Ok(unsafe { AtomicU16::from_ptr(self.pointer(offset).cast()) }.load(order))
    }

    pub fn store_u16(&self, offset: usize, value: u16, order: Ordering) -> Result<(), HwError> {
        self.check(offset, 2, 2)?;
        // SAFETY: as in `load_u16`.
        unsafe { AtomicU16::from_ptr(self.pointer(offset).cast()) }.store(value, order);
        Ok(())
    }

    #[inline]
    pub fn load_u32(&self, offset: usize, order: Ordering) -> Result<u32, HwError> {
        self.check(offset, 4, 4)?;
        // SAFETY: in bounds and 4-byte aligned (checked); atomic access to shared memory.
        Ok(unsafe { AtomicU32::from_ptr(self.pointer(offset).cast()) }.load(order))
    }

    #[inline]
    pub fn store_u32(&self, offset: usize, value: u32, order: Ordering) -> Result<(), HwError> {
        self.check(offset, 4, 4)?;
        // SAFETY: as in `load_u32`.
        unsafe { AtomicU32::from_ptr(self.pointer(offset).cast()) }.store(value, order);
        Ok(())
    }

    pub fn fetch_add_u32(&self, offset: usize, value: u32, order: Ordering) -> Result<u32, HwError> {
        self.check(offset, 4, 4)?;
        // SAFETY: as in `load_u32`.
        Ok(unsafe { AtomicU32::from_ptr(self.pointer(offset).cast()) }.fetch_add(value, order))
    }

    pub fn load_u64(&self, offset: usize, order: Ordering) -> Result<u64, HwError> {
        self.check(offset, 8, 8)?;
        // SAFETY: in bounds and 8-byte aligned (checked); atomic access to shared memory.
        Ok(unsafe { AtomicU64::from_ptr(self.pointer(offset).cast()) }.load(order))
    }

    pub fn store_u64(&self, offset: usize, value: u64, order: Ordering) -> Result<(), HwError> {
        self.check(offset, 8, 8)?;
        // SAFETY: as in `load_u64`.
        unsafe { AtomicU64::from_ptr(self.pointer(offset).cast()) }.store(value, order);
        Ok(())
    }
}

/// `value` rounded up to a multiple of `to` (non-zero); `None` when that does not fit in a usize
/// (a caller-supplied length near `usize::MAX`: wrapping would make it 0).
pub(super) fn round_up(value: usize, to: usize) -> Option<usize> {
    value.checked_next_multiple_of(to)
}

/// A test's hook into [`PoolShared::release`] (see `after_give_back`).
#[cfg(test)]
type ReleaseHook = Arc<dyn Fn(Iova) + Send + Sync>;

/// IOVA bookkeeping shared by a pool and its regions (regions release their range on drop).
///
/// # Locks and strong references
///
/// No strong reference to a region (`Arc<RegionInner>`, `Arc<CopiedInner>`) may be dropped
/// while `table`, `copied` or `state` is locked: if it was the last one, the region's `Drop`
/// releases its range, which takes `table` (or `copied`) for writing and then `state` on the
/// same thread. std's locks are not reentrant: that thread would deadlock on itself, and every
/// later translation, allocation and drop on the pool would hang behind it. So a lookup
/// upgrades its `Weak` inside a block that ends the guard before any check that can return.
pub(super) struct PoolShared {
    mapper: Arc<dyn IommuMapper>,
    state: Mutex<IovaState>,
    /// Every live mapping by start IOVA: the translation table devices without an IOMMU of their
    /// own (the software controller) use, and how upper layers validate descriptors.
    table: RwLock<BTreeMap<u64, Weak<RegionInner>>>,
    /// Memory reached only by copies, by start IOVA (IOVAs from the same allocator as the
    /// table's, so the two never overlap); see `copied.rs`.
    copied: RwLock<BTreeMap<u64, Weak<CopiedInner>>>,
    /// Called by [`PoolShared::release`] once the range is back in the allocator, before the
    /// release returns: lets a test act in that window (another thread reusing the range).
    #[cfg(test)]
    after_give_back: Mutex<Option<ReleaseHook>>,
}

/// The IOVA allocator: `base..next` has been handed out at some time, `next..limit` never.
///
/// Invariants (kept by [`IovaState::give_back`]): free ranges never overlap or touch (a freed
/// range merges with both neighbours), and none ends at `next` (it is folded back into the
/// untouched space instead). Without them a pool whose windows come and go in different sizes
/// (tuttid maps every client's window into the device pool) fragments until a new window finds
/// no room though most of the space is free.
struct IovaState {
    next: u64,
    limit: u64,
    /// Freed ranges below `next`: start -> length.
    free: BTreeMap<u64, u64>,
}

impl IovaState {
    /// Returns `start..start+len` (below `next`, reserved) to the free ranges, merged with its
    /// neighbours and with the untouched space when it reaches `next`.
    fn give_back(&mut self, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        let (mut merged_start, mut merged_end) = (start, start.saturating_add(len));
        if let Some((&before_start, &before_len)) = self.free.range(..start).next_back() {
            debug_assert!(before_start + before_len <= start, "freed range {start:#x}+{len:#x} overlaps a free range");
            if before_start + before_len == start {
                self.free.remove(&before_start);
                merged_start = before_start;
            }
        }
        if let Some(after_len) = self.free.remove(&merged_end) {
            merged_end += after_len;
        }
        if merged_end == self.next {
            self.next = merged_start;
        } else {
            self.free.insert(merged_start, merged_end - merged_start);
        }
    }
}

impl PoolShared {
    /// Reserves `len` bytes at a multiple of `align` (a power of two): the smallest freed range
    /// that holds them (best fit, so large ranges stay whole for large requests), else fresh
    /// space at `next`. What an alignment skips stays free.
    ///
    /// The scan is linear in the number of free ranges, which merging keeps below the number of
    /// live regions; reservations happen when memory is mapped, not per command.
    pub(super) fn reserve(&self, len: u64, align: u64) -> Result<u64, HwError> {
        let exhausted = HwError::IovaExhausted { len: len as usize };
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let fits = |(&start, &free_len): (&u64, &u64)| {
            let aligned = start.checked_next_multiple_of(align)?;
            let end = aligned.checked_add(len)?;
            (end <= start + free_len).then_some((free_len, start, aligned))
        };
        if let Some((free_len, start, aligned)) = state.free.iter().filter_map(fits).min() {
            state.free.remove(&start);
            if aligned > start {
                state.free.insert(start, aligned - start);
            }
            let (end, free_end) = (aligned + len, start + free_len);
            if free_end > end {
                state.free.insert(end, free_end - end);
            }
            return Ok(aligned);
        }
        let (next, limit) = (state.next, state.limit);
        let start = next.checked_next_multiple_of(align).ok_or(exhausted)?;
        let end = start.checked_add(len).filter(|&end| end <= limit);
        let Some(end) = end else {
            return Err(HwError::IovaExhausted { len: len as usize });
        };
        state.next = end;
        // The skipped gap ends at `start`, below the new `next`: it stays a free range.
        state.give_back(next, start - next);
        Ok(start)
    }

    /// Reserves exactly `start..start+len` (a fixed mapping, e.g. memory inside a client's DMA
    /// window whose IOVA follows from its place in the window). Refused with
    /// [`HwError::Overlap`] when any part of it is already reserved: it must lie wholly inside
    /// one free range or wholly in the untouched space. (Free ranges are merged and never end
    /// at the untouched space, so a range that straddles the two overlaps a reservation.)
    pub(super) fn reserve_exact(&self, start: u64, len: u64) -> Result<(), HwError> {
        let overlap = HwError::Overlap { iova: Iova(start), len: len as usize };
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let end = start.checked_add(len).filter(|&end| end <= state.limit).ok_or(HwError::IovaExhausted { len: len as usize })?;
        if start >= state.next {
            let gap_start = state.next;
            state.next = end;
            state.give_back(gap_start, start - gap_start);
            return Ok(());
        }
        let containing = state.free.range(..=start).next_back().map(|(&free_start, &free_len)| (free_start, free_len));
        let Some((free_start, free_len)) = containing.filter(|&(free_start, free_len)| end <= free_start + free_len) else {
            return Err(overlap);
        };
        state.free.remove(&free_start);
        if start > free_start {
            state.free.insert(free_start, start - free_start);
        }
        if free_start + free_len > end {
            state.free.insert(end, free_start + free_len - end);
        }
        Ok(())
    }

    /// Makes a region of `ptr..ptr+len` at an `iova` already reserved, and enters it in the table.
    pub(super) fn insert(self: &Arc<Self>, ptr: NonNull<u8>, len: usize, iova: Iova, backing: Backing) -> DmaRegion {
        let inner = Arc::new(RegionInner { ptr, len, iova, _backing: backing, pool: Arc::downgrade(self), leaked: AtomicBool::new(false) });
        self.table.write().unwrap_or_else(|poisoned| poisoned.into_inner()).insert(iova.0, Arc::downgrade(&inner));
        DmaRegion { inner, offset: 0, len, iova }
    }

    /// Gives back a reserved range that never became a region.
    pub(super) fn unreserve(&self, iova: u64, len: u64) {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).give_back(iova, len);
    }

    pub(super) fn translate(&self, iova: Iova, len: usize) -> Result<DmaRegion, HwError> {
        // The read guard ends inside this block, before `inner` can drop (see `PoolShared`,
        // "Locks and strong references").
        let inner = {
            let table = self.table.read().unwrap_or_else(|poisoned| poisoned.into_inner());
            let (_, weak) = table.range(..=iova.0).next_back().ok_or(HwError::Unmapped { iova, len })?;
            weak.upgrade().ok_or(HwError::Unmapped { iova, len })?
        };
        let offset =
            iova.checked_offset_from(inner.iova).and_then(|offset| usize::try_from(offset).ok()).ok_or(HwError::Unmapped { iova, len })?;
        let end = offset.checked_add(len).ok_or(HwError::Unmapped { iova, len })?;
        if end > inner.len {
            return Err(HwError::Unmapped { iova, len });
        }
        let (region_len, region_iova) = (inner.len, inner.iova);
        DmaRegion { inner, offset: 0, len: region_len, iova: region_iova }.subregion(offset, len)
    }

    pub(super) fn new(mapper: Arc<dyn IommuMapper>, iova_base: Iova, iova_limit: Iova) -> Self {
        PoolShared {
            mapper,
            state: Mutex::new(IovaState { next: iova_base.0, limit: iova_limit.0, free: BTreeMap::new() }),
            table: RwLock::new(BTreeMap::new()),
            copied: RwLock::new(BTreeMap::new()),
            #[cfg(test)]
            after_give_back: Mutex::new(None),
        }
    }

    /// Gives `memory` a fresh IOVA range and enters it in the copied table.
    pub(super) fn insert_copied(self: &Arc<Self>, memory: Arc<dyn CopiedMemory>) -> Result<CopiedRegion, HwError> {
        let len = memory.len();
        if len == 0 {
            return Err(HwError::ZeroLength);
        }
        let align = if len >= HUGE_PAGE_SIZE_BYTES { HUGE_PAGE_SIZE_BYTES } else { PAGE_SIZE_BYTES };
        let rounded = round_up(len, PAGE_SIZE_BYTES).ok_or(HwError::IovaExhausted { len })?;
        let iova = Iova(self.reserve(rounded as u64, align as u64)?);
        let inner = Arc::new(CopiedInner { memory, iova, len, pool: Arc::downgrade(self) });
        self.copied.write().unwrap_or_else(|poisoned| poisoned.into_inner()).insert(iova.0, Arc::downgrade(&inner));
        Ok(CopiedRegion { inner, offset: 0, len, iova })
    }

    /// The copied mapping that contains `iova..iova+len`, as a window of exactly that range.
    pub(super) fn translate_copied(&self, iova: Iova, len: usize) -> Result<CopiedRegion, HwError> {
        let unmapped = || HwError::Unmapped { iova, len };
        // As in `translate`: no strong reference may drop while the table is locked.
        let inner = {
            let table = self.copied.read().unwrap_or_else(|poisoned| poisoned.into_inner());
            let (_, weak) = table.range(..=iova.0).next_back().ok_or_else(unmapped)?;
            weak.upgrade().ok_or_else(unmapped)?
        };
        let offset = iova.checked_offset_from(inner.iova).and_then(|offset| usize::try_from(offset).ok()).ok_or_else(unmapped)?;
        if offset.checked_add(len).is_none_or(|end| end > inner.len) {
            return Err(unmapped());
        }
        let (whole_len, whole_iova) = (inner.len, inner.iova);
        CopiedRegion { inner, offset: 0, len: whole_len, iova: whole_iova }.subregion(offset, len)
    }

    /// A copied mapping's last holder dropped: its IOVA range goes back (nothing was
    /// programmed anywhere, so there is nothing to unmap).
    pub(super) fn release_copied(&self, iova: Iova, len: usize) {
        let mut table = self.copied.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        if table.get(&iova.0).is_some_and(|weak| weak.strong_count() == 0) {
            table.remove(&iova.0);
        }
        drop(table);
        // `insert_copied` reserved exactly this rounding of `len`, so it fits.
        self.unreserve(iova.0, round_up(len, PAGE_SIZE_BYTES).unwrap_or(len) as u64);
    }

    /// Runs the test hook set in `after_give_back`, if any (outside its own lock).
    #[cfg(test)]
    fn run_after_give_back(&self, iova: Iova) {
        let hook = self.after_give_back.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
        if let Some(hook) = hook {
            hook(iova);
        }
    }

    /// Unmaps a region whose last holder dropped; false when the unmap failed, in which case the
    /// IOVA range stays reserved and the caller must keep the host memory mapped too.
    ///
    /// The dead entry leaves the table before the range goes back to the allocator (as in
    /// `release_copied`): once it is back, a new region may start below the dead entry's key
    /// and cover it (freed ranges merge, best fit), and a translation in it would find the dead
    /// entry (the largest start at or below it) and answer Unmapped for mapped memory. No strong
    /// reference drops under the table lock here: the entry is a `Weak` whose region is gone.
    fn release(&self, iova: Iova, len: usize) -> bool {
        let mut table = self.table.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        if table.get(&iova.0).is_some_and(|weak| weak.strong_count() == 0) {
            table.remove(&iova.0);
        }
        drop(table);
        match self.mapper.unmap(iova, len) {
            Err(error) => {
                // The range stays reserved: reusing an IOVA whose unmap failed could alias memory.
                tracing::error!(%iova, len, %error, "IOMMU unmap failed; IOVA range leaked");
                false
            }
            Ok(()) => {
                self.unreserve(iova.0, len as u64);
                #[cfg(test)]
                self.run_after_give_back(iova);
                true
            }
        }
    }
}

/// The standard [`DmaAllocator`]: host pages (2 MiB ones for allocations of 2 MiB or more when
/// reservable), IOVAs from a simple allocator inside `[base, limit)`, programmed through an
/// [`IommuMapper`].
#[derive(Clone)]
pub struct DmaPool {
    shared: Arc<PoolShared>,
    prefer_huge: bool,
}

impl DmaPool {
    /// A pool handing out IOVAs in `[iova_base, iova_limit)`.
    pub fn new(mapper: Arc<dyn IommuMapper>, iova_base: Iova, iova_limit: Iova, prefer_huge: bool) -> Self {
        Self { shared: Arc::new(PoolShared::new(mapper, iova_base, iova_limit)), prefer_huge }
    }

    /// A pool for a device that translates through [`DmaAllocator::translate`] itself.
    pub fn identity() -> Self {
        // Start away from zero so that a zeroed descriptor never names valid memory.
        Self::new(Arc::new(IdentityMapper), Iova(1 << 32), Iova(1 << 48), false)
    }

    /// [`DmaPool::identity`] whose every mapping is first reported to `observer` (which must
    /// not allocate from this pool).
    pub fn identity_observed(observer: MapObserver) -> Self {
        Self::new(Arc::new(ObservedIdentityMapper { observer }), Iova(1 << 32), Iova(1 << 48), false)
    }

    fn register(&self, ptr: NonNull<u8>, len: usize, backing: Backing) -> Result<DmaRegion, HwError> {
        let align = if len >= HUGE_PAGE_SIZE_BYTES { HUGE_PAGE_SIZE_BYTES } else { PAGE_SIZE_BYTES } as u64;
        let iova = Iova(self.shared.reserve(len as u64, align)?);
        // SAFETY: `ptr..ptr+len` is either memory owned by `backing` (kept alive by the region
        // until after unmap in RegionInner::drop, and leaked with the IOVA range if that unmap
        // fails) or external memory whose lifetime the caller of
        // `map_external` guaranteed.
        if let Err(error) = unsafe { self.shared.mapper.map(ptr.as_ptr(), len, iova) } {
            self.shared.unreserve(iova.0, len as u64);
            return Err(error);
        }
        Ok(self.shared.insert(ptr, len, iova, backing))
    }
}

impl DmaAllocator for DmaPool {
    fn allocate(&self, len: usize) -> Result<DmaRegion, HwError> {
        let memory = HostMemory::allocate(len, self.prefer_huge)?;
        let ptr = memory.ptr;
        let mapped_len = memory.len;
        let region = self.register(ptr, mapped_len, Backing::Owned(memory))?;
        // `memory` holds at least `len` rounded up to a page, so the rounding fits.
        region.subregion(0, round_up(len, PAGE_SIZE_BYTES).unwrap_or(mapped_len))
    }

    unsafe fn map_external(&self, host: *mut u8, len: usize) -> Result<DmaRegion, HwError> {
        if len == 0 {
            return Err(HwError::ZeroLength);
        }
        let ptr = NonNull::new(host).ok_or(HwError::Misaligned { offset: 0, align: PAGE_SIZE_BYTES })?;
        if !(host as usize).is_multiple_of(PAGE_SIZE_BYTES) {
            return Err(HwError::Misaligned { offset: 0, align: PAGE_SIZE_BYTES });
        }
        self.register(ptr, len, Backing::External)
    }

    fn address_space(&self) -> AddressSpaceId {
        // Clones of a pool share `shared` (one IOVA allocator and table): its address is the id.
        AddressSpaceId(Arc::as_ptr(&self.shared) as u64)
    }

    fn translate(&self, iova: Iova, len: usize) -> Result<DmaRegion, HwError> {
        self.shared.translate(iova, len)
    }

    fn map_shared(&self, memory: &Arc<SharedMemory>) -> Result<DmaRegion, HwError> {
        // The region holds an Arc to the mapping, so it stays mapped while the device may use it.
        self.register(memory.pointer(), memory.len(), Backing::Shared(Arc::clone(memory)))
    }

    fn map_copied(&self, memory: Arc<dyn CopiedMemory>) -> Result<CopiedRegion, HwError> {
        if !self.shared.mapper.device_translates() {
            return Err(HwError::CopiedUnsupported { allocator: "a DMA pool programmed through an IOMMU (VFIO)" });
        }
        self.shared.insert_copied(memory)
    }

    fn translate_data(&self, iova: Iova, len: usize) -> Result<DataRegion, HwError> {
        match self.shared.translate(iova, len) {
            Ok(region) => Ok(DataRegion::Host(region)),
            Err(host_error) => self.shared.translate_copied(iova, len).map(DataRegion::Copied).map_err(|_| host_error),
        }
    }
}

/// The offsets in a region at host address `base` that [`DmaRegion::prefetch`] touches for
/// `offset..end` (`offset < end`): one in every cache line the range meets, from the start of
/// the line holding `offset` (the region's first byte standing in for a line start before the
/// region), so the last line is not missed when the range starts mid-line. Each is `< end`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn prefetch_offsets(base: usize, offset: usize, end: usize) -> impl Iterator<Item = usize> {
    const LINE_BYTES: usize = 64;
    let first_line = (base + offset) & !(LINE_BYTES - 1);
    (first_line..base + end).step_by(LINE_BYTES).map(move |line| line.max(base) - base)
}

#[cfg(test)]
mod tests;
