//! A minimal host for tests: writes SQEs into DMA memory, rings doorbells, polls CQEs, all with
//! deadlines so no test can hang.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::hw::{DeviceBackend, DmaAllocator, DmaPool, DmaRegion, RegisterIo};
use nvme_driver::spec::command::DataPointerKind;
use nvme_driver::spec::data_pointer::SglDescriptor;
use nvme_driver::spec::registers::{self, ControllerConfiguration, ControllerStatus, ShutdownStatus};
use nvme_driver::spec::{CompletionEntry, NvmeStatus, SubmissionEntry};
use nvme_driver::{BlockCount, CommandId, Lba, NamespaceId};

use crate::device::SleepBarrier;
use crate::{EmuConfig, EmuDevice};

pub(crate) const DEADLINE: Duration = Duration::from_secs(5);

/// A block count for a test command (1..=65536, or the test is wrong).
pub(crate) fn block_count(blocks: u32) -> BlockCount {
    BlockCount::new(blocks).expect("1..=65536 blocks")
}

#[derive(Clone)]
pub(crate) struct HostQueue {
    pub id: u16,
    pub entries: u32,
    pub submission: DmaRegion,
    pub completion: DmaRegion,
    pub tail: u32,
    pub head: u32,
    pub phase: bool,
    pub next_command_id: u16,
}

impl HostQueue {
    pub(crate) fn new(dma: &dyn DmaAllocator, id: u16, entries: u32) -> Self {
        let submission = dma.allocate(entries as usize * 64).unwrap();
        let completion = dma.allocate(entries as usize * 16).unwrap();
        Self { id, entries, submission, completion, tail: 0, head: 0, phase: true, next_command_id: 1 }
    }
}

pub(crate) struct TestHost {
    pub device: Arc<EmuDevice>,
    pub registers: Arc<dyn RegisterIo>,
    pub dma: Arc<dyn DmaAllocator>,
    pub admin: HostQueue,
    pub stride_log2: u8,
}

pub(crate) fn status_of(completion: &CompletionEntry) -> Result<(), NvmeStatus> {
    completion.status()
}

impl TestHost {
    /// Starts a device and brings it up (admin queue of `admin_entries`).
    pub(crate) fn start(config: EmuConfig) -> Self {
        Self::start_with_barrier(config, SleepBarrier::detect())
    }

    /// [`TestHost::start`] with the controller thread's sleep handshake chosen by the test.
    pub(crate) fn start_with_barrier(config: EmuConfig, barrier: SleepBarrier) -> Self {
        let stride_log2 = config.doorbell_stride_log2;
        let device = EmuDevice::start_with_barrier(config, &DmaPool::identity(), barrier).expect("start emulator");
        let registers = device.registers();
        let dma = device.dma();
        let admin = HostQueue::new(&*dma, 0, 32);
        let mut host = Self { device, registers, dma, admin, stride_log2 };
        host.enable();
        host
    }

    pub(crate) fn csts(&self) -> ControllerStatus {
        ControllerStatus(self.registers.read32(registers::CSTS))
    }

