//! `tutti devices`, `tutti bind`, `tutti unbind`: find NVMe functions and move them between the
//! kernel's nvme driver and vfio-pci.
//!
//! Binding uses `driver_override` (sticky: the function stays with vfio-pci until unbound) and
//! `drivers_probe`, never `new_id`, which would grab every function with the same ids. A bind
//! that fails once the override is written is rolled back: the override is cleared and the
//! function handed back to the driver it had (bounded waits); the error says where it stands,
//! and when that is not where it was, that `tutti unbind` restores it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use nvme_driver::hw::vfio::{describe_blockers, PciAddress, VFIO_PCI_DRIVER};
use tutti_cli::outln;
use tutti_devices::{DeviceError, DEFAULT_LOCK_DIR};

use crate::system::{BlockDeviceUse, GroupProbe, System};
use crate::Unusable;

/// How long the kernel gets to bind or release a function after a probe request (short in unit
/// tests, where one test waits it out on purpose).
const DRIVER_CHANGE_TIMEOUT: Duration = if cfg!(test) { Duration::from_millis(500) } else { Duration::from_secs(10) };

#[derive(Args)]
pub struct DevicesArgs {}

#[derive(Args)]
pub struct BindArgs {
    /// PCI address of the NVMe function, e.g. 0000:00:04.0.
    address: String,
    /// Bind even if the device is in use (a mounted filesystem, swap, a stacked device, any other
    /// claim the kernel reports as EBUSY to an exclusive open, such as a ZFS pool, or a process
    /// holding a disk or the controller's /dev/nvmeN or /dev/ngNnM open: it will stop working).
    /// A function with SR-IOV virtual functions enabled is refused all the same (vfio-pci does
    /// not take one).
    #[arg(long)]
    force: bool,
    /// Bind even if the function is not an NVMe controller (PCI class 0x010802). Its disks are
    /// still checked: a disk in use needs --force as well.
    #[arg(long)]
    not_nvme: bool,
    /// Where `vfio:` devices' lock files live: tuttid's `--lock-dir`, so that a tuttid starting
    /// on the function is refused while it is being bound. Only a lock file already there is
    /// taken: neither the directory nor a file is made (they are the tuttid user's).
    #[arg(long, default_value = DEFAULT_LOCK_DIR)]
    lock_dir: PathBuf,
}

#[derive(Args)]
pub struct UnbindArgs {
    /// PCI address of the NVMe function, e.g. 0000:00:04.0.
    address: String,
    /// Only detach from vfio-pci; do not ask the kernel to probe a driver for it again.
    #[arg(long)]
    no_reprobe: bool,
    /// Unbind even if the function is not an NVMe controller (PCI class 0x010802).
    #[arg(long)]
    not_nvme: bool,
    /// Where `vfio:` devices' lock files live: tuttid's `--lock-dir`, so that a tuttid starting
    /// on the function is refused while it is being unbound. Only a lock file already there is
    /// taken: neither the directory nor a file is made (they are the tuttid user's).
    #[arg(long, default_value = DEFAULT_LOCK_DIR)]
    lock_dir: PathBuf,
}

/// Whether VFIO can take a function, and what stands in the way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Bound to vfio-pci, its IOMMU group holding nothing bound elsewhere (the group's device
    /// node `/dev/vfio/<group>` is not checked here).
    Ready,
    /// `tutti bind` would make it ready.
    Bindable,
    /// Bindable, but the blocking reason must be resolved first (or `--force`d when in use).
    Blocked(String),
    /// Bindable as far as could be seen, but whether its disks are in use could not be checked
    /// (as a user other than root, an exclusive open is not permitted); `tutti bind` refuses it
    /// unless `--force`.
    Unchecked(String),
    /// VFIO cannot take it in this configuration.
    Impossible(String),
}

impl std::fmt::Display for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Readiness::Ready => write!(f, "yes"),
            Readiness::Bindable => write!(f, "after `tutti bind`"),
            Readiness::Blocked(reason) => write!(f, "blocked: {reason}"),
            Readiness::Unchecked(reason) => write!(f, "unknown: {reason}"),
            Readiness::Impossible(reason) => write!(f, "no: {reason}"),
        }
    }
}

