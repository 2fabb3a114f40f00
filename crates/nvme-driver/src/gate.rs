//! The doorbell gate: how a controller reset and the queue pairs it makes stale agree on who may
//! still ring a doorbell, and on whether a stale pair's rings may be freed.
//!
//! Queue ids are handed out again from 1 after a reset, so a doorbell write from a pair created
//! before the reset lands on the doorbell of whichever new pair got its id: the controller then
//! runs that pair's SQ slots (zeroed entries, or stale commands). An epoch check before the
//! write does not close this: the check can pass, the reset run to completion on another thread
//! and a new pair take the id, all before the write. So the check and the write must be one
//! step as far as a reset is concerned, and a reset bumps the generation before it touches CC:
//! once `begin_reset` returned, every doorbell write of an older generation has landed (on
//! queues the reset is about to delete) and no later one can start.
//!
//! A lock around the check and the write would do that (the doorbell path held the shared side
//! of one until 2026-11-28), but a lock's release is an atomic read-modify-write, which on x86
//! waits for every earlier store to leave the CPU — the doorbell's own store among them, so
//! each doorbell write would wait for the device (or the controller thread's CPU, for the
//! software controller) to take the line. Instead each queue pair has a flag ([`Ringer`], on a
//! cache line of its own) and the check is a store-then-load handshake with the reset: the pair
//! raises its flag and reads the generation; the reset bumps the generation and waits for every
//! raised flag to drop. With
//! the flag's swap, the pair's generation load, the reset's generation store and its flag loads
//! all sequentially consistent, either the pair reads the new generation (and writes nothing)
//! or the reset sees its flag (and waits until the write is done). The pair lowers its flag
//! with a release store after the write, which costs nothing. What remains per doorbell is one
//! locked swap of a line only its thread writes, before the doorbell's store (it waits for the
//! stores before it, so a doorbell's store is waited for at the pair's next doorbell, not at
//! its own). Queue pairs are owned by one thread each, so a flag has one writer.
//!
//! The gate also records which generations' queues are known to be gone from the controller:
//! a reset that saw CSTS.RDY = 0 after clearing CC.EN deleted every I/O queue (§3.7.2), one that
//! did not (a timeout, a device that vanished) leaves them possibly live, and a pair of such a
//! generation must keep its rings allocated forever rather than free memory the controller may
//! still write. A reset keeps the exclusive side until it knows which ([`ResetGuard`]), so a
//! pair dropped on another thread in the meantime waits for the answer instead of leaking its
//! rings on a reset that is about to succeed. Once the reset holds the exclusive side, that
//! wait is bounded by the reset's wait for CSTS.RDY = 0, which is CAP.TO (CRTO.CRWMT never
//! bounds a disable), preceded, only on a controller found in the middle of an enable, by a
//! wait for that enable to finish: CAP.TO when it is an earlier reset's enable that already ran
//! out the enable bound, the enable bound (CAP.TO, or CRTO.CRWMT when larger) otherwise; a
//! reset's own wait for doorbell writes in progress is bounded by `RINGER_WAIT_MAX`: a thread
//! stopped inside a write makes the reset fail (its generation's pairs then keep their rings)
//! rather than hold the gate forever.
//!
//! Before that, the reset waits for the exclusive side: for every queue deletion in progress,
//! which holds the shared side throughout (`AdminShared::retire_queue_pair`: two admin
//! commands, each bounded by the admin timeout, the deletions taking the admin queue in turn),
//! so up to about `2n + 1` admin timeouts for `n` pairs being deleted (see
//! `Controller::reset`). std's `RwLock` on Linux lets no new reader in while a writer waits, so
//! in the meantime every other pair's drop or deletion and every fate query
//! (`IoQueuePair::controller_was_reset`, `DetachedQueuePair::is_live`) waits as well: for those
//! deletions, then for the reset's own waits above — not one admin timeout, nor CAP.TO.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};
use std::time::{Duration, Instant};

use crate::error::NvmeError;
use crate::types::QueueId;

