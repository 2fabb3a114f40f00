//! Sizes as every tool takes them on the command line, and as they are printed back.

use crate::DeviceError;

/// What [`parse_size`] accepts, for messages.
pub const ACCEPTED: &str = "accepted: a whole number of bytes with an optional k/m/g/t suffix (powers of 1024), e.g. 4k, 128KiB, 1m, 2G";

/// Parses a size like fio: plain bytes, or a whole number with k/m/g/t (optionally followed by
/// `b` or `ib`), all powers of 1024, any case: `4k` = `4KiB` = `4kb` = 4096. Zero is a size;
/// callers that need more say so.
pub fn parse_size(text: &str) -> Result<u64, DeviceError> {
    let trimmed = text.trim();
    let digits_end = trimmed.find(|c: char| !c.is_ascii_digit()).unwrap_or(trimmed.len());
    let (digits, suffix) = trimmed.split_at(digits_end);
    let malformed = |detail: String| DeviceError::MalformedSize { text: text.to_string(), detail };
    if digits.is_empty() {
        return Err(malformed(String::new()));
    }
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(malformed(format!(" (unknown suffix '{suffix}')"))),
    };
    let too_large = || DeviceError::SizeTooLarge { text: text.to_string() };
    let number: u64 = digits.parse().map_err(|_| too_large())?;
    number.checked_mul(1u64 << shift).ok_or_else(too_large)
}

/// Human size with binary units (`4KiB`, `1.50GiB`): whole numbers without decimals.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value.fract() == 0.0 {
        format!("{value:.0}{}", UNITS[unit])
    } else {
        format!("{value:.2}{}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_fio() {
        // Goal: fio's suffixes, all binary, any case; junk is refused with what is accepted.
        for (text, bytes) in
            [("4k", 4096), ("4K", 4096), ("4KiB", 4096), ("128kb", 128 << 10), ("1m", 1 << 20), ("2G", 2 << 30), ("512", 512)]
        {
            assert_eq!(parse_size(text).unwrap(), bytes, "{text}");
        }
        assert_eq!(parse_size("1t").unwrap(), 1 << 40);
        assert_eq!(parse_size("0").unwrap(), 0);
        let message = parse_size("4q").unwrap_err().to_string();
        assert!(message.contains("'4q'") && message.contains("unknown suffix 'q'") && message.contains("accepted"), "{message}");
        assert!(parse_size("").is_err());
        assert!(parse_size("k").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999t").unwrap_err().to_string().contains("too large"));
        assert!(parse_size("99999999999999999999999").unwrap_err().to_string().contains("too large"));
    }

    #[test]
    fn sizes_format() {
        assert_eq!(format_size(4096), "4KiB");
        assert_eq!(format_size(1536 << 20), "1.50GiB");
        assert_eq!(format_size(1 << 40), "1TiB");
        assert_eq!(format_size(3), "3B");
    }
}
