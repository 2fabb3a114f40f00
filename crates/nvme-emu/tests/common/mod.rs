//! Shared by the driver-against-emulator tests: the software controller seen through registers
//! whose 32-bit writes run a test's hook first (to count doorbells, or to pause inside one).

use std::sync::Arc;

use nvme_driver::hw::{DeviceBackend, DmaAllocator, HwError, RegisterIo};
use nvme_emu::EmuDevice;

/// Runs before every 32-bit register write, with its offset.
pub type WriteHook = Box<dyn Fn(usize) + Send + Sync>;

struct HookedRegisters {
    inner: Arc<dyn RegisterIo>,
    before_write32: WriteHook,
}

impl RegisterIo for HookedRegisters {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn read32(&self, offset: usize) -> u32 {
        self.inner.read32(offset)
    }
    fn write32(&self, offset: usize, value: u32) {
        (self.before_write32)(offset);
        self.inner.write32(offset, value);
    }
    fn read64(&self, offset: usize) -> u64 {
        self.inner.read64(offset)
    }
    fn write64(&self, offset: usize, value: u64) {
        self.inner.write64(offset, value);
    }
}

struct HookedBackend {
    device: Arc<EmuDevice>,
    registers: Arc<HookedRegisters>,
}

impl DeviceBackend for HookedBackend {
    fn name(&self) -> String {
        format!("hooked {}", self.device.name())
    }
    fn registers(&self) -> Arc<dyn RegisterIo> {
        Arc::clone(&self.registers) as Arc<dyn RegisterIo>
    }
    fn dma(&self) -> Arc<dyn DmaAllocator> {
        self.device.dma()
    }
    fn function_reset(&self) -> Result<(), HwError> {
        self.device.function_reset()
    }
}

/// `device`, with `hook` run before each 32-bit register write the driver makes.
pub fn hooked_backend(device: &Arc<EmuDevice>, hook: WriteHook) -> Arc<dyn DeviceBackend> {
    let registers = Arc::new(HookedRegisters { inner: device.registers(), before_write32: hook });
    Arc::new(HookedBackend { device: Arc::clone(device), registers })
}
