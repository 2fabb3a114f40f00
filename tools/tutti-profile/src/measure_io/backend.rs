//! The device `io` measures on: the software controller (over a file or memory) or an NVMe
//! function bound to vfio-pci, brought up through `nvme-driver`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use nvme_driver::hw::DeviceBackend;
use nvme_driver::{Controller, ControllerConfig, Namespace};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};

/// What `--device` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// A file-backed software controller on a temporary file, removed afterwards.
    EmuTemporary,
    /// A file-backed software controller; a missing file is created with the size the grid needs.
    EmuFile(PathBuf),
    /// A software controller over process memory of this many bytes.
    EmuMemory(u64),
    /// An NVMe function bound to vfio-pci, by PCI address.
    Vfio(String),
}

impl DeviceSpec {
    pub fn parse(text: &str) -> Result<Self> {
        if let Some(size) = text.strip_prefix("emu:mem:") {
            return Ok(Self::EmuMemory(parse_size(size).with_context(|| format!("--device {text}"))?));
        }
        if let Some(path) = text.strip_prefix("emu:") {
            if path.is_empty() {
                bail!("--device emu: needs a path (emu:PATH) or a memory size (emu:mem:SIZE)");
            }
            return Ok(Self::EmuFile(PathBuf::from(path)));
        }
        if let Some(address) = text.strip_prefix("vfio:") {
            if address.is_empty() {
                bail!("--device vfio: needs a PCI address, e.g. vfio:0000:01:00.0");
            }
            return Ok(Self::Vfio(address.to_string()));
        }
        bail!("--device `{text}`: expected emu:PATH, emu:mem:SIZE or vfio:BDF")
    }

    /// Whether measuring writes would overwrite data that existed before the run.
    pub fn holds_prior_data(&self) -> bool {
        match self {
            Self::EmuTemporary | Self::EmuMemory(_) => false,
            Self::EmuFile(path) => path.exists(),
            Self::Vfio(_) => true,
        }
    }
}

