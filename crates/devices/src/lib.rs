//! The device strings every tutti tool accepts, in one place:
//!
//! - [`size`]: sizes like fio's (`4k` = `4KiB` = 4096, k/m/g/t powers of 1024) and their display;
//! - [`spec`]: `vfio:BDF`, `emu:PATH`, `emu:mem:SIZE`, `emu:null:SIZE`, `uring:PATH` as a typed
//!   [`DeviceSpec`], each tool naming the kinds it accepts;
//! - [`duration`]: durations (`10`, `500ms`, `50us`);
//! - [`timing`]: the software controller's timing model (`--emu-timing`);
//! - [`memory`]: the check that `emu:mem:` devices fit the memory the machine has available
//!   (`MemAvailable` less a reserve), before anything is allocated (`emu:null:` allocates none);
//! - [`claim`]: exclusive opens (`O_EXCL`) of the block devices a tool is to write, refusing
//!   one that is mounted or otherwise in use, held until the tool is done;
//! - [`contents`]: what a device holds (a tutti pool, blank, a file system, ...), so that
//!   formatting refuses to destroy anything but a pool unless told to overwrite it;
//! - [`lock`]: one user per pool device: an exclusive `flock` on an `emu:` file or on a `vfio:`
//!   function's lock file, naming the holder when refused (tuttid and `tutti pool` both take it);
//!   one file or PCI function named twice is refused as such first, not as in use;
//! - [`open`]: opening a list of specs in one DMA space (every `vfio:` function in one VFIO
//!   container, every software controller in one DMA pool), as an object-store pool needs; one
//!   file named by two `emu:` specs, however spelled, is refused;
//! - [`undo`]: the `emu:` files a format creates or grows, put back as they were when it is
//!   refused.
//!
//! Every error is a [`DeviceError`] that names what was given, what is wrong and what is
//! accepted; the tools print it as one line and exit with status 2 (unusable input), except
//! for a device that fails: a controller that does not come up ([`DeviceError::BringUp`]) or a
//! namespace that cannot be read ([`DeviceError::NamespaceHead`]) is status 1.
#![forbid(unsafe_code)]

pub mod claim;
pub mod contents;
pub mod duration;
pub mod lock;
pub mod memory;
pub mod open;
pub mod size;
pub mod spec;
pub mod timing;
pub mod undo;

pub use claim::{BlockDeviceClaims, BlockDeviceOpener, HostBlockDevices};
pub use contents::{read_namespace_head, refuse_foreign_contents, refuse_foreign_namespaces};
pub use duration::parse_duration;
pub use lock::{DeviceLocks, DEFAULT_LOCK_DIR};
pub use memory::{check_memory, check_memory_with, mem_available_bytes, memory_reserve_bytes, memory_shortfall, MemoryShortfall};
pub use open::{
    check_one_space, open_in_one_space, open_pool_devices, refuse_shared_files, refuse_shared_files_with, BlockDeviceLayout, DiskExtent,
    OpenedDevice, PoolDevice,
};
pub use size::{format_size, format_size_exact, parse_size};
pub use spec::{DeviceKind, DeviceSpec};
pub use timing::parse_timing;
pub use undo::FileUndo;

