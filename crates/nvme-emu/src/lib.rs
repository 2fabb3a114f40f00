//! A software NVMe controller: the device side of `nvme-driver`'s hardware seam.
//!
//! [`EmuDevice`] implements [`nvme_driver::hw::DeviceBackend`]: its registers are an emulated
//! BAR0 kept in a page-aligned DMA region (so a GPU can map it and ring doorbells), its DMA
//! allocator is an identity [`nvme_driver::hw::DmaPool`] whose table the controller thread
//! translates through to perform DMA. The controller runs on its own thread, polling the
//! doorbells with idle back-off, and implements:
//!
//! - the register file (CAP with MQES/DSTRD/TO/MPSMIN/CQR/CSS, VS 1.4, CC enable, disable and
//!   shutdown, CSTS RDY/CFS/SHST, AQA/ASQ/ACQ, doorbells with the configured stride);
//! - admin commands: Identify (CNS 0/1/2), Create/Delete I/O SQ/CQ, Get/Set Features (Number of
//!   Queues, Volatile Write Cache, Arbitration), Get Log Page (Error Information, SMART), Abort;
//! - NVM commands: Read and Write (FUA), Flush, Write Zeroes, Dataset Management (deallocate);
//! - PRP (with chained lists) and SGL (Data Block, Segment, Last Segment) data pointers;
//! - a volatile write cache with [`EmuDevice::power_loss`], fault injection ([`FaultPlan`]),
//!   a no-storage mode, counters ([`EmuStats`]), and an optional [`TimingModel`] that holds
//!   completions back as an SSD of given bandwidth, latency and mixed-traffic collapse would.
//!
//! Nothing a host writes can make it panic: every malformed command gets the NVMe status a
//! real controller would return (see `docs/nvme-emu.md` for the table). It has no unsafe code:
//! file-backed reads and write-through writes stay in flight across doorbell scans through the
//! shared `tutti-uring` crate, which owns the buffers (or host DMA regions, for transfers
//! straight into host memory) while the kernel uses them.
//!
//! # API
//!
//! - [`EmuConfig`] (`Default` + `with_*` builders), [`Backing`] (`Memory { bytes }`,
//!   `File { path, create_bytes }`), [`NamespaceConfig`] (`block_size_bytes`, `size_bytes`);
//! - [`EmuDevice::start`]`(EmuConfig) -> Result<Arc<EmuDevice>, EmuError>`; the device implements
//!   [`nvme_driver::hw::DeviceBackend`] and stops its thread when the last `Arc` drops;
//! - [`EmuDevice::power_loss`], [`EmuDevice::power_loss_with`]`(`[`PowerLossMode`]`)`, [`EmuDevice::set_faults`]`(`[`FaultPlan`]`)`,
//!   [`EmuDevice::stats`]` -> `[`EmuStats`], [`EmuDevice::register_region`] (BAR0 memory for a
//!   GPU), [`EmuDevice::dma_pool`];
//! - [`fuzzing::process_raw`] for fuzzers.
//!
//! # Example
//!
//! ```
//! use nvme_driver::hw::{DeviceBackend, RegisterIo};
//! use nvme_driver::spec::registers::{Capabilities, CAP};
//! use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};
//!
//! let config = EmuConfig::default()
//!     .with_backing(Backing::Memory { bytes: 8 << 20 })
//!     .with_namespaces(vec![NamespaceConfig::new(512, Some(4 << 20)), NamespaceConfig::new(4096, None)])
//!     .with_sgl(false); // make the driver take its PRP path
//! let device = EmuDevice::start(config)?;
//! let cap = Capabilities(device.registers().read64(CAP));
//! assert_eq!(cap.max_queue_entries(), 2048);
//! // ... hand `device` to the driver as an `Arc<dyn DeviceBackend>`, do I/O, then:
//! device.power_loss(); // unflushed writes are gone; the host must bring the controller up again
//! # Ok::<(), nvme_emu::EmuError>(())
//! ```
#![forbid(unsafe_code)]

mod admin;
mod backing;
mod cache;
pub mod config;
mod controller;
mod data_pointer;
mod device;
pub mod faults;
pub mod fuzzing;
mod io;
mod queues;
mod registers;
pub mod restriction;
mod shadow;
pub mod stats;
pub mod timing;
mod uring;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use config::{Backing, EmuConfig, NamespaceConfig};
pub use device::{EmuDevice, PowerLossMode, RestrictionPreset};
pub use faults::{FaultAction, FaultPlan, FaultRule, QueueFilter};
pub use registers::RegisterFile;
pub use restriction::QueueRestriction;
pub use stats::EmuStats;
pub use timing::{TimingModel, TimingStats};

/// Errors starting, configuring or resetting the software controller (command errors are NVMe
/// statuses in completions, never Rust errors).
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    #[error("invalid emulator configuration: {reason}")]
    InvalidConfig { reason: String },
    #[error("backing store {path}: {source}")]
    Backing { path: PathBuf, source: std::io::Error },
    #[error("cannot allocate {bytes} bytes of memory for the backing store: {source}")]
    Memory { bytes: u64, source: std::io::Error },
    #[error("DMA memory for the emulator: {0}")]
    Hw(#[from] nvme_driver::hw::HwError),
    #[error("no I/O submission queue {queue_id} exists to restrict")]
    NoSuchQueue { queue_id: u16 },
    #[error("a restriction for the submission queue with its ring at IOVA {ring_iova:#x} is preset already")]
    RestrictionPending { ring_iova: u64 },
    #[error("cannot start the controller thread: {0}")]
    Thread(std::io::Error),
    #[error("the volatile write cache could not be written back ({status}): its blocks stay cached")]
    WriteBack { status: nvme_driver::spec::NvmeStatus },
    #[error(
        "{transfers} transfer(s) straight into host memory are still with the kernel after cancellation: the \
         controller keeps CSTS.RDY = 1 with CSTS.CFS until the kernel gives them back, and that memory must not be reused"
    )]
    HostMemoryInKernel { transfers: usize },
}
