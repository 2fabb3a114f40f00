//! Tests of discovery and binding against a fake sysfs/procfs tree, with a thread standing in
//! for the kernel's driver core (it reacts to unbind, driver_override and drivers_probe writes).

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::*;
use crate::system::ExclusiveHandle;

struct FakeHost {
    _temp: tempfile::TempDir,
    sys: PathBuf,
    proc: PathBuf,
}

impl FakeHost {
    fn new() -> Self {
        let temp = tempfile::tempdir().unwrap();
        let sys = temp.path().join("sys");
        let proc = temp.path().join("proc");
        std::fs::create_dir_all(&proc).unwrap();
        std::fs::write(proc.join("mounts"), "sysfs /sys sysfs rw 0 0\n/dev/sda1 / ext4 rw 0 0\n").unwrap();
        std::fs::write(proc.join("swaps"), "Filename Type Size Used Priority\n").unwrap();
        for driver in ["nvme", "vfio-pci", "ahci"] {
            let dir = sys.join("bus/pci/drivers").join(driver);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("unbind"), "").unwrap();
        }
        std::fs::write(sys.join("bus/pci/drivers_probe"), "").unwrap();
        Self { _temp: temp, sys, proc }
    }

    /// Where the tests' `vfio:` lock files live (tuttid's and `tutti unbind`'s `--lock-dir`).
    fn lock_dir(&self) -> PathBuf {
        self.proc.with_file_name("locks")
    }

    /// The fake host; its block device nodes are files under `dev/` that answer an exclusive
    /// open with EBUSY when they hold `EBUSY` ([`FakeHost::claim`]), with EACCES when they hold
    /// `EACCES` ([`FakeHost::deny`]), open as that block device
    /// when they hold its `major:minor` ([`FakeHost::node`]), and as something else otherwise;
    /// a missing node is not found. No test opens the real /dev.
    fn system(&self) -> System {
        self.system_logging(None).0
    }

    /// [`FakeHost::system`] whose exclusive opens log `open <node> (driver <d>)` and, when their
    /// handle drops, `close <node> (driver <d>)`, `<d>` being the driver of `function` then.
    fn system_logging(&self, function: Option<&str>) -> (System, Arc<Mutex<Vec<String>>>) {
        let dev = self.proc.with_file_name("dev");
        let log = Arc::new(Mutex::new(Vec::new()));
        let driver_link = function.map(|function| self.sys.join("bus/pci/devices").join(function).join("driver"));
        let driver_now = move || {
            let target = driver_link.as_ref().and_then(|link| std::fs::read_link(link).ok());
            target.map_or("none".to_string(), |target| target.file_name().unwrap().to_string_lossy().into_owned())
        };
        let group_driver_now = driver_now.clone();
        let opens_log = Arc::clone(&log);
        // As the kernel does (block/bdev.c, bd_may_claim), an exclusive open of a partition
        // fails while its whole disk is held exclusively, and one of the whole disk fails while
        // one of its partitions is (claiming a partition marks its disk claimed), each open
        // file being its own holder.
        let held = Arc::new(Mutex::new(Vec::<String>::new()));
        let exclusive_open = move |path: &Path| {
            let text = std::fs::read_to_string(path)?;
            let node = path.file_name().unwrap().to_string_lossy().into_owned();
            let partition_of = |partition: &str, disk: &str| partition.strip_prefix(disk).is_some_and(|rest| rest.starts_with('p'));
            let conflict = held.lock().unwrap().iter().any(|other| partition_of(&node, other) || partition_of(other, &node));
            if text == "EBUSY" || conflict {
                return Err(std::io::Error::from_raw_os_error(libc::EBUSY));
            }
            if text == "EACCES" {
                return Err(std::io::Error::from_raw_os_error(libc::EACCES));
            }
            held.lock().unwrap().push(node.clone());
            opens_log.lock().unwrap().push(format!("open {node} (driver {})", driver_now()));
            let device_number = text.contains(':').then(|| text.trim().to_string());
            let closed = LogOnDrop {
                log: Arc::clone(&opens_log),
                line: Box::new({
                    let driver_now = driver_now.clone();
                    let held = Arc::clone(&held);
                    move || {
                        held.lock().unwrap().retain(|disk| *disk != node);
                        format!("close {node} (driver {})", driver_now())
                    }
                }),
            };
            Ok(ExclusiveHandle::new(device_number, Box::new(closed)))
        };
        // A VFIO group node `dev/vfio/<group>` answers EBUSY when it holds `EBUSY`, and opens
        // otherwise, logging `open vfio/<group> (driver <d>, override <o>)` and, when closed,
        // `close vfio/<group> (driver <d>)`; a missing one is not found.
        let group_log = Arc::clone(&log);
        let override_file = function.map(|function| self.sys.join("bus/pci/devices").join(function).join("driver_override"));
        let group_open = move |path: &Path| -> std::io::Result<Box<dyn Send + Sync>> {
            if std::fs::read_to_string(path)? == "EBUSY" {
                return Err(std::io::Error::from_raw_os_error(libc::EBUSY));
            }
            let node = format!("vfio/{}", path.file_name().unwrap().to_string_lossy());
            let override_now = override_file.as_ref().and_then(|file| std::fs::read_to_string(file).ok()).unwrap_or_default();
            group_log.lock().unwrap().push(format!("open {node} (driver {}, override {:?})", group_driver_now(), override_now.trim()));
            let driver_now = group_driver_now.clone();
            Ok(Box::new(LogOnDrop {
                log: Arc::clone(&group_log),
                line: Box::new(move || format!("close {node} (driver {})", driver_now())),
            }))
        };
        let system = System::with_exclusive_open(self.sys.clone(), self.proc.clone(), dev, Box::new(exclusive_open));
        (system.with_group_open(Box::new(group_open)), log)
    }

    /// Makes `/dev/vfio/<group>` a group node that opens (`free`) or answers EBUSY (`EBUSY`).
    fn group_node(&self, group: u32, state: &str) {
        let vfio = self.proc.with_file_name("dev").join("vfio");
        std::fs::create_dir_all(&vfio).unwrap();
        std::fs::write(vfio.join(group.to_string()), state).unwrap();
    }

    /// Makes `/dev/<device>` a node of block device `major_minor`, free for an exclusive open.
    fn node(&self, device: &str, major_minor: &str) {
        let dev = self.proc.with_file_name("dev");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join(device), major_minor).unwrap();
    }

    /// The nodes of the namespaces (and their partitions) [`FakeHost::add`] gave controller
    /// `nvme<index>`, free for an exclusive open, as the host's /dev has them.
    fn nodes(&self, index: u32, namespaces: u32) {
        for namespace in 1..=namespaces {
            let minor = (index * 16 + namespace) * 2;
            self.node(&format!("nvme{index}n{namespace}"), &format!("259:{minor}"));
            self.node(&format!("nvme{index}n{namespace}p1"), &format!("259:{}", minor + 1));
        }
    }

    /// Makes `/dev/<device>` busy for an exclusive open, as a claim /proc/mounts does not show
    /// (a ZFS vdev, a btrfs member other than the one mounted) makes it.
    fn claim(&self, device: &str) {
        let dev = self.proc.with_file_name("dev");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join(device), "EBUSY").unwrap();
    }

    /// Makes `/dev/<device>` refuse an exclusive open with EACCES, as the host's /dev does to a
    /// user other than root (and the `disk` group).
    fn deny(&self, device: &str) {
        let dev = self.proc.with_file_name("dev");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join(device), "EACCES").unwrap();
    }

    /// A PCI function; with `namespaces`, an nvme controller `nvme<index>` with those namespaces
    /// (and one partition each) as the kernel's nvme driver would publish them.
    fn add(&self, address: &str, class: u32, driver: Option<&str>, group: u32, index: u32, namespaces: u32) -> PathBuf {
        let dir = self.sys.join("bus/pci/devices").join(address);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("class"), format!("{class:#08x}\n")).unwrap();
        std::fs::write(dir.join("vendor"), "0x1b36\n").unwrap();
        std::fs::write(dir.join("device"), "0x0010\n").unwrap();
        std::fs::write(dir.join("driver_override"), "(null)\n").unwrap();
        if let Some(driver) = driver {
            symlink(self.sys.join("bus/pci/drivers").join(driver), dir.join("driver")).unwrap();
        }
        let group_dir = self.sys.join("kernel/iommu_groups").join(group.to_string());
        std::fs::create_dir_all(group_dir.join("devices")).unwrap();
        symlink(&group_dir, dir.join("iommu_group")).unwrap();
        symlink(&dir, group_dir.join("devices").join(address)).unwrap();
        if namespaces > 0 {
            let controller = dir.join(format!("nvme/nvme{index}"));
            std::fs::create_dir_all(&controller).unwrap();
            std::fs::write(controller.join("model"), "QEMU NVMe Ctrl                          \n").unwrap();
            for namespace in 1..=namespaces {
                let name = format!("nvme{index}n{namespace}");
                let minor = (index * 16 + namespace) * 2;
                self.block(&controller.join(&name), &name, &format!("259:{minor}"));
                self.block(&controller.join(&name).join(format!("{name}p1")), &format!("{name}p1"), &format!("259:{}", minor + 1));
            }
        }
        dir
    }

    /// The nvme controller most tests bind: 0000:00:04.0 on nvme in IOMMU group 3, `nvme0`
    /// with one namespace and its partition, their /dev nodes in place.
    fn nvme_controller(&self) -> PathBuf {
        let dir = self.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 1);
        self.nodes(0, 1);
        dir
    }

    /// 0000:00:04.0 (IOMMU group 3, no disks) as a bind leaves it: on vfio-pci, its
    /// driver_override `vfio-pci`.
    fn bound_to_vfio(&self) -> PathBuf {
        let dir = self.add("0000:00:04.0", 0x010802, Some("vfio-pci"), 3, 0, 0);
        std::fs::write(dir.join("driver_override"), "vfio-pci\n").unwrap();
        dir
    }

    /// A block device `name` (device number `dev`, "major:minor") whose sysfs directory is
    /// `device_dir` (a partition when that lies in another block device's), linked from
    /// `class/block` as the kernel links it.
    fn block(&self, device_dir: &Path, name: &str, dev: &str) {
        std::fs::create_dir_all(device_dir).unwrap();
        std::fs::write(device_dir.join("dev"), format!("{dev}\n")).unwrap();
        // A partition's directory lies in its disk's, and only partitions have `partition`.
        if device_dir.parent().is_some_and(|parent| parent.join("dev").exists()) {
            std::fs::write(device_dir.join("partition"), "1\n").unwrap();
        }
        let class = self.sys.join("class/block");
        std::fs::create_dir_all(&class).unwrap();
        symlink(device_dir, class.join(name)).unwrap();
    }

    /// Process `pid` (named `comm`) holding `target` open as file descriptor `fd`.
    fn open_fd(&self, pid: u32, comm: &str, fd: u32, target: &str) {
        let dir = self.proc.join(pid.to_string());
        std::fs::create_dir_all(dir.join("fd")).unwrap();
        std::fs::write(dir.join("comm"), format!("{comm}\n")).unwrap();
        symlink(target, dir.join("fd").join(fd.to_string())).unwrap();
    }

    fn mount(&self, device: &str, target: &str) {
        let mut mounts = std::fs::read_to_string(self.proc.join("mounts")).unwrap();
        mounts.push_str(&format!("/dev/{device} {target} ext4 rw 0 0\n"));
        std::fs::write(self.proc.join("mounts"), mounts).unwrap();
    }

    fn driver_of(&self, address: &str) -> Option<String> {
        std::fs::read_link(self.sys.join("bus/pci/devices").join(address).join("driver"))
            .ok()
            .map(|target| target.file_name().unwrap().to_string_lossy().into_owned())
    }

    /// Starts the fake driver core; it stops when the returned guard drops.
    fn kernel(&self) -> FakeKernel {
        self.kernel_declining(&[])
    }

    /// A fake driver core whose `declined` drivers refuse every function they are probed for
    /// (as vfio-pci does when it cannot set a function up): the function stays unbound.
    fn kernel_declining(&self, declined: &[&'static str]) -> FakeKernel {
        self.kernel_with(declined, "nvme")
    }

    /// A fake driver core whose `declined` drivers refuse every function, and which gives a
    /// function with no override to `default_driver` (vfio-pci: its ids in `vfio-pci.ids=`).
    fn kernel_with(&self, declined: &[&'static str], default_driver: &'static str) -> FakeKernel {
        let stop = Arc::new(AtomicBool::new(false));
        let sys = self.sys.clone();
        let flag = Arc::clone(&stop);
        let declined = declined.to_vec();
        let handle = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(30);
            while !flag.load(Ordering::Relaxed) && Instant::now() < deadline {
                fake_driver_core_step(&sys, &declined, default_driver);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        FakeKernel { stop, handle: Some(handle) }
    }
}

/// Logs a line when dropped (a fake exclusive open being closed).
struct LogOnDrop {
    log: Arc<Mutex<Vec<String>>>,
    line: Box<dyn Fn() -> String + Send + Sync>,
}

impl Drop for LogOnDrop {
    fn drop(&mut self) {
        let line = (self.line)();
        self.log.lock().unwrap().push(line);
    }
}

struct FakeKernel {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Drop for FakeKernel {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take() {
            handle.join().unwrap();
        }
    }
}

/// One round of what the driver core does with the files tutti writes.
fn fake_driver_core_step(sys: &Path, declined: &[&str], default_driver: &str) {
    let drivers = sys.join("bus/pci/drivers");
    for driver in std::fs::read_dir(&drivers).unwrap().filter_map(|entry| entry.ok()) {
        let unbind = driver.path().join("unbind");
        let requested = std::fs::read_to_string(&unbind).unwrap_or_default();
        let requested = requested.trim();
        if !requested.is_empty() {
            let _ = std::fs::remove_file(sys.join("bus/pci/devices").join(requested).join("driver"));
            std::fs::write(&unbind, "").unwrap();
        }
    }
    let probe = sys.join("bus/pci/drivers_probe");
    let requested = std::fs::read_to_string(&probe).unwrap_or_default();
    let requested = requested.trim();
    if !requested.is_empty() {
        let dir = sys.join("bus/pci/devices").join(requested);
        let override_driver = std::fs::read_to_string(dir.join("driver_override")).unwrap_or_default();
        let chosen = match override_driver.trim() {
            "" | "(null)" => default_driver.to_string(),
            name => name.to_string(),
        };
        if !dir.join("driver").exists() && !declined.contains(&chosen.as_str()) {
            symlink(drivers.join(chosen), dir.join("driver")).unwrap();
        }
        std::fs::write(&probe, "").unwrap();
    }
}

/// `--force`: past the in-use check only.
const FORCE: Overrides = Overrides { in_use: true, not_nvme: false };

fn at(text: &str) -> PciAddress {
    text.parse().unwrap()
}

/// What the function whose sysfs directory is `function` has in its driver_override.
fn override_of(function: &Path) -> String {
    std::fs::read_to_string(function.join("driver_override")).unwrap()
}

/// Whether `error` makes tutti exit 2 (unusable input, nothing changed), as `tutti pool` and
/// tutti-bench do for the same refusals (a device in use, one that is not there).
fn unusable(error: &anyhow::Error) -> bool {
    tutti_cli::exit::is_unusable(error.as_ref())
}

#[test]
fn inspect_reports_model_block_devices_and_readiness() {
    // Goal: the listing shows what an operator needs to decide whether to bind.
    let host = FakeHost::new();
    host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 1);
    host.add("0000:00:05.0", 0x010802, Some("vfio-pci"), 4, 1, 0);
    host.add("0000:00:06.0", 0x010802, Some("nvme"), 5, 2, 1);
    host.add("0000:00:06.1", 0x010601, Some("ahci"), 5, 0, 0);
    host.add("0000:00:1f.2", 0x010601, Some("ahci"), 6, 0, 0);
    host.mount("nvme0n1p1", "/data");
    let system = host.system();
    assert_eq!(system.nvme_functions().unwrap(), vec![at("0000:00:04.0"), at("0000:00:05.0"), at("0000:00:06.0")]);

    let mounted = inspect(&system, at("0000:00:04.0")).unwrap();
    assert_eq!(mounted.model, "QEMU NVMe Ctrl");
    assert_eq!(mounted.block_devices, vec!["nvme0n1", "nvme0n1p1"]);
    assert_eq!(mounted.iommu_group, Some(3));
    assert!(
        matches!(&mounted.readiness, Readiness::Blocked(reason) if reason.contains("nvme0n1p1 mounted on /data")),
        "{:?}",
        mounted.readiness
    );

    let ready = inspect(&system, at("0000:00:05.0")).unwrap();
    assert_eq!(ready.readiness, Readiness::Ready);
    assert_eq!(ready.model, "(Red Hat / QEMU)", "no kernel model when vfio-pci holds it");

    let shared = inspect(&system, at("0000:00:06.0")).unwrap();
    assert!(matches!(&shared.readiness, Readiness::Impossible(reason) if reason.contains("0000:00:06.1 (ahci)")));
}

#[test]
fn bind_and_unbind_round_trip() {
    // Goal: bind moves an idle nvme-bound function to vfio-pci through driver_override, and
    // unbind gives it back to nvme, with the override cleared.
    let host = FakeHost::new();
    let dir = host.nvme_controller();
    let system = host.system();
    let _kernel = host.kernel();

    let outcome = bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap();
    assert_eq!(outcome, BindOutcome::Bound { previous_driver: Some("nvme".into()) });
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("vfio-pci"));
    assert_eq!(override_of(&dir), "vfio-pci");
    assert_eq!(bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap(), BindOutcome::AlreadyBound);

    let driver = unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap();
    assert_eq!(driver.as_deref(), Some("nvme"));
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"));
    assert_eq!(override_of(&dir).trim(), "");
}

