//! tuttid's process model in one process: the "daemon" owns the software controller (with its
//! register page in a memfd) and creates a detached queue pair whose rings lie in a "client's"
//! DMA window; the client, which has only memfd fds, the layout and the window's IOVA base,
//! maps both memfds a second time through the driver's shared-memory types and drives the queue
//! itself. Nothing in Rust memory is shared between the two sides but plain values.
//!
//! Each test opens with its goal; every wait has a deadline.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme_driver::hw::{AddressSpaceId, DeviceBackend, DmaAllocator, DmaRegion, DmaWindow, RegisterIo, SharedMemory, SharedRegisters};
use nvme_driver::spec::command::DataPointerKind;
use nvme_driver::spec::data_pointer::SglDescriptor;
use nvme_driver::spec::status::{codes, StatusCodeType};
use nvme_driver::spec::{NvmeStatus, SubmissionEntry, COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use nvme_driver::{
    AttachedQueueConfig, BlockCount, Controller, ControllerConfig, DataPointerMode, DataSegment, DetachedQueueLayout, DetachedQueuePair,
    IoQueuePair, Iova, Lba, Namespace, NvmeError,
};
use nvme_emu::{Backing, EmuConfig, EmuDevice, QueueRestriction};

const TIMEOUT: Duration = Duration::from_secs(5);
const WINDOW_BYTES: usize = 2 << 20;
const DEPTH: u32 = 64;

/// What the daemon keeps for one client: the controller, its mapping of the client's window
/// (every region over it holds the mapping alive) and the client's queue pair.
struct Daemon {
    device: Arc<EmuDevice>,
    controller: Controller,
    window: DmaRegion,
}

/// Everything a client receives from the daemon: fds and plain values.
struct Grant {
    registers_fd: OwnedFd,
    registers_bytes: usize,
    iova_base: Iova,
    address_space: AddressSpaceId,
    namespaces: Vec<Namespace>,
    mode: DataPointerMode,
    max_transfer_bytes: u64,
}

impl Daemon {
    fn start(sgl: bool) -> Daemon {
        let config = EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_shared_registers(true).with_sgl(sgl);
        let device = EmuDevice::start(config).expect("software controller");
        let backend: Arc<dyn DeviceBackend> = device.clone();
        let controller = Controller::init(backend, ControllerConfig::default()).expect("bring-up");
        // Placeholder until a client registers: an empty daemon has no window.
        let window = controller.dma().allocate(4096).expect("placeholder");
        Daemon { device, controller, window }
    }

    /// The client's memfd arrives (SCM_RIGHTS in tuttid): check it, map it, register it.
    fn register_window(&mut self, fd: OwnedFd, len: usize) -> Grant {
        let memory = SharedMemory::from_fd(fd, len).expect("client window");
        self.window = self.controller.dma().map_shared(&memory).expect("map window for the device");
        let registers = self.device.shared_register_memory().expect("shared registers");
        Grant {
            registers_fd: registers.fd().try_clone_to_owned().expect("dup"),
            registers_bytes: registers.len(),
            iova_base: self.window.iova(),
            address_space: self.controller.dma().address_space(),
            namespaces: self.controller.namespaces().to_vec(),
            mode: self.controller.data_pointer_mode(),
            max_transfer_bytes: self.controller.max_transfer_bytes(),
        }
    }

    /// Creates the client's queue pair with rings at the IOVAs the client chose in its window.
    fn create_queue(&self, submission: Iova, completion: Iova) -> DetachedQueuePair {
        let at = |iova: Iova, len: usize| {
            let offset = iova.checked_offset_from(self.window.iova()).expect("inside the window") as usize;
            self.window.subregion(offset, len).expect("ring inside the window")
        };
        let rings = (at(submission, DEPTH as usize * SUBMISSION_ENTRY_BYTES), at(completion, DEPTH as usize * COMPLETION_ENTRY_BYTES));
        self.controller.create_detached_queue_pair(DEPTH, Some(rings)).expect("detached pair")
    }

    /// Reads blocks through the daemon's own queue pair (what the device really holds).
    fn read_back(&self, lba: u64, bytes: usize) -> Vec<u8> {
        let mut queue = self.controller.create_io_queue_pair(16).expect("daemon queue");
        let buffer = self.controller.dma().allocate(bytes).expect("buffer");
        let namespace = self.controller.namespaces()[0].id;
        queue.read(namespace, Lba(lba), &[DataSegment::new(buffer.iova(), bytes as u32)], TIMEOUT).expect("daemon read");
        let mut data = vec![0u8; bytes];
        buffer.read(0, &mut data).expect("copy out");
        data
    }
}

/// The client: its own memfd window, its own mapping of the register page, its attached pair.
struct Client {
    window: DmaWindow,
    rings: (DmaRegion, DmaRegion),
    namespaces: Vec<Namespace>,
    pair: Option<IoQueuePair>,
}

impl Client {
    fn new(daemon: &mut Daemon) -> (Client, Grant) {
        let memory = SharedMemory::create("client-window", WINDOW_BYTES).expect("window memfd");
        let grant = daemon.register_window(memory.fd().try_clone_to_owned().expect("dup"), WINDOW_BYTES);
        let window = DmaWindow::new(memory, grant.iova_base, grant.address_space).expect("window");
        let submission = window.allocate(DEPTH as usize * SUBMISSION_ENTRY_BYTES).expect("SQ");
        let completion = window.allocate(DEPTH as usize * COMPLETION_ENTRY_BYTES).expect("CQ");
        let namespaces = grant.namespaces.clone();
        (Client { window, rings: (submission, completion), namespaces, pair: None }, grant)
    }

    fn attach(&mut self, grant: Grant, layout: DetachedQueueLayout) -> Result<(), NvmeError> {
        let registers = SharedMemory::from_fd(grant.registers_fd, grant.registers_bytes).expect("register page");
        let registers: Arc<dyn RegisterIo> = Arc::new(SharedRegisters::new(registers));
        let config = AttachedQueueConfig {
            layout,
            namespaces: grant.namespaces,
            data_pointer_mode: grant.mode,
            max_transfer_bytes: grant.max_transfer_bytes,
            // The software controller takes SGL Data Blocks of any length (SGLS bits 1:0 = 01b).
            sgl_dword_lengths: false,
        };
        self.pair = Some(IoQueuePair::attach(config, self.rings.clone(), &self.window, registers)?);
        Ok(())
    }

    fn pair(&mut self) -> &mut IoQueuePair {
        self.pair.as_mut().expect("attached")
    }

    /// Writes `pattern` over `bytes` from `lba` and reads it back into a cleared buffer, with
    /// the buffer scattered over two pieces of the window (a PRP list or an SGL segment).
    fn round_trip(&mut self, lba: u64, bytes: usize, seed: u8) -> Vec<u8> {
        let namespace = self.namespaces[0].id;
        let half = bytes / 2;
        let first = self.window.allocate(half).expect("buffer");
        let second = self.window.allocate(bytes - half).expect("buffer");
        let pattern: Vec<u8> = (0..bytes).map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed)).collect();
        first.write(0, &pattern[..half]).unwrap();
        second.write(0, &pattern[half..]).unwrap();
        let segments = [DataSegment::new(first.iova(), half as u32), DataSegment::new(second.iova(), (bytes - half) as u32)];
        self.pair().write(namespace, Lba(lba), &segments, true, TIMEOUT).expect("client write");
        first.fill(0, half, 0).unwrap();
        second.fill(0, bytes - half, 0).unwrap();
        self.pair().read(namespace, Lba(lba), &segments, TIMEOUT).expect("client read");
        let mut data = vec![0u8; bytes];
        first.read(0, &mut data[..half]).unwrap();
        second.read(0, &mut data[half..]).unwrap();
        assert_eq!(data, pattern, "client read back what it wrote");
        pattern
    }
}

