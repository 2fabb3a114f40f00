//! The device `io` measures on: the software controller (over a file or memory) or an NVMe
//! function bound to vfio-pci, brought up through `nvme-driver`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use nvme_driver::{Controller, ControllerConfig, DeviceBackend, Namespace};
use nvme_emu::{EmuConfig, EmuDevice, NamespaceConfig};
use tutti_devices::open::EmuOptions;
use tutti_devices::{open_in_one_space, DeviceKind, DeviceLocks, DeviceSpec, OpenedDevice};

use crate::unusable;

/// What `--device` may name (no temporary file: that is what no `--device` means).
pub const DEVICE_KINDS: [DeviceKind; 3] = [DeviceKind::EmuFile, DeviceKind::EmuMemory, DeviceKind::Vfio];

/// Whether measuring writes would overwrite data that existed before the run (`None`: the
/// temporary device).
pub fn holds_prior_data(spec: Option<&DeviceSpec>) -> bool {
    match spec {
        None | Some(DeviceSpec::EmuMemory(_) | DeviceSpec::EmuNull(_)) => false,
        Some(DeviceSpec::EmuFile(path)) => path.exists(),
        Some(DeviceSpec::Vfio(_) | DeviceSpec::Uring(_)) => true,
    }
}

/// A size for clap (`4096`, `64K`, `256M`, `1G`: tutti-devices' sizes), more than zero.
pub fn parse_size(text: &str) -> Result<u64, String> {
    match tutti_devices::parse_size(text) {
        Ok(0) => Err(format!("size '{text}' must be more than 0")),
        Ok(bytes) => Ok(bytes),
        Err(error) => Err(error.to_string()),
    }
}

/// A file this run created; removed when dropped.
#[derive(Debug)]
struct TemporaryFile(PathBuf);

impl Drop for TemporaryFile {
    fn drop(&mut self) {
        // Best effort: a file that cannot be removed is reported, not fatal.
        if let Err(error) = std::fs::remove_file(&self.0) {
            if error.kind() != std::io::ErrorKind::NotFound {
                eprintln!("warning: could not remove temporary device file {}: {error}", self.0.display());
            }
        }
    }
}

/// What the backend must support.
#[derive(Clone, Copy, Debug)]
pub struct Requirements {
    /// Bytes of namespace the grid touches (an emulated device is created this large).
    pub span_bytes: u64,
    /// Largest single command (one IOCTX).
    pub command_bytes: u64,
    /// I/O queue pairs needed at once (one per CPU worker).
    pub queue_pairs: u16,
}

/// A controller brought up and ready for queue pairs. Fields drop in order: the controller
/// (which shuts the device down) before the software controller's thread and its file.
pub struct Backend {
    pub controller: Controller,
    pub namespace: Namespace,
    /// For the table's provenance: what the device is.
    pub description: String,
    _emulator: Option<Arc<EmuDevice>>,
    _temporary: Option<TemporaryFile>,
}

impl Backend {
    /// Opens `spec`, or a software controller over a temporary file when `None`.
    /// `emu_file_is_new`: an `emu:` file this run created (empty, to lock it) is grown to the
    /// span; any other keeps its size. `locks`: what the run holds on `spec`; an `emu:` file
    /// the controller opens (by its path, again) must be the one locked there, else it is
    /// refused (exit 2) before anything is written: one renamed or copied over the path since
    /// the lock is another's to hold (a live tuttid's pool, say).
    pub fn open(spec: Option<&DeviceSpec>, needs: Requirements, emu_file_is_new: bool, locks: &DeviceLocks) -> Result<Self> {
        let Some(spec) = spec else {
            let path = temporary_path();
            // Registered before the controller creates it, so that a failed start removes it.
            let guard = TemporaryFile(path.clone());
            let what = format!("nvme-emu software controller over temporary file {} (host page cache)", path.display());
            // The run's own file, which nothing locks: nothing to compare.
            let mut backend = Self::emu(&DeviceSpec::EmuFile(path), Some(needs.span_bytes), needs, what, None)?;
            backend._temporary = Some(guard);
            return Ok(backend);
        };
        match spec {
            DeviceSpec::EmuFile(path) => {
                // An existing file keeps its size: growing a user's file is not ours to do.
                let create_bytes = (emu_file_is_new || !path.exists()).then_some(needs.span_bytes);
                let description = format!("nvme-emu software controller over file {} (host page cache)", path.display());
                Self::emu(spec, create_bytes, needs, description, Some(locks))
            }
            DeviceSpec::EmuMemory(bytes) => {
                let description = format!("nvme-emu software controller over {} of memory", tutti_devices::format_size(*bytes));
                Self::emu(spec, None, needs, description, Some(locks))
            }
            DeviceSpec::Vfio(address) => {
                let device = open_one(spec, &EmuOptions::default(), Some(locks))?;
                let controller = Self::bring_up(device.backend, needs).with_context(|| format!("vfio:{address}"))?;
                let identify = controller.identify();
                let description = format!(
                    "NVMe controller {address} through VFIO ({} firmware {}, volatile write cache {})",
                    identify.model_number.trim(),
                    identify.firmware_revision.trim(),
                    match controller.volatile_write_cache() {
                        Ok(true) => "on",
                        Ok(false) => "off",
                        Err(_) => "unknown",
                    }
                );
                Self::finish(controller, description, None, needs)
            }
            DeviceSpec::EmuNull(_) | DeviceSpec::Uring(_) => {
                Err(unusable(format!("{spec} cannot be measured here; accepted: {}", DeviceKind::list(&DEVICE_KINDS))))
            }
        }
    }

