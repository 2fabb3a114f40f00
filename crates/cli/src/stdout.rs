//! Standard output for tools whose output may be piped into `head`.
//!
//! Rust ignores SIGPIPE, so a write to a closed pipe fails with `EPIPE`, and `println!` turns that
//! into a panic (exit 101, "failed printing to stdout"). The tools write through [`outln!`]
//! instead, which returns a [`StdoutError`]; the error travels up with `?` like any other (so
//! temporary files and devices are released on the way), and `main` exits quietly with
//! [`crate::exit::STDOUT_CLOSED`] when [`is_stdout_closed`] finds it in the error's chain.
//!
//! [`outln!`]: crate::outln

use std::error::Error;
use std::io::{self, Write};

/// A write to standard output failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot write to standard output: {error}")]
pub struct StdoutError {
    error: io::Error,
}

impl StdoutError {
    /// The reader closed the pipe (`EPIPE`): not a failure of the tool.
    pub fn is_closed(&self) -> bool {
        self.error.kind() == io::ErrorKind::BrokenPipe
    }
}

/// Writes `arguments` to standard output (line-buffered: a line is written when it ends).
pub fn write_fmt(arguments: std::fmt::Arguments<'_>) -> Result<(), StdoutError> {
    io::stdout().lock().write_fmt(arguments).map_err(|error| StdoutError { error })
}

/// Writes what is still buffered (text without a final newline).
pub fn flush() -> Result<(), StdoutError> {
    io::stdout().lock().flush().map_err(|error| StdoutError { error })
}

/// Whether `error` or any error in its source chain is standard output closed by its reader.
pub fn is_stdout_closed(error: &(dyn Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(cause) = current {
        if cause.downcast_ref::<StdoutError>().is_some_and(StdoutError::is_closed) {
            return true;
        }
        current = cause.source();
    }
    false
}

/// `println!` that returns `Result<(), StdoutError>` instead of panicking.
#[macro_export]
macro_rules! outln {
    () => {
        $crate::stdout::write_fmt(format_args!("\n"))
    };
    ($($argument:tt)*) => {
        $crate::stdout::write_fmt(format_args!("{}\n", format_args!($($argument)*)))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("printing the report")]
    struct Wrapper(#[source] StdoutError);

    #[test]
    fn a_closed_pipe_is_found_through_the_chain_and_other_errors_are_not_it() {
        let closed = StdoutError { error: io::Error::from(io::ErrorKind::BrokenPipe) };
        assert!(is_stdout_closed(&Wrapper(closed)));
        let full = StdoutError { error: io::Error::from(io::ErrorKind::StorageFull) };
        assert!(!is_stdout_closed(&Wrapper(full)));
        assert!(!is_stdout_closed(&io::Error::from(io::ErrorKind::BrokenPipe)), "only standard output's EPIPE is quiet");
    }
}
