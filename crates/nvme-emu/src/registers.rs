//! The emulated BAR0: a register file in a page-aligned DMA region.
//!
//! The registers live in shared memory, not in Rust atomics inside a struct, so that another
//! agent (a GPU that mapped the region with `cuMemHostRegister`) can write doorbells directly.
//! The host side goes through [`RegisterIo`]; the controller thread reads the same memory with
//! Acquire loads. Read-only registers (CAP, VS, CSTS) ignore host writes, and accesses outside
//! the file or misaligned ones read as all ones and drop writes, as a device off the bus would.
//!
//! A shared page ([`crate::EmuConfig::shared_registers`]) can be stored into behind
//! [`RegisterIo`]'s back, read-only registers included. So their values are kept here, not
//! read back from the page: the controller and every read through [`RegisterIo`] see CAP, VS
//! and the controller's own CSTS (republished to the page at every change of it), whatever a
//! client stored there; only a reader of the raw page sees the stored value, until the next
//! change of CSTS or a reset rewrites it.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use std::sync::Arc;

use nvme_driver::hw::{DmaAllocator, DmaPool, DmaRegion, HwError, RegisterIo, SharedMemory};
use nvme_driver::spec::registers::{self, Version};

/// The register file. Cheap to share (`Arc`) between the device handle and the controller.
pub struct RegisterFile {
    region: DmaRegion,
    /// Keeps the pool (and so the mapping) alive; a private pool, so the register file is not
    /// reachable through the device's own DMA translation.
    _pool: DmaPool,
    /// The memfd behind the registers when they are shared with another process.
    shared: Option<Arc<SharedMemory>>,
    capabilities: u64,
    /// CSTS as the controller set it: the value every read returns (see the module comment).
    status: AtomicU32,
    doorbell_stride_log2: u8,
    /// Runs after every host write of CC through [`RegisterIo`]: wakes the controller thread,
    /// which applies the write (enable, reset, shutdown) at its next poll. It does not apply it
    /// itself: a reset or a shutdown waits for the transfers in flight, and an MMIO write
    /// returns at once; the host polls CSTS under its own deadline (CAP.TO), as on hardware.
    configuration_hook: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Set by every host write of CC with EN = 0, taken by the controller together with CC's
    /// value (`take_configuration`): a reset the host asked for is an edge, so a write of EN = 1
    /// that follows before the controller thread looked does not hide it. The lock makes the
    /// host's CC store and flag one step, and the controller's take and CC load another: with
    /// two separate atomics a controller could read a CC = 0 whose flag was not set yet, reset,
    /// and later take that stale flag and reset a controller the host had enabled since. Only
    /// CC writes and the controller's poll take it, never a doorbell.
    disable_written: Mutex<bool>,
    /// `disable_written`'s value for lock-free reads (`reset_requested`, checked per fetch and
    /// per command); written only under that lock.
    disable_pending: AtomicBool,
    /// Host CC writes so far (wrapping), counted under `disable_written`'s lock after the store:
    /// the controller looks at CC (and takes that lock) only when it moved.
    configuration_writes: AtomicU32,
    /// Runs after every host doorbell write through [`RegisterIo`]: wakes a sleeping controller
    /// thread so that a command after an idle period does not wait out the sleep. (Doorbells
    /// written straight into the memory, as a GPU does, are found by polling.)
    doorbell_hook: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl RegisterFile {
    /// A register file with room for the admin queue pair and `io_queue_pairs` I/O pairs; in a
    /// sealed memfd another process can map when `shared`.
    pub(crate) fn new(capabilities: u64, doorbell_stride_log2: u8, io_queue_pairs: u16, shared: bool) -> Result<Self, HwError> {
        let pool = DmaPool::identity();
        let doorbells = (usize::from(io_queue_pairs) + 1) * 2;
        let len = registers::DOORBELL_BASE + doorbells * (4usize << doorbell_stride_log2);
        let (region, shared) = if shared {
            let memory = SharedMemory::create("nvme-emu-registers", len.div_ceil(4096) * 4096)?;
            (pool.map_shared(&memory)?, Some(memory))
        } else {
            (pool.allocate(len)?, None)
        };
        let file = Self {
            region,
            _pool: pool,
            shared,
            capabilities,
            status: AtomicU32::new(0),
            doorbell_stride_log2,
            configuration_hook: OnceLock::new(),
            doorbell_hook: OnceLock::new(),
            disable_written: Mutex::new(false),
            disable_pending: AtomicBool::new(false),
            configuration_writes: AtomicU32::new(0),
        };
        file.power_on_reset();
        Ok(file)
    }

    /// Installs the CC write hook (once; later calls are ignored).
    pub(crate) fn set_configuration_hook(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.configuration_hook.set(hook);
    }

    /// Installs the doorbell write hook (once; later calls are ignored).
    pub(crate) fn set_doorbell_hook(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.doorbell_hook.set(hook);
    }

    /// The memory holding the registers, for mapping into another agent's address space.
    pub fn region(&self) -> &DmaRegion {
        &self.region
    }

    /// The memfd holding the registers when they are shared ([`crate::EmuConfig::shared_registers`]):
    /// its fd and length are what another process needs to map them.
    pub fn shared_memory(&self) -> Option<&Arc<SharedMemory>> {
        self.shared.as_ref()
    }

    /// Every register to its reset value: CAP and VS, zero elsewhere (CC, CSTS, AQA, doorbells).
    /// A CC write the controller had not looked at yet is forgotten with them.
    pub(crate) fn power_on_reset(&self) {
        let mut disable_written = self.lock_configuration();
        *disable_written = false;
        self.disable_pending.store(false, Ordering::Release);
        self.status.store(0, Ordering::Release);
        // The region is at least one page and 8-aligned: these stores cannot fail.
        let _ = self.region.fill(0, self.region.len(), 0);
        let _ = self.region.store_u64(registers::CAP, self.capabilities, Ordering::Relaxed);
        let _ = self.region.store_u32(registers::VS, Version::V1_4.0, Ordering::Release);
    }

    /// Zeroes every doorbell (queues are created with head = tail = 0).
    pub(crate) fn clear_doorbells(&self) {
        let start = registers::DOORBELL_BASE;
        let _ = self.region.fill(start, self.region.len().saturating_sub(start), 0);
    }

    /// A 32-bit register: CAP's halves, VS and CSTS are the controller's own values, the others
    /// what the memory holds (all ones outside the file or misaligned).
    pub(crate) fn load32(&self, offset: usize) -> u32 {
        match offset {
            registers::CAP => self.capabilities as u32,
            _ if offset == registers::CAP + 4 => (self.capabilities >> 32) as u32,
            registers::VS => Version::V1_4.0,
            registers::CSTS => self.status.load(Ordering::Acquire),
            _ => self.region.load_u32(offset, Ordering::Acquire).unwrap_or(u32::MAX),
        }
    }

    /// A 64-bit register: CAP is the controller's own value, the others what the memory holds.
    pub(crate) fn load64(&self, offset: usize) -> u64 {
        match offset {
            registers::CAP => self.capabilities,
            _ => self.region.load_u64(offset, Ordering::Acquire).unwrap_or(u64::MAX),
        }
    }

    /// Whether the host wrote CC.EN = 0 since the last call (see `disable_written`), CC as the
    /// host last wrote it, and the count of CC writes it reflects, in one step.
    pub(crate) fn take_configuration(&self) -> (bool, u32, u32) {
        let mut disable_written = self.lock_configuration();
        let taken = std::mem::take(&mut *disable_written);
        self.disable_pending.store(false, Ordering::Release);
        (taken, self.load32(registers::CC), self.configuration_writes.load(Ordering::Relaxed))
    }

    /// Host CC writes so far (wrapping): unchanged since a `take_configuration`, CC is as taken.
    pub(crate) fn configuration_writes(&self) -> u32 {
        self.configuration_writes.load(Ordering::Acquire)
    }

    fn lock_configuration(&self) -> MutexGuard<'_, bool> {
        // A panic under this lock leaves only a bool behind: the value is still meaningful.
        self.disable_written.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether the host asked for a controller reset that the controller has not done yet: an
    /// EN = 0 write through `RegisterIo` not taken yet (the controller resets as it takes one;
    /// a value stored into a shared page behind `RegisterIo`'s back is not a request). A running controller checks it
    /// before it fetches or runs more commands, so that a doorbell rung after the host cleared
    /// EN is not new work for queues the reset deletes. One load: it runs per command.
    pub(crate) fn reset_requested(&self) -> bool {
        self.disable_pending.load(Ordering::Acquire)
    }

    /// Sets CSTS: the controller's own value, which every read returns, republished to the
    /// memory for agents that read the page directly.
    pub(crate) fn set_status(&self, csts: u32) {
        self.status.store(csts, Ordering::Release);
        let _ = self.region.store_u32(registers::CSTS, csts, Ordering::Release);
    }

    fn doorbell_offset(&self, queue_id: u16, completion: bool) -> usize {
        registers::doorbell_offset(queue_id, completion, self.doorbell_stride_log2)
    }

    /// The value last written to a doorbell, `None` if the queue has no doorbell in this file.
    pub(crate) fn doorbell(&self, queue_id: u16, completion: bool) -> Option<u32> {
        self.region.load_u32(self.doorbell_offset(queue_id, completion), Ordering::Acquire).ok()
    }

    /// Resets one queue's doorbell to zero when the queue is created.
    pub(crate) fn reset_doorbell(&self, queue_id: u16, completion: bool) {
        let _ = self.region.store_u32(self.doorbell_offset(queue_id, completion), 0, Ordering::Release);
    }

    /// Whether the host may write this 32-bit register.
    fn host_writable(offset: usize) -> bool {
        matches!(offset, registers::INTMS | registers::INTMC | registers::CC | registers::NSSR | registers::AQA)
            || (registers::ASQ..registers::ACQ + 8).contains(&offset)
            || offset >= registers::DOORBELL_BASE
    }
}

impl RegisterIo for RegisterFile {
    fn len(&self) -> usize {
        self.region.len()
    }

