//! The device: a controller thread polling the register file, and the `DeviceBackend` face the
//! driver sees.

use std::sync::atomic::{compiler_fence, fence, AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use nvme_driver::hw::{DeviceBackend, DmaAllocator, DmaPool, DmaRegion, HwError, RegisterIo, SharedMemory};
use nvme_driver::spec::registers::Capabilities;
use nvme_driver::Iova;

use crate::config::EmuConfig;
use crate::controller::{ControllerCore, Unlocked};
use crate::faults::FaultPlan;
use crate::registers::RegisterFile;
use crate::restriction::QueueRestriction;
use crate::stats::EmuStats;
use crate::EmuError;

/// Idle back-off: busy scans first, then yields, then sleeps doubling up to the configured cap.
const SPIN_SCANS: u32 = 256;
const YIELD_SCANS: u32 = 256;
const FIRST_SLEEP: Duration = Duration::from_micros(5);
/// Longest the controller thread waits, after a poll, for a host-side call waiting for its lock
/// to take it.
const CALLER_HANDOFF: Duration = Duration::from_millis(1);
/// How long `Drop` waits for the controller thread before leaving it detached.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

struct Shared {
    core: Mutex<ControllerCore>,
    /// The core's [`Unlocked`]: the stop flag, preemption and counters reached without `core`.
    unlocked: Arc<Unlocked>,
    wake: Arc<Wake>,
}

/// How the controller thread's announcement that it is going to sleep is ordered against a
/// doorbell write (a store-then-load on each side: either the thread's last scan sees the
/// doorbell, or the writer sees `sleeping`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SleepBarrier {
    /// The sleeping side runs `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`, a full barrier on
    /// every CPU running a thread of this process, so a doorbell write needs only a compiler
    /// fence. The doorbell is the hot side (one per batch, like a posted MMIO write, which
    /// nothing waits for); falling asleep happens once per idle period.
    Process,
    /// Both sides fence (`mfence` on x86): for kernels without expedited membarrier. The
    /// writer then waits for its doorbell store to reach the controller's CPU.
    Fence,
}

impl SleepBarrier {
    /// `Process` when this kernel has expedited private membarrier and this process could
    /// register for it (once per process), else `Fence`.
    pub(crate) fn detect() -> Self {
        static PROCESS_REGISTERED: OnceLock<bool> = OnceLock::new();
        let registered = *PROCESS_REGISTERED.get_or_init(|| {
            use rustix::thread::{membarrier, membarrier_query, MembarrierCommand};
            membarrier_query().contains_command(MembarrierCommand::PrivateExpedited)
                && membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok()
        });
        if registered {
            Self::Process
        } else {
            Self::Fence
        }
    }
}

/// What a doorbell or CC write needs to wake the controller thread. The register file's hooks
/// hold it directly (not through `Shared`, which reaches the register file through the core):
/// a doorbell write does no atomic read-modify-write (on x86 one would wait for the doorbell's
/// store to reach the controller's CPU first), and neither write takes the core's lock, which
/// the controller thread holds while a reset or a shutdown waits for transfers in flight.
struct Wake {
    /// Set from the announcement before the controller's last scan ahead of sleeping until a
    /// scan finds work, so a doorbell write knows to unpark it.
    sleeping: AtomicBool,
    thread: OnceLock<Thread>,
    barrier: SleepBarrier,
}

impl Wake {
    /// After a doorbell's store: unparks the controller thread if it announced a sleep.
    fn after_doorbell(&self) {
        match self.barrier {
            // The controller's membarrier orders this CPU's accesses for it.
            SleepBarrier::Process => compiler_fence(Ordering::SeqCst),
            SleepBarrier::Fence => fence(Ordering::SeqCst),
        }
        if self.sleeping.load(Ordering::Relaxed) {
            if let Some(thread) = self.thread.get() {
                thread.unpark();
            }
        }
    }

