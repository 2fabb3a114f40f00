//! Doorbell Buffer Config (§5.7): the controller reads I/O doorbells from the shadow page and
//! answers each read in the EventIdx page; without the command, or when not offered, nothing
//! changes.

use std::sync::atomic::Ordering;
use std::time::Duration;

use nvme_driver::spec::command::IdentifyCns;
use nvme_driver::spec::identify::IdentifyController;
use nvme_driver::spec::registers::shadow_doorbell_offset;
use nvme_driver::spec::status::codes;
use nvme_driver::spec::{NvmeStatus, SubmissionEntry};
use nvme_driver::NamespaceId;

use super::harness::{status_of, TestHost};
use crate::{Backing, EmuConfig};

fn config() -> EmuConfig {
    EmuConfig::default().with_backing(Backing::Memory { bytes: 4 << 20 })
}

fn identify(host: &mut TestHost) -> IdentifyController {
    let buffer = host.buffer(4096);
    let completion = host.admin(SubmissionEntry::identify(IdentifyCns::Controller, 0, buffer.iova().0));
    assert_eq!(status_of(&completion), Ok(()));
    let mut bytes = vec![0u8; 4096];
    buffer.read(0, &mut bytes).expect("identify data");
    IdentifyController::parse(&bytes).expect("identify parses")
}

#[test]
fn io_doorbells_come_from_the_shadow_page_once_configured() {
    // Goal: after Doorbell Buffer Config a command published only in the shadow page runs, its
    // EventIdx says which tail was read, and a register-only doorbell no longer counts.
    let mut host = TestHost::start(config());
    assert!(identify(&mut host).supports_doorbell_buffer_config(), "OACS bit 8 advertised");
    let (shadow, events) = (host.buffer(4096), host.buffer(4096));
    let misaligned = host.admin(SubmissionEntry::doorbell_buffer_config(shadow.iova().0 + 8, events.iova().0));
    assert_eq!(status_of(&misaligned), Err(NvmeStatus::generic(codes::INVALID_FIELD)));
    let accepted = host.admin(SubmissionEntry::doorbell_buffer_config(shadow.iova().0, events.iova().0));
    assert_eq!(status_of(&accepted), Ok(()));

    let mut queue = host.create_io_pair(1, 8);
    let (sq_slot, cq_slot) = (shadow_doorbell_offset(1, false, 0), shadow_doorbell_offset(1, true, 0));
    for round in 0..12u32 {
        // Wraps the 8-entry rings: the values the controller reads stay in range.
        let id = TestHost::push(&mut queue, SubmissionEntry::flush(NamespaceId(1)));
        shadow.store_u32(sq_slot, queue.tail, Ordering::Release).expect("shadow tail");
        let completion = TestHost::try_reap_within(&mut queue, Duration::from_secs(5)).expect("flush completes from the shadow tail");
        assert_eq!((completion.command_id(), status_of(&completion)), (id, Ok(())), "round {round}");
        shadow.store_u32(cq_slot, queue.head, Ordering::Release).expect("shadow head");
        assert_eq!(events.load_u32(sq_slot, Ordering::Acquire).expect("event index"), queue.tail, "EventIdx = the tail read");
    }
    // The register doorbell alone is not what the controller reads any more.
    TestHost::push(&mut queue, SubmissionEntry::flush(NamespaceId(1)));
    host.ring_submission(&queue);
    assert!(TestHost::try_reap_within(&mut queue, Duration::from_millis(200)).is_none(), "a register-only doorbell is not seen");
    shadow.store_u32(sq_slot, queue.tail, Ordering::Release).expect("shadow tail");
    assert!(TestHost::try_reap_within(&mut queue, Duration::from_secs(5)).is_some(), "seen once in the shadow page");

    // A controller reset forgets the pages: register doorbells count again.
    host.enable();
    let mut queue = host.create_io_pair(1, 8);
    let completion = host.execute_on(&mut queue, SubmissionEntry::flush(NamespaceId(1)));
    assert_eq!(status_of(&completion), Ok(()), "register doorbells after a reset");
}

#[test]
fn doorbell_buffer_config_is_refused_when_not_offered() {
    // Goal: a controller configured without shadow doorbells neither advertises nor takes them.
    let mut host = TestHost::start(config().with_shadow_doorbells(false));
    assert!(!identify(&mut host).supports_doorbell_buffer_config());
    let (shadow, events) = (host.buffer(4096), host.buffer(4096));
    let refused = host.admin(SubmissionEntry::doorbell_buffer_config(shadow.iova().0, events.iova().0));
    assert_eq!(status_of(&refused), Err(NvmeStatus::generic(codes::INVALID_OPCODE)));
}

#[test]
fn a_doorbell_rung_just_before_doorbell_buffer_config_is_not_lost() {
    // Goal: a host that rings an I/O queue's register doorbell and then sends Doorbell Buffer
    // Config has its command fetched even when the controller sees both in one scan (it reads
    // the admin queue first): the shadow slot starts from the doorbell the host rang, not from
    // the controller's older copy. Until 2026-11-29 the slot was seeded with the stale tail
    // and, the register no longer read, the Flush never ran.
    let mut host = TestHost::start(config());
    let mut queue = host.create_io_pair(1, 8);
    let (shadow, events) = (host.buffer(4096), host.buffer(4096));
    let mut admin = host.admin.clone();
    let (flush, config_id) = host.device.with_core(|_| {
        // The controller thread waits for the lock: it sees both doorbells in its next scan.
        let flush = TestHost::push(&mut queue, SubmissionEntry::flush(NamespaceId(1)));
        host.ring_submission(&queue);
        let config_id = TestHost::push(&mut admin, SubmissionEntry::doorbell_buffer_config(shadow.iova().0, events.iova().0));
        host.ring_submission(&admin);
        (flush, config_id)
    });
    let accepted = host.reap(&mut admin);
    host.admin = admin;
    assert_eq!((accepted.command_id(), status_of(&accepted)), (config_id, Ok(())));
    let completion = TestHost::try_reap_within(&mut queue, Duration::from_secs(5)).expect("the Flush rung before the config completes");
    assert_eq!((completion.command_id(), status_of(&completion)), (flush, Ok(())));
    let sq_slot = shadow_doorbell_offset(1, false, 0);
    assert_eq!(shadow.load_u32(sq_slot, Ordering::Acquire).expect("shadow tail"), queue.tail, "the slot holds the tail rung");
}