/// One row of `tutti devices`.
#[derive(Debug, Clone)]
pub struct DeviceReport {
    pub address: PciAddress,
    pub vendor_id: u32,
    pub device_id: u32,
    pub model: String,
    pub driver: Option<String>,
    pub iommu_group: Option<u32>,
    pub block_devices: Vec<String>,
    pub readiness: Readiness,
}

pub fn inspect(system: &System, address: PciAddress) -> Result<DeviceReport> {
    let vendor_id = system.sysfs.hex_attribute(address, "vendor")?;
    let device_id = system.sysfs.hex_attribute(address, "device")?;
    let driver = system.sysfs.driver(address)?;
    let iommu_group = system.sysfs.iommu_group(address)?;
    let controllers = system.nvme_controllers(address);
    let model = controllers
        .iter()
        .find_map(|controller| system.controller_model(address, controller))
        .unwrap_or_else(|| vendor_name(vendor_id).map_or_else(|| "-".to_string(), |vendor| format!("({vendor})")));
    let block_devices = system.block_devices(address);
    let readiness = readiness(system, address, driver.as_deref(), iommu_group, &block_devices)?;
    Ok(DeviceReport {
        address,
        vendor_id,
        device_id,
        model,
        driver,
        iommu_group,
        block_devices: block_devices.into_iter().collect(),
        readiness,
    })
}

fn readiness(
    system: &System,
    address: PciAddress,
    driver: Option<&str>,
    iommu_group: Option<u32>,
    block_devices: &std::collections::BTreeSet<String>,
) -> Result<Readiness> {
    let Some(group) = iommu_group else {
        return Ok(Readiness::Impossible("no IOMMU group (enable VT-d/AMD-Vi and boot with intel_iommu=on / amd_iommu=on)".into()));
    };
    let blockers = system.sysfs.group_blockers(group, address)?;
    if !blockers.is_empty() {
        return Ok(Readiness::Impossible(format!("IOMMU group {group} shared with {}", describe_blockers(&blockers))));
    }
    if driver == Some(VFIO_PCI_DRIVER) {
        return Ok(Readiness::Ready);
    }
    if let Some(reason) = sriov_blocker(system, address) {
        return Ok(Readiness::Blocked(reason));
    }
    // A disk whose exclusive open failed other than with EBUSY (not root, the usual case here)
    // is a use to `tutti bind`, which then needs --force; here it is no use seen but a check
    // not made, and said so.
    let (mut uses, _claims) = system.uses_of(block_devices)?;
    uses.extend(system.controller_node_uses(address));
    let (unchecked, uses): (Vec<_>, Vec<_>) = uses.into_iter().partition(|(_, how)| matches!(how, BlockDeviceUse::Unchecked { .. }));
    if !uses.is_empty() {
        let list: Vec<String> = uses.iter().map(|(device, how)| format!("{device} {how}")).collect();
        return Ok(Readiness::Blocked(format!("in use: {}", list.join(", "))));
    }
    if !system.driver_loaded(VFIO_PCI_DRIVER) {
        return Ok(Readiness::Blocked("vfio-pci is not loaded (`modprobe vfio-pci`)".into()));
    }
    if !unchecked.is_empty() {
        return Ok(Readiness::Unchecked(describe_unchecked(&unchecked)));
    }
    Ok(Readiness::Bindable)
}

/// Why vfio-pci cannot take `address`, a physical function with SR-IOV virtual functions
/// enabled (None when it has none: `sriov_numvfs` 0, or no such file, no SR-IOV): vfio-pci
/// refuses it (the kernel's vfio_pci_core_register_device, "Cannot bind to PF with SR-IOV
/// enabled", EBUSY, since 5.7), and nvme's unbind leaves the VFs enabled, so no override can
/// help; the VFs must be disabled first. A count that cannot be read is refused the same way.
fn sriov_blocker(system: &System, address: PciAddress) -> Option<String> {
    let path = system.sysfs.device_dir(address).join("sriov_numvfs");
    let count = match std::fs::read_to_string(&path) {
        Ok(text) => match text.trim().parse::<u32>() {
            Ok(0) => return None,
            Ok(count) => format!("{count} SR-IOV virtual functions enabled"),
            Err(_) => format!("SR-IOV virtual functions in an unknown number ({} reads {:?})", path.display(), text.trim()),
        },
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return None,
        Err(error) => format!("SR-IOV virtual functions in an unknown number ({}: {error})", path.display()),
    };
    Some(format!(
        "{count}: vfio-pci refuses a physical function with SR-IOV enabled (\"Cannot bind to PF with SR-IOV enabled\"), \
         whatever the options; `echo 0 > {}` first (its virtual functions, and their disks, go away)",
        path.display()
    ))
}

