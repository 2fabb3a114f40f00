//! The host as tutti sees it: sysfs (PCI functions, NVMe controllers, block devices), procfs
//! (mounts, swaps) and the block device nodes (an exclusive open), under configurable roots and
//! a replaceable open so tests run against fake trees.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nvme_driver::hw::vfio::{PciAddress, PciSysfs};

/// PCI class code of an NVM Express controller (mass storage / NVM / NVMe).
pub const NVME_CLASS: u32 = 0x010802;

/// Opens a block device node for reading with `O_EXCL`: the kernel answers `EBUSY` while
/// anything claims the device (a mount, a ZFS vdev, any member of a btrfs filesystem, md,
/// device-mapper, swap), also claims /proc/mounts does not name. While the returned handle lives
/// the claim is ours, so nothing else can mount the device in the meantime.
pub type ExclusiveOpen = Box<dyn Fn(&Path) -> std::io::Result<ExclusiveHandle> + Send + Sync>;

/// An exclusive open that succeeded: the device number of the node opened, and the open file
/// (dropping the handle closes it and ends the claim).
pub struct ExclusiveHandle {
    /// `major:minor` as sysfs writes it; None when the node is not a block device.
    pub device_number: Option<String>,
    _open: Box<dyn Send + Sync>,
}

impl ExclusiveHandle {
    pub fn new(device_number: Option<String>, open: Box<dyn Send + Sync>) -> Self {
        Self { device_number, _open: open }
    }
}

/// Exclusive claims on block devices, held until dropped.
pub type ExclusiveClaims = Vec<ExclusiveHandle>;

/// Opens a legacy VFIO group node (`/dev/vfio/<group>`, or `/dev/vfio/noiommu-<group>` in
/// VFIO's no-IOMMU mode) read-write; the open file is returned and closed when dropped. The
/// kernel lets one file at a time open a group, and keeps it from being opened while a device
/// descriptor taken through it is open, or an iommufd cdev (`/dev/vfio/devices/vfioN`) of any
/// of its devices is bound to an iommufd (`VFIO_DEVICE_BIND_IOMMUFD`): EBUSY says someone holds
/// it so, whoever and wherever they are (another PID namespace, a /proc mounted with hidepid).
/// A cdev opened but not yet bound is not seen so, though the kernel's unbind waits for it to
/// be closed as for any holder: only /proc shows it. Replaceable so tests answer for it.
pub type GroupOpen = Box<dyn Fn(&Path) -> std::io::Result<Box<dyn Send + Sync>> + Send + Sync>;

/// What opening a function's VFIO group node showed.
pub enum GroupProbe {
    /// Opened: nothing else held the group, a device taken through it or a device's cdev
    /// bound to iommufd, and while this lives nothing can open the group nor bind a cdev (a
    /// cdev can still be opened, unbound: see [`GroupOpen`]).
    Held(Box<dyn Send + Sync>),
    /// There is no group node (an iommufd-only kernel): only /proc can tell who holds it.
    NoNode,
    /// EBUSY from the group node `node` (`/dev/vfio/<name>`): a process holds the group, a
    /// device of it or a cdev of one bound to iommufd.
    Busy { node: String },
}

/// The names a VFIO group's node may have under `/dev/vfio`: `<group>`, or `noiommu-<group>`
/// for a group of VFIO's no-IOMMU mode (the kernel names it so, never both).
const GROUP_NODE_NAMES: [fn(u32) -> String; 2] = [|group| group.to_string(), |group| format!("noiommu-{group}")];

pub struct System {
    pub sysfs: PciSysfs,
    proc_root: PathBuf,
    /// Where the block device nodes are (`/dev`), for [`System::exclusive_open`].
    dev_root: PathBuf,
    exclusive_open: ExclusiveOpen,
    group_open: GroupOpen,
}

impl System {
    /// The host under these roots, its block device nodes in `dev_root` probed with a real
    /// exclusive open.
    pub fn new(sysfs_root: PathBuf, proc_root: PathBuf, dev_root: PathBuf) -> Self {
        Self::with_exclusive_open(sysfs_root, proc_root, dev_root, Box::new(open_exclusive))
    }

