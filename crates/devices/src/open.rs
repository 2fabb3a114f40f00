//! Opening a list of device specs in one DMA space: every `vfio:` function in one VFIO
//! container, every software controller in one DMA pool. An object-store pool striped over
//! several devices needs that (the engine's KV memory is registered once, at one set of
//! addresses every device reaches); a single device gets its own space.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nvme_driver::hw::vfio::{PciAddress, VfioOptions};
use nvme_driver::hw::VfioDevice;
use nvme_driver::{Controller, ControllerConfig, DeviceBackend, DmaPool};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};

use crate::claim::HostBlockDevices;
use crate::memory::check_memory;
use crate::spec::{DeviceKind, DeviceSpec};
use crate::DeviceError;

/// One opened device: the backend a `Controller` is brought up on and, for the software
/// controller, the device itself (its thread runs as long as this is held; fault injection).
pub struct OpenedDevice {
    pub spec: DeviceSpec,
    pub backend: Arc<dyn DeviceBackend>,
    pub emulator: Option<Arc<EmuDevice>>,
}

impl OpenedDevice {
    /// The device and inode of the file a software controller serves (`None`: no file), for
    /// [`crate::DeviceLocks::check_opened`].
    pub fn backing_file(&self) -> Option<(u64, u64)> {
        self.emulator.as_ref().and_then(|emulator| emulator.backing_file())
    }
}

/// How software controllers are started.
#[derive(Debug, Clone, Default)]
pub struct EmuOptions {
    /// Everything but the backing store, which each spec names.
    pub config: EmuConfig,
    /// An `emu:PATH` file that is missing is created with this many bytes, one that is smaller is
    /// grown to it (nvme-emu's rule); `None`: the file must exist and keeps its size.
    pub create_bytes: Option<u64>,
}

/// Opens `specs` in one DMA space, in order. Refuses `uring:` (no NVMe controller), a mix of
/// `vfio:` and software controllers (two address spaces), memory devices the machine cannot
/// hold ([`check_memory`]) and one file named by two `emu:` specs (two controllers would
/// overwrite each other's data) or one PCI function named twice
/// ([`DeviceError::DuplicateFunction`]), before anything is opened.
pub fn open_in_one_space(specs: &[DeviceSpec], emu: &EmuOptions) -> Result<Vec<OpenedDevice>, DeviceError> {
    let addresses = check_one_space(specs, emu.create_bytes)?;
    let mut functions = if addresses.is_empty() {
        Vec::new().into_iter()
    } else {
        VfioDevice::open_many(&addresses, &VfioOptions::default())
            .map_err(|source| {
                let listed = addresses.iter().map(|address| format!("vfio:{address}")).collect::<Vec<_>>().join(" ");
                DeviceError::Vfio { listed, source }
            })?
            .into_iter()
    };
    let space = DmaPool::identity();
    let mut opened = Vec::with_capacity(specs.len());
    for spec in specs {
        let (backend, emulator): (Arc<dyn DeviceBackend>, _) = match spec {
            DeviceSpec::Vfio(_) => {
                // open_many returns one function per address, in order.
                let function = functions.next().ok_or_else(|| DeviceError::Vfio {
                    listed: spec.to_string(),
                    source: nvme_driver::HwError::Backend { backend: "vfio", message: "VFIO opened fewer functions than asked".into() },
                })?;
                (Arc::new(function), None)
            }
            _ => {
                let config = emu_config(spec, emu);
                let device =
                    EmuDevice::start_in(config, &space).map_err(|source| DeviceError::Emulator { spec: spec.to_string(), source })?;
                (Arc::clone(&device) as Arc<dyn DeviceBackend>, Some(device))
            }
        };
        opened.push(OpenedDevice { spec: spec.clone(), backend, emulator });
    }
    Ok(opened)
}

