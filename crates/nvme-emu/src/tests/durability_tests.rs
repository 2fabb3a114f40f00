//! What the controller promises about durability: with `sync_file_on_flush`, every write whose
//! completion means "on media" (FUA, cache off, shutdown write-back) is `fdatasync`ed before it
//! completes, and so is a FUA Read, which writes its cached blocks back first; a write-back that fails loses nothing, and a shutdown whose write-back or sync
//! fails never reports SHST = complete.

use std::time::{Duration, Instant};

use nvme_driver::hw::DmaRegion;
use nvme_driver::spec::command::FeatureId;
use nvme_driver::spec::registers::{self, ControllerConfiguration, ControllerStatus, ShutdownStatus};
use nvme_driver::spec::SubmissionEntry;
use nvme_driver::{Lba, NamespaceId};

use super::harness::{block_count, read_block, status_of, with_sgl, HostQueue, TestHost};
use crate::{Backing, EmuConfig};

fn file_config(name: &str, sync_file_on_flush: bool) -> (EmuConfig, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!("nvme-emu-durability-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let mut config = EmuConfig::default().with_backing(Backing::File { path: path.clone(), create_bytes: Some(4 << 20) });
    config.sync_file_on_flush = sync_file_on_flush;
    (config, path)
}

/// A one-block Write of `byte`s, and its source buffer (keep it until the command completes).
fn write_entry(host: &TestHost, lba: u64, byte: u8, fua: bool) -> (SubmissionEntry, DmaRegion) {
    let source = host.buffer(4096);
    source.fill(0, 4096, byte).unwrap();
    (with_sgl(SubmissionEntry::write(NamespaceId(1), Lba(lba), block_count(1), fua), &source, 4096), source)
}

fn write(host: &TestHost, queue: &mut HostQueue, lba: u64, byte: u8, fua: bool) {
    let (entry, _source) = write_entry(host, lba, byte, fua);
    assert_eq!(status_of(&host.execute_on(queue, entry)), Ok(()));
}

fn syncs(host: &TestHost) -> u64 {
    host.device.with_core(|core| core.store.syncs())
}

/// Write Zeroes of one block at `lba`, with FUA (CDW12 bit 30) when `fua`.
fn write_zeroes(host: &TestHost, queue: &mut HostQueue, lba: u64, fua: bool) {
    let mut entry = SubmissionEntry::write_zeroes(NamespaceId(1), Lba(lba), block_count(1), false);
    if fua {
        entry.cdw12 |= 1 << 30;
    }
    assert!(entry.force_unit_access() == fua);
    assert_eq!(status_of(&host.execute_on(queue, entry)), Ok(()));
}

fn set_write_cache(host: &mut TestHost, enabled: bool) {
    let entry = SubmissionEntry::set_features(FeatureId::VolatileWriteCache, u32::from(enabled));
    assert_eq!(status_of(&host.admin(entry)), Ok(()));
}

/// The steps of [`syncs_per_step`], in order.
#[derive(Debug, Default, PartialEq, Eq)]
struct SyncsPerStep {
    /// A lone FUA write.
    alone: u64,
    /// FUA writes through io_uring.
    ring: u64,
    /// A write with the cache off (VWC = 0).
    cache_off: u64,
    /// A cached write.
    cached: u64,
    /// Set Features VWC = 0 with a dirty cache (its write-back).
    cache_disabled_dirty: u64,
    /// Write Zeroes with the cache off.
    zeroes_cache_off: u64,
    /// Write Zeroes with FUA, the cache on.
    zeroes_fua: u64,
    /// Write Zeroes without FUA, the cache on.
    zeroes_cached: u64,
    /// A shutdown with a dirty cache.
    shutdown: u64,
}

/// fdatasyncs seen by each step of [`SyncsPerStep`].
fn syncs_per_step(sync_file_on_flush: bool) -> SyncsPerStep {
    let (config, path) = file_config(&format!("sync-{sync_file_on_flush}"), sync_file_on_flush);
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 16);
    let mut steps = [0u64; 9];
    let mut before = syncs(&host);
    let mut step = |host: &TestHost, index: usize| {
        let now = syncs(host);
        steps[index] = now - before;
        before = now;
    };
    write(&host, &mut queue, 0, 1, true);
    step(&host, 0);
    let batched_before = host.device.stats().batched_writes;
    let mut sources = Vec::new();
    for lba in 1..4 {
        let (entry, source) = write_entry(&host, lba, 2, true);
        TestHost::push(&mut queue, entry);
        sources.push(source);
    }
    host.ring_submission(&queue);
    for _ in 1..4 {
        assert_eq!(status_of(&host.reap(&mut queue)), Ok(()));
    }
    if tutti_uring::available() {
        assert!(host.device.stats().batched_writes > batched_before, "the FUA writes went through io_uring");
    } else {
        eprintln!("io_uring unavailable here: the ring path of FUA writes was not checked");
    }
    step(&host, 1);
    set_write_cache(&mut host, false);
    write(&host, &mut queue, 4, 3, false);
    step(&host, 2);
    set_write_cache(&mut host, true);
    write(&host, &mut queue, 5, 4, false);
    step(&host, 3);
    set_write_cache(&mut host, false);
    step(&host, 4);
    write_zeroes(&host, &mut queue, 6, false);
    step(&host, 5);
    set_write_cache(&mut host, true);
    write_zeroes(&host, &mut queue, 7, true);
    step(&host, 6);
    write_zeroes(&host, &mut queue, 8, false);
    step(&host, 7);
    write(&host, &mut queue, 9, 5, false);
    host.registers.write32(registers::CC, ControllerConfiguration::for_enable().0 | 1 << 14);
    host.wait_shutdown(ShutdownStatus::Complete);
    step(&host, 8);
    drop(host);
    let _ = std::fs::remove_file(&path);
    let [alone, ring, cache_off, cached, cache_disabled_dirty, zeroes_cache_off, zeroes_fua, zeroes_cached, shutdown] = steps;
    SyncsPerStep { alone, ring, cache_off, cached, cache_disabled_dirty, zeroes_cache_off, zeroes_fua, zeroes_cached, shutdown }
}

