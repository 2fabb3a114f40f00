//! The raw workload: jobs (one thread each, one queue per device each) issuing fio-style
//! sequential, random and mixed I/O, with an optional verify pattern.
//!
//! Hot loop per iteration: fill free slots (no allocation: slots, timestamps and the completion
//! list are sized to the queue depth up front), one submit-and-reap per device, then account the
//! completions with one clock read per batch (and one per publish a queue() made on its own:
//! each I/O's submission time is when it became visible to the device).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};

use crate::args::Pattern;
use crate::devices::{Device, DeviceError, Direction, IoQueue, Traffic, Visibility, IO_TIMEOUT};
use crate::report::{thread_cpu, DirectionStats, JobStats, JobWindow, PhaseResult, ProcessCpu};

/// What a phase does with data beyond moving it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyMode {
    None,
    /// Writes carry the pattern of their offset.
    WritePattern,
    /// Reads are compared against the pattern of their offset.
    CheckPattern,
}

/// One phase of a run: every job runs it once.
#[derive(Debug, Clone)]
pub struct PhasePlan {
    pub label: String,
    pub pattern: Pattern,
    pub bs: u64,
    pub iodepth: u32,
    /// Logical region (across striped devices) every job covers, unless `split_region`.
    pub region_start: u64,
    pub region_bytes: u64,
    /// Give each job its own slice of the region instead of the whole region.
    pub split_region: bool,
    pub runtime: Option<Duration>,
    pub time_based: bool,
    /// Stop each job after this many I/Os (wrapping around the region if needed).
    pub number_ios: Option<u64>,
    pub rwmixread: u8,
    pub verify: VerifyMode,
    /// Stamp each write's buffer before it goes (`--scramble_buffers`).
    pub scramble_buffers: bool,
    pub seed: u64,
    /// CPUs every job thread is confined to (`--cpus_allowed`).
    pub cpus_allowed: Option<crate::cpus::CpuList>,
}

/// A verify mismatch: data came back different from what was written (exit status 1).
#[derive(Debug, thiserror::Error)]
#[error("verify failed: {device} byte offset {offset_bytes} (I/O at {io_offset_bytes}, byte {byte_in_io} of it): expected {expected:#04x}, read {actual:#04x}")]
pub struct VerifyError {
    pub device: String,
    pub offset_bytes: u64,
    pub io_offset_bytes: u64,
    pub byte_in_io: usize,
    pub expected: u8,
    pub actual: u8,
}

/// Shared progress counters the main thread renders.
#[derive(Debug, Default)]
pub struct Progress {
    pub bytes_done: AtomicU64,
    pub stop: AtomicBool,
}

/// Maps a logical byte offset onto (device index, device offset): stripes of `bs` round-robin.
fn stripe(logical_bytes: u64, bs: u64, devices: u64) -> (usize, u64) {
    let chunk = logical_bytes / bs;
    ((chunk % devices) as usize, (chunk / devices) * bs + logical_bytes % bs)
}

/// The verify pattern: each 8-byte word is a hash of its logical byte offset and the run's seed,
/// so any block read back can be checked without remembering what was written.
pub fn fill_pattern(buffer: &mut [u8], logical_offset_bytes: u64, seed: u64) {
    for (index, word) in buffer.chunks_mut(8).enumerate() {
        let value = mix(seed ^ (logical_offset_bytes + index as u64 * 8));
        let bytes = value.to_le_bytes();
        word.copy_from_slice(&bytes[..word.len()]);
    }
}

