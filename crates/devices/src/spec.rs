//! Device strings: what each kind names, how it is written, and which kinds a tool accepts.

use std::fmt;
use std::path::PathBuf;

use nvme_driver::hw::vfio::PciAddress;

use crate::size::{format_size, format_size_exact, parse_size};
use crate::DeviceError;

/// Smallest memory (or no-storage) device: below this a namespace holds nothing useful.
pub const MEMORY_DEVICE_BYTES_MIN: u64 = 1 << 20;

/// A device as given on a command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The software controller over a file or block device: `emu:PATH`.
    EmuFile(PathBuf),
    /// The software controller over this many bytes of process memory: `emu:mem:SIZE`.
    EmuMemory(u64),
    /// The software controller in no-storage mode (commands complete without moving data):
    /// `emu:null:SIZE`.
    EmuNull(u64),
    /// An NVMe function bound to vfio-pci: `vfio:BDF`.
    Vfio(PciAddress),
    /// The kernel's io_uring with `O_DIRECT` on a file or block device: `uring:PATH`.
    Uring(PathBuf),
}

/// The kinds of [`DeviceSpec`], for saying which a tool accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    EmuFile,
    EmuMemory,
    EmuNull,
    Vfio,
    Uring,
}

impl DeviceKind {
    pub const ALL: [DeviceKind; 5] = [DeviceKind::EmuFile, DeviceKind::EmuMemory, DeviceKind::EmuNull, DeviceKind::Vfio, DeviceKind::Uring];

    /// How this kind is written.
    pub fn syntax(self) -> &'static str {
        match self {
            DeviceKind::EmuFile => "emu:PATH",
            DeviceKind::EmuMemory => "emu:mem:SIZE",
            DeviceKind::EmuNull => "emu:null:SIZE",
            DeviceKind::Vfio => "vfio:BDF (e.g. vfio:0000:00:04.0)",
            DeviceKind::Uring => "uring:PATH",
        }
    }

    /// "emu:PATH, emu:mem:SIZE, ..." for `kinds`, in the order given.
    pub fn list(kinds: &[DeviceKind]) -> String {
        kinds.iter().map(|kind| kind.syntax()).collect::<Vec<_>>().join(", ")
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::EmuFile(path) => write!(f, "emu:{}", path.display()),
            // Exact, not format_size's rounded form: a printed spec must parse back to itself.
            DeviceSpec::EmuMemory(bytes) => write!(f, "emu:mem:{}", format_size_exact(*bytes)),
            DeviceSpec::EmuNull(bytes) => write!(f, "emu:null:{}", format_size_exact(*bytes)),
            DeviceSpec::Vfio(address) => write!(f, "vfio:{address}"),
            DeviceSpec::Uring(path) => write!(f, "uring:{}", path.display()),
        }
    }
}

impl DeviceSpec {
    /// Parses `text`, accepting only `accepted` kinds (the message lists them).
    pub fn parse(text: &str, accepted: &[DeviceKind]) -> Result<Self, DeviceError> {
        let malformed =
            |reason: String| DeviceError::MalformedSpec { text: text.to_string(), reason, accepted: DeviceKind::list(accepted) };
        let Some((kind, rest)) = text.split_once(':') else {
            return Err(malformed("has no type prefix".into()));
        };
        if rest.is_empty() {
            return Err(malformed("names no path, size or address".into()));
        }
        let spec = match kind {
            // Without a size these would be files named mem and null (created with a tool's
            // create size): almost surely a memory or no-storage device with its size forgotten.
            "emu" if rest == "mem" => {
                return Err(malformed(
                    "names no size: a memory device is emu:mem:SIZE (e.g. emu:mem:256M); a file named mem is emu:./mem".into(),
                ))
            }
            "emu" if rest == "null" => {
                return Err(malformed(
                    "names no size: a no-storage device is emu:null:SIZE (e.g. emu:null:1G); a file named null is emu:./null".into(),
                ))
            }
            "emu" => match (rest.strip_prefix("mem:"), rest.strip_prefix("null:")) {
                (Some(size), _) => DeviceSpec::EmuMemory(memory_size(text, size)?),
                (None, Some(size)) => DeviceSpec::EmuNull(memory_size(text, size)?),
                (None, None) => DeviceSpec::EmuFile(PathBuf::from(rest)),
            },
            "uring" => DeviceSpec::Uring(PathBuf::from(rest)),
            "vfio" => DeviceSpec::Vfio(
                rest.parse::<PciAddress>()
                    .map_err(|_| malformed(format!("names '{rest}', which is not a PCI address like 0000:00:04.0")))?,
            ),
            _ => return Err(malformed(format!("has unknown type '{kind}'"))),
        };
        if !accepted.contains(&spec.kind()) {
            return Err(DeviceError::NotAccepted { spec: text.to_string(), accepted: DeviceKind::list(accepted) });
        }
        Ok(spec)
    }