/// What [`open_in_one_space`] checks before it opens anything, on its own: the kinds, one DMA
/// space, the memory `emu:mem:` devices need, missing or empty files when `create_bytes` is
/// `None`, and one file or PCI function named twice. A command that creates or grows files
/// (a format) calls it first, so that none of these refusals can come after a file was made.
/// The `vfio:` functions' addresses, in order.
pub fn check_one_space(specs: &[DeviceSpec], create_bytes: Option<u64>) -> Result<Vec<PciAddress>, DeviceError> {
    let mut addresses: Vec<PciAddress> = Vec::new();
    for spec in specs {
        match spec {
            DeviceSpec::Vfio(address) => addresses.push(*address),
            DeviceSpec::Uring(_) => {
                let accepted = DeviceKind::list(&[DeviceKind::EmuFile, DeviceKind::EmuMemory, DeviceKind::EmuNull, DeviceKind::Vfio]);
                return Err(DeviceError::NotAccepted { spec: spec.to_string(), accepted });
            }
            DeviceSpec::EmuFile(_) | DeviceSpec::EmuMemory(_) | DeviceSpec::EmuNull(_) => {}
        }
    }
    if !addresses.is_empty() && addresses.len() != specs.len() {
        return Err(DeviceError::MixedSpaces);
    }
    check_memory(specs)?;
    if create_bytes.is_none() {
        for spec in specs {
            if let DeviceSpec::EmuFile(path) = spec {
                check_file(spec, path)?;
            }
        }
    }
    refuse_shared_files(specs)?;
    Ok(addresses)
}

/// The software controller as a KV pool's device runs it (`tutti pool`, `tuttid`): one namespace
/// of `lba_bytes` LBAs, MDTS 8 (1 MiB), and Flush reaching the file with `fdatasync`, so the
/// pool's durability promises hold across host crashes too.
pub fn pool_emu_options(lba_bytes: u32, create_bytes: Option<u64>) -> EmuOptions {
    let mut config = EmuConfig::default().with_namespaces(vec![NamespaceConfig::new(lba_bytes, None)]).with_mdts(8);
    config.sync_file_on_flush = true;
    EmuOptions { config, create_bytes }
}

/// A device of a pool, brought up: its spec and its controller.
pub struct PoolDevice {
    pub spec: DeviceSpec,
    pub controller: Arc<Controller>,
    /// [`OpenedDevice::backing_file`], for [`crate::DeviceLocks::check_opened`].
    pub backing_file: Option<(u64, u64)>,
}

/// Opens `specs` in one DMA space ([`open_in_one_space`]) with [`pool_emu_options`] and brings
/// each controller up, in order: the devices of one KV pool. One at a time is safe although
/// the first one's rings are mapped into the shared space while a later function may still run
/// as a crashed process left it: a `vfio:` function can do no DMA (bus mastering off from
/// open) until its own bring-up saw its controller stop (docs/vfio.md, "Bring-up order").
pub fn open_pool_devices(specs: &[DeviceSpec], lba_bytes: u32, create_bytes: Option<u64>) -> Result<Vec<PoolDevice>, DeviceError> {
    let opened = open_in_one_space(specs, &pool_emu_options(lba_bytes, create_bytes))?;
    let mut devices = Vec::with_capacity(opened.len());
    for device in opened {
        let backing_file = device.backing_file();
        let controller = Controller::init(device.backend, ControllerConfig::default())
            .map_err(|source| DeviceError::BringUp { spec: device.spec.to_string(), source })?;
        devices.push(PoolDevice { spec: device.spec, controller: Arc::new(controller), backing_file });
    }
    Ok(devices)
}

/// A file the software controller is to open as it is: it must exist and, when it is a regular
/// file, hold something (a block device reports length 0 here, and its own size to the
/// controller).
fn check_file(spec: &DeviceSpec, path: &Path) -> Result<(), DeviceError> {
    match std::fs::metadata(path) {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Err(DeviceError::MissingFile { spec: spec.to_string() }),
        Ok(metadata) if metadata.is_file() && metadata.len() == 0 => Err(DeviceError::EmptyFile { spec: spec.to_string() }),
        // Other failures (permissions) are the controller's to report, with the path.
        _ => Ok(()),
    }
}

