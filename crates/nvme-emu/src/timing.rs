//! An optional timing model: makes the software controller complete Reads and Writes no sooner
//! than an SSD of given read and write bandwidth, command latency and mixed-traffic collapse
//! would (in the spirit of FEMU's latency emulation, much simpler).
//!
//! The controller still moves the data when it executes a command; the model only holds the
//! completion back. Each direction is a FIFO pipe of the configured bandwidth: a command's bytes
//! start flowing when the commands of its direction before it have flowed, and its completion
//! is posted `command_latency` after its last byte. While both directions have bytes flowing,
//! each gets only `mixed_share` of its solo bandwidth (Tutti §3.3 measures ~60% lost on real
//! SSDs under mixed traffic). This is a fluid model advanced piecewise: between two events
//! (an arrival or the end of a command's transfer) both pipes flow at constant rates.
//!
//! A completion is therefore posted at the later of what the model says and what this machine
//! achieves: the model can make the emulator slower, never faster. Everything a figure measured
//! with the model on says about an SSD is what the model was told; tools print the model next to
//! such figures.

use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};

use nvme_driver::spec::CompletionEntry;

use crate::EmuError;

/// What the model is told about the SSD it stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimingModel {
    /// Solo read bandwidth (no write in flight), bytes per second.
    pub read_bytes_per_s: u64,
    /// Solo write bandwidth (no read in flight), bytes per second.
    pub write_bytes_per_s: u64,
    /// Share of solo bandwidth each direction keeps while the other one also transfers, in
    /// thousandths (1..=1000; 1000 = no collapse).
    pub mixed_share_permille: u16,
    /// Time from a command's last byte to its completion (and the whole time of a command that
    /// moves no data: Flush, Write Zeroes, Dataset Management, errors).
    pub command_latency: Duration,
}

impl TimingModel {
    /// Refuses models that cannot be run: zero bandwidth, a share outside 1..=1000, a latency
    /// over a second.
    pub fn validate(&self) -> Result<(), EmuError> {
        let invalid = |reason: String| Err(EmuError::InvalidConfig { reason: format!("timing model: {reason}") });
        if self.read_bytes_per_s == 0 || self.write_bytes_per_s == 0 {
            return invalid("read and write bandwidth must be above 0 bytes/s".into());
        }
        if !(1..=1000).contains(&self.mixed_share_permille) {
            return invalid(format!("mixed share {} permille outside 1..=1000", self.mixed_share_permille));
        }
        if self.command_latency > Duration::from_secs(1) {
            return invalid(format!("command latency {:?} above 1 s", self.command_latency));
        }
        Ok(())
    }

    fn mixed_share(&self) -> f64 {
        f64::from(self.mixed_share_permille) / 1000.0
    }
}

impl fmt::Display for TimingModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "timing model: read {:.0} MB/s, write {:.0} MB/s, {}% of each under mixed traffic, {} µs per command",
            self.read_bytes_per_s as f64 / 1e6,
            self.write_bytes_per_s as f64 / 1e6,
            f64::from(self.mixed_share_permille) / 10.0,
            self.command_latency.as_micros()
        )
    }
}

/// What the model did, for [`crate::EmuStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimingStats {
    /// Reads and Writes whose completion the model held back.
    pub modelled_reads: u64,
    pub modelled_writes: u64,
    /// Model time during which reads flowed, writes flowed, and both at once.
    pub read_busy: Duration,
    pub write_busy: Duration,
    pub mixed_busy: Duration,
}

/// A completion the model holds until its transfer is over.
pub(crate) struct ModelledCommand {
    pub completion_queue_id: u16,
    pub entry: CompletionEntry,
    remaining_bytes: f64,
}

/// A command whose transfer is over: post `entry` at `due`.
pub(crate) struct FinishedCommand {
    pub completion_queue_id: u16,
    pub entry: CompletionEntry,
    pub due: Instant,
}

