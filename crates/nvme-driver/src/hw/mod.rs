//! The hardware seam: the only place in this crate that touches raw memory or the kernel.
//!
//! The driver above this module is written against three small abstractions:
//! - [`RegisterIo`]: 32/64-bit accesses to the controller's BAR0 at a byte offset;
//! - [`DmaAllocator`]: memory the device can reach, as [`DmaRegion`]s that carry a device-visible
//!   address ([`Iova`]) and offer only copying or atomic accessors (never a Rust reference into
//!   memory a device writes);
//! - [`DeviceBackend`]: one PCI function — its registers, its DMA allocator and function reset.
//!
//! Data buffers may also lie in memory the host has no pointer to ([`CopiedMemory`], `copied.rs`:
//! GPU memory a daemon imported), which only a device translating IOVAs in software reaches, by
//! asking that memory to copy ([`DmaAllocator::map_copied`], [`DmaAllocator::translate_data`]).
//!
//! VFIO implements them for real hardware; the software controller (`nvme-emu`) implements the
//! device side of the same seam for tests and the embedded default device.
#![allow(unsafe_code)]

mod copied;
mod mapper;
mod memory;
mod shared;
pub mod vfio;
mod window;

use std::io;
use std::sync::Arc;

pub use copied::{CopiedMemory, CopiedRegion, DataRegion};
pub use mapper::{IdentityMapper, IommuMapper, MapObserver, ObservedIdentityMapper};
pub use memory::{DmaPool, DmaRegion, HostMemory, PageKind};
pub use shared::{SharedMemory, SharedMemoryError, SharedRegisters};
pub use vfio::{VfioDevice, VfioError};
pub use window::DmaWindow;

use crate::types::Iova;