/// What an `emu:` path names, so that two spellings of one file compare equal.
#[derive(Debug, PartialEq, Eq)]
enum FileIdentity {
    /// A block device: the device itself, whichever node names it.
    BlockDevice { rdev: u64 },
    /// Any other existing file (hard links and every path to it included).
    Inode { dev: u64, ino: u64 },
    /// A file still to be created: its directory, canonical, and its name.
    ToCreate(PathBuf),
}

/// `None` where it cannot be told (a path ending in `..`, a directory that cannot be reached,
/// a file that cannot be looked at): opening it fails on its own, with the path. Block devices
/// are told by `layout`.
fn file_identity(path: &Path, layout: &dyn BlockDeviceLayout) -> Option<FileIdentity> {
    if let Some(rdev) = layout.block_device_number(path) {
        return Some(FileIdentity::BlockDevice { rdev });
    }
    match std::fs::metadata(path) {
        Ok(metadata) => Some(FileIdentity::Inode { dev: metadata.dev(), ino: metadata.ino() }),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => to_create(path),
        Err(_) => None,
    }
}

/// The bytes of a disk that a block device covers: the whole disk, or one partition of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskExtent {
    /// The whole disk's device number (`st_rdev`; the device's own for a whole disk).
    pub disk: u64,
    pub start_bytes: u64,
    pub len_bytes: u64,
}

impl DiskExtent {
    /// Whether the two share a byte of one disk.
    fn overlaps(&self, other: &DiskExtent) -> bool {
        self.disk == other.disk
            && self.start_bytes < other.start_bytes.saturating_add(other.len_bytes)
            && other.start_bytes < self.start_bytes.saturating_add(self.len_bytes)
    }
}

/// What [`refuse_shared_files_with`] asks of the system about block devices, so that tests can
/// answer for the kernel and sysfs.
pub trait BlockDeviceLayout {
    /// The device number of the block device `path` names (following symbolic links); `None`
    /// for anything else, or where it cannot be looked at.
    fn block_device_number(&self, path: &Path) -> Option<u64>;
    /// Where block device `rdev` lies on its disk; `None` where that cannot be told, and then
    /// it is compared with others by device number only.
    fn disk_extent(&self, rdev: u64) -> Option<DiskExtent>;
}

/// Bytes per sector in sysfs's `size` and `start`, whatever the device's own block size.
const SYSFS_SECTOR_BYTES: u64 = 512;

impl BlockDeviceLayout for HostBlockDevices {
    fn block_device_number(&self, path: &Path) -> Option<u64> {
        let metadata = std::fs::metadata(path).ok()?;
        metadata.file_type().is_block_device().then(|| metadata.rdev())
    }

    /// From `/sys/dev/block/MAJ:MIN`: a partition has a `partition` file, `start` and `size`
    /// (512-byte sectors), and is a directory of its disk's, whose `dev` names the disk; a
    /// whole disk covers its `size` from 0.
    fn disk_extent(&self, rdev: u64) -> Option<DiskExtent> {
        let directory = std::fs::canonicalize(format!("/sys/dev/block/{}:{}", nix::libc::major(rdev), nix::libc::minor(rdev))).ok()?;
        let bytes = |name: &str| -> Option<u64> {
            std::fs::read_to_string(directory.join(name)).ok()?.trim().parse::<u64>().ok()?.checked_mul(SYSFS_SECTOR_BYTES)
        };
        let len_bytes = bytes("size")?;
        if !directory.join("partition").exists() {
            return Some(DiskExtent { disk: rdev, start_bytes: 0, len_bytes });
        }
        let disk = parse_device_number(&std::fs::read_to_string(directory.parent()?.join("dev")).ok()?)?;
        Some(DiskExtent { disk, start_bytes: bytes("start")?, len_bytes })
    }
}