/// Why the disks whose exclusive open failed (other than with EBUSY) leave their use unknown:
/// the ones this user may not open need root to be checked; any other failure (no node in a
/// container's /dev) is named, with the --force that `tutti bind` would need.
fn describe_unchecked(unchecked: &[(String, BlockDeviceUse)]) -> String {
    let mut denied: Vec<&str> = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    for (device, how) in unchecked {
        match how {
            BlockDeviceUse::Unchecked { kind: std::io::ErrorKind::PermissionDenied, .. } => denied.push(device),
            BlockDeviceUse::Unchecked { node, error, .. } => failed.push(format!("{device} ({}: {error})", node.display())),
            _ => {}
        }
    }
    denied.sort_unstable();
    failed.sort_unstable();
    let mut reasons = Vec::new();
    if !denied.is_empty() {
        reasons.push(format!(
            "{} cannot be checked as this user (an exclusive open is not permitted): run as root to check",
            denied.join(", ")
        ));
    }
    if !failed.is_empty() {
        reasons.push(format!("{} cannot be checked for use; `tutti bind` needs --force", failed.join(", ")));
    }
    reasons.join("; ")
}

/// A few vendors, for functions whose model the kernel has not read (not bound to nvme).
fn vendor_name(vendor_id: u32) -> Option<&'static str> {
    Some(match vendor_id {
        0x1b36 => "Red Hat / QEMU",
        0x8086 => "Intel",
        0x144d => "Samsung",
        0x15b7 => "Western Digital",
        0x1e0f => "KIOXIA",
        0x025e => "Solidigm",
        0x1c5c => "SK hynix",
        0x1344 => "Micron",
        0x1987 => "Phison",
        _ => return None,
    })
}

pub fn run_devices(system: &System, _args: &DevicesArgs) -> Result<()> {
    let functions = system.nvme_functions().context("listing PCI functions")?;
    if functions.is_empty() {
        outln!("no NVMe functions (PCI class 0x010802) under {}", system.sysfs_root().display())?;
        return Ok(());
    }
    outln!("{:<13} {:<9} {:<28} {:<9} {:<5} {:<16} VFIO", "ADDRESS", "ID", "MODEL", "DRIVER", "GROUP", "BLOCK")?;
    for address in functions {
        // One function the kernel describes oddly (a strange iommu_group link, an unreadable
        // vendor) is noted and skipped; the others are still listed.
        let report = match inspect(system, address) {
            Ok(report) => report,
            Err(error) => {
                tutti_cli::errln!("note: {address} skipped: {error:#}");
                continue;
            }
        };
        let block = if report.block_devices.is_empty() { "-".to_string() } else { report.block_devices.join(",") };
        outln!(
            "{:<13} {:04x}:{:04x} {:<28} {:<9} {:<5} {:<16} {}",
            report.address.to_string(),
            report.vendor_id,
            report.device_id,
            // As the device reported it (Identify Controller, through sysfs).
            tutti_cli::printable(&report.model),
            report.driver.as_deref().unwrap_or("-"),
            report.iommu_group.map_or_else(|| "-".to_string(), |group| group.to_string()),
            block,
            report.readiness
        )?;
    }
    Ok(())
}

/// The refusals a caller chose to override; each flag lifts one check only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--force`: take the function's disks away even while in use.
    pub in_use: bool,
    /// `--not-nvme`: act on a function whose class is not NVMe.
    pub not_nvme: bool,
}

/// What `bind` did.
#[derive(Debug, PartialEq, Eq)]
pub enum BindOutcome {
    AlreadyBound,
    Bound { previous_driver: Option<String> },
}

