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
    measure_io_costs_reporting(probe, grid, &mut |done, total, _| progress(done, total))
}

/// One grid point as measured, before and after the monotonicity rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MeasuredPoint {
    /// The row as it goes into the table.
    pub entry: IoCostEntry,
    /// The median of the samples; below `entry.duration_us` when the point measured faster than
    /// a smaller IOCB count and took that slower neighbour's value.
    pub median_us: f64,
}

impl MeasuredPoint {
    /// Whether the row carries a smaller count's (slower) duration rather than its own median.
    pub fn raised(&self) -> bool {
        self.entry.duration_us > self.median_us
    }
}

/// [`measure_io_costs`], with each point handed to `progress` as it is measured (a tool prints
/// what it measured, not only how far it got).
pub fn measure_io_costs_reporting(
    probe: &mut dyn IoCostProbe,
    grid: &IoGrid,
    progress: &mut dyn FnMut(usize, usize, &MeasuredPoint),
) -> Result<Vec<IoCostEntry>> {
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
                let median_us = durations[durations.len() / 2];
                // Noise can make a larger count measure faster; the table requires monotone
                // durations, and the slower neighbour is the conservative value.
                let duration_us = median_us.max(previous_us);
                previous_us = duration_us;
                let entry = IoCostEntry { kind, iocb_count, sm_budget, duration_us, bytes };
                rows.push(entry);
                done += 1;
                progress(done, total, &MeasuredPoint { entry, median_us });
            }
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Durations that fall with the IOCB count (as noise can make them): 300, 200, 100 µs.
    struct Falling;

    impl IoCostProbe for Falling {
        fn describe(&self) -> String {
            "falling".into()
        }
        fn measure(&mut self, _kind: IoKind, iocb_count: u32, _sm_budget: u32) -> Result<ProbeSample> {
            Ok(ProbeSample { duration_us: 400.0 - 100.0 * f64::from(iocb_count), bytes: u64::from(iocb_count) })
        }
    }

    #[test]
    fn reporting_hands_out_each_median_and_marks_raised_rows() {
        // Goal: a tool can print what each point measured, and tell a row carrying a smaller
        // count's slower value from one carrying its own median.
        let grid = IoGrid { iocb_counts: vec![3, 1, 2], sm_budgets: vec![4], repetitions: 1 };
        let mut seen = Vec::new();
        let rows = measure_io_costs_reporting(&mut Falling, &grid, &mut |done, total, point| seen.push((done, total, *point))).unwrap();
        assert_eq!(seen.len(), 6);
        assert_eq!((seen[5].0, seen[5].1), (6, 6));
        let medians: Vec<f64> = seen[..3].iter().map(|(_, _, p)| p.median_us).collect();
        assert_eq!(medians, [300.0, 200.0, 100.0]);
        assert_eq!(seen[..3].iter().map(|(_, _, p)| p.raised()).collect::<Vec<_>>(), [false, true, true]);
        assert!(rows.iter().all(|r| r.duration_us == 300.0), "{rows:?}");
        assert_eq!(rows, seen.iter().map(|(_, _, p)| p.entry).collect::<Vec<_>>());
    }
}
