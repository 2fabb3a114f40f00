//! A userspace NVMe host driver.
//!
//! Layers, bottom up:
//! - [`spec`]: NVMe specification types (registers, commands, completions, status, Identify,
//!   PRP/SGL), plain data without unsafe code;
//! - [`hw`]: the hardware seam — BAR0 register I/O, DMA memory with device-visible addresses, the
//!   device backend — and all of this crate's unsafe code;
//! - the driver proper, written against the seam only.
//!
//! The same driver code runs against the software controller (`nvme-emu`), QEMU's NVMe
//! controller through VFIO, and real SSDs.
#![deny(unsafe_code)]

mod controller;
pub mod datapath;
#[cfg(test)]
mod delete_retry_tests;
mod detached;
mod error;
#[cfg(any(test, feature = "fake-device"))]
pub mod fake_device;
mod gate;
#[cfg(test)]
mod hardening_tests;
pub mod hw;
mod io;
mod namespace;
mod queue;
mod shadow;
#[cfg(test)]
mod shutdown_tests;
pub mod spec;
mod teardown;
pub mod types;

pub use controller::{BringUpStage, Controller, ControllerConfig, DataPointerPreference};
pub use datapath::{DataPointerMode, DataSegment};
pub use detached::{AttachedQueueConfig, DetachedQueueLayout, DetachedQueuePair, UndeletedDetachedQueuePair};
pub use error::{NvmeError, ReadyBoundSource};
pub use hw::{AddressSpaceId, DeviceBackend, DmaAllocator, DmaPool, DmaRegion, HwError, RegisterIo};
pub use io::{IoQueuePair, UndeletedQueuePair, DEALLOCATE_RANGES_MAX};
pub use namespace::{Namespace, NamespaceRefusal, RefusedNamespace};
pub use queue::{Completion, QueuePair, QUEUE_DEPTH_MAX};
pub use types::{BlockCount, CommandId, Iova, Lba, NamespaceId, QueueId};