fn set_up(sgl: bool) -> (Daemon, Client, DetachedQueuePair) {
    let mut daemon = Daemon::start(sgl);
    let (mut client, grant) = Client::new(&mut daemon);
    let detached = daemon.create_queue(client.rings.0.iova(), client.rings.1.iova());
    client.attach(grant, detached.layout()).expect("attach");
    (daemon, client, detached)
}

#[test]
fn a_client_with_only_fds_and_the_layout_writes_and_reads_byte_exact() {
    // Goal: with PRP lists and with SGL segments, a client that mapped the window and the
    // register page itself moves data byte-exact, and the daemon's own queue sees the same bytes.
    for sgl in [false, true] {
        let (daemon, mut client, detached) = set_up(sgl);
        assert_eq!(client.pair().data_pointer_mode(), if sgl { DataPointerMode::Sgl } else { DataPointerMode::Prp });
        for (round, lba) in [0u64, 40, 4000].into_iter().enumerate() {
            // 64 KiB in two pieces: more than two pages each, so PRP needs a list page.
            let pattern = client.round_trip(lba, 64 << 10, round as u8);
            assert_eq!(daemon.read_back(lba, 64 << 10), pattern, "the device holds the client's data");
        }
        let stats = daemon.device.stats();
        assert!(stats.commands_on_queue(detached.layout().id.0) >= 6, "the client's queue carried its commands");
        drop(client);
        detached.delete().expect("the daemon deletes the client's queues");
    }
}