/// Errors from the hardware seam: memory, mappings and the kernel interfaces under them.
#[derive(Debug, thiserror::Error)]
pub enum HwError {
    #[error("mmap of {len} bytes ({kind:?}) failed: {source}")]
    Mmap { len: usize, kind: PageKind, source: io::Error },
    #[error("access of {access_len} bytes at offset {offset} is outside a region of {region_len} bytes")]
    OutOfRange { offset: usize, access_len: usize, region_len: usize },
    #[error("access at offset {offset} is not aligned to {align} bytes")]
    Misaligned { offset: usize, align: usize },
    #[error("IOVA space exhausted: no free range of {len} bytes")]
    IovaExhausted { len: usize },
    #[error("zero-length DMA allocation or mapping")]
    ZeroLength,
    #[error("IOMMU map of {len} bytes at {iova} failed: {source}")]
    Map { iova: Iova, len: usize, source: io::Error },
    #[error("no DMA region is mapped at {iova} (+{len} bytes)")]
    Unmapped { iova: Iova, len: usize },
    #[error("device backend '{backend}': {message}")]
    Backend { backend: &'static str, message: String },
    #[error("IOVA range {iova} (+{len} bytes) overlaps memory already mapped")]
    Overlap { iova: Iova, len: usize },
    #[error("host range {host:#x} (+{len} bytes) is not inside the DMA window")]
    OutsideWindow { host: usize, len: usize },
    #[error("shared memory: {0}")]
    Shared(Box<SharedMemoryError>),
    #[error("{allocator} cannot map shared memory")]
    SharedUnsupported { allocator: &'static str },
    #[error(
        "{allocator} cannot map memory reached only by copies (GPU memory imported from another process): an IOMMU maps host \
         pages; only a device that translates IOVAs in software (the software controller) copies through such memory"
    )]
    CopiedUnsupported { allocator: &'static str },
    #[error(transparent)]
    Vfio(#[from] vfio::VfioError),
}

/// Volatile access to a controller's register space (BAR0), NVMe base spec §3.1.
///
/// 32-bit accesses use that width. A 64-bit access (CAP, ASQ, ACQ) may be made as two 32-bit
/// ones, low dword first, as §3.1.1 allows: the VFIO BAR always splits them, as Linux does,
/// because some controllers and root complexes mishandle 64-bit MMIO. An offset
/// past the end of the BAR reads as all ones (like a device that fell off the bus) and writes are
/// dropped: the driver treats all-ones reads as "device gone", so this can never be mistaken for
/// valid data.
#[allow(clippy::len_without_is_empty)] // A BAR is never empty.
pub trait RegisterIo: Send + Sync {
    /// Size of the register space in bytes.
    fn len(&self) -> usize;
    fn read32(&self, offset: usize) -> u32;
    fn write32(&self, offset: usize, value: u32);
    fn read64(&self, offset: usize) -> u64;
    fn write64(&self, offset: usize, value: u64);
}

/// Memory the device can reach by DMA.
pub trait DmaAllocator: Send + Sync {
    /// Allocates `len` bytes (rounded up to 4 KiB), zeroed, page aligned, mapped for the device.
    fn allocate(&self, len: usize) -> Result<DmaRegion, HwError>;

    /// Maps memory the caller owns (an engine's KV pool, a registered host buffer) for the device.
    ///
    /// # Safety
    /// `host..host+len` must be valid for reads and writes for as long as the returned region or
    /// any clone of it lives, must not be unmapped or freed before then, and must be page aligned
    /// (4 KiB). The device may write it at any time while a command referencing it is in flight;
    /// the caller must not hold Rust references into it while I/O is outstanding.
    unsafe fn map_external(&self, host: *mut u8, len: usize) -> Result<DmaRegion, HwError>;

    /// Finds the mapped region that contains `iova..iova+len` (the device's view of DMA). Used by
    /// the software controller to perform DMA and by upper layers to validate descriptors.
    fn translate(&self, iova: Iova, len: usize) -> Result<DmaRegion, HwError>;

    /// Which device address space this allocator's IOVAs belong to. Two allocators with the
    /// same id resolve every IOVA to the same memory (one VFIO container, one emulator DMA
    /// pool); an IOVA from another space names unrelated memory, or none, on this device.
    fn address_space(&self) -> AddressSpaceId;

    /// Maps a whole shared-memory mapping (a client's DMA window the daemon received) for the
    /// device. Safe, unlike [`DmaAllocator::map_external`]: the returned region (and every clone
    /// or subregion) keeps the mapping alive, so it outlives every use the device can make of it.
    fn map_shared(&self, memory: &Arc<SharedMemory>) -> Result<DmaRegion, HwError> {
        let _ = memory;
        Err(HwError::SharedUnsupported { allocator: std::any::type_name::<Self>() })
    }

    /// Gives memory reached only by copies (`copied.rs`: GPU memory imported from another
    /// process) an IOVA in this space. Only where the device translates IOVAs itself (the
    /// software controller); an IOMMU cannot map it: [`HwError::CopiedUnsupported`].
    fn map_copied(&self, memory: Arc<dyn CopiedMemory>) -> Result<CopiedRegion, HwError> {
        let _ = memory;
        Err(HwError::CopiedUnsupported { allocator: std::any::type_name::<Self>() })
    }

    /// [`DmaAllocator::translate`] for a data buffer, which may also lie in memory reached by
    /// copies ([`DmaAllocator::map_copied`]). Rings, PRP lists and SGL segments are host
    /// memory and use `translate`.
    fn translate_data(&self, iova: Iova, len: usize) -> Result<DataRegion, HwError> {
        self.translate(iova, len).map(DataRegion::Host)
    }
}

/// Makes every store this thread made to DMA memory (SQ entries, PRP lists, SGL segments,
/// DSM ranges) complete before the next store — the SQ tail doorbell write to BAR0 — is issued.
///
/// Why not `fence(Release)`: a Release fence orders memory for other *threads* that synchronise
/// through atomics. It compiles to nothing on x86 and to `dmb ish` on Arm, and "inner
/// shareable" does not reach a PCIe device, whose doorbell is Device memory: on an Arm host
/// (Grace-Hopper is the natural host for the GPU path) the entry stores may still sit in the
/// CPU's write buffer when the doorbell write reaches the controller, which then fetches a
/// stale entry. `dsb st` waits until all earlier stores are complete for every observer,
/// devices included, before any later store issues. On x86 ordinary (write-back) stores are
/// already seen in program order by a device before an uncached MMIO store; `sfence` also
/// drains write-combining and non-temporal stores (a memcpy may use them), so the argument does
/// not depend on how the copy into the ring was compiled. The cost is paid once per doorbell,
/// i.e. once per batch. The `asm!` blocks leave out `nomem` on purpose: the compiler must also
/// treat them as a barrier and keep the ring stores before them.
#[inline]
pub fn fence_before_submission_doorbell() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` only orders stores; it reads and writes no memory, touches no register
    // and no flag, and needs no stack.
    unsafe {
        std::arch::asm!("sfence", options(nostack, preserves_flags));
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: `dsb st` only waits for earlier stores to complete; it reads and writes no memory
    // and no register, and needs no stack.
    unsafe {
        std::arch::asm!("dsb st", options(nostack, preserves_flags));
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Makes this thread's loads of the completion entries it consumed complete before the next
/// store — the CQ head doorbell write, which hands those slots back to the controller — is
/// issued, so the controller cannot overwrite an entry that is still being read.
///
/// Here the earlier accesses are *loads*. x86 never lets a later store pass an earlier load
/// (TSO), so `sfence` (kept for its effect on write-combining stores, as above) suffices. Arm
/// does let a store become visible before an earlier load is satisfied, and `dsb st` waits for
/// stores only; `dsb sy` waits for every earlier access, loads included. Once per reap batch.
#[inline]
pub fn fence_before_completion_doorbell() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `fence_before_submission_doorbell`: an ordering instruction only.
    unsafe {
        std::arch::asm!("sfence", options(nostack, preserves_flags));
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: `dsb sy` only waits for earlier memory accesses to complete; it reads and writes
    // no memory and no register, and needs no stack.
    unsafe {
        std::arch::asm!("dsb sy", options(nostack, preserves_flags));
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Orders the loads of a completion entry's body (SQ head, SQ id, dword 0) after the Acquire
/// load of its dword 3 that found the expected phase tag, so the body read cannot return what
/// the slot held on the CQ's previous lap.
///
/// Why not the Acquire load alone: on Arm it orders later loads only for observers in the
/// location's shareability domain (inner shareable for user mappings), and a PCIe device is not
/// in it (the argument of [`fence_before_submission_doorbell`], for loads). `dmb oshld` orders
/// earlier loads before later loads and stores for the outer shareable domain, which the
/// device's writes are seen in: Linux's `dma_rmb()`, SPDK's poller after its phase check. On
/// x86 loads are not reordered with other loads (TSO), so only the compiler must keep the body
/// copy after the dword 3 load. Once per completion entry reaped.
#[inline]
pub fn fence_after_completion_phase() {
    #[cfg(test)]
    COMPLETION_PHASE_FENCES.with(|fences| fences.set(fences.get() + 1));
    #[cfg(target_arch = "x86_64")]
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
    #[cfg(target_arch = "aarch64")]
    // SAFETY: `dmb oshld` only orders earlier loads before later accesses; it reads and writes
    // no memory and no register, and needs no stack. No `nomem`: it is a compiler barrier too.
    unsafe {
        std::arch::asm!("dmb oshld", options(nostack, preserves_flags));
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

#[cfg(test)]
thread_local! {
    /// [`fence_after_completion_phase`] calls on this thread: what no x86 test can observe
    /// (the fence's effect) is pinned by its tests as "the reap path calls it".
    pub(crate) static COMPLETION_PHASE_FENCES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Makes this thread's store of a shadow doorbell (§5.7) visible to the controller before its
/// next load — the EventIdx the controller writes — is performed. This is the store-then-load
/// half of a Dekker handshake: the controller stores the EventIdx and then reloads the shadow
/// doorbell, the host stores the shadow doorbell and then loads the EventIdx, and with a full
/// barrier on both sides at least one of them sees the other's store, so a doorbell is never
/// left unseen with the MMIO write skipped. No store barrier is enough: x86 lets a load pass an
/// earlier store (`mfence` forbids it), and Arm needs `dsb sy` for an observer that is a device.
/// Once per doorbell, only when shadow doorbells are on.
#[inline]
pub fn fence_before_event_index_load() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `mfence` only orders earlier loads and stores before later ones; it reads and
    // writes no memory, touches no register and no flag, and needs no stack.
    unsafe {
        std::arch::asm!("mfence", options(nostack, preserves_flags));
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: as in `fence_before_completion_doorbell`: an ordering instruction only.
    unsafe {
        std::arch::asm!("dsb sy", options(nostack, preserves_flags));
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Identifies a device address space (see [`DmaAllocator::address_space`]). Only equality is
/// meaningful.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AddressSpaceId(pub u64);

/// One NVMe PCI function, as the driver sees it.
pub trait DeviceBackend: Send + Sync {
    /// A short human-readable name: `emu:/path`, `vfio:0000:00:04.0`.
    fn name(&self) -> String;
    fn registers(&self) -> Arc<dyn RegisterIo>;
    fn dma(&self) -> Arc<dyn DmaAllocator>;
    /// Function-level reset (PCIe FLR through VFIO; a full controller reset for the emulator).
    /// A backend that gates DMA with bus mastering leaves it off afterwards, for the
    /// bring-up that follows to turn on ([`DeviceBackend::enable_bus_master`]).
    fn function_reset(&self) -> Result<(), HwError>;
    /// Lets the function master the bus, i.e. DMA. The driver calls it only once the controller
    /// was seen stopped (CSTS.RDY = 0 after CC.EN = 0) in a bring-up, just before it enables
    /// the controller. A backend whose functions share one DMA space (VFIO: one container for
    /// a striped pool) opens them with bus mastering off, so that a function a crashed process
    /// left running cannot DMA into memory mapped for another function of the space before its
    /// own bring-up stopped it. Default: nothing to do (the software controller has no such
    /// gate, and starts stopped).
    fn enable_bus_master(&self) -> Result<(), HwError> {
        Ok(())
    }
}