/// Moves `address` to vfio-pci. Refuses non-NVMe functions and devices in use (mounted
/// filesystems, active swap, holders, an exclusive claim such as a ZFS vdev, a process holding
/// a disk or a controller's character device open), each unless its override is given: passing
/// the class check never passes the in-use check; a function with SR-IOV virtual functions
/// enabled, which vfio-pci would not take ([`sriov_blocker`]), always. These refusals,
/// and a function that is not there, are unusable input ([`Unusable`], exit status 2, nothing
/// changed), as `tutti pool` and tutti-bench refuse a device in use. tuttid's device lock
/// (`lock_dir/vfio-BDF.lock`), where its file is already there, is held throughout
/// ([`device_lock`]; neither directory nor file is made): one held by another process
/// is refused the same way, and no tuttid starts on the function (nor a rollback's unbind waits
/// on one) while it moves. Without a file no tuttid has locked the function there yet, and a
/// rollback's unbind is guarded by its own VFIO check.
pub fn bind(system: &System, address: PciAddress, overrides: Overrides, lock_dir: &Path) -> Result<BindOutcome> {
    if !system.sysfs.exists(address) {
        return Err(Unusable(format!("no PCI function {address} (see `tutti devices`)")).into());
    }
    if !system.is_nvme(address) && !overrides.not_nvme {
        return Err(Unusable(format!("{address} is not an NVMe controller (class 0x010802); use --not-nvme to bind it anyway")).into());
    }
    // A function on vfio-pci already has nothing to move, whoever holds its lock (the tuttid
    // serving it): said before the lock is looked at, and again once it is held.
    if system.sysfs.driver(address)?.as_deref() == Some(VFIO_PCI_DRIVER) {
        return Ok(BindOutcome::AlreadyBound);
    }
    let _lock = device_lock(address, lock_dir, "bind")?;
    let previous_driver = system.sysfs.driver(address)?;
    if previous_driver.as_deref() == Some(VFIO_PCI_DRIVER) {
        return Ok(BindOutcome::AlreadyBound);
    }
    if !system.driver_loaded(VFIO_PCI_DRIVER) {
        bail!("vfio-pci is not loaded: run `modprobe vfio-pci` (and make sure the IOMMU is on)");
    }
    if system.sysfs.iommu_group(address)?.is_none() {
        bail!("{address} has no IOMMU group: enable VT-d/AMD-Vi in firmware and boot with intel_iommu=on or amd_iommu=on");
    }
    // No override: nvme's unbind would take the disks away, and vfio-pci then refuse it all
    // the same.
    if let Some(reason) = sriov_blocker(system, address) {
        return Err(Unusable(format!("{address} has {reason}")).into());
    }
    // The exclusive opens stay held until the old driver has let go of the function, so that
    // nothing mounts one of its disks between this check and the unbind.
    let (mut uses, claims) = system.uses_of(&system.block_devices(address))?;
    uses.extend(system.controller_node_uses(address));
    if !uses.is_empty() && !overrides.in_use {
        let list: Vec<String> = uses.iter().map(|(device, how)| format!("/dev/{device} {how}")).collect();
        return Err(Unusable(format!(
            "{address} is in use: {}; unmount first, or pass --force to take it away from the kernel anyway",
            list.join(", ")
        ))
        .into());
    }
    let device_dir = system.sysfs.device_dir(address);
    // Nothing has changed until the override is written; from then on a failure rolls back.
    system.write_attribute(&device_dir.join("driver_override"), VFIO_PCI_DRIVER)?;
    let moved = (|| {
        if previous_driver.is_some() {
            system.write_attribute(&device_dir.join("driver/unbind"), &address.to_string())?;
        }
        system.write_attribute(&system.sysfs_root().join("bus/pci/drivers_probe"), &address.to_string())?;
        system
            .wait_for_driver(address, DRIVER_CHANGE_TIMEOUT, |driver| driver == Some(VFIO_PCI_DRIVER))
            .with_context(|| format!("vfio-pci did not take {address}"))
    })();
    drop(claims);
    match moved {
        Ok(_) => Ok(BindOutcome::Bound { previous_driver }),
        Err(error) => Err(roll_back_bind(system, address, previous_driver.as_deref(), error)),
    }
}