    pub fn kind(&self) -> DeviceKind {
        match self {
            DeviceSpec::EmuFile(_) => DeviceKind::EmuFile,
            DeviceSpec::EmuMemory(_) => DeviceKind::EmuMemory,
            DeviceSpec::EmuNull(_) => DeviceKind::EmuNull,
            DeviceSpec::Vfio(_) => DeviceKind::Vfio,
            DeviceSpec::Uring(_) => DeviceKind::Uring,
        }
    }

    /// Bytes of process memory the device takes (its backing store), if any. A no-storage
    /// device (`emu:null:`) has a size but no store, so it takes none.
    pub fn memory_bytes(&self) -> Option<u64> {
        match self {
            DeviceSpec::EmuMemory(bytes) => Some(*bytes),
            _ => None,
        }
    }

    /// Whether this is one of the software controller's kinds.
    pub fn is_emulated(&self) -> bool {
        matches!(self, DeviceSpec::EmuFile(_) | DeviceSpec::EmuMemory(_) | DeviceSpec::EmuNull(_))
    }

    /// A sentence about what is under this name, for printed configurations.
    pub fn describe(&self) -> String {
        match self {
            DeviceSpec::EmuFile(path) => format!("software NVMe controller (nvme-emu) over file {}", path.display()),
            DeviceSpec::EmuMemory(bytes) => format!("software NVMe controller (nvme-emu) over {} of memory", format_size(*bytes)),
            DeviceSpec::EmuNull(bytes) => {
                format!("software NVMe controller (nvme-emu) in no-storage mode ({}; data is not moved)", format_size(*bytes))
            }
            DeviceSpec::Vfio(address) => format!("NVMe controller {address} through VFIO"),
            DeviceSpec::Uring(path) => format!("the kernel's io_uring with O_DIRECT on {}", path.display()),
        }
    }
}

