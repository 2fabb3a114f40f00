//! The SSD model used by the simulator, and the I/O cost table derived from it.
//!
//! The model is deliberately small (Tutti §3.3, Fig. 6):
//! - aggregate read and write bandwidth = per-device bandwidth × device count (RAID-0 striping);
//! - while reads and writes transfer at the same time, *both* run at `mixed_bandwidth_fraction` of
//!   their solo bandwidth (Tutti measured a ~60% drop: fraction 0.4);
//! - one I/O kernel pays `command_latency_us` before its first byte when its direction was idle;
//!   back-to-back kernels in the same direction hide it behind the queue depth;
//! - an I/O kernel on `sm_budget` SMs cannot move more than `sm_budget × io_bytes_per_s_per_sm`
//!   (command construction and doorbells run on those SMs, Tutti §3.2).
//!
//! Numbers produced from this model are *modelled*, not measured; tables built from it say so in
//! their `io_cost_source`.

use serde::{Deserialize, Serialize};

use crate::error::{check_positive, Result, SchedulerError};
use crate::table::{IoCostEntry, IoKind};

/// Bandwidth and latency of the SSD set behind one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SsdModel {
    pub device_count: u32,
    pub read_bytes_per_s_per_device: f64,
    pub write_bytes_per_s_per_device: f64,
    /// Share of solo bandwidth each direction keeps while the other one also transfers.
    pub mixed_bandwidth_fraction: f64,
    /// Time from submitting a kernel's first command to its first data, when the queue was idle.
    pub command_latency_us: f64,
    /// What one SM running the I/O kernel can push (command build + doorbell + completion poll).
    pub io_bytes_per_s_per_sm: f64,
}

