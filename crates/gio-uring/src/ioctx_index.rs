//! Which IOCTXs of an IOCB each CPU worker owns, built once when the IOCB is filled, so that a
//! worker handed an IOCB goes straight to its own IOCTXs instead of scanning all of them, and a
//! worker that owns none is not handed the IOCB at all.
//!
//! Layout: per IOCB, its IOCTX indices grouped by worker (a counting sort by the owner of each
//! IOCTX's device) in `order`, and per (IOCB, worker) the group's start and length in `ranges`.
//! Everything is allocated at start-up. The caller's thread writes an IOCB's entries in
//! `fill_iocb`, when no worker uses them (an IOCB is refilled only after its completion, and a
//! worker stops reading its group once its IOCTXs are submitted). The channel that hands the IOCB
//! to a worker orders those writes before the worker's reads, so Relaxed accesses suffice.

use std::sync::atomic::{AtomicU32, Ordering};

use crate::layout::QueueMemory;
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

    /// Groups IOCB `id`'s IOCTXs by the worker that owns their device (`owner[device]`; an
    /// out-of-range device goes to worker 0, which fails it as invalid). `counts` is scratch of
    /// one entry per worker.
    pub(crate) fn build(&self, memory: &QueueMemory, id: IocbId, owner: &[usize], counts: &mut [u32]) {
        let header = memory.read_iocb_header(id);
        let worker_of = |index: u32| {
            let device = usize::from(memory.read_ioctx(header.ioctx_first + index).device_index);
            owner.get(device).copied().unwrap_or(0)
        };
        counts.fill(0);
        for index in 0..header.ioctx_count {
            counts[worker_of(index)] += 1;
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
        for index in 0..header.ioctx_count {
            let worker = worker_of(index);
            self.order[order + counts[worker] as usize].store(index, Ordering::Relaxed);
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
    use crate::abi::gio_ioctx;
    use crate::layout::{IocbHeader, QueueConfig};

    #[test]
    fn ioctxs_are_grouped_by_the_worker_owning_their_device() {
        // Goal: devices 0,1,2,0,2 with owners [1, 0, 1] give worker 0 IOCTX 1 and worker 1
        // IOCTXs 0, 2, 3, 4 in their original order; a worker with no device gets nothing.
        let memory = QueueMemory::new(QueueConfig { depth: 2, ioctx_per_iocb_max: 8 }).unwrap();
        let id = IocbId(1);
        let first = memory.layout.ioctx_first(id);
        for (index, device) in [0u16, 1, 2, 0, 2].into_iter().enumerate() {
            let ioctx = gio_ioctx {
                desc_iova: 0,
                data_iova: 0,
                start_lba: 0,
                nsid: 1,
                block_count: 1,
                data_bytes: 512,
                desc_bytes: 0,
                device_index: device,
                descriptor_kind: 0,
                flags: 0,
                reserved0: 0,
            };
            memory.write_ioctx(first + index as u32, &ioctx);
        }
        let header = IocbHeader {
            id: 1,
            ioctx_count: 5,
            ioctx_first: first,
            layer_count: 1,
            layer: 0,
            issue_seq: 0,
            opcode: 2,
            user_data: 0,
            lba_stride_blocks: 0,
            mem_stride_bytes: 0,
            desc_stride_bytes: 0,
        };
        memory.write_iocb_header(id, &header);
        let index = IoctxIndex::new(2, 8, 3);
        index.build(&memory, id, &[1, 0, 1], &mut [0; 3]);
        let group = |worker| {
            let (start, len) = index.range(id, worker);
            (start..start + len).map(|position| index.ioctx_at(id, position)).collect::<Vec<_>>()
        };
        assert_eq!(group(0), vec![1]);
        assert_eq!(group(1), vec![0, 2, 3, 4]);
        assert_eq!(group(2), Vec::<u32>::new());
    }
}