/// How long a reset waits for doorbell writes in progress before it gives up. A write is a few
/// stores (with shadow doorbells, a fence and a load more): microseconds, or a scheduler's
/// timeslice or two (milliseconds) for a thread preempted inside it. Only a stopped thread
/// (a debugger, SIGSTOP, a page fault on swapped-out memory) takes seconds, and the reset
/// holds the gate's exclusive side meanwhile, stalling every pair's drop and fate query: two
/// seconds keeps a loaded machine's preemptions well inside and a stuck one from stalling
/// the process for long.
const RINGER_WAIT_MAX: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy)]
struct GateState {
    /// Bumped by every reset (and by the controller's drop) before it touches CC.
    generation: u64,
    /// Every queue created in a generation below this one is gone from the controller: a
    /// disable that began in this generation reached CSTS.RDY = 0.
    quiesced_below: u64,
}

/// Where a queue pair of some generation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QueueFate {
    /// Created in the current generation: the queues exist on the controller.
    Live,
    /// A reset since then disabled the controller: the queues are gone, the rings are ours again.
    Gone,
    /// A reset since then could not confirm the controller stopped: the queues may still be
    /// live there, and their rings must never be freed.
    MaybeLive,
}

/// Shared by a controller and its queue pairs (see the module documentation).
#[derive(Debug)]
pub(crate) struct DoorbellGate {
    state: RwLock<GateState>,
    /// A copy of `state.generation`, written by a reset under the exclusive side: the deciding
    /// check of a doorbell write (see the module documentation) and the cheap early check of
    /// submit paths.
    generation_now: AtomicU64,
    /// Every live pair's flag, for a reset to wait on. Locked only to register a pair and by a
    /// reset, never by a doorbell write.
    ringers: Mutex<Vec<Weak<RingFlag>>>,
    /// [`RINGER_WAIT_MAX`], shorter in tests.
    ringer_wait_max: Duration,
}

/// A queue pair's flag at the gate: raised while the pair checks the generation and writes a
/// doorbell (see the module documentation).
#[derive(Debug)]
pub(crate) struct Ringer {
    ringing: Arc<RingFlag>,
}

/// A ringer's flag, alone on its cache line: flags of pairs created one after another would
/// otherwise share a line, and two threads driving two pairs would pass it back and forth on
/// every doorbell.
#[derive(Debug, Default)]
#[repr(align(64))]
struct RingFlag(AtomicBool);

impl std::ops::Deref for RingFlag {
    type Target = AtomicBool;

    fn deref(&self) -> &AtomicBool {
        &self.0
    }
}

#[cfg(test)]
impl Ringer {
    /// Raises the flag and leaves it up: a thread stopped inside a doorbell write, for tests.
    pub(crate) fn raise_and_stop(&self) {
        self.ringing.store(true, Ordering::SeqCst);
    }
}

/// Lowers a ringer's flag when the doorbell write is over, however it ended.
struct Lowered<'a>(&'a AtomicBool);

impl Drop for Lowered<'_> {
    fn drop(&mut self) {
        // Release: the doorbell's store is visible before a reset sees the flag down.
        self.0.store(false, Ordering::Release);
    }
}

/// The shared side of the gate, held while a pair deletes its queues, so that a reset cannot
/// disable the controller under an admin command of a generation it is about to end.
pub(crate) struct GateHold<'a> {
    state: RwLockReadGuard<'a, GateState>,
}

impl GateHold<'_> {
    pub(crate) fn fate(&self, generation: u64) -> QueueFate {
        fate(&self.state, generation)
    }
}

fn fate(state: &GateState, generation: u64) -> QueueFate {
    if generation == state.generation {
        QueueFate::Live
    } else if generation < state.quiesced_below {
        QueueFate::Gone
    } else {
        QueueFate::MaybeLive
    }
}

impl DoorbellGate {
    pub(crate) fn new() -> Self {
        Self {
            state: RwLock::new(GateState { generation: 0, quiesced_below: 0 }),
            generation_now: AtomicU64::new(0),
            ringers: Mutex::new(Vec::new()),
            ringer_wait_max: RINGER_WAIT_MAX,
        }
    }

    /// A gate whose resets wait at most `ringer_wait_max` for a doorbell write in progress.
    #[cfg(test)]
    pub(crate) fn with_ringer_wait_max(ringer_wait_max: Duration) -> Self {
        Self { ringer_wait_max, ..Self::new() }
    }

    /// A flag for a new queue pair, which every reset from now on waits on while it is raised.
    pub(crate) fn register(&self) -> Ringer {
        let ringing = Arc::new(RingFlag::default());
        let mut ringers = self.ringers.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // Bounded by the live pairs: the flags of dropped pairs go here.
        ringers.retain(|flag| flag.strong_count() > 0);
        ringers.push(Arc::downgrade(&ringing));
        Ringer { ringing }
    }