/// The devices holding the I/Os in flight (slots not free), each with its count when there are
/// several: what a timeout names. Cold path (once, at a timeout).
fn stuck_devices(devices: &[Arc<dyn Device>], slots: &[SlotState], free_slots: &[u32]) -> String {
    let mut counts = vec![0usize; devices.len()];
    for (slot, state) in slots.iter().enumerate() {
        if !free_slots.contains(&(slot as u32)) {
            if let Some(count) = counts.get_mut(state.device) {
                *count += 1;
            }
        }
    }
    let stuck: Vec<usize> = (0..devices.len()).filter(|&device| counts[device] > 0).collect();
    match stuck.as_slice() {
        [] => devices.iter().map(|device| device.name()).collect::<Vec<_>>().join(", "),
        [device] => devices[*device].name(),
        several => several
            .iter()
            .map(|&device| format!("{} ({} in flight)", devices[device].name(), counts[device]))
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// Pseudorandom bytes from `seed` (each 8-byte word a hash of the seed and its index): what a
/// slot's buffer holds for writes that carry no verify pattern. fio writes random buffers too;
/// a short repeating pattern would compress and deduplicate on storage that does.
pub fn fill_random(buffer: &mut [u8], seed: u64) {
    for (index, word) in buffer.chunks_mut(8).enumerate() {
        let bytes = mix(seed.wrapping_add(index as u64)).to_le_bytes();
        word.copy_from_slice(&bytes[..word.len()]);
    }
}

/// Fills every slot buffer of `queues` once, before the job's clock starts, with pseudorandom
/// bytes seeded by the job, device and slot, when the phase writes without a verify pattern.
fn fill_write_buffers(queues: &mut [Box<dyn IoQueue>], plan: &PhasePlan, job_seed: u64) -> Result<(), DeviceError> {
    if plan.verify != VerifyMode::None || !matches!(plan.pattern, Pattern::Write | Pattern::Randwrite | Pattern::Randrw) {
        return Ok(());
    }
    let mut bytes = vec![0u8; plan.bs as usize];
    for (device, queue) in queues.iter_mut().enumerate() {
        for slot in 0..plan.iodepth {
            fill_random(&mut bytes, mix(job_seed ^ ((device as u64) << 32 | u64::from(slot))));
            queue.write_buffer(slot, &bytes)?;
        }
    }
    Ok(())
}

/// The first byte where `actual` differs from the pattern: (index, expected, actual).
pub fn find_mismatch(actual: &[u8], logical_offset_bytes: u64, seed: u64) -> Option<(usize, u8, u8)> {
    for (index, word) in actual.chunks(8).enumerate() {
        let expected = mix(seed ^ (logical_offset_bytes + index as u64 * 8)).to_le_bytes();
        if word != &expected[..word.len()] {
            let byte = word.iter().zip(expected.iter()).position(|(a, e)| a != e).unwrap_or(0);
            return Some((index * 8 + byte, expected[byte], word[byte]));
        }
    }
    None
}

/// SplitMix64's finaliser: a bijective 64-bit mix.
fn mix(mut value: u64) -> u64 {
    value = value.wrapping_add(0x9e37_79b9_7f4a_7c15);
    value = (value ^ (value >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    value ^ (value >> 31)
}

/// Visits every block of `0..blocks` once per pass in a scrambled order (like fio's random map):
/// a bijection on the next power of two, skipping values past the end.
struct BlockPermutation {
    blocks: u64,
    bits: u32,
    counter: u64,
    seed: u64,
}

impl BlockPermutation {
    fn new(blocks: u64, seed: u64) -> Self {
        let bits = 64 - blocks.saturating_sub(1).leading_zeros();
        Self { blocks, bits, counter: 0, seed }
    }

    fn mask(&self) -> u64 {
        if self.bits >= 64 {
            u64::MAX
        } else {
            (1u64 << self.bits) - 1
        }
    }

    /// Each step is a bijection on `bits`-bit integers: add, multiply by an odd number, and
    /// xor with a right shift of itself, all modulo 2^bits.
    fn scramble(&self, mut value: u64) -> u64 {
        let mask = self.mask();
        let shift = (self.bits / 2).max(1);
        for round in 0..3u64 {
            value = value.wrapping_add(self.seed.rotate_left(round as u32 * 21)) & mask;
            value = value.wrapping_mul(0x9e37_79b9_7f4a_7c15 | 1) & mask;
            value ^= value >> shift;
        }
        value & mask
    }

    fn next(&mut self) -> u64 {
        if self.blocks <= 1 {
            return 0;
        }
        // At most half the domain lies past `blocks`, so this ends within 2^bits steps.
        loop {
            let candidate = self.scramble(self.counter & self.mask());
            self.counter = self.counter.wrapping_add(1);
            if self.counter & self.mask() == 0 {
                self.seed = mix(self.seed); // a new order for the next pass
            }
            if candidate < self.blocks {
                return candidate;
            }
        }
    }
}

/// Picks direction and offset of the next I/O.
struct OffsetGenerator {
    pattern: Pattern,
    start_bytes: u64,
    bs: u64,
    blocks: u64,
    issued: u64,
    permutation: BlockPermutation,
    mix_state: u64,
    rwmixread: u8,
}

impl OffsetGenerator {
    fn next(&mut self) -> (Direction, u64) {
        let block = if self.pattern.is_random() { self.permutation.next() } else { self.issued % self.blocks };
        self.issued += 1;
        let direction = match self.pattern {
            Pattern::Read | Pattern::Randread => Direction::Read,
            Pattern::Write | Pattern::Randwrite => Direction::Write,
            Pattern::Randrw => {
                self.mix_state = mix(self.mix_state);
                if self.mix_state % 100 < u64::from(self.rwmixread) {
                    Direction::Read
                } else {
                    Direction::Write
                }
            }
        };
        (direction, self.start_bytes + block * self.bs)
    }
}

/// Runs one phase on all jobs and collects their statistics.
pub fn run_phase(devices: &[Arc<dyn Device>], numjobs: u32, plan: &PhasePlan, progress: &Arc<Progress>) -> anyhow::Result<PhaseResult> {
    run_phase_with(devices, numjobs, plan, progress, &|job| Ok(std::thread::Builder::new().name(format!("job{job}"))))
}

/// [`run_phase`] with the builder of each job's thread from `builder` (a test fails one).
fn run_phase_with(
    devices: &[Arc<dyn Device>],
    numjobs: u32,
    plan: &PhasePlan,
    progress: &Arc<Progress>,
    builder: &(dyn Fn(u32) -> std::io::Result<std::thread::Builder> + Sync),
) -> anyhow::Result<PhaseResult> {
    let gate = StartGate::new(numjobs);
    let (results, unstarted): (Vec<anyhow::Result<JobStats>>, Option<anyhow::Error>) = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..numjobs)
            .map(|job| {
                let gate = &gate;
                let progress = Arc::clone(progress);
                builder(job)?.spawn_scoped(scope, move || {
                    let result = run_job(devices, job, numjobs, plan, gate, &progress);
                    if result.is_err() {
                        progress.stop.store(true, Ordering::Relaxed); // the others stop too
                    }
                    result
                })
            })
            .collect();
        // Every thread is asked for before any is joined: one that could not start (a pids
        // limit) would never reach the gate, so the started ones are released from it (they
        // close their queues and return) instead of waiting for it forever.
        let unstarted = handles.iter().find_map(|handle| handle.as_ref().err()).map(|error| anyhow!("cannot start a job thread: {error}"));
        if unstarted.is_some() {
            gate.call_off();
        }
        let results = handles
            .into_iter()
            .map(|handle| match handle {
                Ok(handle) => handle.join().unwrap_or_else(|_| Err(anyhow!("a job thread panicked"))),
                Err(error) => Err(anyhow!("cannot start a job thread: {error}")),
            })
            .collect();
        (results, unstarted)
    });
    // The cause, not the released jobs' "called off".
    if let Some(error) = unstarted {
        return Err(error);
    }
    let mut jobs = Vec::with_capacity(results.len());
    for result in results {
        jobs.push(result?);
    }
    // The aggregate's time is the span of the jobs' I/O, as each job's own figures are: not the
    // threads' start, queue creation and buffer set-up before the barrier, nor the drain and
    // queue deletion after (with one job they made the aggregate slower than the job itself).
    let first = jobs.iter().map(|job| job.window).min_by_key(|window| window.started);
    let last = jobs.iter().map(|job| job.window).max_by_key(|window| window.ended);
    let (elapsed, cpu) = match (first, last) {
        (Some(first), Some(last)) => {
            (last.ended.saturating_duration_since(first.started), last.process_cpu_at_end.since(&first.process_cpu_at_start))
        }
        _ => (Duration::ZERO, Default::default()),
    };
    Ok(PhaseResult { label: plan.label.clone(), pattern: plan.pattern, verify: plan.verify, jobs, elapsed, process_cpu: cpu })
}

/// The longest a job waits at the start for the others to open their queues (an admin command
/// or two per device each): well past any healthy start, and bounded.
const START_TIMEOUT: Duration = Duration::from_secs(300);

/// The jobs' start barrier (timing starts together), which the phase can call off: a
/// `std::sync::Barrier` waits for every job unboundedly, including one whose thread never started.
struct StartGate {
    state: Mutex<GateState>,
    changed: Condvar,
    jobs: u32,
}

struct GateState {
    arrived: u32,
    called_off: bool,
}

impl StartGate {
    fn new(jobs: u32) -> Self {
        Self { state: Mutex::new(GateState { arrived: 0, called_off: false }), changed: Condvar::new(), jobs }
    }

    /// Arrives and waits until every job has (Ok), or the start was called off or
    /// [`START_TIMEOUT`] passed (which calls it off for the others too): Err says which.
    fn wait(&self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.arrived += 1;
        if state.arrived >= self.jobs {
            self.changed.notify_all();
        }
        loop {
            if state.called_off {
                return Err("the phase's start was called off (another job failed to start)".to_string());
            }
            if state.arrived >= self.jobs {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                state.called_off = true;
                self.changed.notify_all();
                return Err(format!(
                    "{} of {} jobs opened their queues within {START_TIMEOUT:?}; the phase's start was called off",
                    state.arrived, self.jobs
                ));
            }
            state = self.changed.wait_timeout(state, deadline - now).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// Releases every job waiting, or still to arrive, with an error.
    fn call_off(&self) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).called_off = true;
        self.changed.notify_all();
    }
}

/// Job `job`'s slice of a region split among `numjobs` jobs: (offset from the region's start,
/// bytes), whole blocks of `bs`. The blocks the jobs do not divide evenly go one each to the
/// first jobs, so that the slices cover every whole block of the region (with 10 blocks and 3
/// jobs: 4, 3, 3; a slice of `blocks / numjobs` each left the last block unwritten and unchecked).
pub fn job_slice(region_bytes: u64, bs: u64, numjobs: u32, job: u32) -> (u64, u64) {
    let blocks = region_bytes / bs;
    let numjobs = u64::from(numjobs.max(1));
    let job = u64::from(job);
    let (base, extra) = (blocks / numjobs, blocks % numjobs);
    let start_block = base * job + job.min(extra);
    let slice_blocks = base + u64::from(job < extra);
    (start_block * bs, slice_blocks * bs)
}

/// Nanoseconds from `start` to `at`: per-I/O latencies are then integer differences of one
/// clock reading per loop turn. `Instant` arithmetic per I/O (three subtractions) was ~130 of the
/// job thread's ~1,600 instructions per 4 KiB read at QD 32 (callgrind).
fn nanos_since(start: Instant, at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(start).as_nanos()).unwrap_or(u64::MAX)
}