#[test]
fn writes_that_complete_as_durable_are_synced_only_with_sync_file_on_flush() {
    // Goal: with sync_file_on_flush, every completion that promises media fdatasyncs the file
    // first: a FUA write (alone, and through io_uring), a write with the cache off, turning
    // the cache off (VWC = 0) over dirty blocks, Write Zeroes with FUA or with the cache off,
    // a shutdown's write-back; a cached write and a Write Zeroes through an enabled cache
    // without FUA do not; without the option nothing is synced. Until 2026-11-29 neither
    // VWC = 0 nor Write Zeroes synced.
    let steps = syncs_per_step(true);
    assert!(steps.alone >= 1, "a lone FUA write was not synced");
    assert!(steps.ring >= 1 || !tutti_uring::available(), "FUA writes through io_uring were not synced");
    assert!(steps.cache_off >= 1, "a write with the cache off was not synced");
    assert_eq!(steps.cached, 0, "a cached write needs no sync");
    assert!(steps.cache_disabled_dirty >= 1, "VWC = 0 wrote the dirty cache back without a sync");
    assert!(steps.zeroes_cache_off >= 1, "Write Zeroes with the cache off was not synced");
    assert!(steps.zeroes_fua >= 1, "a FUA Write Zeroes was not synced");
    assert_eq!(steps.zeroes_cached, 0, "a Write Zeroes through an enabled cache promises nothing until Flush");
    assert!(steps.shutdown >= 1, "the shutdown write-back was not synced");
    assert_eq!(syncs_per_step(false), SyncsPerStep::default(), "without sync_file_on_flush nothing is synced");
}

