//! Which IOCTXs of an IOCB each CPU worker takes, built when the IOCB is issued (the SM budget of
//! the issue decides how many workers share it), so that a worker handed an IOCB goes straight
//! to its own IOCTXs instead of scanning all of them, and a worker dealt none is not handed the
//! IOCB at all.
//!
//! Layout: per IOCB, its IOCTX indices grouped by worker (a counting sort by the worker each
//! IOCTX was dealt) in `order`, and per (IOCB, worker) the group's start and length in `ranges`.
//! Everything is allocated at start-up. The caller's thread writes an IOCB's entries when it
//! issues the IOCB, when no worker uses them (an IOCB is reissued only after its completion, and
//! a worker stops reading its group once its IOCTXs are submitted, before they can complete).
//! The channel that hands the IOCB to a worker orders those writes before the worker's reads, so
//! Relaxed accesses suffice.

use std::sync::atomic::{AtomicU32, Ordering};

use crate::types::IocbId;

#[derive(Debug)]
pub(crate) struct IoctxIndex {
    workers: usize,
    ioctx_per_iocb_max: usize,
    order: Box<[AtomicU32]>,
    ranges: Box<[AtomicU32]>,
}

impl IoctxIndex {
    pub(crate) fn new(depth: u32, ioctx_per_iocb_max: u32, workers: usize) -> Self {
        let atomics = |count: usize| (0..count).map(|_| AtomicU32::new(0)).collect::<Box<[_]>>();
        Self {
            workers,
            ioctx_per_iocb_max: ioctx_per_iocb_max as usize,
            order: atomics(depth as usize * ioctx_per_iocb_max as usize),
            ranges: atomics(depth as usize * workers * 2),
        }
    }

    /// Groups IOCB `id`'s IOCTXs by the worker each was dealt: `assigned[i]` is IOCTX `i`'s
    /// worker (`assigned.len()` is the IOCB's IOCTX count; every entry below the worker count).
    /// `counts` is scratch of one entry per worker.
    pub(crate) fn build(&self, id: IocbId, assigned: &[usize], counts: &mut [u32]) {
        counts.fill(0);
        for &worker in assigned {
            counts[worker] += 1;
        }
        let ranges = id.0 as usize * self.workers * 2;
        let mut start = 0u32;
        for (worker, count) in counts.iter_mut().enumerate() {
            self.ranges[ranges + worker * 2].store(start, Ordering::Relaxed);
            self.ranges[ranges + worker * 2 + 1].store(*count, Ordering::Relaxed);
            let next = start + *count;
            *count = start; // from here on: the next free position of this worker's group
            start = next;
        }
        let order = id.0 as usize * self.ioctx_per_iocb_max;
        for (index, &worker) in assigned.iter().enumerate() {
            self.order[order + counts[worker] as usize].store(index as u32, Ordering::Relaxed);
            counts[worker] += 1;
        }
    }

    /// Positions `start..start + len` of `id`'s order hold `worker`'s IOCTXs.
    pub(crate) fn range(&self, id: IocbId, worker: usize) -> (u32, u32) {
        let at = (id.0 as usize * self.workers + worker) * 2;
        (self.ranges[at].load(Ordering::Relaxed), self.ranges[at + 1].load(Ordering::Relaxed))
    }

    /// The IOCTX index (within the IOCB) at `position` of `id`'s order.
    pub(crate) fn ioctx_at(&self, id: IocbId, position: u32) -> u32 {
        self.order[id.0 as usize * self.ioctx_per_iocb_max + position as usize].load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctxs_are_grouped_by_the_worker_they_were_dealt() {
        // Goal: IOCTXs dealt to workers [1, 0, 1, 1, 1] give worker 0 IOCTX 1 and worker 1
        // IOCTXs 0, 2, 3, 4 in their original order; a worker dealt nothing gets an empty group.
        let id = IocbId(1);
        let index = IoctxIndex::new(2, 8, 3);
        index.build(id, &[1, 0, 1, 1, 1], &mut [0; 3]);
        let group = |worker| {
            let (start, len) = index.range(id, worker);
            (start..start + len).map(|position| index.ioctx_at(id, position)).collect::<Vec<_>>()
        };
        assert_eq!(group(0), vec![1]);
        assert_eq!(group(1), vec![0, 2, 3, 4]);
        assert_eq!(group(2), Vec::<u32>::new());
        // Rebuilt for another issue of the same IOCB (another SM budget), the groups follow.
        index.build(id, &[0, 0, 2, 0, 2], &mut [0; 3]);
        assert_eq!((group(0), group(1), group(2)), (vec![0, 1, 3], vec![], vec![2, 4]));
    }
}