struct SlotState {
    direction: Direction,
    logical_bytes: u64,
    device: usize,
    /// Nanoseconds since the job started ([`nanos_since`]).
    queued_ns: u64,
    submitted_ns: u64,
}

fn run_job(
    devices: &[Arc<dyn Device>],
    job: u32,
    numjobs: u32,
    plan: &PhasePlan,
    gate: &StartGate,
    progress: &Progress,
) -> anyhow::Result<JobStats> {
    // Pin (when asked) and open queues first, then meet the other jobs, so that timing starts
    // together; a failure is reported after the start gate, which every job must reach.
    let pinned = plan.cpus_allowed.as_ref().map_or(Ok(()), |cpus| cpus.pin_current_thread().map_err(|error| (cpus, error)));
    let seed = mix(plan.seed ^ u64::from(job));
    // The phase moves one direction, or both: a timing model passes one alone at its solo rate.
    let traffic = Traffic::of(plan.pattern, plan.rwmixread);
    let opened: Result<Vec<Box<dyn IoQueue>>, DeviceError> =
        devices.iter().map(|device| device.open_queue(plan.iodepth, plan.bs as usize, traffic)).collect();
    let opened = opened.and_then(|mut queues| fill_write_buffers(&mut queues, plan, seed).map(|()| queues));
    // Released without the others: the queues close as this returns.
    gate.wait().map_err(|why| anyhow!("job{job}: {why}"))?;
    pinned.map_err(|(cpus, error)| anyhow!("job{job}: --cpus_allowed={cpus}: {error}"))?;
    let mut queues = opened.with_context(|| format!("job{job}: opening queues"))?;
    // Progress on any of them resets the wait: the longest any queue may take bounds it (a
    // device under a slow timing model takes longer than IO_TIMEOUT, devices::wait_bound).
    let io_timeout = queues.iter().map(|queue| queue.io_timeout()).max().unwrap_or(IO_TIMEOUT);
    let (region_start, region_bytes) = if plan.split_region {
        let (start, bytes) = job_slice(plan.region_bytes, plan.bs, numjobs, job);
        (plan.region_start + start, bytes)
    } else {
        (plan.region_start, plan.region_bytes)
    };
    let blocks = region_bytes / plan.bs;
    if blocks == 0 {
        return Err(anyhow!("job{job}: region of {region_bytes} bytes holds no {}-byte block", plan.bs));
    }
    let mut generator = OffsetGenerator {
        pattern: plan.pattern,
        start_bytes: region_start,
        bs: plan.bs,
        blocks,
        issued: 0,
        permutation: BlockPermutation::new(blocks, seed),
        mix_state: seed,
        rwmixread: plan.rwmixread,
    };
    let depth = plan.iodepth as usize;
    let device_count = devices.len() as u64;
    let total_ios = plan.number_ios.unwrap_or(if plan.time_based { u64::MAX } else { blocks });
    let mut free_slots: Vec<u32> = (0..plan.iodepth).rev().collect();
    let mut slots: Vec<SlotState> =
        (0..depth).map(|_| SlotState { direction: Direction::Read, logical_bytes: 0, device: 0, queued_ns: 0, submitted_ns: 0 }).collect();
    let mut batch: Vec<u32> = Vec::with_capacity(depth);
    let mut completed: Vec<(u32, Result<(), DeviceError>)> = Vec::with_capacity(depth);
    let mut scratch = vec![0u8; plan.bs as usize];
    let mut read = DirectionStats::new();
    let mut write = DirectionStats::new();
    let mut retry: Option<(Direction, u64)> = None;
    let mut issued = 0u64;
    let mut in_flight = 0usize;
    let mut stop_issuing = false;
    let cpu_before = thread_cpu();
    let process_cpu_at_start = ProcessCpu::now();
    let started = Instant::now();
    let runtime_deadline = plan.runtime.map(|runtime| started + runtime);
    let mut last_progress = started;
    let mut idle_polls = 0u32;

    loop {
        let now = Instant::now();
        let now_ns = nanos_since(started, now);
        if runtime_deadline.is_some_and(|deadline| now >= deadline) || progress.stop.load(Ordering::Relaxed) {
            stop_issuing = true;
        }
        let mut backpressure = false;
        while !stop_issuing && in_flight < depth {
            if issued >= total_ios && retry.is_none() {
                stop_issuing = true;
                break;
            }
            let Some(slot) = free_slots.pop() else { break };
            let (direction, logical) = retry.take().unwrap_or_else(|| {
                issued += 1;
                generator.next()
            });
            let (device, device_offset) = stripe(logical, plan.bs, device_count);
            if direction == Direction::Write {
                if plan.verify == VerifyMode::WritePattern {
                    fill_pattern(&mut scratch, logical, plan.seed);
                    queues[device].write_buffer(slot, &scratch)?;
                } else if plan.scramble_buffers {
                    // The slot's random bytes, stamped with this I/O (fio's scramble_buffers).
                    queues[device].stamp_buffer(slot, seed ^ logical ^ issued.rotate_left(40))?;
                }
            }
            match queues[device].queue(slot, direction, device_offset) {
                Ok(visibility) => {
                    slots[slot as usize] = SlotState { direction, logical_bytes: logical, device, queued_ns: now_ns, submitted_ns: now_ns };
                    batch.push(slot);
                    in_flight += 1;
                    if visibility == Visibility::Published {
                        // The device can start on this device's queued I/Os from here: one clock
                        // reading per publish (per I/O on `uring:`, whose enter costs far more;
                        // per half refill on a deep NVMe queue), not per I/O.
                        let published_ns = nanos_since(started, Instant::now());
                        batch.retain(|&queued| {
                            let state = &mut slots[queued as usize];
                            if state.device != device {
                                return true;
                            }
                            state.submitted_ns = published_ns;
                            false
                        });
                    }
                }
                Err(DeviceError::Backpressure { .. }) => {
                    free_slots.push(slot);
                    retry = Some((direction, logical));
                    backpressure = true;
                    break;
                }
                Err(error) => return Err(error.into()),
            }
        }
        if in_flight == 0 && stop_issuing {
            break;
        }
        // What no queue() published goes to the devices in submit_and_reap, right after this
        // reading.
        if !batch.is_empty() {
            let submitted_ns = nanos_since(started, Instant::now());
            for &slot in &batch {
                slots[slot as usize].submitted_ns = submitted_ns;
            }
        }
        batch.clear();
        // Block only when nothing more can be queued; with several devices, poll them in turn.
        let must_wait = in_flight == depth || stop_issuing || backpressure;
        let deadline = last_progress + io_timeout;
        for queue in queues.iter_mut() {
            queue.submit_and_reap(must_wait && device_count == 1, deadline, &mut |slot, result| completed.push((slot, result)))?;
        }
        if completed.is_empty() {
            if Instant::now() > deadline {
                let device = stuck_devices(devices, &slots, &free_slots);
                return Err(DeviceError::Timeout { device, timeout_s: io_timeout.as_secs(), in_flight }.into());
            }
            // With one device, submit_and_reap has waited under that device's waiter, and what
            // it reaped was part of an I/O split into several commands (larger than the MDTS):
            // wait again at once. Pacing here put a spin hint after each such reap, on `vfio:`
            // too, whose waiter avoids the hint (under TCG it takes QEMU's big lock; see
            // devices.rs, Waiter::Polls). Several devices are polled in turn without waiting:
            // each paces as its waiter does.
            if must_wait && device_count > 1 {
                idle_polls = idle_polls.wrapping_add(1);
                for queue in queues.iter() {
                    queue.pace_idle_poll(idle_polls);
                }
            }
            continue;
        }
        let done_at = Instant::now();
        let done_ns = nanos_since(started, done_at);
        last_progress = done_at;
        let mut bytes_done = 0u64;
        for (slot, result) in completed.drain(..) {
            let state = slots.get(slot as usize).ok_or_else(|| anyhow!("completion for unknown slot {slot}"))?;
            result?;
            if plan.verify == VerifyMode::CheckPattern && state.direction == Direction::Read {
                queues[state.device].read_buffer(slot, &mut scratch)?;
                if let Some((byte, expected, actual)) = find_mismatch(&scratch, state.logical_bytes, plan.seed) {
                    return Err(VerifyError {
                        device: devices[state.device].name(),
                        offset_bytes: stripe(state.logical_bytes, plan.bs, device_count).1 + byte as u64,
                        io_offset_bytes: stripe(state.logical_bytes, plan.bs, device_count).1,
                        byte_in_io: byte,
                        expected,
                        actual,
                    }
                    .into());
                }
            }
            let stats = if state.direction == Direction::Read { &mut read } else { &mut write };
            stats.record(plan.bs, state.queued_ns, state.submitted_ns, done_ns);
            bytes_done += plan.bs;
            free_slots.push(slot);
            in_flight -= 1;
        }
        progress.bytes_done.fetch_add(bytes_done, Ordering::Relaxed);
    }
    let ended = Instant::now();
    let process_cpu_at_end = ProcessCpu::now();
    let elapsed = ended.saturating_duration_since(started);
    let cpu = thread_cpu().since(&cpu_before);
    for queue in queues.iter_mut() {
        queue.drain(Instant::now() + io_timeout);
    }
    let window = JobWindow { started, process_cpu_at_start, ended, process_cpu_at_end };
    Ok(JobStats { name: format!("job{job}"), read, write, elapsed, thread_cpu: cpu, window })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_slices_cover_every_block_once() {
        // Goal: the slices of a split region are contiguous, disjoint and cover every whole block,
        // also when the jobs do not divide the blocks.
        for (blocks, numjobs) in [(10u64, 3u32), (12, 4), (5, 5), (7, 1), (64, 63)] {
            let mut next = 0;
            for job in 0..numjobs {
                let (start, bytes) = job_slice(blocks * 4096 + 100, 4096, numjobs, job);
                assert_eq!(start, next, "{blocks} blocks, {numjobs} jobs, job {job}");
                assert!(bytes >= 4096 && bytes % 4096 == 0);
                next = start + bytes;
            }
            assert_eq!(next, blocks * 4096, "{blocks} blocks, {numjobs} jobs");
        }
    }

    #[test]
    fn permutation_visits_every_block_once_per_pass() {
        // Goal: random workloads cover the region like fio's random map (each block once).
        for blocks in [1u64, 2, 3, 7, 64, 1000, 4097] {
            let mut permutation = BlockPermutation::new(blocks, 42);
            let mut seen = vec![false; blocks as usize];
            for _ in 0..blocks {
                let block = permutation.next();
                assert!(block < blocks);
                assert!(!seen[block as usize], "block {block} of {blocks} visited twice");
                seen[block as usize] = true;
            }
        }
    }

    #[test]
    fn permutation_is_not_sequential() {
        let mut permutation = BlockPermutation::new(1 << 16, 7);
        let first: Vec<u64> = (0..16).map(|_| permutation.next()).collect();
        let sequential = first.windows(2).filter(|pair| pair[1] == pair[0] + 1).count();
        assert!(sequential < 4, "{first:?}");
    }

    #[test]
    fn pattern_round_trips_and_names_the_first_mismatch() {
        let mut buffer = vec![0u8; 4096];
        fill_pattern(&mut buffer, 8192, 5);
        assert_eq!(find_mismatch(&buffer, 8192, 5), None);
        // A different offset has a different pattern (a misdirected write is caught).
        assert!(find_mismatch(&buffer, 4096, 5).is_some());
        buffer[1234] ^= 0xff;
        let (byte, expected, actual) = find_mismatch(&buffer, 8192, 5).unwrap();
        assert_eq!(byte, 1234);
        assert_eq!(expected ^ 0xff, actual);
    }

    #[test]
    fn a_timeout_names_the_devices_whose_ios_are_stuck() {
        // Goal: a timeout named devices[0] even when the I/Os in flight were on another device.
        let paced = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let devices: Vec<Arc<dyn Device>> = ["emu:a", "emu:b", "emu:c"]
            .into_iter()
            .map(|name| Arc::new(NamedDevice { name, inner: SplitDevice { paced: Arc::clone(&paced) } }) as Arc<dyn Device>)
            .collect();
        let slot = |device| SlotState { direction: Direction::Read, logical_bytes: 0, device, queued_ns: 0, submitted_ns: 0 };
        let slots = [slot(1), slot(0), slot(1), slot(2)];
        // Slots 1 and 3 (devices 0 and 2) are free: only device 1 holds I/Os.
        assert_eq!(stuck_devices(&devices, &slots, &[1, 3]), "emu:b");
        assert_eq!(stuck_devices(&devices, &slots, &[1]), "emu:b (2 in flight), emu:c (1 in flight)");
    }

    /// [`SplitDevice`] under another name.
    struct NamedDevice {
        name: &'static str,
        inner: SplitDevice,
    }

    impl Device for NamedDevice {
        fn name(&self) -> String {
            self.name.into()
        }
        fn describe(&self) -> String {
            self.inner.describe()
        }
        fn capacity_bytes(&self) -> u64 {
            self.inner.capacity_bytes()
        }
        fn block_size_bytes(&self) -> u32 {
            self.inner.block_size_bytes()
        }
        fn open_queue(&self, depth: u32, slot_bytes: usize, traffic: Traffic) -> Result<Box<dyn IoQueue>, DeviceError> {
            self.inner.open_queue(depth, slot_bytes, traffic)
        }
    }

    /// A device whose every I/O completes as two commands, one per reap (an I/O larger than
    /// the MDTS), and which counts how often the job loop paces its polls.
    struct SplitDevice {
        paced: Arc<std::sync::atomic::AtomicU32>,
    }

    struct SplitQueue {
        /// Slots in flight with the commands each still has to complete, oldest first.
        in_flight: std::collections::VecDeque<(u32, u32)>,
        paced: Arc<std::sync::atomic::AtomicU32>,
    }

    impl Device for SplitDevice {
        fn name(&self) -> String {
            "split".into()
        }
        fn describe(&self) -> String {
            "every I/O in two commands".into()
        }
        fn capacity_bytes(&self) -> u64 {
            1 << 20
        }
        fn block_size_bytes(&self) -> u32 {
            4096
        }
        fn open_queue(&self, _depth: u32, _slot_bytes: usize, _traffic: Traffic) -> Result<Box<dyn IoQueue>, DeviceError> {
            Ok(Box::new(SplitQueue { in_flight: Default::default(), paced: Arc::clone(&self.paced) }))
        }
    }

    impl IoQueue for SplitQueue {
        fn queue(&mut self, slot: u32, _direction: Direction, _offset_bytes: u64) -> Result<Visibility, DeviceError> {
            self.in_flight.push_back((slot, 2));
            Ok(Visibility::Queued)
        }
        fn submit_and_reap(
            &mut self,
            _wait: bool,
            _deadline: Instant,
            on_done: &mut dyn FnMut(u32, Result<(), DeviceError>),
        ) -> Result<usize, DeviceError> {
            // One command of the oldest I/O completes per call, waiting or not.
            let Some((slot, remaining)) = self.in_flight.front_mut() else { return Ok(0) };
            *remaining -= 1;
            if *remaining > 0 {
                return Ok(0);
            }
            on_done(*slot, Ok(()));
            self.in_flight.pop_front();
            Ok(1)
        }
        fn write_buffer(&mut self, _slot: u32, _source: &[u8]) -> Result<(), DeviceError> {
            Ok(())
        }
        fn read_buffer(&self, _slot: u32, _destination: &mut [u8]) -> Result<(), DeviceError> {
            Ok(())
        }
        fn stamp_buffer(&mut self, _slot: u32, _stamp: u64) -> Result<(), DeviceError> {
            Ok(())
        }
        fn drain(&mut self, _deadline: Instant) {}
        fn pace_idle_poll(&self, _polls: u32) {
            self.paced.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_job_thread_that_cannot_start_releases_the_others() {
        // Goal: a job thread that cannot be started (a pids limit) must not leave the started
        // ones waiting for it at the start barrier forever (and the join and the progress thread
        // with them): they are released, their queues closed, and the phase fails naming why.
        let devices: Vec<Arc<dyn Device>> =
            vec![Arc::new(SplitDevice { paced: Arc::new(std::sync::atomic::AtomicU32::new(0)) }) as Arc<dyn Device>];
        let plan = split_plan();
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let progress = Arc::new(Progress::default());
            let result = run_phase_with(&devices, 3, &plan, &progress, &|job| {
                if job == 1 {
                    Err(std::io::Error::other("Resource temporarily unavailable (pids limit)"))
                } else {
                    Ok(std::thread::Builder::new())
                }
            });
            let _ = sender.send(result.map(|_| ()).map_err(|error| format!("{error:#}")));
        });
        let result = receiver.recv_timeout(Duration::from_secs(10)).expect("run_phase did not return within 10 s");
        let message = result.expect_err("a phase with a job that never started succeeded");
        assert!(message.contains("cannot start a job thread") && message.contains("pids limit"), "{message}");
    }

    fn split_plan() -> PhasePlan {
        PhasePlan {
            label: "split".into(),
            pattern: crate::args::Pattern::Read,
            bs: 4096,
            iodepth: 4,
            region_start: 0,
            region_bytes: 1 << 20,
            split_region: false,
            runtime: None,
            time_based: false,
            number_ios: Some(200),
            rwmixread: 100,
            verify: VerifyMode::None,
            scramble_buffers: true,
            seed: 1,
            cpus_allowed: None,
        }
    }

    fn run_on_split_devices(devices: usize) -> (u64, u32) {
        let paced = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let devices: Vec<Arc<dyn Device>> =
            (0..devices).map(|_| Arc::new(SplitDevice { paced: Arc::clone(&paced) }) as Arc<dyn Device>).collect();
        let plan = split_plan();
        let progress = Arc::new(Progress::default());
        let result = run_phase(&devices, 1, &plan, &progress).expect("phase");
        let ios = result.jobs.iter().map(|job| job.read.ios).sum();
        (ios, paced.load(Ordering::Relaxed))
    }

    #[test]
    fn a_waited_reap_that_completes_part_of_an_io_waits_again_without_pacing() {
        // Goal: with one device, the job loop waits inside submit_and_reap (under the device's
        // own waiter); a reap that finished only one command of a split I/O goes straight back
        // to waiting. Pacing there put a spin hint (x86 PAUSE, QEMU's big lock under TCG) after
        // such reaps on `vfio:` too.
        let (ios, paced) = run_on_split_devices(1);
        assert_eq!(ios, 200);
        assert_eq!(paced, 0, "one device: the job loop paced {paced} polls");
    }

    #[test]
    fn devices_polled_in_turn_pace_their_idle_polls() {
        // Goal: with several devices nobody waits in submit_and_reap, so a poll of all of them
        // that completed nothing is paced by each device (a software controller may share
        // this thread's cores).
        let (ios, paced) = run_on_split_devices(2);
        assert_eq!(ios, 200);
        assert!(paced > 0, "two devices polled in turn were never paced");
    }

    /// A device that makes each I/O visible as it is queued (as `uring:` does: one
    /// `io_uring_enter` per I/O) after [`SLOW_SUBMIT`] of work, and completes it
    /// [`SERVICE_TIME`] after it became visible.
    struct SlowSubmitDevice;
    struct SlowSubmitQueue {
        /// Slots in flight with the moment each completes, oldest first.
        in_flight: std::collections::VecDeque<(u32, Instant)>,
    }
    const SLOW_SUBMIT: Duration = Duration::from_millis(2);
    const SERVICE_TIME: Duration = Duration::from_millis(5);

    impl Device for SlowSubmitDevice {
        fn name(&self) -> String {
            "slow-submit".into()
        }
        fn describe(&self) -> String {
            "publishes each I/O as it is queued, slowly".into()
        }
        fn capacity_bytes(&self) -> u64 {
            1 << 20
        }
        fn block_size_bytes(&self) -> u32 {
            4096
        }
        fn open_queue(&self, _depth: u32, _slot_bytes: usize, _traffic: Traffic) -> Result<Box<dyn IoQueue>, DeviceError> {
            Ok(Box::new(SlowSubmitQueue { in_flight: Default::default() }))
        }
    }

    impl IoQueue for SlowSubmitQueue {
        fn queue(&mut self, slot: u32, _direction: Direction, _offset_bytes: u64) -> Result<Visibility, DeviceError> {
            std::thread::sleep(SLOW_SUBMIT);
            // Visible from here: the service time runs from now.
            self.in_flight.push_back((slot, Instant::now() + SERVICE_TIME));
            Ok(Visibility::Published)
        }
        fn submit_and_reap(
            &mut self,
            wait: bool,
            deadline: Instant,
            on_done: &mut dyn FnMut(u32, Result<(), DeviceError>),
        ) -> Result<usize, DeviceError> {
            if let Some(&(_, due)) = self.in_flight.front() {
                if wait && due > Instant::now() {
                    std::thread::sleep(due.min(deadline).saturating_duration_since(Instant::now()));
                }
            }
            let mut done = 0;
            while let Some(&(slot, due)) = self.in_flight.front() {
                if due > Instant::now() {
                    break;
                }
                self.in_flight.pop_front();
                on_done(slot, Ok(()));
                done += 1;
            }
            Ok(done)
        }
        fn write_buffer(&mut self, _slot: u32, _source: &[u8]) -> Result<(), DeviceError> {
            Ok(())
        }
        fn read_buffer(&self, _slot: u32, _destination: &mut [u8]) -> Result<(), DeviceError> {
            Ok(())
        }
        fn stamp_buffer(&mut self, _slot: u32, _stamp: u64) -> Result<(), DeviceError> {
            Ok(())
        }
        fn drain(&mut self, _deadline: Instant) {}
    }

    #[test]
    fn clat_runs_from_when_each_io_became_visible_to_the_device() {
        // Goal: an I/O's clat starts when it became visible to the device, not after the whole
        // refill: a device that publishes each I/O as it is queued and serves it in
        // SERVICE_TIME can complete nothing sooner, so no clat is below that service time
        // (less 1 ms: the job reads its clock just after queue() returns, a little after the
        // fake started its service clock). One clock reading after the refill, used for every
        // I/O of it, made the first I/Os' clat about zero.
        let devices: Vec<Arc<dyn Device>> = vec![Arc::new(SlowSubmitDevice)];
        let plan = PhasePlan {
            label: "slow submit".into(),
            pattern: crate::args::Pattern::Read,
            bs: 4096,
            iodepth: 4,
            region_start: 0,
            region_bytes: 1 << 20,
            split_region: false,
            runtime: None,
            time_based: false,
            number_ios: Some(16),
            rwmixread: 100,
            verify: VerifyMode::None,
            scramble_buffers: true,
            seed: 1,
            cpus_allowed: None,
        };
        let result = run_phase(&devices, 1, &plan, &Arc::new(Progress::default())).expect("phase");
        let read = &result.jobs[0].read;
        assert_eq!(read.ios, 16);
        let floor_ns = (SERVICE_TIME - Duration::from_millis(1)).as_nanos() as u64;
        assert!(read.completion.min() >= floor_ns, "clat min {} ns, service time {SERVICE_TIME:?}", read.completion.min());
    }

    #[test]
    fn striping_round_robins_blocks() {
        assert_eq!(stripe(0, 4096, 2), (0, 0));
        assert_eq!(stripe(4096, 4096, 2), (1, 0));
        assert_eq!(stripe(8192, 4096, 2), (0, 4096));
        assert_eq!(stripe(12288, 4096, 1), (0, 12288));
    }
}