    fn read32(&self, offset: usize) -> u32 {
        self.load32(offset)
    }

    fn write32(&self, offset: usize, value: u32) {
        if Self::host_writable(offset) {
            if offset == registers::CC {
                // CC's value and the EN = 0 flag change together (see `disable_written`).
                let mut disable_written = self.lock_configuration();
                let _ = self.region.store_u32(offset, value, Ordering::Release);
                if value & 1 == 0 {
                    *disable_written = true;
                    self.disable_pending.store(true, Ordering::Release);
                }
                self.configuration_writes.fetch_add(1, Ordering::Release);
            } else {
                // Release: the SQ entries written before this doorbell are visible to the
                // controller thread once it observes the new tail with its Acquire load.
                let _ = self.region.store_u32(offset, value, Ordering::Release);
            }
            let hook = if offset == registers::CC {
                self.configuration_hook.get()
            } else if offset >= registers::DOORBELL_BASE {
                self.doorbell_hook.get()
            } else {
                None
            };
            if let Some(hook) = hook {
                hook();
            }
        }
    }

    fn read64(&self, offset: usize) -> u64 {
        self.load64(offset)
    }

    fn write64(&self, offset: usize, value: u64) {
        if offset == registers::ASQ || offset == registers::ACQ {
            let _ = self.region.store_u64(offset, value, Ordering::Release);
        } else if offset.is_multiple_of(8) && offset >= registers::DOORBELL_BASE {
            // Split as §3.1.1 allows: low dword first.
            self.write32(offset, value as u32);
            self.write32(offset + 4, (value >> 32) as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme_driver::spec::registers::Capabilities;

    #[test]
    fn read_only_registers_ignore_writes_and_out_of_range_reads_all_ones() {
        // Goal: the host cannot change CAP/VS/CSTS, and bad offsets behave like a missing device.
        let cap = Capabilities::build(2048, 20, 0, 0, 0).0;
        let file = RegisterFile::new(cap, 0, 4, false).unwrap();
        file.write64(registers::CAP, 0);
        file.write32(registers::VS, 0);
        file.write32(registers::CSTS, 1);
        assert_eq!(file.read64(registers::CAP), cap);
        assert_eq!(file.read32(registers::VS), Version::V1_4.0);
        assert_eq!(file.read32(registers::CSTS), 0);
        // Nor by storing into the memory behind RegisterIo's back (a shared page's client).
        for offset in [registers::CAP, registers::CAP + 4, registers::VS, registers::CSTS] {
            file.region().store_u32(offset, 0x9, Ordering::Release).unwrap();
        }
        assert_eq!((file.read64(registers::CAP), file.read32(registers::CAP + 4)), (cap, (cap >> 32) as u32));
        assert_eq!((file.read32(registers::VS), file.read32(registers::CSTS)), (Version::V1_4.0, 0));
        file.set_status(1);
        assert_eq!((file.read32(registers::CSTS), file.region().load_u32(registers::CSTS, Ordering::Acquire).unwrap()), (1, 1));
        assert_eq!(file.read32(file.len() + 4), u32::MAX);
        assert_eq!(file.read32(3), u32::MAX, "misaligned reads are all ones");
        file.write32(file.len(), 5); // dropped, no panic
        file.write32(registers::CC, 0x46_0001);
        assert_eq!(file.read32(registers::CC), 0x46_0001);
        file.write32(registers::doorbell_offset(4, true, 0), 9);
        assert_eq!(file.doorbell(4, true), Some(9));
        assert_eq!(file.doorbell(5000, true), None);
    }
}
