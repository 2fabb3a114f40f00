//! Whether the host memory a run allocates up front fits the machine: the I/O buffers of the raw
//! workload (numjobs × devices × iodepth × bs, plus one scratch block per job) and the engine KV
//! memory of the kv workload (2 × layers × blocks × object bytes, in every client process an
//! --attach run starts on this host) and of each serve policy's
//! stack (4 prompts of engine blocks, beside its in-memory pool), together with the memory
//! devices (`emu:mem:`), against what the kernel says is available less the same reserve
//! `tutti_devices::check_memory` keeps back for memory devices.
//!
//! Like that check, this is a first line with a message in words, not a guarantee: the
//! allocations themselves are fallible. A machine whose /proc/meminfo cannot be read or has no
//! `MemAvailable` passes.

use tutti_devices::{format_size, memory_shortfall, DeviceSpec};

use crate::Unusable;

const MEMINFO_PATH: &str = "/proc/meminfo";

/// Checks that `asked_bytes` of host memory (what `what` names) fits beside the memory devices
/// among `specs`.
pub fn check_host_memory(what: &str, asked_bytes: u64, specs: &[DeviceSpec], accepted: &str) -> Result<(), Unusable> {
    match std::fs::read_to_string(MEMINFO_PATH) {
        Ok(meminfo) => check_host_memory_with(what, asked_bytes, specs, accepted, &meminfo),
        Err(_) => Ok(()),
    }
}

/// [`check_host_memory`] against the text of a /proc/meminfo.
pub fn check_host_memory_with(what: &str, asked_bytes: u64, specs: &[DeviceSpec], accepted: &str, meminfo: &str) -> Result<(), Unusable> {
    let Some(shortfall) = memory_shortfall(asked_bytes, specs, meminfo) else { return Ok(()) };
    let beside = if shortfall.devices_bytes > 0 {
        format!(" beside {} of memory devices", format_size(shortfall.devices_bytes))
    } else {
        String::new()
    };
    Err(Unusable(format!(
        "{what}: {} of host memory asked{beside}, but only {} can be spared (MemAvailable {} less a reserve of {}); accepted: {accepted}",
        format_size(asked_bytes),
        format_size(shortfall.spare_bytes()),
        format_size(shortfall.available_bytes),
        format_size(shortfall.reserve_bytes),
    )))
}

/// Bytes the raw workload's queues and jobs allocate: `depth` buffers of `bs` per job and
/// device, and one scratch block per job (saturating: past 2^64 it is refused anyway).
pub fn raw_buffer_bytes(numjobs: u32, devices: usize, iodepth: u32, bs: u64) -> u64 {
    let per_job = (devices as u64).saturating_mul(u64::from(iodepth)).saturating_mul(bs).saturating_add(bs);
    per_job.saturating_mul(u64::from(numjobs))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 20 GiB available: 17.5 GiB can be spared.
    const MEMINFO_20G: &str = "MemTotal:       24000000 kB\nMemAvailable:   20971520 kB\n";

    #[test]
    fn buffers_beyond_the_spare_memory_are_refused_in_words() {
        // Goal: 64 jobs × 4096 × 64 MiB of buffers (16 TiB) are refused up front with what was
        // asked, what can be spared and what to change; 1 GiB fits, and counts memory devices.
        let huge = raw_buffer_bytes(64, 1, 4096, 64 << 20);
        let message = check_host_memory_with("I/O buffers", huge, &[], "a smaller --iodepth", MEMINFO_20G).unwrap_err().to_string();
        assert!(message.starts_with("I/O buffers: 16.00TiB of host memory asked, but only 17.50GiB can be spared"), "{message}");
        assert!(message.contains("accepted: a smaller --iodepth"), "{message}");
        check_host_memory_with("I/O buffers", 1 << 30, &[], "", MEMINFO_20G).unwrap();
        let specs = [DeviceSpec::EmuMemory(17 << 30)];
        let message = check_host_memory_with("I/O buffers", 1 << 30, &specs, "", MEMINFO_20G).unwrap_err().to_string();
        assert!(message.contains("beside 17GiB of memory devices"), "{message}");
        // No MemAvailable: passes (the allocation itself is fallible).
        check_host_memory_with("I/O buffers", huge, &[], "", "MemTotal: 1 kB\n").unwrap();
        assert_eq!(raw_buffer_bytes(u32::MAX, usize::MAX, u32::MAX, u64::MAX), u64::MAX);
    }
}
