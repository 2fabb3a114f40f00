//! The crate's single error type.
//!
//! Profile tables come from disk and timelines from other programs: both are untrusted input, so
//! every rejection names the field and the bucket (or line) that was wrong instead of panicking.

use thiserror::Error;

/// Everything that can go wrong while loading a profile table, building one, scheduling or
/// simulating.
#[derive(Debug, Error)]
pub enum SchedulerError {
    /// The table was written by a newer format than this build understands.
    #[error("profile table format_version {found} is not supported (this build reads versions 1..={supported})")]
    UnsupportedVersion { found: u64, supported: u32 },

    /// A field holds a value that cannot be right (negative, NaN, zero where a step is needed…).
    #[error("profile table: field `{field}` at {location}: {reason}")]
    InvalidField { field: String, location: String, reason: String },

    /// A bucket of the (input length, prefix length) grid is absent.
    #[error("profile table: missing bucket input_tokens={input_tokens} prefix_tokens={prefix_tokens}")]
    MissingBucket { input_tokens: u32, prefix_tokens: u32 },

    /// Entries that must be strictly increasing are not (duplicate or out of order).
    #[error("profile table: `{field}` is not strictly increasing at {location}")]
    NonMonotonic { field: String, location: String },

    /// The table describes another model or GPU than the one in use.
    #[error("profile table was built for {field} `{table}`, but `{in_use}` is in use")]
    IdentityMismatch { field: &'static str, table: String, in_use: String },

    /// A lookup outside the range the table covers, where no conservative fallback exists.
    #[error("lookup out of range: {what} = {value} is outside the profiled range [{min}, {max}]")]
    OutOfRange { what: &'static str, value: u64, min: u64, max: u64 },

    /// The table is not valid JSON or does not have the documented shape. The parser's message
    /// (line, column, field) is part of this error's text rather than a separate source, so a
    /// printed chain does not repeat it.
    #[error("profile table JSON: {0}")]
    Parse(serde_json::Error),

    /// A model, GPU, SSD or simulation parameter is unusable.
    #[error("invalid configuration: `{field}`: {reason}")]
    InvalidConfig { field: String, reason: String },

    /// A measured kernel timeline has a malformed line.
    #[error("timeline line {line}: {reason}")]
    Timeline { line: usize, reason: String },

    /// The table built from a timeline fails validation (a bucket missing, no decode step where
    /// a write fits): unusable input, and the grid it is checked against was inferred from the
    /// timeline, not declared by it.
    #[error(
        "the table built from the timeline is invalid (its grid is inferred: input step {input_step_tokens} tokens, the smallest \
         input; prefix step {prefix_step_tokens} tokens, the greatest common divisor of the prefixes): {source}"
    )]
    ImportedTable {
        input_step_tokens: u32,
        prefix_step_tokens: u32,
        #[source]
        source: Box<SchedulerError>,
    },

    /// An imported table was refused (`source`, an [`SchedulerError::ImportedTable`]) and its
    /// cost rows of a kind all ask for more SMs than the `io_sms` reserved for I/O: where
    /// compute fills its SMs no such kernel fits, so the reservation is named first; alone, the
    /// refusal behind it (the decode steps' free SMs) blamed the timeline. The refusal is kept
    /// as the source, typed, not flattened into this text.
    #[error("invalid configuration: `io_sms`: {mismatch}: {source}")]
    IoReservation {
        io_sms: u32,
        /// Each such kind's smallest budget against `io_sms`, and what to do.
        mismatch: String,
        #[source]
        source: Box<SchedulerError>,
    },

    /// A policy asked for something impossible (more IOCBs than are pending, an unknown layer).
    #[error("policy `{policy}` produced an invalid decision at {location}: {reason}")]
    InvalidDecision { policy: &'static str, location: String, reason: String },

    /// The I/O probe (live backend) failed.
    #[error("I/O probe `{probe}` failed at {point}: {reason}")]
    Probe { probe: String, point: String, reason: String },
}

impl From<serde_json::Error> for SchedulerError {
    fn from(error: serde_json::Error) -> Self {
        Self::Parse(error)
    }
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, SchedulerError>;

/// Helper: reject a float that is NaN, infinite, negative or past
/// [`crate::table::DURATION_US_MAX`].
pub(crate) fn check_duration(value_us: f64, field: &str, location: &dyn Fn() -> String) -> Result<()> {
    if !value_us.is_finite() {
        return Err(SchedulerError::InvalidField {
            field: field.to_string(),
            location: location(),
            reason: format!("{value_us} is not a finite number"),
        });
    }
    if value_us < 0.0 {
        return Err(SchedulerError::InvalidField {
            field: field.to_string(),
            location: location(),
            reason: format!("{value_us} is negative"),
        });
    }
    if value_us > crate::table::DURATION_US_MAX {
        return Err(SchedulerError::InvalidField {
            field: field.to_string(),
            location: location(),
            reason: format!("{value_us} µs is past {} µs, the longest duration a table holds", crate::table::DURATION_US_MAX),
        });
    }
    Ok(())
}

/// Helper: reject a configuration float that is not finite and strictly positive.
pub(crate) fn check_positive(value: f64, field: &str) -> Result<()> {
    if !value.is_finite() || value <= 0.0 {
        return Err(SchedulerError::InvalidConfig { field: field.to_string(), reason: format!("{value} must be a finite number > 0") });
    }
    Ok(())
}
