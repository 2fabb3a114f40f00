//! The seam through which `tutti-profile io` measures the I/O cost table on a live backend
//! (Tutti §3.3: "we profile … the execution time and SM occupancy of read/write kernels under
//! different IOCB counts").
//!
//! A backend (the CPU executor over the software controller, a VFIO device, the GPU executor)
//! implements [`IoCostProbe`]; [`measure_io_costs`] walks the grid and turns the samples into
//! validated [`IoCostEntry`] rows. This crate holds no backend: it is pure logic, and a table is
//! only ever labelled "measured" when the numbers came from a real probe.

use crate::error::{Result, SchedulerError};
use crate::table::{IoCostEntry, IoKind};

/// One timed I/O kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProbeSample {
    /// From launch to the last completion.
    pub duration_us: f64,
    /// Bytes the kernel moved.
    pub bytes: u64,
}

/// A live I/O backend that can time one kernel of `iocb_count` IOCBs on `sm_budget` SMs.
pub trait IoCostProbe {
    /// Names the backend and device, for the table's `io_cost_source`.
    fn describe(&self) -> String;
    /// Runs and times one kernel.
    fn measure(&mut self, kind: IoKind, iocb_count: u32, sm_budget: u32) -> Result<ProbeSample>;
}

/// The grid `io` walks.
#[derive(Clone, Debug, PartialEq)]
pub struct IoGrid {
    pub iocb_counts: Vec<u32>,
    pub sm_budgets: Vec<u32>,
    /// Samples per point; the median is kept (robust to one slow outlier).
    pub repetitions: u32,
}

/// Measures every (kind, SM budget, IOCB count) point, reporting progress as (done, total).
/// Rows come out sorted as the table format requires; each duration is the median of
/// `repetitions` samples. Samples that are not finite and positive are rejected.
pub fn measure_io_costs(probe: &mut dyn IoCostProbe, grid: &IoGrid, progress: &mut dyn FnMut(usize, usize)) -> Result<Vec<IoCostEntry>> {
    let mut counts = grid.iocb_counts.clone();
    counts.sort_unstable();
    counts.dedup();
    let mut budgets = grid.sm_budgets.clone();
    budgets.sort_unstable();
    budgets.dedup();
    if counts.is_empty() || budgets.is_empty() || grid.repetitions == 0 || counts[0] == 0 || budgets[0] == 0 {
        return Err(SchedulerError::InvalidConfig {
            field: "io grid".into(),
            reason: "needs non-zero IOCB counts, SM budgets and repetitions".into(),
        });
    }
    let total = 2 * counts.len() * budgets.len();
    let mut done = 0;
    let mut rows = Vec::with_capacity(total);
    for kind in [IoKind::Read, IoKind::Write] {
        for &sm_budget in &budgets {
            let mut previous_us = 0.0_f64;
            for &iocb_count in &counts {
                let point = || format!("kind={kind:?} iocb_count={iocb_count} sm_budget={sm_budget}");
                let mut durations = Vec::new();
                let mut bytes = 0;
                for _ in 0..grid.repetitions {
                    let sample = probe.measure(kind, iocb_count, sm_budget)?;
                    if !(sample.duration_us.is_finite() && sample.duration_us > 0.0) || sample.bytes == 0 {
                        return Err(SchedulerError::Probe {
                            probe: probe.describe(),
                            point: point(),
                            reason: format!("implausible sample {sample:?}"),
                        });
                    }
                    durations.push(sample.duration_us);
                    bytes = sample.bytes;
                }
                durations.sort_by(f64::total_cmp);
                // Noise can make a larger count measure faster; the table requires monotone
                // durations, and the slower neighbour is the conservative value.
                let duration_us = durations[durations.len() / 2].max(previous_us);
                previous_us = duration_us;
                rows.push(IoCostEntry { kind, iocb_count, sm_budget, duration_us, bytes });
                done += 1;
                progress(done, total);
            }
        }
    }
    Ok(rows)
}
