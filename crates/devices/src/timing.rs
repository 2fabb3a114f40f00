//! The software controller's timing model as the tools take it (`--emu-timing`): a preset SSD
//! from the scheduler's model, slowed down by a factor this machine can keep up with, or
//! explicit figures.
//!
//! - `tutti-ssd` (or `tutti-ssd:xN`): one SSD of Tutti's evaluation set-up as the scheduler's
//!   [`SsdModel::tutti_two_ssds`] describes it (14.5 GB/s read, 6 GB/s write, 40% of each under
//!   mixed traffic, 50 µs per command) in slow motion: bandwidth divided by N and latency
//!   multiplied by N (default N = 32), so that every ratio of the real device (latency against
//!   transfer time, read against write, mixed against solo) is kept and the emulator can still
//!   move the bytes. Compute times compared with it must be dilated by the same N.
//! - `read=SIZE,write=SIZE,mixed=FRACTION,latency=DURATION`: bandwidths per second (sizes as
//!   [`crate::parse_size`] takes them: `900m` is 900 MiB/s), the share kept under mixed traffic
//!   (0 < f ≤ 1), the per-command latency ([`crate::parse_duration`]); all four are required,
//!   each once.

use std::time::Duration;

use nvme_emu::TimingModel;
use scheduler::ssd::SsdModel;

use crate::duration::parse_duration;
use crate::size::parse_size;
use crate::DeviceError;

/// What `--emu-timing` accepts, for messages.
pub const ACCEPTED: &str =
    "accepted: tutti-ssd, tutti-ssd:xN (N = 1..=1024, default 32), or read=SIZE,write=SIZE,mixed=FRACTION,latency=DURATION \
     (e.g. read=900m,write=375m,mixed=0.4,latency=800us)";

/// Slow-motion factor of `tutti-ssd` without `:xN`: Tutti's SSD read at 14.5 GB/s becomes
/// ~0.45 GB/s, half of what the software controller moves over a file on a 2-core machine
/// (~0.9 GB/s at 16x left no headroom: the machine, not the model, set the pace).
pub const DEFAULT_DILATION: u32 = 32;

/// One device of `model` slowed down `dilation` times (bandwidth / N, latency × N).
pub fn dilated(model: &SsdModel, dilation: u32) -> Result<TimingModel, DeviceError> {
    let invalid = |reason: String| DeviceError::MalformedTiming { text: format!("x{dilation}"), reason };
    if !(1..=1024).contains(&dilation) {
        return Err(invalid("the slow-motion factor must be in 1..=1024".into()));
    }
    model.validate().map_err(|error| invalid(error.to_string()))?;
    let factor = f64::from(dilation);
    let per_second = |bytes_per_s: f64| (bytes_per_s / factor).round() as u64;
    // The model's validation bounds the latency below, not above: a latency too long for a
    // Duration (1e30 µs) is refused here rather than panicking in from_secs_f64.
    let latency_s = model.command_latency_us * factor / 1e6;
    let command_latency = Duration::try_from_secs_f64(latency_s)
        .map_err(|error| invalid(format!("a command latency of {} µs is not a duration ({error})", model.command_latency_us)))?;
    let timing = TimingModel {
        read_bytes_per_s: per_second(model.read_bytes_per_s_per_device),
        write_bytes_per_s: per_second(model.write_bytes_per_s_per_device),
        mixed_share_permille: (model.mixed_bandwidth_fraction * 1000.0).round() as u16,
        command_latency,
    };
    timing.validate().map_err(|error| invalid(error.to_string()))?;
    Ok(timing)
}

