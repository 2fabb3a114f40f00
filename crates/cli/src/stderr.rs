//! Standard error for status lines (progress, warnings, refusals): best effort.
//!
//! `eprintln!` panics when standard error is closed (`2>&1 | head -1` once `head` has exited:
//! EPIPE), and a panic there, on a progress thread or in `main`'s last words, loses the run's
//! results or turns its exit status into 101. Status lines are not the run's output: the tools
//! write them through [`errln!`], which ignores a failed write and says whether it went out.
//!
//! [`errln!`]: crate::errln

use std::io::{self, Write};

/// Writes `arguments` to standard error, ignoring a failure; returns whether it was written.
pub fn write_fmt(arguments: std::fmt::Arguments<'_>) -> bool {
    io::stderr().lock().write_fmt(arguments).is_ok()
}

/// `eprintln!` that never panics: a failed write (standard error closed) is ignored; the macro's
/// value says whether the line went out (`bool`).
#[macro_export]
macro_rules! errln {
    () => {
        $crate::stderr::write_fmt(format_args!("\n"))
    };
    ($($argument:tt)*) => {
        $crate::stderr::write_fmt(format_args!("{}\n", format_args!($($argument)*)))
    };
}
