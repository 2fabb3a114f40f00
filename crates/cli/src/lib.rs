//! What the tutti command-line tools share beyond device strings (those are `tutti-devices`):
//!
//! - [`exit`]: the exit statuses every tool keeps (0 done, 1 failed or damage found, 2 unusable
//!   input, 141 standard output closed);
//! - [`stdout`]: writing to standard output without panicking when a reader such as `head`
//!   closes the pipe: the write fails with a [`stdout::StdoutError`], the run unwinds through
//!   its `Drop`s (temporary files are removed) and the tool exits quietly with 141;
//! - [`timeout`]: `--timeout-s`, bounded so that a deadline (`Instant + Duration`) cannot
//!   overflow;
//! - [`geometry`]: the model-geometry options (`--model`, `--model-config FILE`, `--layers`,
//!   `--kv-heads`, `--head-dim`, `--dtype`, `--tokens-per-block`) and their one parser, used by
//!   tutti-bench, `tutti pool format` and tutti-profile (feature `geometry`, on by default;
//!   without it the crate needs nothing beyond std, for binaries below the object store).
#![forbid(unsafe_code)]

pub mod exit;
#[cfg(feature = "geometry")]
pub mod geometry;
pub mod stdout;
pub mod timeout;

#[cfg(feature = "geometry")]
pub use geometry::{Dtype, GeometryArgs, GeometryError, ModelChoice};
pub use stdout::{is_stdout_closed, StdoutError};
