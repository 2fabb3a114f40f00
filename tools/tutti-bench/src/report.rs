//! Statistics (hdrhistogram latencies, CPU time) and the two output formats: fio-like text and
//! JSON with fio's field names where they mean the same thing.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde_json::{json, Map, Value};

use crate::args::{format_size, Pattern};
use crate::workloads::VerifyMode;

/// Percentiles printed and written, as fio names them.
pub const PERCENTILES: [f64; 7] = [1.0, 10.0, 50.0, 90.0, 99.0, 99.9, 99.99];

/// Latencies up to an hour, 3 significant digits: ~200 KiB per histogram, allocated once.
fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("constant histogram bounds are valid")
}

/// One direction (read or write) of one job.
///
/// Only clat keeps a histogram (percentiles); slat, clat and lat keep exact min, max, mean and
/// stddev (clat's from its own summary, not the histogram's 3-digit buckets), as fio does by
/// default. Recording three histograms per I/O was ~150 of the job thread's ~1,600
/// instructions per 4 KiB read at QD 32 (callgrind, docs/tutti-bench.md).
#[derive(Clone)]
pub struct DirectionStats {
    pub ios: u64,
    pub bytes: u64,
    /// Queued → completion seen (fio's lat).
    pub total: LatencySummary,
    /// Made visible to the device → completion seen (fio's clat): its percentiles.
    pub completion: Histogram<u64>,
    /// The same latency's exact min, max, mean and stddev.
    pub completion_exact: LatencySummary,
    /// Queued → made visible to the device (fio's slat).
    pub submission: LatencySummary,
}

impl DirectionStats {
    pub fn new() -> Self {
        Self {
            ios: 0,
            bytes: 0,
            total: LatencySummary::default(),
            completion: new_histogram(),
            completion_exact: LatencySummary::default(),
            submission: LatencySummary::default(),
        }
    }

    /// Records one I/O from its three timestamps (nanoseconds on one clock).
    pub fn record(&mut self, bytes: u64, queued_ns: u64, submitted_ns: u64, done_ns: u64) {
        self.ios += 1;
        self.bytes += bytes;
        self.total.record(done_ns.saturating_sub(queued_ns));
        let completion_ns = done_ns.saturating_sub(submitted_ns);
        self.completion.saturating_record(completion_ns.max(1));
        self.completion_exact.record(completion_ns);
        self.submission.record(submitted_ns.saturating_sub(queued_ns));
    }

    pub fn merge(&mut self, other: &DirectionStats) {
        self.ios += other.ios;
        self.bytes += other.bytes;
        self.total.merge(&other.total);
        // Same bounds on both sides: adding cannot fail.
        let _ = self.completion.add(&other.completion);
        self.completion_exact.merge(&other.completion_exact);
        self.submission.merge(&other.submission);
    }
}

/// Count, min, max and exact sums of one latency, in nanoseconds: a few integer operations per
/// I/O where a histogram record is ~50 instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatencySummary {
    count: u64,
    min_ns: u64,
    max_ns: u64,
    sum_ns: u128,
    sum_squares_ns2: u128,
}

impl Default for LatencySummary {
    fn default() -> Self {
        Self { count: 0, min_ns: u64::MAX, max_ns: 0, sum_ns: 0, sum_squares_ns2: 0 }
    }
}

impl LatencySummary {
    pub fn record(&mut self, value_ns: u64) {
        self.count += 1;
        self.min_ns = self.min_ns.min(value_ns);
        self.max_ns = self.max_ns.max(value_ns);
        let value = u128::from(value_ns);
        // The sum cannot reach u128::MAX (2^64 values would be needed). The sum of squares can,
        // but only after ~2^44 latencies of an hour each; it then saturates (no wrap-around,
        // but the stddev is no longer exact). No run gets near that.
        self.sum_ns = self.sum_ns.saturating_add(value);
        self.sum_squares_ns2 = self.sum_squares_ns2.saturating_add(value * value);
    }

    pub fn merge(&mut self, other: &LatencySummary) {
        self.count += other.count;
        self.min_ns = self.min_ns.min(other.min_ns);
        self.max_ns = self.max_ns.max(other.max_ns);
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
        self.sum_squares_ns2 = self.sum_squares_ns2.saturating_add(other.sum_squares_ns2);
    }