    /// The host with `exclusive_open` answering for its block device nodes (tests give a fake).
    pub fn with_exclusive_open(sysfs_root: PathBuf, proc_root: PathBuf, dev_root: PathBuf, exclusive_open: ExclusiveOpen) -> Self {
        Self { sysfs: PciSysfs::new(sysfs_root), proc_root, dev_root, exclusive_open, group_open: Box::new(open_vfio_group) }
    }

    /// This host with `group_open` answering for its VFIO group nodes (tests give a fake).
    #[cfg(test)]
    pub fn with_group_open(self, group_open: GroupOpen) -> Self {
        Self { group_open, ..self }
    }

    pub fn sysfs_root(&self) -> &Path {
        self.sysfs.root()
    }

    /// Every PCI function whose class is NVMe.
    pub fn nvme_functions(&self) -> Result<Vec<PciAddress>> {
        Ok(self.sysfs.devices()?.into_iter().filter(|&address| self.is_nvme(address)).collect())
    }

    pub fn is_nvme(&self, address: PciAddress) -> bool {
        self.sysfs.hex_attribute(address, "class").is_ok_and(|class| class == NVME_CLASS)
    }

    /// `<root>/bus/pci/drivers/<name>` exists: the driver is loaded.
    pub fn driver_loaded(&self, name: &str) -> bool {
        self.sysfs_root().join("bus/pci/drivers").join(name).is_dir()
    }