/// After a failed bind: clears the sticky `driver_override` and gives the function back to
/// `previous_driver` (each step bounded), then says in the error where the function stands,
/// and, when it is not back where it was, that `tutti unbind` restores it.
fn roll_back_bind(system: &System, address: PciAddress, previous_driver: Option<&str>, error: anyhow::Error) -> anyhow::Error {
    let device_dir = system.sysfs.device_dir(address);
    let current = || system.sysfs.driver(address).ok().flatten();
    // vfio-pci, having taken it late, is left to a process that holds it through VFIO (a VM
    // that opened the group meanwhile): its unbind would wait for that process, for ever if it
    // has no request handler. A free group stays open through the unbind below.
    let _group = if current().as_deref() == Some(VFIO_PCI_DRIVER) {
        match vfio_free(system, address) {
            Ok(group) => group,
            Err(held) => {
                return error.context(format!(
                    "binding {address} to vfio-pci failed and was not rolled back: {address} is now bound to vfio-pci, \
                     driver_override still vfio-pci (it was {}), left so because {held:#}; `tutti unbind {address}` restores it once \
                     that is stopped",
                    previous_driver.map_or("bound to no driver".to_string(), |driver| format!("bound to {driver}"))
                ));
            }
        }
    } else {
        None
    };
    let override_cleared = system.write_attribute(&device_dir.join("driver_override"), "\n").is_ok();
    // A driver other than the one it had (vfio-pci, late) lets go of it first.
    if current().is_some_and(|driver| Some(driver.as_str()) != previous_driver) {
        let _ = system.write_attribute(&device_dir.join("driver/unbind"), &address.to_string());
        let _ = system.wait_for_driver(address, DRIVER_CHANGE_TIMEOUT, |driver| driver.is_none());
    }
    if previous_driver.is_some() && current().is_none() && override_cleared {
        let _ = system.write_attribute(&system.sysfs_root().join("bus/pci/drivers_probe"), &address.to_string());
        let _ = system.wait_for_driver(address, DRIVER_CHANGE_TIMEOUT, |driver| driver == previous_driver);
    }
    let driver = current();
    let state = format!(
        "{address} is now {}, driver_override {}",
        driver.as_deref().map_or("bound to no driver".to_string(), |driver| format!("bound to {driver}")),
        if override_cleared { "cleared" } else { "still vfio-pci" }
    );
    if override_cleared && driver.as_deref() == previous_driver {
        error.context(format!("binding {address} to vfio-pci failed and was rolled back: {state}, as before"))
    } else {
        error.context(format!(
            "binding {address} to vfio-pci failed and could not be rolled back: {state} (it was {}); `tutti unbind {address}` restores it",
            previous_driver.map_or("bound to no driver".to_string(), |driver| format!("bound to {driver}"))
        ))
    }
}

pub fn run_bind(system: &System, args: &BindArgs) -> Result<()> {
    let address = parse_address(&args.address)?;
    match bind(system, address, Overrides { in_use: args.force, not_nvme: args.not_nvme }, &args.lock_dir)? {
        BindOutcome::AlreadyBound => outln!("{address} is already bound to vfio-pci")?,
        BindOutcome::Bound { previous_driver } => outln!("{address}: {} -> vfio-pci", previous_driver.as_deref().unwrap_or("(no driver)"))?,
    }
    // The function is bound by now: what follows is advice, and failing to read it is a warning
    // (exit 0), not a failed bind.
    let blockers = system.sysfs.iommu_group(address).map_err(anyhow::Error::from).and_then(|group| match group {
        Some(group) => Ok(Some((group, system.sysfs.group_blockers(group, address)?))),
        None => Ok(None),
    });
    match blockers {
        // Best effort (errln!): advice that cannot be written (standard error closed) must not
        // turn a bind that was done into a panic.
        Ok(Some((group, blockers))) if !blockers.is_empty() => {
            tutti_cli::errln!(
                "warning: IOMMU group {group} also holds {}: VFIO will refuse the group until they are bound too",
                describe_blockers(&blockers)
            );
        }
        Ok(_) => {}
        Err(error) => {
            tutti_cli::errln!("warning: {address} is bound to vfio-pci, but its IOMMU group could not be checked: {error:#}");
        }
    }
    Ok(())
}