    fn figures(&self) -> LatencyFigures {
        if self.count == 0 {
            return LatencyFigures { min_ns: 0, max_ns: 0, mean_ns: 0.0, stdev_ns: 0.0, count: 0 };
        }
        let count = u128::from(self.count);
        // Population variance n·Σx² − (Σx)² over n², exact in integers where it fits.
        let variance = count
            .checked_mul(self.sum_squares_ns2)
            .and_then(|scaled| self.sum_ns.checked_mul(self.sum_ns).map(|square| scaled.saturating_sub(square)))
            .map_or_else(
                || {
                    let mean = self.sum_ns as f64 / count as f64;
                    (self.sum_squares_ns2 as f64 / count as f64 - mean * mean).max(0.0)
                },
                |numerator| numerator as f64 / (count as f64 * count as f64),
            );
        LatencyFigures {
            min_ns: self.min_ns,
            max_ns: self.max_ns,
            mean_ns: self.sum_ns as f64 / count as f64,
            stdev_ns: variance.sqrt(),
            count: self.count,
        }
    }
}

/// What the text and JSON reports print for one latency.
struct LatencyFigures {
    min_ns: u64,
    max_ns: u64,
    mean_ns: f64,
    stdev_ns: f64,
    count: u64,
}

impl Default for DirectionStats {
    fn default() -> Self {
        Self::new()
    }
}

/// User and system CPU time.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTime {
    pub user: Duration,
    pub system: Duration,
}

impl CpuTime {
    pub fn since(&self, before: &CpuTime) -> CpuTime {
        CpuTime { user: self.user.saturating_sub(before.user), system: self.system.saturating_sub(before.system) }
    }

    pub fn total(&self) -> Duration {
        self.user + self.system
    }
}

fn rusage(who: libc::c_int) -> CpuTime {
    // getrusage only fails for an invalid `who`; then "no CPU" is reported rather than a guess.
    let Some(usage) = crate::uring::getrusage(who) else { return CpuTime::default() };
    let duration = |time: libc::timeval| Duration::from_secs(time.tv_sec.max(0) as u64) + Duration::from_micros(time.tv_usec.max(0) as u64);
    CpuTime { user: duration(usage.ru_utime), system: duration(usage.ru_stime) }
}

/// CPU time of the calling thread.
pub fn thread_cpu() -> CpuTime {
    rusage(libc::RUSAGE_THREAD)
}

/// CPU time of the whole process (job threads, the software controller's thread, the kernel on
/// their behalf).
pub struct ProcessCpu;

impl ProcessCpu {
    #[allow(clippy::new_ret_no_self)]
    pub fn now() -> CpuTime {
        rusage(libc::RUSAGE_SELF)
    }
}

pub struct JobStats {
    pub name: String,
    pub read: DirectionStats,
    pub write: DirectionStats,
    pub elapsed: Duration,
    pub thread_cpu: CpuTime,
    /// When the job's I/O started (after every job met at the barrier, its queues open) and
    /// ended (its last completion, before its queues drain), with the process's CPU time at
    /// each: the phase's aggregate figures span the earliest start to the latest end.
    pub window: JobWindow,
}

#[derive(Debug, Clone, Copy)]
pub struct JobWindow {
    pub started: std::time::Instant,
    pub process_cpu_at_start: CpuTime,
    pub ended: std::time::Instant,
    pub process_cpu_at_end: CpuTime,
}

pub struct PhaseResult {
    pub label: String,
    pub pattern: Pattern,
    pub verify: VerifyMode,
    pub jobs: Vec<JobStats>,
    pub elapsed: Duration,
    pub process_cpu: CpuTime,
}

impl PhaseResult {
    pub fn total_ios(&self) -> u64 {
        self.jobs.iter().map(|job| job.read.ios + job.write.ios).sum()
    }

    fn merged(&self) -> (DirectionStats, DirectionStats) {
        let mut read = DirectionStats::new();
        let mut write = DirectionStats::new();
        for job in &self.jobs {
            read.merge(&job.read);
            write.merge(&job.write);
        }
        (read, write)
    }

