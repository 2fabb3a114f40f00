//! Opening the daemon's devices and pool from device strings: lock every device (one daemon
//! per pool), open them in one DMA space (`tutti_devices::open_in_one_space`), bring up each
//! controller, format the pool if asked (refusing devices that hold something else unless told
//! to overwrite them: `emu:` files and block devices read before anything is opened, `vfio:`
//! SSDs through their controllers once up, before anything is written, as `tutti pool format`
//! does), then open it (recovery happens there).
//!
//! Software controllers run inside the daemon with their register page in a memfd (so each
//! client rings its own doorbells; with `emu_doorbell_relay`, without it: clients' doorbells then
//! go through the daemon's relay, as on a VFIO device) and with `client_queue_pairs + 2` I/O
//! queue pairs: one per client (each client gets one pair per pool device, and each software
//! controller is one device; a session attaches once, however many windows it registers:
//! `crate::session::Holdings::attach`), one the pool keeps for its metadata (header writes,
//! flushes: the control half runs with `NoLender`, objstore's StoreControl docs), and one spare
//! for a temporary metadata pair should the pool's own be lost.

use std::path::PathBuf;

/// I/O queue pairs of each software controller that are the pool's, not a client's: its
/// metadata pair and a spare (module docs); a client's attach never takes them
/// (`crate::session::Holdings::attach`).
pub const POOL_QUEUE_PAIRS_RESERVED: u16 = 2;

/// The I/O queue pairs of each controller that no client's attach may take: the pool's
/// ([`POOL_QUEUE_PAIRS_RESERVED`]) and, on a cluster node, the data plane's staging pair (which
/// tuttid counts in `client_queue_pairs`, started one over `--clients-max`).
pub fn queue_pairs_reserved(cluster_node: bool) -> u16 {
    POOL_QUEUE_PAIRS_RESERVED + u16::from(cluster_node)
}
use std::sync::Arc;

use nvme_driver::{Controller, ControllerConfig, NamespaceId};
use nvme_emu::EmuDevice;
use objstore::{format_pool, FormatParams, Pool, PoolTarget, RecoveryReport};
use tutti_devices::open::pool_emu_options;
use tutti_devices::{open_in_one_space, DeviceSpec, FileUndo};

use crate::lock::DeviceLocks;
use crate::protocol::DeviceStatus;
use crate::DaemonError;

/// What to open.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub specs: Vec<DeviceSpec>,
    /// Namespace id on every device.
    pub namespace: u32,
    /// LBA size of a software controller's namespace.
    pub emu_lba_bytes: u32,
    /// With `format`: create (or grow) `emu:PATH` files to this size. Without it, ignored: an
    /// existing pool's size is fixed by its superblock, so no file is created or grown (a
    /// missing one is refused as missing).
    pub emu_create_bytes: Option<u64>,
    /// Format a fresh pool before opening (`emu:mem:` needs it at every start).
    pub format: Option<FormatParams>,
    /// With `format`: format devices that hold something other than a tutti pool (a file
    /// system, a partition table, stray bytes; a `vfio:` SSD or block device that does not start
    /// with a tutti superblock), which are refused otherwise ([`tutti_devices::contents`]; a
    /// tutti pool is reformatted either way).
    pub overwrite: bool,
    /// Where `vfio:` devices' lock files live.
    pub lock_dir: PathBuf,
    /// Client queue pairs each software controller must be able to create (one per client).
    pub client_queue_pairs: u16,
    /// Run software controllers without a shared register page, so clients ring their
    /// doorbells through the daemon's relay (`crate::relay`), the VFIO path: for tests of it
    /// without VFIO. Off by default.
    pub emu_doorbell_relay: bool,
}