#[test]
fn bind_refuses_mounted_devices_unless_forced() {
    // Goal: a mounted filesystem (or swap) on any namespace or partition blocks binding, and the
    // error says where; --force overrides.
    let host = FakeHost::new();
    host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 2);
    host.mount("nvme0n2p1", r"/mnt/my\040data");
    let system = host.system();
    let _kernel = host.kernel();
    let error = bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err();
    assert!(unusable(&error), "a disk in use is refused as unusable input (status 2): {error:#}");
    let error = error.to_string();
    assert!(error.contains("/dev/nvme0n2p1 mounted on /mnt/my data") && error.contains("--force"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"), "nothing changed");
    assert!(bind(&system, at("0000:00:04.0"), FORCE, &host.lock_dir()).is_ok());
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("vfio-pci"));

    let swap_host = FakeHost::new();
    swap_host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 1);
    std::fs::write(swap_host.proc.join("swaps"), "Filename Type Size Used Priority\n/dev/nvme0n1p1 partition 100 0 -2\n").unwrap();
    let error = bind(&swap_host.system(), at("0000:00:04.0"), Overrides::default(), &swap_host.lock_dir()).unwrap_err().to_string();
    assert!(error.contains("/dev/nvme0n1p1 used as swap"), "{error}");

    let stacked_host = FakeHost::new();
    stacked_host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 1);
    std::fs::create_dir_all(stacked_host.sys.join("class/block/nvme0n1/holders/dm-0")).unwrap();
    let error = bind(&stacked_host.system(), at("0000:00:04.0"), Overrides::default(), &stacked_host.lock_dir()).unwrap_err().to_string();
    // Each kind of use reads as itself: this was "/dev/nvme0n1 on held by dm-0".
    assert!(error.contains("/dev/nvme0n1 held by dm-0") && !error.contains(" on held"), "{error}");
}

