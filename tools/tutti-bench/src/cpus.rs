//! `--cpus_allowed` (fio's option, its default "shared" policy): the CPUs every job thread may
//! run on. A polled driver is sensitive to where its thread runs (SPDK's perf pins itself to
//! one core, `-c`); this lets a comparison pin ours the same way.

use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// A set of CPU numbers, ascending and without repeats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuList(Vec<usize>);

impl CpuList {
    /// Parses fio's syntax: CPU numbers and inclusive ranges, comma separated ("0", "0,2",
    /// "1-3,6"). Every number must be below what the kernel's affinity mask can hold.
    pub fn parse(text: &str) -> Result<Self, String> {
        let accepted = "accepted: CPU numbers and ranges, e.g. 0 or 0,2 or 1-3";
        let limit = CpuSet::count();
        let number = |part: &str| -> Result<usize, String> {
            let value = part.trim().parse::<usize>().map_err(|_| format!("'{text}' is not a CPU list; {accepted}"))?;
            if value >= limit {
                return Err(format!("CPU {value} in '{text}' is beyond the {limit} CPUs an affinity mask holds; {accepted}"));
            }
            Ok(value)
        };
        let mut cpus = Vec::new();
        for part in text.split(',') {
            match part.split_once('-') {
                Some((first, last)) => {
                    let (first, last) = (number(first)?, number(last)?);
                    if first > last {
                        return Err(format!("range {first}-{last} in '{text}' runs backwards; {accepted}"));
                    }
                    cpus.extend(first..=last);
                }
                None => cpus.push(number(part)?),
            }
        }
        cpus.sort_unstable();
        cpus.dedup();
        Ok(Self(cpus))
    }

    /// Confines the calling thread to these CPUs.
    pub fn pin_current_thread(&self) -> Result<(), String> {
        let mut set = CpuSet::new();
        for &cpu in &self.0 {
            set.set(cpu).map_err(|error| format!("CPU {cpu}: {error}"))?;
        }
        // Pid 0: the calling thread.
        sched_setaffinity(Pid::from_raw(0), &set)
            .map_err(|error| format!("cannot run on CPUs {} ({error}): none of them is online and allowed here", self))
    }
}

impl std::fmt::Display for CpuList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let listed: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&listed.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_and_ranges_parse_and_nonsense_is_refused() {
        assert_eq!(CpuList::parse("0").unwrap().to_string(), "0");
        assert_eq!(CpuList::parse("3,1-2,1").unwrap().to_string(), "1,2,3");
        for bad in ["", "x", "1-", "3-1", "0,,1", "99999999"] {
            assert!(CpuList::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn the_calling_thread_is_confined() {
        // Goal: after pinning, the thread's affinity is exactly the list.
        std::thread::spawn(|| {
            CpuList::parse("0").unwrap().pin_current_thread().expect("CPU 0 is online");
            let set = nix::sched::sched_getaffinity(Pid::from_raw(0)).expect("affinity");
            assert!(set.is_set(0).unwrap());
            assert!(!(1..CpuSet::count()).any(|cpu| set.is_set(cpu).unwrap_or(false)));
        })
        .join()
        .expect("pinned thread");
    }
}