    pub(crate) fn wait_ready(&self, ready: bool) {
        let deadline = Instant::now() + DEADLINE;
        while self.csts().ready() != ready {
            assert!(Instant::now() < deadline, "CSTS.RDY did not become {ready}: {:?}", self.csts());
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Waits (bounded) for CSTS.SHST to read `status`: the controller thread applies a CC write
    /// after the write returned, as a real controller does.
    pub(crate) fn wait_shutdown(&self, status: ShutdownStatus) {
        let deadline = Instant::now() + DEADLINE;
        while self.csts().shutdown() != status {
            assert!(Instant::now() < deadline, "CSTS.SHST did not become {status:?}: {:?}", self.csts());
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Waits (bounded) for CSTS.CFS = 1.
    pub(crate) fn wait_fatal(&self) {
        let deadline = Instant::now() + DEADLINE;
        while !self.csts().fatal() {
            assert!(Instant::now() < deadline, "CSTS.CFS was never set: {:?}", self.csts());
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    pub(crate) fn enable(&mut self) {
        self.registers.write32(registers::CC, 0);
        self.wait_ready(false);
        self.admin = HostQueue::new(&*self.dma, 0, 32);
        self.registers.write32(registers::AQA, registers::admin_queue_attributes(32, 32));
        self.registers.write64(registers::ASQ, self.admin.submission.iova().0);
        self.registers.write64(registers::ACQ, self.admin.completion.iova().0);
        self.registers.write32(registers::CC, ControllerConfiguration::for_enable().0);
        self.wait_ready(true);
    }

    pub(crate) fn buffer(&self, len: usize) -> DmaRegion {
        self.dma.allocate(len).unwrap()
    }

    pub(crate) fn doorbell(&self, queue: u16, completion: bool) -> usize {
        registers::doorbell_offset(queue, completion, self.stride_log2)
    }

    /// Writes `entry` at the tail (assigning a command id) without ringing.
    pub(crate) fn push(queue: &mut HostQueue, mut entry: SubmissionEntry) -> CommandId {
        let id = CommandId(queue.next_command_id);
        queue.next_command_id = queue.next_command_id.wrapping_add(1);
        entry.set_command_id(id);
        queue.submission.write(queue.tail as usize * 64, &entry.to_bytes()).unwrap();
        queue.tail = (queue.tail + 1) % queue.entries;
        id
    }

    pub(crate) fn ring_submission(&self, queue: &HostQueue) {
        self.registers.write32(self.doorbell(queue.id, false), queue.tail);
    }

    pub(crate) fn ring_completion(&self, queue: &HostQueue) {
        self.registers.write32(self.doorbell(queue.id, true), queue.head);
    }

    /// The next completion if one is posted (does not ring the CQ doorbell).
    pub(crate) fn try_reap(queue: &mut HostQueue) -> Option<CompletionEntry> {
        let offset = queue.head as usize * 16;
        let dword3 = queue.completion.load_u32(offset + 12, Ordering::Acquire).unwrap();
        let (_, _, phase) = CompletionEntry::decode_dword3(dword3);
        if phase != queue.phase {
            return None;
        }
        let mut bytes = [0u8; 16];
        queue.completion.read(offset, &mut bytes).unwrap();
        queue.head += 1;
        if queue.head == queue.entries {
            queue.head = 0;
            queue.phase = !queue.phase;
        }
        Some(CompletionEntry::from_bytes(&bytes))
    }

    /// Waits up to `timeout` for the next completion; rings the CQ head doorbell.
    pub(crate) fn reap_within(&self, queue: &mut HostQueue, timeout: Duration) -> Option<CompletionEntry> {
        let completion = Self::try_reap_within(queue, timeout)?;
        self.ring_completion(queue);
        Some(completion)
    }

    /// Waits up to `timeout` for the next completion without ringing any doorbell.
    pub(crate) fn try_reap_within(queue: &mut HostQueue, timeout: Duration) -> Option<CompletionEntry> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(completion) = Self::try_reap(queue) {
                return Some(completion);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    pub(crate) fn reap(&self, queue: &mut HostQueue) -> CompletionEntry {
        self.reap_within(queue, DEADLINE).expect("completion within the deadline")
    }

    /// Submits one command on `queue` and waits for its completion.
    pub(crate) fn execute_on(&self, queue: &mut HostQueue, entry: SubmissionEntry) -> CompletionEntry {
        let id = Self::push(queue, entry);
        self.ring_submission(queue);
        let completion = self.reap(queue);
        assert_eq!(completion.command_id(), id, "completion for the command submitted");
        completion
    }

    pub(crate) fn admin(&mut self, entry: SubmissionEntry) -> CompletionEntry {
        let mut queue = self.admin.clone();
        let completion = self.execute_on(&mut queue, entry);
        self.admin = queue;
        completion
    }

    /// Creates I/O queue pair `id` with `entries` slots (CQ then SQ).
    pub(crate) fn create_io_pair(&mut self, id: u16, entries: u32) -> HostQueue {
        let queue = HostQueue::new(&*self.dma, id, entries);
        let cq = self.admin(SubmissionEntry::create_io_completion_queue(id, entries, queue.completion.iova().0));
        assert_eq!(status_of(&cq), Ok(()), "create CQ {id}");
        let sq = self.admin(SubmissionEntry::create_io_submission_queue(id, entries, queue.submission.iova().0, id));
        assert_eq!(status_of(&sq), Ok(()), "create SQ {id}");
        queue
    }
}

/// Writes one 4 KiB block of `byte` at `lba` of namespace 1 and checks it completed.
pub(crate) fn write_block(host: &TestHost, queue: &mut HostQueue, lba: u64, byte: u8) {
    let source = host.buffer(4096);
    source.fill(0, 4096, byte).unwrap();
    let entry = with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(lba), block_count(1), false), &source, 4096);
    assert_eq!(status_of(&host.execute_on(queue, entry)), Ok(()));
}

/// Reads one 4 KiB block at `lba` of namespace 1, checking it completed.
pub(crate) fn read_block(host: &TestHost, queue: &mut HostQueue, lba: u64) -> Vec<u8> {
    let target = host.buffer(4096);
    let entry = with_sgl(SubmissionEntry::read(NamespaceId(1), Lba(lba), block_count(1)), &target, 4096);
    assert_eq!(status_of(&host.execute_on(queue, entry)), Ok(()));
    let mut out = vec![0u8; 4096];
    target.read(0, &mut out).unwrap();
    out
}

/// Points `entry` at `buffer` with a single SGL Data Block.
pub(crate) fn with_sgl(mut entry: SubmissionEntry, buffer: &DmaRegion, len: u32) -> SubmissionEntry {
    entry.set_data_pointer_kind(DataPointerKind::Sgl);
    entry.dptr = SglDescriptor::data_block(buffer.iova().0, len).to_dptr();
    entry
}

/// Points `entry` at `len` bytes starting `offset` bytes into `buffer` with PRPs, building a
/// list in `list` when the transfer touches more than two pages.
pub(crate) fn with_prp(mut entry: SubmissionEntry, buffer: &DmaRegion, offset: usize, len: usize, list: &DmaRegion) -> SubmissionEntry {
    let base = buffer.iova().0;
    entry.dptr[0] = base + offset as u64;
    let pages = (offset % 4096 + len).div_ceil(4096);
    let first_page = offset / 4096;
    if pages == 2 {
        entry.dptr[1] = base + (first_page as u64 + 1) * 4096;
    } else if pages > 2 {
        for page in 1..pages {
            list.write((page - 1) * 8, &(base + (first_page + page) as u64 * 4096).to_le_bytes()).unwrap();
        }
        entry.dptr[1] = list.iova().0;
    }
    entry
}
