//! The real driver against the software controller with fault injection: teardown and reset
//! never free memory a live queue can still write, and a queue pair from before a reset can
//! never ring a doorbell (whose queue id a new pair may hold by then).
//!
//! Each test opens with its goal; every wait has a deadline.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::hw::{DeviceBackend, DmaAllocator};
use nvme_driver::spec::registers::{self, ControllerStatus};
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{AdminOpcode, NvmeStatus};
use nvme_driver::{Controller, ControllerConfig, DataSegment, IoQueuePair, Iova, Lba, NvmeError, QueueId};
use nvme_emu::{Backing, EmuConfig, EmuDevice, FaultAction, FaultPlan, FaultRule};

mod common;
use common::hooked_backend;

const TIMEOUT: Duration = Duration::from_secs(5);

fn device() -> Arc<EmuDevice> {
    EmuDevice::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 })).expect("software controller")
}

fn controller(device: &Arc<EmuDevice>) -> Controller {
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let config = ControllerConfig { admin_timeout: Duration::from_millis(300), ..ControllerConfig::default() };
    Controller::init(backend, config).expect("bring-up")
}

/// Whether the controller can still reach `iova` (a freed ring no longer translates).
fn is_mapped(device: &EmuDevice, iova: Iova) -> bool {
    device.dma_pool().translate(iova, 64).is_ok()
}

fn rings(queue: &IoQueuePair) -> [Iova; 2] {
    [queue.submission_iova(), queue.completion_iova()]
}

/// Round-trips one 4 KiB block through `queue`.
fn write_and_read(controller: &Controller, queue: &mut IoQueuePair, lba: u64, byte: u8) {
    let namespace = controller.namespaces()[0];
    let buffer = controller.dma().allocate(4096).expect("buffer");
    buffer.fill(0, 4096, byte).expect("fill");
    let segment = [DataSegment::new(buffer.iova(), 4096)];
    queue.write(namespace.id, Lba(lba), &segment, false, TIMEOUT).expect("write");
    buffer.fill(0, 4096, 0).expect("clear");
    queue.read(namespace.id, Lba(lba), &segment, TIMEOUT).expect("read");
    let mut data = vec![0u8; 4096];
    buffer.read(0, &mut data).expect("copy out");
    assert!(data.iter().all(|&value| value == byte), "block {lba} read back");
}

#[test]
fn a_failed_submission_queue_deletion_leaks_the_rings_and_keeps_the_queue_id() {
    // Goal: when Delete I/O SQ fails, dropping the pair must not free its rings (the controller
    // still owns the queue and may write them) nor hand its id out again; the leak is counted.
    let device = device();
    let controller = controller(&device);
    let queue = controller.create_io_queue_pair(16).expect("queue pair");
    assert_eq!(queue.id(), QueueId(1));
    let rings = rings(&queue);
    let internal = NvmeStatus::generic(codes::INTERNAL_ERROR);
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_admin(
        1,
        AdminOpcode::DeleteIoSubmissionQueue,
        FaultAction::Status(internal),
    )));
    drop(queue);
    assert_eq!(controller.leaked_queue_pairs(), 1);
    assert!(controller.leaked_bytes() >= 3 * 4096);
    for iova in &rings {
        assert!(is_mapped(&device, *iova), "ring at {iova} was freed while the controller still has the queue");
    }
    let next = controller.create_io_queue_pair(16).expect("another pair");
    assert_eq!(next.id(), QueueId(2), "queue id 1 is still in use on the controller");
}

#[test]
fn a_failed_completion_queue_deletion_leaks_too() {
    // Goal: the SQ went, but the CQ stays on the controller: its memory must stay ours.
    let device = device();
    let controller = controller(&device);
    let queue = controller.create_io_queue_pair(16).expect("queue pair");
    let rings = rings(&queue);
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_admin(
        1,
        AdminOpcode::DeleteIoCompletionQueue,
        FaultAction::Status(NvmeStatus::generic(codes::INTERNAL_ERROR)),
    )));
    drop(queue);
    assert_eq!(controller.leaked_queue_pairs(), 1);
    assert!(rings.iter().all(|iova| is_mapped(&device, *iova)));
    assert_eq!(controller.create_io_queue_pair(16).expect("another pair").id(), QueueId(2));
}

#[test]
fn a_deletion_that_times_out_leaks() {
    // Goal: a Delete I/O SQ that never completes is a failure like any other: `delete` hands
    // the pair back, dropping it keeps the rings; a reset afterwards recovers the controller.
    let device = device();
    let mut controller = controller(&device);
    let queue = controller.create_io_queue_pair(16).expect("queue pair");
    let rings = rings(&queue);
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_admin(
        1,
        AdminOpcode::DeleteIoSubmissionQueue,
        FaultAction::DropCompletion,
    )));
    let undeleted = queue.delete().expect_err("the deletion timed out");
    assert!(matches!(undeleted.source, NvmeError::Timeout { .. }), "{}", undeleted.source);
    drop(undeleted);
    assert_eq!(controller.leaked_queue_pairs(), 1);
    assert!(rings.iter().all(|iova| is_mapped(&device, *iova)), "a ring was freed after a deletion that never completed");
    device.set_faults(FaultPlan::none());
    controller.reset(false).expect("reset recovers the admin queue");
    let mut queue = controller.create_io_queue_pair(16).expect("queue pair after the reset");
    write_and_read(&controller, &mut queue, 2, 0x77);
}

