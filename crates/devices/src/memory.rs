//! Whether memory devices fit: the sum of every `emu:mem:` size must fit what the
//! kernel says is available (`MemAvailable` in /proc/meminfo) less a reserve for the rest of
//! the process and the machine.
//!
//! This is a first line, not a guarantee: with overcommit the kernel may still grant a mapping
//! it cannot back, so the software controller also allocates fallibly (nvme-emu's memory
//! backing refuses with an error rather than aborting). Both are needed: the check gives a
//! message in words before anything starts; the fallible allocation covers what the check
//! cannot see (other processes growing meanwhile, kernels without `MemAvailable`).

use crate::spec::DeviceSpec;
use crate::DeviceError;

const MEMINFO_PATH: &str = "/proc/meminfo";
/// Smallest reserve kept back from `MemAvailable`.
const RESERVE_BYTES_MIN: u64 = 256 << 20;
/// The reserve is at least this fraction (1/n) of `MemAvailable`: engine memory, page cache,
/// other processes.
const RESERVE_DIVISOR: u64 = 8;

/// The part of `available_bytes` kept back from memory devices.
pub fn memory_reserve_bytes(available_bytes: u64) -> u64 {
    (available_bytes / RESERVE_DIVISOR).max(RESERVE_BYTES_MIN)
}

/// Checks that the memory devices among `specs` fit this machine's available memory. Passes
/// (leaving the fallible allocation to refuse) when /proc/meminfo cannot be read or has no
/// `MemAvailable` (kernels before 3.14).
pub fn check_memory(specs: &[DeviceSpec]) -> Result<(), DeviceError> {
    match std::fs::read_to_string(MEMINFO_PATH) {
        Ok(meminfo) => check_memory_with(specs, &meminfo),
        Err(_) => Ok(()),
    }
}

/// [`check_memory`] against the text of a /proc/meminfo.
pub fn check_memory_with(specs: &[DeviceSpec], meminfo: &str) -> Result<(), DeviceError> {
    let memory: Vec<&DeviceSpec> = specs.iter().filter(|spec| spec.memory_bytes().is_some()).collect();
    if memory.is_empty() {
        return Ok(());
    }
    match memory_shortfall(0, specs, meminfo) {
        None => Ok(()),
        Some(shortfall) => Err(DeviceError::NotEnoughMemory {
            specs: memory.iter().map(ToString::to_string).collect::<Vec<_>>().join(" + "),
            asked_bytes: shortfall.devices_bytes,
            available_bytes: shortfall.available_bytes,
            reserve_bytes: shortfall.reserve_bytes,
        }),
    }
}

/// What a host allocation and the memory devices beside it would need past what can be spared:
/// the figures a refusal names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryShortfall {
    /// The memory devices' sizes, summed (saturating).
    pub devices_bytes: u64,
    /// `MemAvailable`.
    pub available_bytes: u64,
    /// What is kept back from it ([`memory_reserve_bytes`]).
    pub reserve_bytes: u64,
}

impl MemoryShortfall {
    /// `MemAvailable` less the reserve: what memory devices and host allocations may take.
    pub fn spare_bytes(&self) -> u64 {
        self.available_bytes.saturating_sub(self.reserve_bytes)
    }
}

/// Whether `host_bytes` of host memory plus the memory devices among `specs` fit `MemAvailable`
/// (from the text of a /proc/meminfo) less the reserve: `None` when they fit, or when the text
/// has no readable `MemAvailable` (the fallible allocations refuse then); otherwise the figures.
/// The one place both the device check and the tools' host-memory checks do this arithmetic.
pub fn memory_shortfall(host_bytes: u64, specs: &[DeviceSpec], meminfo: &str) -> Option<MemoryShortfall> {
    let available_bytes = mem_available_bytes(meminfo)?;
    let devices_bytes = specs.iter().filter_map(DeviceSpec::memory_bytes).fold(0u64, u64::saturating_add);
    let shortfall = MemoryShortfall { devices_bytes, available_bytes, reserve_bytes: memory_reserve_bytes(available_bytes) };
    (host_bytes.saturating_add(devices_bytes) > shortfall.spare_bytes()).then_some(shortfall)
}

