//! `--timeout-s SECONDS`, the deadline option of the tools that wait on a device (tutti-profile
//! io, nvme-conformance): one parser, so that every tool bounds it the same way.
//!
//! A deadline is `Instant::now() + timeout`, which panics when the sum overflows the clock: a
//! bound at parse time keeps every such sum far from it (a day is longer than any one wait of
//! these tools should take, and far below the clock's range).

use std::time::Duration;

/// The longest `--timeout-s` accepted: one day.
pub const TIMEOUT_S_MAX: u64 = 24 * 3600;

/// Parses whole seconds, 1 to [`TIMEOUT_S_MAX`]; anything else is an error saying what is
/// accepted (a clap `value_parser`: exit status 2).
pub fn parse_timeout_s(text: &str) -> Result<Duration, String> {
    let accepted = format!("accepted: whole seconds from 1 to {TIMEOUT_S_MAX} (a day)");
    let seconds: u64 = text.trim().parse().map_err(|_| format!("'{text}' is not a number of seconds; {accepted}"))?;
    if seconds == 0 || seconds > TIMEOUT_S_MAX {
        return Err(format!("{seconds} s is out of range; {accepted}"));
    }
    Ok(Duration::from_secs(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_whole_seconds_up_to_a_day() {
        // Goal: a timeout that would overflow a deadline (Instant + Duration) is refused in
        // words, as are zero and text that is not a number.
        assert_eq!(parse_timeout_s("60"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_timeout_s("86400"), Ok(Duration::from_secs(86_400)));
        for bad in ["0", "86401", "18446744073709551615", "99999999999999999999", "ten", "-1", ""] {
            let error = parse_timeout_s(bad).unwrap_err();
            assert!(error.contains("accepted: whole seconds from 1 to 86400"), "{bad}: {error}");
        }
    }
}
