//! The device: a controller thread polling the register file, and the `DeviceBackend` face the
//! driver sees.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use nvme_driver::hw::{DeviceBackend, DmaAllocator, DmaPool, DmaRegion, HwError, RegisterIo, SharedMemory};
use nvme_driver::spec::registers::Capabilities;

use crate::config::EmuConfig;
use crate::controller::ControllerCore;
use crate::faults::FaultPlan;
use crate::registers::RegisterFile;
use crate::restriction::QueueRestriction;
use crate::stats::EmuStats;
use crate::EmuError;

/// Idle back-off: busy scans first, then yields, then sleeps doubling up to the configured cap.
const SPIN_SCANS: u32 = 256;
const YIELD_SCANS: u32 = 256;
const FIRST_SLEEP: Duration = Duration::from_micros(5);
/// How long `Drop` waits for the controller thread before leaving it detached.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

struct Shared {
    core: Mutex<ControllerCore>,
    stop: AtomicBool,
    /// Set while the controller thread sleeps, so a doorbell write knows to wake it.
    sleeping: AtomicBool,
    thread: OnceLock<Thread>,
}

impl Shared {
    fn core(&self) -> MutexGuard<'_, ControllerCore> {
        // The controller never panics while holding the lock by design; if it ever did, the
        // state is still structurally valid, so keep serving rather than cascade the panic.
        self.core.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A running software NVMe controller. See the crate documentation for an example.
pub struct EmuDevice {
    shared: Arc<Shared>,
    registers: Arc<RegisterFile>,
    dma: Arc<DmaPool>,
    name: String,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl EmuDevice {
    /// Opens the backing store, builds the register file and starts the controller thread. The
    /// controller starts disabled (CC.EN = 0), waiting for a host to bring it up.
    pub fn start(config: EmuConfig) -> Result<Arc<Self>, EmuError> {
        Self::start_in(config, &DmaPool::identity())
    }

    /// [`EmuDevice::start`] in the DMA space of `dma` (e.g. another controller's
    /// [`EmuDevice::dma_pool`]): controllers started in one space reach each other's
    /// allocations at the same IOVAs, like SSDs in one VFIO container. A pool striped across
    /// several controllers needs that, because the engine's KV memory is registered once.
    pub fn start_in(config: EmuConfig, dma: &DmaPool) -> Result<Arc<Self>, EmuError> {
        config.validate()?;
        let capabilities =
            Capabilities::build(config.max_queue_entries, config.ready_timeout_500ms_units, config.doorbell_stride_log2, 0, 0);
        let registers =
            Arc::new(RegisterFile::new(capabilities.0, config.doorbell_stride_log2, config.io_queue_pairs_max, config.shared_registers)?);
        let dma = Arc::new(dma.clone());
        let core = ControllerCore::new(config, Arc::clone(&registers), (*dma).clone())?;
        let name = format!("emu:{}", core.describe_store());
        let shared = Arc::new(Shared {
            core: Mutex::new(core),
            stop: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            thread: OnceLock::new(),
        });
        let hook_shared = Arc::downgrade(&shared);
        registers.set_configuration_hook(Box::new(move || {
            if let Some(shared) = hook_shared.upgrade() {
                shared.core().react_to_configuration();
            }
        }));
        let wake_shared = Arc::downgrade(&shared);
        registers.set_doorbell_hook(Box::new(move || {
            if let Some(shared) = wake_shared.upgrade() {
                // The fence pairs with the one after the thread's store of `sleeping`: either its
                // last scan before parking saw this doorbell, or this load sees `sleeping` and
                // unparks. (A miss would cost at most one bounded sleep anyway.)
                std::sync::atomic::fence(Ordering::SeqCst);
                if shared.sleeping.load(Ordering::SeqCst) {
                    if let Some(thread) = shared.thread.get() {
                        thread.unpark();
                    }
                }
            }
        }));
        let thread_shared = Arc::clone(&shared);
        let thread =
            std::thread::Builder::new().name("nvme-emu".to_string()).spawn(move || run(&thread_shared)).map_err(EmuError::Thread)?;
        let _ = shared.thread.set(thread.thread().clone());
        Ok(Arc::new(Self { shared, registers, dma, name, thread: Mutex::new(Some(thread)) }))
    }

    /// Cuts the power: what the volatile write cache held is lost, commands in flight get no
    /// completion, CSTS.RDY drops to 0 and every register returns to its reset value. The
    /// backing store keeps what was durable; the host must bring the controller up again.
    pub fn power_loss(&self) {
        self.shared.core().power_loss();
    }

    /// Installs a fault plan (replacing the previous one; rule counters start from zero).
    pub fn set_faults(&self, plan: FaultPlan) {
        self.shared.core().set_faults(plan);
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> EmuStats {
        self.shared.core().stats()
    }

    /// The emulated BAR0 memory (to map for a GPU that rings doorbells itself).
    pub fn register_region(&self) -> DmaRegion {
        self.registers.region().clone()
    }

    /// The memfd holding BAR0 when [`EmuConfig::shared_registers`] is on, `None` otherwise: pass
    /// its fd and length to a client, which maps it with `SharedMemory::from_fd` and rings
    /// doorbells through `SharedRegisters`. Its doorbell writes are found by the controller's
    /// polling (no wake-up crosses the process boundary): within `idle_sleep_max` (100 µs by
    /// default) plus one scan after an idle period, at once while the controller is busy.
    pub fn shared_register_memory(&self) -> Option<Arc<SharedMemory>> {
        self.registers.shared_memory().cloned()
    }

    /// Restricts I/O submission queue `queue_id` to the memory and LBA ranges of `restriction`
    /// (tuttid: a client's window and its share of each namespace), or lifts it with `None`.
    /// A command outside them completes with an error status and moves no data (see
    /// [`crate::restriction`]); counted in [`EmuStats::restriction_refusals`]. Set it after
    /// creating the queue and before handing its layout to the client.
    pub fn restrict_submission_queue(&self, queue_id: u16, restriction: Option<QueueRestriction>) -> Result<(), EmuError> {
        if self.shared.core().restrict_submission_queue(queue_id, restriction) {
            Ok(())
        } else {
            Err(EmuError::NoSuchQueue { queue_id })
        }
    }

    /// The DMA pool whose table the controller translates through (same as [`DeviceBackend::dma`]).
    pub fn dma_pool(&self) -> Arc<DmaPool> {
        Arc::clone(&self.dma)
    }

    /// Runs `change` on the controller under its lock (tests that reach into its state).
    #[cfg(test)]
    pub(crate) fn with_core<R>(&self, change: impl FnOnce(&mut ControllerCore) -> R) -> R {
        change(&mut self.shared.core())
    }

    fn stop_thread(&self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(thread) = self.shared.thread.get() {
            thread.unpark();
        }
        let handle = self.thread.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        let Some(handle) = handle else { return };
        let deadline = Instant::now() + STOP_TIMEOUT;
        // Bounded wait: the thread checks `stop` at least every idle_sleep_max.
        while !handle.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        if handle.is_finished() {
            if handle.join().is_err() {
                tracing::error!("nvme-emu controller thread panicked");
            }
        } else {
            tracing::error!("nvme-emu controller thread did not stop within {STOP_TIMEOUT:?}; detaching it");
        }
    }
}

impl Drop for EmuDevice {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

impl DeviceBackend for EmuDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn registers(&self) -> Arc<dyn RegisterIo> {
        Arc::clone(&self.registers) as Arc<dyn RegisterIo>
    }

    fn dma(&self) -> Arc<dyn DmaAllocator> {
        Arc::clone(&self.dma) as Arc<dyn DmaAllocator>
    }

    fn function_reset(&self) -> Result<(), HwError> {
        self.shared
            .core()
            .function_reset()
            .map_err(|status| HwError::Backend { backend: "nvme-emu", message: format!("cache write-back during reset: {status}") })
    }
}

/// The controller thread: scan, and back off while idle.
fn run(shared: &Shared) {
    let mut idle_scans: u32 = 0;
    let mut sleep = FIRST_SLEEP;
    while !shared.stop.load(Ordering::Acquire) {
        let now = Instant::now();
        let (worked, sleep_cap) = {
            let mut core = shared.core();
            (core.poll(now), core.sleep_bound(now))
        };
        if worked {
            idle_scans = 0;
            sleep = FIRST_SLEEP;
            continue;
        }
        idle_scans = idle_scans.saturating_add(1);
        if idle_scans < SPIN_SCANS {
            std::hint::spin_loop();
        } else if idle_scans < SPIN_SCANS + YIELD_SCANS {
            std::thread::yield_now();
        } else {
            // Announce the sleep, then scan once more so a doorbell rung in between is not
            // missed; a doorbell rung after that scan sees `sleeping` and unparks us.
            shared.sleeping.store(true, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            let worked = shared.core().poll(Instant::now());
            if !worked {
                std::thread::park_timeout(sleep.min(sleep_cap));
            }
            shared.sleeping.store(false, Ordering::SeqCst);
            if worked {
                idle_scans = 0;
                sleep = FIRST_SLEEP;
            } else {
                sleep = (sleep * 2).min(sleep_cap.max(FIRST_SLEEP));
            }
        }
    }
}