    /// Process CPU nanoseconds per I/O.
    pub fn cpu_ns_per_io(&self) -> Option<f64> {
        let ios = self.total_ios();
        (ios > 0).then(|| self.process_cpu.total().as_nanos() as f64 / ios as f64)
    }
}

fn rate(amount: u64, elapsed: Duration) -> f64 {
    let seconds = elapsed.as_secs_f64();
    if seconds > 0.0 {
        amount as f64 / seconds
    } else {
        0.0
    }
}

fn human_count(value: f64) -> String {
    if value >= 1e6 {
        format!("{:.2}M", value / 1e6)
    } else if value >= 1e4 {
        format!("{:.1}k", value / 1e3)
    } else {
        format!("{value:.0}")
    }
}

fn human_bandwidth(bytes_per_second: f64) -> String {
    let mib = bytes_per_second / (1024.0 * 1024.0);
    let mb = bytes_per_second / 1e6;
    if mib >= 1024.0 {
        format!("{:.2}GiB/s ({:.2}GB/s)", mib / 1024.0, mb / 1000.0)
    } else {
        format!("{mib:.1}MiB/s ({mb:.1}MB/s)")
    }
}

/// Picks fio's unit for a latency line by the magnitude of the mean.
fn latency_unit(mean_ns: f64) -> (&'static str, f64) {
    if mean_ns >= 10_000_000.0 {
        ("msec", 1e6)
    } else if mean_ns >= 10_000.0 {
        ("usec", 1e3)
    } else {
        ("nsec", 1.0)
    }
}

fn latency_line(name: &str, figures: &LatencyFigures) -> String {
    let (unit, divisor) = latency_unit(figures.mean_ns);
    format!(
        "    {name} ({unit}): min={:.0}, max={:.0}, avg={:.2}, stdev={:.2}",
        figures.min_ns as f64 / divisor,
        figures.max_ns as f64 / divisor,
        figures.mean_ns / divisor,
        figures.stdev_ns / divisor
    )
}

fn percentile_line(histogram: &Histogram<u64>) -> String {
    let (unit, divisor) = latency_unit(histogram.mean());
    let values: Vec<String> = PERCENTILES
        .iter()
        .map(|&percentile| format!("{percentile:.2}th=[{:.0}]", histogram.value_at_quantile(percentile / 100.0) as f64 / divisor))
        .collect();
    format!("    clat percentiles ({unit}): {}", values.join(", "))
}

fn direction_text(label: &str, stats: &DirectionStats, elapsed: Duration) -> Vec<String> {
    if stats.ios == 0 {
        return Vec::new();
    }
    vec![
        format!(
            "  {label}: IOPS={}, BW={} ({}/{:.2}s)",
            human_count(rate(stats.ios, elapsed)),
            human_bandwidth(rate(stats.bytes, elapsed)),
            format_size(stats.bytes),
            elapsed.as_secs_f64()
        ),
        latency_line("slat", &stats.submission.figures()),
        latency_line("clat", &stats.completion_exact.figures()),
        latency_line(" lat", &stats.total.figures()),
        percentile_line(&stats.completion),
    ]
}

