//! Memory shared with another agent (executor threads, a GPU, an NVMe controller): the only module
//! of gio-uring with `unsafe` code.
//!
//! Another agent may write any byte of a [`SharedRegion`] at any time, so Rust must never hold a
//! reference (`&T` / `&mut T`) into it: the compiler would assume the bytes cannot change. Every
//! access is a single atomic load, store or read-modify-write of a naturally aligned 1-, 2-, 4- or
//! 8-byte location, built with `Atomic*::from_ptr` for the duration of that one access. Fields
//! that are read while another agent may write them (ring heads and tails, an IOCB's executor
//! line, CQ entries) are always accessed with their own width, here and on the GPU side
//! (`volatile`/atomic operations of the same width, kernels/).
//!
//! One exception: [`SharedRegion::store_u64_array`] writes IOCTX records as 8-byte words that
//! span narrower fields, which executors then read field by field (4, 2 and 1 bytes, on the CPU
//! and the GPU). Mixed-size atomic accesses to one location are sound only when they do not
//! race, and these do not: a record is written only while its IOCB is not in flight (`fill_iocb`
//! refuses an IOCB in flight), and every read happens after that write: the executor reads it
//! after acquiring the SQ tail whose Release store published the issue (or after receiving the
//! IOCB over a channel from the thread that did, or on the filling thread itself, in
//! `prepared`); a kernel launch is ordered after the host writes that precede it.
//!
//! Offsets come from [`crate::layout`], computed from validated configuration. Some derive from
//! values read back from shared memory (an SQ entry's IOCB id, an IOCB's `ioctx_first` and
//! `ioctx_count`): the executors check those first (`sq_entry`, the SQ-entry checks of the CPU
//! executors, [`crate::layout::QueueMemory::read_issued_header`]) and refuse a bad one with an
//! error. An offset out of bounds or misaligned that still reaches this module is a bug in this
//! crate and panics before any memory is touched.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};

use crate::error::GioError;

/// Alignment of host-allocated regions: a page, so that a region can later be registered with a
/// GPU (`cuMemHostRegister`) or an IOMMU mapping, both of which work in pages.
pub const REGION_ALIGN_BYTES: usize = 4096;

/// Who frees the memory of a region.
#[derive(Debug)]
enum Owner {
    /// Allocated by [`SharedRegion::allocate_host`] with this layout.
    Host(Layout),
    /// Owned by someone else (a CUDA host allocation, a mapped BAR); see [`SharedRegion::from_raw`].
    External,
}

/// A contiguous block of memory that both this process and another agent read and write.
#[derive(Debug)]
pub struct SharedRegion {
    base: NonNull<u8>,
    len_bytes: usize,
    owner: Owner,
}

// SAFETY: a SharedRegion is a pointer to memory that is only ever accessed through atomic
// operations (see the module documentation), which are safe to perform from any thread; the region
// does not contain thread-affine state.
unsafe impl Send for SharedRegion {}
// SAFETY: as for Send: concurrent `&SharedRegion` users only perform atomic accesses.
unsafe impl Sync for SharedRegion {}

impl SharedRegion {
    /// Allocates `len_bytes` of zeroed, page-aligned host memory.
    pub fn allocate_host(len_bytes: usize) -> Result<Self, GioError> {
        if len_bytes == 0 {
            return Err(GioError::OutOfMemory { len_bytes });
        }
        let layout = Layout::from_size_align(len_bytes, REGION_ALIGN_BYTES).map_err(|_| GioError::OutOfMemory { len_bytes })?;
        // SAFETY: `layout` has a non-zero size (checked above), as `alloc_zeroed` requires.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let base = NonNull::new(raw).ok_or(GioError::OutOfMemory { len_bytes })?;
        Ok(Self { base, len_bytes, owner: Owner::Host(layout) })
    }

    /// Wraps memory owned elsewhere, e.g. a `cuMemHostAlloc` allocation mapped into the GPU.
    ///
    /// # Safety
    /// - `base` must be valid for reads and writes of `len_bytes` bytes for the whole life of the
    ///   returned region, and aligned to at least 8 bytes;
    /// - every other agent must access the memory only with atomic or volatile accesses of the
    ///   field widths defined in `kernels/gio_abi.h`;
    /// - the owner must not free or unmap it before the region is dropped; dropping the region does
    ///   not free it.
    pub unsafe fn from_raw(base: NonNull<u8>, len_bytes: usize) -> Self {
        Self { base, len_bytes, owner: Owner::External }
    }

