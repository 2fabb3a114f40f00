//! Configuration of the software controller: geometry, capabilities, backing store.

use std::path::PathBuf;
use std::time::Duration;

use crate::timing::TimingModel;
use crate::EmuError;

/// The per-command transfer cap applied when `mdts` is 0 ("no limit" in Identify).
pub const UNLIMITED_TRANSFER_CAP_BYTES: u64 = 32 << 20;

/// Where the namespaces' data lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    /// Zeroed process memory of `bytes` (lazily committed by the kernel). It survives
    /// [`crate::EmuDevice::power_loss`] (it models the flash), not the process.
    Memory { bytes: u64 },
    /// A regular file or block device. With `create_bytes`, the file is created if missing and
    /// grown to at least that size; without, it must exist and its current size is used.
    File { path: PathBuf, create_bytes: Option<u64> },
}

/// One namespace: its LBA size and its share of the backing store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceConfig {
    /// Logical block size: a power of two in 512..=65536 (512 and 4096 are the usual ones).
    pub block_size_bytes: u32,
    /// Namespace size; `None` takes what the namespaces before it left of the backing store
    /// (only allowed for the last namespace). Rounded down to whole blocks.
    pub size_bytes: Option<u64>,
}

impl NamespaceConfig {
    pub fn new(block_size_bytes: u32, size_bytes: Option<u64>) -> Self {
        Self { block_size_bytes, size_bytes }
    }
}

/// Everything that shapes the emulated controller. `EmuConfig::default()` is one namespace of
/// 4 KiB LBAs over 64 MiB of memory, MQES 2048, MDTS 5 (128 KiB), SGL and a volatile write
/// cache on, 64 I/O queue pairs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmuConfig {
    pub backing: Backing,
    /// Namespaces, NSID 1.. in order, laid out back to back in the backing store.
    pub namespaces: Vec<NamespaceConfig>,
    /// CAP.MQES + 1: the largest queue the host may create (2..=65536).
    pub max_queue_entries: u32,
    /// CAP.DSTRD: doorbell stride is 4 << this (0..=15; keep it small, it sizes the BAR).
    pub doorbell_stride_log2: u8,
    /// CAP.TO: how long the host should wait for CSTS.RDY, in 500 ms units.
    pub ready_timeout_500ms_units: u8,
    /// Identify MDTS: commands may move at most 4 KiB << mdts bytes (0 = unlimited).
    pub mdts: u8,
    /// Report and accept SGLs (SGLS bit 0). Off makes a driver take its PRP path.
    pub sgl_supported: bool,
    /// A volatile write cache (Identify VWC = 1): writes are durable only after Flush or FUA.
    pub volatile_write_cache: bool,
    /// Dirty bytes the cache holds before it writes everything back on its own.
    pub write_cache_bytes: u64,
    /// I/O submission and completion queues the controller can allocate (Number of Queues).
    pub io_queue_pairs_max: u16,
    /// Validate commands and complete them without moving data or touching storage.
    pub no_storage: bool,
    /// Identify serial number.
    pub serial_number: String,
    /// Longest sleep of the idle poller between doorbell scans.
    pub idle_sleep_max: Duration,
    /// `fdatasync` the backing file before every completion that promises media: Flush, FUA
    /// Writes and Reads, Writes with the cache off, a shutdown's write-back (real durability
    /// across host crashes; slow).
    pub sync_file_on_flush: bool,
    /// Batch consecutive Reads and write-through Writes of a file-backed device through io_uring
    /// (several in flight); off, or when io_uring is unavailable, every transfer is one
    /// synchronous `pread`/`pwrite`.
    pub io_uring: bool,
    /// Most bytes of bounced Reads and write-through Writes in flight through io_uring at once
    /// (the controller's buffers they hold); a command larger than this still runs, alone.
    /// Transfers straight between the file and host memory hold no such buffer and are bounded
    /// by the ring's depth only.
    pub in_flight_bytes_max: u64,
    /// Hold Read/Write completions back as an SSD of this bandwidth, latency and mixed-traffic
    /// collapse would (see [`crate::timing`]); `None` (the default) completes as fast as this
    /// machine can.
    pub timing: Option<TimingModel>,
    /// Keep the register file (BAR0) in a sealed memfd instead of private memory, so that another
    /// process can map it ([`crate::EmuDevice::shared_register_memory`]) and ring doorbells
    /// itself (tuttid's clients). Such doorbells cannot wake the controller thread: they are
    /// found by its polling, within `idle_sleep_max` after an idle period.
    pub shared_registers: bool,
    /// Advertise Doorbell Buffer Config (OACS bit 8) and accept it: a host that sends it keeps
    /// its I/O queues' doorbells in a shadow page and writes the registers only when the
    /// controller's EventIdx asks (see `shadow.rs`). A host that does not send it sees only the
    /// OACS bit.
    pub shadow_doorbells: bool,
}