    /// After a host write of CC: unparks the controller thread, which applies the write at its
    /// next poll. Unconditional (CC writes are rare): an unpark sent while the thread is not
    /// parked ends its next sleep at once, so the write waits at most for the scan in progress.
    /// Unpark synchronizes with the park it ends, so the thread sees the new CC.
    fn after_configuration(&self) {
        if let Some(thread) = self.thread.get() {
            thread.unpark();
        }
    }

    /// Before the controller's last scan ahead of sleeping.
    fn announce_sleep(&self) {
        self.sleeping.store(true, Ordering::Relaxed);
        match self.barrier {
            SleepBarrier::Process => {
                // Registered at detection, so this does not fail on a kernel that has it; if it
                // ever did, a doorbell rung now could be missed for one bounded sleep
                // (`idle_sleep_max`), never lost: the thread scans after every sleep.
                if rustix::thread::membarrier(rustix::thread::MembarrierCommand::PrivateExpedited).is_err() {
                    fence(Ordering::SeqCst);
                }
            }
            SleepBarrier::Fence => fence(Ordering::SeqCst),
        }
    }

    /// A scan found work: doorbell writes need not unpark the thread any more.
    fn end_sleep(&self) {
        self.sleeping.store(false, Ordering::Relaxed);
    }
}

impl Shared {
    /// The controller's lock, for the controller thread.
    fn lock_core(&self) -> MutexGuard<'_, ControllerCore> {
        // The controller never panics while holding the lock by design; if it ever did, the
        // state is still structurally valid, so keep serving rather than cascade the panic.
        self.core.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The controller's lock, for a host-side call: the controller thread lets it in after
    /// its current poll (see [`Unlocked::lock_as_caller`]).
    fn core(&self) -> MutexGuard<'_, ControllerCore> {
        self.unlocked.lock_as_caller(false, || self.lock_core())
    }

    /// [`Shared::core`] for a call that ends every command anyway (a power loss, a function
    /// reset): a zeroing holding the lock gives way at its next slice instead of running on, and
    /// a wait for transfers in flight at its next look (see `ControllerCore::stop_asked`).
    fn core_preempting(&self) -> MutexGuard<'_, ControllerCore> {
        self.unlocked.lock_as_caller(true, || self.lock_core())
    }
}