    /// The kernel NVMe controllers (`nvme0`, ...) on this function, present while nvme drives it.
    pub fn nvme_controllers(&self, address: PciAddress) -> Vec<String> {
        let mut names: Vec<String> = read_names(&self.sysfs.device_dir(address).join("nvme"))
            .into_iter()
            .filter(|name| name.strip_prefix("nvme").is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit())))
            .collect();
        names.sort();
        names
    }

    /// The model string the kernel read from Identify Controller.
    pub fn controller_model(&self, address: PciAddress, controller: &str) -> Option<String> {
        let path = self.sysfs.device_dir(address).join("nvme").join(controller).join("model");
        std::fs::read_to_string(path).ok().map(|text| text.trim().to_string()).filter(|text| !text.is_empty())
    }

    /// Block devices backed by this function, whatever drives it (nvme, ahci, vmd, a RAID HBA):
    /// every entry of `class/block` whose resolved sysfs device lies under the function's, and
    /// the namespaces (`nvme0n1`) and partitions (`nvme0n1p1`) under its nvme controllers. A
    /// multipath path node `nvme0c0n1` stands for the head disk `nvme0n1`, whose partitions are
    /// listed from `class/block/nvme0n1/`.
    pub fn block_devices(&self, address: PciAddress) -> BTreeSet<String> {
        let mut devices = BTreeSet::new();
        for controller in self.nvme_controllers(address) {
            let controller_dir = self.sysfs.device_dir(address).join("nvme").join(&controller);
            for entry in read_names(&controller_dir) {
                let Some(namespace) = namespace_block_name(&entry) else { continue };
                for child in read_names(&controller_dir.join(&entry)) {
                    if child.starts_with(&format!("{entry}p")) || child.starts_with(&format!("{namespace}p")) {
                        devices.insert(child.replacen(&entry, &namespace, 1));
                    }
                }
                devices.insert(namespace);
            }
        }
        // The function's own directory, resolved as the class/block links resolve (a VMD
        // domain's or an HBA's disks are its descendants in /sys/devices).
        if let Ok(function_dir) = std::fs::canonicalize(self.sysfs.device_dir(address)) {
            let class_block = self.sysfs_root().join("class/block");
            for name in read_names(&class_block) {
                let Ok(device) = std::fs::canonicalize(class_block.join(&name)) else { continue };
                if device.starts_with(&function_dir) {
                    devices.insert(namespace_block_name(&name).unwrap_or(name));
                }
            }
        }
        // With native multipath the controller holds only the hidden path disk; the head disk
        // and its partitions are under nvme-subsystem/, reached through class/block.
        let namespaces: Vec<String> =
            devices.iter().filter(|name| namespace_block_name(name).as_deref() == Some(name.as_str())).cloned().collect();
        for namespace in namespaces {
            for child in read_names(&self.sysfs_root().join("class/block").join(&namespace)) {
                if child
                    .strip_prefix(&format!("{namespace}p"))
                    .is_some_and(|number| !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()))
                {
                    devices.insert(child);
                }
            }
        }
        devices
    }

    /// Mount points, swap areas, stacked devices and other exclusive claims (an open with
    /// `O_EXCL` that the kernel answers with EBUSY) on the given block devices, as
    /// `(device, use)`, and the exclusive opens that succeeded: while they are held nothing else
    /// can claim (mount) those devices. A node whose device number is not the one sysfs gives
    /// for its name is reported as a use: it proves nothing about the disk.
    pub fn uses_of(&self, block_devices: &BTreeSet<String>) -> Result<(Vec<(String, BlockDeviceUse)>, ExclusiveClaims)> {
        let mut uses = Vec::new();
        let mounts_path = self.proc_root.join("mounts");
        let mounts = std::fs::read_to_string(&mounts_path).with_context(|| format!("reading {}", mounts_path.display()))?;
        for line in mounts.lines() {
            let mut fields = line.split_whitespace();
            let (Some(source), Some(target)) = (fields.next(), fields.next()) else { continue };
            if let Some(name) = source.strip_prefix("/dev/").filter(|name| block_devices.contains(*name)) {
                uses.push((name.to_string(), BlockDeviceUse::Mounted(unescape_mount_path(target))));
            }
        }
        // Stacked devices (device-mapper, md RAID, bcache) list themselves as holders; a mount
        // of /dev/mapper/x never names the NVMe device itself.
        for name in block_devices {
            for holder in read_names(&self.sysfs_root().join("class/block").join(name).join("holders")) {
                uses.push((name.clone(), BlockDeviceUse::HeldBy(holder)));
            }
        }
        // /proc/swaps may be absent (no CONFIG_SWAP); then nothing is swapped on the device.
        if let Ok(swaps) = std::fs::read_to_string(self.proc_root.join("swaps")) {
            for line in swaps.lines().skip(1) {
                let Some(source) = line.split_whitespace().next() else { continue };
                if let Some(name) = source.strip_prefix("/dev/").filter(|name| block_devices.contains(*name)) {
                    uses.push((name.to_string(), BlockDeviceUse::Swap));
                }
            }
        }
        // Ordinary openers (a VM's disk, a database on a raw partition) claim nothing: they are
        // found by their descriptors, by path or by device number. Before our own exclusive
        // opens below, and never counting this process.
        let device_numbers: Vec<(&String, Option<String>)> = block_devices
            .iter()
            .map(|name| {
                let dev = std::fs::read_to_string(self.sysfs_root().join("class/block").join(name).join("dev"));
                (name, dev.ok().map(|text| text.trim().to_string()))
            })
            .collect();
        let own_pid = self.own_pid();
        let opened = |fd_path: &Path, target: &Path| -> Option<String> {
            if let Some((name, _)) = device_numbers.iter().find(|(name, _)| target == Path::new("/dev").join(name)) {
                return Some((*name).clone());
            }
            if !may_be_a_file(target) {
                return None;
            }
            let opened_number = block_device_number(fd_path)?;
            device_numbers.iter().find(|(_, number)| number.as_deref() == Some(opened_number.as_str())).map(|(name, _)| (*name).clone())
        };
        for opener in self.openers(|fd_path, target| opened(fd_path, target).is_some()) {
            if Some(opener.pid) == own_pid {
                continue;
            }
            // It may have closed it since: then it is no longer a use.
            if let Some(name) = opened(&opener.fd, &opener.path) {
                uses.push((name, BlockDeviceUse::OpenBy { pid: opener.pid, comm: opener.comm }));
            }
        }
        // Claims none of the above shows (a ZFS vdev, the btrfs members /proc/mounts does not
        // name, and in a container a mount in the host's mount namespace, where /proc/mounts
        // and /proc/*/fd see only the container): the kernel refuses an exclusive open with
        // EBUSY. Any other error (no node in this /dev, not root) leaves the disk unchecked,
        // which is a use too (--force): free is what only a successful open shows. An open
        // that succeeds is kept.
        let mut claims = ExclusiveClaims::new();
        // Partitions are probed and closed at once; only whole disks are held. The kernel
        // (block/bdev.c, bd_may_claim) marks a disk claimed while one of its partitions is, so
        // an exclusive open of the disk fails with EBUSY while we hold a partition: holding
        // both would call every idle partitioned disk claimed. A held whole disk in turn makes
        // any claim of its partitions fail (a mount among them), so holding the disks alone
        // keeps everything under them unclaimable until we let go.
        let (partitions, disks): (Vec<&String>, Vec<&String>) = block_devices.iter().partition(|name| self.is_partition(name));
        for (name, hold) in partitions.into_iter().map(|name| (name, false)).chain(disks.into_iter().map(|name| (name, true))) {
            if uses.iter().any(|(used, _)| used == name) {
                continue;
            }
            match (self.exclusive_open)(&self.dev_root.join(name)) {
                Ok(handle) => {
                    let sysfs_dev = self.sysfs_root().join("class/block").join(name).join("dev");
                    let expected = std::fs::read_to_string(&sysfs_dev).map(|text| text.trim().to_string()).ok();
                    if expected.is_none() || handle.device_number != expected {
                        uses.push((
                            name.clone(),
                            BlockDeviceUse::OtherNode {
                                node: handle.device_number.clone().unwrap_or_else(|| "not a block device".into()),
                                sysfs: expected.unwrap_or_else(|| format!("unreadable ({})", sysfs_dev.display())),
                            },
                        ));
                    }
                    if hold {
                        claims.push(handle);
                    }
                }
                Err(error) if error.raw_os_error() == Some(libc::EBUSY) => uses.push((name.clone(), BlockDeviceUse::ExclusiveClaim)),
                Err(error) => uses.push((
                    name.clone(),
                    BlockDeviceUse::Unchecked { node: self.dev_root.join(name), kind: error.kind(), error: error.to_string() },
                )),
            }
        }
        Ok((uses, claims))
    }

    /// Processes (other than this one) holding a character device of the function's nvme
    /// controllers open: the controller node (`/dev/nvme0`: nvme-cli, admin passthrough) and
    /// the generic namespace nodes (`/dev/ng0n1`: io_uring passthrough), which no block device
    /// check sees. Found by path or, for another node of the same device (`/dev/char/M:m`), by
    /// device number. The generic nodes are those under the controller's sysfs directory and,
    /// for a multipath head (whose node hangs off the subsystem), `ngXnY` of each namespace
    /// disk `nvmeXnY` that has one in `class/nvme-generic`.
    pub fn controller_node_uses(&self, address: PciAddress) -> Vec<(String, BlockDeviceUse)> {
        let mut nodes: Vec<(String, Option<String>)> = Vec::new();
        let read_dev = |dir: &Path| std::fs::read_to_string(dir.join("dev")).ok().map(|text| text.trim().to_string());
        let is_generic = |name: &str| {
            name.strip_prefix("ng")
                .and_then(split_digits)
                .and_then(|(_, rest)| rest.strip_prefix('n'))
                .and_then(split_digits)
                .is_some_and(|(_, tail)| tail.is_empty())
        };
        for controller in self.nvme_controllers(address) {
            let controller_dir = self.sysfs.device_dir(address).join("nvme").join(&controller);
            nodes.push((controller.clone(), read_dev(&controller_dir)));
            for entry in read_names(&controller_dir).into_iter().filter(|entry| is_generic(entry)) {
                let number = read_dev(&controller_dir.join(&entry));
                nodes.push((entry, number));
            }
        }
        for disk in self.block_devices(address) {
            let Some(generic) = disk.strip_prefix("nvme").filter(|_| namespace_block_name(&disk).as_deref() == Some(disk.as_str())) else {
                continue;
            };
            let generic = format!("ng{generic}");
            let dir = self.sysfs_root().join("class/nvme-generic").join(&generic);
            if dir.exists() && !nodes.iter().any(|(name, _)| *name == generic) {
                let number = read_dev(&dir);
                nodes.push((generic, number));
            }
        }
        let opened = |fd_path: &Path, target: &Path| -> Option<String> {
            if let Some((name, _)) = nodes.iter().find(|(name, _)| target == Path::new("/dev").join(name)) {
                return Some(name.clone());
            }
            if !may_be_a_file(target) {
                return None;
            }
            let opened_number = device_number(fd_path, libc::S_IFCHR)?;
            nodes.iter().find(|(_, number)| number.as_deref() == Some(opened_number.as_str())).map(|(name, _)| name.clone())
        };
        let own_pid = self.own_pid();
        let mut uses = Vec::new();
        for opener in self.openers(|fd_path, target| opened(fd_path, target).is_some()) {
            if Some(opener.pid) == own_pid {
                continue;
            }
            if let Some(name) = opened(&opener.fd, &opener.path) {
                uses.push((name, BlockDeviceUse::OpenBy { pid: opener.pid, comm: opener.comm }));
            }
        }
        uses
    }

    /// Whether block device `name` is a partition: the kernel gives partitions, and only
    /// them, a `partition` attribute.
    fn is_partition(&self, name: &str) -> bool {
        self.sysfs_root().join("class/block").join(name).join("partition").exists()
    }

    /// This process's pid in the /proc that is read (`<proc_root>/self`): with a /proc of
    /// another PID namespace it is not `std::process::id()`, which there may be any other
    /// process. None where `self` does not resolve: this process is not in that namespace, and
    /// none of its descriptors show there.
    pub fn own_pid(&self) -> Option<u32> {
        std::fs::read_link(self.proc_root.join("self")).ok()?.to_str()?.parse().ok()
    }

    /// Every process with an open file descriptor that `holds` accepts, given the descriptor's
    /// `/proc/<pid>/fd/<n>` path and the path it links to; a process or descriptor that goes
    /// away (or cannot be read) while scanning is skipped.
    pub fn openers(&self, holds: impl Fn(&Path, &Path) -> bool) -> Vec<Opener> {
        let mut openers = Vec::new();
        for pid in read_names(&self.proc_root) {
            let Ok(pid_number) = pid.parse::<u32>() else { continue };
            let fd_dir = self.proc_root.join(&pid).join("fd");
            for fd in read_names(&fd_dir) {
                let fd_path = fd_dir.join(&fd);
                let Ok(target) = std::fs::read_link(&fd_path) else { continue };
                if holds(&fd_path, &target) {
                    let comm = std::fs::read_to_string(self.proc_root.join(&pid).join("comm")).unwrap_or_default();
                    openers.push(Opener { pid: pid_number, comm: comm.trim().to_string(), fd: fd_path, path: target });
                }
            }
        }
        openers.sort_by(|a, b| (a.pid, &a.path).cmp(&(b.pid, &b.path)));
        openers.dedup_by(|a, b| a.pid == b.pid && a.path == b.path);
        openers
    }

    /// The VFIO device nodes through which user space can hold this function: its group's
    /// `/dev/vfio/<group>` (`/dev/vfio/noiommu-<group>` in no-IOMMU mode) and the iommufd cdevs `/dev/vfio/devices/<name>` (from `vfio-dev/`)
    /// of every device of its IOMMU group, its own included: a cdev bound to iommufd keeps the
    /// whole group from being opened, so a sibling's holder is why the group open fails.
    pub fn vfio_nodes(&self, address: PciAddress, group: Option<u32>) -> Vec<PathBuf> {
        let mut nodes: Vec<PathBuf> =
            group.into_iter().flat_map(|group| GROUP_NODE_NAMES.map(|name| Path::new("/dev/vfio").join(name(group)))).collect();
        let mut device_dirs = vec![self.sysfs.device_dir(address)];
        if let Some(group) = group {
            let members = self.sysfs_root().join("kernel/iommu_groups").join(group.to_string()).join("devices");
            device_dirs.extend(read_names(&members).into_iter().map(|member| members.join(member)));
        }
        for dir in device_dirs {
            for name in read_names(&dir.join("vfio-dev")) {
                nodes.push(Path::new("/dev/vfio/devices").join(name));
            }
        }
        nodes.sort();
        nodes.dedup();
        nodes
    }

    /// Opens `<dev_root>/vfio/<group>` (or, if there is none, `noiommu-<group>`), to see whether
    /// anything holds the group and, while the returned file lives, to keep anything else from
    /// opening it. Another failure than EBUSY or a missing node is an error: the group's use is
    /// then unknown.
    pub fn probe_vfio_group(&self, group: u32) -> Result<GroupProbe> {
        for name in GROUP_NODE_NAMES.map(|name| name(group)) {
            let node = self.dev_root.join("vfio").join(&name);
            match (self.group_open)(&node) {
                Ok(file) => return Ok(GroupProbe::Held(file)),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
                Err(error) if error.raw_os_error() == Some(libc::EBUSY) => {
                    return Ok(GroupProbe::Busy { node: format!("/dev/vfio/{name}") })
                }
                Err(error) => {
                    return Err(anyhow::Error::new(error)
                        .context(format!("opening {} to see whether a process holds the VFIO group", node.display())))
                }
            }
        }
        Ok(GroupProbe::NoNode)
    }

    /// Writes a sysfs attribute the way `echo value > file` does (sysfs ignores the truncation,
    /// a fake tree needs it); never creates files.
    pub fn write_attribute(&self, path: &Path, value: &str) -> Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(path)
            .with_context(|| format!("opening {} for writing (are you root?)", path.display()))?;
        file.write_all(value.as_bytes()).with_context(|| format!("writing {value:?} to {}", path.display()))?;
        Ok(())
    }

    /// Polls the function's driver until `accept` says yes; errors out after `timeout`.
    pub fn wait_for_driver(&self, address: PciAddress, timeout: Duration, accept: impl Fn(Option<&str>) -> bool) -> Result<Option<String>> {
        let deadline = Instant::now() + timeout;
        loop {
            let driver = self.sysfs.driver(address)?;
            if accept(driver.as_deref()) {
                return Ok(driver);
            }
            if Instant::now() >= deadline {
                bail!("{address}: driver is still {} after {} ms", driver.as_deref().unwrap_or("(none)"), timeout.as_millis());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A process holding a file open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opener {
    pub pid: u32,
    /// `/proc/<pid>/comm`, empty when unreadable.
    pub comm: String,
    /// The descriptor, `/proc/<pid>/fd/<n>`.
    pub fd: PathBuf,
    /// What its descriptor links to.
    pub path: PathBuf,
}

impl std::fmt::Display for Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A process names itself (comm), and a path may hold any byte but `/` and NUL.
        let path = self.path.to_string_lossy();
        write!(f, "pid {} ({}) holds {}", self.pid, tutti_cli::printable(&self.comm), tutti_cli::printable(&path))
    }
}

/// How the kernel is using a block device, worded to follow its name ("/dev/nvme0n1 held by
/// dm-0"): each kind reads as itself, not as a mount point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockDeviceUse {
    /// A filesystem mounted at this path (from /proc/mounts, unescaped).
    Mounted(String),
    /// A stacked device (device-mapper, md RAID, bcache) listed under `holders/`.
    HeldBy(String),
    /// An active swap area (from /proc/swaps).
    Swap,
    /// None of the above, but an `O_EXCL` open is refused with EBUSY.
    ExclusiveClaim,
    /// Held open (not exclusively) by this process: a VM's disk, a database's raw device.
    OpenBy { pid: u32, comm: String },
    /// The node `/dev/<name>` is device `node`, sysfs says the disk is `sysfs`: what the node
    /// shows says nothing about the disk.
    OtherNode { node: String, sysfs: String },
    /// The exclusive open of `node` failed other than with EBUSY (no such node in this /dev,
    /// not permitted): a claim only the kernel sees would go unseen. `kind` tells a user who
    /// may not open it (PermissionDenied: not root) from a missing node.
    Unchecked { node: PathBuf, kind: std::io::ErrorKind, error: String },
}