/// The open pool with what keeps it ours. Fields drop in order: the pool (its controllers, the
/// software controllers' threads) before the locks.
pub struct OpenedPool {
    pub pool: Pool,
    /// Per pool device, in the pool's order (its superblocks' device indexes, not necessarily
    /// the order the devices were given in), what status reports of it.
    pub devices: Vec<DeviceStatus>,
    pub report: RecoveryReport,
    /// Per pool device, in the pool's order as `devices`, the software controller running it
    /// (`None` for VFIO): its register page and per-queue restrictions serve the clients' queue
    /// pairs on that device.
    pub emulators: Vec<Option<Arc<EmuDevice>>>,
    /// The longest the controllers wait for an admin command (`ControllerConfig::admin_timeout`):
    /// what bounds the drain's wait for unconfirmed deletions (`crate::server`).
    pub admin_timeout: std::time::Duration,
    pub locks: DeviceLocks,
}

#[cfg(test)]
thread_local! {
    /// The admin timeout of the controllers `open_pool` brings up on this thread (the server's
    /// tests of a late admin completion); `None`: the default.
    pub(crate) static TEST_ADMIN_TIMEOUT: std::cell::Cell<Option<std::time::Duration>> = const { std::cell::Cell::new(None) };
}

pub fn open_pool(options: &PoolOptions) -> Result<OpenedPool, DaemonError> {
    // Only a format creates or grows a file: opening a file that holds no pool (a mistyped path)
    // must leave it as it was.
    let create_bytes = options.emu_create_bytes.filter(|_| options.format.is_some());
    // What opening the devices refuses on its own (kinds, one DMA space, one file named twice)
    // is refused before anything is locked, created or grown.
    tutti_devices::check_one_space(&options.specs, create_bytes)?;
    #[cfg(test)]
    tests::BEFORE_LOCKING.with(|hook| hook.take().map(|hook| hook()));
    // Existing files are locked and read first, the ones a format is to create only once
    // nothing refused (as `tutti pool format` orders it): a refusal leaves no file behind.
    let mut locks = DeviceLocks::acquire(&options.specs, &options.lock_dir, false)?;
    refuse_foreign_files(options, &options.specs, &locks)?;
    let missing: Vec<DeviceSpec> = options
        .specs
        .iter()
        .filter(|spec| matches!(spec, DeviceSpec::EmuFile(path) if !locks.paths().any(|held| held == path)))
        .cloned()
        .collect();
    if let (Some(params), Some(bytes)) = (&options.format, create_bytes) {
        // A format its parameters refuse for the files it would create or grow is refused
        // before one is made or grown: each `emu:` regular file as the software controller will
        // find it (the larger of its size and the size asked for, in whole LBAs). A block device
        // keeps its own size, which the format plans on once it is open.
        let lba_bytes = u64::from(options.emu_lba_bytes.max(1));
        for spec in &options.specs {
            let DeviceSpec::EmuFile(path) = spec else { continue };
            let size_bytes = match std::fs::metadata(path) {
                Ok(metadata) if metadata.is_file() => metadata.len().max(bytes),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => bytes,
                _ => continue,
            };
            objstore::check_format(params, options.emu_lba_bytes, size_bytes / lba_bytes, options.specs.len())
                .map_err(|source| DaemonError::Pool { context: "formatting the pool".into(), source })?;
        }
    }
    // The files a format creates and grows, put back as they were if it is refused before
    // anything is written. Declared after the locks, so dropped before them: it undoes the
    // files while they are still held.
    let mut undo: Option<FileUndo> = None;
    if create_bytes.is_some() {
        // Made here with O_EXCL (so the undo knows which it made) and locked at once; the
        // existing (held) files' sizes recorded.
        let mut made = FileUndo::create_missing(&options.specs, locks.paths());
        #[cfg(test)]
        tests::BEFORE_CREATING_FILES.with(|hook| hook.take().map(|hook| hook()));
        if !missing.is_empty() {
            // Only the missing files are locked now (those made here: the lock taken when they
            // were made, lent by the undo to this call alone, and kept by the undo whatever
            // happens here: no other opener, on another thread either, can take it); the locks
            // and claims on the existing ones stay held throughout (letting go to take the
            // whole set again would let another starter in between, and two racing starters
            // would both be refused as in use).
            let created = made.lending_locks(|| DeviceLocks::acquire(&missing, &options.lock_dir, true))?;
            // A file another process made or wrote since the first look is read as the others
            // were; one refused is left as that process wrote it (its mode too: narrowing
            // waits for the pool to open).
            for spec in &missing {
                if let Err(error) = refuse_foreign_files(options, std::slice::from_ref(spec), &created) {
                    if let DeviceSpec::EmuFile(path) = spec {
                        made.forget(path);
                    }
                    // Undone while the files are still locked.
                    drop(made);
                    drop(created);
                    return Err(error);
                }
            }
            locks.extend(created);
        }
        undo = Some(made);
    }
    let mut emu = pool_emu_options(options.emu_lba_bytes, create_bytes);
    emu.config = emu
        .config
        .with_shared_registers(!options.emu_doorbell_relay)
        .with_io_queue_pairs_max(options.client_queue_pairs.saturating_add(POOL_QUEUE_PAIRS_RESERVED));
    #[cfg(test)]
    tests::BEFORE_OPENING.with(|hook| hook.take().map(|hook| hook()));
    let opened = open_in_one_space(&options.specs, &emu)?;
    // The controllers opened the files by path again: each must be the file locked above (one
    // missing then and put there since is refused too: nothing locked it).
    for device in &opened {
        locks.check_opened(&device.spec, device.backing_file())?;
    }
    let mut targets = Vec::with_capacity(opened.len());
    let mut devices = Vec::with_capacity(opened.len());
    let mut emulators = Vec::with_capacity(opened.len());
    #[allow(unused_mut)] // changed only by the test hook
    let mut controller_config = ControllerConfig::default();
    #[cfg(test)]
    if let Some(admin_timeout) = TEST_ADMIN_TIMEOUT.with(std::cell::Cell::get) {
        controller_config.admin_timeout = admin_timeout;
    }
    for device in opened {
        let controller = Controller::init(device.backend, controller_config.clone())
            .map_err(|source| DaemonError::Controller { spec: device.spec.to_string(), source })?;
        devices.push(DeviceStatus { spec: device.spec.to_string(), description: device.spec.describe(), refused_commands: 0 });
        targets.push(PoolTarget { controller: Arc::new(controller), namespace: NamespaceId(options.namespace) });
        emulators.push(device.emulator);
    }
    if let Some(params) = &options.format {
        // What a vfio: SSD holds can only be read through its controller, now that it is up;
        // emu: devices were read before anything was created or grown.
        let formatted = format_targets(&options.specs, &targets, params, options.overwrite, |spec| matches!(spec, DeviceSpec::Vfio(_)));
        // The format plans every device before it writes any: a refusal of its plan wrote
        // nothing, and the files are put back; anything else keeps them.
        if !matches!(&formatted, Err(DaemonError::Pool { source, .. }) if plan_refusal(source)) {
            if let Some(undo) = undo.take() {
                undo.keep();
            }
        }
        formatted?;
    }
    let controllers: Vec<Arc<Controller>> = targets.iter().map(|target| target.controller.clone()).collect();
    let (pool, report) = Pool::open(targets, None).map_err(|source| DaemonError::Pool {
        // A pool of another LBA size is a pool still: the --format hint would destroy it.
        context: match source {
            objstore::ObjstoreError::LbaSizeMismatch { .. } => {
                "opening the pool (formatted with another LBA size than its namespace has now: a namespace reformatted \
                 with another LBA format, or a software controller run with another LBA size)"
            }
            _ => "opening the pool (a device that holds none: start with --format, or run `tutti pool format`)",
        }
        .into(),
        source,
    })?;
    // The pool orders its devices by the index each superblock records, whatever order the
    // command line gave them in (device names such as /dev/nvmeXn1 change across boots); the
    // per-device state the clients' attaches and the status index by pool device must follow.
    let order = pool_order(&controllers, pool.device_count(), |device| &pool.target(device).controller)?;
    drop(controllers);
    let devices = reorder(devices, &order);
    let emulators = reorder(emulators, &order);
    // Open: the files stay as the pool found them (a grown file without --format included).
    if let Some(undo) = undo.take() {
        undo.keep();
    }
    // Known to be the pool now: a pool file of this user's that others could open is made its
    // owner's only (logged). Not before: a start refused on the way here (a file system on the
    // device, a file that holds no pool) must leave every mode as it was.
    // (Refused here, the pool is dropped before the locks, as on any error.)
    // A --format start's error then says the pool was formatted (and is kept).
    locks.narrow_pool_files(if options.format.is_some() { &options.specs } else { &[] })?;
    Ok(OpenedPool { pool, devices, report, emulators, admin_timeout: controller_config.admin_timeout, locks })
}