#[test]
fn a_client_refuses_a_layout_that_does_not_match_the_register_page_or_its_rings() {
    // Goal: attach checks the layout against what the client can see: doorbells from CAP.DSTRD,
    // ring IOVAs from its own regions; a mismatch is an error, nothing is rung.
    let mut daemon = Daemon::start(true);
    let (mut client, grant) = Client::new(&mut daemon);
    let detached = daemon.create_queue(client.rings.0.iova(), client.rings.1.iova());
    let mut bad_doorbell = detached.layout();
    bad_doorbell.submission_doorbell_offset += 8;
    let regrant = |grant: &Grant| Grant {
        registers_fd: grant.registers_fd.try_clone().unwrap(),
        registers_bytes: grant.registers_bytes,
        iova_base: grant.iova_base,
        address_space: grant.address_space,
        namespaces: grant.namespaces.clone(),
        mode: grant.mode,
        max_transfer_bytes: grant.max_transfer_bytes,
    };
    assert!(matches!(client.attach(regrant(&grant), bad_doorbell), Err(NvmeError::Unsupported { .. })));
    let mut bad_ring = detached.layout();
    bad_ring.completion_iova = bad_ring.submission_iova;
    assert!(matches!(client.attach(regrant(&grant), bad_ring), Err(NvmeError::Unsupported { .. })));
    client.attach(grant, detached.layout()).expect("the true layout attaches");
    // A client never deletes the queues; its `delete` says whether any command of its own can
    // still move data: refused with one in flight, done once it completed.
    let mut pair = client.pair.take().unwrap();
    let buffer = client.window.allocate(4096).expect("buffer");
    pair.submit_read(client.namespaces[0].id, Lba(0), &[DataSegment::new(buffer.iova(), 4096)], 7).expect("submit");
    let error = pair.delete().expect_err("a command in flight");
    assert!(matches!(error.source, NvmeError::Unsupported { .. }), "{}", error.source);
    let mut pair = *error.pair;
    pair.ring_doorbell().expect("doorbell");
    pair.wait_idle(Instant::now() + TIMEOUT, |completion| assert!(completion.status.is_ok())).expect("the read completes");
    pair.delete().expect("nothing in flight: this process is done with the pair");
    assert!(daemon.device.stats().commands_on_queue(detached.layout().id.0) >= 1);
    detached.delete().expect("daemon delete");
}

#[test]
fn a_doorbell_from_the_client_is_found_within_the_idle_poll_interval() {
    // Goal: the controller thread cannot be woken across processes, so a client's doorbell
    // after an idle period is found by polling: the round trip stays within idle_sleep_max
    // (100 µs) plus scheduling noise. Measured here, printed, and bounded loosely for CI.
    let (_daemon, mut client, detached) = set_up(true);
    let namespace = client.namespaces[0].id;
    let buffer = client.window.allocate(4096).unwrap();
    let segment = [DataSegment::new(buffer.iova(), 4096)];
    let mut samples = Vec::new();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(20)); // let the controller back off to sleeping
        let started = Instant::now();
        client.pair().read(namespace, Lba(0), &segment, TIMEOUT).expect("read");
        samples.push(started.elapsed());
    }
    samples.sort();
    let median = samples[samples.len() / 2];
    println!("idle-to-completion round trip through the shared register page: median {median:?}, max {:?}", samples.last().unwrap());
    assert!(median < Duration::from_millis(20), "median {median:?}: doorbells are not being found by polling");
    drop(client);
    detached.delete().expect("daemon delete");
}