/// A sysfs `dev` file's `MAJ:MIN` as a device number.
fn parse_device_number(text: &str) -> Option<u64> {
    let (major, minor) = text.trim().split_once(':')?;
    Some(nix::libc::makedev(major.parse().ok()?, minor.parse().ok()?))
}

/// Most symbolic links followed to find where a file to be created will be: the kernel's own
/// limit (`MAXSYMLINKS`), past which opening it fails with `ELOOP` anyway.
const SYMLINKS_MAX: usize = 40;

/// Where creating `path` (which does not resolve to an existing file) makes the file: the
/// target of a dangling symbolic link, not the link, since opening with `O_CREAT` follows it.
/// Without this, `link.img -> target.img` and `target.img` would look like two files.
fn to_create(path: &Path) -> Option<FileIdentity> {
    let path = creation_path(path)?;
    let name = path.file_name()?;
    Some(FileIdentity::ToCreate(std::fs::canonicalize(parent_directory(&path)).ok()?.join(name)))
}

/// The path of the file that opening `path` with `O_CREAT` would make: `path` itself if
/// nothing is there, the last target of a chain of dangling symbolic links (not canonical) if
/// it is one; `None` if `path` resolves to something that exists, cannot be looked at, or
/// loops ([`SYMLINKS_MAX`]). [`crate::FileUndo`] creates that file itself (`O_EXCL`), so that
/// it knows it made it: the link's own name exists already.
pub(crate) fn creation_path(path: &Path) -> Option<PathBuf> {
    let mut path = path.to_path_buf();
    for _ in 0..=SYMLINKS_MAX {
        match std::fs::symlink_metadata(&path) {
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Some(path),
            // A relative target is relative to the link's directory; an absolute one replaces it.
            Ok(metadata) if metadata.file_type().is_symlink() => path = parent_directory(&path).join(std::fs::read_link(&path).ok()?),
            // Created meanwhile, or cannot be looked at: opening it says what it is.
            _ => return None,
        }
    }
    None
}

