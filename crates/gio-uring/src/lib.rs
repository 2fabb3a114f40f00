//! gio_uring: the IOCB/IOCTX rings of Tutti §3.2 ("GPU io_uring"), shared by the CPU runtime and
//! an I/O executor.
//!
//! - [`abi`]: the records of `kernels/gio_abi.h` (bindgen output, checked in) and their codes;
//! - [`shared_memory`]: the only unsafe code — atomic access to memory another agent writes;
//! - [`layout`]: where rings, IOCBs and IOCTXs live in a queue's region;
//! - [`ring`]: SPSC rings with batch-publishing producer/consumer views;
//! - [`validate`]: the checks an IOCTX passes when its IOCB is filled;
//! - [`queue`]: the API — `init_queue`, `get_iocb`, `fill_iocb`, `issue_io`, `wait_cqe`,
//!   `peek_cqe`, `reap_cqe`, `put_iocb`;
//! - [`executor`]: the seam an executor (CPU workers, the CUDA kernel) plugs into;
//! - [`cpu_executor`]: the executor that runs IOCBs on the CPU over nvme-driver's queue pairs;
//! - [`cpu_workers`]: the same on worker threads, each owning the queue pairs of some devices;
//! - `gpu` (feature `cuda`): CUDA driver detection, kernel loading, green contexts, DMA modes, and
//!   the CUDA executor over nvme-driver's detached queue pairs;
//! - `detached_rings` (feature `cuda`, and tests): one device's detached pair across the CUDA
//!   executor's resets: an undeleted pair is kept and its rings never reused.
//!
//! Status: the CPU executor works over nvme-driver's queue pairs (tested end to end on the
//! software controller); the CUDA executor is implemented, compiled and unit-tested in its pure
//! parts, but was never run on a GPU; see docs/gio-uring.md.

// Unsafe code is confined to `shared_memory` and (feature `cuda`) `gpu::driver`, which opt in.
#![deny(unsafe_code)]

pub mod abi;
pub mod cpu_executor;
pub mod cpu_workers;
#[cfg(any(test, feature = "cuda"))]
mod detached_rings;
pub mod error;
pub mod executor;
#[cfg(feature = "cuda")]
pub mod gpu;
mod ioctx_index;
pub mod layout;
pub mod queue;
pub mod ring;
#[allow(unsafe_code)]
pub mod shared_memory;
pub mod types;
pub mod validate;

#[cfg(test)]
mod queue_tests;

pub use cpu_executor::CpuExecutor;
pub use cpu_workers::CpuWorkers;
pub use error::{GioError, IocbFailure, IoctxFault};
pub use executor::{Executor, IssueBatch, QueuePairReset, LENT_COMMAND_TAG};
pub use layout::QueueConfig;
pub use queue::{Completion, GioQueue};
pub use types::{Dependency, DeviceIndex, EventToken, IocbId, Iova, IovaRange, LayerIndex, Lba, SmBudget};
pub use validate::{Descriptor, DeviceInfo, DeviceTable, IocbSpec, IoctxSpec, RegisteredMemory};