/// fio-like text for one phase.
pub fn phase_text(phase: &PhaseResult) -> String {
    let mut lines = vec![format!("{}: {} job(s), {:.2}s", phase.label, phase.jobs.len(), phase.elapsed.as_secs_f64())];
    let many = phase.jobs.len() > 1;
    if many {
        for job in &phase.jobs {
            let ios = job.read.ios + job.write.ios;
            let bytes = job.read.bytes + job.write.bytes;
            lines.push(format!(
                "  {}: IOPS={}, BW={}, thread cpu: usr={:.3}s sys={:.3}s",
                job.name,
                human_count(rate(ios, job.elapsed)),
                human_bandwidth(rate(bytes, job.elapsed)),
                job.thread_cpu.user.as_secs_f64(),
                job.thread_cpu.system.as_secs_f64()
            ));
        }
    }
    let (read, write) = phase.merged();
    lines.extend(direction_text("read", &read, phase.elapsed));
    lines.extend(direction_text("write", &write, phase.elapsed));
    let seconds = phase.elapsed.as_secs_f64().max(1e-9);
    lines.push(format!(
        "  cpu (process): usr={:.2}%, sys={:.2}%, {} per I/O",
        100.0 * phase.process_cpu.user.as_secs_f64() / seconds,
        100.0 * phase.process_cpu.system.as_secs_f64() / seconds,
        phase.cpu_ns_per_io().map_or("n/a".to_string(), |ns| format!("{ns:.0} ns")),
    ));
    let thread: Duration = phase.jobs.iter().map(|job| job.thread_cpu.total()).sum();
    let ios = phase.total_ios();
    if ios > 0 {
        lines.push(format!("  cpu (job threads only): {:.0} ns per I/O", thread.as_nanos() as f64 / ios as f64));
    }
    if phase.verify == VerifyMode::CheckPattern {
        lines.push(format!("  verify: {} read back and compared, no mismatch", format_size(read.bytes)));
    }
    lines.join("\n")
}

fn latency_json(figures: &LatencyFigures, percentiles_of: Option<&Histogram<u64>>) -> Value {
    let mut object = Map::new();
    object.insert("min".into(), json!(figures.min_ns));
    object.insert("max".into(), json!(figures.max_ns));
    object.insert("mean".into(), json!(figures.mean_ns));
    object.insert("stddev".into(), json!(figures.stdev_ns));
    object.insert("N".into(), json!(figures.count));
    if let Some(histogram) = percentiles_of {
        let mut percentiles = Map::new();
        for percentile in PERCENTILES {
            percentiles.insert(format!("{percentile:.6}"), json!(histogram.value_at_quantile(percentile / 100.0)));
        }
        object.insert("percentile".into(), Value::Object(percentiles));
    }
    Value::Object(object)
}

fn direction_json(stats: &DirectionStats, elapsed: Duration) -> Value {
    json!({
        "io_bytes": stats.bytes,
        "io_kbytes": stats.bytes / 1024,
        "bw_bytes": rate(stats.bytes, elapsed).round() as u64,
        "bw": (rate(stats.bytes, elapsed) / 1024.0).round() as u64,
        "iops": rate(stats.ios, elapsed),
        "runtime": elapsed.as_millis() as u64,
        "total_ios": stats.ios,
        "slat_ns": latency_json(&stats.submission.figures(), None),
        "clat_ns": latency_json(&stats.completion_exact.figures(), Some(&stats.completion)),
        "lat_ns": latency_json(&stats.total.figures(), None),
    })
}