    fn read(&self) -> RwLockReadGuard<'_, GateState> {
        // The state is two integers written together under the lock: a panic elsewhere cannot
        // leave it torn, so a poisoned lock is still good.
        self.state.read().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The current generation (new queue pairs are created in it).
    pub(crate) fn generation(&self) -> u64 {
        self.read().generation
    }

    /// Cheap check for submit paths: false once a reset began after `generation`. A pair that
    /// passes may still be stale by the time it rings; the doorbell write checks again.
    pub(crate) fn is_current_hint(&self, generation: u64) -> bool {
        self.generation_now.load(Ordering::Acquire) == generation
    }

    /// Runs `write` — a doorbell write, with its fence and, when shadow doorbells are on, its
    /// shadow and EventIdx accesses (see `crate::queue`) — if `generation` is still current, with
    /// `ringer`'s flag raised from before the check until after the write.
    pub(crate) fn ring(
        &self,
        generation: u64,
        ringer: &Ringer,
        queue: QueueId,
        write: impl FnOnce() -> Result<(), NvmeError>,
    ) -> Result<(), NvmeError> {
        // Both sequentially consistent, pairing with the generation's store and the flags'
        // loads in `begin_reset`: the flag is up before the generation is read. (On x86 the swap
        // is one locked instruction, cheaper there than a store followed by `mfence`.)
        ringer.ringing.swap(true, Ordering::SeqCst);
        let _lowered = Lowered(&ringer.ringing);
        if self.generation_now.load(Ordering::SeqCst) != generation {
            return Err(NvmeError::QueueStale { queue });
        }
        write()
    }

    /// Holds the shared side (see [`GateHold`]).
    pub(crate) fn hold(&self) -> GateHold<'_> {
        GateHold { state: self.read() }
    }

    /// Where a pair created in `generation` stands now.
    pub(crate) fn fate(&self, generation: u64) -> QueueFate {
        fate(&self.read(), generation)
    }

    /// Ends the current generation: waits for every doorbell write and queue deletion in
    /// progress, then makes every pair of this and older generations stale. Called before a
    /// reset or teardown touches CC. The returned guard keeps the exclusive side until the
    /// caller knows whether the controller stopped, so that no pair decides its rings' fate
    /// (free or leak) from a reset still in progress.
    ///
    /// If a doorbell write is still in progress after [`RINGER_WAIT_MAX`] (its thread is
    /// stopped), fails with [`NvmeError::ResetBlockedByDoorbellWrite`] and releases the
    /// exclusive side: the generation stays ended (no pair of it rings again, except that
    /// write), but is not marked quiesced, so its pairs stay [`QueueFate::MaybeLive`] and keep
    /// their rings. The caller must then leave CC alone if it would enable the controller
    /// again: the late write could land on a queue id a new pair holds.
    pub(crate) fn begin_reset(&self) -> Result<ResetGuard<'_>, NvmeError> {
        let mut state = self.state.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        state.generation += 1;
        // Sequentially consistent, like the flags' loads after it and the swap and load in
        // `ring`: the new generation is out before any flag is read.
        self.generation_now.store(state.generation, Ordering::SeqCst);
        match self.wait_for_ringers() {
            Ok(()) => Ok(ResetGuard { state }),
            Err(waited) => {
                drop(state);
                let waited_ms = waited.as_millis() as u64;
                tracing::error!(
                    waited_ms,
                    "controller reset gave up waiting for a doorbell write in progress on another thread: the queue pairs of before \
                     the reset keep their rings until a later reset succeeds"
                );
                Err(NvmeError::ResetBlockedByDoorbellWrite { waited_ms })
            }
        }
    }

    /// Ends the current generation without waiting for ringers: what a pair sees when a reset
    /// began just after its flag dropped (tests place that moment inside a register write).
    #[cfg(test)]
    pub(crate) fn end_generation_unwaited(&self) {
        let mut state = self.state.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        state.generation += 1;
        self.generation_now.store(state.generation, Ordering::SeqCst);
    }

    /// Waits until no pair is in the middle of a doorbell write, at most `ringer_wait_max` for
    /// all of them together. A write is a few stores (its thread may be preempted in it, hence
    /// the yields); every pair that raises its flag from now on reads the new generation and
    /// lowers it without writing. `Err` with the time waited when a flag is still up at the
    /// bound: the caller must not proceed as if no stale write could land (see `begin_reset`).
    fn wait_for_ringers(&self) -> Result<(), Duration> {
        let ringers = self.ringers.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let started = Instant::now();
        for flag in ringers.iter().filter_map(Weak::upgrade) {
            let mut spins = 0u32;
            while flag.load(Ordering::SeqCst) {
                spins = spins.saturating_add(1);
                if spins < 64 {
                    std::hint::spin_loop();
                    continue;
                }
                let waited = started.elapsed();
                if waited >= self.ringer_wait_max {
                    return Err(waited);
                }
                std::thread::yield_now();
            }
        }
        Ok(())
    }
}