    fn emu(
        spec: &DeviceSpec,
        create_bytes: Option<u64>,
        needs: Requirements,
        description: String,
        locks: Option<&DeviceLocks>,
    ) -> Result<Self> {
        // MDTS large enough that one IOCTX is one command, as the executor requires.
        let mut mdts = 5u8;
        while (4096u64 << mdts) < needs.command_bytes && mdts < 12 {
            mdts += 1;
        }
        let config = EmuConfig::default()
            .with_namespaces(vec![NamespaceConfig::new(4096, None)])
            .with_mdts(mdts)
            // Off: a completed write has reached the backing store, as on a device without a
            // volatile cache (a 32 MiB cache would make small write kernels look free).
            .with_volatile_write_cache(false)
            .with_io_queue_pairs_max(needs.queue_pairs.max(1));
        let device = open_one(spec, &EmuOptions { config, create_bytes }, locks)?;
        let emulator = device.emulator.clone();
        let controller = Self::bring_up(device.backend, needs).context("bringing up the software NVMe controller")?;
        Self::finish(controller, format!("{description}, volatile write cache off"), emulator, needs)
    }

    fn bring_up(backend: Arc<dyn DeviceBackend>, needs: Requirements) -> Result<Controller> {
        let config = ControllerConfig { io_queue_pairs_requested: needs.queue_pairs.max(1), ..ControllerConfig::default() };
        Ok(Controller::init(backend, config)?)
    }

    fn finish(controller: Controller, description: String, emulator: Option<Arc<EmuDevice>>, needs: Requirements) -> Result<Self> {
        let Some(&namespace) = controller.namespaces().first() else {
            bail!("{description}: no active namespace");
        };
        // What the flags ask beyond what the controller offers is unusable input (exit 2).
        if controller.granted_queue_pairs() < needs.queue_pairs {
            return Err(unusable(format!(
                "{description}: the largest SM budget needs {} CPU workers, each owning an I/O queue pair, but the \
                 controller granted {}; lower --sm-budgets",
                needs.queue_pairs,
                controller.granted_queue_pairs()
            )));
        }
        if controller.max_transfer_bytes() < needs.command_bytes {
            return Err(unusable(format!(
                "{description}: one IOCTX of {} bytes is one command, but the controller takes at most {} bytes per \
                 command; lower --ioctx-bytes",
                needs.command_bytes,
                controller.max_transfer_bytes()
            )));
        }
        Ok(Self { controller, namespace, description, _emulator: emulator, _temporary: None })
    }
}

/// Opens one device through tutti-devices; what it refuses (a memory device larger than the
/// machine can spare, a VFIO function that cannot be opened) is unusable input, and so is a
/// file opened that is not the one `locks` holds at its path (None: a file nothing locks).
fn open_one(spec: &DeviceSpec, emu: &EmuOptions, locks: Option<&DeviceLocks>) -> Result<OpenedDevice> {
    let opened = open_in_one_space(std::slice::from_ref(spec), emu).map_err(|error| unusable(error.to_string()))?;
    let device = opened.into_iter().next().with_context(|| format!("{spec}: nothing was opened"))?;
    if let Some(locks) = locks {
        locks.check_opened(spec, device.backing_file()).map_err(|error| unusable(error.to_string()))?;
    }
    Ok(device)
}

fn temporary_path() -> PathBuf {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    std::env::temp_dir().join(format!("tutti-profile-io-{}-{nanos}.img", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_must_be_positive_and_devices_of_the_accepted_kinds() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert!(parse_size("0").unwrap_err().contains("more than 0"));
        assert!(parse_size("12Q").unwrap_err().contains("unknown suffix"));
        assert!(DeviceSpec::parse("uring:/dev/nvme0n1", &DEVICE_KINDS).is_err());
        assert!(DeviceSpec::parse("emu:mem:64M", &DEVICE_KINDS).is_ok());
        assert!(holds_prior_data(Some(&DeviceSpec::parse("vfio:0000:01:00.0", &DEVICE_KINDS).unwrap())));
        assert!(!holds_prior_data(Some(&DeviceSpec::EmuMemory(1 << 20))));
        assert!(!holds_prior_data(None));
    }

    #[test]
    fn a_file_replaced_after_its_lock_is_refused_before_it_is_written() {
        // Goal: `tutti-profile io` locks an emu: file, then the software controller opens it by
        // its path again; a file renamed and copied over the path in between (another holder's
        // pool, say) got the measurement's write pattern, unlocked. Refused, status 2, naming
        // the path, before the controller is brought up.
        let directory = std::env::temp_dir().join(format!("tutti-profile-io-test-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let path = directory.join("p.img");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let spec = DeviceSpec::parse(&format!("emu:{}", path.display()), &DEVICE_KINDS).unwrap();
        let locks = DeviceLocks::acquire_leaving_modes(std::slice::from_ref(&spec), &directory, false).unwrap();
        let moved = directory.join("moved.img");
        std::fs::rename(&path, &moved).unwrap();
        std::fs::copy(&moved, &path).unwrap();
        let error = open_one(&spec, &EmuOptions::default(), Some(&locks)).err().map(|error| format!("{error:#}"));
        let unusable = open_one(&spec, &EmuOptions::default(), Some(&locks)).err().map(|error| error.is::<crate::Unusable>());
        drop(locks);
        std::fs::remove_dir_all(&directory).unwrap();
        let error = error.expect("a file replaced after its lock was opened");
        assert!(error.contains(&path.display().to_string()) && error.contains("replaced"), "{error}");
        assert_eq!(unusable, Some(true), "not status 2");
    }
}