/// fio-shaped JSON for one phase: `jobs[]` with `read`/`write` objects, plus an aggregate.
pub fn phase_json(phase: &PhaseResult) -> Value {
    let seconds = phase.elapsed.as_secs_f64().max(1e-9);
    let jobs: Vec<Value> = phase
        .jobs
        .iter()
        .map(|job| {
            let job_seconds = job.elapsed.as_secs_f64().max(1e-9);
            json!({
                "jobname": job.name,
                "groupid": 0,
                "error": 0,
                "job_runtime": job.elapsed.as_millis() as u64,
                "read": direction_json(&job.read, job.elapsed),
                "write": direction_json(&job.write, job.elapsed),
                "usr_cpu": 100.0 * job.thread_cpu.user.as_secs_f64() / job_seconds,
                "sys_cpu": 100.0 * job.thread_cpu.system.as_secs_f64() / job_seconds,
            })
        })
        .collect();
    let (read, write) = phase.merged();
    json!({
        "phase": phase.label,
        "rw": phase.pattern.name(),
        "verify": phase.verify == VerifyMode::CheckPattern,
        "elapsed_ms": phase.elapsed.as_millis() as u64,
        "jobs": jobs,
        "aggregate": {
            "read": direction_json(&read, phase.elapsed),
            "write": direction_json(&write, phase.elapsed),
            "usr_cpu": 100.0 * phase.process_cpu.user.as_secs_f64() / seconds,
            "sys_cpu": 100.0 * phase.process_cpu.system.as_secs_f64() / seconds,
            "cpu_ns_per_io": phase.cpu_ns_per_io(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_summary_matches_the_exact_figures() {
        let values = [3u64, 7, 7, 11, 1_000, 250];
        let mut summary = LatencySummary::default();
        for value in values {
            summary.record(value);
        }
        let figures = summary.figures();
        let mean = values.iter().sum::<u64>() as f64 / values.len() as f64;
        let variance = values.iter().map(|&value| (value as f64 - mean).powi(2)).sum::<f64>() / values.len() as f64;
        assert_eq!((figures.min_ns, figures.max_ns, figures.count), (3, 1_000, 6));
        assert!((figures.mean_ns - mean).abs() < 1e-9, "{} vs {mean}", figures.mean_ns);
        assert!((figures.stdev_ns - variance.sqrt()).abs() < 1e-9, "{} vs {}", figures.stdev_ns, variance.sqrt());
    }

    #[test]
    fn merged_summaries_equal_one_summary_of_all_values() {
        let (mut left, mut right, mut all) = (LatencySummary::default(), LatencySummary::default(), LatencySummary::default());
        for value in 0..100u64 {
            let value = value * value * 37 % 9_973;
            if value % 3 == 0 { &mut left } else { &mut right }.record(value);
            all.record(value);
        }
        left.merge(&right);
        assert_eq!(left, all);
        // Empty: zeros, not u64::MAX as a minimum.
        let empty = LatencySummary::default().figures();
        assert_eq!((empty.min_ns, empty.max_ns, empty.count), (0, 0, 0));
    }

    #[test]
    fn huge_latencies_fall_back_to_floating_point_without_overflow() {
        let mut summary = LatencySummary::default();
        summary.record(u64::MAX);
        summary.record(u64::MAX - 2);
        let figures = summary.figures();
        assert_eq!(figures.max_ns, u64::MAX);
        assert!(figures.stdev_ns.is_finite() && figures.mean_ns > 1e19);
    }

    #[test]
    fn clat_min_max_and_mean_are_exact_not_histogram_buckets() {
        // Goal: clat's min, max, mean and stddev came from the histogram (3 significant digits),
        // so a clat max could exceed the lat max of the same I/O (46,662 us against 46,638 us).
        let mut stats = DirectionStats::new();
        stats.record(4096, 0, 0, 46_638_000);
        stats.record(4096, 0, 10, 1_001);
        let json = direction_json(&stats, Duration::from_secs(1));
        let (clat, lat) = (&json["clat_ns"], &json["lat_ns"]);
        assert_eq!(clat["max"], 46_638_000, "{clat}");
        assert_eq!(clat["min"], 991, "{clat}");
        assert!(clat["max"].as_u64() <= lat["max"].as_u64(), "{clat} vs {lat}");
        assert_eq!(clat["mean"].as_f64(), Some((46_638_000.0 + 991.0) / 2.0), "{clat}");
        assert!(phase_text_lines(&stats).iter().any(|line| line.contains("clat (msec): min=0, max=47,")), "{:?}", phase_text_lines(&stats));
    }

    fn phase_text_lines(stats: &DirectionStats) -> Vec<String> {
        direction_text("read", stats, Duration::from_secs(1))
    }

    #[test]
    fn direction_stats_split_one_io_into_slat_clat_and_lat() {
        let mut stats = DirectionStats::new();
        stats.record(4096, 1_000, 1_300, 6_300);
        assert_eq!(stats.submission.figures().max_ns, 300);
        assert_eq!(stats.total.figures().max_ns, 5_300);
        assert!(stats.completion.equivalent(stats.completion.max(), 5_000));
        // A clock that went backwards between readings records zero, not a wrapped value.
        stats.record(4096, 2_000, 1_900, 1_800);
        assert_eq!(stats.submission.figures().min_ns, 0);
        let json = direction_json(&stats, Duration::from_secs(1));
        assert!(json["clat_ns"]["percentile"]["99.000000"].as_u64().unwrap() >= 4_990);
        assert!(json["lat_ns"].get("percentile").is_none() && json["slat_ns"].get("percentile").is_none());
    }
}
