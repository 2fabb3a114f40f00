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

/// Human size with binary units (`4KiB`, `1.50GiB`): whole numbers without decimals, others
/// rounded to two decimals (so not always exact: [`format_size_exact`] is what parses back).
/// A value that rounds up to 1024 of a unit is written in the next unit (`1.00TiB`, never
/// `1024.00GiB`).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    // Compare what will be printed (rounded to two decimals), not the raw value: 1 TiB - 1 is
    // 1023.999... GiB, which would print as 1024.00GiB.
    while (value * 100.0).round() / 100.0 >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value.fract() == 0.0 {
        format!("{value:.0}{}", UNITS[unit])
    } else {
        format!("{value:.2}{}", UNITS[unit])
    }
}

/// `bytes` written exactly, in a form [`parse_size`] reads back to the same number: in the
/// largest unit (up to TiB) that divides it (`1536MiB`, `1TiB`), else as plain bytes
/// (`1048577`). For strings that are parsed again, such as a device spec's `Display`.
pub fn format_size_exact(bytes: u64) -> String {
    const UNITS: [(u32, &str); 4] = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
    for (shift, unit) in UNITS {
        if bytes != 0 && bytes.trailing_zeros() >= shift {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
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

    #[test]
    fn human_sizes_move_to_the_next_unit_when_rounding_reaches_1024() {
        // Goal: a value just under a unit boundary never prints as 1024.00 of the unit below.
        assert_eq!(format_size((1 << 40) - 1), "1.00TiB");
        assert_eq!(format_size((1 << 20) - 1), "1.00MiB");
        assert_eq!(format_size(1023), "1023B");
        assert_eq!(format_size((1 << 20) + 1), "1.00MiB");
        for shift in [10u32, 20, 30, 40, 50] {
            for bytes in [(1u64 << shift) - 1, (1 << shift) - (1 << (shift - 10)), 1 << shift] {
                assert!(!format_size(bytes).starts_with("1024"), "{bytes}: {}", format_size(bytes));
            }
        }
    }

    #[test]
    fn exact_sizes_parse_back_to_the_same_number() {
        // Goal: format_size_exact is lossless: every tricky size (unit boundaries, one either
        // side, odd multiples, the largest) parses back to itself, in the largest exact unit.
        assert_eq!(format_size_exact(1536 << 20), "1536MiB");
        assert_eq!(format_size_exact((1 << 20) + 1), "1048577");
        assert_eq!(format_size_exact(1 << 40), "1TiB");
        assert_eq!(format_size_exact(3 << 50), "3072TiB");
        assert_eq!(format_size_exact(0), "0");
        let mut sizes = vec![0, 1, u64::MAX, u64::MAX - 1, u64::MAX >> 1, 1536 << 20];
        for shift in 0..64 {
            let boundary = 1u64 << shift;
            sizes.extend([boundary - 1, boundary, boundary + 1, boundary.wrapping_mul(3), boundary.wrapping_mul(1023)]);
        }
        for bytes in sizes {
            let text = format_size_exact(bytes);
            assert_eq!(parse_size(&text).unwrap(), bytes, "{bytes} printed as {text}");
        }
    }
}