#[test]
fn bind_refuses_a_device_claimed_without_a_mount_unless_forced() {
    // Goal: a disk that is a ZFS vdev, or a btrfs member other than the one /proc/mounts names,
    // shows in no mount, holder or swap; the kernel still answers an exclusive open with EBUSY,
    // and bind refuses it (naming the device) unless forced.
    let host = FakeHost::new();
    host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 2);
    host.claim("nvme0n2");
    let system = host.system();
    let _kernel = host.kernel();
    let error = bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err().to_string();
    assert!(
        error.contains("/dev/nvme0n2 claimed exclusively by another opener") && error.contains("EBUSY") && error.contains("--force"),
        "{error}"
    );
    assert!(!error.contains(" on an exclusive claim"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"), "nothing changed");
    assert!(bind(&system, at("0000:00:04.0"), FORCE, &host.lock_dir()).is_ok());
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("vfio-pci"));
}

#[test]
fn bind_refuses_what_vfio_cannot_take() {
    // Goal: non-NVMe functions, missing devices, a missing vfio-pci driver and a function without
    // an IOMMU group are refused before anything is written.
    let host = FakeHost::new();
    let sata = host.add("0000:00:1f.2", 0x010601, Some("ahci"), 6, 0, 0);
    let system = host.system();
    let error = bind(&system, at("0000:00:1f.2"), Overrides::default(), &host.lock_dir()).unwrap_err();
    assert!(error.to_string().contains("not an NVMe controller") && unusable(&error), "{error:#}");
    assert_eq!(override_of(&sata), "(null)\n");
    let error = bind(&system, at("0000:00:09.0"), Overrides::default(), &host.lock_dir()).unwrap_err();
    assert!(error.to_string().contains("no PCI function") && unusable(&error), "{error:#}");
    let error = unbind(&system, at("0000:00:09.0"), true, false, &host.lock_dir()).unwrap_err();
    assert!(error.to_string().contains("no PCI function") && unusable(&error), "{error:#}");

    let nvme = host.add("0000:00:04.0", 0x010802, None, 3, 0, 0);
    std::fs::remove_file(nvme.join("iommu_group")).unwrap();
    assert!(bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err().to_string().contains("intel_iommu=on"));

    std::fs::remove_dir_all(host.sys.join("bus/pci/drivers/vfio-pci")).unwrap();
    assert!(bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir())
        .unwrap_err()
        .to_string()
        .contains("modprobe vfio-pci"));
}