/// `MemAvailable:   23759532 kB` in bytes, from the text of `/proc/meminfo` (None when the
/// line is missing or malformed).
pub fn mem_available_bytes(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|line| line.starts_with("MemAvailable:"))?;
    let mut words = line["MemAvailable:".len()..].split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::DeviceKind;

    const MEMINFO_24G: &str = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20971520 kB\nBuffers: 1 kB\n";

    fn specs(texts: &[&str]) -> Vec<DeviceSpec> {
        texts.iter().map(|text| DeviceSpec::parse(text, &DeviceKind::ALL).unwrap()).collect()
    }

    #[test]
    fn a_memory_device_larger_than_available_memory_is_refused_in_words() {
        // Goal: emu:mem:1T and emu:mem:30G on a machine with 20 GiB available are refused with the
        // size asked, what is available and the fix; 16 GiB fits (20 GiB less a 2.5 GiB reserve).
        for too_big in ["emu:mem:1T", "emu:mem:30G"] {
            let message = check_memory_with(&specs(&[too_big]), MEMINFO_24G).unwrap_err().to_string();
            assert!(message.contains("MemAvailable 20GiB") && message.contains("use emu:PATH"), "{message}");
        }
        let message = check_memory_with(&specs(&["emu:mem:1T"]), MEMINFO_24G).unwrap_err().to_string();
        assert!(message.starts_with("emu:mem:1TiB: 1TiB of memory asked, but only 17.50GiB can be spared"), "{message}");
        check_memory_with(&specs(&["emu:mem:16G"]), MEMINFO_24G).unwrap();
    }

    #[test]
    fn memory_devices_are_summed_and_other_kinds_ignored() {
        let message = check_memory_with(&specs(&["emu:mem:10G", "emu:mem:10G"]), MEMINFO_24G).unwrap_err().to_string();
        assert!(message.contains("emu:mem:10GiB + emu:mem:10GiB: 20GiB"), "{message}");
        // A no-storage controller has a size but allocates no store (nvme-emu's Store::Null).
        check_memory_with(&specs(&["emu:/tmp/x", "vfio:0000:00:04.0", "uring:/dev/x", "emu:null:1T"]), "MemAvailable: 1 kB\n").unwrap();
    }

    #[test]
    fn an_unreadable_meminfo_leaves_the_decision_to_the_allocation() {
        check_memory_with(&specs(&["emu:mem:1T"]), "MemTotal: 5 kB\n").unwrap();
        check_memory_with(&specs(&["emu:mem:1T"]), "MemAvailable: lots\n").unwrap();
        assert_eq!(mem_available_bytes("MemAvailable:   2 kB\n"), Some(2048));
    }

    #[test]
    fn host_memory_is_counted_beside_the_memory_devices() {
        // Goal: 17.5 GiB can be spared of 20 GiB available; 10 GiB of host memory fits alone and
        // beside emu:mem:7G, not beside emu:mem:8G; a file-backed device counts nothing.
        assert_eq!(memory_shortfall(10 << 30, &[], MEMINFO_24G), None);
        assert_eq!(memory_shortfall(10 << 30, &specs(&["emu:mem:7G", "emu:/tmp/x"]), MEMINFO_24G), None);
        let shortfall = memory_shortfall(10 << 30, &specs(&["emu:mem:8G"]), MEMINFO_24G).unwrap();
        assert_eq!(shortfall.devices_bytes, 8 << 30);
        assert_eq!(shortfall.spare_bytes(), 17_920 << 20);
        assert_eq!(memory_shortfall(u64::MAX, &specs(&["emu:mem:1T"]), "MemTotal: 5 kB\n"), None);
    }
}