/// Detaches `address` from vfio-pci and, with `reprobe`, lets the kernel pick its driver again.
/// Returns the driver that took it (None if none did); vfio-pci taking it back (its ids given
/// to vfio-pci) is an error. Refuses, before writing anything, a function that is not an NVMe
/// controller (unless `not_nvme`), one whose tuttid device lock (`lock_dir/vfio-BDF.lock`,
/// taken where its file is there: [`device_lock`], which makes neither directory nor file)
/// another process holds, and one whose VFIO group or device some process holds open (seen by
/// opening the single-open group node, and named from /proc where it shows): the kernel's
/// unbind would wait for that process to let go (for ever, if it has no request handler), with
/// the override already cleared. The group node stays open until the kernel has let go, so
/// nothing opens it in between. The lock is held from before the check to the end, so that a
/// tuttid starting meanwhile (a supervisor's restart) is refused instead of opening the group
/// between the check and the unbind; a tuttid that never locked the function there (no file)
/// finds the group node taken once the check has opened it. These refusals, a function that is not there and one
/// bound to a driver other than vfio-pci are unusable input ([`Unusable`], exit status 2,
/// nothing changed), as `tutti pool` refuses a device whose lock another holds.
pub fn unbind(system: &System, address: PciAddress, reprobe: bool, not_nvme: bool, lock_dir: &Path) -> Result<Option<String>> {
    if !system.sysfs.exists(address) {
        return Err(Unusable(format!("no PCI function {address} (see `tutti devices`)")).into());
    }
    if !system.is_nvme(address) && !not_nvme {
        return Err(Unusable(format!("{address} is not an NVMe controller (class 0x010802); use --not-nvme to unbind it anyway")).into());
    }
    let _lock = device_lock(address, lock_dir, "unbind")?;
    let device_dir = system.sysfs.device_dir(address);
    let driver = system.sysfs.driver(address)?;
    if driver.as_deref().is_some_and(|driver| driver != VFIO_PCI_DRIVER) {
        return Err(
            Unusable(format!("{address} is bound to {}, not vfio-pci: nothing to undo", driver.as_deref().unwrap_or_default())).into()
        );
    }
    // Held from before the override is cleared until the kernel has let go: nothing can open
    // the group in between, and the unbind cannot wait on a holder.
    let group = if driver.is_some() { Some(vfio_free(system, address)?) } else { None };
    // An empty line clears the override, so that the default driver matches again.
    system.write_attribute(&device_dir.join("driver_override"), "\n")?;
    if driver.is_some() {
        system.write_attribute(&device_dir.join("driver/unbind"), &address.to_string())?;
        system.wait_for_driver(address, DRIVER_CHANGE_TIMEOUT, |driver| driver != Some(VFIO_PCI_DRIVER))?;
    }
    drop(group);
    if !reprobe {
        return Ok(None);
    }
    system.write_attribute(&system.sysfs_root().join("bus/pci/drivers_probe"), &address.to_string())?;
    // The kernel probes synchronously, but a driver may also decline: then the function stays
    // unbound, which is not an error. A short bounded wait covers asynchronous probing.
    let driver = system.wait_for_driver(address, Duration::from_secs(2), |driver| driver.is_some()).unwrap_or(None);
    if driver.as_deref() == Some(VFIO_PCI_DRIVER) {
        // Its ids are vfio-pci's own (a module option or a new_id write): the probe that was
        // to hand it to the kernel's driver gave it straight back.
        let id = |name| system.sysfs.hex_attribute(address, name).map_or_else(|_| name.to_uppercase(), |id| format!("{id:04x}"));
        bail!(
            "vfio-pci took {address} back when the kernel probed it again: its ids ({vendor}:{device}) are vfio-pci's, from \
             the vfio-pci.ids= module option or a new_id write; `echo {vendor} {device} > {}` (or drop them from the module \
             options and reload vfio-pci), then run `tutti unbind {address}` again",
            system.sysfs_root().join("bus/pci/drivers/vfio-pci/remove_id").display(),
            vendor = id("vendor"),
            device = id("device"),
        );
    }
    Ok(driver)
}