#[test]
fn a_failed_write_back_keeps_the_blocks_dirty_until_a_flush_succeeds() {
    // Goal: when the store refuses a cache write-back, the Flush fails with Write Fault and no
    // block is lost: neither the failed run (LBAs 0-7) nor the one not yet tried (16-23). The
    // next Flush retries (and fails while the store does); once the store takes writes again a
    // Flush succeeds and the data is on media, even across a power loss.
    let mut host = TestHost::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 8 << 20 }));
    let mut queue = host.create_io_pair(1, 16);
    let lbas: Vec<u64> = (0..8).chain(16..24).collect();
    for &lba in &lbas {
        write(&host, &mut queue, lba, lba as u8 + 1, false);
    }
    let write_fault = Err(nvme_driver::spec::NvmeStatus::new(
        nvme_driver::spec::StatusCodeType::MediaAndDataIntegrity,
        nvme_driver::spec::status::codes::WRITE_FAULT,
    ));
    host.device.with_core(|core| core.fail_write_backs_for_tests = true);
    for attempt in 0..2 {
        let flushed = host.execute_on(&mut queue, SubmissionEntry::flush(NamespaceId(1)));
        assert_eq!(status_of(&flushed), write_fault, "flush {attempt} while the store refuses writes");
    }
    for &lba in &lbas {
        assert!(read_block(&host, &mut queue, lba).iter().all(|&byte| byte == lba as u8 + 1), "LBA {lba} still reads its write");
    }
    host.device.with_core(|core| core.fail_write_backs_for_tests = false);
    assert_eq!(status_of(&host.execute_on(&mut queue, SubmissionEntry::flush(NamespaceId(1)))), Ok(()));
    host.device.power_loss();
    host.enable();
    let mut queue = host.create_io_pair(1, 16);
    for &lba in &lbas {
        assert!(read_block(&host, &mut queue, lba).iter().all(|&byte| byte == lba as u8 + 1), "LBA {lba} reached media");
    }
}

/// Requests a normal shutdown (CC.SHN = 01b) with the controller enabled.
fn request_shutdown(host: &TestHost) {
    host.registers.write32(registers::CC, ControllerConfiguration::for_enable().0 | 1 << 14);
}

/// Asserts that a shutdown is not reported complete (SHST never reads complete, for a while)
/// and that the controller says it failed (CSTS.CFS, once the controller thread got to it).
fn assert_shutdown_failed(host: &TestHost, why: &str) {
    host.wait_fatal();
    let until = Instant::now() + Duration::from_millis(100);
    while Instant::now() < until {
        let csts = host.csts();
        assert_ne!(csts.shutdown(), ShutdownStatus::Complete, "shutdown reported complete although {why}: {csts:?}");
        assert!(csts.fatal(), "CSTS.CFS not set although {why}: {csts:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_shutdown_whose_write_back_fails_is_not_reported_complete() {
    // Goal: SHST = complete tells the host its data is durable (it may cut power next), so a
    // shutdown whose cache write-back fails never reports it: SHST stays short of complete and
    // CSTS.CFS is set. The blocks stay cached: after the host's reset they still read back,
    // and a later shutdown, once the store takes writes again, completes and makes them durable.
    let mut host = TestHost::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 8 << 20 }));
    let mut queue = host.create_io_pair(1, 16);
    write(&host, &mut queue, 1, 0x11, false);
    host.device.with_core(|core| core.fail_write_backs_for_tests = true);
    request_shutdown(&host);
    assert_shutdown_failed(&host, "the write-back failed");
    host.device.with_core(|core| core.fail_write_backs_for_tests = false);
    host.enable();
    let mut queue = host.create_io_pair(1, 16);
    assert!(read_block(&host, &mut queue, 1).iter().all(|&byte| byte == 0x11), "the block stayed cached");
    request_shutdown(&host);
    host.wait_shutdown(ShutdownStatus::Complete);
    assert!(!host.csts().fatal());
    host.device.power_loss();
    host.enable();
    let mut queue = host.create_io_pair(1, 16);
    assert!(read_block(&host, &mut queue, 1).iter().all(|&byte| byte == 0x11), "the second shutdown made it durable");
}

