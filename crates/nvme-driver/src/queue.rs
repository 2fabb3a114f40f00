//! A submission/completion queue pair (§3.3.1): the SQ tail, the CQ head and phase tag, command
//! slots with generation-tagged command ids, batched doorbells and bounded polling.
//!
//! Memory ordering. Submission: entries are copied into the SQ (with non-temporal stores on
//! x86_64, [`crate::DmaRegion::write_entry_streaming`]: the slot's line is not read for
//! ownership first, which is what a slot the controller read last would wait for), then a store
//! fence ([`crate::hw::fence_before_submission_doorbell`]: `sfence` / `dsb st`, not a Release
//! fence, which orders neither those weakly ordered stores on x86 nor stores against a PCIe
//! device on Arm), then one doorbell write for the whole batch, so the controller never sees a
//! tail that covers an unwritten entry. Completion:
//! dword 3 of the entry at the head (command id, status, phase) is loaded with Acquire; only when
//! its phase matches the expected one is the rest of the entry read, after a load barrier
//! ([`crate::hw::fence_after_completion_phase`]: `dmb oshld` on Arm, where the Acquire load
//! orders later loads only within the inner shareable domain, which a PCIe device is not in;
//! a compiler barrier on x86), so the read cannot observe an entry older than the phase it
//! carries. The CQ head doorbell is written after the entries
//! were consumed and a fence ([`crate::hw::fence_before_completion_doorbell`]) made those loads
//! complete, so the controller cannot reuse a slot still being read: once per reap batch on the
//! admin queue and on attached pairs; on I/O queues the driver created, only when it is needed
//! (`completion_doorbell_needed`: the controller could otherwise run short of CQ entries), and
//! then after the SQ tail of the same ring, as SPDK's pollers order them.
//!
//! Doorbells of I/O queue pairs go through the controller's [`DoorbellGate`]: a pair whose
//! controller was reset since it was created cannot ring (see `gate.rs`). With shadow doorbells
//! on (`shadow.rs`), each doorbell value goes to the pair's shadow slot first, and the MMIO
//! write follows only when the controller's EventIdx asks for it.
//!
//! Untrusted completions. Every completion is checked before it is believed: its SQ id names
//! this queue, its SQ head names a slot the controller could have consumed (from the last head
//! it reported up to the tail we published), its command id names a slot in flight with the
//! current generation, and that head has passed the command's own SQ entry (§4.6: SQHD counts
//! the entries consumed, so a command completes only once it was fetched; the pair sums the
//! heads' advances in `sq_consumed` and records each command's place in `Slot::sq_entry`).
//! A controller posts a completion after fetching its command and reports the head it had when
//! it created the entry (§4.6), as QEMU's controller, `nvme-emu` and the fake do. Nothing makes
//! it post entries in the order it created them, so a completion naming a command in flight may
//! also report a head behind the last one reported, as long as that head lies in the command's
//! own window (just past its entry up to the tail we published): it is believed, and heads
//! only move forward by their place in the stream of SQ entries (`sq_consumed`), not by their
//! ring index: a head behind the last one leaves it where it was, and so does any head of a
//! command published more than a ring ago, whose place the ring index cannot tell (see
//! `accept_submission_head`). A completion naming no command in flight has no window: it must
//! report a head from the last one to the tail, and that head is never applied (a duplicate's
//! old head can read as a lap forward inside that range). Nor is the head of a completion
//! that names a command but lies short of its entry (refused as `CompletionBeforeFetch`): only
//! a head in its own command's window ever moves the head. Submission also stops one
//! short of the SQ head the controller reported, not only at depth − 1 commands in flight, so
//! neither ring can overflow whatever the slot accounting says.
//!
//! Rejected completions. Each is consumed and reported by `reap` as an error, after the
//! completions before it were delivered; what else happens depends on what it breaks:
//! - its command id names no command in flight (stale, duplicated or corrupted), but its SQ id
//!   is this queue's and its SQ head lies between the last head reported and the tail we
//!   published, modulo the depth: [`NvmeError::UnexpectedCompletion`]; it completes nothing
//!   and the pair goes on (a command whose real completion this was stays in flight). A wait
//!   (`poll_until`) that meets one goes on too, and reports it once its condition holds: the
//!   commands waited for may still complete. At its deadline (checked after each such
//!   completion, so a controller posting them without end cannot hold it) it first reads what
//!   the CQ holds behind the stray (one ring's worth at most), then times out as any wait with
//!   commands in flight, and logs them. Such a completion has no command window, so that range
//!   is the only check on its head, and a head outside it fails the pair as below, even a
//!   duplicate's (or a late entry's) old head, one the controller really had: every ring index
//!   was the head at some time, so no check can tell that head from one the controller cannot
//!   have reached (past the tail: a controller fetching entries we never published). Whether a
//!   duplicate is only unexpected or fails the pair thus depends on how full the SQ is when it
//!   comes.
//!   Failing is the conservative choice: that head is all the entry says about the
//!   controller's view of the queue, believing it would let a controller whose view is not
//!   ours run on, and a failed pair frees nothing early (its commands still complete or keep
//!   their slots until it is deleted); a controller that posts a completion twice is off the
//!   specification anyway. The kernel does the same (`BAD_SQ_HEAD`);
//! - its SQ id is not this queue's, or its SQ head is impossible, or that head has not passed
//!   the entry of the command it names ([`NvmeError::CompletionBeforeFetch`]: the controller
//!   completed a command it has not fetched): the controller's view of the queue is not ours,
//!   so the pair is failed, and refuses new commands with
//!   [`NvmeError::QueueFailed`] until it is deleted (or, for the admin queue, the controller is
//!   reset). If its command id names a command in flight, that command's outcome is unknown:
//!   [`NvmeError::CommandOutcomeUnknown`] names it (command id, opcode, the caller's tag), and
//!   its slot stays reserved and counted in flight, so neither its scratch page nor the memory
//!   it names is reused before a deletion or reset ends it for sure. Completions of other
//!   commands are still checked and delivered; entries submitted before the failure may still
//!   be published by `ring_doorbell` (their callers were told they were queued); waits give up
//!   with `QueueFailed` once only commands of unknown outcome remain.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::datapath::{ScratchPage, SCRATCH_BYTES};
use crate::error::NvmeError;
use crate::gate::{DoorbellGate, Ringer};
use crate::hw::{self, DmaAllocator, DmaRegion, RegisterIo};
use crate::shadow::ShadowSlots;
use crate::spec::registers::{self, ControllerStatus};
use crate::spec::{CompletionEntry, NvmeStatus, SubmissionEntry, COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use crate::types::{CommandId, QueueId};

/// One finished command, as handed to the reaper's callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The caller's tag given at submission.
    pub tag: u64,
    pub command_id: CommandId,
    pub opcode: u8,
    /// Command-specific dword 0 (e.g. queues granted by Set Features).
    pub dw0: u32,
    pub status: Result<(), NvmeStatus>,
}