/// `4096`, `64K`, `256M`, `1G` (binary multiples).
pub fn parse_size(text: &str) -> Result<u64> {
    let text = text.trim();
    let (digits, multiplier) = match text.char_indices().last() {
        Some((at, 'k' | 'K')) => (&text[..at], 1u64 << 10),
        Some((at, 'm' | 'M')) => (&text[..at], 1 << 20),
        Some((at, 'g' | 'G')) => (&text[..at], 1 << 30),
        Some((at, 't' | 'T')) => (&text[..at], 1 << 40),
        _ => (text, 1),
    };
    let value: u64 = digits.parse().with_context(|| format!("size `{text}` is not a number with an optional K/M/G/T suffix"))?;
    let bytes = value.checked_mul(multiplier).with_context(|| format!("size `{text}` overflows"))?;
    if bytes == 0 {
        bail!("size `{text}` must be > 0");
    }
    Ok(bytes)
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
    pub fn open(spec: &DeviceSpec, needs: Requirements) -> Result<Self> {
        match spec {
            DeviceSpec::EmuTemporary => {
                let path = temporary_path();
                // Registered before the controller creates it, so that a failed start removes it.
                let guard = TemporaryFile(path.clone());
                let backing = Backing::File { path: path.clone(), create_bytes: Some(needs.span_bytes) };
                let what = format!("nvme-emu software controller over temporary file {} (host page cache)", path.display());
                let mut backend = Self::emu(backing, needs, what)?;
                backend._temporary = Some(guard);
                Ok(backend)
            }
            DeviceSpec::EmuFile(path) => {
                // An existing file keeps its size: growing a user's file is not ours to do.
                let create_bytes = (!path.exists()).then_some(needs.span_bytes);
                let backing = Backing::File { path: path.clone(), create_bytes };
                Self::emu(backing, needs, format!("nvme-emu software controller over file {} (host page cache)", path.display()))
            }
            DeviceSpec::EmuMemory(bytes) => {
                let backing = Backing::Memory { bytes: *bytes };
                Self::emu(backing, needs, format!("nvme-emu software controller over {} of memory", super::format_bytes(*bytes)))
            }
            DeviceSpec::Vfio(address) => {
                let device = nvme_driver::hw::VfioDevice::open(address).map_err(|error| {
                    anyhow::anyhow!("vfio:{address}: {error} (needs the function bound to vfio-pci and access to /dev/vfio)")
                })?;
                let backend: Arc<dyn DeviceBackend> = Arc::new(device);
                let controller = Self::bring_up(backend, needs).with_context(|| format!("vfio:{address}"))?;
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
        }
    }

    fn emu(backing: Backing, needs: Requirements, description: String) -> Result<Self> {
        // MDTS large enough that one IOCTX is one command, as the executor requires.
        let mut mdts = 5u8;
        while (4096u64 << mdts) < needs.command_bytes && mdts < 12 {
            mdts += 1;
        }
        let config = EmuConfig::default()
            .with_backing(backing)
            .with_namespaces(vec![NamespaceConfig::new(4096, None)])
            .with_mdts(mdts)
            // Off: a completed write has reached the backing store, as on a device without a
            // volatile cache (a 32 MiB cache would make small write kernels look free).
            .with_volatile_write_cache(false)
            .with_io_queue_pairs_max(needs.queue_pairs.max(1));
        let device = EmuDevice::start(config).context("starting the software NVMe controller")?;
        let backend: Arc<dyn DeviceBackend> = device.clone();
        let controller = Self::bring_up(backend, needs).context("bringing up the software NVMe controller")?;
        Self::finish(controller, format!("{description}, volatile write cache off"), Some(device), needs)
    }

    fn bring_up(backend: Arc<dyn DeviceBackend>, needs: Requirements) -> Result<Controller> {
        let config = ControllerConfig { io_queue_pairs_requested: needs.queue_pairs.max(1), ..ControllerConfig::default() };
        Ok(Controller::init(backend, config)?)
    }

    fn finish(controller: Controller, description: String, emulator: Option<Arc<EmuDevice>>, needs: Requirements) -> Result<Self> {
        let Some(&namespace) = controller.namespaces().first() else {
            bail!("{description}: no active namespace");
        };
        if controller.granted_queue_pairs() < needs.queue_pairs {
            bail!(
                "{description}: the largest SM budget needs {} CPU workers, each owning an I/O queue pair, but the \
                 controller granted {}; lower --sm-budgets",
                needs.queue_pairs,
                controller.granted_queue_pairs()
            );
        }
        if controller.max_transfer_bytes() < needs.command_bytes {
            bail!(
                "{description}: one IOCTX of {} bytes is one command, but the controller takes at most {} bytes per \
                 command; lower --ioctx-bytes",
                needs.command_bytes,
                controller.max_transfer_bytes()
            );
        }
        Ok(Self { controller, namespace, description, _emulator: emulator, _temporary: None })
    }
}

fn temporary_path() -> PathBuf {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    std::env::temp_dir().join(format!("tutti-profile-io-{}-{nanos}.img", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_and_sizes_parse_and_bad_ones_are_errors() {
        assert_eq!(DeviceSpec::parse("emu:mem:64M").unwrap(), DeviceSpec::EmuMemory(64 << 20));
        assert_eq!(DeviceSpec::parse("emu:/tmp/x.img").unwrap(), DeviceSpec::EmuFile("/tmp/x.img".into()));
        assert_eq!(DeviceSpec::parse("vfio:0000:01:00.0").unwrap(), DeviceSpec::Vfio("0000:01:00.0".into()));
        for bad in ["emu:", "vfio:", "uring:/dev/nvme0n1", "emu:mem:", "emu:mem:12Q", "emu:mem:0", "emu:mem:99999999999T"] {
            assert!(DeviceSpec::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert!(DeviceSpec::Vfio("x".into()).holds_prior_data());
        assert!(!DeviceSpec::EmuMemory(1).holds_prior_data());
    }
}
