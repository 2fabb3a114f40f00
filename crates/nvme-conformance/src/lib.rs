//! The NVMe driver's conformance suite: one set of checks that can be pointed at any device the
//! driver's hardware seam reaches — the software controller in every `cargo test`, QEMU's
//! emulated controller through VFIO in the VM harness, a real SSD by PCI address.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # fn device() -> Arc<dyn nvme_driver::DeviceBackend> { unimplemented!() }
//! let report = nvme_conformance::run_suite(device(), None, &nvme_conformance::SuiteConfig::default());
//! print!("{report}");
//! assert!(report.passed());
//! ```
//!
//! Checks that need to provoke faults (a controller fatal status, a dropped completion) take a
//! [`FaultInjector`]; on a device without one (QEMU, real SSDs) they are reported as skipped.
#![forbid(unsafe_code)]

mod checks;
mod emu;
mod pattern;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::DeviceBackend;

pub use emu::EmuFaults;
pub use pattern::{fill_pattern, verify_pattern};

/// Faults a test device can be told to produce (the software controller implements this).
pub trait FaultInjector: Send + Sync {
    /// The next I/O command is never completed.
    fn drop_next_completion(&self);
    /// The controller sets CSTS.CFS and stops processing until reset.
    fn raise_fatal_status(&self);
    /// The next completion carries a corrupted command id.
    fn corrupt_next_command_id(&self);
    /// Clears any pending fault.
    fn clear_faults(&self);
}

/// What to run and how hard.
#[derive(Debug, Clone)]
pub struct SuiteConfig {
    /// I/O queue pairs to ask the controller for and exercise at once. A controller may grant
    /// fewer (Set Features Number of Queues): the multi-queue checks then run with what it
    /// granted (at least one) and say so in their result line.
    pub queue_pairs: u16,
    /// Upper bound on queue depth (CAP.MQES bounds it too).
    pub queue_depth_max: u32,
    /// Deadline for any one wait.
    pub timeout: Duration,
    /// MiB of patterned data for the data-integrity check (0 skips it).
    pub integrity_mib: u64,
    /// Fewer sizes and iterations (slow emulation, e.g. QEMU under TCG).
    pub quick: bool,
    /// Run only checks whose name contains this.
    pub filter: Option<String>,
}

impl Default for SuiteConfig {
    fn default() -> Self {
        Self { queue_pairs: 4, queue_depth_max: 1024, timeout: Duration::from_secs(30), integrity_mib: 0, quick: false, filter: None }
    }
}

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    Failed(String),
    Skipped(String),
}

#[derive(Debug, Clone)]
pub struct CheckResult {
    pub name: &'static str,
    pub outcome: Outcome,
    pub duration: Duration,
    /// What a passed check adapted to the device (e.g. how many queue pairs it used).
    pub note: Option<String>,
}

/// Every check's result, in order.
#[derive(Debug, Clone)]
pub struct SuiteReport {
    pub device: String,
    pub results: Vec<CheckResult>,
}

impl SuiteReport {
    /// True when no check failed and at least one passed.
    pub fn passed(&self) -> bool {
        self.failed() == 0 && self.count(|outcome| matches!(outcome, Outcome::Passed)) > 0
    }

    pub fn failed(&self) -> usize {
        self.count(|outcome| matches!(outcome, Outcome::Failed(_)))
    }

    fn count(&self, predicate: impl Fn(&Outcome) -> bool) -> usize {
        self.results.iter().filter(|result| predicate(&result.outcome)).count()
    }
}

impl fmt::Display for SuiteReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "conformance suite on {}", self.device)?;
        for result in &self.results {
            let (word, detail) = match &result.outcome {
                Outcome::Passed => ("PASS", result.note.as_ref().map(|note| format!(": {note}")).unwrap_or_default()),
                Outcome::Failed(message) => ("FAIL", format!(": {message}")),
                Outcome::Skipped(reason) => ("SKIP", format!(": {reason}")),
            };
            writeln!(f, "  {word} {:<34} {:>8.1} ms{detail}", result.name, result.duration.as_secs_f64() * 1e3)?;
        }
        let passed = self.count(|outcome| matches!(outcome, Outcome::Passed));
        let skipped = self.count(|outcome| matches!(outcome, Outcome::Skipped(_)));
        writeln!(f, "{passed} passed, {} failed, {skipped} skipped", self.failed())
    }
}

/// Runs every check against the device. Never panics on device behaviour: every problem becomes
/// a failed check with a message.
pub fn run_suite(device: Arc<dyn DeviceBackend>, faults: Option<Arc<dyn FaultInjector>>, config: &SuiteConfig) -> SuiteReport {
    let mut results = Vec::new();
    for check in checks::ALL {
        if config.filter.as_deref().is_some_and(|filter| !check.name.contains(filter)) {
            continue;
        }
        if check.name == "data_integrity" && config.integrity_mib == 0 {
            continue;
        }
        let started = Instant::now();
        let (outcome, note) =
            match (check.run)(&checks::Context { device: Arc::clone(&device), faults: faults.clone(), config: config.clone() }) {
                Ok(checks::Verdict::Passed) => (Outcome::Passed, None),
                Ok(checks::Verdict::PassedWith(note)) => (Outcome::Passed, Some(note)),
                Ok(checks::Verdict::Skipped(reason)) => (Outcome::Skipped(reason), None),
                Err(error) => (Outcome::Failed(format!("{error:#}")), None),
            };
        if let Some(faults) = &faults {
            faults.clear_faults();
        }
        results.push(CheckResult { name: check.name, outcome, duration: started.elapsed(), note });
    }
    SuiteReport { device: device.name(), results }
}