/// The model's state: two FIFO pipes and the time up to which they have flowed.
pub(crate) struct TimingState {
    model: TimingModel,
    reads: VecDeque<ModelledCommand>,
    writes: VecDeque<ModelledCommand>,
    /// Time up to which the pipes have been advanced.
    clock: Option<Instant>,
    stats: TimingStats,
}

/// Bytes below which a command counts as transferred (floating-point rounding of the rates).
const FINISHED_BYTES_EPSILON: f64 = 1e-6;

impl TimingState {
    pub(crate) fn new(model: TimingModel) -> Self {
        Self { model, reads: VecDeque::new(), writes: VecDeque::new(), clock: None, stats: TimingStats::default() }
    }

    pub(crate) fn stats(&self) -> TimingStats {
        self.stats
    }

    /// Queues a transfer of `bytes` in one direction, arriving at `now`. The caller has reserved
    /// a slot of its completion queue for it.
    pub(crate) fn admit(
        &mut self,
        now: Instant,
        write: bool,
        bytes: u64,
        command: (u16, CompletionEntry),
        finished: &mut Vec<FinishedCommand>,
    ) {
        self.advance(now, finished);
        let (completion_queue_id, entry) = command;
        let modelled = ModelledCommand { completion_queue_id, entry, remaining_bytes: bytes as f64 };
        if write {
            self.stats.modelled_writes += 1;
            self.writes.push_back(modelled);
        } else {
            self.stats.modelled_reads += 1;
            self.reads.push_back(modelled);
        }
    }

    /// Latency alone, for a command that moves no data.
    pub(crate) fn due_without_transfer(&self, now: Instant) -> Instant {
        now + self.model.command_latency
    }

    /// Current rates in bytes per second of (reads, writes): each direction its solo bandwidth,
    /// or its mixed share while the other one flows too.
    fn rates(&self) -> (f64, f64) {
        let both = !self.reads.is_empty() && !self.writes.is_empty();
        let share = if both { self.model.mixed_share() } else { 1.0 };
        (self.model.read_bytes_per_s as f64 * share, self.model.write_bytes_per_s as f64 * share)
    }

    /// Seconds until the first command at the head of a pipe has flowed, at the current rates.
    fn next_finish_s(&self) -> Option<f64> {
        let (read_rate, write_rate) = self.rates();
        let read = self.reads.front().map(|command| command.remaining_bytes / read_rate);
        let write = self.writes.front().map(|command| command.remaining_bytes / write_rate);
        match (read, write) {
            (Some(read), Some(write)) => Some(read.min(write)),
            (one, other) => one.or(other),
        }
    }

    /// Lets the pipes flow up to `now`, moving every command whose transfer ended by then to
    /// `finished` with its due time (end of transfer plus latency). Each pass of the loop
    /// finishes at least one command, so it runs at most once per command held, plus once.
    pub(crate) fn advance(&mut self, now: Instant, finished: &mut Vec<FinishedCommand>) {
        let Some(mut clock) = self.clock else {
            self.clock = Some(now);
            return;
        };
        while clock < now {
            let Some(next_s) = self.next_finish_s() else {
                clock = now;
                break;
            };
            let available_s = (now - clock).as_secs_f64();
            let step_s = next_s.min(available_s);
            let (read_rate, write_rate) = self.rates();
            let step = Duration::from_secs_f64(step_s);
            self.account(step);
            if let Some(head) = self.reads.front_mut() {
                head.remaining_bytes -= read_rate * step_s;
            }
            if let Some(head) = self.writes.front_mut() {
                head.remaining_bytes -= write_rate * step_s;
            }
            clock = if next_s <= available_s { clock + step } else { now };
            let due = clock + self.model.command_latency;
            for pipe in [&mut self.reads, &mut self.writes] {
                while pipe.front().is_some_and(|head| head.remaining_bytes <= FINISHED_BYTES_EPSILON) {
                    if let Some(done) = pipe.pop_front() {
                        finished.push(FinishedCommand { completion_queue_id: done.completion_queue_id, entry: done.entry, due });
                    }
                }
            }
            if next_s > available_s {
                break;
            }
        }
        self.clock = Some(clock.max(now));
    }