impl Completion {
    /// The completion as a `Result`, with the queue and command named on failure.
    pub fn into_result(self, queue: QueueId) -> Result<Completion, NvmeError> {
        match self.status {
            Ok(()) => Ok(self),
            Err(status) => Err(NvmeError::Command { queue, command_id: self.command_id, opcode: self.opcode, status }),
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    generation: u16,
    busy: bool,
    opcode: u8,
    /// The id the slot's command in flight carries (set when reserved): a completion must name
    /// exactly this one.
    command_id: u16,
    tag: u64,
    /// Where the slot's command falls in the pair's issue order ([`QueuePair::issue_sequence`]
    /// when it was reserved): a timeout names the busy slot with the smallest, the command
    /// outstanding longest. Slots are reused in the order they were freed, so the index says nothing.
    issued: u64,
    /// A completion named this command but broke the queue protocol: its outcome is unknown. The
    /// slot stays busy (never reused: the controller may still read its scratch page and move
    /// the command's data) and matches no later completion.
    outcome_unknown: bool,
    /// The command's place in the SQ's stream of entries ([`QueuePair::sq_pushed`] before it
    /// was pushed): it can complete only once the controller reported more entries consumed
    /// than that ([`QueuePair::sq_consumed`]).
    sq_entry: u64,
}

/// Where a completion's SQ head falls in its command's window
/// ([`QueuePair::place_in_command_window`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CommandWindowPlace {
    /// Its place in the SQ's stream of entries (the command was published at most a ring ago).
    Exact(u64),
    /// Some ring index lies in the window twice (published more than a ring ago): its place
    /// is not known.
    Ambiguous,
}

/// Polls between deadline checks and before the poller starts yielding the CPU.
const POLLS_PER_CHECK: u32 = 64;

/// The completions naming nothing in flight that one wait met ([`QueuePair::poll_until`]): the
/// first, kept to report, and how many. They are logged once, as the wait ends, not one line
/// each: a controller can post them as fast as they are reaped.
#[derive(Default)]
struct Strays {
    first: Option<NvmeError>,
    count: u64,
}

impl Strays {
    fn met(&mut self, error: NvmeError) {
        self.count += 1;
        self.first.get_or_insert(error);
    }

    /// The first, for a wait whose condition held; the others go to the log.
    fn reported(self, queue: QueueId) -> Option<NvmeError> {
        if self.count > 1 {
            tracing::warn!(%queue, count = self.count, "a wait whose commands completed met more than one unexpected completion (the first is reported)");
        }
        self.first
    }

    /// Logs them (if any) for a wait that ends on something else: its deadline, a failed pair,
    /// another error from `reap`.
    fn log(&self, queue: QueueId, ending: &NvmeError) {
        if let Some(first) = &self.first {
            tracing::warn!(%queue, %first, count = self.count, %ending, "a wait that met unexpected completions ended without its commands");
        }
    }
}

/// The deepest queue this driver creates. A command id is the slot index in the low bits and a
/// generation in the rest; at depth 32768 the slot index takes 15 of the 16 bits, and deeper
/// queues would leave no generation bit at all (a late completion for a slot's previous command
/// would then be taken for the current one). So deeper queues are refused, whatever CAP.MQES says.
pub const QUEUE_DEPTH_MAX: u32 = 32768;

/// The SQ tail and CQ head doorbell offsets of queue `id`, checked to lie inside a BAR0 of
/// `bar_bytes`: CAP.DSTRD comes from the device, and a stride too large for the BAR would send
/// doorbell writes (ours, or another agent's for a detached pair) outside the mapping.
pub(crate) fn doorbell_offsets(id: QueueId, doorbell_stride_log2: u8, bar_bytes: usize) -> Result<(usize, usize), NvmeError> {
    let stride_bytes = 4usize.checked_shl(u32::from(doorbell_stride_log2)).filter(|&stride| stride >= 4);
    let offset = |completion: bool| {
        let index = 2 * usize::from(id.0) + usize::from(completion);
        stride_bytes.and_then(|stride| index.checked_mul(stride)).and_then(|offset| offset.checked_add(registers::DOORBELL_BASE))
    };
    match (offset(false), offset(true)) {
        // The CQ head doorbell is the higher of the two.
        (Some(submission), Some(completion)) if completion.checked_add(4).is_some_and(|end| end <= bar_bytes) => {
            Ok((submission, completion))
        }
        (_, completion) => Err(NvmeError::DoorbellOutsideBar { queue: id, offset: completion.unwrap_or(usize::MAX), bar_bytes }),
    }
}

/// Entries from ring index `from` forward to `to` in a ring of `depth` (both below `depth`, the
/// caller's invariant or check): `(to - from) mod depth` without a division, which costs tens of
/// cycles on the submit and reap paths where this runs several times per command.
fn ring_distance(from: u32, to: u32, depth: u32) -> u32 {
    debug_assert!(from < depth && to < depth, "ring indices {from}, {to} outside depth {depth}");
    if to >= from {
        to - from
    } else {
        depth - from + to
    }
}

/// The ring index after `index` (below `depth`), wrapping to 0.
fn ring_next(index: u32, depth: u32) -> u32 {
    let next = index + 1;
    if next == depth {
        0
    } else {
        next
    }
}

/// Completion entries a reap prefetches ahead (8 lines): one batch of the usual 32, without
/// pulling in lines a deep queue's controller is still to write.
const COMPLETION_PREFETCH_ENTRIES_MAX: usize = 32;

/// The controller's generation a queue pair was created in, to check before each doorbell.
struct GateTicket {
    gate: Arc<DoorbellGate>,
    generation: u64,
    ringer: Ringer,
}

/// An SQ/CQ pair in DMA memory with its doorbells.
pub struct QueuePair {
    id: QueueId,
    depth: u32,
    submission: DmaRegion,
    completion: DmaRegion,
    scratch: DmaRegion,
    registers: Arc<dyn RegisterIo>,
    /// `None` for the admin queue (the controller owns it and clears it on reset) and for
    /// queues built by hand in tests.
    gate: Option<GateTicket>,
    sq_doorbell: usize,
    cq_doorbell: usize,
    /// This pair's shadow doorbell and EventIdx slots, when the controller uses them.
    shadow: Option<ShadowSlots>,
    sq_tail: u32,
    /// The tail the controller was last told (the last SQ doorbell value written).
    sq_tail_published: u32,
    /// The SQ head the controller last reported in a completion.
    sq_head: u32,
    /// SQ entries written since the pair was created or cleared (64 bits, so a plain count:
    /// at 10^9 commands a second it would wrap after 584 years).
    sq_pushed: u64,
    /// SQ entries the controller reported consumed: the place in the stream of the furthest
    /// head it reported (`accept_submission_head`), never moved back. A command whose entry is
    /// at `sq_entry` was fetched only if this exceeds it.
    sq_consumed: u64,
    cq_head: u32,
    /// The CQ head the controller was last told.
    cq_head_published: u32,
    /// Whether the CQ head doorbell may wait until the controller could need the entries (see
    /// [`QueuePair::completion_doorbell_needed`]); otherwise every reap that consumed something
    /// writes it.
    defer_completion_doorbell: bool,
    phase: bool,
    doorbell_pending: bool,
    slots: Vec<Slot>,
    /// Free slots, reused first-freed-first: a slot's id comes back only after every other
    /// slot was used once more, so the generation bits (as few as one at depth 32768) tell a
    /// late or duplicated completion of a slot's earlier command from its current one as long
    /// as they can. Last-freed-first handed one slot to every command at queue depth 1, and its
    /// id recurred every 2^generation_bits commands (every 2 at depth 32768).
    free: VecDeque<u16>,
    slot_bits: u32,
    /// The low `slot_bits` bits of a command id (the slot index), and what is left of a
    /// generation above them: computed once, used on every submission and completion.
    slot_mask: u16,
    generation_mask: u16,
    in_flight: usize,
    /// Commands reserved so far (the last one's [`Slot::issued`]). 64 bits: at 10^9 commands a
    /// second it would wrap after 584 years, so issue order is a plain comparison.
    issue_sequence: u64,
    /// Set by the first completion that broke the queue protocol (see [`QueuePair::reject`]):
    /// no command is submitted any more.
    failed: bool,
    /// Busy slots whose command's outcome is unknown ([`Slot::outcome_unknown`]).
    unknown_outcomes: usize,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair").field("id", &self.id).field("depth", &self.depth).field("in_flight", &self.in_flight).finish()
    }
}