/// Whether `format_pool` refused its plan (before writing anything).
fn plan_refusal(error: &objstore::ObjstoreError) -> bool {
    use objstore::ObjstoreError;
    matches!(error, ObjstoreError::NamespaceTooSmall { .. } | ObjstoreError::InvalidGeometry { .. } | ObjstoreError::InvalidFormat { .. })
}

/// For each of the pool's `pool_devices` in turn, the position among `given` (the controllers in
/// command-line order) of the controller `pool_target` names for it; an error if the pool's
/// targets are not exactly the given controllers, each once (then no per-device state could be
/// matched up).
fn pool_order<'a>(
    given: &[Arc<Controller>],
    pool_devices: usize,
    pool_target: impl Fn(usize) -> &'a Arc<Controller>,
) -> Result<Vec<usize>, DaemonError> {
    let mismatch = |device: usize, reason: String| DaemonError::Pool {
        context: format!("matching pool device {device} to a given device"),
        source: objstore::ObjstoreError::PoolMembership { device, reason },
    };
    if pool_devices != given.len() {
        return Err(mismatch(0, format!("the pool has {pool_devices} devices, {} were given", given.len())));
    }
    let mut order = Vec::with_capacity(given.len());
    for device in 0..pool_devices {
        let controller = pool_target(device);
        let position = given.iter().position(|candidate| Arc::ptr_eq(candidate, controller));
        match position {
            Some(position) if !order.contains(&position) => order.push(position),
            _ => return Err(mismatch(device, "its controller is none of the given devices', or one already matched".into())),
        }
    }
    Ok(order)
}