impl std::fmt::Display for BlockDeviceUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // Unescaped from /proc/mounts (where a newline is \012): escaped again to print.
            Self::Mounted(path) => write!(f, "mounted on {}", tutti_cli::printable(path)),
            Self::HeldBy(holder) => write!(f, "held by {holder}"),
            Self::Swap => f.write_str("used as swap"),
            Self::ExclusiveClaim => f.write_str(
                "claimed exclusively by another opener (an O_EXCL open fails with EBUSY: e.g. a ZFS pool or a btrfs filesystem)",
            ),
            Self::OpenBy { pid, comm } => write!(f, "open by pid {pid} ({})", tutti_cli::printable(comm)),
            Self::OtherNode { node, sysfs } => {
                write!(f, "is not the disk of that name: the node is device {node}, sysfs gives {sysfs}, so its use cannot be checked")
            }
            Self::Unchecked { node, error, .. } => write!(
                f,
                "cannot be checked: {}: {error} (an exclusive open is what shows a claim /proc does not, such as a mount in \
                 another mount namespace)",
                node.display()
            ),
        }
    }
}

/// The real [`ExclusiveOpen`]: `open(path, O_RDONLY | O_EXCL)` (tutti-devices' claim opener, as
/// `tutti pool` claims disks), kept open in the handle, with
/// the device number of what was opened (fstat, so it is the node opened, not one swapped in).
fn open_exclusive(path: &Path) -> std::io::Result<ExclusiveHandle> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    use tutti_devices::BlockDeviceOpener;
    let file = tutti_devices::HostBlockDevices.open_exclusive(path)?;
    let metadata = file.metadata()?;
    let device_number = metadata.file_type().is_block_device().then(|| {
        let rdev = metadata.rdev();
        format!("{}:{}", libc::major(rdev), libc::minor(rdev))
    });
    Ok(ExclusiveHandle::new(device_number, Box::new(file)))
}