impl QueuePair {
    /// Allocates the rings and one scratch page per command slot (PRP lists, SGL segments and
    /// DSM ranges live there, so nothing is allocated per command).
    pub fn allocate(
        id: QueueId,
        depth: u32,
        dma: &dyn DmaAllocator,
        registers: Arc<dyn RegisterIo>,
        doorbell_stride_log2: u8,
    ) -> Result<Self, NvmeError> {
        if !(2..=QUEUE_DEPTH_MAX).contains(&depth) {
            return Err(NvmeError::InvalidQueueDepth { requested: depth, max: QUEUE_DEPTH_MAX });
        }
        let submission = dma.allocate(depth as usize * SUBMISSION_ENTRY_BYTES)?;
        let completion = dma.allocate(depth as usize * COMPLETION_ENTRY_BYTES)?;
        let scratch = dma.allocate((depth as usize - 1) * SCRATCH_BYTES)?;
        let doorbells = doorbell_offsets(id, doorbell_stride_log2, registers.len())?;
        Ok(Self::from_regions(id, depth, [submission, completion, scratch], registers, doorbells))
    }

    /// A pair over rings that already exist on the controller (created by another process, see
    /// [`crate::IoQueuePair::attach`]): `regions` are the SQ, the CQ and one scratch page per
    /// slot; `doorbells` the SQ tail and CQ head doorbell offsets, already checked against the
    /// register space. The caller checked the depth and the ring sizes.
    pub(crate) fn from_regions(
        id: QueueId,
        depth: u32,
        regions: [DmaRegion; 3],
        registers: Arc<dyn RegisterIo>,
        doorbells: (usize, usize),
    ) -> Self {
        let [submission, completion, scratch] = regions;
        let (sq_doorbell, cq_doorbell) = doorbells;
        let slot_count = depth as usize - 1;
        let slot_bits = usize::BITS - (slot_count - 1).max(1).leading_zeros();
        Self {
            id,
            depth,
            submission,
            completion,
            scratch,
            registers,
            gate: None,
            sq_doorbell,
            cq_doorbell,
            shadow: None,
            sq_tail: 0,
            sq_tail_published: 0,
            sq_head: 0,
            sq_pushed: 0,
            sq_consumed: 0,
            cq_head: 0,
            cq_head_published: 0,
            defer_completion_doorbell: false,
            phase: true,
            doorbell_pending: false,
            slots: vec![Slot::default(); slot_count],
            free: (0..slot_count as u16).collect(),
            slot_bits,
            slot_mask: ((1u32 << slot_bits) - 1) as u16,
            generation_mask: ((1u32 << (16 - slot_bits)) - 1) as u16,
            in_flight: 0,
            issue_sequence: 0,
            failed: false,
            unknown_outcomes: 0,
        }
    }

    /// Makes every doorbell of this pair go through `gate`, valid while `generation` is the
    /// controller's current one.
    pub(crate) fn attach_gate(&mut self, gate: Arc<DoorbellGate>, generation: u64) {
        let ringer = gate.register();
        self.gate = Some(GateTicket { gate, generation, ringer });
    }

    /// Lets the CQ head doorbell wait while the controller has room for every command
    /// outstanding: for I/O queues, whose CQs are created without interrupts (an interrupt
    /// stays asserted while the head trails the tail, so the admin queue writes every head).
    pub(crate) fn defer_completion_doorbell(&mut self) {
        self.defer_completion_doorbell = true;
    }

    /// Makes every doorbell of this pair go through `slots` first (see `shadow.rs`). Set before
    /// the queue is created on the controller, with the slots zeroed.
    pub(crate) fn attach_shadow(&mut self, slots: ShadowSlots) {
        self.shadow = Some(slots);
    }

    /// Returns the queue to its just-created state (after a controller reset).
    pub fn clear(&mut self) -> Result<(), NvmeError> {
        self.completion.fill(0, self.completion.len(), 0)?;
        self.sq_tail = 0;
        self.sq_tail_published = 0;
        self.sq_head = 0;
        self.sq_pushed = 0;
        self.sq_consumed = 0;
        self.cq_head = 0;
        self.cq_head_published = 0;
        self.phase = true;
        self.doorbell_pending = false;
        for slot in &mut self.slots {
            slot.busy = false;
            slot.outcome_unknown = false;
            slot.generation = slot.generation.wrapping_add(1);
        }
        self.free = (0..self.slots.len() as u16).collect();
        self.in_flight = 0;
        self.failed = false;
        self.unknown_outcomes = 0;
        Ok(())
    }

    pub fn id(&self) -> QueueId {
        self.id
    }