/// What the volatile write cache does when the power goes ([`EmuDevice::power_loss_with`]).
///
/// A real drive writes its cache back in its own order, a block at a time, whenever it likes:
/// at a cut any subset of the blocks written since the last Flush may already be on media, in
/// no relation to the order the host wrote them. Blocks covered by a completed Flush or FUA are
/// on media in every mode; each cached block is written back whole or not at all (one logical
/// block is atomic on power fail, AWUPF = 0). A Write in flight at the cut: see [`EmuDevice::power_loss`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PowerLossMode {
    /// Every dirty cached block is lost ([`EmuDevice::power_loss`]): the media holds what was
    /// written back when asked: all of the cache by a Flush of every namespace, a full cache or
    /// a shutdown; a namespace's or a range's blocks by a Flush of that namespace or a FUA
    /// command. So it may hold a later write without an earlier one.
    #[default]
    DiscardCache,
    /// A pseudorandom subset of the dirty cached blocks (each with even odds, drawn from `seed`)
    /// reaches the media first, the rest is lost: a host that relies on the order of two
    /// non-FUA writes without a Flush between them can find the later one on media without the
    /// earlier. The same seed over the same cached blocks picks the same subset. While the
    /// store is fenced (an abandoned io_uring write the kernel still holds may land) nothing is
    /// written back, as in `DiscardCache` (logged as an error).
    PartialWriteBack { seed: u64 },
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
        Self::start_with_barrier(config, dma, SleepBarrier::detect())
    }

    /// [`EmuDevice::start_in`] with the sleep handshake chosen by the caller (tests of both).
    pub(crate) fn start_with_barrier(config: EmuConfig, dma: &DmaPool, barrier: SleepBarrier) -> Result<Arc<Self>, EmuError> {
        config.validate()?;
        let capabilities =
            Capabilities::build(config.max_queue_entries, config.ready_timeout_500ms_units, config.doorbell_stride_log2, 0, 0);
        let registers =
            Arc::new(RegisterFile::new(capabilities.0, config.doorbell_stride_log2, config.io_queue_pairs_max, config.shared_registers)?);
        let dma = Arc::new(dma.clone());
        let core = ControllerCore::new(config, Arc::clone(&registers), (*dma).clone())?;
        let name = format!("emu:{}", core.describe_store());
        let unlocked = Arc::clone(&core.unlocked);
        let shared = Arc::new(Shared {
            core: Mutex::new(core),
            unlocked,
            wake: Arc::new(Wake { sleeping: AtomicBool::new(false), thread: OnceLock::new(), barrier }),
        });
        // A CC write only wakes the controller thread, which applies it: a reset or a shutdown
        // waits for the transfers in flight (up to their deadlines, 30 s), and the host's store
        // to CC must return at once, as an MMIO write does, so that its CAP.TO deadline works.
        let wake = Arc::clone(&shared.wake);
        registers.set_configuration_hook(Box::new(move || wake.after_configuration()));
        let wake = Arc::clone(&shared.wake);
        registers.set_doorbell_hook(Box::new(move || wake.after_doorbell()));
        let thread_shared = Arc::clone(&shared);
        let thread =
            std::thread::Builder::new().name("nvme-emu".to_string()).spawn(move || run(&thread_shared)).map_err(EmuError::Thread)?;
        let _ = shared.wake.thread.set(thread.thread().clone());
        Ok(Arc::new(Self { shared, registers, dma, name, thread: Mutex::new(Some(thread)) }))
    }

    /// Cuts the power: what the volatile write cache held is lost, commands in flight get no
    /// completion, CSTS.RDY drops to 0 and every register returns to its reset value. The
    /// backing store keeps what was durable; the host must bring the controller up again. A
    /// Write in flight lands whole, not at all, or in part: one the kernel gives back short has
    /// the logical block it stopped in finished (AWUPF = 0: one block is atomic), unless that
    /// fails (logged); one given back failed may leave a block torn (which landed is unknown),
    /// and so may one the kernel keeps past the 5 s cancellation: it fences the store, and
    /// when the kernel gives it back later, what it wrote stays as it landed (not finished).
    ///
    /// Unless the kernel still holds a transfer straight into host memory that it would not
    /// cancel: CSTS then reads RDY = 1 with CFS (not a clean stop) until it gives it back, and
    /// only then RDY = 0, so a host never reuses memory the kernel may still write.
    ///
    /// Synchronous, unlike a CC write: it returns once the cut is done (transfers in flight
    /// cancelled or, where the kernel cannot cancel them, waited for up to their deadlines), and
    /// it waits for the controller's lock, which the controller thread holds while it runs a
    /// command and while a reset waits for transfers (up to the 5 s cancellation). What would
    /// hold the lock longer gives way to the cut: a wait for transfers before a command (a
    /// Flush, an admin command, an overlapping one) or before a shutdown's write-back within
    /// 10 ms, the command getting no completion and the shutdown ending at SHST 01b (which the
    /// cut's register reset clears); a zeroing (deallocate, Write Zeroes) at its next slice,
    /// without a completion. A function reset waits, and is given way to, the same way.
    pub fn power_loss(&self) {
        self.power_loss_with(PowerLossMode::DiscardCache);
    }

    /// [`EmuDevice::power_loss`], with what the volatile write cache does at the cut chosen by
    /// `mode` (see [`PowerLossMode`]).
    pub fn power_loss_with(&self, mode: PowerLossMode) {
        self.shared.core_preempting().power_loss(mode);
    }

    /// Installs a fault plan (replacing the previous one; rule counters start from zero).
    pub fn set_faults(&self, plan: FaultPlan) {
        self.shared.core().set_faults(plan);
    }

    /// The device and inode (`st_dev`, `st_ino`) of the file the backing store is open on;
    /// `None` for memory. A caller that locked the path before starting the controller compares
    /// it with the file it locked: the path is looked up again here, and may name another file
    /// by then.
    pub fn backing_file(&self) -> Option<(u64, u64)> {
        self.shared.core().store_file_identity()
    }

    /// Whether the backing store is a file the controller reads and writes through the page
    /// cache, because its filesystem refused `O_DIRECT` (tmpfs before Linux 6.6, some FUSE
    /// filesystems): its figures are then memory's, not a disk's.
    pub fn backing_is_buffered(&self) -> bool {
        self.shared.core().store_is_buffered_file()
    }

    /// A snapshot of the counters. It waits for the controller's lock, for at most the poll in
    /// progress (a slice of a long zeroing, a Flush's wait for transfers in flight, a shutdown's
    /// wait for them).
    pub fn stats(&self) -> EmuStats {
        self.shared.core().stats()
    }

    /// [`EmuStats::restriction_refusals`], read without the controller's lock, so a caller that
    /// holds a lock of its own (tuttid's status reply) never waits for a running command.
    pub fn restriction_refusals(&self) -> u64 {
        self.shared.unlocked.restriction_refusals()
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
    /// [`crate::restriction`]); counted in [`EmuStats::restriction_refusals`]. A queue whose
    /// doorbell another process can ring (shared registers) must have it from its creation on:
    /// preset it with [`EmuDevice::preset_restriction`] instead.
    pub fn restrict_submission_queue(&self, queue_id: u16, restriction: Option<QueueRestriction>) -> Result<(), EmuError> {
        if self.shared.core().restrict_submission_queue(queue_id, restriction) {
            Ok(())
        } else {
            Err(EmuError::NoSuchQueue { queue_id })
        }
    }

    /// Restricts the I/O submission queue that a later Create I/O SQ places at `ring` (its
    /// PRP1) from the moment it exists, as [`EmuDevice::restrict_submission_queue`] does for a
    /// queue that exists. tuttid sets it before creating a client's queue: with the shared
    /// register page every client can ring every doorbell, and a command rung between the
    /// creation and a later restriction would run unrestricted.
    ///
    /// The first Create I/O SQ for `ring` takes the preset whether or not it succeeds, so it
    /// never applies to a later queue; the returned handle removes it on drop if no Create I/O
    /// SQ took it (a creation that failed before sending one), and tells which queue it
    /// restricted; [`RestrictionPreset::keep_pending`] leaves it for a creation whose outcome is
    /// unknown. [`EmuError::RestrictionPending`] when a preset for `ring` is held already.
    pub fn preset_restriction(&self, ring: Iova, restriction: QueueRestriction) -> Result<RestrictionPreset, EmuError> {
        let (token, applied_to) =
            self.shared.core().pending_restrictions.add(ring.0, restriction).ok_or(EmuError::RestrictionPending { ring_iova: ring.0 })?;
        Ok(RestrictionPreset { shared: Arc::clone(&self.shared), token, applied_to, kept_pending: false })
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

    /// Whether the controller thread waits for transfers in flight before a command or a
    /// shutdown's write-back (tests; read without the lock that wait holds).
    #[cfg(test)]
    pub(crate) fn settling_for_tests(&self) -> bool {
        self.shared.unlocked.settling_for_tests()
    }

    fn stop_thread(&self) {
        // Also makes a zeroing under way stop at its next slice, so the thread ends within a
        // slice rather than write zeroes on, detached, into a file a new device may have open.
        self.shared.unlocked.stop();
        if let Some(thread) = self.shared.wake.thread.get() {
            thread.unpark();
        }
        let handle = self.thread.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        let Some(handle) = handle else { return };
        let deadline = Instant::now() + STOP_TIMEOUT;
        // Bounded wait: the thread checks `stopping` at least every idle_sleep_max, and a
        // zeroing between slices.
        while !handle.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        if handle.is_finished() {
            if handle.join().is_err() {
                tracing::error!("nvme-emu controller thread panicked");
            }
            // A wait for transfers gave way to the stop (`stop_asked`): what it left in flight
            // is cancelled here, after the thread ended, so the thread's end is not held up.
            self.shared.core().cancel_in_flight_for_drop();
        } else {
            tracing::error!("nvme-emu controller thread did not stop within {STOP_TIMEOUT:?}; detaching it");
        }
    }
}

/// A restriction preset for a queue not created yet ([`EmuDevice::preset_restriction`]). Drop
/// it once the creation returned: a preset no Create I/O SQ took is removed then (unless
/// [`RestrictionPreset::keep_pending`] kept it).
pub struct RestrictionPreset {
    shared: Arc<Shared>,
    token: u64,
    applied_to: Arc<OnceLock<u16>>,
    /// Set by `keep_pending`: the drop leaves the preset pending.
    kept_pending: bool,
}

impl RestrictionPreset {
    /// The I/O submission queue a Create I/O SQ created with this restriction; `None` while
    /// none did (not sent yet, failed, or sent with another ring address).
    pub fn queue_id(&self) -> Option<u16> {
        self.applied_to.get().copied()
    }

    /// Gives up the handle but leaves the preset pending, for a Create I/O SQ that was sent
    /// and may still execute (it timed out: its outcome is unknown). Dropping the handle would
    /// remove the preset, and a creation executing late would then make an unrestricted queue
    /// on the ring. The first Create I/O SQ for the ring takes it, as ever.
    ///
    /// Only for a ring the host never uses again: the kept preset would otherwise restrict
    /// (or, its ring being held, refuse with [`EmuError::RestrictionPending`]) a later queue
    /// there. The driver keeps such a ring for good after a timed-out creation (its IOVA is
    /// never mapped again), so the kept presets are bounded by the rings, and queue ids, the
    /// host leaked.
    pub fn keep_pending(mut self) {
        self.kept_pending = true;
    }
}

impl std::fmt::Debug for RestrictionPreset {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("RestrictionPreset").field("token", &self.token).field("queue_id", &self.queue_id()).finish()
    }
}