/// What a device string or a device set cannot be used for, in words.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("malformed size '{text}'{detail}; {}", size::ACCEPTED)]
    MalformedSize { text: String, detail: String },
    #[error("malformed duration '{text}'{detail}; {}", duration::ACCEPTED)]
    MalformedDuration { text: String, detail: String },
    #[error("timing model '{text}': {reason}; {}", timing::ACCEPTED)]
    MalformedTiming { text: String, reason: String },
    #[error("size '{text}' is too large (over 2^64 bytes)")]
    SizeTooLarge { text: String },
    #[error("duration '{text}' is too large (at most 2^64-1 us, ms or seconds)")]
    DurationTooLarge { text: String },
    #[error("device '{text}' {reason}; accepted: {accepted}")]
    MalformedSpec { text: String, reason: String, accepted: String },
    #[error("{spec} cannot be used here; accepted: {accepted}")]
    NotAccepted { spec: String, accepted: String },
    #[error(
        "{specs}: {} of memory asked, but only {} can be spared (MemAvailable {} less a reserve of {}); \
         use emu:PATH for a file-backed device, or a smaller size",
        format_size(*asked_bytes), format_size(available_bytes.saturating_sub(*reserve_bytes)),
        format_size(*available_bytes), format_size(*reserve_bytes)
    )]
    NotEnoughMemory { specs: String, asked_bytes: u64, available_bytes: u64, reserve_bytes: u64 },
    #[error("{spec}: no such file (nothing to open; give a size to create one where the tool offers it)")]
    MissingFile { spec: String },
    #[error("{spec}: the file is empty (0 bytes), so it holds no namespace (was it truncated?)")]
    EmptyFile { spec: String },
    /// Two specs naming one file or, `overlap` saying where, two block devices sharing bytes of
    /// one disk (a whole disk and one of its partitions, two overlapping partitions).
    #[error("{first} and {second} {}", duplicate_file_reason(overlap.as_deref()))]
    DuplicateFile { first: String, second: String, overlap: Option<String> },
    #[error(
        "{spec}: {} is {kind}, not a regular file or a device: a pool device must be one (opening it could wait \
         without end, as for a FIFO's writer)",
        path.display()
    )]
    NotAFileOrDevice { spec: String, path: std::path::PathBuf, kind: String },
    #[error("{first} and {second} name the same PCI function: one controller cannot be two devices of a pool; give each device once")]
    DuplicateFunction { first: String, second: String },
    #[error("the devices of one set share one DMA space: give only vfio: devices (one VFIO container) or only emu: ones")]
    MixedSpaces,
    #[error("{spec}: cannot start the software NVMe controller: {source}")]
    Emulator { spec: String, source: nvme_emu::EmuError },
    #[error("bringing up {spec}: {source}")]
    BringUp { spec: String, source: nvme_driver::NvmeError },
    #[error("{spec} is in use by another process: {lock} is held by {holder}")]
    DeviceInUse { spec: String, lock: std::path::PathBuf, holder: String },
    /// The file an `emu:`/`uring:` device serves is not the one its lock is on: its path was
    /// renamed over or relinked between the lock and the open ([`DeviceLocks::check_opened`]).
    #[error(
        "{spec}: {} was replaced while it was being opened (renamed or linked over after it was locked): the file \
         opened is not the one locked, and another process could lock and use it too; open it again",
        path.display()
    )]
    ReplacedWhileOpening { spec: String, path: std::path::PathBuf },
    #[error("{path}: {reason}")]
    SharedLockFile { path: std::path::PathBuf, reason: String },
    /// A device's file (or a `vfio:` lock file) that could not be opened to lock it;
    /// [`DeviceError::is_unusable_input`] tells what was given from what failed.
    #[error("opening {path} to lock it: {source}")]
    OpenFailed { path: std::path::PathBuf, source: std::io::Error },
    #[error(
        "{spec}: the block device is in use (mounted, swap, under device-mapper/RAID, or held open exclusively by another \
         program): refusing to touch it; unmount or release it first"
    )]
    BlockDeviceInUse { spec: String },
    #[error(
        "{spec} holds {found}: it is not a tutti pool, and formatting it destroys what is there; \
         give --overwrite to format it anyway"
    )]
    ForeignContents { spec: String, found: String },
    #[error("{spec}: {context}: {source}")]
    NamespaceHead { spec: String, context: String, source: nvme_driver::NvmeError },
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    #[error("{listed}: {source} (needs the device bound to vfio-pci, e.g. `tutti bind BDF`, and access to /dev/vfio)")]
    Vfio { listed: String, source: nvme_driver::HwError },
}