/// Parses an `--emu-timing` value (see the module documentation).
pub fn parse_timing(text: &str) -> Result<TimingModel, DeviceError> {
    let trimmed = text.trim();
    let malformed = |reason: String| DeviceError::MalformedTiming { text: text.to_string(), reason };
    if let Some(rest) = trimmed.strip_prefix("tutti-ssd") {
        let dilation = match rest {
            "" => DEFAULT_DILATION,
            _ => rest
                .strip_prefix(":x")
                .and_then(|factor| factor.parse::<u32>().ok())
                .ok_or_else(|| malformed(format!("'{rest}' is not ':xN' with N a whole number")))?,
        };
        return dilated(&SsdModel::tutti_two_ssds(), dilation).map_err(|error| malformed(error.to_string()));
    }
    let (mut read, mut write, mut mixed, mut latency) = (None, None, None, None);
    for field in trimmed.split(',') {
        let Some((key, value)) = field.split_once('=') else {
            return Err(malformed(format!("'{field}' is not KEY=VALUE")));
        };
        let field_error = |error: DeviceError| malformed(format!("{key}: {error}"));
        // A key given twice (read=1m,read=2g) is refused rather than the last one winning: one
        // of the two is a mistake, and which one is not ours to guess.
        let repeated = match key.trim() {
            "read" => read.is_some(),
            "write" => write.is_some(),
            "mixed" => mixed.is_some(),
            "latency" => latency.is_some(),
            _ => false,
        };
        if repeated {
            return Err(malformed(format!("'{}' is given more than once", key.trim())));
        }
        match key.trim() {
            "read" => read = Some(parse_size(value).map_err(field_error)?),
            "write" => write = Some(parse_size(value).map_err(field_error)?),
            "mixed" => {
                let share = value.trim().parse::<f64>().ok().filter(|share| *share > 0.0 && *share <= 1.0);
                let share = share.ok_or_else(|| malformed(format!("mixed: '{value}' is not a fraction in (0, 1]")))?;
                mixed = Some(((share * 1000.0).round() as u16).max(1));
            }
            "latency" => latency = Some(parse_duration(value).map_err(field_error)?),
            other => return Err(malformed(format!("unknown key '{other}'"))),
        }
    }
    let (Some(read_bytes_per_s), Some(write_bytes_per_s), Some(mixed_share_permille), Some(command_latency)) =
        (read, write, mixed, latency)
    else {
        return Err(malformed("read, write, mixed and latency are all required".into()));
    };
    let timing = TimingModel { read_bytes_per_s, write_bytes_per_s, mixed_share_permille, command_latency };
    timing.validate().map_err(|error| malformed(error.to_string()))?;
    Ok(timing)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preset_is_tuttis_ssd_in_slow_motion() {
        let timing = parse_timing("tutti-ssd").unwrap();
        assert_eq!(timing.read_bytes_per_s, 453_125_000);
        assert_eq!(timing.write_bytes_per_s, 187_500_000);
        assert_eq!(timing.mixed_share_permille, 400);
        assert_eq!(timing.command_latency, Duration::from_micros(1600));
        let real = parse_timing("tutti-ssd:x1").unwrap();
        assert_eq!((real.read_bytes_per_s, real.command_latency), (14_500_000_000, Duration::from_micros(50)));
        assert_eq!(parse_timing("tutti-ssd:x32").unwrap(), timing);
    }

    #[test]
    fn a_latency_too_long_for_a_duration_is_an_error_not_a_panic() {
        // Goal: SsdModel::validate accepts any positive latency; one past what a Duration holds
        // (1e30 µs) is a MalformedTiming naming the latency, not a panic in from_secs_f64.
        let model = SsdModel { command_latency_us: 1e30, ..SsdModel::tutti_two_ssds() };
        assert!(model.validate().is_ok(), "the model's own check lets it through");
        let error = dilated(&model, 1).unwrap_err();
        assert!(matches!(error, DeviceError::MalformedTiming { .. }), "{error:?}");
        assert!(error.to_string().contains("command latency"), "{error}");
        let slowed = SsdModel { command_latency_us: f64::MAX / 2.0, ..SsdModel::tutti_two_ssds() };
        assert!(dilated(&slowed, 1024).is_err(), "latency × N overflowing is refused too");
    }

    #[test]
    fn explicit_figures_parse_and_every_mistake_is_named() {
        let timing = parse_timing("read=900m,write=375m,mixed=0.4,latency=800us").unwrap();
        assert_eq!(timing.read_bytes_per_s, 900 << 20);
        assert_eq!(timing.mixed_share_permille, 400);
        for (text, expected) in [
            ("tutti-ssd:x0", "1..=1024"),
            ("tutti-ssd:16", "is not ':xN'"),
            ("read=900m,write=375m,mixed=0.4", "all required"),
            ("read=900m,write=375m,mixed=1.5,latency=1ms", "not a fraction in (0, 1]"),
            ("read=0,write=375m,mixed=0.5,latency=1ms", "bandwidth must be above 0"),
            ("read=fast,write=375m,mixed=0.5,latency=1ms", "read: malformed size 'fast'"),
            ("speed=1", "unknown key 'speed'"),
            ("ssd", "'ssd' is not KEY=VALUE"),
            ("read=1m,read=2g,write=375m,mixed=0.4,latency=1ms", "'read' is given more than once"),
            ("read=1m,write=375m,mixed=0.4,latency=1ms,latency=2ms", "'latency' is given more than once"),
            ("read=1m,write=375m,mixed=0.4, mixed=0.5,latency=1ms", "'mixed' is given more than once"),
        ] {
            let error = parse_timing(text).unwrap_err().to_string();
            assert!(error.contains(expected) && error.contains(ACCEPTED), "{text}: {error}");
        }
    }
}