    fn account(&mut self, step: Duration) {
        let reading = !self.reads.is_empty();
        let writing = !self.writes.is_empty();
        if reading {
            self.stats.read_busy += step;
        }
        if writing {
            self.stats.write_busy += step;
        }
        if reading && writing {
            self.stats.mixed_busy += step;
        }
    }

    /// When the next held completion falls due at the current rates (no earlier one can).
    pub(crate) fn next_due(&self) -> Option<Instant> {
        let clock = self.clock?;
        let next_s = self.next_finish_s()?;
        Some(clock + Duration::from_secs_f64(next_s) + self.model.command_latency)
    }

    /// Drops every held completion (reset, power loss), calling `release` with each one's
    /// completion queue id so the caller can free its reserved slot.
    pub(crate) fn clear(&mut self, mut release: impl FnMut(u16)) {
        for command in self.reads.drain(..).chain(self.writes.drain(..)) {
            release(command.completion_queue_id);
        }
    }

    /// Takes out the held completions of a submission queue being deleted (their transfers stop
    /// flowing), handing each one's completion queue id and entry to `taken`: the caller posts
    /// them at once and frees their reserved slots.
    pub(crate) fn take_for(&mut self, submission_queue_id: u16, mut taken: impl FnMut(u16, CompletionEntry)) {
        for pipe in [&mut self.reads, &mut self.writes] {
            pipe.retain(|command| {
                let keep = command.entry.sq_id != submission_queue_id;
                if !keep {
                    taken(command.completion_queue_id, command.entry);
                }
                keep
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn model(read_mib_per_s: u64, write_mib_per_s: u64, share_permille: u16, latency_us: u64) -> TimingModel {
        TimingModel {
            read_bytes_per_s: read_mib_per_s * MIB,
            write_bytes_per_s: write_mib_per_s * MIB,
            mixed_share_permille: share_permille,
            command_latency: Duration::from_micros(latency_us),
        }
    }

    fn command(id: u16) -> (u16, CompletionEntry) {
        (1, CompletionEntry { command_id: id, sq_id: 1, ..CompletionEntry::default() })
    }

    /// Advances in small steps (as the poller does) until every command finished; returns each
    /// command id's due time in milliseconds after `start`.
    fn run_to_end(state: &mut TimingState, start: Instant) -> Vec<(u16, f64)> {
        let mut finished = Vec::new();
        let mut now = start;
        while state.next_due().is_some() {
            now += Duration::from_micros(250);
            state.advance(now, &mut finished);
        }
        finished.iter().map(|done| (done.entry.command_id, (done.due - start).as_secs_f64() * 1e3)).collect()
    }

    fn close(actual: f64, expected: f64) -> bool {
        (actual - expected).abs() < 1e-3
    }

    #[test]
    fn reads_flow_one_after_another_at_the_read_bandwidth_plus_latency() {
        // Goal: 4 x 1 MiB at 100 MiB/s end at 10, 20, 30, 40 ms, each posted 0.1 ms later.
        let start = Instant::now();
        let mut state = TimingState::new(model(100, 50, 400, 100));
        let mut finished = Vec::new();
        for id in 0..4 {
            state.admit(start, false, MIB, command(id), &mut finished);
        }
        let dues = run_to_end(&mut state, start);
        assert_eq!(dues.len(), 4);
        for (index, (id, due_ms)) in dues.iter().enumerate() {
            assert_eq!(*id as usize, index, "FIFO order");
            assert!(close(*due_ms, 10.0 * (index + 1) as f64 + 0.1), "{dues:?}");
        }
        assert_eq!(state.stats().modelled_reads, 4);
        assert_eq!(state.stats().mixed_busy, Duration::ZERO);
    }

    #[test]
    fn mixed_traffic_slows_both_directions_to_their_share() {
        // Goal: a 1 MiB read (100 MiB/s) and a 1 MiB write (50 MiB/s) together at 40%: the
        // read flows at 40 MiB/s and ends at 25 ms; the write has then moved 0.5 MiB (20 MiB/s)
        // and its other 0.5 MiB flow alone at 50 MiB/s: it ends at 35 ms.
        let start = Instant::now();
        let mut state = TimingState::new(model(100, 50, 400, 0));
        let mut finished = Vec::new();
        state.admit(start, false, MIB, command(1), &mut finished);
        state.admit(start, true, MIB, command(2), &mut finished);
        let dues = run_to_end(&mut state, start);
        assert!(close(dues[0].1, 25.0) && dues[0].0 == 1, "{dues:?}");
        assert!(close(dues[1].1, 35.0) && dues[1].0 == 2, "{dues:?}");
        let stats = state.stats();
        assert!((stats.mixed_busy.as_secs_f64() * 1e3 - 25.0).abs() < 0.01, "{stats:?}");
        // Without collapse (share 1000) the read would end at 10 ms.
        let mut solo = TimingState::new(model(100, 50, 1000, 0));
        solo.admit(start, false, MIB, command(1), &mut finished);
        solo.admit(start, true, MIB, command(2), &mut finished);
        let dues = run_to_end(&mut solo, start);
        assert!(close(dues[0].1, 10.0) && close(dues[1].1, 20.0), "{dues:?}");
    }

    #[test]
    fn an_idle_pipe_does_not_bank_time_and_a_late_write_slows_only_what_overlaps() {
        // Goal: a read arriving after 50 idle ms still takes its full 10 ms; a write arriving
        // 5 ms into it slows its second half only.
        let start = Instant::now();
        let mut state = TimingState::new(model(100, 100, 500, 0));
        let mut finished = Vec::new();
        state.advance(start, &mut finished);
        let read_at = start + Duration::from_millis(50);
        state.admit(read_at, false, MIB, command(1), &mut finished);
        state.admit(read_at + Duration::from_millis(5), true, MIB, command(2), &mut finished);
        let dues = run_to_end(&mut state, start);
        // Read: 0.5 MiB alone (5 ms), 0.5 MiB at 50 MiB/s (10 ms): ends at 65 ms. Write: 0.5 MiB
        // in those 10 ms, then 0.5 MiB alone (5 ms): ends at 70 ms.
        assert!(close(dues[0].1, 65.0) && close(dues[1].1, 70.0), "{dues:?}");
    }

    #[test]
    fn clearing_and_deleting_release_every_reserved_slot() {
        let start = Instant::now();
        let mut state = TimingState::new(model(1, 1, 500, 0));
        let mut finished = Vec::new();
        state.admit(start, false, MIB, (1, CompletionEntry { sq_id: 1, ..CompletionEntry::default() }), &mut finished);
        state.admit(start, true, MIB, (2, CompletionEntry { sq_id: 2, ..CompletionEntry::default() }), &mut finished);
        let mut released = Vec::new();
        state.take_for(2, |queue, entry| released.push((queue, entry.sq_id)));
        assert_eq!(released, [(2, 2)]);
        state.clear(|queue| released.push((queue, 0)));
        assert_eq!(released, [(2, 2), (1, 0)]);
        assert_eq!(state.next_due(), None);
    }

    #[test]
    fn models_that_cannot_run_are_refused() {
        assert!(model(0, 1, 500, 0).validate().is_err());
        assert!(model(1, 1, 0, 0).validate().is_err());
        assert!(model(1, 1, 1001, 0).validate().is_err());
        assert!(model(1, 1, 1000, 2_000_000).validate().is_err());
        assert!(model(1, 1, 1000, 50).validate().is_ok());
        let text = model(100, 50, 400, 50).to_string();
        assert_eq!(text, "timing model: read 105 MB/s, write 52 MB/s, 40% of each under mixed traffic, 50 µs per command");
    }
}
