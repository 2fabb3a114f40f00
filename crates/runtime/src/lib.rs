//! The runtime an inference engine drives at layer boundaries (Tutti §3.4): it owns the object
//! store and a scheduling policy, and decides every KV read and write.
//!
//! ```text
//! let start = runtime.begin_prefill(&KvRequest { tokens, block_ids })?; // lookup, prepare
//! for layer in 0..layers {
//!     runtime.begin_layer(start.id, layer)?;   // issue what the policy says
//!     /* the layer's work before attention */
//!     runtime.wait_layer_kv(start.id, layer)?; // wait for this layer's cached KV (the bubble)
//!     /* attention and the rest of the layer */
//!     runtime.after_layer(start.id, layer)?;  // its new KV may be written
//! }
//! runtime.end_prefill(start.id)?;
//! runtime.decode_step(context_tokens)?;       // deferred writes go into decode slack
//! runtime.releasable(engine_block);           // may the engine reuse this block yet?
//! ```
//!
//! - [`config`]: the policy setting, the write-queue bound and what happens past it;
//! - [`runtime`]: the calls above and the mapping onto the store; its `progress` submodule reaps,
//!   commits, keeps the read/write barrier and issues what may go;
//! - `writes`: the write queue that outlives its request, and the releasable-block contract;
//! - [`events`]: counters and an optional bounded log of issue/complete events.
//!
//! Dependencies point down: this crate uses `objstore`, `scheduler` and `gio-uring`; none of
//! them knows it.
#![forbid(unsafe_code)]

pub mod config;
pub mod error;
pub mod events;
pub mod runtime;
mod writes;

pub use config::{PolicyChoice, RuntimeConfig, WriteQueueFullAction, IO_TIMEOUT_MAX};
pub use error::{FinishError, Result, RuntimeError};
pub use events::{IoDirection, IoEvent, IoEventKind, RuntimeCounters};
pub use runtime::{PrefillId, PrefillStart, Runtime};