impl SsdModel {
    /// Tutti's evaluation set-up: two SSDs, 29 GB/s read and 12 GB/s write aggregate, ~60%
    /// collapse under mixed traffic. The latency (50 µs) and the per-SM rate (10 GB/s, about what
    /// Tutti's single-thread SGL microbenchmark reached, Fig. 10) are assumptions of this model.
    pub fn tutti_two_ssds() -> Self {
        Self {
            device_count: 2,
            read_bytes_per_s_per_device: 14.5e9,
            write_bytes_per_s_per_device: 6.0e9,
            mixed_bandwidth_fraction: 0.4,
            command_latency_us: 50.0,
            io_bytes_per_s_per_sm: 10.0e9,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.device_count == 0 {
            return Err(SchedulerError::InvalidConfig { field: "ssd.device_count".into(), reason: "must be > 0".into() });
        }
        check_positive(self.read_bytes_per_s_per_device, "ssd.read_bytes_per_s_per_device")?;
        check_positive(self.write_bytes_per_s_per_device, "ssd.write_bytes_per_s_per_device")?;
        check_positive(self.io_bytes_per_s_per_sm, "ssd.io_bytes_per_s_per_sm")?;
        let f = self.mixed_bandwidth_fraction;
        if !(f.is_finite() && f > 0.0 && f <= 1.0) {
            return Err(SchedulerError::InvalidConfig {
                field: "ssd.mixed_bandwidth_fraction".into(),
                reason: format!("{f} must be in (0, 1]"),
            });
        }
        if !(self.command_latency_us.is_finite() && self.command_latency_us >= 0.0) {
            return Err(SchedulerError::InvalidConfig {
                field: "ssd.command_latency_us".into(),
                reason: format!("{} must be finite and >= 0", self.command_latency_us),
            });
        }
        Ok(())
    }

    /// Aggregate solo bandwidth of a direction.
    pub fn bandwidth_bytes_per_s(&self, kind: IoKind) -> f64 {
        let per_device = match kind {
            IoKind::Read => self.read_bytes_per_s_per_device,
            IoKind::Write => self.write_bytes_per_s_per_device,
        };
        per_device * f64::from(self.device_count)
    }

    /// Solo rate of one kernel on `sm_budget` SMs.
    pub fn kernel_bytes_per_s(&self, kind: IoKind, sm_budget: u32) -> f64 {
        self.bandwidth_bytes_per_s(kind).min(f64::from(sm_budget) * self.io_bytes_per_s_per_sm)
    }

    /// Solo duration of one kernel moving `bytes` from an idle queue.
    pub fn kernel_duration_us(&self, kind: IoKind, bytes: u64, sm_budget: u32) -> f64 {
        self.command_latency_us + bytes as f64 / self.kernel_bytes_per_s(kind, sm_budget) * 1e6
    }

    /// An I/O cost table for [`crate::table::ProfileTable::io_costs`], computed from this model
    /// (the stand-in for `tutti-profile io` where no backend is available). Counts are powers of
    /// two up to `iocb_count_max`, for each budget in `sm_budgets` (sorted, deduplicated).
    pub fn cost_table(&self, iocb_bytes: u64, iocb_count_max: u32, sm_budgets: &[u32]) -> Result<Vec<IoCostEntry>> {
        self.validate()?;
        if iocb_bytes == 0 || iocb_count_max == 0 || sm_budgets.is_empty() {
            return Err(SchedulerError::InvalidConfig {
                field: "io cost grid".into(),
                reason: "iocb_bytes, iocb_count_max and sm_budgets must be non-zero/non-empty".into(),
            });
        }
        // A budget of 0 SMs moves nothing: its rows cost infinity, which validation then
        // reported as a non-finite duration rather than as the budget it was.
        if sm_budgets.contains(&0) {
            return Err(SchedulerError::InvalidConfig {
                field: "sm_budgets".into(),
                reason: "an SM budget of 0 moves no I/O; budgets must be at least 1 (tutti-profile: --io-sms)".into(),
            });
        }
        // The largest kernel of the grid moves iocb_count_max IOCBs; every smaller one fits if it does.
        if iocb_bytes.checked_mul(u64::from(iocb_count_max)).is_none() {
            return Err(SchedulerError::InvalidConfig {
                field: "io cost grid".into(),
                reason: format!(
                    "{iocb_count_max} IOCBs of {iocb_bytes} bytes are past 2^64 bytes; accepted: iocb_bytes × iocb_count_max below 2^64"
                ),
            });
        }
        let mut budgets = sm_budgets.to_vec();
        budgets.sort_unstable();
        budgets.dedup();
        let mut rows = Vec::new();
        for kind in [IoKind::Read, IoKind::Write] {
            for &sm_budget in &budgets {
                let mut count = 1u32;
                loop {
                    // count <= iocb_count_max, checked above.
                    let bytes = iocb_bytes.saturating_mul(u64::from(count));
                    rows.push(IoCostEntry {
                        kind,
                        iocb_count: count,
                        sm_budget,
                        duration_us: self.kernel_duration_us(kind, bytes, sm_budget),
                        bytes,
                    });
                    if count >= iocb_count_max {
                        break;
                    }
                    count = count.saturating_mul(2).min(iocb_count_max);
                }
            }
        }
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grid_whose_bytes_overflow_is_an_invalid_config() {
        // Goal: iocb_bytes × count past 2^64 (a huge --iocb-bytes from tutti-profile) is refused
        // naming the grid, not a multiplication overflow (a panic in debug, a wrong size in
        // release).
        let model = SsdModel::tutti_two_ssds();
        for (iocb_bytes, count_max) in [(u64::MAX, 2), (1 << 40, 1 << 24)] {
            match model.cost_table(iocb_bytes, count_max, &[1]) {
                Err(SchedulerError::InvalidConfig { field, reason }) => {
                    assert_eq!(field, "io cost grid");
                    assert!(reason.contains("2^64"), "{reason}");
                }
                other => panic!("{iocb_bytes} x {count_max}: {other:?}"),
            }
        }
        let rows = model.cost_table(4096, 4, &[1, 8]).unwrap();
        assert_eq!(rows.len(), 2 * 2 * 3);
        assert_eq!(rows.iter().map(|row| row.bytes).max(), Some(4 * 4096));
    }
}