fn memory_size(text: &str, size: &str) -> Result<u64, DeviceError> {
    let malformed = |reason: String| DeviceError::MalformedSpec {
        text: text.to_string(),
        reason,
        accepted: format!("a memory size of at least {} like emu:mem:256M", format_size(MEMORY_DEVICE_BYTES_MIN)),
    };
    let bytes = parse_size(size).map_err(|error| malformed(format!("has a bad size: {error}")))?;
    if bytes < MEMORY_DEVICE_BYTES_MIN {
        return Err(malformed(format!("is smaller than {}", format_size(MEMORY_DEVICE_BYTES_MIN))));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_any(text: &str) -> Result<DeviceSpec, DeviceError> {
        DeviceSpec::parse(text, &DeviceKind::ALL)
    }

    #[test]
    fn every_kind_parses_and_prints_back() {
        // Goal: each kind's syntax, the PCI address typed, sizes in fio's units.
        assert_eq!(parse_any("emu:/tmp/x").unwrap(), DeviceSpec::EmuFile("/tmp/x".into()));
        assert_eq!(parse_any("emu:mem:64m").unwrap(), DeviceSpec::EmuMemory(64 << 20));
        assert_eq!(parse_any("emu:null:1g").unwrap(), DeviceSpec::EmuNull(1 << 30));
        assert_eq!(parse_any("uring:/dev/nvme0n1").unwrap(), DeviceSpec::Uring("/dev/nvme0n1".into()));
        let vfio = parse_any("vfio:0000:00:04.0").unwrap();
        assert_eq!(vfio.to_string(), "vfio:0000:00:04.0");
        assert_eq!(parse_any("vfio:00:04.0").unwrap(), vfio, "the domain is optional");
        assert_eq!(parse_any("emu:mem:64m").unwrap().to_string(), "emu:mem:64MiB");
        assert_eq!(parse_any("emu:mem:1T").unwrap().memory_bytes(), Some(1 << 40));
    }

    #[test]
    fn sized_specs_print_in_a_form_that_parses_back_to_the_same_spec() {
        // Goal: Display is exact for memory and no-storage sizes (1536m, 1m + 1 byte, 1 TiB - 1
        // and the sizes around every unit boundary), so a printed spec parses back to itself.
        assert_eq!(DeviceSpec::EmuMemory(1536 << 20).to_string(), "emu:mem:1536MiB");
        assert_eq!(DeviceSpec::EmuNull((1 << 20) + 1).to_string(), "emu:null:1048577");
        let mut sizes = vec![1536 << 20, (1 << 20) + 1, (1 << 40) - 1, u64::MAX];
        for shift in 20..64 {
            let boundary = 1u64 << shift;
            sizes.extend([boundary - 1, boundary, boundary + 1, boundary + (boundary >> 1), boundary + (1 << 10)]);
        }
        for bytes in sizes.into_iter().filter(|&bytes| bytes >= MEMORY_DEVICE_BYTES_MIN) {
            for spec in [DeviceSpec::EmuMemory(bytes), DeviceSpec::EmuNull(bytes)] {
                let text = spec.to_string();
                assert_eq!(parse_any(&text).unwrap(), spec, "{bytes} printed as {text}");
            }
        }
    }

    #[test]
    fn bad_strings_say_what_is_wrong_and_what_is_accepted() {
        let message = |text: &str| parse_any(text).unwrap_err().to_string();
        assert!(message("vfio:banana").contains("'banana', which is not a PCI address"), "{}", message("vfio:banana"));
        assert!(message("nvme:/dev/x").contains("unknown type 'nvme'") && message("nvme:/dev/x").contains("uring:PATH"));
        assert!(message("/dev/x").contains("no type prefix"));
        assert!(message("emu:").contains("names no path"));
        assert!(message("emu:mem:4q").contains("unknown suffix 'q'"), "{}", message("emu:mem:4q"));
        assert!(message("emu:mem:4k").contains("smaller than 1MiB"));
        // emu:mem and emu:null without a size are not files named mem and null.
        for (text, syntax) in [("emu:mem", "emu:mem:SIZE"), ("emu:null", "emu:null:SIZE")] {
            let error = message(text);
            assert!(error.starts_with(&format!("device '{text}' names no size")), "{error}");
            assert!(error.contains(syntax) && error.contains("emu:./"), "{error}");
        }
        assert_eq!(parse_any("emu:./mem").unwrap(), DeviceSpec::EmuFile("./mem".into()), "a file named mem");
        assert_eq!(parse_any("emu:memory.img").unwrap(), DeviceSpec::EmuFile("memory.img".into()));
        // A tool that takes only some kinds names those.
        let error = DeviceSpec::parse("uring:/dev/x", &[DeviceKind::Vfio, DeviceKind::EmuFile]).unwrap_err().to_string();
        assert!(error.contains("uring:/dev/x cannot be used here; accepted: vfio:BDF"), "{error}");
        assert!(!error.contains("emu:mem"), "{error}");
    }
}