/// `items` (in command-line order) put in pool order: entry `i` is `items[order[i]]`.
fn reorder<T>(items: Vec<T>, order: &[usize]) -> Vec<T> {
    let mut items: Vec<Option<T>> = items.into_iter().map(Some).collect();
    order.iter().filter_map(|&position| items.get_mut(position).and_then(Option::take)).collect()
}

/// With `format` and without `overwrite`, refuses an `emu:` device of `specs` that holds something other
/// than a tutti pool (tutti-devices' `refuse_foreign_contents`), reading block devices through
/// the claims in `locks`: before a file is created or grown or a controller writes anything. A
/// read that fails (EIO) is I/O that failed, not what was given (`lock::daemon_error`).
fn refuse_foreign_files(options: &PoolOptions, specs: &[DeviceSpec], locks: &DeviceLocks) -> Result<(), DaemonError> {
    if options.format.is_some() && !options.overwrite {
        tutti_devices::refuse_foreign_contents(specs, locks.claims()).map_err(crate::lock::daemon_error)?;
    }
    Ok(())
}

/// Formats a pool on `targets` (one per spec of `specs`, in order), first refusing, unless
/// `overwrite`, any of the devices `read_through_controller` picks (the `vfio:` ones) whose
/// namespace holds something other than a tutti pool: nothing is written then.
fn format_targets(
    specs: &[DeviceSpec],
    targets: &[PoolTarget],
    params: &FormatParams,
    overwrite: bool,
    read_through_controller: fn(&DeviceSpec) -> bool,
) -> Result<(), DaemonError> {
    if !overwrite {
        let read = specs.iter().zip(targets).filter(|(spec, _)| read_through_controller(spec));
        tutti_devices::refuse_foreign_namespaces(read).map_err(DaemonError::Devices)?;
    }
    format_pool(targets, params).map_err(|source| DaemonError::Pool { context: "formatting the pool".into(), source })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};
    use std::rc::Rc;

    use objstore::ModelGeometry;
    use tutti_devices::DeviceError;

    use super::*;

    /// Options that format `specs` (emu: files, made `create_bytes` long where missing) for
    /// `geometry`, k = 1, locked in `directory`/locks.
    fn formatting(directory: &std::path::Path, specs: Vec<DeviceSpec>, geometry: ModelGeometry, create_bytes: u64) -> PoolOptions {
        PoolOptions {
            specs,
            namespace: 1,
            emu_lba_bytes: 4096,
            emu_create_bytes: Some(create_bytes),
            format: Some(FormatParams::new(geometry)),
            overwrite: false,
            lock_dir: directory.join("locks"),
            client_queue_pairs: 1,
            emu_doorbell_relay: false,
        }
    }

    thread_local! {
        /// Run by open_pool (on the test's thread) just before it locks the files a format is
        /// to create: a test looks at what is held at that moment.
        pub(super) static BEFORE_CREATING_FILES: RefCell<Option<Box<dyn FnOnce()>>> = RefCell::new(None);
        /// Run by open_pool (on the test's thread) once the devices were checked, before they
        /// are locked.
        pub(super) static BEFORE_LOCKING: RefCell<Option<Box<dyn FnOnce()>>> = RefCell::new(None);
        /// Run by open_pool (on the test's thread) between taking the locks and opening the
        /// devices by their paths.
        pub(super) static BEFORE_OPENING: RefCell<Option<Box<dyn FnOnce()>>> = RefCell::new(None);
    }

    #[test]
    fn a_file_put_at_its_path_after_the_locks_were_taken_is_refused() {
        // Goal: without --format a missing emu: file is not locked (nothing to lock) and one put
        // at its path before the controller opens it was served unlocked (a second tuttid could
        // serve it too); a file renamed and copied over a locked one was served likewise. Both
        // are refused (status 2), naming the path, before anything is read or written.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("p.img");
        let options = PoolOptions {
            specs: vec![DeviceSpec::EmuFile(path.clone())],
            namespace: 1,
            emu_lba_bytes: 4096,
            emu_create_bytes: None,
            format: None,
            overwrite: false,
            lock_dir: directory.path().join("locks"),
            client_queue_pairs: 1,
            emu_doorbell_relay: false,
        };
        let refused = |error: DaemonError| {
            assert!(
                matches!(&error, DaemonError::Devices(DeviceError::ReplacedWhileOpening { path: named, .. }) if *named == path),
                "{error}"
            )
        };
        // There when the devices are checked, gone when they are locked, back when opened.
        std::fs::write(&path, vec![0u8; 8 << 20]).unwrap();
        let gone = path.clone();
        BEFORE_LOCKING.with(|hook| *hook.borrow_mut() = Some(Box::new(move || std::fs::remove_file(&gone).unwrap())));
        let (late, zeros) = (path.clone(), vec![0u8; 8 << 20]);
        BEFORE_OPENING.with(|hook| *hook.borrow_mut() = Some(Box::new(move || std::fs::write(&late, &zeros).unwrap())));
        refused(open_pool(&options).err().expect("a file that appeared after the locks was opened"));
        let (replaced, moved) = (path.clone(), directory.path().join("moved.img"));
        BEFORE_OPENING.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move || {
                std::fs::rename(&replaced, &moved).unwrap();
                std::fs::copy(&moved, &replaced).unwrap();
            }))
        });
        refused(open_pool(&options).err().expect("a file renamed over the locked one was opened"));
    }

    #[test]
    fn the_existing_files_stay_locked_while_missing_ones_are_created() {
        // Goal: a format that creates a missing emu: file keeps the locks (and block-device
        // claims) it took on the existing files to the end: no moment in which another tuttid
        // or `tutti pool` can take one (two starters racing both failed as in use, each having
        // let go of what the other then found held). Just before the missing file is locked,
        // another locker of the existing file must be refused as in use.
        let directory = tempfile::tempdir().unwrap();
        let existing = directory.path().join("existing.img");
        std::fs::write(&existing, b"").unwrap();
        let missing = directory.path().join("new.img");
        let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let options = formatting(
            directory.path(),
            vec![DeviceSpec::EmuFile(existing.clone()), DeviceSpec::EmuFile(missing.clone())],
            geometry,
            64 << 20,
        );
        let refused_meanwhile: Rc<Cell<Option<bool>>> = Rc::default();
        let (seen, spec, lock_dir) = (refused_meanwhile.clone(), options.specs[0].clone(), options.lock_dir.clone());
        BEFORE_CREATING_FILES.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move || {
                let other = tutti_devices::DeviceLocks::acquire(&[spec], &lock_dir, false);
                seen.set(Some(matches!(other, Err(DeviceError::DeviceInUse { .. }))));
            }))
        });
        let opened = open_pool(&options).expect("format and open");
        assert_eq!(refused_meanwhile.get(), Some(true), "the existing file's lock was let go while the missing file was created");
        let held: Vec<&std::path::Path> = opened.locks.paths().collect();
        assert!(held.contains(&existing.as_path()) && held.contains(&missing.as_path()), "{held:?}");
    }

    #[test]
    fn a_file_another_process_writes_once_it_was_created_is_refused_and_left_as_it_is() {
        // Goal: a missing emu: file that a format creates and another process then writes (a
        // file system, before the format reads it) is refused as foreign and left exactly as
        // the other process wrote it; the undo used to remove it (it was "made here").
        let directory = tempfile::tempdir().unwrap();
        let missing = directory.path().join("new.img");
        let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let options = formatting(directory.path(), vec![DeviceSpec::EmuFile(missing.clone())], geometry, 64 << 20);
        let mut bytes = vec![0u8; 8 << 20];
        bytes[1080..1082].copy_from_slice(&[0x53, 0xef]);
        let (path, written) = (missing.clone(), bytes.clone());
        BEFORE_CREATING_FILES.with(|hook| *hook.borrow_mut() = Some(Box::new(move || std::fs::write(&path, &written).unwrap())));
        let error = open_pool(&options).err().expect("the file system is refused");
        assert!(matches!(error, DaemonError::Devices(DeviceError::ForeignContents { .. })), "{error}");
        assert!(std::fs::read(&missing).map(|read| read == bytes).unwrap_or(false), "the other process's file was removed or changed");
    }

    #[test]
    fn a_format_its_parameters_refuse_creates_no_file() {
        // Goal: a --format with --emu-create-bytes whose parameters cannot format the file it
        // would create (objects not a whole number of LBAs; a file too small for one slot) is
        // refused before the file is made, as the format itself would refuse it: a refused
        // start leaves nothing behind. Before, the file was created and then the format refused.
        let directory = tempfile::tempdir().unwrap();
        let missing = directory.path().join("new.img");
        let small = ModelGeometry { layers: 2, kv_heads: 1, head_dim: 64, dtype_bytes: 2, block_tokens: 8 };
        let fitting = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        for (geometry, create_bytes, expected) in
            [(small, 64 << 20, "not a whole number of 4096-byte LBAs"), (fitting, 64 << 10, "too small")]
        {
            let options = formatting(directory.path(), vec![DeviceSpec::EmuFile(missing.clone())], geometry, create_bytes);
            let error = open_pool(&options).err().expect("the format is refused");
            assert!(error.to_string().contains(expected), "{error}");
            assert!(!missing.exists(), "the refused format created {}: {error}", missing.display());
        }
    }

    #[test]
    fn a_namespace_holding_a_file_system_is_not_formatted_unless_overwrite() {
        // Goal: open_pool's format step reads what a vfio: SSD holds through its controller and
        // refuses a file system (an emu:-file-backed controller read the same way stands in for
        // the SSD: no VFIO here), writing nothing; with overwrite it formats.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("ssd.img");
        let mut bytes = vec![0u8; 16 << 20];
        bytes[1080..1082].copy_from_slice(&[0x53, 0xef]);
        std::fs::write(&path, &bytes).unwrap();
        let specs = [DeviceSpec::EmuFile(path.clone())];
        let targets: Vec<PoolTarget> = tutti_devices::open_pool_devices(&specs, 4096, None)
            .unwrap()
            .into_iter()
            .map(|device| PoolTarget { controller: device.controller, namespace: NamespaceId(1) })
            .collect();
        let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let params = FormatParams::new(geometry);
        let error = format_targets(&specs, &targets, &params, false, |_| true).unwrap_err();
        assert!(matches!(error, DaemonError::Devices(DeviceError::ForeignContents { .. })), "{error}");
        assert!(error.to_string().contains("an ext2/3/4 file system"), "{error}");
        assert!(std::fs::read(&path).unwrap() == bytes, "the refused format wrote to the device");
        format_targets(&specs, &targets, &params, true, |_| true).expect("overwrite formats it");
        drop(targets);
        assert!(std::fs::read(&path).unwrap().starts_with(&objstore::format::MAGIC), "formatted");
    }

    /// Calls `path` a block device whose claimed descriptor fails every read with EIO
    /// (`/proc/self/mem` at offset 0, unmapped), as a failing disk's would.
    struct UnreadableDisk {
        path: std::path::PathBuf,
    }

    impl tutti_devices::BlockDeviceOpener for UnreadableDisk {
        fn is_block_device(&self, path: &std::path::Path) -> bool {
            path == self.path
        }

        fn open_exclusive(&self, _path: &std::path::Path) -> std::io::Result<std::fs::File> {
            std::fs::File::open("/proc/self/mem")
        }
    }

    #[test]
    fn a_block_device_whose_head_cannot_be_read_is_a_failure_not_unusable_input() {
        // Goal: --format reads what a block device holds before writing; a read that fails with
        // EIO is I/O that failed (DaemonError::Io, tuttid's status 1), as the claim's own open
        // failing with EIO is, not what was given (Devices, 2) as it was.
        let directory = tempfile::tempdir().unwrap();
        let disk = directory.path().join("disk");
        std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
        let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let options = formatting(directory.path(), vec![DeviceSpec::EmuFile(disk.clone())], geometry, 64 << 20);
        let opener = UnreadableDisk { path: disk };
        let locks = DeviceLocks::acquire_with(&options.specs, &options.lock_dir, false, &opener).expect("locked and claimed");
        let error = refuse_foreign_files(&options, &options.specs, &locks).unwrap_err();
        assert!(matches!(&error, DaemonError::Io { source, .. } if source.raw_os_error() == Some(nix::libc::EIO)), "{error:?}");
        assert!(error.to_string().contains("reading its first bytes"), "{error}");
    }

    #[test]
    fn a_refused_start_changes_no_mode_and_a_pool_opened_is_made_its_owners_only() {
        // Goal: a pool file of this user's that others could open was narrowed to 0600 when it
        // was locked, before the refusals that come after the lock: a disk image holding a file
        // system that --format refuses, or a mistyped path that holds no pool, lost its group
        // and others' access though the start was refused. Only a pool that opened is narrowed.
        use std::os::unix::fs::PermissionsExt;
        let directory = tempfile::tempdir().unwrap();
        let image = directory.path().join("vm.img");
        let mut bytes = vec![0u8; 8 << 20];
        bytes[1080..1082].copy_from_slice(&[0x53, 0xef]);
        std::fs::write(&image, &bytes).unwrap();
        std::fs::set_permissions(&image, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mode = || std::fs::metadata(&image).unwrap().permissions().mode() & 0o7777;
        let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let mut options = formatting(directory.path(), vec![DeviceSpec::EmuFile(image.clone())], geometry, 64 << 20);
        let error = open_pool(&options).err().expect("the file system is refused");
        assert!(matches!(error, DaemonError::Devices(DeviceError::ForeignContents { .. })), "{error}");
        assert_eq!(mode(), 0o644, "a refused --format changed the mode");
        let format = options.format.take();
        assert!(open_pool(&options).is_err(), "a file that holds no pool opened");
        assert_eq!(mode(), 0o644, "a refused start changed the mode");
        assert!(std::fs::read(&image).unwrap() == bytes, "a refused start wrote to the file");
        options.format = format;
        options.overwrite = true;
        let opened = open_pool(&options).expect("format over it");
        assert_eq!(mode(), 0o600, "the pool opened is still open to others");
        drop(opened);
        std::fs::set_permissions(&image, std::fs::Permissions::from_mode(0o640)).unwrap();
        options.format = None;
        drop(open_pool(&options).expect("open the pool"));
        assert_eq!(mode(), 0o600, "a pool opened without --format is still open to others");
    }

    #[test]
    fn a_format_whose_narrowing_fails_says_the_pool_was_formatted_and_keeps_it() {
        // Goal: narrowing waits for the format, so an EPERM from it (a filesystem refusing
        // chmod) comes after the pool was written; the start was refused with the lock step's
        // old message alone, which reads as if nothing had changed though the file now holds a
        // fresh pool (with --overwrite, what it held is gone). Now the error says the pool was
        // formatted there, and the pool is kept (a later start opens it).
        use std::os::unix::fs::PermissionsExt;
        let directory = tempfile::tempdir().unwrap();
        let image = directory.path().join("pool.img");
        std::fs::write(&image, vec![0u8; 8 << 20]).unwrap();
        std::fs::set_permissions(&image, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mode = || std::fs::metadata(&image).unwrap().permissions().mode() & 0o7777;
        let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let mut options = formatting(directory.path(), vec![DeviceSpec::EmuFile(image.clone())], geometry, 64 << 20);
        crate::lock::NARROWING_FAILS_WITH.set(Some(nix::libc::EPERM));
        let refused = open_pool(&options).err();
        crate::lock::NARROWING_FAILS_WITH.set(None);
        let error = refused.expect("a pool file that cannot be narrowed is refused");
        let text = error.to_string();
        assert!(matches!(error, DaemonError::Devices(DeviceError::Io { .. })), "not status 2: {error:?}");
        assert!(text.contains(&format!("the pool was formatted on emu:{} and is kept", image.display())), "{text}");
        assert!(text.contains("EPERM") && !text.contains("immutable"), "{text}");
        // No mode is asserted here: the seam fails every fchmod, so the file's cannot change
        // (what is put back is the devices crate's to test).
        options.format = None;
        drop(open_pool(&options).expect("the pool formatted is there"));
        assert_eq!(mode(), 0o600);
    }

    #[test]
    fn a_pool_of_another_lba_size_is_not_told_to_be_formatted() {
        // Goal: a pool read with another LBA size than it was formatted with (a vfio: namespace
        // reformatted with another LBA format; here an emu: file formatted with 512-byte LBAs and
        // opened with 4096) is a pool still: the refusal says what differs and never suggests
        // --format, which would destroy it.
        let directory = tempfile::tempdir().unwrap();
        let image = directory.path().join("pool.img");
        let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let mut options = formatting(directory.path(), vec![DeviceSpec::EmuFile(image)], geometry, 64 << 20);
        options.emu_lba_bytes = 512;
        drop(open_pool(&options).expect("format a pool of 512-byte LBAs"));
        options.emu_lba_bytes = 4096;
        options.format = None;
        let Err(error) = open_pool(&options) else { panic!("a pool of 512-byte LBAs opened with 4096-byte ones") };
        let message = error.to_string();
        assert!(matches!(&error, DaemonError::Pool { source: objstore::ObjstoreError::LbaSizeMismatch { .. }, .. }), "{message}");
        assert!(message.contains("another LBA size") && !message.contains("--format"), "{message}");
    }
}
