//! examples/vfio_probe.rs drives a real controller by hand, outside `Controller`, so it must keep
//! the driver's rule itself: memory the controller may write is never unmapped or freed while
//! the controller may still be running (CC.EN = 1 or CSTS.RDY = 1); it is unmapped only after
//! the controller was seen stopped, and leaked when it cannot be. The example's controller part
//! runs here against a register file that never answers an admin command, with a DMA pool whose
//! IOMMU records the controller's state at every unmap. Each test opens with its goal.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvme_driver::hw::{DmaPool, HwError, IommuMapper, RegisterIo};
use nvme_driver::spec::registers::{self as reg, Capabilities};
use nvme_driver::Iova;

#[allow(dead_code)]
#[path = "../examples/vfio_probe.rs"]
mod probe;

/// A controller's registers that enables and disables at once (or never stops, with
/// `disable_completes` false) and never fetches a command: every admin command times out.
struct SilentRegisters {
    cc: AtomicU32,
    ready: AtomicBool,
    disable_completes: bool,
}

impl SilentRegisters {
    fn new(disable_completes: bool) -> Self {
        Self { cc: AtomicU32::new(0), ready: AtomicBool::new(false), disable_completes }
    }

    /// Whether the controller may still touch memory: CC.EN = 1 or CSTS.RDY = 1.
    fn running(&self) -> bool {
        self.cc.load(Ordering::SeqCst) & 1 == 1 || self.ready.load(Ordering::SeqCst)
    }
}

impl RegisterIo for SilentRegisters {
    fn len(&self) -> usize {
        0x2000
    }

    fn read32(&self, offset: usize) -> u32 {
        match offset {
            reg::CC => self.cc.load(Ordering::SeqCst),
            // RDY, and SHST = complete once CC.SHN asked for a shutdown.
            reg::CSTS => {
                let shutdown = if self.cc.load(Ordering::SeqCst) >> 14 & 0x3 != 0 { 0b10 << 2 } else { 0 };
                u32::from(self.ready.load(Ordering::SeqCst)) | shutdown
            }
            reg::VS => 0x0001_0400,
            _ => 0,
        }
    }

    fn write32(&self, offset: usize, value: u32) {
        if offset == reg::CC {
            self.cc.store(value, Ordering::SeqCst);
            let enabled = value & 1 == 1;
            if enabled || self.disable_completes {
                self.ready.store(enabled, Ordering::SeqCst);
            }
        }
    }

    fn read64(&self, offset: usize) -> u64 {
        match offset {
            // CAP.TO 1: 500 ms.
            reg::CAP => Capabilities::build(64, 1, 0, 0, 0).0,
            _ => u64::from(self.read32(offset)) | u64::from(self.read32(offset + 4)) << 32,
        }
    }

    fn write64(&self, offset: usize, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }
}

/// An IOMMU that maps nothing (the pool's memory is host memory the test reads directly) and
/// records, at every unmap, whether the controller was still running.
struct WatchingMapper {
    registers: Arc<SilentRegisters>,
    unmaps: AtomicU64,
    unmaps_while_running: Mutex<Vec<Iova>>,
}

impl IommuMapper for WatchingMapper {
    // SAFETY: maps nothing and reads nothing through `_host`, so no caller promise is relied on.
    unsafe fn map(&self, _host: *mut u8, _len: usize, _iova: Iova) -> Result<(), HwError> {
        Ok(())
    }

    fn unmap(&self, iova: Iova, _len: usize) -> Result<(), HwError> {
        self.unmaps.fetch_add(1, Ordering::SeqCst);
        if self.registers.running() {
            self.unmaps_while_running.lock().unwrap().push(iova);
        }
        Ok(())
    }
}

/// Runs the example's controller part against a silent controller; returns its error and the
/// mapper that watched the unmaps.
fn probe_silent_controller(disable_completes: bool) -> (String, Arc<WatchingMapper>, Arc<SilentRegisters>) {
    let registers = Arc::new(SilentRegisters::new(disable_completes));
    let mapper =
        Arc::new(WatchingMapper { registers: Arc::clone(&registers), unmaps: AtomicU64::new(0), unmaps_while_running: Mutex::default() });
    let pool = DmaPool::new(mapper.clone(), Iova(1 << 32), Iova(1 << 40), false);
    let bounds = probe::Bounds { command: Duration::from_millis(50), shutdown: Duration::from_millis(50) };
    let result = probe::identify_controller(&*registers, &pool, &|| Ok(()), &bounds);
    let error = result.expect_err("no admin command is ever answered").to_string();
    drop(pool);
    (error, mapper, registers)
}

#[test]
fn a_failed_probe_stops_the_controller_before_its_memory_goes() {
    // Goal: when the Identify times out, the probe clears CC.EN and sees CSTS.RDY = 0 before
    // the admin queue and Identify buffer are unmapped. It used to return at once, unmapping
    // them (and giving their IOVAs back) with the controller still enabled.
    let (error, mapper, registers) = probe_silent_controller(true);
    assert!(error.contains("timed out"), "{error}");
    assert!(!registers.running(), "the controller was left running");
    assert_eq!(mapper.unmaps.load(Ordering::SeqCst), 2, "the pool memory and the external page are given back");
    let while_running = mapper.unmaps_while_running.lock().unwrap().clone();
    assert!(while_running.is_empty(), "unmapped while the controller ran: {while_running:?}");
}

#[test]
fn a_controller_that_does_not_stop_keeps_the_probes_memory() {
    // Goal: when CSTS.RDY never reads 0 after CC.EN = 0 (within CAP.TO), the probe leaks its
    // DMA memory rather than unmap it under a controller that may still write it.
    let (error, mapper, _registers) = probe_silent_controller(false);
    assert!(error.contains("timed out") && error.contains("leaked"), "{error}");
    let while_running = mapper.unmaps_while_running.lock().unwrap().clone();
    assert!(while_running.is_empty(), "unmapped while the controller ran: {while_running:?}");
}
