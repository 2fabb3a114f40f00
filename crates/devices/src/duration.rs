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
    let number: u64 = digits.parse().map_err(|_| malformed(String::new()))?;
    Ok(match unit.to_ascii_lowercase().as_str() {
        "us" => Duration::from_micros(number),
        "ms" => Duration::from_millis(number),
        "" | "s" => Duration::from_secs(number),
        "m" => Duration::from_secs(number.saturating_mul(60)),
        "h" => Duration::from_secs(number.saturating_mul(3600)),
        _ => return Err(malformed(format!(" (unknown unit '{unit}')"))),
    })
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
    }
}
