//! `tutti._tutti`: the compiled half of the `tutti` Python package (python/tutti; the API is
//! typed and documented in python/tutti/_tutti.pyi, docs/python.md says what runs where).
//!
//! - [`store`] — `Store` (in-process over the pool's devices, or attached to tuttid) and its
//!   completion thread; [`backend`] — what it holds under its lock;
//! - [`request`] — `Request` and `LayerIo`, waits with the GIL released, eventfds;
//! - [`memory`] — `RawMemory`, `KvBuffer`, `KvLayout`, tensors from DLPack / the buffer protocol;
//! - [`device_memory`] — CUDA tensors and their CPU stand-in registered with tuttid as device
//!   memory;
//! - [`tensor`] — the checks a registered tensor must pass (no Python);
//! - [`errors`] — the exception classes and the mapping from the Rust errors;
//! - [`lookup`] — `LookupClient`;
//! - [`process`] — which process a session belongs to (a forked child may not use it);
//! - [`ffi`] — the crate's only unsafe code (DLPack capsules, mapping caller memory).
#![deny(unsafe_code)]

pub mod backend;
pub mod device_memory;
pub mod errors;
#[allow(unsafe_code)]
pub mod ffi;
pub mod geometry;
pub mod lookup;
pub mod memory;
pub mod process;
pub mod request;
pub mod store;
pub mod tensor;

use pyo3::prelude::*;

#[pymodule]
fn _tutti(module: &Bound<'_, PyModule>) -> PyResult<()> {
    // The store's warnings and errors (a request orphaned without finish, a queue pair leaked)
    // go to standard error, filtered by TUTTI_LOG (default warn). Written to fd 2 directly,
    // never through Python's logging: events fire under the store's lock, which a thread
    // holding the GIL may be waiting for. A host that installed its own subscriber keeps it.
    tutti_cli::init_stderr_logging();
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(module)?;
    module.add_class::<geometry::ModelGeometry>()?;
    module.add_class::<memory::RawMemory>()?;
    module.add_class::<memory::KvBuffer>()?;
    module.add_class::<memory::KvLayout>()?;
    module.add_class::<device_memory::DeviceMemoryStandIn>()?;
    module.add_class::<store::Store>()?;
    module.add_class::<request::Request>()?;
    module.add_class::<request::LayerIo>()?;
    module.add_class::<lookup::LookupClient>()?;
    Ok(())
}