impl Drop for RestrictionPreset {
    fn drop(&mut self) {
        if !self.kept_pending {
            self.shared.core().pending_restrictions.remove(self.token);
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

    /// Synchronous, as [`EmuDevice::power_loss`] is: a host-side call (VFIO's reset ioctl also
    /// returns when the reset is done), not a register write; see `ControllerCore::function_reset`.
    fn function_reset(&self) -> Result<(), HwError> {
        self.shared
            .core_preempting()
            .function_reset()
            .map_err(|error| HwError::Backend { backend: "nvme-emu", message: format!("function reset: {error}") })
    }
}

/// The controller thread: scan, and back off while idle.
fn run(shared: &Shared) {
    const ANNOUNCE_AT: u32 = SPIN_SCANS + YIELD_SCANS;
    let mut idle_scans: u32 = 0;
    let mut sleep = FIRST_SLEEP;
    while !shared.unlocked.stopping() {
        let now = Instant::now();
        let (worked, sleep_cap) = {
            let mut core = shared.lock_core();
            (core.poll(now), core.sleep_bound(now))
        };
        if shared.unlocked.callers_waiting() {
            // A host-side call (stats(), a restriction, a power loss) waits for the lock just
            // released; the mutex is not fair, and this thread would retake it at once (a long
            // zeroing's next slice, say): let the call take it first, for a bounded time.
            let until = Instant::now() + CALLER_HANDOFF;
            while shared.unlocked.callers_waiting() && Instant::now() < until {
                std::thread::yield_now();
            }
        }
        if worked {
            if idle_scans >= ANNOUNCE_AT {
                shared.wake.end_sleep();
            }
            idle_scans = 0;
            sleep = FIRST_SLEEP;
            continue;
        }
        idle_scans = idle_scans.saturating_add(1);
        if idle_scans < SPIN_SCANS {
            std::hint::spin_loop();
        } else if idle_scans < ANNOUNCE_AT {
            std::thread::yield_now();
        } else if idle_scans == ANNOUNCE_AT {
            // Announce the sleep once per idle period; the scan at the top of the loop comes
            // after the announcement, so a doorbell rung before it is found there and one rung
            // after it sees `sleeping` and unparks us.
            shared.wake.announce_sleep();
        } else {
            std::thread::park_timeout(sleep.min(sleep_cap));
            sleep = (sleep * 2).min(sleep_cap.max(FIRST_SLEEP));
        }
    }
}
