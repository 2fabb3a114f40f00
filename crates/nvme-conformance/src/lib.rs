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
    /// Mixed into every data pattern's seed, drawn afresh for each [`run_suite`]: data an
    /// earlier run left on persistent media does not match this run's patterns, so a controller
    /// that completes writes without storing them fails instead of reading back the last run's
    /// blocks. Printed in the report's first line.
    pub pattern_nonce: u64,
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
        writeln!(f, "conformance suite on {}, pattern nonce {:#018x}", self.device, self.pattern_nonce)?;
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

/// A configuration the suite cannot run as asked: bad usage (the binary's exit status 2), found
/// before any check runs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UsageError {
    #[error("--filter '{filter}' matches no check; the checks: {checks}")]
    FilterMatchesNothing { filter: String, checks: String },
    #[error("--filter '{filter}' selects only data_integrity, which --integrity-mib 0 skips; accepted: --integrity-mib 1 or more")]
    IntegrityNotAsked { filter: String },
    #[error("--integrity-mib {mib} is larger than the namespace ({namespace_mib} MiB); accepted: up to {namespace_mib}")]
    IntegrityLargerThanNamespace { mib: u64, namespace_mib: u64 },
    #[error(
        "--filter '{filter}' selects only checks that need fault injection ({checks}), which this device lacks (only the \
         software controller, emu:, has it), so every one would be skipped; accepted: a filter that selects a check that \
         runs without it"
    )]
    NeedsFaultInjection { filter: String, checks: String },
    #[error("--integrity-mib {mib} is larger than any namespace (past 2^64 bytes); accepted: up to the namespace's size in MiB")]
    IntegrityPastAnyNamespace { mib: u64 },
}

/// Bytes a MiB count of the data-integrity check covers (None past 2^64).
fn integrity_bytes(mib: u64) -> Option<u64> {
    mib.checked_mul(1 << 20)
}

impl SuiteConfig {
    /// The checks this configuration runs, in order: those whose name contains the filter,
    /// less data_integrity when `integrity_mib` is 0.
    pub fn selected_checks(&self) -> Vec<&'static str> {
        checks::ALL
            .iter()
            .map(|check| check.name)
            .filter(|name| self.filter.as_deref().is_none_or(|filter| name.contains(filter)))
            .filter(|name| *name != "data_integrity" || self.integrity_mib > 0)
            .collect()
    }

    /// What can be refused without a device: a filter that selects nothing, an integrity size
    /// past 2^64 bytes.
    pub fn validate(&self) -> Result<(), UsageError> {
        if self.selected_checks().is_empty() {
            let filter = self.filter.clone().unwrap_or_default();
            if "data_integrity".contains(filter.as_str()) {
                return Err(UsageError::IntegrityNotAsked { filter });
            }
            let checks = checks::ALL.iter().map(|check| check.name).collect::<Vec<_>>().join(", ");
            return Err(UsageError::FilterMatchesNothing { filter, checks });
        }
        if integrity_bytes(self.integrity_mib).is_none() {
            return Err(UsageError::IntegrityPastAnyNamespace { mib: self.integrity_mib });
        }
        Ok(())
    }

    /// That some selected check runs on a device without a [`FaultInjector`] (a selection that
    /// would skip every check there, pass none and so fail the run, is bad usage). Needs no
    /// device: a caller that knows which devices lack one (a `vfio:` device has none) refuses
    /// the selection before testing any of them.
    pub fn validate_without_faults(&self) -> Result<(), UsageError> {
        let selected = self.selected_checks();
        if checks::ALL.iter().filter(|check| selected.contains(&check.name)).all(|check| check.needs_faults) {
            return Err(UsageError::NeedsFaultInjection { filter: self.filter.clone().unwrap_or_default(), checks: selected.join(", ") });
        }
        Ok(())
    }

    /// [`SuiteConfig::validate`]; without `faults`, that some selected check runs without fault
    /// injection (a selection that would skip every check, pass none and so fail the run, is
    /// bad usage); and when the data-integrity check runs, that its MiB fit the device's first
    /// namespace (one bring-up to read it; a device that does not come up is left to the
    /// checks, which report it as a failure).
    pub fn validate_for(&self, device: &Arc<dyn DeviceBackend>, faults: Option<&Arc<dyn FaultInjector>>) -> Result<(), UsageError> {
        self.validate()?;
        if faults.is_none() {
            self.validate_without_faults()?;
        }
        if !self.selected_checks().contains(&"data_integrity") {
            return Ok(());
        }
        // No check runs: no pattern, no nonce.
        let context = checks::Context { device: Arc::clone(device), faults: None, config: self.clone(), nonce: 0 };
        let Some(namespace_bytes) = checks::first_namespace_bytes(&context) else { return Ok(()) };
        if integrity_bytes(self.integrity_mib).is_none_or(|bytes| bytes > namespace_bytes) {
            return Err(UsageError::IntegrityLargerThanNamespace { mib: self.integrity_mib, namespace_mib: namespace_bytes >> 20 });
        }
        Ok(())
    }
}

/// Runs every check against the device. Never panics on device behaviour: every problem becomes
/// a failed check with a message.
pub fn run_suite(device: Arc<dyn DeviceBackend>, faults: Option<Arc<dyn FaultInjector>>, config: &SuiteConfig) -> SuiteReport {
    let mut results = Vec::new();
    let nonce = pattern_nonce();
    let selected = config.selected_checks();
    for check in checks::ALL {
        if !selected.contains(&check.name) {
            continue;
        }
        let started = Instant::now();
        let (outcome, note) =
            match (check.run)(&checks::Context { device: Arc::clone(&device), faults: faults.clone(), config: config.clone(), nonce }) {
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
    SuiteReport { device: device.name(), pattern_nonce: nonce, results }
}

/// A nonce for one run: the standard library's per-process random hash keys over the time and a
/// per-process count, so that two runs differ whether they are in one process or two.
fn pattern_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    hasher.write_u128(since_epoch.as_nanos());
    hasher.write_u64(RUNS.fetch_add(1, Ordering::Relaxed));
    hasher.write_u32(std::process::id());
    hasher.finish()
}
