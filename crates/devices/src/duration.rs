//! Durations as the tools take them on the command line (like fio's `runtime`).

use std::time::Duration;

use crate::DeviceError;

/// What [`parse_duration`] accepts, for messages.
pub const ACCEPTED: &str = "accepted: a whole number with an optional unit us/ms/s/m/h (default seconds), e.g. 10, 500ms, 50us, 2m";

/// Parses plain seconds, or a whole number with us/ms/s/m/h. Zero is a duration; callers that
/// need more say so.
pub fn parse_duration(text: &str) -> Result<Duration, DeviceError> {
    let trimmed = text.trim();
    let digits_end = trimmed.find(|c: char| !c.is_ascii_digit()).unwrap_or(trimmed.len());
    let (digits, unit) = trimmed.split_at(digits_end);
    let malformed = |detail: String| DeviceError::MalformedDuration { text: text.to_string(), detail };
    if digits.is_empty() {
        return Err(malformed(String::new()));
    }
    // The constructor for what the number is counted in, and how many of those one unit is.
    let (from_count, count_per_unit): (fn(u64) -> Duration, u64) = match unit.to_ascii_lowercase().as_str() {
        "us" => (Duration::from_micros, 1),
        "ms" => (Duration::from_millis, 1),
        "" | "s" => (Duration::from_secs, 1),
        "m" => (Duration::from_secs, 60),
        "h" => (Duration::from_secs, 3600),
        _ => return Err(malformed(format!(" (unknown unit '{unit}')"))),
    };
    // All digits: the parse fails only when the number is past u64.
    let too_large = || DeviceError::DurationTooLarge { text: text.to_string() };
    let number: u64 = digits.parse().map_err(|_| too_large())?;
    Ok(from_count(number.checked_mul(count_per_unit).ok_or_else(too_large)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_and_without_units() {
        assert_eq!(parse_duration("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("50us").unwrap(), Duration::from_micros(50));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        let error = parse_duration("ten").unwrap_err().to_string();
        assert!(error.starts_with("malformed duration 'ten'; accepted:"), "{error}");
        let error = parse_duration("5 days").unwrap_err().to_string();
        assert!(error.contains("unknown unit ' days'"), "{error}");
        assert!(parse_duration("").unwrap_err().to_string().starts_with("malformed duration ''"));
        assert!(parse_duration("ms").unwrap_err().to_string().starts_with("malformed duration 'ms'"));
    }

    #[test]
    fn durations_past_what_a_duration_holds_are_too_large() {
        // Goal: a number that overflows, by itself or times its unit, is an error saying so (not
        // "malformed", and not a duration saturated to u64::MAX seconds that a later
        // `Instant + duration` panics on); the largest that fit are accepted.
        for text in ["307445734561825861m", "5124095576030432h", "18446744073709551616", "99999999999999999999999ms"] {
            let error = parse_duration(text).unwrap_err();
            assert!(matches!(error, DeviceError::DurationTooLarge { .. }), "{text}: {error}");
            assert!(error.to_string().starts_with(&format!("duration '{text}' is too large")), "{error}");
        }
        assert_eq!(parse_duration("307445734561825860m").unwrap(), Duration::from_secs(307_445_734_561_825_860 * 60));
        assert_eq!(parse_duration("5124095576030431h").unwrap(), Duration::from_secs(5_124_095_576_030_431 * 3600));
        assert_eq!(parse_duration("18446744073709551615us").unwrap(), Duration::from_micros(u64::MAX));
    }
}