/// The real [`GroupOpen`]: `open(path, O_RDWR | O_CLOEXEC)` (std sets O_CLOEXEC), as a VFIO
/// user opens the group.
fn open_vfio_group(path: &Path) -> std::io::Result<Box<dyn Send + Sync>> {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
    Ok(Box::new(file))
}

/// Whether a `/proc/<pid>/fd/<n>` link's target can be a file at all (a block device node
/// among them): sockets, pipes and anonymous inodes read `socket:[N]`, `pipe:[N]`,
/// `anon_inode:...`, never a path, and need no stat.
fn may_be_a_file(target: &Path) -> bool {
    target.is_absolute()
}

/// `major:minor` of the block device a path (a `/proc/<pid>/fd/<n>` link) leads to; None for
/// anything else or when it cannot be read.
///
/// `statx` with `AT_STATX_DONT_SYNC` and only the file type asked for: the attributes the kernel
/// has cached are enough to tell a block device node, and a file on a FUSE or NFS mount whose
/// server hangs is answered from them instead of blocking the scan for ever (a full `stat`
/// reaches the file system's getattr).
fn block_device_number(path: &Path) -> Option<String> {
    device_number(path, libc::S_IFBLK)
}

/// `major:minor` of the device of type `kind` (`S_IFBLK`, `S_IFCHR`) a path leads to, as
/// [`block_device_number`] reads it; None for anything else or when it cannot be read.
fn device_number(path: &Path, kind: libc::mode_t) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut buffer = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `c_path` is a NUL-terminated string alive for the call and `buffer` a writable
    // `statx` the kernel fills; nothing else is passed or kept.
    let result = unsafe { libc::statx(libc::AT_FDCWD, c_path.as_ptr(), libc::AT_STATX_DONT_SYNC, libc::STATX_TYPE, buffer.as_mut_ptr()) };
    if result != 0 {
        return None;
    }
    // SAFETY: zeroed before the call, so every field is initialised; statx succeeded and filled it.
    let stat = unsafe { buffer.assume_init() };
    let of_kind = u32::from(stat.stx_mode) & libc::S_IFMT == kind;
    of_kind.then(|| format!("{}:{}", stat.stx_rdev_major, stat.stx_rdev_minor))
}

