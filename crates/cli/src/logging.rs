//! Logging: where every tutti process's `tracing` events go. The libraries report what an
//! operator must see (a queue pair whose deletion failed and is leaked, a request orphaned
//! without `finish`, a lease that could not be renewed) as `tracing` events; without a
//! subscriber installed they are discarded. Every binary calls [`init_stderr_logging`] first
//! thing in `main`, and the Python module calls it when it is imported.
//!
//! - Events go to standard error, one line each, never to standard output (which carries the
//!   tools' results and may be parsed).
//! - [`LOG_ENV`] (`TUTTI_LOG`) selects them in `RUST_LOG` syntax (`info`, `tutti_daemon=debug`,
//!   `warn,objstore=trace`). Unset or blank, the filter is [`DEFAULT_FILTER`], `warn`: warnings
//!   and errors are shown, nothing chattier. `RUST_LOG` is not read: the Python module lives in
//!   an engine's process (vLLM, SGLang) whose other Rust libraries read `RUST_LOG` for their own
//!   logging, and one variable for every tutti process keeps the rule the same everywhere.
//! - A `TUTTI_LOG` that does not parse does not stop the program: the default is used and one
//!   line on standard error says so. So is one with a bare word that is not a level
//!   (`warning`), which `RUST_LOG` syntax would read as a target selecting nothing of tutti's:
//!   a target alone is written `target=trace`.
//! - Colours only when standard error is a terminal and `NO_COLOR` is unset.
//! - Installing never panics: where a subscriber is already installed (a host program's own),
//!   that one is kept.
//!
//! The subscriber writes to file descriptor 2 directly. In the Python module that matters: an
//! event may fire under the store's lock while a thread holding the GIL waits for that lock, so
//! a subscriber that forwarded to Python's `logging` (taking the GIL) could deadlock.

use std::ffi::OsStr;
use std::io::IsTerminal;
use std::sync::Once;

use tracing_subscriber::EnvFilter;

/// The environment variable holding the filter, in `RUST_LOG` syntax.
pub const LOG_ENV: &str = "TUTTI_LOG";

/// The filter when [`LOG_ENV`] is unset, blank or invalid: warnings and errors.
pub const DEFAULT_FILTER: &str = "warn";

/// The filter a value of [`LOG_ENV`] selects, and the line to print when the value was refused
/// (the default is used then). Unset and blank values are the default, silently.
pub fn filter_from(value: Option<&OsStr>) -> (EnvFilter, Option<String>) {
    let Some(value) = value else {
        return (EnvFilter::new(DEFAULT_FILTER), None);
    };
    let complaint = match value.to_str() {
        Some(text) if text.trim().is_empty() => return (EnvFilter::new(DEFAULT_FILTER), None),
        Some(text) => match bare_word_not_a_level(text) {
            Some(word) => format!(
                "{LOG_ENV}={text:?}: {word:?} is not a level (off, error, warn, info, debug, trace); a target alone is \
                 written {word}=trace"
            ),
            None => match EnvFilter::builder().parse(text) {
                Ok(filter) => return (filter, None),
                Err(error) => format!("{LOG_ENV}={text:?} is not a valid filter ({error})"),
            },
        },
        None => format!("{LOG_ENV}={value:?} is not valid UTF-8"),
    };
    let complaint = format!("tutti: {complaint}; logging with the default filter, {DEFAULT_FILTER:?}");
    (EnvFilter::new(DEFAULT_FILTER), Some(complaint))
}

/// The first directive of `text` that is a bare word but not a level, if any. `RUST_LOG`
/// syntax reads a bare word as a target enabled at every level, so a misspelt level
/// (`warning`, Python's name, or `verbose`) would parse and select only events of a target by
/// that name: none of tutti's, every warning silenced (a leak "reported loudly" included),
/// without a word. Such a word is refused instead; a target alone is spelt `target=trace`.
fn bare_word_not_a_level(text: &str) -> Option<&str> {
    text.split(',')
        .map(str::trim)
        .filter(|directive| !directive.is_empty() && !directive.contains('=') && !directive.contains('['))
        .find(|word| word.parse::<tracing_subscriber::filter::LevelFilter>().is_err())
}

/// Installs the process's subscriber: events selected by [`LOG_ENV`] (default `warn`) to
/// standard error. Only the first call in a process does anything; where another subscriber is
/// already installed it is kept. Never panics.
pub fn init_stderr_logging() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let (filter, complaint) = filter_from(std::env::var_os(LOG_ENV).as_deref());
        if let Some(complaint) = complaint {
            crate::errln!("{complaint}");
        }
        let colours = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        // An error here means a subscriber is installed already: it stays.
        let _ = tracing_subscriber::fmt().with_writer(std::io::stderr).with_ansi(colours).with_env_filter(filter).try_init();
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::filter::LevelFilter;

    fn level(value: Option<&str>) -> (Option<LevelFilter>, Option<String>) {
        let (filter, complaint) = filter_from(value.map(OsStr::new));
        (filter.max_level_hint(), complaint)
    }

    #[test]
    fn the_default_shows_warnings_and_errors() {
        // Goal: with TUTTI_LOG unset or blank, warn and error events are shown and nothing more,
        // without a word about the variable.
        assert_eq!(level(None), (Some(LevelFilter::WARN), None));
        assert_eq!(level(Some("")), (Some(LevelFilter::WARN), None));
        assert_eq!(level(Some("  ")), (Some(LevelFilter::WARN), None));
    }

    #[test]
    fn a_valid_filter_is_used() {
        // Goal: RUST_LOG syntax is honoured, per target too.
        assert_eq!(level(Some("info")), (Some(LevelFilter::INFO), None));
        assert_eq!(level(Some("tutti_daemon=debug")), (Some(LevelFilter::DEBUG), None));
        assert_eq!(level(Some("off")), (Some(LevelFilter::OFF), None));
        assert_eq!(level(Some("WARN")), (Some(LevelFilter::WARN), None));
        assert_eq!(level(Some("warn,objstore=trace")), (Some(LevelFilter::TRACE), None));
        assert_eq!(level(Some("tutti_daemon=trace")), (Some(LevelFilter::TRACE), None));
    }

    #[test]
    fn an_invalid_filter_falls_back_to_the_default_and_says_so() {
        // Goal: a typo in TUTTI_LOG neither stops the program nor silences its warnings; one
        // line names the variable, the value and the default used instead.
        // A misspelt level parses in RUST_LOG syntax as a target of that name (every level of
        // no tutti target: nothing shown): refused as well, with or without other directives.
        for value in ["tutti=loud", "[unclosed", "=warn", "warning", "WARNING", "verbose", "info,tutti_daemn"] {
            let (hint, complaint) = level(Some(value));
            assert_eq!(hint, Some(LevelFilter::WARN), "{value}");
            let complaint = complaint.unwrap_or_else(|| panic!("{value} was accepted"));
            assert!(complaint.contains("TUTTI_LOG") && complaint.contains(value), "{complaint}");
            assert!(complaint.contains("\"warn\""), "{complaint}");
            assert!(!complaint.contains('\n'), "{complaint}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_value_that_is_not_utf8_falls_back_to_the_default() {
        use std::os::unix::ffi::OsStrExt;
        let (filter, complaint) = filter_from(Some(OsStr::from_bytes(b"info\xff")));
        assert_eq!(filter.max_level_hint(), Some(LevelFilter::WARN));
        assert!(complaint.is_some_and(|line| line.contains("UTF-8")));
    }
}