#[test]
fn an_explicit_delete_that_failed_can_be_retried() {
    // Goal: `delete` returns the pair on failure; a retry that succeeds frees it, no leak.
    let device = device();
    let controller = controller(&device);
    let queue = controller.create_io_queue_pair(16).expect("queue pair");
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_admin(
        1,
        AdminOpcode::DeleteIoCompletionQueue,
        FaultAction::Status(NvmeStatus::generic(codes::INTERNAL_ERROR)),
    )));
    let undeleted = queue.delete().expect_err("the first deletion fails");
    assert_eq!(undeleted.source.status(), Some(NvmeStatus::generic(codes::INTERNAL_ERROR)));
    undeleted.pair.delete().expect("the retry deletes the CQ (the SQ went the first time)");
    assert_eq!(controller.leaked_queue_pairs(), 0);
    assert_eq!(controller.create_io_queue_pair(16).expect("pair").id(), QueueId(1), "the id was released");
}

#[test]
fn a_stale_pair_cannot_ring_the_doorbell_of_the_pair_that_reused_its_id() {
    // Goal: after reset, queue ids start again from 1; the old pair's doorbell (directly, or
    // through complete_all, reap, wait) must be refused, or the controller would run the new
    // pair's SQ slots (zeroed entries here).
    let device = device();
    let mut controller = controller(&device);
    let namespace = controller.namespaces()[0];
    let mut stale = controller.create_io_queue_pair(16).expect("queue pair");
    stale.submit_flush(namespace.id, 1).expect("queued before the reset");
    controller.reset(false).expect("reset");
    let mut fresh = controller.create_io_queue_pair(16).expect("new pair");
    assert_eq!(fresh.id(), stale.id(), "the new pair got the old id");
    let before = device.stats();
    assert!(matches!(stale.ring_doorbell(), Err(NvmeError::QueueStale { .. })));
    assert!(matches!(stale.complete_all(Duration::from_millis(100)), Err(NvmeError::QueueStale { .. })));
    assert!(matches!(stale.reap(16, |_| {}), Err(NvmeError::QueueStale { .. })));
    assert!(matches!(stale.wait_idle(Instant::now() + Duration::from_millis(50), |_| {}), Err(NvmeError::QueueStale { .. })));
    std::thread::sleep(Duration::from_millis(20)); // let the controller thread scan the doorbells
    let after = device.stats();
    assert_eq!(after.zeroed_entries_fetched, 0, "the controller fetched slots nobody wrote");
    assert_eq!(after.commands_on_queue(fresh.id().0), before.commands_on_queue(fresh.id().0), "the stale doorbell moved queue 1");
    write_and_read(&controller, &mut fresh, 3, 0x5A);
    drop(stale);
    assert_eq!(controller.leaked_queue_pairs(), 0, "the reset saw the controller stop: the stale rings may go");
}

/// Where a register write pauses: writes to one armed offset stop inside the write, once, for
/// `pause` — the window between a generation check and the store that a reset on another thread
/// must not slip into.
struct Pause {
    armed_offset: AtomicUsize,
    entered: std::sync::Mutex<Option<mpsc::Sender<()>>>,
    pause: Duration,
    paused: AtomicBool,
}

impl Pause {
    fn before_write32(&self, offset: usize) {
        if offset == self.armed_offset.load(Ordering::SeqCst) && !self.paused.swap(true, Ordering::SeqCst) {
            if let Some(entered) = self.entered.lock().unwrap().take() {
                let _ = entered.send(());
            }
            std::thread::sleep(self.pause);
        }
    }
}

#[test]
fn a_reset_waits_for_a_doorbell_write_in_progress_on_another_thread() {
    // Goal: a pair rings on thread T and the controller is reset on the main thread while T is
    // between its check and its store (held there for 200 ms). The reset must wait for that
    // store, so it lands on the old queue (which the reset then deletes), never on the queue a
    // new pair creates with the same id. Without the gate, the store lands after the new pair
    // was created and the controller fetches the new pair's zeroed slot 0.
    let device = device();
    let (mut controller, pause, entered) = pausing_controller(&device, Duration::from_millis(200));
    let namespace = controller.namespaces()[0];
    let mut old = controller.create_io_queue_pair(16).expect("queue pair");
    let stride = controller.capabilities().doorbell_stride_log2();
    pause.armed_offset.store(registers::doorbell_offset(old.id().0, false, stride), Ordering::SeqCst);
    old.submit_flush(namespace.id, 7).expect("queued");
    let ringer = std::thread::spawn(move || {
        let rang = old.ring_doorbell();
        (rang, old)
    });
    entered.recv_timeout(TIMEOUT).expect("the ringer reached the doorbell write");
    controller.reset(false).expect("reset");
    let mut fresh = controller.create_io_queue_pair(16).expect("new pair");
    let (rang, mut old) = ringer.join().expect("ringer thread");
    std::thread::sleep(Duration::from_millis(20)); // let the controller thread scan the doorbells
    assert_eq!(device.stats().zeroed_entries_fetched, 0, "a doorbell write from before the reset ran the new pair's empty slots");
    assert!(rang.is_ok(), "the write in progress completed before the reset began: {rang:?}");
    assert!(matches!(old.submit_flush(namespace.id, 8), Err(NvmeError::QueueStale { .. })));
    assert!(matches!(old.ring_doorbell(), Err(NvmeError::QueueStale { .. })));
    write_and_read(&controller, &mut fresh, 5, 0xC3);
    drop(old);
    assert_eq!(controller.leaked_queue_pairs(), 0);
}

