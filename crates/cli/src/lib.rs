//! What the tutti command-line tools share beyond device strings (those are `tutti-devices`):
//!
//! - [`exit`]: the exit statuses every tool keeps (0 done, 1 failed or damage found, 2 unusable
//!   input, 141 standard output closed);
//! - [`stdout`]: writing to standard output without panicking when a reader such as `head`
//!   closes the pipe: the write fails with a [`stdout::StdoutError`], the run unwinds through
//!   its `Drop`s (temporary files are removed) and the tool exits quietly with 141;
//! - [`stderr`]: status lines on standard error ([`errln!`]) that a closed standard error cannot
//!   turn into a panic (exit 101, results lost): best effort, never the run's output;
//! - [`logging`]: the one `tracing` subscriber of every tutti process (binaries and the Python
//!   module): events to standard error, filtered by `TUTTI_LOG`, `warn` by default;
//! - [`timeout`]: `--timeout-s`, bounded so that a deadline (`Instant + Duration`) cannot
//!   overflow;
//! - [`geometry`]: the model-geometry options (`--model`, `--model-config FILE`, `--layers`,
//!   `--kv-heads`, `--head-dim`, `--dtype`, `--tokens-per-block`) and their one parser, used by
//!   tutti-bench, `tutti pool format` and tutti-profile (feature `geometry`, on by default;
//!   without it the crate needs nothing beyond std, clap and tracing-subscriber, for binaries
//!   below the object store and the Python module);
//! - [`key_secret`]: `--key-secret-file`, the pool's key secret read with a warning when the file
//!   is exposed (feature `geometry`, which brings the object store);
//! - [`text`]: text from outside printed with its control characters escaped ([`printable`]).
#![forbid(unsafe_code)]

pub mod exit;
#[cfg(feature = "geometry")]
pub mod geometry;
#[cfg(feature = "geometry")]
pub mod key_secret;
pub mod logging;
pub mod stderr;
pub mod stdout;
pub mod text;
pub mod timeout;

#[cfg(feature = "geometry")]
pub use geometry::{Dtype, GeometryArgs, GeometryError, ModelChoice};
#[cfg(feature = "geometry")]
pub use key_secret::read_key_secret_file;
pub use logging::init_stderr_logging;
pub use stdout::{is_stdout_closed, StdoutError};
pub use text::printable;
