//! Slack windows for a request between grid points: conservative in time *and* in free SMs.
//!
//! [`Profile::bucket`] rounds to the grid point whose layer is cheapest (input down, prefix up):
//! its windows close no later than the real layer's, but a cheaper layer can be more
//! memory-bound and show more SMs free at some offset than the real one. Between grid points the
//! real layer is bracketed by the cell's corners — input rounded down and up, prefix rounded up
//! and down — so the windows the policy plans with are the corners' intersection: at each offset
//! into the layer, the fewest SMs any corner has free there (none where some corner has no
//! window). That is a subset, in time, of the cheapest corner's windows (still conservative in
//! time) and never more SMs than a corner shows. On a grid point the bucket's own windows are
//! returned unchanged. Beyond the longest input there is no upper corner: the longest input's
//! row alone, as before.

use crate::error::{Result, SchedulerError};
use crate::table::{prefix_up_to_grid, Bucket, Profile, SlackWindow};

impl Profile {
    /// The slack windows of layer `layer` for `input_tokens` with `prefix_tokens` cached,
    /// intersected over the grid cell's corners (module documentation), into `out` (cleared
    /// first). Errors as [`Profile::bucket`], and `OutOfRange` for a layer past the model's.
    pub fn slack_windows_between(&self, input_tokens: u32, prefix_tokens: u32, layer: u32, out: &mut Vec<SlackWindow>) -> Result<()> {
        let cheapest = self.bucket(input_tokens, prefix_tokens)?;
        out.clear();
        out.extend_from_slice(layer_windows(cheapest, layer)?);
        let table = self.table();
        let (input_step, prefix_step) = (table.input_step_tokens, table.prefix_step_tokens);
        let input_max = self.input_tokens_max();
        let input_low = input_tokens.min(input_max) / input_step * input_step;
        let input_high = (input_tokens < input_max && !input_tokens.is_multiple_of(input_step)).then(|| input_low + input_step);
        let mut scratch = Vec::new();
        for row in std::iter::once(input_low).chain(input_high) {
            // The prefix rounded down and up, each within what this row lists.
            let prefix_high = prefix_up_to_grid(prefix_tokens, row, prefix_step);
            let prefix_low = (prefix_tokens / prefix_step * prefix_step).min(prefix_high);
            for prefix in [prefix_low, prefix_high] {
                let corner = self.bucket_at_grid_point(row, prefix)?;
                if std::ptr::eq(corner, cheapest) {
                    continue;
                }
                intersect(out, layer_windows(corner, layer)?, &mut scratch);
                std::mem::swap(out, &mut scratch);
            }
        }
        Ok(())
    }
}

fn layer_windows(bucket: &Bucket, layer: u32) -> Result<&[SlackWindow]> {
    bucket.layers.get(layer as usize).map(|profile| profile.slack_windows.as_slice()).ok_or(SchedulerError::OutOfRange {
        what: "layer",
        value: u64::from(layer),
        min: 0,
        max: bucket.layers.len().saturating_sub(1) as u64,
    })
}

/// `out` = where both sorted, non-overlapping window lists have a window, with the fewer free
/// SMs of the two (a window of 0 free SMs is dropped: nothing can run in it).
pub(crate) fn intersect(a: &[SlackWindow], b: &[SlackWindow], out: &mut Vec<SlackWindow>) {
    out.clear();
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let start_us = a[i].offset_us.max(b[j].offset_us);
        let end_us = a[i].end_us().min(b[j].end_us());
        let free_sms = a[i].free_sms.min(b[j].free_sms);
        if end_us > start_us && free_sms > 0 {
            out.push(SlackWindow { offset_us: start_us, duration_us: end_us - start_us, free_sms });
        }
        if a[i].end_us() <= b[j].end_us() {
            i += 1;
        } else {
            j += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(offset_us: f64, duration_us: f64, free_sms: u32) -> SlackWindow {
        SlackWindow { offset_us, duration_us, free_sms }
    }

    #[test]
    fn intersection_keeps_the_overlaps_with_the_fewer_free_sms() {
        let a = [window(0.0, 10.0, 100), window(20.0, 10.0, 50), window(40.0, 5.0, 8)];
        let b = [window(5.0, 20.0, 30), window(28.0, 20.0, 60)];
        let mut out = Vec::new();
        intersect(&a, &b, &mut out);
        assert_eq!(out, vec![window(5.0, 5.0, 30), window(20.0, 5.0, 30), window(28.0, 2.0, 50), window(40.0, 5.0, 8)]);
        intersect(&a, &[], &mut out);
        assert!(out.is_empty());
        intersect(&[window(0.0, 10.0, 0)], &[window(0.0, 10.0, 10)], &mut out);
        assert!(out.is_empty(), "a window with no SM free is no window");
    }
}