/// The exclusive side of the gate, held by a reset or teardown from the generation bump until
/// the controller was seen to stop (or the attempt failed). Dropping it without
/// [`ResetGuard::mark_quiesced`] leaves the older generations' queues possibly live.
pub(crate) struct ResetGuard<'a> {
    state: RwLockWriteGuard<'a, GateState>,
}

impl ResetGuard<'_> {
    /// Records that the controller reached CSTS.RDY = 0 after CC.EN was cleared in this reset:
    /// every queue of an older generation is gone.
    pub(crate) fn mark_quiesced(mut self) {
        self.state.quiesced_below = self.state.generation;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::RegisterIo;
    use std::sync::atomic::AtomicU32;
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    /// Registers that record the last doorbell value and sleep inside the write, to widen the
    /// window between the generation check and the store.
    #[derive(Default)]
    struct SlowRegisters {
        last: AtomicU32,
    }

    impl RegisterIo for SlowRegisters {
        fn len(&self) -> usize {
            0x2000
        }
        fn read32(&self, _offset: usize) -> u32 {
            self.last.load(Ordering::SeqCst)
        }
        fn write32(&self, _offset: usize, value: u32) {
            std::thread::sleep(Duration::from_millis(50));
            self.last.store(value, Ordering::SeqCst);
        }
        fn read64(&self, _offset: usize) -> u64 {
            0
        }
        fn write64(&self, _offset: usize, _value: u64) {}
    }

    #[test]
    fn fates_follow_resets_and_quiesce() {
        // Goal: a pair is live in its generation, gone after a reset that quiesced the
        // controller, and possibly live after one that did not.
        let gate = DoorbellGate::new();
        assert_eq!(gate.fate(0), QueueFate::Live);
        drop(gate.begin_reset().expect("no ringer")); // a reset that never saw RDY = 0
        assert_eq!(gate.fate(0), QueueFate::MaybeLive);
        assert!(!gate.is_current_hint(0));
        gate.begin_reset().expect("no ringer").mark_quiesced(); // a retry that did
        assert_eq!((gate.fate(0), gate.fate(1), gate.fate(2)), (QueueFate::Gone, QueueFate::Gone, QueueFate::Live));
        let registers = SlowRegisters::default();
        let ringer = gate.register();
        assert!(matches!(
            gate.ring(0, &ringer, QueueId(1), || {
                registers.write32(0x1008, 7);
                Ok(())
            }),
            Err(NvmeError::QueueStale { queue: QueueId(1) })
        ));
        assert_eq!(registers.last.load(Ordering::SeqCst), 0, "a stale pair's doorbell is never written");
    }

    #[test]
    fn a_reset_waits_for_a_doorbell_write_in_progress() {
        // Goal: once begin_reset returns, no doorbell write of the old generation can land.
        let gate = Arc::new(DoorbellGate::new());
        let registers = Arc::new(SlowRegisters::default());
        let started = Arc::new(Barrier::new(2));
        let ringer = {
            let (gate, registers, started) = (Arc::clone(&gate), Arc::clone(&registers), Arc::clone(&started));
            std::thread::spawn(move || {
                let hold = gate.hold(); // keep the shared side taken until the reset is waiting
                started.wait();
                std::thread::sleep(Duration::from_millis(20));
                drop(hold);
                gate.ring(0, &gate.register(), QueueId(1), || {
                    registers.write32(0x1008, 9);
                    Ok(())
                })
            })
        };
        started.wait();
        drop(gate.begin_reset().expect("the ringer finishes"));
        let landed_before_reset = registers.last.load(Ordering::SeqCst);
        let result = ringer.join().expect("ringer thread");
        match result {
            // Rang before the reset took the lock: the write had landed when begin_reset returned.
            Ok(()) => assert_eq!(landed_before_reset, 9),
            Err(error) => {
                assert!(matches!(error, NvmeError::QueueStale { .. }));
                assert_eq!(registers.last.load(Ordering::SeqCst), 0, "no write after the reset");
            }
        }
    }

    #[test]
    fn begin_reset_returns_only_after_a_write_in_progress_landed() {
        // Goal: a pair already past the generation check when a reset begins finishes its
        // write before begin_reset returns (the reset waits on its flag), for each of several
        // pairs; and a dropped pair's flag is forgotten.
        let gate = Arc::new(DoorbellGate::new());
        drop(gate.register());
        let registers: Vec<Arc<SlowRegisters>> = (0..3).map(|_| Arc::new(SlowRegisters::default())).collect();
        let inside = Arc::new(Barrier::new(registers.len() + 1));
        let ringers: Vec<_> = registers
            .iter()
            .enumerate()
            .map(|(index, registers)| {
                let (gate, registers, inside) = (Arc::clone(&gate), Arc::clone(registers), Arc::clone(&inside));
                let ringer = gate.register();
                std::thread::spawn(move || {
                    gate.ring(0, &ringer, QueueId(1 + index as u16), || {
                        inside.wait();
                        registers.write32(0x1008, 11); // sleeps 50 ms, then stores
                        Ok(())
                    })
                })
            })
            .collect();
        assert_eq!(gate.ringers.lock().unwrap().len(), registers.len(), "the dropped pair's flag was pruned");
        inside.wait();
        drop(gate.begin_reset().expect("the ringers finish"));
        for (index, registers) in registers.iter().enumerate() {
            assert_eq!(registers.last.load(Ordering::SeqCst), 11, "pair {index}: begin_reset returned before its write landed");
        }
        for ringer in ringers {
            assert!(ringer.join().expect("ringer thread").is_ok());
        }
    }

    #[test]
    fn a_reset_gives_up_on_a_ringer_that_never_finishes() {
        // Goal: a thread stopped inside a doorbell write (here blocked on a channel) cannot
        // make a reset, and so every fate()/hold() and every pair's drop behind its exclusive
        // side, wait forever: the reset gives up within its bound, without marking the older
        // generations quiesced (their pairs stay MaybeLive and keep their rings), and the gate
        // is free again for everyone else.
        let gate = Arc::new(DoorbellGate::with_ringer_wait_max(Duration::from_millis(200)));
        let (inside_sender, inside) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let ringer = {
            let gate = Arc::clone(&gate);
            let ringer = gate.register();
            std::thread::spawn(move || {
                gate.ring(0, &ringer, QueueId(1), || {
                    inside_sender.send(()).expect("main thread");
                    released.recv().expect("released");
                    Ok(())
                })
            })
        };
        inside.recv_timeout(Duration::from_secs(10)).expect("the ringer is inside its write");
        let (done_sender, done) = std::sync::mpsc::channel();
        let resetter = {
            let gate = Arc::clone(&gate);
            std::thread::spawn(move || {
                let started = Instant::now();
                let outcome = gate.begin_reset().map(drop);
                done_sender.send((started.elapsed(), outcome)).expect("main thread");
            })
        };
        // Watchdog: well past the bound, so that an unbounded wait fails here, not the run.
        let waited = done.recv_timeout(Duration::from_secs(10));
        release.send(()).expect("ringer");
        assert!(ringer.join().expect("ringer thread").is_ok(), "the write past its check completes");
        let (waited, outcome) = waited.expect("begin_reset is still waiting for the stopped ringer");
        resetter.join().expect("resetter thread");
        assert!(
            matches!(outcome, Err(NvmeError::ResetBlockedByDoorbellWrite { waited_ms }) if waited_ms >= 200),
            "{outcome:?} after {waited:?}"
        );
        assert_eq!(gate.fate(0), QueueFate::MaybeLive, "a reset that could not wait must not mark the old queues gone");
        assert!(!gate.is_current_hint(0), "the old generation stays ended");
        // Once the ringer is done, a reset goes through and can confirm the old queues gone.
        gate.begin_reset().expect("no ringer left").mark_quiesced();
        assert_eq!(gate.fate(0), QueueFate::Gone);
    }
}