#[test]
fn a_shutdown_whose_sync_fails_is_not_reported_complete() {
    // Goal: with sync_file_on_flush, a shutdown whose write-back reached the file but whose
    // fdatasync failed has not made the data durable either: no SHST = complete, CSTS.CFS set.
    let (config, path) = file_config("shutdown-sync-fails", true);
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 16);
    write(&host, &mut queue, 2, 0x22, false);
    host.device.with_core(|core| core.fail_syncs_for_tests = true);
    request_shutdown(&host);
    assert_shutdown_failed(&host, "the fdatasync failed");
    drop(host);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn the_driver_sees_a_failed_shutdown_as_an_error() {
    // Goal: the real driver's normal shutdown returns `ControllerFatal` as soon as CSTS shows
    // CFS (well before its bounded wait, 1 s here: CAP.TO 500 ms, RTD3E unset, the floor, for SHST = complete) when the
    // write-back fails, instead of Ok (which says the data is durable); teardown after it
    // still stops the controller.
    use nvme_driver::hw::DeviceBackend;
    use nvme_driver::{Controller, ControllerConfig, DataSegment, NvmeError};
    let config = EmuConfig { ready_timeout_500ms_units: 1, ..EmuConfig::default().with_backing(Backing::Memory { bytes: 8 << 20 }) };
    let device = crate::EmuDevice::start(config).unwrap();
    let backend: std::sync::Arc<dyn DeviceBackend> = device.clone();
    let config = ControllerConfig { admin_timeout: Duration::from_millis(300), ..ControllerConfig::default() };
    let controller = Controller::init(backend, config).unwrap();
    let mut queue = controller.create_io_queue_pair(16).unwrap();
    let buffer = controller.dma().allocate(4096).unwrap();
    buffer.fill(0, 4096, 0x33).unwrap();
    let namespace = controller.namespaces()[0].id;
    queue.write(namespace, Lba(3), &[DataSegment::new(buffer.iova(), 4096)], false, Duration::from_secs(5)).unwrap();
    device.with_core(|core| core.fail_write_backs_for_tests = true);
    let started = Instant::now();
    match controller.shutdown() {
        Err(NvmeError::ControllerFatal { .. }) => {}
        other => panic!("a shutdown whose write-back failed returned {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_millis(400), "CFS ends the wait before CAP.TO: {:?}", started.elapsed());
    drop(queue);
    drop(controller);
    assert!(!ControllerStatus(device.registers().read32(registers::CSTS)).ready(), "teardown stopped the controller (RDY = 0)");
}

#[test]
fn a_failed_write_through_keeps_an_earlier_completed_cached_write() {
    // Goal: a FUA Write (and a Write Zeroes) that goes straight to the store and fails there
    // leaves the blocks' earlier completed cached write in place: it still reads back, and a
    // later Flush makes it durable. The cached copy used to be dropped before the store write,
    // so a failed write took a completed one with it (reads and media then held the data from
    // before it), while the in-flight path drops cached copies only once a write landed.
    let write_fault = Err(nvme_driver::spec::NvmeStatus::new(
        nvme_driver::spec::StatusCodeType::MediaAndDataIntegrity,
        nvme_driver::spec::status::codes::WRITE_FAULT,
    ));
    for zeroes in [false, true] {
        let (config, path) = file_config(&format!("failed-write-through-{zeroes}"), false);
        let mut host = TestHost::start(config);
        let mut queue = host.create_io_pair(1, 16);
        write(&host, &mut queue, 3, 0xA1, false);
        host.device.with_core(|core| core.fail_write_throughs_for_tests = true);
        let failed = if zeroes {
            let mut entry = SubmissionEntry::write_zeroes(NamespaceId(1), Lba(3), block_count(1), false);
            entry.cdw12 |= 1 << 30;
            host.execute_on(&mut queue, entry)
        } else {
            let (entry, _source) = write_entry(&host, 3, 0xB2, true);
            host.execute_on(&mut queue, entry)
        };
        assert_eq!(status_of(&failed), write_fault, "zeroes {zeroes}: the write-through fails while the store refuses it");
        host.device.with_core(|core| core.fail_write_throughs_for_tests = false);
        assert!(read_block(&host, &mut queue, 3).iter().all(|&byte| byte == 0xA1), "zeroes {zeroes}: the cached write still reads");
        assert_eq!(status_of(&host.execute_on(&mut queue, SubmissionEntry::flush(NamespaceId(1)))), Ok(()));
        host.device.power_loss();
        host.enable();
        let mut queue = host.create_io_pair(1, 16);
        assert!(read_block(&host, &mut queue, 3).iter().all(|&byte| byte == 0xA1), "zeroes {zeroes}: the flush made it durable");
        drop(host);
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn a_partial_power_loss_writes_back_some_whole_cached_blocks_and_loses_the_rest() {
    // Goal: `PowerLossMode::PartialWriteBack` models a drive that wrote back part of its cache
    // before the cut: of 64 blocks written (not FUA, no Flush) over old data, some read back new
    // and some old, each one wholly; the same seed picks the same blocks; a Flushed block and a
    // FUA one are on media whatever the seed; plain `power_loss` still loses every cached block.
    let lbas = 0..64u64;
    let cut = |mode: Option<crate::PowerLossMode>| -> Vec<bool> {
        let mut host = TestHost::start(EmuConfig::default().with_backing(Backing::Memory { bytes: 8 << 20 }));
        let mut queue = host.create_io_pair(1, 16);
        for lba in lbas.clone() {
            write(&host, &mut queue, lba, 0x11, false);
        }
        write(&host, &mut queue, 100, 0x33, false);
        assert_eq!(status_of(&host.execute_on(&mut queue, SubmissionEntry::flush(NamespaceId(1)))), Ok(()));
        for lba in lbas.clone() {
            write(&host, &mut queue, lba, 0x22, false);
        }
        write(&host, &mut queue, 101, 0x44, true);
        match mode {
            Some(mode) => host.device.power_loss_with(mode),
            None => host.device.power_loss(),
        }
        host.enable();
        let mut queue = host.create_io_pair(1, 16);
        assert!(read_block(&host, &mut queue, 100).iter().all(|&byte| byte == 0x33), "a Flushed block was lost");
        assert!(read_block(&host, &mut queue, 101).iter().all(|&byte| byte == 0x44), "a FUA block was lost");
        lbas.clone()
            .map(|lba| {
                let block = read_block(&host, &mut queue, lba);
                let new = block.iter().all(|&byte| byte == 0x22);
                assert!(new || block.iter().all(|&byte| byte == 0x11), "LBA {lba} is torn: neither wholly old nor wholly new");
                new
            })
            .collect()
    };
    let seed = crate::PowerLossMode::PartialWriteBack { seed: 7 };
    let first = cut(Some(seed));
    let landed = first.iter().filter(|&&new| new).count();
    assert!(landed > 0 && landed < first.len(), "{landed} of {} cached blocks reached media: want some, not all", first.len());
    assert_eq!(cut(Some(seed)), first, "the same seed must pick the same blocks");
    assert_ne!(cut(Some(crate::PowerLossMode::PartialWriteBack { seed: 8 })), first, "another seed picks other blocks");
    assert!(cut(None).iter().all(|&new| !new), "plain power_loss must lose every cached block");
    assert!(cut(Some(crate::PowerLossMode::DiscardCache)).iter().all(|&new| !new), "DiscardCache is power_loss");
}

/// A one-block Read at `lba` into a fresh buffer, with FUA (CDW12 bit 30) when `fua`; the
/// buffer is returned with it (keep it until the command completes).
fn read_entry(host: &TestHost, lba: u64, fua: bool) -> (SubmissionEntry, DmaRegion) {
    let target = host.buffer(4096);
    let mut entry = SubmissionEntry::read(NamespaceId(1), Lba(lba), block_count(1));
    if fua {
        entry.cdw12 |= 1 << 30;
    }
    assert!(entry.force_unit_access() == fua);
    (with_sgl(entry, &target, 4096), target)
}

#[test]
fn a_fua_read_makes_its_cached_blocks_durable() {
    // Goal: a Read with FUA commits the data of its blocks to non-volatile media before it
    // reads (NVM command set, Read, CDW12 bit 30): a block written through the enabled cache
    // (no Flush) and then read with FUA survives a power loss, whether the Read runs alone
    // (the synchronous path) or within a batch (where Reads of a file go through io_uring);
    // another cached block, outside the Read, stays volatile. With sync_file_on_flush the FUA
    // Read also fdatasyncs the file, on either path, as a FUA Write does; a plain Read does not.
    // Until 2026-12-01 FUA on a Read was ignored: its cached blocks were lost at the cut.
    for sync_file_on_flush in [false, true] {
        let (config, path) = file_config(&format!("fua-read-{sync_file_on_flush}"), sync_file_on_flush);
        let mut host = TestHost::start(config);
        let mut queue = host.create_io_pair(1, 16);
        for lba in 0..4 {
            write(&host, &mut queue, lba, 0x10, true);
        }
        for lba in [0, 1, 3] {
            write(&host, &mut queue, lba, 0x20 + lba as u8, false);
        }
        // Alone: LBA 0.
        let before = syncs(&host);
        let (entry, target) = read_entry(&host, 0, true);
        assert_eq!(status_of(&host.execute_on(&mut queue, entry)), Ok(()));
        let mut read = vec![0u8; 4096];
        target.read(0, &mut read).unwrap();
        assert!(read.iter().all(|&byte| byte == 0x20), "the FUA Read returns the cached write");
        let alone_syncs = syncs(&host) - before;
        // In a batch: LBA 1 with FUA, LBA 3 without, then LBA 2 (not cached) with FUA and
        // LBA 3 again without.
        let before = syncs(&host);
        // Submits reads of (LBA, FUA) in one batch and reaps them, each a success.
        let mut targets = Vec::new();
        let mut batch = |reads: [(u64, bool); 2], targets: &mut Vec<_>| {
            for (lba, fua) in reads {
                let (entry, target) = read_entry(&host, lba, fua);
                TestHost::push(&mut queue, entry);
                targets.push(target);
            }
            host.ring_submission(&queue);
            for _ in reads {
                assert_eq!(status_of(&host.reap(&mut queue)), Ok(()));
            }
        };
        batch([(1, true), (3, false)], &mut targets);
        targets[0].read(0, &mut read).unwrap();
        assert!(read.iter().all(|&byte| byte == 0x21), "the batched FUA Read returns the cached write");
        let batch_syncs = syncs(&host) - before;
        let before = syncs(&host);
        let batched_before = host.device.stats().batched_reads;
        batch([(2, true), (3, false)], &mut targets);
        let uncached_syncs = syncs(&host) - before;
        let ring = tutti_uring::available() && host.device.stats().batched_reads > batched_before;
        if sync_file_on_flush {
            assert!(alone_syncs >= 1, "a lone FUA Read was not synced");
            assert!(batch_syncs >= 1, "a batched FUA Read was not synced");
            assert!(uncached_syncs >= 1, "a FUA Read of uncached blocks (ring: {ring}) was not synced");
        } else {
            assert_eq!((alone_syncs, batch_syncs, uncached_syncs), (0, 0, 0), "without sync_file_on_flush nothing is synced");
        }
        let before = syncs(&host);
        assert!(read_block(&host, &mut queue, 3).iter().all(|&byte| byte == 0x23));
        assert_eq!(syncs(&host), before, "a plain Read needs no sync");
        host.device.power_loss();
        host.enable();
        let mut queue = host.create_io_pair(1, 16);
        for (lba, expected) in [(0, 0x20), (1, 0x21), (2, 0x10), (3, 0x10)] {
            let block = read_block(&host, &mut queue, lba);
            assert!(
                block.iter().all(|&byte| byte == expected),
                "sync {sync_file_on_flush}: LBA {lba} reads {:#x}, not {expected:#x}",
                block[0]
            );
        }
        drop(host);
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn discard_cache_can_leave_a_later_write_on_media_without_an_earlier_one() {
    // Goal: pins what `PowerLossMode::DiscardCache` promises and no more. A FUA Read writes back
    // only the cached blocks of its own range, so after two cached writes (LBA 0, then LBA 8)
    // and a FUA Read of LBA 8 the cut leaves the later write on media and loses the earlier
    // one: a state the host's writes never passed through in order. The docs said until
    // 2026-12-02 that cached writes reach media only all together in this mode.
    let (config, path) = file_config("out-of-order", false);
    let mut host = TestHost::start(config);
    let mut queue = host.create_io_pair(1, 16);
    for lba in [0, 8] {
        write(&host, &mut queue, lba, 0x10, true);
    }
    write(&host, &mut queue, 0, 0x20, false);
    write(&host, &mut queue, 8, 0x28, false);
    let (entry, _target) = read_entry(&host, 8, true);
    assert_eq!(status_of(&host.execute_on(&mut queue, entry)), Ok(()));
    host.device.power_loss();
    host.enable();
    let mut queue = host.create_io_pair(1, 16);
    for (lba, expected) in [(0, 0x10), (8, 0x28)] {
        let block = read_block(&host, &mut queue, lba);
        assert!(block.iter().all(|&byte| byte == expected), "LBA {lba} reads {:#x}, not {expected:#x}", block[0]);
    }
    drop(host);
    let _ = std::fs::remove_file(&path);
}