impl Default for EmuConfig {
    fn default() -> Self {
        Self {
            backing: Backing::Memory { bytes: 64 << 20 },
            namespaces: vec![NamespaceConfig::new(4096, None)],
            max_queue_entries: 2048,
            doorbell_stride_log2: 0,
            ready_timeout_500ms_units: 20,
            mdts: 5,
            sgl_supported: true,
            volatile_write_cache: true,
            write_cache_bytes: 32 << 20,
            io_queue_pairs_max: 64,
            no_storage: false,
            serial_number: "TUTTI-EMU-0001".to_string(),
            idle_sleep_max: Duration::from_micros(100),
            sync_file_on_flush: false,
            io_uring: true,
            in_flight_bytes_max: 16 << 20,
            timing: None,
            shared_registers: false,
            shadow_doorbells: true,
        }
    }
}

impl EmuConfig {
    pub fn with_backing(mut self, backing: Backing) -> Self {
        self.backing = backing;
        self
    }
    pub fn with_namespaces(mut self, namespaces: Vec<NamespaceConfig>) -> Self {
        self.namespaces = namespaces;
        self
    }
    pub fn with_max_queue_entries(mut self, entries: u32) -> Self {
        self.max_queue_entries = entries;
        self
    }
    pub fn with_doorbell_stride_log2(mut self, stride_log2: u8) -> Self {
        self.doorbell_stride_log2 = stride_log2;
        self
    }
    pub fn with_shadow_doorbells(mut self, supported: bool) -> Self {
        self.shadow_doorbells = supported;
        self
    }
    pub fn with_mdts(mut self, mdts: u8) -> Self {
        self.mdts = mdts;
        self
    }
    pub fn with_sgl(mut self, supported: bool) -> Self {
        self.sgl_supported = supported;
        self
    }
    pub fn with_volatile_write_cache(mut self, present: bool) -> Self {
        self.volatile_write_cache = present;
        self
    }
    pub fn with_write_cache_bytes(mut self, bytes: u64) -> Self {
        self.write_cache_bytes = bytes;
        self
    }
    pub fn with_io_queue_pairs_max(mut self, pairs: u16) -> Self {
        self.io_queue_pairs_max = pairs;
        self
    }
    pub fn with_in_flight_bytes_max(mut self, bytes: u64) -> Self {
        self.in_flight_bytes_max = bytes;
        self
    }

    pub fn with_io_uring(mut self, enabled: bool) -> Self {
        self.io_uring = enabled;
        self
    }
    pub fn with_timing(mut self, timing: Option<TimingModel>) -> Self {
        self.timing = timing;
        self
    }
    pub fn with_shared_registers(mut self, shared: bool) -> Self {
        self.shared_registers = shared;
        self
    }
    pub fn with_no_storage(mut self, no_storage: bool) -> Self {
        self.no_storage = no_storage;
        self
    }

    /// Largest transfer of one command in bytes as Identify reports it, `None` if unlimited.
    pub fn max_transfer_bytes(&self) -> Option<u64> {
        (self.mdts != 0).then(|| 4096u64 << self.mdts.min(20))
    }

    /// Largest transfer the controller accepts: MDTS, or [`UNLIMITED_TRANSFER_CAP_BYTES`] when
    /// MDTS is 0, so that a host cannot make it allocate gigabytes for one command.
    pub fn accepted_transfer_bytes(&self) -> u64 {
        self.max_transfer_bytes().unwrap_or(UNLIMITED_TRANSFER_CAP_BYTES)
    }

    /// Checks what can be checked without opening the backing store.
    pub(crate) fn validate(&self) -> Result<(), EmuError> {
        let invalid = |reason: String| Err(EmuError::InvalidConfig { reason });
        if !(2..=65536).contains(&self.max_queue_entries) {
            return invalid(format!("max_queue_entries {} outside 2..=65536", self.max_queue_entries));
        }
        if self.doorbell_stride_log2 > 8 {
            return invalid(format!("doorbell_stride_log2 {} above 8", self.doorbell_stride_log2));
        }
        if self.io_queue_pairs_max == 0 || self.io_queue_pairs_max > 1024 {
            return invalid(format!("io_queue_pairs_max {} outside 1..=1024", self.io_queue_pairs_max));
        }
        if self.namespaces.is_empty() || self.namespaces.len() > 1024 {
            return invalid(format!("{} namespaces; 1..=1024 supported", self.namespaces.len()));
        }
        for (index, namespace) in self.namespaces.iter().enumerate() {
            let size = namespace.block_size_bytes;
            if !size.is_power_of_two() || !(512..=65536).contains(&size) {
                return invalid(format!("namespace {}: block size {size} is not a power of two in 512..=65536", index + 1));
            }
            if namespace.size_bytes.is_none() && index + 1 != self.namespaces.len() {
                return invalid(format!("namespace {}: only the last namespace may take the remaining space", index + 1));
            }
        }
        if self.mdts > 20 {
            return invalid(format!("mdts {} above 20", self.mdts));
        }
        if let Some(timing) = &self.timing {
            timing.validate()?;
        }
        Ok(())
    }
}