    /// Entries in each ring.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Whether a completion broke the queue protocol (see [`NvmeError::QueueFailed`]): the pair
    /// takes no new command until [`QueuePair::clear`].
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// Commands submitted and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// SQ entries written since the last SQ tail doorbell: the controller cannot see them yet.
    pub fn unpublished_submissions(&self) -> usize {
        ring_distance(self.sq_tail_published, self.sq_tail, self.depth) as usize
    }

    /// Commands that can still be submitted before back-pressure: free command slots, and free
    /// SQ entries up to one short of the head the controller reported.
    pub fn free_slots(&self) -> usize {
        self.free.len().min(self.submission_room() as usize)
    }

    /// The most commands the pair holds at once (depth − 1, one command slot each).
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// SQ entries we may still fill: the ring holds depth − 1 unconsumed entries at most.
    fn submission_room(&self) -> u32 {
        let unconsumed = ring_distance(self.sq_head, self.sq_tail, self.depth);
        self.depth - 1 - unconsumed
    }

    /// Handles to the rings and scratch pages, for leaking them when the controller may still
    /// use them (a leaked handle keeps the memory for good, whatever happens to this pair).
    pub(crate) fn regions(&self) -> Vec<DmaRegion> {
        let rings = [self.submission.clone(), self.completion.clone(), self.scratch.clone()];
        rings.into_iter().chain(self.shadow.iter().flat_map(ShadowSlots::regions)).collect()
    }

    pub fn submission_iova(&self) -> crate::types::Iova {
        self.submission.iova()
    }

    pub fn completion_iova(&self) -> crate::types::Iova {
        self.completion.iova()
    }