/// Fills `blocks` 4 KiB blocks from `lba` with `byte` through the daemon's own queue pair.
fn daemon_fill(daemon: &Daemon, lba: u64, blocks: usize, byte: u8) {
    let mut queue = daemon.controller.create_io_queue_pair(16).expect("daemon queue");
    let buffer = daemon.controller.dma().allocate(blocks * 4096).expect("buffer");
    buffer.fill(0, blocks * 4096, byte).unwrap();
    let namespace = daemon.controller.namespaces()[0].id;
    queue.write(namespace, Lba(lba), &[DataSegment::new(buffer.iova(), (blocks * 4096) as u32)], true, TIMEOUT).expect("daemon write");
}

/// Submits `entry` raw on the client's pair and returns the completion status.
fn client_raw(client: &mut Client, entry: SubmissionEntry) -> Result<(), NvmeStatus> {
    let queue = client.pair().id();
    client.pair().submit_raw(entry, 0).expect("submit");
    match client.pair().complete_all(TIMEOUT) {
        Ok(()) => Ok(()),
        Err(NvmeError::Command { status, .. }) => Err(status),
        Err(error) => panic!("{queue}: {error}"),
    }
}

#[test]
fn a_restricted_queue_refuses_stray_memory_and_lbas_and_moves_no_data() {
    // Goal: once the daemon restricts the client's SQ to its window and LBAs 0..1024, a stray
    // LBA (Access Denied), a data pointer into the daemon's memory, a PRP list there and an SGL
    // segment there (Data Transfer Error) are all refused; the device and the daemon's memory
    // keep their bytes; the refusals are counted; commands inside the limits still work.
    let (daemon, mut client, detached) = set_up(true);
    let queue_id = detached.layout().id.0;
    let restriction = QueueRestriction::new().allow_memory(daemon.window.iova(), WINDOW_BYTES as u64).allow_blocks(1, 0, 1024);
    daemon.device.restrict_submission_queue(queue_id, Some(restriction)).expect("restrict");
    assert!(matches!(daemon.device.restrict_submission_queue(60, None), Err(nvme_emu::EmuError::NoSuchQueue { queue_id: 60 })));
    let namespace = client.namespaces[0].id;
    client.round_trip(0, 16 << 10, 1);

    // The daemon's memory: a page holding 0x5A, a PRP list page and an SGL segment page that
    // point back into the client's window (so an unrestricted controller would accept them).
    let secret = daemon.controller.dma().allocate(4 * 4096).expect("daemon memory");
    secret.fill(0, 4 * 4096, 0x5A).unwrap();
    let window_pages = client.window.allocate(3 * 4096).expect("client pages");
    window_pages.fill(0, 3 * 4096, 0xC1).unwrap();
    let list = daemon.controller.dma().allocate(4096).expect("daemon list page");
    for (index, page) in [1u64, 2].into_iter().enumerate() {
        list.write(index * 8, &(window_pages.iova().0 + page * 4096).to_le_bytes()).unwrap();
    }
    list.write(2048, &SglDescriptor::data_block(window_pages.iova().0, 4096).to_bytes()).unwrap();
    daemon_fill(&daemon, 100, 3, 0x77);
    daemon_fill(&daemon, 2000, 1, 0x66);
    let before = daemon.device.stats();
    let transfer_error = NvmeStatus::generic(codes::DATA_TRANSFER_ERROR);
    let one = BlockCount::new(1).unwrap();

    // A stray LBA, with a data pointer inside the window.
    let stray_lba = [DataSegment::new(window_pages.iova(), 4096)];
    let refused = client.pair().write(namespace, Lba(2000), &stray_lba, true, TIMEOUT);
    assert!(
        matches!(refused, Err(NvmeError::Command { status, .. }) if status == NvmeStatus::new(StatusCodeType::MediaAndDataIntegrity, codes::ACCESS_DENIED)),
        "{refused:?}"
    );
    // Data pointers into the daemon's memory: a write from it and a read into it.
    let stray_data = [DataSegment::new(secret.iova(), 4096)];
    for write in [true, false] {
        let result = if write {
            client.pair().write(namespace, Lba(100), &stray_data, true, TIMEOUT)
        } else {
            client.pair().read(namespace, Lba(100), &stray_data, TIMEOUT)
        };
        assert!(matches!(result, Err(NvmeError::Command { status, .. }) if status == transfer_error), "{result:?}");
    }
    // A PRP list in the daemon's memory (PRP1 in the window).
    let mut entry = SubmissionEntry::write(namespace, Lba(100), BlockCount::new(3).unwrap(), true);
    entry.set_data_pointer_kind(DataPointerKind::Prp);
    entry.dptr = [window_pages.iova().0, list.iova().0];
    assert_eq!(client_raw(&mut client, entry), Err(transfer_error), "PRP list outside the window");
    // An SGL segment in the daemon's memory.
    let mut entry = SubmissionEntry::write(namespace, Lba(100), one, true);
    entry.set_data_pointer_kind(DataPointerKind::Sgl);
    entry.dptr = SglDescriptor::last_segment(list.iova().0 + 2048, 1).to_dptr();
    assert_eq!(client_raw(&mut client, entry), Err(transfer_error), "SGL segment outside the window");

    // Nothing moved: the device's blocks and the daemon's memory are as they were.
    assert!(daemon.read_back(100, 3 * 4096).iter().all(|&byte| byte == 0x77), "LBAs 100.. untouched");
    assert!(daemon.read_back(2000, 4096).iter().all(|&byte| byte == 0x66), "LBA 2000 untouched");
    let mut secret_bytes = vec![0u8; 4 * 4096];
    secret.read(0, &mut secret_bytes).unwrap();
    assert!(secret_bytes.iter().all(|&byte| byte == 0x5A), "the daemon's memory untouched");
    let after = daemon.device.stats();
    assert_eq!(after.restriction_refusals - before.restriction_refusals, 5);
    assert_eq!(after.bytes_written, before.bytes_written, "no refused command wrote a byte");

    // Inside the limits, the same queue still works; lifting the restriction restores access.
    client.round_trip(8, 16 << 10, 2);
    daemon.device.restrict_submission_queue(queue_id, None).expect("lift");
    client.pair().write(namespace, Lba(2000), &stray_lba, true, TIMEOUT).expect("unrestricted");
    drop(client);
    detached.delete().expect("daemon delete");
}