/// Names of the entries of a directory; empty when it does not exist or cannot be read.
fn read_names(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries.filter_map(|entry| entry.ok()).filter_map(|entry| entry.file_name().to_str().map(str::to_string)).collect()
}

/// `nvme0n1` → `nvme0n1`; `nvme0c1n2` (a multipath path) → `nvme0n2`; anything else → None.
fn namespace_block_name(name: &str) -> Option<String> {
    let rest = name.strip_prefix("nvme")?;
    let (controller, rest) = split_digits(rest)?;
    let rest = match rest.strip_prefix('c') {
        Some(path) => split_digits(path)?.1,
        None => rest,
    };
    let (namespace, tail) = split_digits(rest.strip_prefix('n')?)?;
    tail.is_empty().then(|| format!("nvme{controller}n{namespace}"))
}

/// Splits a leading run of ASCII digits (at least one) from the rest.
fn split_digits(text: &str) -> Option<(&str, &str)> {
    let end = text.bytes().position(|b| !b.is_ascii_digit()).unwrap_or(text.len());
    (end > 0).then(|| text.split_at(end))
}

/// /proc/mounts escapes space, tab, newline and backslash as octal `\NNN`.
fn unescape_mount_path(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let octal = bytes.get(index + 1..index + 4).filter(|digits| digits.iter().all(|d| (b'0'..=b'7').contains(d)));
        match (bytes[index], octal) {
            (b'\\', Some(digits)) => {
                let value = digits.iter().fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                out.push(u8::try_from(value).unwrap_or(b'?'));
                index += 4;
            }
            (byte, _) => {
                out.push(byte);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_names_are_recognised() {
        // Goal: block device names come only from well-formed namespace entries.
        assert_eq!(namespace_block_name("nvme0n1").as_deref(), Some("nvme0n1"));
        assert_eq!(namespace_block_name("nvme3c1n12").as_deref(), Some("nvme3n12"));
        for other in ["nvme0", "nvme0n", "nvme0n1p1", "device", "nvmeXn1", "power", "nvme0c0"] {
            assert_eq!(namespace_block_name(other), None, "{other}");
        }
    }

    #[test]
    fn mount_paths_are_unescaped() {
        assert_eq!(unescape_mount_path(r"/mnt/my\040disk"), "/mnt/my disk");
        assert_eq!(unescape_mount_path(r"/a\\b\9"), r"/a\\b\9");
        assert_eq!(unescape_mount_path(r"/x\134y"), r"/x\y");
    }

    #[test]
    fn text_from_mounts_and_processes_is_printed_with_control_characters_escaped() {
        // Goal: a mount point (unescaped from /proc/mounts, where a newline is \012) and a
        // process's name (/proc/PID/comm, which the process sets) are printed in `tutti devices`
        // and bind/unbind refusals; a newline or an escape sequence there forged or erased lines.
        let texts = [
            BlockDeviceUse::Mounted(unescape_mount_path(r"/mnt/a\012b\033[2K")).to_string(),
            BlockDeviceUse::OpenBy { pid: 7, comm: "qemu\n\u{1b}[2K".into() }.to_string(),
            Opener { pid: 7, comm: "qemu\n".into(), fd: PathBuf::from("/proc/7/fd/3"), path: PathBuf::from("/dev/vfio/\n3") }.to_string(),
        ];
        for text in texts {
            assert!(!text.chars().any(char::is_control), "{text:?}");
            assert!(text.contains(r"\n"), "{text}");
        }
    }

    #[test]
    fn descriptors_that_are_no_files_are_not_looked_at() {
        // Goal: `tutti devices`/`bind` stat what other processes hold open to find block devices
        // opened by another path; sockets, pipes and anonymous inodes cannot be one and are
        // skipped before any stat, and a file is looked at without asking its file system
        // (AT_STATX_DONT_SYNC: a hung FUSE or NFS server cannot block the scan).
        for target in ["socket:[12345]", "pipe:[678]", "anon_inode:[eventfd]", "anon_inode:bpf-map", "net:[4026531840]"] {
            assert!(!may_be_a_file(Path::new(target)), "{target}");
        }
        assert!(may_be_a_file(Path::new("/dev/nvme0n1")));
        assert!(may_be_a_file(Path::new("/var/lib/vm/disk-node")));
        assert_eq!(block_device_number(Path::new("/dev/null")), None, "a character device is no block device");
        assert_eq!(block_device_number(Path::new("/nonexistent/tutti-test")), None);
    }
}