/// A controller whose register writes go through a [`Pause`], and the pause to arm.
fn pausing_controller(device: &Arc<EmuDevice>, pause: Duration) -> (Controller, Arc<Pause>, mpsc::Receiver<()>) {
    let (entered_sender, entered) = mpsc::channel();
    let armed = Arc::new(Pause {
        armed_offset: AtomicUsize::new(usize::MAX),
        entered: std::sync::Mutex::new(Some(entered_sender)),
        pause,
        paused: AtomicBool::new(false),
    });
    let hooked = Arc::clone(&armed);
    let backend = hooked_backend(device, Box::new(move |offset| hooked.before_write32(offset)));
    let config = ControllerConfig { admin_timeout: Duration::from_secs(2), ..ControllerConfig::default() };
    (Controller::init(backend, config).expect("bring-up"), armed, entered)
}

#[test]
fn a_pair_dropped_while_a_reset_disables_the_controller_waits_for_the_outcome() {
    // Goal: a pair dropped on another thread while a reset is between clearing CC.EN and seeing
    // CSTS.RDY = 0 must not decide its rings' fate from the half-done reset: it waits, learns
    // the queues are gone, and frees them (no leak). Deciding early would leak them for nothing.
    let device = device();
    let (mut controller, pause, entered) = pausing_controller(&device, Duration::from_millis(200));
    let pair = controller.create_io_queue_pair(16).expect("queue pair");
    pause.armed_offset.store(registers::CC, Ordering::SeqCst);
    let dropper = std::thread::spawn(move || {
        entered.recv_timeout(TIMEOUT).expect("the reset reached its CC write");
        drop(pair);
    });
    controller.reset(false).expect("reset");
    dropper.join().expect("dropper thread");
    assert_eq!(controller.leaked_queue_pairs(), 0, "the pair leaked its rings although the reset stopped the controller");
}

#[test]
fn dropping_the_controller_disables_it_before_its_memory_goes() {
    // Goal: Controller's drop leaves CC.EN = 0 and CSTS.RDY = 0 (a controller left enabled would
    // keep writing admin rings that are about to be freed), and a pair that outlives it cannot
    // ring and frees its rings without leaking (the controller was seen to stop).
    let device = device();
    let controller = controller(&device);
    let namespace = controller.namespaces()[0];
    let mut survivor = controller.create_io_queue_pair(8).expect("queue pair");
    assert!(ControllerStatus(device.registers().read32(registers::CSTS)).ready());
    drop(controller);
    let status = ControllerStatus(device.registers().read32(registers::CSTS));
    assert!(!status.ready(), "CSTS.RDY is still 1 after the controller was dropped: {status:?}");
    assert_eq!(device.registers().read32(registers::CC) & 1, 0, "CC.EN is still 1");
    assert!(matches!(survivor.submit_flush(namespace.id, 1), Err(NvmeError::QueueStale { .. })));
    assert!(matches!(survivor.ring_doorbell(), Err(NvmeError::QueueStale { .. })));
    assert!(survivor.controller_was_reset());
    drop(survivor);
    // A new controller on the same device works: nothing was left behind.
    let controller = self::controller(&device);
    let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
    write_and_read(&controller, &mut queue, 1, 0x11);
    assert_eq!(controller.leaked_queue_pairs(), 0);
}

#[test]
fn a_detached_pair_whose_deletion_fails_keeps_its_rings() {
    // Goal: the same rule for queues another agent drives: a failed delete leaks, counted.
    let device = device();
    let controller = controller(&device);
    let pair = controller.create_detached_queue_pair(16, None).expect("detached pair");
    let layout = pair.layout();
    device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_admin(
        1,
        AdminOpcode::DeleteIoSubmissionQueue,
        FaultAction::Status(NvmeStatus::generic(codes::INTERNAL_ERROR)),
    )));
    drop(pair);
    assert_eq!(controller.leaked_queue_pairs(), 1);
    assert!(is_mapped(&device, layout.submission_iova) && is_mapped(&device, layout.completion_iova));
    device.set_faults(FaultPlan::none());
    let pair = controller.create_detached_queue_pair(16, None).expect("detached pair");
    assert_ne!(pair.layout().id, layout.id, "the undeleted queue's id stays reserved");
    pair.delete().expect("delete");
    assert_eq!(controller.leaked_queue_pairs(), 1);
}