#[test]
fn a_queue_restricted_at_creation_refuses_a_command_rung_right_after_create_sq() {
    // Goal: a restriction preset before Create I/O SQ holds from the queue's first command:
    // a Read into the daemon's memory rung right after the Create SQ completion is refused
    // (Data Transfer Error, one refusal counted), which a restriction set after the creation
    // let through. A preset no Create I/O SQ took is removed with its handle; one a creation
    // took is pending no more.
    let mut daemon = Daemon::start(false);
    let (mut client, grant) = Client::new(&mut daemon);
    let ring = client.rings.0.iova();
    let restriction = QueueRestriction::new().allow_memory(daemon.window.iova(), WINDOW_BYTES as u64).allow_blocks(1, 0, 1024);
    drop(daemon.device.preset_restriction(ring, restriction.clone()).expect("preset"));
    let preset = daemon.device.preset_restriction(ring, restriction.clone()).expect("the dropped preset is gone");
    assert!(
        matches!(daemon.device.preset_restriction(ring, restriction), Err(nvme_emu::EmuError::RestrictionPending { ring_iova }) if ring_iova == ring.0)
    );
    let detached = daemon.create_queue(ring, client.rings.1.iova());
    assert_eq!(preset.queue_id(), Some(detached.layout().id.0), "the Create I/O SQ applied the preset");
    drop(preset);
    client.attach(grant, detached.layout()).expect("attach");
    let secret = daemon.controller.dma().allocate(4096).expect("daemon memory");
    let namespace = client.namespaces[0].id;
    let stray = [DataSegment::new(secret.iova(), 4096)];
    let result = client.pair().read(namespace, Lba(0), &stray, TIMEOUT);
    let transfer_error = NvmeStatus::generic(codes::DATA_TRANSFER_ERROR);
    assert!(matches!(result, Err(NvmeError::Command { status, .. }) if status == transfer_error), "{result:?}");
    assert_eq!(daemon.device.stats().restriction_refusals, 1);
    client.round_trip(0, 16 << 10, 3);
    // The creation took the preset: none is pending for the ring any more.
    drop(daemon.device.preset_restriction(ring, QueueRestriction::new()).expect("the creation took the first preset"));
    drop(client);
    detached.delete().expect("daemon delete");
}