    /// Size of the region.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The process virtual address of the first byte, for registering the region with a device
    /// (a host address is the device address for executors running on the CPU).
    pub fn host_address(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    /// Pointer to a field of `size_bytes` at `offset_bytes`, after checking bounds and alignment.
    fn field(&self, offset_bytes: usize, size_bytes: usize) -> *mut u8 {
        self.span(offset_bytes, size_bytes, size_bytes)
    }

    /// Pointer to `len_bytes` at `offset_bytes`, after checking bounds and `align_bytes` alignment.
    #[inline]
    fn span(&self, offset_bytes: usize, len_bytes: usize, align_bytes: usize) -> *mut u8 {
        let end = offset_bytes.checked_add(len_bytes);
        assert!(
            end.is_some_and(|end| end <= self.len_bytes),
            "shared field {offset_bytes}+{len_bytes} outside region of {} bytes",
            self.len_bytes
        );
        assert!(offset_bytes.is_multiple_of(align_bytes), "shared field at {offset_bytes} not aligned to {align_bytes}");
        // SAFETY: offset_bytes + len_bytes <= len_bytes of the region (asserted above), so the result stays
        // inside the allocation that `base` points to.
        unsafe { self.base.as_ptr().add(offset_bytes) }
    }

    pub fn load_u8(&self, offset_bytes: usize, order: Ordering) -> u8 {
        let ptr = self.field(offset_bytes, 1);
        // SAFETY: `ptr` is in bounds for 1 byte (checked by `field`), valid for the life of self,
        // and only accessed atomically (module invariant).
        unsafe { AtomicU8::from_ptr(ptr) }.load(order)
    }

    pub fn store_u8(&self, offset_bytes: usize, value: u8, order: Ordering) {
        let ptr = self.field(offset_bytes, 1);
        // SAFETY: as in `load_u8`.
        unsafe { AtomicU8::from_ptr(ptr) }.store(value, order);
    }

    pub fn load_u16(&self, offset_bytes: usize, order: Ordering) -> u16 {
        let ptr = self.field(offset_bytes, 2).cast::<u16>();
        // SAFETY: `ptr` is in bounds and 2-byte aligned (checked by `field`; the base is page
        // aligned or at least 8-aligned per `from_raw`), and only accessed atomically.
        unsafe { AtomicU16::from_ptr(ptr) }.load(order)
    }

    pub fn store_u16(&self, offset_bytes: usize, value: u16, order: Ordering) {
        let ptr = self.field(offset_bytes, 2).cast::<u16>();
        // SAFETY: as in `load_u16`.
        unsafe { AtomicU16::from_ptr(ptr) }.store(value, order);
    }

    pub fn load_u32(&self, offset_bytes: usize, order: Ordering) -> u32 {
        let ptr = self.field(offset_bytes, 4).cast::<u32>();
        // SAFETY: `ptr` is in bounds and 4-byte aligned (checked by `field` on an 8-aligned base),
        // and only accessed atomically.
        unsafe { AtomicU32::from_ptr(ptr) }.load(order)
    }

    pub fn store_u32(&self, offset_bytes: usize, value: u32, order: Ordering) {
        let ptr = self.field(offset_bytes, 4).cast::<u32>();
        // SAFETY: as in `load_u32`.
        unsafe { AtomicU32::from_ptr(ptr) }.store(value, order);
    }

    pub fn fetch_add_u32(&self, offset_bytes: usize, value: u32, order: Ordering) -> u32 {
        let ptr = self.field(offset_bytes, 4).cast::<u32>();
        // SAFETY: as in `load_u32`.
        unsafe { AtomicU32::from_ptr(ptr) }.fetch_add(value, order)
    }

    /// Compare-and-swap of a 32-bit field; `Ok(previous)` when it held `current` and now holds `new`.
    pub fn compare_exchange_u32(
        &self,
        offset_bytes: usize,
        current: u32,
        new: u32,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u32, u32> {
        let ptr = self.field(offset_bytes, 4).cast::<u32>();
        // SAFETY: as in `load_u32`.
        unsafe { AtomicU32::from_ptr(ptr) }.compare_exchange(current, new, success, failure)
    }

    pub fn load_u64(&self, offset_bytes: usize, order: Ordering) -> u64 {
        let ptr = self.field(offset_bytes, 8).cast::<u64>();
        // SAFETY: `ptr` is in bounds and 8-byte aligned (checked by `field` on an 8-aligned base),
        // and only accessed atomically.
        unsafe { AtomicU64::from_ptr(ptr) }.load(order)
    }

    pub fn store_u64(&self, offset_bytes: usize, value: u64, order: Ordering) {
        let ptr = self.field(offset_bytes, 8).cast::<u64>();
        // SAFETY: as in `load_u64`.
        unsafe { AtomicU64::from_ptr(ptr) }.store(value, order);
    }

    /// Stores `words` at consecutive 8-byte fields from `offset_bytes`, with one bounds and
    /// alignment check for the whole span (a check per field was a measurable share of
    /// `prepare_*`, which writes thousands of IOCTX records); the compiler unrolls it.
    ///
    /// The words may span fields that are read with narrower accesses: the caller must write
    /// only memory no other agent reads or writes concurrently, and publish it (a Release store
    /// the readers acquire, a channel) before anyone reads it with another width, as
    /// `crate::layout::QueueMemory::write_ioctx_record` does for the IOCTX records of an IOCB
    /// that is not in flight.
    #[inline]
    pub fn store_u64_array<const N: usize>(&self, offset_bytes: usize, words: &[u64; N], order: Ordering) {
        let first = self.span(offset_bytes, N * 8, 8).cast::<u64>();
        for (index, &word) in words.iter().enumerate() {
            // SAFETY: the span [offset, offset + 8 * N) is in bounds and 8-byte aligned (checked
            // by `span`), so word `index < N` is too. The word may span narrower fields that
            // readers load with their own widths: sound because no such read races with this
            // store (the callers' contract, below; module documentation).
            let atomic = unsafe { AtomicU64::from_ptr(first.add(index)) };
            atomic.store(word, order);
        }
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        if let Owner::Host(layout) = self.owner {
            // SAFETY: `base` was returned by `alloc_zeroed(layout)` in `allocate_host` and is freed
            // exactly once, here; no reference into it can outlive `self`.
            unsafe { alloc::dealloc(self.base.as_ptr(), layout) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_region_is_zeroed_page_aligned_and_round_trips_every_width() {
        // Goal: fields of each width read back what was stored, at their own offsets only.
        let region = SharedRegion::allocate_host(256).unwrap();
        assert_eq!(region.host_address() % REGION_ALIGN_BYTES as u64, 0);
        assert_eq!(region.load_u64(248, Ordering::Relaxed), 0);
        region.store_u8(1, 0xAB, Ordering::Relaxed);
        region.store_u16(2, 0xBEEF, Ordering::Relaxed);
        region.store_u32(4, 0xDEAD_BEEF, Ordering::Relaxed);
        region.store_u64(8, u64::MAX - 1, Ordering::Release);
        assert_eq!(region.load_u8(0, Ordering::Relaxed), 0);
        assert_eq!(region.load_u8(1, Ordering::Relaxed), 0xAB);
        assert_eq!(region.load_u16(2, Ordering::Relaxed), 0xBEEF);
        assert_eq!(region.load_u32(4, Ordering::Relaxed), 0xDEAD_BEEF);
        assert_eq!(region.load_u64(8, Ordering::Acquire), u64::MAX - 1);
        assert_eq!(region.fetch_add_u32(4, 1, Ordering::AcqRel), 0xDEAD_BEEF);
        assert_eq!(region.compare_exchange_u32(4, 7, 9, Ordering::AcqRel, Ordering::Acquire), Err(0xDEAD_BEF0));
    }

    #[test]
    #[should_panic(expected = "outside region")]
    fn out_of_bounds_field_panics_before_touching_memory() {
        let region = SharedRegion::allocate_host(64).unwrap();
        region.load_u64(64, Ordering::Relaxed);
    }

    #[test]
    #[should_panic(expected = "not aligned")]
    fn misaligned_field_panics() {
        let region = SharedRegion::allocate_host(64).unwrap();
        region.load_u32(2, Ordering::Relaxed);
    }
}