impl DeviceError {
    /// Whether this says something about what was given (exit status 2) rather than that a
    /// device or this host failed (1). Only [`DeviceError::OpenFailed`] is decided here, by its
    /// errno: a path that does not exist, is not allowed, is read-only, loops or is malformed is
    /// unusable input; so is a device node with no device behind it (ENXIO, ENODEV: a `/dev`
    /// entry whose driver or hardware is not there; the path given names nothing usable, as a
    /// missing one does, and running again on the same host changes nothing); anything else
    /// (EIO, EMFILE, ENOSPC, ...) a failure.
    ///
    /// A [`DeviceError::Io`] is a failure here; the tools decide one by its errno with
    /// [`is_unusable_errno`] on its source (`tutti pool`'s and tutti-bench's locks, tuttid's
    /// locks and block-device claims: no permission to create the lock directory, or a disk
    /// that vanished before its exclusive open, is what was given, exit status 2).
    pub fn is_unusable_input(&self) -> bool {
        match self {
            DeviceError::OpenFailed { source, .. } => is_unusable_errno(source),
            _ => false,
        }
    }
}

/// The rest of [`DeviceError::DuplicateFile`]'s message.
fn duplicate_file_reason(overlap: Option<&str>) -> String {
    match overlap {
        None => "name the same file: two software controllers on one file would overwrite each other's data; give each file once".into(),
        Some(overlap) => format!(
            "overlap on one disk ({overlap}): two software controllers on the same sectors would overwrite each other's data; \
             give a disk or partitions of it, not both, and partitions that do not overlap"
        ),
    }
}

/// Whether an I/O error on a path that was given says something about the path (exit status 2)
/// rather than that the device or this host failed (1), by its errno: a path that does not
/// exist, is not allowed, is read-only, loops or is malformed, or a device node with no device
/// behind it (ENXIO, ENODEV), is unusable input; anything else (EIO, EMFILE, ENOSPC, ENOLCK,
/// ...), or an error with no errno, a failure. [`DeviceError::is_unusable_input`] decides a
/// failed open with this.
pub fn is_unusable_errno(source: &std::io::Error) -> bool {
    use nix::errno::Errno;
    matches!(
        source.raw_os_error().map(Errno::from_raw),
        Some(
            Errno::ENOENT
                | Errno::EACCES
                | Errno::EPERM
                | Errno::EROFS
                | Errno::ELOOP
                | Errno::ENAMETOOLONG
                | Errno::ENOTDIR
                | Errno::EISDIR
                | Errno::ENXIO
                | Errno::ENODEV
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_open_is_input_or_failure_by_its_errno() {
        // Goal: tutti-bench told a lock file's failed open from other I/O errors by the words of
        // its context ("opening "), and made EIO, EMFILE or ENOSPC unusable input (2); the
        // typed error is classified by its errno.
        let open = |errno: nix::errno::Errno| DeviceError::OpenFailed {
            path: "/x".into(),
            source: std::io::Error::from_raw_os_error(errno as i32),
        };
        use nix::errno::Errno;
        for errno in
            [Errno::ENOENT, Errno::EACCES, Errno::EPERM, Errno::EROFS, Errno::ELOOP, Errno::ENAMETOOLONG, Errno::ENOTDIR, Errno::EISDIR]
        {
            assert!(open(errno).is_unusable_input(), "{errno}");
        }
        // A device node with no device behind it (ENXIO, ENODEV): the path given names nothing
        // usable, as a missing one does; retrying on a healthy host changes nothing.
        for errno in [Errno::ENXIO, Errno::ENODEV] {
            assert!(open(errno).is_unusable_input(), "{errno}");
        }
        for errno in [Errno::EIO, Errno::EMFILE, Errno::ENOSPC, Errno::ENOMEM] {
            assert!(!open(errno).is_unusable_input(), "{errno}");
        }
        let error = DeviceError::Io { context: "opening /x".into(), source: std::io::Error::from_raw_os_error(Errno::ENOENT as i32) };
        assert!(!error.is_unusable_input());
    }
}
