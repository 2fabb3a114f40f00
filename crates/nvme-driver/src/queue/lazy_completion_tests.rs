//! Lazy CQ head doorbells against a model controller that posts a completion only where the CQ
//! head it was last told leaves room, as the specification requires (§3.3.1.2: full is tail + 1
//! == head). The model reads the commands the SQ tail doorbells published and posts their
//! completions in order, in batches of random size; the driver submits and reaps random amounts.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::QueuePair;
use crate::hw::{DmaPool, RegisterIo};
use crate::spec::registers::doorbell_offset;
use crate::spec::{CompletionEntry, SubmissionEntry, COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use crate::types::{NamespaceId, QueueId};

const QUEUE: u16 = 1;

/// Registers that keep the last value of each doorbell and count the CQ head writes.
#[derive(Default)]
struct Doorbells {
    state: Mutex<DoorbellState>,
}

#[derive(Default)]
struct DoorbellState {
    sq_tail: u32,
    cq_head: u32,
    cq_head_writes: usize,
}

impl RegisterIo for Doorbells {
    fn len(&self) -> usize {
        0x2000
    }
    fn read32(&self, _offset: usize) -> u32 {
        0
    }
    fn write32(&self, offset: usize, value: u32) {
        let mut state = self.state.lock().expect("doorbells");
        if offset == doorbell_offset(QUEUE, false, 0) {
            state.sq_tail = value;
        } else if offset == doorbell_offset(QUEUE, true, 0) {
            state.cq_head = value;
            state.cq_head_writes += 1;
        } else {
            panic!("write to {offset:#x}, not a doorbell of queue {QUEUE}");
        }
    }
    fn read64(&self, _offset: usize) -> u64 {
        0
    }
    fn write64(&self, _offset: usize, _value: u64) {}
}

/// The controller's side of one queue pair.
struct ModelController {
    sq_head: u32,
    cq_tail: u32,
    phase: bool,
    /// Command ids fetched from the SQ and not yet completed.
    fetched: VecDeque<u16>,
    posted: usize,
}

impl ModelController {
    fn fetch(&mut self, queue: &QueuePair, doorbells: &Doorbells) {
        let tail = doorbells.state.lock().expect("doorbells").sq_tail;
        while self.sq_head != tail {
            let mut bytes = [0u8; SUBMISSION_ENTRY_BYTES];
            queue.submission.read(self.sq_head as usize * SUBMISSION_ENTRY_BYTES, &mut bytes).expect("read SQ");
            self.fetched.push_back((SubmissionEntry::from_bytes(&bytes).cdw0 >> 16) as u16);
            self.sq_head = (self.sq_head + 1) % queue.depth;
        }
    }

    /// Posts up to `count` completions; fails if a fetched command finds the CQ full.
    fn post(&mut self, queue: &QueuePair, doorbells: &Doorbells, count: usize) -> Result<(), String> {
        for _ in 0..count {
            let Some(&command_id) = self.fetched.front() else { return Ok(()) };
            let head = doorbells.state.lock().expect("doorbells").cq_head;
            if (self.cq_tail + 1) % queue.completion_depth == head {
                return Err(format!("CQ full (tail {}, head told {head}) with {} completions to post", self.cq_tail, self.fetched.len()));
            }
            self.fetched.pop_front();
            let entry = CompletionEntry {
                sq_head: self.sq_head as u16,
                sq_id: QUEUE,
                command_id,
                status_and_phase: u16::from(self.phase),
                ..CompletionEntry::default()
            };
            let offset = self.cq_tail as usize * COMPLETION_ENTRY_BYTES;
            let bytes = entry.to_bytes();
            queue.completion.write(offset, &bytes[..CompletionEntry::DWORD3_OFFSET]).expect("write CQ");
            let dword3 = u32::from_le_bytes(bytes[CompletionEntry::DWORD3_OFFSET..].try_into().expect("4 bytes"));
            queue.completion.store_u32(offset + CompletionEntry::DWORD3_OFFSET, dword3, Ordering::Release).expect("write CQ");
            self.cq_tail += 1;
            if self.cq_tail == queue.completion_depth {
                self.cq_tail = 0;
                self.phase = !self.phase;
            }
            self.posted += 1;
        }
        Ok(())
    }
}

/// xorshift64: a reproducible schedule without a dependency.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

struct Outcome {
    completions: usize,
    reaps_with_completions: usize,
    cq_head_writes: usize,
}

/// Runs a random schedule of `rounds` steps on a pair of `depth` SQ and `completion_depth` CQ
/// entries, checking that every command completes once and the model is never blocked.
fn run(depth: u32, completion_depth: u32, seed: u64, rounds: usize) -> Result<Outcome, String> {
    let dma = DmaPool::identity();
    let doorbells = Arc::new(Doorbells::default());
    let mut queue = QueuePair::allocate_with_completion_depth(
        QueueId(QUEUE),
        depth,
        completion_depth,
        &dma,
        Arc::clone(&doorbells) as Arc<dyn RegisterIo>,
        0,
    )
    .expect("pair");
    let mut model = ModelController { sq_head: 0, cq_tail: 0, phase: true, fetched: VecDeque::new(), posted: 0 };
    let mut state = seed | 1;
    let (mut next_tag, mut expected_tag, mut reaps_with_completions) = (0u64, 0u64, 0usize);
    for _ in 0..rounds {
        // Submit up to the free slots (often all of them: the edge is a full pair).
        let free = queue.free_slots();
        let submit = if next(&mut state).is_multiple_of(2) { free } else { (next(&mut state) % (free as u64 + 1)) as usize };
        for _ in 0..submit {
            queue.submit(SubmissionEntry::flush(NamespaceId(1)), next_tag).map_err(|error| error.to_string())?;
            next_tag += 1;
        }
        queue.ring_doorbell().map_err(|error| error.to_string())?;
        model.fetch(&queue, &doorbells);
        let post = (next(&mut state) % (u64::from(depth) + 1)) as usize;
        model.post(&queue, &doorbells, post)?;
        let max = (next(&mut state) % (u64::from(depth) + 1)) as usize;
        let reaped = queue
            .reap(max, |completion| {
                assert_eq!(completion.tag, expected_tag, "completions arrive in the order the model posted them");
                expected_tag += 1;
            })
            .map_err(|error| error.to_string())?;
        reaps_with_completions += usize::from(reaped > 0);
    }
    // Drain: everything submitted completes.
    for _ in 0..4 * depth {
        model.fetch(&queue, &doorbells);
        model.post(&queue, &doorbells, depth as usize)?;
        let reaped = queue.reap(usize::MAX, |_| expected_tag += 1).map_err(|error| error.to_string())?;
        reaps_with_completions += usize::from(reaped > 0);
    }
    if expected_tag != next_tag || queue.in_flight() != 0 || model.posted as u64 != next_tag {
        return Err(format!("{next_tag} submitted, {expected_tag} reaped, {} posted, {} in flight", model.posted, queue.in_flight()));
    }
    let cq_head_writes = doorbells.state.lock().expect("doorbells").cq_head_writes;
    Ok(Outcome { completions: model.posted, reaps_with_completions, cq_head_writes })
}

#[test]
fn a_longer_cq_defers_head_doorbells_without_ever_filling() {
    // Goal: with a CQ twice the SQ, the controller never finds the CQ full while it has a
    // completion to post (the head left unreported never takes a command's entry), and each CQ
    // head doorbell reports more than the slack (`completion depth − 1 − slots` = depth).
    for depth in [2u32, 3, 8, 33] {
        for seed in 1..=20u64 {
            let outcome =
                run(depth, 2 * depth, seed * 0x9e37_79b9, 400).unwrap_or_else(|error| panic!("depth {depth}, seed {seed}: {error}"));
            assert!(outcome.completions > 100, "depth {depth}, seed {seed}: only {} completions", outcome.completions);
            let most = outcome.completions / (depth as usize + 1);
            assert!(
                outcome.cq_head_writes <= most,
                "depth {depth}, seed {seed}: {} CQ head writes for {} completions (at most {most})",
                outcome.cq_head_writes,
                outcome.completions
            );
        }
    }
}

#[test]
fn equal_rings_write_the_head_after_every_reap_that_consumed() {
    // Goal: without slack (the admin queue, detached and attached pairs, a controller whose
    // maximum depth leaves no room) the head is reported after every reap, as before.
    for seed in 1..=10u64 {
        let outcome = run(8, 8, seed * 0x51_7cc1, 300).unwrap_or_else(|error| panic!("seed {seed}: {error}"));
        assert_eq!(outcome.cq_head_writes, outcome.reaps_with_completions, "seed {seed}");
    }
}

#[test]
fn a_cq_shorter_than_the_sq_is_refused() {
    let dma = DmaPool::identity();
    let doorbells = Arc::new(Doorbells::default()) as Arc<dyn RegisterIo>;
    assert!(QueuePair::allocate_with_completion_depth(QueueId(QUEUE), 8, 7, &dma, doorbells, 0).is_err());
}