/// The directory `path` is in, as given (`.` for a bare name).
fn parent_directory(path: &Path) -> &Path {
    path.parent().filter(|parent| !parent.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// Refuses two specs naming one file ([`DeviceError::DuplicateFile`], naming both): `emu:`
/// files (two software controllers on one file) and `uring:` files (tutti-bench's kernel
/// path), in any mix, block devices among them also when they share bytes of one disk (a whole
/// disk and one of its partitions, two overlapping partitions; told from sysfs, and by device
/// number alone where sysfs cannot be read); and two `vfio:` specs of one PCI function
/// ([`DeviceError::DuplicateFunction`]; addresses compare parsed, so however spelled).
/// [`open_in_one_space`] and [`crate::DeviceLocks::acquire`] check their own sets (the second
/// lock on one file would otherwise be refused as held by another process, the exclusive claim
/// of a disk's partition as in use by another program); a tool that opens its devices one by
/// one calls this first.
pub fn refuse_shared_files(specs: &[DeviceSpec]) -> Result<(), DeviceError> {
    refuse_shared_files_with(specs, &HostBlockDevices)
}

/// [`refuse_shared_files`] with block devices told by `layout`.
pub fn refuse_shared_files_with(specs: &[DeviceSpec], layout: &dyn BlockDeviceLayout) -> Result<(), DeviceError> {
    let functions = specs.iter().filter_map(|spec| match spec {
        DeviceSpec::Vfio(address) => Some((address, spec)),
        _ => None,
    });
    let mut seen_functions: Vec<(&PciAddress, &DeviceSpec)> = Vec::with_capacity(specs.len());
    for (address, spec) in functions {
        if let Some((_, first)) = seen_functions.iter().find(|(earlier, _)| *earlier == address) {
            return Err(DeviceError::DuplicateFunction { first: first.to_string(), second: spec.to_string() });
        }
        seen_functions.push((address, spec));
    }
    let mut seen: Vec<(FileIdentity, Option<DiskExtent>, &DeviceSpec)> = Vec::with_capacity(specs.len());
    for spec in specs {
        let (DeviceSpec::EmuFile(path) | DeviceSpec::Uring(path)) = spec else { continue };
        let Some(identity) = file_identity(path, layout) else { continue };
        let extent = match identity {
            FileIdentity::BlockDevice { rdev } => layout.disk_extent(rdev),
            _ => None,
        };
        for (earlier, earlier_extent, first) in &seen {
            if *earlier == identity {
                return Err(DeviceError::DuplicateFile { first: first.to_string(), second: spec.to_string(), overlap: None });
            }
            // Two device numbers of one disk (the disk and a partition, two partitions): the
            // same sectors unless their ranges are apart. The exclusive claim taken later would
            // refuse the second as in use by "another program".
            if let (Some(a), Some(b)) = (earlier_extent, extent) {
                if a.overlaps(&b) {
                    let (major, minor) = (nix::libc::major(a.disk), nix::libc::minor(a.disk));
                    let overlap = format!(
                        "disk {major}:{minor}, bytes {}..{} and {}..{}",
                        a.start_bytes,
                        a.start_bytes.saturating_add(a.len_bytes),
                        b.start_bytes,
                        b.start_bytes.saturating_add(b.len_bytes)
                    );
                    return Err(DeviceError::DuplicateFile { first: first.to_string(), second: spec.to_string(), overlap: Some(overlap) });
                }
            }
        }
        seen.push((identity, extent, spec));
    }
    Ok(())
}

fn emu_config(spec: &DeviceSpec, emu: &EmuOptions) -> EmuConfig {
    let config = emu.config.clone();
    match spec {
        DeviceSpec::EmuFile(path) => config.with_backing(Backing::File { path: path.clone(), create_bytes: emu.create_bytes }),
        DeviceSpec::EmuMemory(bytes) => config.with_backing(Backing::Memory { bytes: *bytes }),
        DeviceSpec::EmuNull(bytes) => config.with_backing(Backing::Memory { bytes: *bytes }).with_no_storage(true),
        DeviceSpec::Vfio(_) | DeviceSpec::Uring(_) => config,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> DeviceSpec {
        DeviceSpec::parse(text, &DeviceKind::ALL).unwrap()
    }

    #[test]
    fn software_controllers_share_one_dma_space() {
        // Goal: two emu devices opened together reach each other's allocations (one space).
        let directory = tempfile::tempdir().unwrap();
        let file = parse(&format!("emu:{}", directory.path().join("a.img").display()));
        let emu = EmuOptions { create_bytes: Some(8 << 20), ..EmuOptions::default() };
        let opened = open_in_one_space(&[parse("emu:mem:8m"), file], &emu).unwrap();
        assert_eq!(opened.len(), 2);
        assert!(opened.iter().all(|device| device.emulator.is_some()));
        assert_eq!(opened[0].backend.dma().address_space(), opened[1].backend.dma().address_space());
        assert_eq!(std::fs::metadata(directory.path().join("a.img")).unwrap().len(), 8 << 20);
    }

    #[test]
    fn mixed_spaces_io_uring_and_missing_files_are_refused() {
        let emu = EmuOptions::default();
        let mixed = open_in_one_space(&[parse("emu:mem:8m"), parse("vfio:0000:00:04.0")], &emu).err().unwrap();
        assert!(matches!(mixed, DeviceError::MixedSpaces), "{mixed}");
        let uring = open_in_one_space(&[parse("uring:/dev/null")], &emu).err().unwrap().to_string();
        assert!(uring.contains("uring:/dev/null cannot be used here"), "{uring}");
        let missing = open_in_one_space(&[parse("emu:/nonexistent/dir/x.img")], &emu).err().unwrap().to_string();
        assert_eq!(
            missing,
            "emu:/nonexistent/dir/x.img: no such file (nothing to open; give a size to create one where the tool offers it)"
        );
        let directory = tempfile::tempdir().unwrap();
        let empty = directory.path().join("empty.img");
        std::fs::write(&empty, b"").unwrap();
        let error = open_in_one_space(&[parse(&format!("emu:{}", empty.display()))], &emu).err().unwrap().to_string();
        assert!(error.ends_with("the file is empty (0 bytes), so it holds no namespace (was it truncated?)"), "{error}");
        // With a size to create, a missing file is made, in a directory that exists.
        let creating = EmuOptions { create_bytes: Some(1 << 20), ..EmuOptions::default() };
        let error = open_in_one_space(&[parse("emu:/nonexistent/dir/x.img")], &creating).err().unwrap().to_string();
        assert!(error.starts_with("emu:/nonexistent/dir/x.img: cannot start the software NVMe controller"), "{error}");
    }

    #[test]
    fn one_file_named_twice_is_refused_before_anything_is_opened() {
        // Goal: two emu: specs of one file, however spelled (twice the same, through `.` or
        // `dir/..`, a hard link; for a file to be created, its directory spelled two ways), would
        // run two controllers over one file, and a pool striped over them would overwrite itself:
        // refused, naming both, before a controller starts or a file is created.
        let directory = tempfile::tempdir().unwrap();
        let dir = directory.path().display().to_string();
        std::fs::create_dir(directory.path().join("sub")).unwrap();
        std::fs::File::create(directory.path().join("p.img")).unwrap().set_len(8 << 20).unwrap();
        std::fs::hard_link(directory.path().join("p.img"), directory.path().join("link.img")).unwrap();
        let existing = EmuOptions::default();
        for (first, second) in [
            (format!("emu:{dir}/p.img"), format!("emu:{dir}/p.img")),
            (format!("emu:{dir}/p.img"), format!("emu:{dir}/./p.img")),
            (format!("emu:{dir}/p.img"), format!("emu:{dir}/sub/../p.img")),
            (format!("emu:{dir}/p.img"), format!("emu:{dir}/link.img")),
        ] {
            let specs = [parse(&first), parse("emu:mem:8m"), parse(&second)];
            let error = open_in_one_space(&specs, &existing).err().unwrap();
            assert!(matches!(error, DeviceError::DuplicateFile { .. }), "{first} {second}: {error}");
            assert!(error.to_string().starts_with(&format!("{first} and {second} name the same file")), "{error}");
        }
        let creating = EmuOptions { create_bytes: Some(8 << 20), ..EmuOptions::default() };
        let specs = [parse(&format!("emu:{dir}/q.img")), parse(&format!("emu:{dir}/sub/../q.img"))];
        let error = open_in_one_space(&specs, &creating).err().unwrap();
        assert!(matches!(error, DeviceError::DuplicateFile { .. }), "{error}");
        assert!(!directory.path().join("q.img").exists(), "refused before the file was created");
        // A relative file to be created, with and without `./`, is one file too.
        let missing = std::path::Path::new("tutti-devices-test-no-such-file.img");
        let identity = |path: &std::path::Path| file_identity(path, &HostBlockDevices);
        assert!(identity(missing).is_some() && identity(missing) == identity(&std::path::Path::new(".").join(missing)));
        // uring: files count too (tutti-bench's kernel path), also mixed with emu: ones.
        let kernel = parse(&format!("uring:{dir}/p.img"));
        assert!(matches!(
            refuse_shared_files(&[parse(&format!("emu:{dir}/link.img")), kernel.clone()]),
            Err(DeviceError::DuplicateFile { .. })
        ));
        assert!(matches!(refuse_shared_files(&[kernel.clone(), kernel.clone()]), Err(DeviceError::DuplicateFile { .. })));
        assert!(refuse_shared_files(&[kernel, parse(&format!("uring:{dir}/sub/r.img"))]).is_ok());
        // Different files, and a file beside a memory device, open.
        let specs = [parse(&format!("emu:{dir}/p.img")), parse(&format!("emu:{dir}/sub/r.img")), parse("emu:mem:8m")];
        assert_eq!(open_in_one_space(&specs, &creating).unwrap().len(), 3);
    }

    #[test]
    fn a_dangling_symlink_and_its_target_to_be_created_are_one_file() {
        // Goal: creating through a dangling symlink creates its target, so link.img ->
        // target.img and target.img (neither existing yet) are one file: refused, however the
        // link is written (absolute, relative, through a second link), before anything is made.
        let directory = tempfile::tempdir().unwrap();
        let dir = directory.path().display().to_string();
        std::fs::create_dir(directory.path().join("sub")).unwrap();
        std::os::unix::fs::symlink(directory.path().join("target.img"), directory.path().join("link.img")).unwrap();
        std::os::unix::fs::symlink("../target.img", directory.path().join("sub/relative.img")).unwrap();
        std::os::unix::fs::symlink("link.img", directory.path().join("chain.img")).unwrap();
        let creating = EmuOptions { create_bytes: Some(8 << 20), ..EmuOptions::default() };
        for link in ["link.img", "sub/relative.img", "chain.img"] {
            let specs = [parse(&format!("emu:{dir}/{link}")), parse(&format!("emu:{dir}/target.img"))];
            let error = open_in_one_space(&specs, &creating).err().unwrap();
            assert!(matches!(error, DeviceError::DuplicateFile { .. }), "{link}: {error}");
            assert!(!directory.path().join("target.img").exists(), "{link}: refused before the file was created");
        }
        // A symlink loop cannot be told apart (opening it fails on its own); it is not a panic.
        std::os::unix::fs::symlink("loop.img", directory.path().join("loop.img")).unwrap();
        assert_eq!(file_identity(&directory.path().join("loop.img"), &HostBlockDevices), None);
        // A dangling link to a different file is a different file.
        let specs = [parse(&format!("emu:{dir}/link.img")), parse(&format!("emu:{dir}/other.img"))];
        assert_eq!(open_in_one_space(&specs, &creating).unwrap().len(), 2);
        assert!(directory.path().join("target.img").exists(), "created through the link");
    }

    /// Answers for the kernel and sysfs: each path is a block device with a device number and,
    /// unless `None` (sysfs unreadable), a place on its disk.
    struct FakeLayout(Vec<(&'static str, u64, Option<DiskExtent>)>);

    impl BlockDeviceLayout for FakeLayout {
        fn block_device_number(&self, path: &Path) -> Option<u64> {
            self.0.iter().find(|(name, ..)| Path::new(name) == path).map(|(_, rdev, _)| *rdev)
        }

        fn disk_extent(&self, rdev: u64) -> Option<DiskExtent> {
            self.0.iter().find(|(_, number, _)| *number == rdev).and_then(|(.., extent)| *extent)
        }
    }

    #[test]
    fn a_disk_and_its_partition_or_overlapping_partitions_are_refused_naming_both() {
        // Goal: two block devices sharing bytes of one disk (a whole disk and one of its
        // partitions, two overlapping partitions) are two software controllers over the same
        // sectors: refused before anything is claimed, naming both specs (the exclusive claim
        // would otherwise blame "another program"). Partitions that do not overlap, or the same
        // range on two disks, are distinct; where sysfs cannot say, device numbers decide.
        const MIB: u64 = 1 << 20;
        let disk = nix::libc::makedev(259, 0);
        let other_disk = nix::libc::makedev(259, 4);
        let extent = |disk, start_bytes, len_bytes| Some(DiskExtent { disk, start_bytes, len_bytes });
        let layout = FakeLayout(vec![
            ("/dev/nvme0n1", disk, extent(disk, 0, 1024 * MIB)),
            ("/dev/nvme0n1p1", nix::libc::makedev(259, 1), extent(disk, MIB, 500 * MIB)),
            ("/dev/nvme0n1p2", nix::libc::makedev(259, 2), extent(disk, 501 * MIB, 500 * MIB)),
            ("/dev/nvme0n1p3", nix::libc::makedev(259, 3), extent(disk, 400 * MIB, 200 * MIB)),
            ("/dev/nvme1n1p1", nix::libc::makedev(259, 5), extent(other_disk, MIB, 500 * MIB)),
            ("/dev/unknown", nix::libc::makedev(8, 0), None),
            ("/dev/unknown-part", nix::libc::makedev(8, 1), None),
        ]);
        for (first, second) in [
            ("emu:/dev/nvme0n1", "emu:/dev/nvme0n1p1"),
            ("emu:/dev/nvme0n1p2", "emu:/dev/nvme0n1"),
            ("emu:/dev/nvme0n1p1", "uring:/dev/nvme0n1p3"),
            ("emu:/dev/nvme0n1p3", "emu:/dev/nvme0n1p2"),
        ] {
            let specs = [parse(first), parse("emu:mem:8m"), parse(second)];
            let error = refuse_shared_files_with(&specs, &layout).unwrap_err();
            assert!(matches!(&error, DeviceError::DuplicateFile { first: a, second: b, .. } if a == first && b == second), "{error}");
            let message = error.to_string();
            assert!(message.starts_with(&format!("{first} and {second} overlap on one disk")), "{message}");
        }
        for (first, second) in [
            ("emu:/dev/nvme0n1p1", "emu:/dev/nvme0n1p2"),
            ("emu:/dev/nvme0n1p1", "emu:/dev/nvme1n1p1"),
            ("emu:/dev/unknown", "emu:/dev/unknown-part"),
        ] {
            assert!(refuse_shared_files_with(&[parse(first), parse(second)], &layout).is_ok(), "{first} {second}");
        }
        // One device twice is still the same file, with or without sysfs.
        for spec in ["emu:/dev/nvme0n1p1", "emu:/dev/unknown"] {
            let error = refuse_shared_files_with(&[parse(spec), parse(spec)], &layout).unwrap_err().to_string();
            assert!(error.starts_with(&format!("{spec} and {spec} name the same file")), "{error}");
        }
    }

    #[test]
    fn sysfs_places_this_hosts_block_devices_on_their_disks() {
        // Goal: the host's answer read from /sys/dev/block: a whole disk is its own disk from
        // byte 0, a partition lies within its parent disk. Checks what this host has (nothing
        // where sysfs shows no block devices); the device number parse on its own.
        assert_eq!(parse_device_number("259:3\n"), Some(nix::libc::makedev(259, 3)));
        assert_eq!(parse_device_number("259"), None);
        assert_eq!(parse_device_number("a:b"), None);
        let Ok(entries) = std::fs::read_dir("/sys/dev/block") else { return };
        for entry in entries.flatten() {
            let Some(rdev) = entry.file_name().to_str().and_then(parse_device_number) else { continue };
            let Some(extent) = HostBlockDevices.disk_extent(rdev) else { continue };
            if extent.disk == rdev {
                assert_eq!(extent.start_bytes, 0, "{entry:?}");
            } else {
                // A disk removed while this walks (a loop device detached) is skipped; a
                // partition past its disk's end is possible (the kernel does not rescan the
                // table of a disk that shrank), so only the placement is checked.
                let Some(disk) = HostBlockDevices.disk_extent(extent.disk) else { continue };
                assert_eq!(disk.disk, extent.disk, "{entry:?}");
                assert_eq!(disk.start_bytes, 0, "{entry:?}: its disk {disk:?}");
            }
        }
    }

    #[test]
    fn a_memory_device_beyond_this_machine_is_refused_before_allocating() {
        // Goal: emu:mem:1P cannot be held anywhere: a typed error, not an abort.
        let error = open_in_one_space(&[parse("emu:mem:1024T")], &EmuOptions::default()).err().unwrap();
        assert!(matches!(error, DeviceError::NotEnoughMemory { .. } | DeviceError::Emulator { .. }), "{error}");
    }
}