/// tuttid's device lock on `address` (`lock_dir/vfio-BDF.lock`) for `tutti <command>`, if its
/// lock file is already there ([`tutti_devices::DeviceLocks::acquire_existing`]: neither the
/// directory nor the file is made, for they belong to the user tuttid runs as): held until
/// dropped, so that no tuttid starts on the function while it moves. One another process holds
/// is unusable input naming the holder; a lock file that cannot be used (a symbolic link, not
/// a regular file, not readable) is unusable input too, an I/O failure (EIO, EMFILE) a failure.
fn device_lock(address: PciAddress, lock_dir: &Path, command: &str) -> Result<Option<tutti_devices::DeviceLocks>> {
    match tutti_devices::DeviceLocks::acquire_existing(address, lock_dir) {
        Ok(lock) => Ok(lock),
        Err(error @ DeviceError::DeviceInUse { .. }) => {
            Err(Unusable(format!("{error}; stop it first and run `tutti {command}` again")).into())
        }
        Err(error) => Err(crate::pool::device_refusal(error).context(format!("taking {address}'s device lock"))),
    }
}

/// Refuses ([`Unusable`]) a function some process holds through VFIO: the kernel's unbind would
/// wait for it to let go (for ever, if it has no request handler). Returns the open group node
/// (None where there is none: an iommufd-only kernel), which keeps anything else from opening
/// the group (or binding a device's cdev to iommufd) until dropped. The group's single open
/// sees a holder of the group, of a device descriptor taken through it or of a cdev bound to
/// iommufd, in any PID namespace; a cdev opened but not yet bound, which the kernel's unbind
/// waits on all the same, shows only in /proc ([`crate::system::GroupOpen`]), which also names
/// the holders it can see.
fn vfio_free(system: &System, address: PciAddress) -> Result<Option<Box<dyn Send + Sync>>> {
    let group = system.sysfs.iommu_group(address)?;
    let probe = match group {
        Some(group) => system.probe_vfio_group(group)?,
        None => GroupProbe::NoNode,
    };
    let nodes = system.vfio_nodes(address, group);
    // This process holds the group it just opened: known by its pid in the /proc read.
    let own_pid = system.own_pid();
    let holders: Vec<String> = system
        .openers(|_, target| nodes.iter().any(|node| node == target))
        .iter()
        .filter(|opener| Some(opener.pid) != own_pid)
        .map(ToString::to_string)
        .collect();
    if !holders.is_empty() {
        return Err(Unusable(format!(
            "{address} is in use through VFIO: {}; stop it first (tuttid, a VM) and run `tutti unbind` again",
            holders.join(", ")
        ))
        .into());
    }
    match probe {
        GroupProbe::Held(file) => Ok(Some(file)),
        GroupProbe::NoNode => Ok(None),
        GroupProbe::Busy { node } => Err(Unusable(format!(
            "{address} is in use through VFIO: its group {node} is held by a process this tool cannot see (another \
             PID namespace, /proc mounted with hidepid, or one holding only a device descriptor), or another device of IOMMU \
             group {group} is in use; stop it first (tuttid, a VM) and run `tutti unbind` again",
            group = group.unwrap_or_default()
        ))
        .into()),
    }
}

pub fn run_unbind(system: &System, args: &UnbindArgs) -> Result<()> {
    let address = parse_address(&args.address)?;
    match unbind(system, address, !args.no_reprobe, args.not_nvme, &args.lock_dir)? {
        Some(driver) => outln!("{address}: vfio-pci -> {driver}")?,
        None if args.no_reprobe => outln!("{address}: detached from vfio-pci (no driver)")?,
        None => outln!("{address}: detached from vfio-pci; no driver claimed it (`modprobe nvme`?)")?,
    }
    Ok(())
}

/// A PCI address from the command line; a malformed one is unusable input (exit status 2).
fn parse_address(text: &str) -> Result<PciAddress> {
    text.parse::<PciAddress>()
        .map_err(|_| crate::Unusable(format!("'{text}' is not a PCI address; accepted: DDDD:BB:DD.F or BB:DD.F, e.g. 0000:01:00.0")).into())
}

#[cfg(test)]
#[path = "devices_tests.rs"]
mod tests;
