//! Tutti's slack-aware I/O scheduler as pure logic (Tutti §3.3), with:
//! - [`table`]: the versioned, validated profile-table format the scheduler reads;
//! - [`analytic`]: a roofline model that builds a table from a model config and a GPU spec;
//! - [`import`]: a table from a measured per-layer kernel timeline;
//! - [`policy`]: the slack-aware policy and the no-overlap and naive-pipelining baselines;
//! - [`ssd`] and [`sim`]: an SSD model and a discrete-event, layer-granular pipeline simulator;
//! - [`sweep`] and [`plot`]: hit-rate and prefix-length sweeps, crossover points, CSV and SVG;
//! - [`probe`]: the seam through which `tutti-profile io` measures I/O costs on a live backend.
//!
//! Nothing here touches hardware; numbers from the analytic model and the simulator are model
//! outputs and are labelled as such wherever they are written.
#![forbid(unsafe_code)]

pub mod analytic;
mod between;
pub mod error;
pub mod import;
pub mod plot;
pub mod policy;
pub mod probe;
pub mod sim;
pub mod ssd;
pub mod sweep;
pub mod table;

pub use error::{Result, SchedulerError};