    /// The scratch page that belongs to `command_id`'s slot (the scratch region holds one page
    /// per slot, so this fails only if that allocation was cut short).
    fn scratch_for(&self, command_id: CommandId) -> Result<ScratchPage<'_>, NvmeError> {
        let slot = usize::from(command_id.0 & self.slot_mask);
        Ok(ScratchPage::new(&self.scratch, slot * SCRATCH_BYTES)?)
    }

    fn command_id(&self, slot: u16) -> CommandId {
        let generation = self.slots[usize::from(slot)].generation & self.generation_mask;
        CommandId(slot | (u32::from(generation) << self.slot_bits) as u16)
    }

    /// Reserves a slot and returns the command id its entry must carry.
    fn reserve(&mut self, opcode: u8, tag: u64) -> Result<CommandId, NvmeError> {
        // Not `ok_or`: an error built eagerly on every submission is dropped on every one.
        let Some(slot) = self.free.pop_front() else {
            return Err(NvmeError::QueueFull { queue: self.id, depth: self.depth });
        };
        let mut command_id = self.command_id(slot);
        if command_id.0 == u16::MAX {
            // FFFFh should not be used as a command id (the CID field of the common command
            // format: the Error Information log uses it for "no particular command"). Only the
            // top slot of a ring whose slot count is a power of two reaches it, once per wrap
            // of its generation: skip that generation (a late completion of the previous one
            // still matches nothing).
            let entry = &mut self.slots[usize::from(slot)];
            entry.generation = entry.generation.wrapping_add(1);
            command_id = self.command_id(slot);
        }
        self.issue_sequence += 1;
        let entry = &mut self.slots[usize::from(slot)];
        entry.issued = self.issue_sequence;
        entry.busy = true;
        entry.opcode = opcode;
        entry.command_id = command_id.0;
        entry.tag = tag;
        self.in_flight += 1;
        Ok(command_id)
    }

    /// [`NvmeError::QueueFailed`] once a completion broke the queue protocol.
    pub(crate) fn check_not_failed(&self) -> Result<(), NvmeError> {
        if self.failed {
            return Err(NvmeError::QueueFailed { queue: self.id, unknown_outcomes: self.unknown_outcomes });
        }
        Ok(())
    }

    /// Records a completion that broke the queue protocol (`reason`: a wrong SQ id, an
    /// impossible SQ head, or a head that has not passed its command's entry) and returns the error to report. The controller's view of this queue
    /// is not ours, so the pair is failed: it takes no new command. If the completion's id names
    /// a command in flight, that command's outcome is unknown (the completion cannot be
    /// believed, nor can the command be assumed still running): its slot stays reserved, so
    /// neither its scratch page nor a new command id reuses it, and the error names the command
    /// and its tag so that its caller learns of it. It stays counted in flight until the pair is
    /// deleted or the controller reset, which end it for sure.
    fn reject(&mut self, command_id: CommandId, reason: NvmeError) -> NvmeError {
        self.failed = true;
        let index = usize::from(command_id.0 & self.slot_mask);
        let Some(slot) = self.slots.get_mut(index).filter(|slot| slot.busy && !slot.outcome_unknown && slot.command_id == command_id.0)
        else {
            return reason;
        };
        slot.outcome_unknown = true;
        self.unknown_outcomes += 1;
        tracing::error!(queue = %self.id, %command_id, tag = slot.tag, %reason, "completion breaks the queue protocol: command outcome unknown, queue pair failed");
        NvmeError::CommandOutcomeUnknown { queue: self.id, command_id, opcode: slot.opcode, tag: slot.tag, reason: Box::new(reason) }
    }

    /// Gives back a reserved slot whose command was never pushed.
    fn unreserve(&mut self, command_id: CommandId) {
        let slot = command_id.0 & self.slot_mask;
        if let Some(entry) = self.slots.get_mut(usize::from(slot)) {
            if entry.busy {
                entry.busy = false;
                self.in_flight -= 1;
                // Never issued: it may be the next one again.
                self.free.push_front(slot);
            }
        }
    }

    /// Copies a prepared entry into the SQ at the tail and records where it went in the slot of
    /// its command id. No doorbell: see [`QueuePair::ring_doorbell`].
    fn push(&mut self, entry: &SubmissionEntry) -> Result<(), NvmeError> {
        if self.submission_room() == 0 {
            // Not reachable while completions are checked against the SQ head (a command
            // completes only once the head passed its entry, so every unconsumed entry holds a
            // busy slot); kept so that a ring can never overflow whatever the slot accounting.
            return Err(NvmeError::QueueFull { queue: self.id, depth: self.depth });
        }
        let offset = self.sq_tail as usize * SUBMISSION_ENTRY_BYTES;
        self.submission.write_entry_streaming(offset, &entry.to_bytes())?;
        if let Some(slot) = self.slots.get_mut(usize::from(entry.command_id().0 & self.slot_mask)) {
            slot.sq_entry = self.sq_pushed;
        }
        self.sq_pushed += 1;
        self.sq_tail = ring_next(self.sq_tail, self.depth);
        self.doorbell_pending = true;
        Ok(())
    }

    /// Submits a complete entry (command id assigned here); `tag` comes back in its completion.
    pub fn submit(&mut self, entry: SubmissionEntry, tag: u64) -> Result<CommandId, NvmeError> {
        self.submit_with(entry, tag, |_, _| Ok(()))
    }

    /// Reserves a slot, lets `fill` complete the entry (data pointer, PRP list or SGL segment in
    /// the slot's scratch page), and copies it into the SQ. On any error the slot is given back
    /// and nothing reaches the SQ.
    pub(crate) fn submit_with(
        &mut self,
        mut entry: SubmissionEntry,
        tag: u64,
        fill: impl FnOnce(&mut SubmissionEntry, ScratchPage<'_>) -> Result<(), NvmeError>,
    ) -> Result<CommandId, NvmeError> {
        self.check_not_failed()?;
        let command_id = self.reserve(entry.opcode(), tag)?;
        entry.set_command_id(command_id);
        let filled = self.scratch_for(command_id).and_then(|scratch| fill(&mut entry, scratch));
        if let Err(error) = filled.and_then(|()| self.push(&entry)) {
            self.unreserve(command_id);
            return Err(error);
        }
        Ok(command_id)
    }

    /// Writes one doorbell (the CQ head's when `completion`), moving it from `previous` to
    /// `value`: through the gate for an I/O queue (refused with `QueueStale`, writing nothing,
    /// once the controller was reset), directly for the admin queue. `fence` runs first. With shadow doorbells the
    /// value goes to the shadow slot, and the MMIO write only when the EventIdx asks for it.
    fn write_doorbell(&self, completion: bool, value: u32, previous: u32, fence: fn()) -> Result<(), NvmeError> {
        let offset = if completion { self.cq_doorbell } else { self.sq_doorbell };
        let write = || {
            fence();
            let needed = match &self.shadow {
                Some(slots) => slots.publish(completion, value, previous)?,
                None => true,
            };
            if needed {
                self.registers.write32(offset, value);
            }
            Ok(())
        };
        match &self.gate {
            Some(ticket) => ticket.gate.ring(ticket.generation, &ticket.ringer, self.id, write),
            None => write(),
        }
    }

    /// Starts bringing in the lines of the next `entries` completion entries from the head, at
    /// most [`COMPLETION_PREFETCH_ENTRIES_MAX`]. Called once the head entry is seen posted, so
    /// its batch has likely landed: without it each line's miss is waited for in turn (the loop
    /// over one line's four entries fills the CPU's window before the next line's load issues),
    /// and a line comes from the device's writes or, for the software controller, from another
    /// CPU's cache.
    fn prefetch_completions(&self, entries: usize) {
        let entries = entries.min(COMPLETION_PREFETCH_ENTRIES_MAX);
        let head = self.cq_head as usize;
        let before_wrap = entries.min(self.depth as usize - head);
        self.completion.prefetch(head * COMPLETION_ENTRY_BYTES, before_wrap * COMPLETION_ENTRY_BYTES);
        self.completion.prefetch(0, (entries - before_wrap) * COMPLETION_ENTRY_BYTES);
    }

    /// Whether the controller was reset since this pair was created (cheap, not authoritative:
    /// the doorbell write checks again under the gate).
    pub(crate) fn is_stale_hint(&self) -> bool {
        self.gate.as_ref().is_some_and(|ticket| !ticket.gate.is_current_hint(ticket.generation))
    }

    /// Whether the CQ head doorbell must be written now. The controller posts a completion
    /// only into an entry it knows is free (§4.6: it must not overflow the CQ), so the head it
    /// last heard must leave room for every command outstanding: entries consumed but not
    /// published, plus commands in flight (each will take one entry), at most depth − 1. While
    /// that holds the write can wait, and a deep queue with spare entries writes it once per
    /// many completions instead of once per reap; under a hypervisor each MMIO write leaves
    /// the guest (under QEMU's TCG it also takes the big lock). A queue gone idle needs no
    /// write: with nothing in flight the controller has nothing to post. Its head goes out
    /// with the next ring that needs it (at two entries, every one), after the SQ tail.
    fn completion_doorbell_needed(&self) -> bool {
        let unpublished = ring_distance(self.cq_head_published, self.cq_head, self.depth) as usize;
        unpublished > 0 && (!self.defer_completion_doorbell || unpublished + self.in_flight > self.depth as usize - 1)
    }

    /// Writes the CQ head doorbell if the controller may need it (see
    /// [`QueuePair::completion_doorbell_needed`]).
    fn publish_completion_head(&mut self) -> Result<(), NvmeError> {
        if self.completion_doorbell_needed() {
            self.write_doorbell(true, self.cq_head, self.cq_head_published, hw::fence_before_completion_doorbell)?;
            self.cq_head_published = self.cq_head;
        }
        Ok(())
    }

    /// Publishes every entry pushed since the last call with one SQ tail doorbell write, then
    /// the CQ head if the commands now outstanding need the entries it frees. The tail goes
    /// first, as SPDK's pollers order them (they submit from the completion callback, before
    /// the head): the controller starts on the new commands one doorbell sooner, and a
    /// completion it has ready before the head lands waits only for the head written next
    /// (§4.6 lets it: a full CQ holds completions, it is not an error). Under QEMU's TCG, where
    /// each doorbell is a trip through the device model, 4 KiB reads at queue depth 1 went
    /// from 0.89x SPDK's to 0.96-1.00x (docs/vfio.md).
    ///
    /// Fails with [`NvmeError::QueueStale`], writing nothing of this batch, once the controller
    /// was reset since this pair was created: the batch's commands never reach the controller.
    /// Once the SQ tail is written the batch is the controller's, and this returns `Ok` even
    /// when a reset that began in between refuses the CQ head write that follows (see
    /// `QueuePair::publish_completion_head_after_tail`): the commands are in flight like any
    /// other, and their buffers stay untouchable until a deletion says none moves data
    /// (`IoQueuePair::delete` returns `Ok` at once after a reset that saw the controller stop,
    /// and [`NvmeError::QueueMaybeLive`] after one that did not). Any other error (a shadow
    /// doorbell slot out of reach) says nothing about whether the tail went out: treat the
    /// batch's commands as in flight too.
    pub fn ring_doorbell(&mut self) -> Result<(), NvmeError> {
        if self.is_stale_hint() {
            return Err(NvmeError::QueueStale { queue: self.id });
        }
        if self.doorbell_pending {
            // Entries were written with non-temporal stores (or plain copies); the store fence
            // makes them complete before the doorbell store (see the module documentation).
            self.write_doorbell(false, self.sq_tail, self.sq_tail_published, hw::fence_before_submission_doorbell)?;
            self.sq_tail_published = self.sq_tail;
            self.doorbell_pending = false;
            self.publish_completion_head_after_tail()?;
        }
        Ok(())
    }

    /// [`QueuePair::publish_completion_head`] right after this ring's SQ tail was written: a
    /// reset can begin between the two writes (the pair's flag is down between them, so the
    /// reset need not wait for the second), and the gate then refuses the head. That refusal
    /// must not reach the caller as `QueueStale`, which promises nothing was written: the tail
    /// was. Leaving the head unpublished is safe: the reset ends these queues (it disables the
    /// controller, which deletes them, §3.7.2), so no completion needs the entries it frees;
    /// and if the reset never sees the controller stop, the pair keeps its rings for good
    /// (`QueueFate::MaybeLive`), so an entry the controller still writes lands in memory that
    /// was never freed. The next reap reports the staleness.
    fn publish_completion_head_after_tail(&mut self) -> Result<(), NvmeError> {
        match self.publish_completion_head() {
            Err(NvmeError::QueueStale { .. }) => Ok(()),
            other => other,
        }
    }

    /// Checks a completion's SQ head (§4.6: where the controller's fetching had got to when it
    /// created the entry) and records it. Heads only move forward, by their place in the SQ's
    /// stream of entries, not by their ring index alone: a controller may post entries in
    /// another order than it created them, so a later entry can carry an older head, but never
    /// one that has not passed its own command's entry.
    /// - A completion naming a command in flight (`command_entry`: its [`Slot::sq_entry`]) is
    ///   believed when the head lies in that command's own window (just past its entry up to
    ///   the tail we published). Published at most a ring ago, the window holds each ring
    ///   index at most once (the entry's own index only as its end, entry + depth), so the
    ///   head's place in the stream is exact: the head moves there if that is past the last one
    ///   reported and stays put otherwise. This is the kernel's rule
    ///   (`gio_sq_head_in_ticket_window`), which never sees a longer window. Published more
    ///   than a ring ago, the window holds some index twice and the place is ambiguous (for
    ///   entry 0, index 1 may be entry 1 or entry depth + 1): the head stays put, since reading
    ///   it a lap forward would count entries the controller may not have consumed, and the
    ///   room check at push would then trust entries it has not fetched.
    ///   The command's own entry is behind the last head reported then (the tail stays within
    ///   depth − 1 of it), so it still passes the completion-before-fetch check.
    /// - A completion naming a command whose window the head missed: the head must lie between
    ///   the last one reported and the tail we published, modulo the depth, and is then a head
    ///   short of the command's entry, which `reap` refuses (`CompletionBeforeFetch`, failing
    ///   the pair). It never moves the head. Read forward, its place lies at most at the tail
    ///   published (the tail stays within depth − 1 of the head); any place past the entry up
    ///   to there would have lain in the command's window (Exact, when that spans at most the
    ///   depth, and Ambiguous otherwise, both handled before), so the place is at or short of
    ///   the entry and `sq_consumed`, kept, stays at or short of it too. Moving the head there
    ///   would judge the completions `reap` still checks on the failed pair against a head
    ///   taken from a completion it refused, where the kernel keeps its head on NOT_FETCHED.
    /// - A completion naming nothing in flight (a duplicate, a stale generation, an id whose
    ///   slot was reused) has no window: its head may be one created long ago, which read
    ///   modulo the depth can land a lap forward, inside the tail, over entries not fetched.
    ///   It is checked against the same range (last head reported to the tail we published)
    ///   only to tell `UnexpectedCompletion` from `InvalidSubmissionQueueHead`, and never
    ///   moves the head: the head is only a lower bound, so keeping it is always safe.
    ///
    /// Anything else names a slot the controller cannot have consumed.
    fn accept_submission_head(&mut self, reported: u16, command_entry: Option<u64>) -> Result<(), NvmeError> {
        let reported = u32::from(reported);
        // `reported` is the device's: range-checked before any arithmetic on it.
        if reported < self.depth {
            match command_entry.and_then(|entry| self.place_in_command_window(entry, reported)) {
                Some(CommandWindowPlace::Exact(place)) => {
                    if place > self.sq_consumed {
                        self.sq_consumed = place;
                        self.sq_head = reported;
                    }
                    return Ok(());
                }
                Some(CommandWindowPlace::Ambiguous) => return Ok(()),
                None => {}
            }
            // Outside the window of the command it names (then short of its entry), or naming
            // none (then possibly an old head): the range only classifies the completion, and
            // the head stays where it was.
            let ahead = ring_distance(self.sq_head, reported, self.depth);
            if ahead <= ring_distance(self.sq_head, self.sq_tail_published, self.depth) {
                return Ok(());
            }
        }
        Err(NvmeError::InvalidSubmissionQueueHead { queue: self.id, reported, head: self.sq_head, tail: self.sq_tail_published })
    }

    /// Where ring index `head` (below the depth) falls in the window of the command whose SQ
    /// entry is at `entry` (a place in the stream, [`Slot::sq_entry`]): the heads the controller
    /// can have had once it consumed that entry, just past it up to the tail we published.
    /// `None` if outside (an entry never published has no window at all).
    fn place_in_command_window(&self, entry: u64, head: u32) -> Option<CommandWindowPlace> {
        let published = self.sq_pushed - u64::from(ring_distance(self.sq_tail_published, self.sq_tail, self.depth));
        let span = published.checked_sub(entry).filter(|&span| span > 0)?;
        if span > u64::from(self.depth) {
            return Some(CommandWindowPlace::Ambiguous);
        }
        // `entry % depth` is below the depth, as ring_distance requires. The window starts
        // just past the entry, so the entry's own index names its end, entry + depth (inside
        // the window only when it spans the whole ring).
        let past_entry = match ring_distance((entry % u64::from(self.depth)) as u32, head, self.depth) {
            0 => self.depth,
            past_entry => past_entry,
        };
        (u64::from(past_entry) <= span).then(|| CommandWindowPlace::Exact(entry + u64::from(past_entry)))
    }

    /// Whether [`QueuePair::reap`] would find something to report now: the entry at the CQ head
    /// carries the current phase, or the pair is stale (reap then says so), or the head entry
    /// cannot be read (reap then reports why). One Acquire load and no side effects: a spin
    /// loop polls this and calls `reap` only when it is true, so that an empty poll costs a
    /// load and a compare rather than a reap's checks. Every check on what the entry says
    /// (queue, SQ head, command id and generation) stays in `reap`.
    #[inline]
    pub fn completion_pending(&self) -> bool {
        if self.is_stale_hint() {
            return true;
        }
        let offset = self.cq_head as usize * COMPLETION_ENTRY_BYTES;
        match self.completion.load_u32(offset + CompletionEntry::DWORD3_OFFSET, Ordering::Acquire) {
            Ok(dword3) => CompletionEntry::decode_dword3(dword3).2 == self.phase,
            Err(_) => true,
        }
    }

    /// Consumes up to `max` completions, calling `on_completion` for each, and writes the CQ head
    /// doorbell once if the controller may need the entries (always, unless the pair defers it;
    /// see `QueuePair::completion_doorbell_needed`). A completion that fails a check is
    /// consumed and reported as an error, after the completions before it were delivered; one
    /// with a wrong SQ id, an impossible SQ head or a head short of its command's entry also
    /// fails the pair and, when it names a command in flight, makes that command's outcome
    /// unknown (see the module documentation, "Rejected completions").
    pub fn reap(&mut self, max: usize, mut on_completion: impl FnMut(Completion)) -> Result<usize, NvmeError> {
        if self.is_stale_hint() {
            return Err(NvmeError::QueueStale { queue: self.id });
        }
        let mut reaped = 0;
        let mut failure = None;
        while reaped < max {
            let offset = self.cq_head as usize * COMPLETION_ENTRY_BYTES;
            let dword3 = self.completion.load_u32(offset + CompletionEntry::DWORD3_OFFSET, Ordering::Acquire)?;
            let (command_id, status_field, phase) = CompletionEntry::decode_dword3(dword3);
            if phase != self.phase {
                break;
            }
            if reaped == 0 {
                self.prefetch_completions(max.min(self.in_flight));
            }
            // The Acquire load does not order the body's loads after it for a device's writes on
            // Arm (see the module documentation).
            hw::fence_after_completion_phase();
            let mut bytes = [0u8; COMPLETION_ENTRY_BYTES];
            self.completion.read(offset, &mut bytes)?;
            let entry = CompletionEntry::from_bytes(&bytes);
            self.cq_head += 1;
            if self.cq_head == self.depth {
                self.cq_head = 0;
                self.phase = !self.phase;
            }
            reaped += 1;
            if entry.sq_id != self.id.0 {
                let reason = NvmeError::WrongSubmissionQueue { queue: self.id, reported: entry.sq_id, expected: self.id.0 };
                failure = Some(self.reject(command_id, reason));
                break;
            }
            let slot_index = command_id.0 & self.slot_mask;
            // The slot's own record of the id it issued: a late completion for the slot's
            // previous command (older generation) or for an idle slot matches nothing.
            let names = |slot: &Slot| slot.busy && !slot.outcome_unknown && slot.command_id == command_id.0;
            let command_entry = self.slots.get(usize::from(slot_index)).filter(|slot| names(slot)).map(|slot| slot.sq_entry);
            if let Err(reason) = self.accept_submission_head(entry.sq_head, command_entry) {
                failure = Some(self.reject(command_id, reason));
                break;
            }
            let Some(slot) = self.slots.get_mut(usize::from(slot_index)).filter(|slot| names(slot)) else {
                failure = Some(NvmeError::UnexpectedCompletion { queue: self.id, command_id });
                break;
            };
            if slot.sq_entry >= self.sq_consumed {
                // The head it reports has not passed the command's entry: the controller cannot
                // have fetched it, and may yet (freeing the slot would hand its scratch page
                // and the caller's buffer to the next command while the entry names them).
                let sq_index = (slot.sq_entry % u64::from(self.depth)) as u32;
                // The head it reported, which was not applied (`accept_submission_head`).
                let reported = u32::from(entry.sq_head);
                let reason = NvmeError::CompletionBeforeFetch { queue: self.id, command_id, sq_index, reported };
                failure = Some(self.reject(command_id, reason));
                break;
            }
            slot.busy = false;
            slot.generation = slot.generation.wrapping_add(1);
            let completion = Completion {
                tag: slot.tag,
                command_id,
                opcode: slot.opcode,
                dw0: entry.dw0,
                status: NvmeStatus::from_status_field(status_field),
            };
            self.free.push_back(slot_index);
            self.in_flight -= 1;
            on_completion(completion);
        }
        if reaped > 0 {
            // Stale: the consumed entries were still delivered (or reported in `failure`), and a
            // doorbell due now is not written; staleness wins over any other failure. (A stale
            // pair whose doorbell could wait is reported by the next reap or ring.)
            self.publish_completion_head()?;
        }
        match failure {
            Some(error) => Err(error),
            None => Ok(reaped),
        }
    }

    /// Consumes what the CQ holds now, stepping over completions naming nothing in flight
    /// (counted in `strays`), at most one ring's worth (`depth` entries, strays included):
    /// the CQ holds at most depth − 1 entries at once, so anything past that was posted after
    /// this began, and a controller that keeps posting strays cannot hold the caller here.
    /// Other errors from `reap` end it. An entry at a time, since a failed `reap` does not say
    /// how many entries it consumed.
    fn reap_posted(&mut self, mut on_completion: impl FnMut(Completion), strays: &mut Strays) -> Result<(), NvmeError> {
        for _ in 0..self.depth {
            if !self.completion_pending() {
                break;
            }
            match self.reap(1, &mut on_completion) {
                Ok(_) => {}
                Err(error @ NvmeError::UnexpectedCompletion { .. }) => strays.met(error),
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// Consumes the late completions of commands whose waits gave up (what the CQ holds now,
    /// one ring's worth at most; see `reap_posted`), stepping over completions naming nothing
    /// in flight, logged once with their count: they complete nothing, and stopping at one would
    /// leave the late completions behind it unread and hand the caller an error for a queue
    /// that goes on. Any other error from `reap` is returned.
    pub(crate) fn reap_late(&mut self, on_completion: impl FnMut(Completion)) -> Result<(), NvmeError> {
        let mut strays = Strays::default();
        let reaped = self.reap_posted(on_completion, &mut strays);
        if let Some(first) = &strays.first {
            tracing::warn!(queue = %self.id, %first, count = strays.count, "unexpected completions stepped over while consuming late ones");
        }
        reaped
    }

    /// Reaps until `done` says so or the deadline passes; on timeout, inspects CSTS so that a dead
    /// or failed controller is reported as such rather than as a slow command. On a
    /// [failed](QueuePair::failed) pair whose commands in flight all have unknown outcomes
    /// (nothing more can complete), fails at once with [`NvmeError::QueueFailed`].
    ///
    /// A completion naming nothing in flight ([`NvmeError::UnexpectedCompletion`]) does not end
    /// the wait: it completes nothing and the pair goes on, so the commands waited for may still
    /// complete, and until they do the memory they name is the controller's. The first one is
    /// remembered and returned once `done` says so (every completion reaped delivered). At the
    /// deadline the wait reports what any wait reports there ([`NvmeError::Timeout`] with
    /// commands still in flight, or a dead or failed controller), and the strays go to the log:
    /// callers take a timeout as "still in flight, retry or settle later", which an
    /// unexpected completion does not say. The deadline is checked after each stray, so a
    /// controller that keeps posting them cannot hold the wait past it; past the deadline, what
    /// the CQ holds behind the stray (one ring's worth at most) is still read, and `done`
    /// checked, before a timeout is reported, as a wait that met no stray reads everything
    /// posted before its last empty poll. Any other error from `reap` ends the wait at once
    /// (the strays met before it logged).
    pub fn poll_until(
        &mut self,
        deadline: Instant,
        mut on_completion: impl FnMut(Completion),
        mut done: impl FnMut(&QueuePair) -> bool,
    ) -> Result<(), NvmeError> {
        let started = Instant::now();
        let mut idle_polls = 0u32;
        let mut strays = Strays::default();
        loop {
            // `reap` delivered the completions before an unexpected one; the wait goes on for
            // those after it.
            let (reaped, stray) = match self.reap(usize::MAX, &mut on_completion) {
                Ok(reaped) => (reaped, false),
                Err(error @ NvmeError::UnexpectedCompletion { .. }) => {
                    strays.met(error);
                    // It consumed an entry: poll again at once, as after any reaped entry.
                    (1, true)
                }
                Err(error) => {
                    strays.log(self.id, &error);
                    return Err(error);
                }
            };
            if done(self) {
                return strays.reported(self.id).map_or(Ok(()), Err);
            }
            if self.failed && self.in_flight == self.unknown_outcomes {
                let failed = NvmeError::QueueFailed { queue: self.id, unknown_outcomes: self.unknown_outcomes };
                strays.log(self.id, &failed);
                return Err(failed);
            }
            // Past a stray the deadline is checked at once: a controller that keeps posting
            // them (each accepted, its entry freed by the head doorbell) would otherwise never
            // leave the wait an empty poll to check it on. Completions of commands in flight
            // are bounded by those commands.
            let deadline_passed = if reaped > 0 {
                idle_polls = 0;
                stray && Instant::now() >= deadline
            } else {
                idle_polls = idle_polls.saturating_add(1);
                idle_polls.is_multiple_of(POLLS_PER_CHECK) && Instant::now() >= deadline
            };
            if deadline_passed {
                if stray {
                    // The stray stopped `reap` at its entry, so completions posted behind it
                    // (perhaps those waited for) are read before a timeout is reported, as a
                    // wait that met none reads everything posted before its empty poll.
                    if let Err(error) = self.reap_posted(&mut on_completion, &mut strays) {
                        strays.log(self.id, &error);
                        return Err(error);
                    }
                    if done(self) {
                        return strays.reported(self.id).map_or(Ok(()), Err);
                    }
                }
                let diagnosis = self.diagnose_timeout(started);
                strays.log(self.id, &diagnosis);
                return Err(diagnosis);
            }
            if reaped > 0 {
                continue;
            }
            if idle_polls.is_multiple_of(POLLS_PER_CHECK) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Why nothing completed: device gone, controller fatal, or a genuine timeout naming the
    /// oldest command outstanding (the busy slot issued first; one pass over the slot table,
    /// only when a deadline passed). Commands whose outcome is unknown were reported already
    /// and are not named.
    pub fn diagnose_timeout(&self, started: Instant) -> NvmeError {
        let status = ControllerStatus(self.registers.read32(registers::CSTS));
        if status.device_gone() {
            return NvmeError::DeviceGone;
        }
        if status.fatal() {
            return NvmeError::ControllerFatal { context: "while waiting for completions" };
        }
        let command_id = self
            .slots
            .iter()
            .filter(|slot| slot.busy && !slot.outcome_unknown)
            .min_by_key(|slot| slot.issued)
            .map_or(CommandId(0), |slot| CommandId(slot.command_id));
        NvmeError::Timeout { queue: self.id, command_id, waited_ms: started.elapsed().as_millis() as u64, outstanding: self.in_flight }
    }

    /// Submits one entry on an idle queue, rings, and waits for it: the admin path and tests.
    /// A queue with a command in flight (one that timed out and never completed, on the admin
    /// queue) is refused with [`NvmeError::QueueBusy`] before anything is submitted, a failed
    /// one with [`NvmeError::QueueFailed`].
    ///
    /// Once the command's completion was delivered, its answer is returned even if the same
    /// reap then failed on a later entry (that failure is logged; where it failed the queue,
    /// later commands are refused as usual): the command did complete, and a caller told
    /// otherwise would treat a deletion that happened as one that may not have.
    pub fn execute(&mut self, entry: SubmissionEntry, timeout: Duration) -> Result<Completion, NvmeError> {
        self.check_not_failed()?;
        if self.in_flight != 0 {
            return Err(NvmeError::QueueBusy { queue: self.id, outstanding: self.in_flight });
        }
        let command_id = self.submit(entry, 0)?;
        self.ring_doorbell()?;
        let mut result = None;
        let polled = self.poll_until(
            Instant::now() + timeout,
            |completion| {
                if completion.command_id == command_id {
                    result = Some(completion);
                }
            },
            |queue| queue.in_flight == 0,
        );
        match (result, polled) {
            (Some(completion), Err(error)) => {
                tracing::warn!(queue = %self.id, %command_id, %error, "the reap that delivered the command's completion failed after it");
                completion.into_result(self.id)
            }
            (Some(completion), Ok(())) => completion.into_result(self.id),
            (None, Err(error)) => Err(error),
            (None, Ok(())) => Err(NvmeError::UnexpectedCompletion { queue: self.id, command_id }),
        }
    }
}

#[cfg(test)]
mod ring_index_tests {
    use super::{ring_distance, ring_next};

    proptest::proptest! {
        #[test]
        fn ring_arithmetic_matches_the_modulo_it_replaces(depth in 2u32..=super::QUEUE_DEPTH_MAX, from in 0u32..super::QUEUE_DEPTH_MAX, to in 0u32..super::QUEUE_DEPTH_MAX) {
            // Goal: the division-free ring index arithmetic of the submit and reap paths gives
            // the same answers as `%` for every pair of indices inside the ring.
            let (from, to) = (from % depth, to % depth);
            proptest::prop_assert_eq!(ring_distance(from, to, depth), (to + depth - from) % depth);
            proptest::prop_assert_eq!(ring_next(from, depth), (from + 1) % depth);
        }
    }
}

#[cfg(test)]
mod stale_ring_tests;

#[cfg(test)]
mod execute_tests;

#[cfg(test)]
mod ordering_tests;