#[test]
fn bind_times_out_when_the_kernel_does_not_react() {
    // Goal: a probe request the kernel ignores ends in a bounded wait and an error, not a hang.
    // (No fake kernel runs here.) The wait is DRIVER_CHANGE_TIMEOUT; keep this test's budget.
    let host = FakeHost::new();
    host.add("0000:00:04.0", 0x010802, None, 3, 0, 0);
    let started = Instant::now();
    let error = bind(&host.system(), at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err();
    assert!(format!("{error:#}").contains("vfio-pci did not take"), "{error:#}");
    assert!(started.elapsed() < DRIVER_CHANGE_TIMEOUT + Duration::from_secs(5));
}

#[test]
fn a_failed_bind_is_rolled_back_to_the_driver_it_had() {
    // Goal: when vfio-pci does not take the function, bind does not leave it unbound with a
    // sticky driver_override: the override is cleared, nvme gets it back, and the error says so.
    let host = FakeHost::new();
    let dir = host.nvme_controller();
    let system = host.system();
    let _kernel = host.kernel_declining(&["vfio-pci"]);
    let error = format!("{:#}", bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err());
    assert!(error.contains("vfio-pci did not take") && error.contains("rolled back"), "{error}");
    assert!(error.contains("bound to nvme, driver_override cleared"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"));
    assert_eq!(override_of(&dir).trim(), "");
}

#[test]
fn a_bind_that_cannot_be_rolled_back_says_where_the_function_is_and_how_to_restore_it() {
    // Goal: when neither vfio-pci nor nvme takes the function, the error names its state (no
    // driver, override cleared) and `tutti unbind`; the override is not left behind.
    let host = FakeHost::new();
    let dir = host.nvme_controller();
    let system = host.system();
    let _kernel = host.kernel_declining(&["vfio-pci", "nvme"]);
    let error = format!("{:#}", bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err());
    assert!(error.contains("could not be rolled back"), "{error}");
    assert!(error.contains("now bound to no driver, driver_override cleared (it was bound to nvme)"), "{error}");
    assert!(error.contains("`tutti unbind 0000:00:04.0` restores it"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0"), None);
    assert_eq!(override_of(&dir).trim(), "");
}

#[test]
fn bind_past_the_class_check_still_refuses_a_disk_in_use_whatever_drives_it() {
    // Goal: a function driven by something other than nvme (ahci here; vmd or a RAID HBA alike)
    // has its disks found under its sysfs device, and letting bind past the class check never
    // lets it past the in-use check: a mounted root filesystem stays with the kernel.
    let host = FakeHost::new();
    let dir = host.add("0000:00:17.0", 0x010601, Some("ahci"), 6, 0, 0);
    host.block(&dir.join("ata1/host0/target0:0:0/0:0:0:0/block/sda"), "sda", "8:0");
    host.block(&dir.join("ata1/host0/target0:0:0/0:0:0:0/block/sda/sda1"), "sda1", "8:1");
    host.mount("sda1", "/");
    let system = host.system();
    let _kernel = host.kernel();
    let error = bind(&system, at("0000:00:17.0"), Overrides { in_use: false, not_nvme: true }, &host.lock_dir()).unwrap_err().to_string();
    assert!(error.contains("/dev/sda1 mounted on /") && error.contains("--force"), "{error}");
    // --force alone lifts the in-use check only; the class check still stands.
    let error = bind(&system, at("0000:00:17.0"), FORCE, &host.lock_dir()).unwrap_err().to_string();
    assert!(error.contains("not an NVMe controller") && error.contains("--not-nvme"), "{error}");
    assert_eq!(host.driver_of("0000:00:17.0").as_deref(), Some("ahci"), "nothing changed");
}

#[test]
fn unbind_refuses_what_is_not_nvme_and_a_vfio_device_someone_holds() {
    // Goal: a mistyped address (a GPU passed through to a VM) or a controller whose VFIO group a
    // process holds open (tuttid, a VM) is refused before anything is written: the kernel's
    // unbind would block until the holder lets go, with the override already cleared.
    let host = FakeHost::new();
    let gpu = host.add("0000:3b:00.0", 0x030000, Some("vfio-pci"), 7, 0, 0);
    let nvme = host.add("0000:00:04.0", 0x010802, Some("vfio-pci"), 3, 0, 0);
    std::fs::write(gpu.join("driver_override"), "vfio-pci\n").unwrap();
    std::fs::write(nvme.join("driver_override"), "vfio-pci\n").unwrap();
    host.open_fd(1234, "tuttid", 5, "/dev/vfio/3");
    host.open_fd(99, "bash", 0, "/dev/pts/0");
    let system = host.system();
    let _kernel = host.kernel();

    let error = unbind(&system, at("0000:3b:00.0"), true, false, &host.lock_dir()).unwrap_err();
    assert!(unusable(&error), "{error:#}");
    let error = format!("{error:#}");
    assert!(error.contains("not an NVMe controller") && error.contains("--not-nvme"), "{error}");
    assert_eq!(host.driver_of("0000:3b:00.0").as_deref(), Some("vfio-pci"), "nothing changed");
    assert_eq!(override_of(&gpu), "vfio-pci\n");
    assert!(unbind(&system, at("0000:3b:00.0"), false, true, &host.lock_dir()).is_ok(), "--not-nvme lets it through");

    let error = unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap_err();
    assert!(unusable(&error), "{error:#}");
    let error = format!("{error:#}");
    assert!(error.contains("pid 1234 (tuttid)") && error.contains("/dev/vfio/3"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("vfio-pci"), "nothing changed");
    assert_eq!(override_of(&nvme), "vfio-pci\n");

    // The iommufd cdev of this function counts as well; another function's does not.
    std::fs::remove_dir_all(host.proc.join("1234")).unwrap();
    std::fs::create_dir_all(nvme.join("vfio-dev/vfio0")).unwrap();
    host.open_fd(77, "qemu-system-x86", 9, "/dev/vfio/devices/vfio1");
    host.open_fd(78, "qemu-system-x86", 9, "/dev/vfio/devices/vfio0");
    let error = format!("{:#}", unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap_err());
    assert!(error.contains("pid 78 (qemu-system-x86)") && !error.contains("pid 77"), "{error}");
    std::fs::remove_dir_all(host.proc.join("78")).unwrap();
    assert_eq!(
        unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap().as_deref(),
        Some("nvme"),
        "free once nothing holds it"
    );
}

#[test]
fn bind_sees_the_partitions_of_a_multipath_head_disk() {
    // Goal: with native NVMe multipath the controller holds only the hidden path disk
    // (nvme0c0n1, no partitions); the head disk nvme0n1 and its partitions live under
    // nvme-subsystem/. A partition of the head mounted is still found, and bind refuses.
    let host = FakeHost::new();
    let dir = host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 0);
    host.block(&dir.join("nvme/nvme0/nvme0c0n1"), "nvme0c0n1", "259:9");
    let head = host.sys.join("devices/virtual/nvme-subsystem/nvme-subsys0/nvme0n1");
    host.block(&head, "nvme0n1", "259:0");
    host.block(&head.join("nvme0n1p1"), "nvme0n1p1", "259:1");
    host.mount("nvme0n1p1", "/data");
    let system = host.system();
    let _kernel = host.kernel();
    assert_eq!(system.block_devices(at("0000:00:04.0")).into_iter().collect::<Vec<_>>(), ["nvme0n1", "nvme0n1p1"]);
    let error = bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err().to_string();
    assert!(error.contains("/dev/nvme0n1p1 mounted on /data"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"), "nothing changed");
}

#[test]
fn bind_holds_the_exclusive_opens_until_the_old_driver_let_go() {
    // Goal: nothing can mount a disk between the in-use check and the unbind: the O_EXCL open
    // of the whole disk stays open until nvme has let go of the function (closed only once
    // vfio-pci holds it).
    let host = FakeHost::new();
    host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 1);
    host.node("nvme0n1", "259:2");
    host.node("nvme0n1p1", "259:3");
    let (system, log) = host.system_logging(Some("0000:00:04.0"));
    let _kernel = host.kernel();
    bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap();
    let log = log.lock().unwrap().clone();
    // A held partition would make the whole disk's exclusive open fail: partitions are probed
    // and closed at once, and the whole disk, whose hold also bars claims of its partitions, is
    // what stays open.
    assert_eq!(
        log,
        ["open nvme0n1p1 (driver nvme)", "close nvme0n1p1 (driver nvme)", "open nvme0n1 (driver nvme)", "close nvme0n1 (driver vfio-pci)"]
    );
}

#[test]
fn an_idle_partitioned_disk_is_not_its_own_exclusive_claim() {
    // Goal: an idle GPT-partitioned SSD binds without --force. Holding a partition's O_EXCL open
    // makes the kernel refuse the whole disk's (EBUSY), so the check must not hold one while it
    // opens the other, or every partitioned disk reads as "claimed exclusively by another opener".
    let host = FakeHost::new();
    host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 1);
    host.node("nvme0n1", "259:2");
    host.node("nvme0n1p1", "259:3");
    let system = host.system();
    let _kernel = host.kernel();
    assert_eq!(
        bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap(),
        BindOutcome::Bound { previous_driver: Some("nvme".into()) }
    );
    // A partition someone else claims is still seen.
    let busy = FakeHost::new();
    busy.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 1);
    busy.node("nvme0n1", "259:2");
    busy.claim("nvme0n1p1");
    let _busy_kernel = busy.kernel();
    let error = bind(&busy.system(), at("0000:00:04.0"), Overrides::default(), &busy.lock_dir()).unwrap_err().to_string();
    assert!(error.contains("/dev/nvme0n1p1 claimed exclusively") && !error.contains("/dev/nvme0n1 claimed"), "{error}");
}

#[test]
fn bind_refuses_a_node_that_is_not_the_disk_it_names() {
    // Goal: an exclusive open proves nothing when /dev/<name> is some other device (a stale or
    // hand-made node): its device number must be the one sysfs gives, or bind refuses, naming
    // both.
    let host = FakeHost::new();
    host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 1);
    host.node("nvme0n1", "8:0");
    let system = host.system();
    let _kernel = host.kernel();
    let error = bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err().to_string();
    assert!(error.contains("/dev/nvme0n1 is not the disk of that name: the node is device 8:0, sysfs gives 259:2"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"), "nothing changed");
}

#[test]
fn one_odd_function_neither_hides_the_others_nor_fails_a_done_bind() {
    // Goal: `tutti devices` lists every function it can read, noting the one it cannot (an odd
    // iommu_group link, an unreadable vendor), instead of stopping there; and a function that
    // is bound to vfio-pci is reported so (exit 0) even if its group cannot be read afterwards.
    let host = FakeHost::new();
    host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 1);
    let odd = host.add("0000:00:05.0", 0x010802, Some("vfio-pci"), 4, 1, 0);
    std::fs::remove_file(odd.join("iommu_group")).unwrap();
    symlink(host.sys.join("kernel/iommu_groups/not-a-number"), odd.join("iommu_group")).unwrap();
    let unreadable = host.add("0000:00:06.0", 0x010802, Some("nvme"), 5, 2, 0);
    std::fs::remove_file(unreadable.join("vendor")).unwrap();
    let system = host.system();
    run_devices(&system, &DevicesArgs {}).unwrap();

    let args = BindArgs { address: "0000:00:05.0".into(), force: false, not_nvme: false, lock_dir: host.lock_dir() };
    run_bind(&system, &args).unwrap();
}

#[test]
fn bind_refuses_a_disk_whose_node_cannot_be_opened_unless_forced() {
    // Goal: the exclusive open is the check that sees claims /proc does not show here (a mount
    // in another mount namespace, a ZFS vdev); in a container with /sys writable but no
    // /dev/nvme0n1 it fails with ENOENT, and bind must not take that for "free": the disk
    // cannot be checked, a use that needs --force.
    let host = FakeHost::new();
    host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 1);
    let system = host.system();
    let _kernel = host.kernel();
    let error = bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err().to_string();
    assert!(error.contains("/dev/nvme0n1 cannot be checked") && error.contains("--force"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"), "nothing changed");
    assert!(bind(&system, at("0000:00:04.0"), FORCE, &host.lock_dir()).is_ok());
}

#[test]
fn devices_says_a_disk_it_may_not_open_exclusively_needs_root_to_check_and_bind_still_refuses() {
    // Goal: run as a user other than root, every exclusive open fails with EACCES. `tutti
    // devices` (no --force, no claim to make) must not call such a function blocked or in use:
    // it says the check needs root. `tutti bind`, which would take the disks away, still
    // refuses them unless --force, as any disk it cannot check.
    let host = FakeHost::new();
    host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 1);
    host.deny("nvme0n1");
    host.deny("nvme0n1p1");
    let system = host.system();
    let readiness = inspect(&system, at("0000:00:04.0")).unwrap().readiness;
    let shown = readiness.to_string();
    assert!(!matches!(readiness, Readiness::Blocked(_)) && !shown.contains("in use"), "{shown}");
    assert!(shown.contains("nvme0n1, nvme0n1p1 cannot be checked as this user") && shown.contains("run as root"), "{shown}");

    let _kernel = host.kernel();
    let error = bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err().to_string();
    assert!(
        error.contains("/dev/nvme0n1 cannot be checked") && error.contains("Permission denied") && error.contains("--force"),
        "{error}"
    );
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"), "nothing changed");
    assert!(bind(&system, at("0000:00:04.0"), FORCE, &host.lock_dir()).is_ok());
}

#[test]
fn bind_refuses_a_disk_a_process_holds_open_unless_forced() {
    // Goal: an ordinary (non-exclusive) opener, such as a VM whose disk is /dev/nvme0n2 or a
    // database on a raw partition, shows in no mount, holder, swap or O_EXCL answer; bind finds
    // it in /proc/*/fd, names pid and command, and refuses unless forced.
    let host = FakeHost::new();
    host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 2);
    host.open_fd(4321, "qemu-system-x86", 12, "/dev/nvme0n2");
    host.open_fd(4400, "postgres", 3, "/dev/nvme0n1p1");
    host.open_fd(99, "bash", 0, "/dev/nvme0n10");
    let system = host.system();
    let _kernel = host.kernel();
    let error = bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err().to_string();
    assert!(error.contains("/dev/nvme0n2 open by pid 4321 (qemu-system-x86)"), "{error}");
    assert!(error.contains("/dev/nvme0n1p1 open by pid 4400 (postgres)") && !error.contains("pid 99"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"), "nothing changed");
    assert!(bind(&system, at("0000:00:04.0"), FORCE, &host.lock_dir()).is_ok());
}

#[test]
fn unbind_refuses_a_function_whose_tuttid_lock_is_held() {
    // Goal: `tutti unbind` takes tuttid's device lock (LOCK_DIR/vfio-BDF.lock) before it checks
    // for VFIO users and holds it through the unbind: a tuttid (restarted by its supervisor) that
    // holds the lock but has not opened the VFIO group yet, invisible to the openers check, makes
    // the unbind refused (exit status 2, as `tutti pool` and tutti-bench refuse a device whose
    // lock another holds) with nothing written, instead of the kernel's unbind then waiting on
    // the group it opens; once the lock is free the unbind runs.
    let host = FakeHost::new();
    let dir = host.bound_to_vfio();
    let system = host.system();
    let _kernel = host.kernel();
    let spec = tutti_devices::DeviceSpec::Vfio(at("0000:00:04.0"));
    let tuttid = tutti_devices::DeviceLocks::acquire(std::slice::from_ref(&spec), &host.lock_dir(), false).unwrap();

    let error = unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap_err();
    assert!(unusable(&error), "a held device is refused as unusable input, as tutti pool refuses it: {error:#}");
    let error = format!("{error:#}");
    assert!(error.contains("in use") && error.contains("vfio-0000:00:04.0.lock") && error.contains("stop it first"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("vfio-pci"), "nothing changed");
    assert_eq!(override_of(&dir), "vfio-pci\n", "override not written");
    assert_eq!(std::fs::read_to_string(host.sys.join("bus/pci/drivers/vfio-pci/unbind")).unwrap(), "", "unbind not written");

    drop(tuttid);
    assert_eq!(unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap().as_deref(), Some("nvme"));
    let after = tutti_devices::DeviceLocks::acquire(std::slice::from_ref(&spec), &host.lock_dir(), false);
    assert!(after.is_ok(), "the unbind let go of the lock: {:?}", after.err());
}

#[test]
fn unbind_refuses_a_vfio_group_held_by_a_process_it_cannot_see() {
    // Goal: a VFIO holder in another PID namespace, behind a hidepid /proc, or holding only a
    // device descriptor (anon_inode:[vfio-device]) shows in no /proc/*/fd scan, and the kernel's
    // unbind then waits for it (D state) with the override already cleared. The group node is
    // single-open: unbind opens it first, and EBUSY refuses the unbind with nothing written; a
    // free group stays open from before the override is cleared until the kernel has let go.
    let host = FakeHost::new();
    let dir = host.bound_to_vfio();
    host.group_node(3, "EBUSY");
    let (system, log) = host.system_logging(Some("0000:00:04.0"));
    let _kernel = host.kernel();

    let error = unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap_err();
    assert!(unusable(&error), "{error:#}");
    let error = format!("{error:#}");
    assert!(error.contains("/dev/vfio/3 is held by a process this tool cannot see") && error.contains("stop it first"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("vfio-pci"), "nothing changed");
    assert_eq!(override_of(&dir), "vfio-pci\n", "override not cleared");

    host.group_node(3, "free");
    assert_eq!(unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap().as_deref(), Some("nvme"));
    assert_eq!(*log.lock().unwrap(), ["open vfio/3 (driver vfio-pci, override \"vfio-pci\")", "close vfio/3 (driver none)"]);
}

#[test]
fn bind_takes_the_tuttid_lock_of_the_function() {
    // Goal: `tutti bind` holds tuttid's device lock (LOCK_DIR/vfio-BDF.lock) while it moves the
    // function, as `tutti unbind` does: a lock another process holds (a tuttid starting on it)
    // refuses the bind (exit 2) with nothing written; a free lock is taken and let go.
    let host = FakeHost::new();
    let dir = host.nvme_controller();
    let system = host.system();
    let _kernel = host.kernel();
    let spec = tutti_devices::DeviceSpec::Vfio(at("0000:00:04.0"));
    let tuttid = tutti_devices::DeviceLocks::acquire(std::slice::from_ref(&spec), &host.lock_dir(), false).unwrap();
    let error = bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err();
    assert!(unusable(&error), "{error:#}");
    let error = format!("{error:#}");
    assert!(error.contains("vfio-0000:00:04.0.lock") && error.contains("run `tutti bind` again"), "{error}");
    // The holder is this test process; named where /proc/locks lists its lock exactly.
    let lock_file = host.lock_dir().join("vfio-0000:00:04.0.lock");
    if tutti_devices::lock::lists_flock_exactly(&lock_file, std::process::id()) {
        assert!(error.contains(&format!("pid {} (", std::process::id())), "{error}");
    }
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"), "nothing changed");
    assert_eq!(override_of(&dir), "(null)\n", "override not written");

    drop(tuttid);
    assert!(bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).is_ok());
    let after = tutti_devices::DeviceLocks::acquire(std::slice::from_ref(&spec), &host.lock_dir(), false);
    assert!(after.is_ok(), "the bind let go of the lock: {:?}", after.err());
}

#[test]
fn a_bind_rollback_leaves_a_function_someone_holds_through_vfio_with_vfio_pci() {
    // Goal: when vfio-pci took the function too late (the bind failed), the rollback unbinds
    // it from vfio-pci only if nothing holds it through VFIO: a process that opened the group
    // meanwhile (a VM) would make the kernel's unbind wait for it. Held, it stays bound to
    // vfio-pci with its override, and the error says so and names `tutti unbind`.
    let host = FakeHost::new();
    let dir = host.bound_to_vfio();
    host.group_node(3, "EBUSY");
    let (system, log) = host.system_logging(Some("0000:00:04.0"));
    let _kernel = host.kernel();
    let error = roll_back_bind(&system, at("0000:00:04.0"), Some("nvme"), anyhow::anyhow!("vfio-pci did not take it"));
    let error = format!("{error:#}");
    assert!(error.contains("was not rolled back") && error.contains("bound to vfio-pci, driver_override still vfio-pci"), "{error}");
    assert!(error.contains("held by a process this tool cannot see") && error.contains("`tutti unbind 0000:00:04.0`"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("vfio-pci"));
    assert_eq!(override_of(&dir), "vfio-pci\n");
    assert_eq!(std::fs::read_to_string(host.sys.join("bus/pci/drivers/vfio-pci/unbind")).unwrap(), "", "unbind not written");

    // One /proc shows is named; a free group is rolled back, held open through the unbind.
    host.group_node(3, "free");
    host.open_fd(4321, "qemu-system-x86", 7, "/dev/vfio/3");
    let error = format!("{:#}", roll_back_bind(&system, at("0000:00:04.0"), Some("nvme"), anyhow::anyhow!("late")));
    assert!(error.contains("was not rolled back") && error.contains("pid 4321 (qemu-system-x86)"), "{error}");
    std::fs::remove_dir_all(host.proc.join("4321")).unwrap();
    log.lock().unwrap().clear();
    let error = format!("{:#}", roll_back_bind(&system, at("0000:00:04.0"), Some("nvme"), anyhow::anyhow!("late")));
    assert!(error.contains("was rolled back"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"));
    assert_eq!(*log.lock().unwrap(), ["open vfio/3 (driver vfio-pci, override \"vfio-pci\")", "close vfio/3 (driver nvme)"]);
}

#[test]
fn unbind_fails_when_vfio_pci_takes_the_function_back() {
    // Goal: with the function's ids in vfio-pci's (the vfio-pci.ids= option, a `new_id` write)
    // the re-probe after the unbind gives it straight back to vfio-pci: that is no success
    // (exit 1), and the error names the cause and the fix.
    let host = FakeHost::new();
    let dir = host.bound_to_vfio();
    let system = host.system();
    let _kernel = host.kernel_with(&[], "vfio-pci");
    let error = unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap_err();
    assert!(!unusable(&error), "a failed unbind, not unusable input: {error:#}");
    let error = format!("{error:#}");
    assert!(error.contains("vfio-pci took 0000:00:04.0 back"), "{error}");
    assert!(
        error.contains("vfio-pci.ids=") && error.contains("echo 1b36 0010 > ") && error.contains("bus/pci/drivers/vfio-pci/remove_id"),
        "{error}"
    );
    assert_eq!(override_of(&dir).trim(), "", "the override is cleared");
}

#[test]
fn bind_refuses_a_controller_or_generic_node_a_process_holds_open_unless_forced() {
    // Goal: a process driving the controller through its character devices (nvme-cli or a
    // passthrough job on /dev/nvme0, io_uring passthrough on the generic /dev/ng0n1) holds no
    // block device, yet the unbind pulls the controller from under it: bind finds it in
    // /proc/*/fd, by path or by device number (another node of it, such as /dev/char/M:m), and
    // refuses unless forced.
    let host = FakeHost::new();
    let dir = host.nvme_controller();
    std::fs::write(dir.join("nvme/nvme0/dev"), "241:0\n").unwrap();
    // The generic node of namespace 1, as /dev/null's device number: a real character device
    // the scan can stat.
    let null = std::fs::metadata("/dev/null").unwrap();
    let null_number = {
        use std::os::unix::fs::MetadataExt;
        format!("{}:{}", libc::major(null.rdev()), libc::minor(null.rdev()))
    };
    std::fs::create_dir_all(dir.join("nvme/nvme0/ng0n1")).unwrap();
    std::fs::write(dir.join("nvme/nvme0/ng0n1/dev"), format!("{null_number}\n")).unwrap();
    host.open_fd(555, "nvme", 3, "/dev/nvme0");
    host.open_fd(556, "fio", 4, "/dev/null");
    host.open_fd(99, "bash", 0, "/dev/nvme01");
    let system = host.system();
    let _kernel = host.kernel();
    let error = bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap_err();
    assert!(unusable(&error), "{error:#}");
    let error = error.to_string();
    assert!(error.contains("/dev/nvme0 open by pid 555 (nvme)") && error.contains("/dev/ng0n1 open by pid 556 (fio)"), "{error}");
    assert!(!error.contains("pid 99") && error.contains("--force"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"), "nothing changed");
    assert!(bind(&system, at("0000:00:04.0"), FORCE, &host.lock_dir()).is_ok());
}

#[test]
fn unbind_refuses_only_a_function_bound_to_another_driver() {
    // Goal: what the docs say exit status 2 covers for unbind: a function bound to a driver
    // other than vfio-pci is refused with nothing written; one bound to no driver (a bind that
    // could not be rolled back, a declined probe) is not refused: its override is cleared and
    // the kernel probes it again.
    let host = FakeHost::new();
    let bound = host.add("0000:00:04.0", 0x010802, Some("nvme"), 3, 0, 0);
    let unbound = host.add("0000:00:05.0", 0x010802, None, 4, 1, 0);
    std::fs::write(bound.join("driver_override"), "vfio-pci\n").unwrap();
    std::fs::write(unbound.join("driver_override"), "vfio-pci\n").unwrap();
    let system = host.system();
    let _kernel = host.kernel();
    let error = unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap_err();
    assert!(unusable(&error) && error.to_string().contains("bound to nvme, not vfio-pci"), "{error:#}");
    assert_eq!(override_of(&bound), "vfio-pci\n", "nothing written");

    assert_eq!(unbind(&system, at("0000:00:05.0"), true, false, &host.lock_dir()).unwrap().as_deref(), Some("nvme"));
    assert_eq!(override_of(&unbound).trim(), "", "override cleared");
}

#[test]
fn bind_refuses_a_function_with_sriov_virtual_functions_even_forced() {
    // Goal: vfio-pci refuses a physical function with SR-IOV enabled (the kernel's
    // vfio_pci_core_register_device: "Cannot bind to PF with SR-IOV enabled", EBUSY, since
    // 5.7), and nvme's unbind leaves the VFs enabled: a forced bind unbound nvme (its disks
    // gone, mounted ones too), then failed and rolled back. Refused always (exit 2, nothing
    // written: no override, no unbind), naming the rule and the fix; `tutti devices` shows it
    // blocked; sriov_numvfs 0 is no VF.
    let host = FakeHost::new();
    let dir = host.nvme_controller();
    std::fs::write(dir.join("sriov_numvfs"), "2\n").unwrap();
    let system = host.system();
    let _kernel = host.kernel();
    for overrides in [Overrides::default(), FORCE] {
        let error = bind(&system, at("0000:00:04.0"), overrides, &host.lock_dir()).unwrap_err();
        assert!(unusable(&error), "{error:#}");
        let error = error.to_string();
        assert!(error.contains("2 SR-IOV virtual functions") && error.contains("vfio-pci refuses"), "{error}");
        assert!(error.contains("echo 0 > ") && error.contains("0000:00:04.0/sriov_numvfs") && !error.contains("--force"), "{error}");
        assert_eq!(override_of(&dir), "(null)\n", "nothing written");
        assert_eq!(std::fs::read_to_string(host.sys.join("bus/pci/drivers/nvme/unbind")).unwrap(), "", "nvme not unbound");
        assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("nvme"));
    }
    let readiness = inspect(&system, at("0000:00:04.0")).unwrap().readiness;
    assert!(matches!(&readiness, Readiness::Blocked(reason) if reason.contains("SR-IOV") && reason.contains("echo 0 >")), "{readiness}");

    let idle = FakeHost::new();
    let dir = idle.nvme_controller();
    std::fs::write(dir.join("sriov_numvfs"), "0\n").unwrap();
    let _idle_kernel = idle.kernel();
    assert_eq!(inspect(&idle.system(), at("0000:00:04.0")).unwrap().readiness, Readiness::Bindable);
    assert!(bind(&idle.system(), at("0000:00:04.0"), Overrides::default(), &idle.lock_dir()).is_ok());
}

#[test]
fn bind_neither_makes_the_lock_directory_nor_a_lock_file() {
    // Goal: tuttid may run as a user of its own, whose lock directory (and lock files) must be
    // that user's: `sudo tutti bind` making /run/tutti (root's, 0700) or a root 0600 lock file
    // in it made that tuttid refuse its lock directory, and a directory made for that user
    // made the bind refuse it. bind only takes a lock file that is already there.
    let host = FakeHost::new();
    host.nvme_controller();
    let system = host.system();
    let _kernel = host.kernel();
    let missing = host.lock_dir().join("missing");
    assert!(bind(&system, at("0000:00:04.0"), Overrides::default(), &missing).is_ok());
    assert!(!missing.exists(), "bind made the lock directory");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("vfio-pci"));

    // A directory that is there, with no lock file for the function: none is made.
    host.add("0000:00:05.0", 0x010802, Some("nvme"), 4, 1, 1);
    host.nodes(1, 1);
    std::fs::create_dir_all(host.lock_dir()).unwrap();
    assert!(bind(&system, at("0000:00:05.0"), Overrides::default(), &host.lock_dir()).is_ok());
    assert_eq!(std::fs::read_dir(host.lock_dir()).unwrap().count(), 0, "bind made a lock file");
    assert_eq!(host.driver_of("0000:00:05.0").as_deref(), Some("vfio-pci"));
}

#[test]
fn bind_of_a_function_on_vfio_pci_is_already_bound_while_tuttid_holds_its_lock() {
    // Goal: `tutti bind X` while tuttid serves X (holding its device lock) has nothing to do
    // and says so (exit 0, "already bound"), as before bind took the lock; the lock only
    // matters to a function that is to move.
    let host = FakeHost::new();
    host.bound_to_vfio();
    let system = host.system();
    let spec = tutti_devices::DeviceSpec::Vfio(at("0000:00:04.0"));
    let _tuttid = tutti_devices::DeviceLocks::acquire(std::slice::from_ref(&spec), &host.lock_dir(), false).unwrap();
    assert_eq!(bind(&system, at("0000:00:04.0"), Overrides::default(), &host.lock_dir()).unwrap(), BindOutcome::AlreadyBound);
}

#[test]
fn unbind_names_a_process_holding_another_device_of_the_iommu_group() {
    // Goal: the group open fails with EBUSY also while another device of the same IOMMU group
    // is held (an iommufd cdev bound to iommufd keeps the whole group so): the process holding
    // the sibling's cdev is named from /proc, not called one this tool cannot see; without one
    // in /proc, the message says that another device of the group may be the one in use.
    let host = FakeHost::new();
    let dir = host.bound_to_vfio();
    let sibling = host.add("0000:00:04.1", 0x010802, Some("vfio-pci"), 3, 1, 0);
    std::fs::create_dir_all(sibling.join("vfio-dev/vfio1")).unwrap();
    host.group_node(3, "EBUSY");
    host.open_fd(77, "qemu-system-x86", 9, "/dev/vfio/devices/vfio1");
    let system = host.system();
    let _kernel = host.kernel();

    let error = unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap_err();
    assert!(unusable(&error), "{error:#}");
    let error = format!("{error:#}");
    assert!(error.contains("pid 77 (qemu-system-x86) holds /dev/vfio/devices/vfio1"), "{error}");
    assert_eq!(override_of(&dir), "vfio-pci\n", "override not cleared");

    std::fs::remove_dir_all(host.proc.join("77")).unwrap();
    let error = format!("{:#}", unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap_err());
    assert!(error.contains("or another device of IOMMU group 3 is in use"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("vfio-pci"), "nothing changed");
}

#[test]
fn the_tools_own_descriptors_are_known_by_its_pid_in_the_proc_it_reads() {
    // Goal: with --proc-root at the /proc of another PID namespace, this process has another
    // pid there (what `self` links to): its own group descriptor, held while it unbinds, was
    // taken for another holder's (skipped by std::process::id(), the pid in its own
    // namespace), and a pid equal to that number there is some other process.
    let host = FakeHost::new();
    let dir = host.bound_to_vfio();
    host.group_node(3, "free");
    symlink("4242", host.proc.join("self")).unwrap();
    host.open_fd(4242, "tutti", 5, "/dev/vfio/3");
    let own_number = std::process::id();
    host.open_fd(own_number, "qemu-system-x86", 7, "/dev/vfio/devices/vfio0");
    std::fs::create_dir_all(dir.join("vfio-dev/vfio0")).unwrap();
    let system = host.system();
    let _kernel = host.kernel();
    let error = format!("{:#}", unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap_err());
    assert!(error.contains(&format!("pid {own_number} (qemu-system-x86)")) && !error.contains("pid 4242"), "{error}");

    std::fs::remove_dir_all(host.proc.join(own_number.to_string())).unwrap();
    assert_eq!(unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap().as_deref(), Some("nvme"));
}

#[test]
fn unbind_probes_and_scans_a_noiommu_group_node() {
    // Goal: in VFIO's no-IOMMU mode the group node is /dev/vfio/noiommu-<group>, not
    // /dev/vfio/<group>: it was taken for an iommufd-only kernel's missing node, neither
    // opened (a holder behind hidepid went unseen) nor looked for in /proc.
    let host = FakeHost::new();
    host.bound_to_vfio();
    let vfio = host.proc.with_file_name("dev").join("vfio");
    std::fs::create_dir_all(&vfio).unwrap();
    std::fs::write(vfio.join("noiommu-3"), "EBUSY").unwrap();
    let (system, log) = host.system_logging(Some("0000:00:04.0"));
    let _kernel = host.kernel();
    let error = format!("{:#}", unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap_err());
    assert!(error.contains("/dev/vfio/noiommu-3 is held by a process this tool cannot see"), "{error}");

    std::fs::write(vfio.join("noiommu-3"), "free").unwrap();
    host.open_fd(88, "dpdk", 4, "/dev/vfio/noiommu-3");
    let error = format!("{:#}", unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap_err());
    assert!(error.contains("pid 88 (dpdk) holds /dev/vfio/noiommu-3"), "{error}");
    assert_eq!(host.driver_of("0000:00:04.0").as_deref(), Some("vfio-pci"), "nothing changed");

    std::fs::remove_dir_all(host.proc.join("88")).unwrap();
    log.lock().unwrap().clear();
    assert_eq!(unbind(&system, at("0000:00:04.0"), true, false, &host.lock_dir()).unwrap().as_deref(), Some("nvme"));
    assert_eq!(
        *log.lock().unwrap(),
        ["open vfio/noiommu-3 (driver vfio-pci, override \"vfio-pci\")", "close vfio/noiommu-3 (driver none)"]
    );
}

#[test]
fn unbind_neither_makes_the_lock_directory_nor_a_lock_file() {
    // Goal: as bind, `sudo tutti unbind` takes tuttid's device lock only where its file is
    // already there: making /run/tutti (root's, 0700) or a root 0600 lock file in it made a
    // tuttid running as a user of its own refuse its lock directory from then on.
    let host = FakeHost::new();
    host.bound_to_vfio();
    let system = host.system();
    let _kernel = host.kernel();
    let missing = host.lock_dir().join("missing");
    assert_eq!(unbind(&system, at("0000:00:04.0"), true, false, &missing).unwrap().as_deref(), Some("nvme"));
    assert!(!missing.exists(), "unbind made the lock directory");

    // A directory that is there, with no lock file for the function: none is made.
    let dir = host.add("0000:00:05.0", 0x010802, Some("vfio-pci"), 4, 0, 0);
    std::fs::write(dir.join("driver_override"), "vfio-pci\n").unwrap();
    std::fs::create_dir_all(host.lock_dir()).unwrap();
    assert_eq!(unbind(&system, at("0000:00:05.0"), true, false, &host.lock_dir()).unwrap().as_deref(), Some("nvme"));
    assert_eq!(std::fs::read_dir(host.lock_dir()).unwrap().count(), 0, "unbind made a lock file");
}
