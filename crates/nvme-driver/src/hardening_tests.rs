//! The driver against the scripted fake controller: device data it must not trust (CAP,
//! Identify Namespace formats, completion SQ heads) and teardown when the controller will not
//! stop. Each test opens with its goal.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use crate::fake_device::{identify_namespace_bytes, FakeDevice, FakeScript};
use crate::hw::{DeviceBackend, DmaAllocator};
use crate::spec::identify::IdentifyError;
use crate::spec::registers::{self, Capabilities};
use crate::spec::{CompletionEntry, SubmissionEntry};
use crate::{Controller, ControllerConfig, DataSegment, IoQueuePair, Lba, NamespaceRefusal, NvmeError, QueueId};

fn config() -> ControllerConfig {
    ControllerConfig { admin_timeout: Duration::from_millis(200), ..ControllerConfig::default() }
}

fn bring_up(script: FakeScript) -> (Arc<FakeDevice>, Controller) {
    let device = FakeDevice::new(script);
    let controller = Controller::init(device.clone(), config()).expect("bring-up");
    (device, controller)
}

/// A Flush of namespace 1: a command with no data, for tests about queue mechanics.
fn flush() -> SubmissionEntry {
    SubmissionEntry::flush(crate::NamespaceId(1))
}

/// A depth-8 I/O queue pair on a fake controller that answers no I/O, with `count` flushes
/// (tags 0..count) submitted and published, and its CQ entries, where the test posts the
/// completions itself (`post_completion`). The device and controller come back to be kept alive.
fn hand_posted_flushes(count: u64) -> (Arc<FakeDevice>, Controller, IoQueuePair, crate::hw::DmaRegion) {
    let (device, controller) = bring_up(FakeScript { io_unanswered: true, ..FakeScript::default() });
    let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
    for tag in 0..count {
        queue.submit_raw(flush(), tag).expect("submit");
    }
    queue.ring_doorbell().expect("ring");
    let ring = device.pool().translate(queue.completion_iova(), 8 * 16).expect("CQ entries");
    (device, controller, queue, ring)
}

/// Writes a completion of `command_id` reporting SQ head `sq_head` into CQ entry `index` with
/// phase tag `phase`.
fn post_completion(ring: &crate::hw::DmaRegion, index: usize, command_id: u16, sq_head: u16, phase: u16) {
    let entry = CompletionEntry { dw0: 0, dw1: 0, sq_head, sq_id: 1, command_id, status_and_phase: phase };
    ring.write(index * 16, &entry.to_bytes()).expect("post");
}

/// Submits up to `count` flushes tagged from `next_tag` on, stopping at back-pressure; returns
/// the next tag.
fn submit_flushes(queue: &mut IoQueuePair, count: usize, mut next_tag: u64) -> u64 {
    for _ in 0..count {
        if queue.submit_raw(flush(), next_tag).is_err() {
            break;
        }
        next_tag += 1;
    }
    next_tag
}

/// A raw completion for I/O queue 1.
fn completion(command_id: u16, sq_head: u16) -> [u8; 16] {
    CompletionEntry { dw0: 0, dw1: 0, sq_head, sq_id: 1, command_id, status_and_phase: 0 }.to_bytes()
}

#[test]
fn cap_mqes_zero_is_refused_instead_of_panicking() {
    // Goal: MQES = 0 (one-entry queues, reserved by the spec) is an Unsupported error; it used
    // to panic bring-up (`clamp` with min > max).
    let capabilities = Capabilities::build(256, 1, 0, 0, 0).0 & !0xFFFF;
    let device = FakeDevice::new(FakeScript { capabilities, ..FakeScript::default() });
    let result = Controller::init(device, config());
    assert!(matches!(result, Err(NvmeError::Unsupported { .. })), "{result:?}");
}

#[test]
fn deep_queues_are_capped_so_command_ids_keep_generation_bits() {
    // Goal: a controller offering 65536 entries gets queues of at most 32768 (beyond that a
    // command id has no generation bits left); asking for more is a typed error.
    let script = FakeScript { capabilities: Capabilities::build(65536, 1, 0, 0, 0).0, ..FakeScript::default() };
    let (_device, controller) = bring_up(script);
    assert_eq!(controller.max_queue_depth(), 32768);
    let refused = controller.create_io_queue_pair(32769);
    assert!(matches!(refused, Err(NvmeError::InvalidQueueDepth { requested: 32769, max: 32768 })), "{refused:?}");
}

#[test]
fn namespaces_with_metadata_or_protection_are_refused_with_their_format() {
    // Goal: a namespace whose format moves metadata (extended LBA here) is not offered for I/O;
    // asking for it names the format. A data-only namespace next to it is used normally.
    let mut list = vec![0u8; 4096];
    list[0..4].copy_from_slice(&1u32.to_le_bytes());
    list[4..8].copy_from_slice(&2u32.to_le_bytes());
    list[8..12].copy_from_slice(&3u32.to_le_bytes());
    let mut protected = identify_namespace_bytes(512, 1024, 0, false);
    protected[29] = 1; // DPS: protection type 1
    let script = FakeScript {
        namespace_list: list,
        identify_namespaces: vec![identify_namespace_bytes(4096, 1024, 8, true), identify_namespace_bytes(512, 2048, 0, false), protected],
        ..FakeScript::default()
    };
    let (_device, controller) = bring_up(script);
    assert_eq!(controller.namespaces().len(), 1);
    assert_eq!(controller.namespaces()[0].id.0, 2);
    let refused: Vec<_> = controller.refused_namespaces().iter().map(|refused| (refused.id.0, refused.refusal)).collect();
    assert_eq!(
        refused,
        [
            (1, NamespaceRefusal::Metadata { metadata_bytes: 8, extended_lba: true }),
            (3, NamespaceRefusal::ProtectionInformation { protection_type: 1 })
        ]
    );
    let error = controller.namespace(crate::NamespaceId(1)).expect_err("refused");
    assert!(error.to_string().contains("LBA format 0 (4096-byte blocks) with 8 metadata bytes per block interleaved"), "{error}");
    let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
    let buffer = controller.dma().allocate(4096).expect("buffer");
    let read = queue.submit_read(crate::NamespaceId(1), Lba(0), &[DataSegment::new(buffer.iova(), 4096)], 0);
    assert!(matches!(read, Err(NvmeError::UnsupportedNamespaceFormat(_))), "{read:?}");
    assert_eq!(queue.in_flight(), 0, "nothing reached the queue");
}

#[test]
fn a_namespace_with_malformed_identify_data_is_refused_not_the_controller() {
    // Goal: Identify Namespace data the driver cannot compute with (LBADS 17 here, or a format
    // index past the defined formats, or NSZE = 0) refuses that namespace with the reason;
    // bring-up succeeds and the other namespace is used.
    let mut list = vec![0u8; 4096];
    for (index, nsid) in [1u32, 2, 3, 4].into_iter().enumerate() {
        list[4 * index..4 * index + 4].copy_from_slice(&nsid.to_le_bytes());
    }
    let mut bad_format = identify_namespace_bytes(512, 1024, 0, false);
    bad_format[26] = 5; // FLBAS names format 5; NLBAF = 0 defines one
    let script = FakeScript {
        namespace_list: list,
        identify_namespaces: vec![
            identify_namespace_bytes(4096, 1024, 0, false),
            identify_namespace_bytes(1 << 17, 1024, 0, false),
            bad_format,
            identify_namespace_bytes(512, 0, 0, false),
        ],
        ..FakeScript::default()
    };
    let (_device, controller) = bring_up(script);
    assert_eq!(controller.namespaces().iter().map(|namespace| namespace.id.0).collect::<Vec<_>>(), [1]);
    let refused: Vec<_> = controller.refused_namespaces().iter().map(|refused| (refused.id.0, refused.refusal)).collect();
    assert_eq!(
        refused,
        [
            (2, NamespaceRefusal::Malformed(IdentifyError::UnsupportedLbaSize { index: 0, lbads: 17 })),
            (3, NamespaceRefusal::Malformed(IdentifyError::FormatIndexOutOfRange { index: 5, count: 1 })),
            (4, NamespaceRefusal::Malformed(IdentifyError::BadNamespaceSize { size_blocks: 0 })),
        ]
    );
    let error = controller.namespace(crate::NamespaceId(2)).expect_err("refused");
    assert!(error.to_string().contains("2^17"), "{error}");
}

#[test]
fn a_namespace_whose_identify_fails_is_refused_not_the_controller() {
    // Goal: one namespace whose Identify Namespace completes with an error status refuses that
    // namespace (with the status), not the whole bring-up: the other namespace is used, and
    // asking for the failed one names the status.
    use crate::spec::status::codes;
    use crate::spec::NvmeStatus;
    let mut list = vec![0u8; 4096];
    list[0..4].copy_from_slice(&1u32.to_le_bytes());
    list[4..8].copy_from_slice(&2u32.to_le_bytes());
    let failure = NvmeStatus::generic(codes::INTERNAL_ERROR);
    let script = FakeScript {
        namespace_list: list,
        identify_namespaces: vec![identify_namespace_bytes(4096, 1024, 0, false), identify_namespace_bytes(4096, 1024, 0, false)],
        identify_namespace_failures: vec![(2, failure)],
        ..FakeScript::default()
    };
    let (_device, controller) = bring_up(script);
    assert_eq!(controller.namespaces().iter().map(|namespace| namespace.id.0).collect::<Vec<_>>(), [1]);
    let refused: Vec<_> = controller.refused_namespaces().iter().map(|refused| (refused.id.0, refused.refusal)).collect();
    assert_eq!(refused, [(2, NamespaceRefusal::IdentifyFailed(failure))]);
    let error = controller.namespace(crate::NamespaceId(2)).expect_err("refused");
    assert!(error.to_string().contains("Identify Namespace failed"), "{error}");
}

#[test]
fn a_completion_naming_an_sq_head_the_controller_cannot_have_reached_is_an_error() {
    // Goal: after one command was published (tail 1), a completion may report head 0 or 1;
    // head 5 (inside the ring but past our tail) or 100 (outside it) is a typed error (inside
    // the one for the command it names, whose outcome that makes unknown).
    for bad_head in [5u16, 100] {
        let script = FakeScript { io_completions: VecDeque::from([completion(0, bad_head)]), ..FakeScript::default() };
        let (_device, controller) = bring_up(script);
        let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
        queue.submit_raw(flush(), 0).expect("submit");
        queue.ring_doorbell().expect("ring");
        let reaped = queue.reap(8, |_| {});
        let Err(NvmeError::CommandOutcomeUnknown { reason, .. }) = reaped else { panic!("head {bad_head}: {reaped:?}") };
        assert!(
            matches!(*reason, NvmeError::InvalidSubmissionQueueHead { queue: QueueId(1), reported, head: 0, tail: 1 } if reported == u32::from(bad_head)),
            "head {bad_head}: {reason:?}"
        );
    }
}

#[test]
fn completions_posted_out_of_creation_order_may_report_sq_heads_going_backwards() {
    // Goal: SQHD is the SQ head when the completion entry was created (§4.6), and nothing
    // makes a controller post entries in the order it created them: one with several
    // completion engines may post C's entry (created at head 3) before A's (created at head
    // 1). A's head lies behind the last one reported but past A's own entry, up to the tail
    // published: it is believed, and the head does not move back. Every command completes and
    // the pair stays usable. A's completion used to fail the pair (InvalidSubmissionQueueHead)
    // and make A's outcome unknown although it succeeded.
    let script =
        FakeScript { io_completions: VecDeque::from([completion(2, 3), completion(0, 1), completion(1, 3)]), ..FakeScript::default() };
    let (_device, controller) = bring_up(script);
    let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
    for tag in [10, 11, 12] {
        queue.submit_raw(flush(), tag).expect("submit");
    }
    queue.ring_doorbell().expect("ring");
    let mut delivered = Vec::new();
    let reaped = queue.reap(8, |completion| delivered.push((completion.tag, completion.status)));
    assert_eq!(reaped.expect("reap"), 3);
    assert_eq!(delivered, [(12, Ok(())), (10, Ok(())), (11, Ok(()))]);
    assert!(!queue.failed());
    assert_eq!((queue.in_flight(), queue.free_slots()), (0, 7), "the head stayed at 3: the whole ring is free again");
    queue.submit_raw(flush(), 13).expect("the pair takes new commands");
}

#[test]
fn a_head_behind_the_last_one_reported_is_believed_only_inside_its_commands_own_window() {
    // Goal: a completion whose SQ head lies behind the last one reported is believed only if
    // that head lies past its own command's entry (A, at index 1, created at head 1 would
    // say it was never fetched: CompletionBeforeFetch is not bypassed by an older head), and
    // a completion naming no command in flight must still report a head between the last one
    // and the tail. Both fail the pair as before.
    let behind_its_own_entry = completion(1, 1);
    let naming_nothing = completion(0x7700, 1);
    for bad in [behind_its_own_entry, naming_nothing] {
        let script = FakeScript { io_completions: VecDeque::from([completion(2, 3), bad]), ..FakeScript::default() };
        let (_device, controller) = bring_up(script);
        let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
        for tag in [10, 11, 12] {
            queue.submit_raw(flush(), tag).expect("submit");
        }
        queue.ring_doorbell().expect("ring");
        let mut delivered = Vec::new();
        let reaped = queue.reap(8, |completion| delivered.push(completion.tag));
        assert_eq!(delivered, [12]);
        let reason = match reaped {
            Err(NvmeError::CommandOutcomeUnknown { tag: 11, reason, .. }) => *reason,
            Err(other) => other,
            Ok(count) => panic!("a completion with head 1 after head 3 was believed ({count} reaped)"),
        };
        assert!(matches!(reason, NvmeError::InvalidSubmissionQueueHead { queue: QueueId(1), reported: 1, head: 3, tail: 3 }), "{reason:?}");
        assert!(queue.failed());
    }
}

#[test]
fn a_head_behind_the_last_one_does_not_complete_a_command_never_published() {
    // Goal: a command whose entry was written but never published has no window at all: a
    // completion naming it with a head behind the last one reported is refused like one with
    // the current head (a_completion_for_a_command_never_published_fails_the_pair).
    let script =
        FakeScript { io_completions: VecDeque::from([completion(0, 1), completion(1, 2), completion(2, 3)]), ..FakeScript::default() };
    let (device, controller) = bring_up(script);
    let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
    for tag in 0..3 {
        queue.submit_raw(flush(), tag).expect("submit");
    }
    queue.ring_doorbell().expect("ring");
    assert_eq!(queue.reap(8, |_| {}).expect("reap"), 3);
    // Slots 3 and 4, generation 0 (slots are reused first-freed-first): SQ entries 3 and 4,
    // not published. Head 4 lies past the first one's entry, but not up to the tail published.
    queue.submit_raw(flush(), 7).expect("submit");
    queue.submit_raw(flush(), 8).expect("submit");
    let forged = CompletionEntry { dw0: 0, dw1: 0, sq_head: 4, sq_id: 1, command_id: 3, status_and_phase: 1 };
    let ring = device.pool().translate(queue.completion_iova(), 4 * 16).expect("CQ entries 0..4");
    ring.write(3 * 16, &forged.to_bytes()).expect("post");
    let reaped = queue.reap(8, |_| panic!("a completion for an unpublished command was delivered"));
    let Err(NvmeError::CommandOutcomeUnknown { tag: 7, reason, .. }) = reaped else { panic!("{reaped:?}") };
    assert!(matches!(*reason, NvmeError::InvalidSubmissionQueueHead { reported: 4, head: 3, tail: 3, .. }), "{reason:?}");
    assert!(queue.failed());
}

#[test]
fn a_head_far_behind_the_last_one_does_not_read_as_a_lap_forward() {
    // Goal: heads only move forward. On a ring of 8, A (SQ entry 0) is still in flight when
    // six later commands completed with head 7 and six more were published (tail 13 in the
    // stream, ring index 5). A's completion reports head 1: A was published a whole ring ago,
    // so that index may be entry 1 or entry 9 in the stream, and the head must not move on a
    // guess. It used to be read modulo the depth as a move from 7 forward to 1 (entry 9, two
    // entries the controller never reported consuming), which a completion naming nothing
    // then showed as the head it was judged against. A duplicate of A's completion, posted
    // after A completed, names nothing and so has no window: its head 1 read forward from 7
    // lies within the tail, but it must not move the head either.
    let (_device, _controller, mut queue, ring) = hand_posted_flushes(7);
    let post_in_phase = |index: usize, command_id: u16, sq_head: u16, phase: u16| post_completion(&ring, index, command_id, sq_head, phase);
    let post = |index: usize, command_id: u16, sq_head: u16| post_in_phase(index, command_id, sq_head, 1);
    for command in 1..7u16 {
        post(usize::from(command) - 1, command, 7);
    }
    let mut delivered = Vec::new();
    assert_eq!(queue.reap(8, |completion| delivered.push(completion.tag)).expect("reap"), 6);
    assert_eq!(delivered, [1, 2, 3, 4, 5, 6]);
    for tag in 10..16 {
        queue.submit_raw(flush(), tag).expect("submit");
    }
    queue.ring_doorbell().expect("ring");
    post(6, 0, 1);
    assert_eq!(queue.reap(8, |completion| delivered.push(completion.tag)).expect("A completes"), 1);
    assert_eq!(delivered.last(), Some(&0));
    post(7, 0, 1);
    let duplicate = queue.reap(8, |_| panic!("a duplicate completion was delivered"));
    assert!(matches!(duplicate, Err(NvmeError::UnexpectedCompletion { .. })), "{duplicate:?}");
    // The CQ wrapped: the next entry is at index 0 in phase 0.
    post_in_phase(0, 0x7700, 6, 0);
    let reaped = queue.reap(8, |_| panic!("a completion naming nothing was delivered"));
    assert!(
        matches!(reaped, Err(NvmeError::InvalidSubmissionQueueHead { reported: 6, head: 7, tail: 5, .. })),
        "the head A or its duplicate reported moved the head: {reaped:?}"
    );
}

#[test]
fn a_duplicates_old_head_fails_the_pair_when_it_reads_past_the_tail() {
    // Goal: the documented policy for a completion naming no command in flight (queue.rs,
    // "Rejected completions"): it has no window, so its SQ head is judged only by the range
    // from the last head reported to the tail published, and one outside it fails the pair,
    // even a duplicate's old head, a head the controller really had. On a ring of 8, A, B and
    // C complete (A with head 1, the others with head 3); A's completion is then posted again.
    // With nothing more published (tail 3), its head 1 lies outside 3..=3: the pair fails.
    // With six more commands published (tail 9, ring index 1), head 1 lies inside 3..=1 read
    // forward: the same duplicate is only unexpected and the pair goes on. The kernel rules
    // pin the same two outcomes (rules_check.c: BAD_SQ_HEAD and UNEXPECTED).
    for published_after in [0u64, 6] {
        let (_device, _controller, mut queue, ring) = hand_posted_flushes(3);
        let post = |index: usize, command_id: u16, sq_head: u16| post_completion(&ring, index, command_id, sq_head, 1);
        for (index, (command_id, sq_head)) in [(0, 1), (1, 3), (2, 3)].into_iter().enumerate() {
            post(index, command_id, sq_head);
        }
        assert_eq!(queue.reap(8, |_| {}).expect("A, B and C complete"), 3);
        for tag in 10..10 + published_after {
            queue.submit_raw(flush(), tag).expect("submit");
        }
        queue.ring_doorbell().expect("ring");
        // Slot 0 is busy again only with a later generation (id 8), if at all: id 0 names nothing.
        post(3, 0, 1);
        let reaped = queue.reap(8, |_| panic!("a duplicate completion was delivered"));
        if published_after == 0 {
            assert!(matches!(reaped, Err(NvmeError::InvalidSubmissionQueueHead { reported: 1, head: 3, tail: 3, .. })), "{reaped:?}");
            assert!(queue.failed(), "a duplicate's head past the tail fails the pair");
        } else {
            assert!(matches!(reaped, Err(NvmeError::UnexpectedCompletion { .. })), "{reaped:?}");
            assert!(!queue.failed(), "a duplicate's head inside the range is only unexpected");
        }
    }
}

#[test]
fn a_head_for_a_command_published_exactly_a_ring_ago_is_exact() {
    // Goal: a command's window (past its entry, up to the tail published) holds each ring index
    // once while it spans at most the depth, its own entry's index included once (as the end
    // of the window, never its start), so its place is exact at a span of exactly the depth,
    // as gio_sq_head_after reads it. On a ring of 8, A (SQ entry 0) is in flight while six
    // later commands complete with head 7, and one more (entry 7) is published: the tail is 8.
    // A's head 0 can only be entry 8: the head moves there, and a completion naming nothing
    // with head 7 (behind it) is then impossible. It used to be called ambiguous and the head
    // stayed at 7, so that head passed as unexpected.
    let (_device, _controller, mut queue, ring) = hand_posted_flushes(7);
    let post = |index: usize, command_id: u16, sq_head: u16| post_completion(&ring, index, command_id, sq_head, 1);
    for command in 1..7u16 {
        post(usize::from(command) - 1, command, 7);
    }
    let mut delivered = Vec::new();
    assert_eq!(queue.reap(8, |completion| delivered.push(completion.tag)).expect("reap"), 6);
    queue.submit_raw(flush(), 7).expect("submit");
    queue.ring_doorbell().expect("ring");
    post(6, 0, 0);
    assert_eq!(queue.reap(8, |completion| delivered.push(completion.tag)).expect("A completes"), 1);
    assert_eq!(delivered.last(), Some(&0));
    post(7, 0x7700, 7);
    let reaped = queue.reap(8, |_| panic!("a completion naming nothing was delivered"));
    assert!(
        matches!(reaped, Err(NvmeError::InvalidSubmissionQueueHead { reported: 7, head: 0, tail: 0, .. })),
        "A's head did not move the head to entry 8: {reaped:?}"
    );
}

#[test]
fn a_completion_short_of_its_commands_entry_leaves_the_head_where_it_was() {
    // Goal: a completion naming a command in flight whose SQ head lies between the last one
    // reported and the tail, but short of the command's own entry, fails the pair
    // (CompletionBeforeFetch, naming the head it reported) without moving the head: the pair
    // keeps reaping other completions after the failure, and those are judged against the head
    // the controller last reported for a command it had fetched, as the kernel judges them
    // (NOT_FETCHED leaves sq_head). On a ring of 8, seven commands are published (tail 7);
    // command 1 completes with head 2; a corrupt completion for command 6 (entry 6) reports head
    // 5. The head used to move to 5 before the refusal, so a duplicate of command 1's completion
    // (head 2) then read as an impossible head (InvalidSubmissionQueueHead, head 5) instead of an
    // unexpected completion.
    let (_device, _controller, mut queue, ring) = hand_posted_flushes(7);
    let post = |index: usize, command_id: u16, sq_head: u16| post_completion(&ring, index, command_id, sq_head, 1);
    post(0, 1, 2);
    let mut delivered = Vec::new();
    assert_eq!(queue.reap(8, |completion| delivered.push(completion.tag)).expect("command 1 completes"), 1);
    assert_eq!(delivered, [1]);
    post(1, 6, 5);
    let reaped = queue.reap(8, |_| panic!("a completion for an unfetched command was delivered"));
    let Err(NvmeError::CommandOutcomeUnknown { tag: 6, reason, .. }) = reaped else { panic!("{reaped:?}") };
    assert!(matches!(*reason, NvmeError::CompletionBeforeFetch { sq_index: 6, reported: 5, .. }), "{reason:?}");
    assert!(queue.failed());
    post(2, 0x7700, 2);
    let reaped = queue.reap(8, |_| panic!("a completion naming nothing was delivered"));
    assert!(
        matches!(reaped, Err(NvmeError::UnexpectedCompletion { command_id: crate::CommandId(0x7700), .. })),
        "the refused completion moved the head: {reaped:?}"
    );
    post(3, 0, 3);
    assert_eq!(queue.reap(8, |completion| delivered.push(completion.tag)).expect("command 0 completes"), 1);
    assert_eq!(delivered, [1, 0], "a later completion of another command is still delivered");
}

#[test]
fn a_completion_whose_sq_head_has_not_passed_its_command_fails_the_pair() {
    // Goal: SQHD counts the entries the controller consumed (§4.6), so a command at SQ index i
    // can complete only with a head past i. A controller that completes three commands at SQ
    // indices 0, 1 and 2 while reporting head 0 (it fetched none of them) is not believed:
    // the first completion makes that command's outcome unknown and fails the pair, so no
    // slot, scratch page or buffer of a command still in the SQ is freed for reuse. These
    // completions used to be accepted (and submission merely stopped one short of the head).
    let script =
        FakeScript { io_completions: VecDeque::from([completion(0, 0), completion(1, 0), completion(2, 0)]), ..FakeScript::default() };
    let (_device, controller) = bring_up(script);
    let mut queue = controller.create_io_queue_pair(4).expect("queue pair");
    for tag in 0..3 {
        queue.submit_raw(flush(), tag).expect("submit");
    }
    queue.ring_doorbell().expect("ring");
    let reaped = queue.reap(8, |_| panic!("a completion for an unfetched command was delivered"));
    let Err(NvmeError::CommandOutcomeUnknown { queue: QueueId(1), tag: 0, reason, .. }) = reaped else { panic!("{reaped:?}") };
    assert!(matches!(*reason, NvmeError::CompletionBeforeFetch { queue: QueueId(1), sq_index: 0, reported: 0, .. }), "{reason}");
    assert!(queue.failed());
    assert_eq!(queue.in_flight(), 3, "no slot was freed");
    let refused = queue.submit_raw(flush(), 3);
    assert!(matches!(refused, Err(NvmeError::QueueFailed { queue: QueueId(1), .. })), "{refused:?}");
}

#[test]
fn a_completion_for_a_command_never_published_fails_the_pair() {
    // Goal: a Flush written to the SQ but never published (no doorbell) cannot have been
    // fetched; a completion naming it with SQ head 0 (inside the range last head ..= tail
    // published, both 0) is refused all the same: the command's outcome is unknown, the pair
    // is failed, and the command keeps its slot. It used to complete (in flight 0) while its
    // entry stayed in the SQ for the next doorbell to publish.
    let (device, controller) = bring_up(FakeScript::default());
    let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
    queue.submit_raw(flush(), 7).expect("submit");
    // The command id of the first command in a fresh pair: slot 0, generation 0.
    let forged = CompletionEntry { dw0: 0, dw1: 0, sq_head: 0, sq_id: 1, command_id: 0, status_and_phase: 1 };
    let ring = device.pool().translate(queue.completion_iova(), 16).expect("CQ entry 0");
    ring.write(0, &forged.to_bytes()).expect("post");
    let reaped = queue.reap(8, |_| panic!("a completion for an unpublished command was delivered"));
    let Err(NvmeError::CommandOutcomeUnknown { queue: QueueId(1), tag: 7, reason, .. }) = reaped else { panic!("{reaped:?}") };
    assert!(matches!(*reason, NvmeError::CompletionBeforeFetch { sq_index: 0, reported: 0, .. }), "{reason}");
    assert!(queue.failed());
    assert_eq!((queue.in_flight(), queue.unpublished_submissions()), (1, 1));
}

#[test]
fn pairs_of_a_reset_that_never_saw_the_controller_stop_keep_their_rings() {
    // Goal: if a reset times out waiting for CSTS.RDY = 0, the old queues may still be live:
    // their pairs become stale, refuse to delete, and leak their rings when dropped. A later
    // reset that succeeds makes the remaining ones free to go.
    let (device, mut controller) = bring_up(FakeScript::default());
    let first = controller.create_io_queue_pair(8).expect("queue pair");
    let second = controller.create_io_queue_pair(8).expect("queue pair");
    let rings = [first.submission_iova(), first.completion_iova()];
    device.update_script(|script| script.disable_completes = false);
    let reset = controller.reset(false);
    assert!(matches!(reset, Err(NvmeError::ReadyTimeout { .. })), "{reset:?}");
    let undeleted = first.delete().expect_err("the queues may still be live");
    assert!(matches!(undeleted.source, NvmeError::QueueMaybeLive { .. }), "{}", undeleted.source);
    drop(undeleted);
    assert_eq!(controller.leaked_queue_pairs(), 1);
    let pool = device.pool();
    assert!(rings.iter().all(|iova| pool.translate(*iova, 16).is_ok()), "a ring of a possibly live queue was freed");
    device.update_script(|script| script.disable_completes = true);
    controller.reset(false).expect("the second reset sees the controller stop");
    second.delete().expect("gone with the successful reset");
    assert_eq!(controller.leaked_queue_pairs(), 1);
}

#[test]
fn a_controller_that_cannot_be_disabled_keeps_its_admin_memory() {
    // Goal: Controller's drop disables the controller; if CSTS.RDY never drops, the admin rings
    // are leaked rather than freed under a controller that may still write them.
    let (device, controller) = bring_up(FakeScript::default());
    let registers = device.registers();
    let admin_rings = [registers.read64(registers::ASQ), registers.read64(registers::ACQ)];
    device.update_script(|script| script.disable_completes = false);
    drop(controller);
    assert_eq!(registers.read32(registers::CC) & 1, 0, "teardown cleared CC.EN");
    let pool = device.pool();
    for iova in admin_rings {
        assert!(pool.translate(crate::Iova(iova), 16).is_ok(), "admin ring at {iova:#x} was freed while the controller may run");
    }
}

#[test]
fn the_active_namespace_list_is_read_only_while_it_is_well_formed() {
    // Goal: the list from the device is untrusted: only strictly ascending NSIDs below
    // FFFFFFFFh are used, up to the first one that breaks the rule.
    let mut list = vec![0u8; 4096];
    for (index, nsid) in [1u32, 1, 2].iter().enumerate() {
        list[index * 4..index * 4 + 4].copy_from_slice(&nsid.to_le_bytes());
    }
    let script = FakeScript {
        namespace_list: list,
        identify_namespaces: vec![identify_namespace_bytes(4096, 1024, 0, false), identify_namespace_bytes(512, 1024, 0, false)],
        ..FakeScript::default()
    };
    let (device, controller) = bring_up(script);
    assert_eq!(controller.namespaces().iter().map(|namespace| namespace.id.0).collect::<Vec<_>>(), [1]);
    // Bring-up identified the controller, the list and NSID 1 once: the duplicate stopped it.
    assert_eq!(device.counters().commands_by_queue.get(&0).copied(), Some(4), "Identify ×3 and Set Features");
}

#[test]
fn a_failed_creation_is_undone_or_its_rings_are_kept() {
    // Goal: when Create I/O SQ fails after the CQ was created, the driver deletes the CQ and
    // releases the id; if that delete fails too, the CQ stays on the controller, so the rings are
    // leaked and the id kept. A Create I/O CQ that never completes may have created the queue:
    // the same rule applies (here the cleanup cannot even run: the admin queue still holds the
    // lost command).
    use crate::spec::status::codes;
    use crate::spec::{AdminOpcode, NvmeStatus};
    let internal = NvmeStatus::generic(codes::INTERNAL_ERROR);
    let (device, controller) = bring_up(FakeScript::default());
    device.update_script(|script| script.admin_failures = vec![(AdminOpcode::CreateIoSubmissionQueue as u8, internal)]);
    let failed = controller.create_io_queue_pair(8);
    assert_eq!(failed.map(|_| ()).expect_err("create SQ fails").status(), Some(internal));
    assert_eq!(controller.leaked_queue_pairs(), 0, "the CQ was deleted again");
    device.update_script(|script| {
        script.admin_failures =
            vec![(AdminOpcode::CreateIoSubmissionQueue as u8, internal), (AdminOpcode::DeleteIoCompletionQueue as u8, internal)]
    });
    assert!(controller.create_io_queue_pair(8).is_err());
    assert_eq!(controller.leaked_queue_pairs(), 1, "the CQ could not be deleted: its ring is kept");
    device.update_script(|script| script.admin_failures.clear());
    let pair = controller.create_io_queue_pair(8).expect("queue pair");
    assert_eq!(pair.id(), QueueId(2), "queue id 1 still has a CQ on the controller");
    drop(pair);
    device.update_script(|script| script.admin_unanswered = vec![AdminOpcode::CreateIoCompletionQueue as u8]);
    let timed_out = controller.create_io_queue_pair(8);
    assert!(matches!(timed_out, Err(NvmeError::Timeout { .. })), "{timed_out:?}");
    assert_eq!(controller.leaked_queue_pairs(), 2, "a CQ that may exist keeps its ring");
}

#[test]
fn a_log_page_of_any_length_is_the_bytes_the_device_sent() {
    // Goal: a log page read whose length is not a multiple of 4 asks the device for the dwords
    // that cover it and returns exactly the bytes asked for, all of them the device's: before,
    // it asked for whole dwords rounded down and returned zeroes the device never sent.
    use crate::spec::LogPageId;
    let smart: Vec<u8> = (1..=512u32).map(|byte| byte as u8).collect();
    let script = FakeScript { log_pages: vec![(LogPageId::SmartHealth as u8, smart.clone())], ..FakeScript::default() };
    let (_device, controller) = bring_up(script);
    for bytes in [6, 1, 3, 4, 510, 512] {
        let log = controller.log_page(LogPageId::SmartHealth, bytes).expect("log page");
        assert_eq!(log, smart[..bytes], "{bytes} bytes");
    }
    assert_eq!(controller.log_page(LogPageId::SmartHealth, 8192).expect("log page").len(), 4096, "at most one page");
}

#[test]
fn a_timed_out_admin_command_keeps_its_buffer_until_it_completes() {
    // Goal: after Get Log Page times out, the controller may still write the page it named. The
    // next log page must not refill that page (it would race with the late transfer: torn bytes
    // on hardware, a data race against the software controller); it is refused before anything
    // is written or submitted, as is any other admin command. Once the late completion
    // arrives, the admin queue is usable again and the page is the driver's to reuse.
    use crate::spec::{AdminOpcode, LogPageId};
    let (device, controller) = bring_up(FakeScript::default());
    device.update_script(|script| script.admin_unanswered = vec![AdminOpcode::GetLogPage as u8]);
    let timed_out = controller.log_page(LogPageId::SmartHealth, 512);
    assert!(matches!(timed_out, Err(NvmeError::Timeout { queue: QueueId(0), .. })), "{timed_out:?}");
    let withheld = device.withheld_admin_commands();
    assert_eq!(withheld.len(), 1);
    // The late transfer lands (or is landing) in the page the command named.
    let page = device.pool().translate(crate::Iova(withheld[0].dptr[0]), 4096).expect("the log page buffer is mapped");
    page.fill(0, 4096, 0xA5).unwrap();
    let fetched = device.counters().commands_by_queue.get(&0).copied();
    let again = controller.log_page(LogPageId::SmartHealth, 512);
    assert!(matches!(again, Err(NvmeError::QueueBusy { queue: QueueId(0), outstanding: 1 })), "{again:?}");
    let mut bytes = vec![0u8; 4096];
    page.read(0, &mut bytes).unwrap();
    assert!(bytes.iter().all(|&byte| byte == 0xA5), "the driver wrote the page while the device still owned it");
    let refused = controller.set_volatile_write_cache(true);
    assert!(matches!(refused, Err(NvmeError::QueueBusy { .. })), "{refused:?}");
    assert_eq!(device.counters().commands_by_queue.get(&0).copied(), fetched, "nothing reached the admin queue");
    // The controller finally answers: the late completion is consumed and the page reused.
    device.update_script(|script| script.admin_unanswered.clear());
    assert_eq!(device.answer_withheld(), 1);
    let log = controller.log_page(LogPageId::SmartHealth, 512).expect("the admin queue is idle again");
    assert_eq!(log, vec![0u8; 512], "the fake sends no log data: the driver's zeroing shows");
}

#[test]
fn a_detached_pair_whose_doorbells_lie_outside_bar0_is_refused() {
    // Goal: CAP.DSTRD is device data. With a stride of 2 KiB (DSTRD 9) the fake's 8 KiB BAR0
    // holds the admin doorbells but not queue 1's: a detached pair, whose doorbells another
    // agent (a GPU kernel) writes with no check of its own, is refused with a typed error
    // before the controller creates any queue, exactly like a host-driven pair.
    let script = FakeScript { capabilities: Capabilities::build(256, 1, 9, 0, 0).0, ..FakeScript::default() };
    let (device, controller) = bring_up(script);
    let fetched = device.counters().commands_by_queue.get(&0).copied();
    let detached = controller.create_detached_queue_pair(8, None);
    assert!(
        matches!(detached, Err(NvmeError::DoorbellOutsideBar { queue: QueueId(1), offset: 0x2800, bar_bytes: 0x2000 })),
        "{detached:?}"
    );
    let host_driven = controller.create_io_queue_pair(8);
    assert!(matches!(host_driven, Err(NvmeError::DoorbellOutsideBar { queue: QueueId(1), .. })), "{host_driven:?}");
    assert_eq!(device.counters().commands_by_queue.get(&0).copied(), fetched, "no Create I/O CQ/SQ was sent");
    assert_eq!(controller.leaked_queue_pairs(), 0);
}

/// CQ head doorbell writes the fake saw for I/O queue 1.
fn completion_doorbells(device: &FakeDevice) -> u64 {
    device.counters().completion_doorbells_by_queue.get(&1).copied().unwrap_or(0)
}

/// Completions the fake holds now on I/O CQ 1 for want of room.
fn waiting_for_room(device: &FakeDevice) -> usize {
    device.completions_waiting_for_room(1)
}

#[test]
fn a_deep_queue_with_spare_entries_writes_the_cq_head_once_per_many_completions() {
    // Goal: with 8 commands kept in flight in a queue of 17 entries, a reap leaves the CQ head
    // doorbell for later while the controller still has an entry for every command
    // outstanding, so one write answers about nine completions; when a ring needs it, it
    // follows the SQ tail of the same ring, so no completion waits for room past that ring.
    let (device, controller) = bring_up(FakeScript::default());
    let mut queue = controller.create_io_queue_pair(17).expect("queue pair");
    for tag in 0..8 {
        queue.submit_raw(flush(), tag).expect("submit");
    }
    queue.ring_doorbell().expect("ring");
    for tag in 8..208 {
        assert_eq!(queue.reap(1, |_| {}).expect("reap"), 1);
        queue.submit_raw(flush(), tag).expect("submit");
        queue.ring_doorbell().expect("ring");
        assert_eq!(waiting_for_room(&device), 0, "a completion still waits for room after the ring of command {tag}");
    }
    let doorbells = completion_doorbells(&device);
    assert!((20..=25).contains(&doorbells), "{doorbells} CQ head doorbells for 200 completions");
}

/// Runs `commands` Flushes one at a time through a fresh I/O pair of `depth` entries: after
/// each ring no completion may wait for room; `check(device, tag, reaped)` runs after the ring
/// (`reaped` false) and after the reap (true). Returns the CQ head doorbells the fake saw and
/// the completions it held for room.
fn one_command_at_a_time(depth: u32, commands: u64, mut check: impl FnMut(&FakeDevice, u64, bool)) -> (u64, u64) {
    let (device, controller) = bring_up(FakeScript::default());
    let mut queue = controller.create_io_queue_pair(depth).expect("queue pair");
    for tag in 0..commands {
        queue.submit_raw(flush(), tag).expect("submit");
        queue.ring_doorbell().expect("ring");
        assert_eq!(waiting_for_room(&device), 0);
        check(&device, tag, false);
        assert_eq!(queue.reap(8, |_| {}).expect("reap"), 1);
        check(&device, tag, true);
    }
    (completion_doorbells(&device), device.counters().completions_held_for_room)
}

#[test]
fn at_queue_depth_one_the_head_follows_the_next_tail() {
    // Goal: in a queue of two entries (what a job of one command at a time opens), the head
    // of each completion is not written when the queue goes idle but by the next ring, after
    // its SQ tail. The fake executes a command as its tail is written, so it finds the CQ
    // full by the head it was told and holds the completion until the head that follows:
    // one hold per command after the first shows the order, and none is left after a ring.
    let (doorbells, held) = one_command_at_a_time(2, 100, |device, tag, reaped| {
        let why = if reaped { "an idle queue writes no head" } else { "the head of the previous command went out with this ring" };
        assert_eq!(device.completion_queue_head(1), Some(tag as u32 % 2), "{why}");
    });
    assert_eq!(doorbells, 99);
    assert_eq!(held, 99);
}

#[test]
fn at_queue_depth_one_a_queue_with_spare_entries_writes_the_head_once_per_ring_of_entries() {
    // Goal: one command at a time in a queue of 64 entries writes the CQ head only when the
    // controller could run short: once per 63 completions. The fake, which executes at the
    // tail, holds that ring's completion until the head that follows it, and only then.
    let (doorbells, held) = one_command_at_a_time(64, 200, |_, _, _| {});
    assert_eq!(doorbells, 3, "200 completions, a head per 63");
    assert_eq!(held, 3);
}

#[test]
fn unpublished_submissions_count_what_the_last_tail_doorbell_left_out() {
    // Goal: the count a caller uses to decide when to ring covers each entry written since the
    // last SQ tail doorbell, falls to zero at the ring, and follows the ring's wrap. The fake
    // executes commands when their tail is written: nothing completes before the ring.
    let (_device, controller) = bring_up(FakeScript::default());
    let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
    let mut tag = 0u64;
    for round in 0..5 {
        for pending in 1..=5 {
            queue.submit_raw(flush(), tag).expect("submit");
            tag += 1;
            assert_eq!(queue.unpublished_submissions(), pending, "round {round}");
        }
        assert_eq!(queue.reap(8, |_| {}).expect("reap"), 0, "round {round}: unpublished commands ran");
        queue.ring_doorbell().expect("ring");
        assert_eq!(queue.unpublished_submissions(), 0, "round {round}");
        assert_eq!(queue.reap(8, |_| {}).expect("reap"), 5, "round {round}: the ring published all five");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]
    #[test]
    fn the_cq_head_doorbell_waits_only_while_the_controller_has_room(
        depth in 2u32..=12,
        rounds in proptest::collection::vec((0usize..=12, 0usize..=12), 1..40),
    ) {
        // Goal: whatever the pattern of submissions and partial reaps, the controller has a CQ
        // entry for each command it may complete once a ring or reap returns (the fake holds a
        // completion whose CQ is full by the head it was told; a hold may last only from a
        // ring's SQ tail to the head written right after it, never past the ring), every
        // command completes, and each doorbell write publishes something new.
        let (device, controller) = bring_up(FakeScript::default());
        let mut queue = controller.create_io_queue_pair(depth).expect("queue pair");
        let (mut submitted, mut completed) = (0u64, 0u64);
        for (submit, reap) in rounds {
            submitted = submit_flushes(&mut queue, submit, submitted);
            queue.ring_doorbell().expect("ring");
            proptest::prop_assert_eq!(waiting_for_room(&device), 0, "a completion waits for room after a ring");
            for _ in 0..reap {
                queue.reap(1, |_| completed += 1).expect("reap");
                proptest::prop_assert_eq!(waiting_for_room(&device), 0, "a completion waits for room after a reap");
            }
        }
        while queue.in_flight() > 0 {
            let reaped = queue.reap(usize::MAX, |_| completed += 1).expect("reap");
            proptest::prop_assert!(reaped > 0, "{} in flight and nothing posted: the controller waits for room", queue.in_flight());
        }
        proptest::prop_assert_eq!(completed, submitted);
        proptest::prop_assert_eq!(device.counters().repeated_completion_heads, 0);
        proptest::prop_assert!(completion_doorbells(&device) <= completed);
    }

    #[test]
    fn completion_pending_says_exactly_when_reap_reports_something(
        rounds in proptest::collection::vec((1usize..=3, 1usize..=3), 1..24),
        scripted in proptest::collection::vec((0u16..4, 0u16..4, proptest::bool::ANY, 0u16..3), 0..12),
        use_script in proptest::bool::ANY,
    ) {
        // Goal: the one-load poll of spin loops never diverges from reap, the slow path: it is
        // true exactly when reap(1) returns a completion or an error, across phase wrap-arounds
        // of a small ring, and for completions the controller gets wrong (a stale phase bit, an
        // unknown command id, a bad SQ head: reap must still get to see and report those).
        let completions = scripted
            .iter()
            .map(|&(command_id, sq_head, phase, sq_id_offset)| {
                CompletionEntry { dw0: 0, dw1: 0, sq_head, sq_id: 1 + sq_id_offset / 2, command_id, status_and_phase: u16::from(phase) }.to_bytes()
            })
            .collect();
        // Without a script the fake posts right completions with the right phase.
        let script = if use_script {
            FakeScript { io_completions: completions, io_phase_from_script: true, ..FakeScript::default() }
        } else {
            FakeScript::default()
        };
        let (_device, controller) = bring_up(script);
        let mut queue = controller.create_io_queue_pair(4).expect("queue pair");
        let mut tag = 0u64;
        for (submit, reap) in rounds {
            tag = submit_flushes(&mut queue, submit, tag);
            queue.ring_doorbell().expect("ring");
            for _ in 0..reap {
                let pending = queue.completion_pending();
                let reaped = queue.reap(1, |_| {});
                proptest::prop_assert_eq!(pending, !matches!(reaped, Ok(0)), "pending {} but reap gave {:?}", pending, reaped);
                if reaped.is_err() {
                    return Ok(());
                }
            }
        }
    }
}

#[test]
fn a_controller_found_mid_enable_is_disabled_only_once_ready() {
    // Goal: a function left mid-enable (CC.EN = 1, CSTS.RDY = 0: a crashed process's bring-up)
    // is disabled only after it reaches RDY = 1: clearing EN during an enable is undefined by
    // the spec, and the RDY = 0 read right after could be the enable not yet done rather than
    // the reset (the bring-up would then mark the old queues quiesced without evidence). It
    // used to clear EN at once. (Teardown's `stop` takes the same step; a fake cannot be put
    // mid-enable under a live controller, so only bring-up and a reset are driven here.)
    let script = FakeScript { starts_enabling: true, enable_ready_after_status_reads: 20, ..FakeScript::default() };
    let (device, mut controller) = bring_up(script);
    assert_eq!(device.counters().disables_before_ready, 0, "bring-up cleared EN before RDY");
    assert_eq!(device.counters().disables, 1);
    // Our own enables now take 20 CSTS reads too: a reset waits for them as before.
    controller.reset(false).expect("reset");
    assert_eq!((device.counters().disables_before_ready, device.counters().disables), (0, 2));
}

#[test]
fn a_controller_left_running_is_disabled_before_any_memory_is_mapped_for_it() {
    // Goal: a function an earlier process left enabled (CC.EN = 1 with CSTS.RDY = 1, or still
    // enabling) may DMA into anything mapped while it runs, through queues that process
    // created. Bring-up disables it and waits for CSTS.RDY = 0 before it maps the admin rings
    // and the scratch page (it used to map them first), and before it lets the function master
    // the bus. The fake is also run mastering from the start (a backend without that gate):
    // then the early stop alone keeps the mappings safe.
    let left_running = FakeScript { starts_enabled: true, ..FakeScript::default() };
    let mid_enable = FakeScript { starts_enabling: true, enable_ready_after_status_reads: 20, ..FakeScript::default() };
    for script in [left_running, mid_enable] {
        for starts_mastering in [false, true] {
            let (device, controller) = bring_up(FakeScript { starts_mastering, ..script.clone() });
            let counters = device.counters();
            assert_eq!(counters.mappings_while_left_enabled, 0, "memory was mapped before the controller was seen to stop");
            assert_eq!(counters.bus_master_enables_while_left_enabled, 0, "bus mastering went on before the controller was seen to stop");
            assert_eq!((counters.disables, counters.disables_before_ready), (1, 0));
            drop(controller);
        }
    }
}

#[test]
fn a_timeout_names_the_oldest_command_outstanding() {
    // Goal: when commands never complete, the timeout names the one issued first, which is
    // the one most overdue. Slots are reused in the order they were freed, so once every slot
    // was used, the oldest command (B, in the last slot) sits above a newer one (C, reusing
    // slot 0): the timeout used to name the lowest busy slot, C.
    let (device, controller) = bring_up(FakeScript::default());
    let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
    let mut completed = Vec::new();
    for tag in 0..6 {
        queue.submit_raw(flush(), tag).expect("a command that completes");
        queue.ring_doorbell().expect("ring");
        queue.reap(8, |completion| completed.push((completion.tag, completion.command_id))).expect("reap");
    }
    assert_eq!(completed.iter().map(|(tag, _)| *tag).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5], "slots 0 to 5 used");
    device.update_script(|script| script.io_unanswered = true);
    queue.submit_raw(flush(), 6).expect("B");
    queue.ring_doorbell().expect("ring B");
    queue.submit_raw(flush(), 7).expect("C");
    queue.ring_doorbell().expect("ring C");
    assert_eq!(device.counters().io_unanswered, 2, "B and C are lost");
    let timed_out = queue.wait_idle(std::time::Instant::now() + Duration::from_millis(20), |_| {});
    let Err(NvmeError::Timeout { queue: QueueId(1), command_id, outstanding: 2, .. }) = timed_out else {
        panic!("{timed_out:?}");
    };
    assert_eq!(command_id.0 & 7, 6, "the timeout named {command_id}, not B (slot 6), the oldest command outstanding");
}

#[test]
fn a_duplicated_completion_of_an_earlier_command_is_not_taken_for_a_later_one() {
    // Goal: a command id recurs only after every slot was used again, so a completion the
    // controller posts twice (a firmware bug) for a command long done names no command in
    // flight. Slots used to be reused last-freed-first: at queue depth 1 every command took
    // slot 0, its id recurred every 2^13 commands on a depth-8 queue (every 2 at depth 32768),
    // and the stale completion was delivered as the later command's, before its data landed.
    let (device, controller) = bring_up(FakeScript::default());
    let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
    let mut first = None;
    // 2^13 commands, one at a time: under last-freed-first the next one carried A's id again.
    for tag in 0..8192u64 {
        queue.submit_raw(flush(), tag).expect("submit");
        queue.ring_doorbell().expect("ring");
        queue.reap(8, |completion| first = first.or(Some(completion.command_id))).expect("reap");
    }
    let first = first.expect("A completed");
    device.update_script(|script| script.io_unanswered = true);
    queue.submit_raw(flush(), 8192).expect("C");
    queue.ring_doorbell().expect("ring C");
    // D's fetch posts A's completion again, naming an SQ head past C's entry (8194 entries
    // pushed on a ring of 8: head 2).
    device.update_script(|script| {
        script.io_unanswered = false;
        script.io_completions.push_back(completion(first.0, 2));
    });
    queue.submit_raw(flush(), 8193).expect("D");
    queue.ring_doorbell().expect("ring D");
    let mut delivered = Vec::new();
    let reaped = queue.reap(8, |completion| delivered.push(completion.tag));
    assert!(!delivered.contains(&8192), "A's stale completion was taken for C ({reaped:?})");
    assert!(matches!(reaped, Err(NvmeError::UnexpectedCompletion { .. })), "{reaped:?}");
}

#[test]
fn a_rejected_completion_naming_a_command_in_flight_fails_that_command_and_the_pair() {
    // Goal: a completion whose command id names a command in flight but whose SQ id or SQ head
    // is impossible breaks the queue protocol. That command's outcome is unknown: the error
    // names it (command id, opcode, tag) so its caller learns of it, its slot stays reserved
    // (the controller may still read its scratch page and move its data) and counts as in
    // flight, and the pair takes no new command. Completions of other commands are still
    // delivered; a wait for the pair to go idle fails at once instead of at its deadline. It
    // used to report only the bad field, leave the command busy with no word to its caller,
    // and keep accepting commands.
    let wrong_queue = CompletionEntry { dw0: 0, dw1: 0, sq_head: 2, sq_id: 7, command_id: 1, status_and_phase: 0 }.to_bytes();
    let impossible_head = completion(1, 100);
    for bad in [wrong_queue, impossible_head] {
        let script = FakeScript { io_completions: VecDeque::from([completion(0, 1), bad, completion(2, 3)]), ..FakeScript::default() };
        let (_device, controller) = bring_up(script);
        let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
        for tag in [10, 11, 12] {
            queue.submit_raw(flush(), tag).expect("submit");
        }
        queue.ring_doorbell().expect("ring");
        let mut delivered = Vec::new();
        let reaped = queue.reap(8, |completion| delivered.push(completion.tag));
        let Err(NvmeError::CommandOutcomeUnknown { queue: QueueId(1), command_id, opcode, tag: 11, reason }) = reaped else {
            panic!("{reaped:?}");
        };
        assert_eq!((command_id.0, opcode), (1, flush().opcode()));
        assert!(matches!(*reason, NvmeError::WrongSubmissionQueue { .. } | NvmeError::InvalidSubmissionQueueHead { .. }), "{reason}");
        assert_eq!(delivered, [10], "the completion before the bad one was delivered");
        assert!(queue.failed());
        assert_eq!(queue.reap(8, |completion| delivered.push(completion.tag)).expect("later completions"), 1);
        assert_eq!(delivered, [10, 12], "a well-formed completion after it still completes its command");
        assert_eq!(queue.in_flight(), 1, "the command whose outcome is unknown keeps its slot");
        let refused = queue.submit_raw(flush(), 13);
        assert!(matches!(refused, Err(NvmeError::QueueFailed { queue: QueueId(1), unknown_outcomes: 1 })), "{refused:?}");
        assert_eq!(queue.in_flight(), 1, "nothing new was queued");
        let started = std::time::Instant::now();
        let idle = queue.wait_idle(started + Duration::from_secs(5), |_| {});
        assert!(matches!(idle, Err(NvmeError::QueueFailed { .. })), "{idle:?}");
        assert!(started.elapsed() < Duration::from_secs(1), "the wait gave up at once, not at its deadline");
        // Deleting the pair makes the controller abort or finish the command: the rings go.
        queue.delete().expect("delete");
        assert_eq!(controller.leaked_queue_pairs(), 0);
    }
}

/// Attaches queue 1 of `controller`, created detached, as a client process would with a grant
/// carrying `namespaces`, `mode` and `max_transfer_bytes` off the daemon's wire. The detached
/// pair is returned too: dropping it deletes the queues.
fn attach_with(
    device: &FakeDevice,
    controller: &Controller,
    namespaces: Vec<crate::Namespace>,
    mode: crate::DataPointerMode,
    max_transfer_bytes: u64,
) -> (crate::DetachedQueuePair, Result<IoQueuePair, NvmeError>) {
    attach_requiring(device, controller, namespaces, mode, max_transfer_bytes, false)
}

/// As [`attach_with`], the grant saying whether the controller requires whole-dword SGL lengths.
fn attach_requiring(
    device: &FakeDevice,
    controller: &Controller,
    namespaces: Vec<crate::Namespace>,
    mode: crate::DataPointerMode,
    max_transfer_bytes: u64,
    sgl_dword_lengths: bool,
) -> (crate::DetachedQueuePair, Result<IoQueuePair, NvmeError>) {
    let detached = controller.create_detached_queue_pair(8, None).expect("detached pair");
    let layout = detached.layout();
    let pool = device.pool();
    let rings = (
        pool.translate(layout.submission_iova, 8 * crate::spec::SUBMISSION_ENTRY_BYTES).expect("SQ"),
        pool.translate(layout.completion_iova, 8 * crate::spec::COMPLETION_ENTRY_BYTES).expect("CQ"),
    );
    let config = crate::AttachedQueueConfig { layout, namespaces, data_pointer_mode: mode, max_transfer_bytes, sgl_dword_lengths };
    let attached = IoQueuePair::attach(config, rings, controller.dma().as_ref(), device.registers());
    (detached, attached)
}

#[test]
fn an_attach_grant_with_block_sizes_or_a_transfer_limit_the_driver_cannot_use_is_refused() {
    // Goal: the namespaces and the transfer limit of an attach come off tuttid's wire, so they
    // are checked like Identify data: a block size that is not a power of two in 512..=65536
    // (0 used to panic the first transfer of two segments with a remainder by zero), and a
    // limit below one block or above the 2 MiB one command carries at most (u64::MAX used to
    // let a transfer's later command fail NLB's 16 bits after the earlier ones were queued),
    // are typed errors at attach. A grant as a real controller makes is accepted.
    use crate::{DataPointerMode, Namespace, NamespaceId};
    let (device, controller) = bring_up(FakeScript::default());
    let namespace_with = |id, block_size_bytes| Namespace { id: NamespaceId(id), block_size_bytes, size_blocks: 1 << 20 };
    let namespace = |block_size_bytes| namespace_with(1, block_size_bytes);
    for block_size_bytes in [0u32, 256, 768, 1 << 17] {
        let (_detached, attached) = attach_with(&device, &controller, vec![namespace(block_size_bytes)], DataPointerMode::Sgl, 1 << 20);
        assert!(
            matches!(attached, Err(NvmeError::InvalidNamespaceBlockSize { namespace: NamespaceId(1), block_size_bytes: size }) if size == block_size_bytes),
            "block size {block_size_bytes}: {attached:?}"
        );
    }
    for (block_size_bytes, max_transfer_bytes) in [(512u32, u64::MAX), (512, (2 << 20) + 512), (4096, 2048), (512, 0)] {
        let (_detached, attached) =
            attach_with(&device, &controller, vec![namespace(block_size_bytes)], DataPointerMode::Sgl, max_transfer_bytes);
        assert!(
            matches!(attached, Err(NvmeError::InvalidMaxTransfer { max_transfer_bytes: max, .. }) if max == max_transfer_bytes),
            "{block_size_bytes}-byte blocks, limit {max_transfer_bytes}: {attached:?}"
        );
    }
    let (_detached, attached) =
        attach_with(&device, &controller, vec![namespace(512), namespace_with(2, 65536)], DataPointerMode::Prp, 2 << 20);
    let mut pair = attached.expect("a grant as a controller makes it");
    let buffer = controller.dma().allocate(8192).expect("buffer");
    let halves = [DataSegment::new(buffer.iova(), 4096), DataSegment::new(buffer.iova().checked_add(4096).expect("iova"), 4096)];
    assert_eq!(pair.submit_read(NamespaceId(1), Lba(0), &halves, 0).expect("a two-segment read"), 1);
}

#[test]
fn an_attached_pair_refuses_odd_sgl_lengths_where_its_grant_says_the_controller_requires_dwords() {
    // Goal: a pair attached from a grant carries the controller's whole-dword SGL requirement,
    // as a pair the controller made does: 510 + 2 bytes is refused with nothing queued (it was
    // sent, for the controller to fail), 508 + 4 is taken; without the requirement both are.
    use crate::{DataPointerMode, Namespace, NamespaceId};
    let (device, controller) = bring_up(FakeScript::default());
    let namespace = Namespace { id: NamespaceId(1), block_size_bytes: 512, size_blocks: 1 << 20 };
    for required in [true, false] {
        let (_detached, attached) = attach_requiring(&device, &controller, vec![namespace], DataPointerMode::Sgl, 1 << 20, required);
        crate::io::tests::check_dword_sgl_rule(&mut attached.expect("attach"), required);
    }
}

#[test]
fn command_id_ffff_is_never_issued() {
    // Goal: FFFFh should not be used as a command id (the Error Information log uses it for
    // "no particular command"). A depth-3 pair has one slot bit, so its slot 1 reaches id
    // FFFFh when its 15-bit generation is all ones, after 32767 commands; with both slots busy
    // every round, 70,000 rounds wrap the generation twice. It used to issue FFFFh.
    let (_device, controller) = bring_up(FakeScript::default());
    let mut queue = controller.create_io_queue_pair(3).expect("queue pair");
    for round in 0..70_000u64 {
        for tag in 0..2 {
            queue.submit_raw(flush(), tag).expect("submit");
        }
        queue.ring_doorbell().expect("ring");
        let mut ids = Vec::with_capacity(2);
        assert_eq!(queue.reap(2, |completion| ids.push(completion.command_id.0)).expect("reap"), 2, "round {round}");
        assert!(!ids.contains(&0xFFFF), "round {round} issued command id FFFFh");
    }
}

#[test]
fn a_function_left_running_cannot_dma_into_memory_mapped_for_another_function_of_its_space() {
    // Goal: two functions in one DMA space (one VFIO container, one pool) are brought up one
    // after the other, as a striped pool's are. The second was left running by a crashed
    // process; while the first is brought up, its admin rings and scratch page are mapped into
    // the shared space, so the second must not be able to DMA then (it could write them
    // through its old queues). Bus mastering stays off for a function until its own bring-up
    // saw it stop. It used to be on for every function from open, so the second could DMA
    // into the first's new rings until its own bring-up disabled it.
    let devices = FakeDevice::new_in_one_space([FakeScript::default(), FakeScript { starts_enabled: true, ..FakeScript::default() }]);
    let [first, left_running] = [Arc::clone(&devices[0]), Arc::clone(&devices[1])];
    let first_controller = Controller::init(first, config()).expect("bring-up of the first");
    assert_eq!(
        left_running.counters().mappings_while_left_enabled,
        0,
        "the first function's memory was mapped while the second, left running, could DMA"
    );
    let second_controller = Controller::init(left_running.clone(), config()).expect("bring-up of the second");
    let counters = left_running.counters();
    assert_eq!(counters.mappings_while_left_enabled, 0);
    assert_eq!(counters.bus_master_enables_while_left_enabled, 0, "the second could DMA before its bring-up saw it stop");
    // A function-level reset leaves bus mastering off, as VFIO's does; the bring-up after it
    // turns it on again once the controller was seen stopped.
    let mut second_controller = second_controller;
    second_controller.reset(true).expect("reset with FLR");
    for controller in [&first_controller, &second_controller] {
        let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
        queue.submit_raw(flush(), 0).expect("submit");
        queue.complete_all(Duration::from_millis(200)).expect("both functions serve I/O");
    }
    assert_eq!(left_running.counters().doorbells_without_bus_master, 0);
}

#[test]
fn detached_rings_outside_the_controllers_dma_space_or_shared_by_both_queues_are_refused() {
    // Goal: the rings a caller hands create_detached_queue_pair are programmed into the
    // controller by IOVA, so they must be memory the controller's own DMA space maps at that
    // IOVA, and the SQ and CQ must not overlap. A region of another identity pool carries an
    // IOVA (from 1 << 32) that this controller's pool maps to other memory, its admin SQ among
    // it; one region given as both rings makes the controller write completions over the
    // commands. Both are refused before any Create I/O queue command is sent.
    let (device, controller) = bring_up(FakeScript::default());
    let sent = device.counters().commands_by_queue.get(&0).copied();
    let depth = 8usize;
    let (sq_bytes, cq_bytes) = (depth * crate::spec::SUBMISSION_ENTRY_BYTES, depth * crate::spec::COMPLETION_ENTRY_BYTES);
    let foreign = crate::hw::DmaPool::identity();
    let rings = (foreign.allocate(sq_bytes).expect("SQ"), foreign.allocate(cq_bytes).expect("CQ"));
    assert!(
        controller.dma().translate(rings.0.iova(), sq_bytes).is_ok(),
        "the test needs the foreign IOVA to name memory in the controller's space too"
    );
    let result = controller.create_detached_queue_pair(depth as u32, Some(rings));
    assert!(matches!(result, Err(NvmeError::RingNotDeviceMemory { ring: "submission ring", .. })), "{result:?}");

    let shared = controller.dma().allocate(sq_bytes).expect("ring");
    let result = controller.create_detached_queue_pair(depth as u32, Some((shared.clone(), shared.clone())));
    assert!(matches!(result, Err(NvmeError::RingsOverlap { .. })), "{result:?}");
    // Rings at IOVAs apart that are two mappings of the same host pages overlap too.
    let memory = crate::hw::SharedMemory::create("detached-rings-test", 4096).expect("shared memory");
    let (first, second) = (controller.dma().map_shared(&memory).expect("map"), controller.dma().map_shared(&memory).expect("map again"));
    assert_ne!(first.iova(), second.iova());
    let result = controller.create_detached_queue_pair(depth as u32, Some((first, second)));
    assert!(matches!(result, Err(NvmeError::RingsOverlap { .. })), "{result:?}");

    assert_eq!(device.counters().commands_by_queue.get(&0).copied(), sent, "no Create I/O CQ/SQ was sent");
    // Rings of the controller's own space, apart, still work.
    let cq = controller.dma().allocate(cq_bytes).expect("CQ");
    let pair = controller.create_detached_queue_pair(depth as u32, Some((shared, cq))).expect("rings of the controller's space");
    pair.delete().map_err(|undeleted| undeleted.source).expect("delete");
    assert_eq!(controller.leaked_queue_pairs(), 0);
}

#[test]
fn reserved_sgl_support_bits_read_as_no_sgl_support() {
    // Goal: Identify Controller SGLS bits 1:0 = 11b is reserved, not a kind of SGL support: under
    // Auto the controller gets PRPs, and Sgl is refused. It used to count as supported (any
    // non-zero value), so SGL commands went to a controller that never said it takes them.
    let mut script = FakeScript::default();
    script.identify_controller[536..540].copy_from_slice(&3u32.to_le_bytes());
    let (_device, controller) = bring_up(script.clone());
    assert_eq!(controller.data_pointer_mode(), crate::DataPointerMode::Prp);
    let sgl = ControllerConfig { data_pointer: crate::DataPointerPreference::Sgl, ..config() };
    let result = Controller::init(FakeDevice::new(script), sgl);
    assert!(matches!(result, Err(NvmeError::Unsupported { .. })), "{result:?}");
}

#[test]
fn an_attach_layout_naming_the_admin_queue_is_refused() {
    // Goal: queue id 0 is the admin queue, which create_detached_queue_pair never hands out: a
    // layout off the wire naming it, with the admin doorbells CAP.DSTRD gives for id 0, is
    // refused, so an attached pair can never ring the admin SQ tail or CQ head. It used to be
    // accepted, since only the offsets' agreement with the id was checked.
    use crate::{DataPointerMode, Namespace, NamespaceId};
    let (device, controller) = bring_up(FakeScript::default());
    let detached = controller.create_detached_queue_pair(8, None).expect("detached pair");
    let mut layout = detached.layout();
    layout.id = QueueId(0);
    (layout.submission_doorbell_offset, layout.completion_doorbell_offset) = (registers::DOORBELL_BASE, registers::DOORBELL_BASE + 4);
    let pool = device.pool();
    let rings = (
        pool.translate(layout.submission_iova, 8 * crate::spec::SUBMISSION_ENTRY_BYTES).expect("SQ"),
        pool.translate(layout.completion_iova, 8 * crate::spec::COMPLETION_ENTRY_BYTES).expect("CQ"),
    );
    let namespaces = vec![Namespace { id: NamespaceId(1), block_size_bytes: 4096, size_blocks: 1024 }];
    let config = crate::AttachedQueueConfig {
        layout,
        namespaces,
        data_pointer_mode: DataPointerMode::Prp,
        max_transfer_bytes: 1 << 17,
        sgl_dword_lengths: false,
    };
    let attached = IoQueuePair::attach(config, rings, controller.dma().as_ref(), device.registers());
    assert!(matches!(attached, Err(NvmeError::Unsupported { .. })), "{attached:?}");
}

#[test]
fn the_ready_wait_honours_crto_when_cap_says_ready_with_media_is_supported() {
    // Goal: an NVMe 2.0 controller with CAP.CRMS.CRWMS (CAP bit 59) set may leave CAP.TO short
    // (here 1: 500 ms) and give the real bound for CSTS.RDY in CRTO.CRWMT (6: 3 s). Its enable,
    // done after 1.5 s, is waited for. It used to end at CAP.TO with
    // ReadyTimeout { timeout_ms: 500 }. CRWMT bounds the enable only: the shutdown bound's floor
    // stays CAP.TO (and 1 s).
    const CRWMS: u64 = 1 << 59;
    let slow_enable = |to: u8, crwms: bool, crwmt: u32, takes_ms: u64| FakeScript {
        capabilities: Capabilities::build(256, to, 0, 0, 0).0 | if crwms { CRWMS } else { 0 },
        ready_timeouts: crwmt | 0xFFFF << 16, // CRIMT (unused: CC.CRIME stays 0)
        enable_takes: Duration::from_millis(takes_ms),
        ..FakeScript::default()
    };
    let device = FakeDevice::new(slow_enable(1, true, 6, 1500));
    let started = std::time::Instant::now();
    let controller = Controller::init(device, config()).expect("bring-up within CRTO.CRWMT");
    assert!(started.elapsed() >= Duration::from_millis(1500), "{:?}", started.elapsed());
    assert_eq!(controller.ready_timeout(), Duration::from_secs(3));
    assert_eq!(controller.shutdown_timeout(), Duration::from_secs(1));
    drop(controller);
    // Without CRWMS, CRTO is ignored (before NVMe 2.0 its offset is reserved): CAP.TO rules.
    let result = Controller::init(FakeDevice::new(slow_enable(1, false, 6, 1500)), config());
    assert!(matches!(result, Err(NvmeError::ReadyTimeout { timeout_ms: 500, .. })), "{result:?}");
    // A CRWMT (500 ms) below CAP.TO (1 s; devices are known to get CRTO wrong) does not shorten
    // the wait: an enable done after 700 ms is waited for.
    let controller = Controller::init(FakeDevice::new(slow_enable(2, true, 1, 700)), config()).expect("bring-up within CAP.TO");
    assert_eq!(controller.ready_timeout(), Duration::from_secs(1));
}

#[test]
fn crto_crwmt_bounds_only_the_enable_and_cap_to_every_disable() {
    // Goal: CRTO.CRWMT is defined for CSTS.RDY 0 → 1 after CC.EN = 1 (CC.CRIME = 0) only, and
    // it is a 16-bit device figure (up to about 9.1 h). A disable (init's stop of a function
    // left running, a reset's, teardown's) is bounded by CAP.TO, as Linux's nvme_disable_ctrl
    // does, and so is the shutdown bound's floor: a drive that never stops fails within CAP.TO.
    // It used to be held for CRWMT (here 3 s instead of 500 ms).
    const CRWMS: u64 = 1 << 59;
    let script = || FakeScript { capabilities: Capabilities::build(256, 1, 0, 0, 0).0 | CRWMS, ready_timeouts: 6, ..FakeScript::default() };
    let device = FakeDevice::new(FakeScript { starts_enabled: true, disable_completes: false, ..script() });
    let started = std::time::Instant::now();
    let result = Controller::init(device, config());
    assert!(matches!(result, Err(NvmeError::ReadyTimeout { timeout_ms: 500, .. })), "{result:?}");
    assert!(started.elapsed() < Duration::from_millis(1500), "{:?}", started.elapsed());
    // A reset whose disable never completes gives up (and lets the doorbell gate go) at CAP.TO.
    let (device, mut controller) = bring_up(script());
    assert_eq!(controller.ready_timeout(), Duration::from_secs(3));
    assert_eq!(controller.shutdown_timeout(), Duration::from_secs(1), "RTD3E 0: the 1 s floor, not CRWMT");
    device.update_script(|script| script.disable_completes = false);
    let started = std::time::Instant::now();
    let reset = controller.reset(false);
    assert!(matches!(reset, Err(NvmeError::ReadyTimeout { timeout_ms: 500, .. })), "{reset:?}");
    assert!(started.elapsed() < Duration::from_millis(1500), "{:?}", started.elapsed());
}

#[test]
fn a_ready_timeout_names_the_bound_it_ran_out() {
    // Goal: ReadyTimeout says which bound ended the wait: CRTO.CRWMT for an enable it bounds,
    // CAP.TO for a disable, the shutdown bound for a shutdown. It used to say "(CAP.TO)" for
    // all three, even for a wait CRWMT or RTD3E had set.
    const CRWMS: u64 = 1 << 59;
    let crwmt_1s = FakeScript {
        capabilities: Capabilities::build(256, 1, 0, 0, 0).0 | CRWMS,
        ready_timeouts: 2,
        enable_takes: Duration::from_millis(1200),
        ..FakeScript::default()
    };
    let enable = Controller::init(FakeDevice::new(crwmt_1s), config()).map(drop).expect_err("the enable takes past CRWMT");
    assert!(matches!(enable, NvmeError::ReadyTimeout { wanted: "CSTS.RDY=1", timeout_ms: 1000, .. }), "{enable:?}");
    assert!(enable.to_string().contains("CRTO.CRWMT") && !enable.to_string().contains("CAP.TO"), "{enable}");
    let stuck = FakeScript { starts_enabled: true, disable_completes: false, ..FakeScript::default() };
    let disable = Controller::init(FakeDevice::new(stuck), config()).map(drop).expect_err("the disable never completes");
    assert!(matches!(disable, NvmeError::ReadyTimeout { wanted: "CSTS.RDY=0", timeout_ms: 500, .. }), "{disable:?}");
    assert!(disable.to_string().contains("CAP.TO"), "{disable}");
    let (_device, controller) = bring_up(FakeScript { shutdown_takes: Duration::from_secs(3600), ..FakeScript::default() });
    let shutdown = controller.shutdown().expect_err("the shutdown never completes");
    assert!(matches!(shutdown, NvmeError::ReadyTimeout { wanted: "CSTS.SHST=complete", timeout_ms: 1000, .. }), "{shutdown:?}");
    assert!(shutdown.to_string().contains("shutdown bound") && !shutdown.to_string().contains("(CAP.TO)"), "{shutdown}");
}

#[test]
fn an_enable_that_ran_out_its_bound_is_given_cap_to_more_not_the_bound_again() {
    // Goal: once bring-up's own WaitReady ran out the enable bound, the teardown that follows
    // (init's error drops the Controller, whose stop finds CC.EN = 1, CSTS.RDY = 0) gives that
    // same enable CAP.TO more, not a second enable bound: with CRWMT = 3 s and CAP.TO = 500 ms,
    // init returned its ReadyTimeout after about 6 s (CRWMT = FFFFh: 18 h instead of 9.1 h).
    // EN is still never cleared under the unfinished enable: the settle times out, and the
    // controller's memory is kept (leaked) as for any controller not seen to stop.
    const CRWMS: u64 = 1 << 59;
    let script = FakeScript {
        capabilities: Capabilities::build(256, 1, 0, 0, 0).0 | CRWMS,
        ready_timeouts: 6,
        enable_takes: Duration::from_secs(3600),
        ..FakeScript::default()
    };
    let device = FakeDevice::new(script);
    let started = std::time::Instant::now();
    let result = Controller::init(device.clone(), config());
    let elapsed = started.elapsed();
    assert!(
        matches!(
            result,
            Err(NvmeError::ReadyTimeout { wanted: "CSTS.RDY=1", timeout_ms: 3000, bound: crate::ReadyBoundSource::CrtoCrwmt, .. })
        ),
        "{result:?}"
    );
    // The enable bound, then CAP.TO for teardown's settle: 3.5 s (it was 6 s; the bound leaves
    // room for a loaded machine).
    assert!(elapsed >= Duration::from_secs(3) && elapsed < Duration::from_millis(5500), "{elapsed:?}");
    assert_eq!(device.counters().disables_before_ready, 0, "EN was cleared under an unfinished enable");
}

#[test]
fn after_a_reset_ran_out_the_enable_bound_the_next_reset_and_teardown_wait_cap_to() {
    // Goal: the same after a reset whose enable never completes: the next reset's Disable stage
    // (which holds the doorbell gate's exclusive side) and teardown give that enable CAP.TO
    // (500 ms), not the enable bound again (CRWMT, 1.5 s here). It used to wait 1.5 s for each.
    const CRWMS: u64 = 1 << 59;
    let script = FakeScript { capabilities: Capabilities::build(256, 1, 0, 0, 0).0 | CRWMS, ready_timeouts: 3, ..FakeScript::default() };
    let (device, mut controller) = bring_up(script);
    device.update_script(|script| script.enable_takes = Duration::from_secs(3600));
    let reset = controller.reset(false);
    assert!(matches!(reset, Err(NvmeError::ReadyTimeout { wanted: "CSTS.RDY=1", timeout_ms: 1500, .. })), "{reset:?}");
    let started = std::time::Instant::now();
    let reset = controller.reset(false);
    assert!(
        matches!(reset, Err(NvmeError::ReadyTimeout { wanted: "CSTS.RDY=1", timeout_ms: 500, bound: crate::ReadyBoundSource::CapTo, .. })),
        "{reset:?}"
    );
    // CAP.TO (500 ms), not the 1.5 s enable bound again; the bound leaves room for a loaded machine.
    assert!(started.elapsed() < Duration::from_millis(1300), "{:?}", started.elapsed());
    let started = std::time::Instant::now();
    drop(controller);
    assert!(started.elapsed() < Duration::from_millis(1300), "{:?}", started.elapsed());
    assert_eq!(device.counters().disables_before_ready, 0, "EN was cleared under an unfinished enable");
}

/// Warn-level messages logged on this thread while `body` runs.
fn warnings_during<T>(body: impl FnOnce() -> T) -> (T, Vec<String>) {
    messages_during(tracing::Level::WARN, body)
}

/// Messages of `level` logged on this thread while `body` runs (a minimal subscriber: the
/// crate has no log-capturing dev-dependency).
pub(crate) fn messages_during<T>(level: tracing::Level, body: impl FnOnce() -> T) -> (T, Vec<String>) {
    use std::sync::Mutex;
    use tracing::field::{Field, Visit};
    struct Collect(tracing::Level, Arc<Mutex<Vec<String>>>);
    struct Message(String);
    impl Visit for Message {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }
    impl tracing::Subscriber for Collect {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            if *event.metadata().level() == self.0 {
                let mut message = Message(String::new());
                event.record(&mut message);
                self.1.lock().expect("messages").push(message.0);
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }
    let messages = Arc::new(Mutex::new(Vec::new()));
    // A second dispatcher alive meanwhile: with only one registered, tracing-core 0.1 caches a
    // call site's interest from whichever thread reaches it first (tokio-rs/tracing#3611), so a
    // message another test's thread met first, with no subscriber, could stay disabled here: a
    // test expecting none would pass without collecting.
    let _second_dispatch = tracing::Dispatch::new(Collect(level, Arc::new(Mutex::new(Vec::new()))));
    let result = tracing::subscriber::with_default(Collect(level, Arc::clone(&messages)), body);
    let messages = messages.lock().expect("messages").clone();
    (result, messages)
}

#[test]
fn a_settle_that_may_wait_past_cap_to_is_logged_first() {
    // Goal: a controller found mid-enable is given up to CRTO.CRWMT (up to about 9.1 h) to
    // finish before it is disabled; that wait is announced at warn level before it starts, so
    // a bring-up does not sit silent for hours. One bounded by CAP.TO is not.
    const CRWMS: u64 = 1 << 59;
    let mid_enable = |crwms: u64| FakeScript {
        capabilities: Capabilities::build(256, 1, 0, 0, 0).0 | crwms,
        ready_timeouts: 6,
        starts_enabling: true,
        enable_ready_after_status_reads: 20,
        ..FakeScript::default()
    };
    let settle_warnings = |script| {
        let (controller, warnings) = warnings_during(|| Controller::init(FakeDevice::new(script), config()));
        controller.expect("bring-up");
        warnings.into_iter().filter(|warning| warning.contains("mid-enable")).count()
    };
    assert_eq!(settle_warnings(mid_enable(CRWMS)), 1, "the CRTO.CRWMT settle was not announced");
    assert_eq!(settle_warnings(mid_enable(0)), 0, "a CAP.TO settle was announced");
}

#[test]
fn a_reset_that_fails_after_the_controller_stopped_refuses_new_pairs_naming_the_stage() {
    // Goal: a reset that saw CSTS.RDY = 0 and then failed (here Number of Queues answered with
    // an error) leaves no I/O queue on the controller and no grant: `granted_queue_pairs` says
    // 0, and creating a pair says the bring-up did not finish (at which stage), not that the
    // ids of the old grant ran out. A later reset that succeeds makes creation work again.
    use crate::spec::{AdminOpcode, NvmeStatus};
    use crate::BringUpStage;
    let (device, mut controller) = bring_up(FakeScript::default());
    assert_eq!(controller.granted_queue_pairs(), 4);
    let invalid_field = NvmeStatus::generic(crate::spec::status::codes::INVALID_FIELD);
    device.update_script(|script| script.admin_failures = vec![(AdminOpcode::SetFeatures as u8, invalid_field)]);
    let reset = controller.reset(false);
    assert!(matches!(reset, Err(NvmeError::Command { .. })), "{reset:?}");
    assert_eq!(controller.granted_queue_pairs(), 0, "the controller reset dropped the old grant");
    let host_driven = controller.create_io_queue_pair(8);
    assert!(matches!(host_driven, Err(NvmeError::ControllerNotReady { stage: BringUpStage::NumberOfQueues })), "{host_driven:?}");
    let detached = controller.create_detached_queue_pair(8, None);
    assert!(matches!(detached, Err(NvmeError::ControllerNotReady { stage: BringUpStage::NumberOfQueues })), "{detached:?}");
    device.update_script(|script| script.admin_failures.clear());
    controller.reset(false).expect("reset");
    assert_eq!(controller.granted_queue_pairs(), 4);
    controller.create_io_queue_pair(8).expect("queue pair after a reset that succeeded");
}

#[test]
fn identify_data_is_replaced_whole_or_not_at_all() {
    // Goal: a reset whose Identify fails part-way (Identify Controller answered with a new
    // MDTS, the Active Namespace List never answered) keeps the Identify-derived view of
    // before whole: the transfer limit the daemon puts in attach grants still matches
    // `identify().mdts`, instead of the new limit next to the old Identify data.
    let (device, mut controller) = bring_up(FakeScript::default());
    let page = controller.capabilities().min_page_size_bytes();
    assert_eq!((controller.identify().mdts, controller.max_transfer_bytes()), (5, page << 5));
    device.update_script(|script| {
        script.identify_controller[77] = 3;
        script.identify_unanswered = vec![0x02];
    });
    let reset = controller.reset(false);
    assert!(matches!(reset, Err(NvmeError::Timeout { queue: QueueId(0), .. })), "{reset:?}");
    let mdts = controller.identify().mdts;
    assert_eq!(controller.max_transfer_bytes(), page << mdts, "max_transfer_bytes agrees with identify().mdts ({mdts})");
    assert_eq!(mdts, 5, "the view of before the failed reset");
}

#[test]
fn a_pair_whose_queues_a_reset_could_not_confirm_gone_does_not_blame_csts_rdy() {
    // Goal: QueueMaybeLive follows every reset or teardown that could not confirm the
    // controller stopped, not only a disable that timed out with CSTS.RDY = 1: here a reset
    // gave up on a doorbell write in progress (ResetBlockedByDoorbellWrite) without touching
    // the controller. The error says what is known and points at that call's error, and does
    // not claim CSTS.RDY stayed 1.
    let (_device, mut controller) = bring_up(FakeScript::default());
    controller.replace_gate_for_test(crate::gate::DoorbellGate::with_ringer_wait_max(Duration::from_millis(1)));
    let first = controller.create_io_queue_pair(8).expect("queue pair");
    let stopped = controller.gate_for_test().register();
    stopped.raise_and_stop();
    let reset = controller.reset(false);
    assert!(matches!(reset, Err(NvmeError::ResetBlockedByDoorbellWrite { .. })), "{reset:?}");
    let undeleted = first.delete().expect_err("the queues may still be live");
    assert!(matches!(undeleted.source, NvmeError::QueueMaybeLive { queue: QueueId(1) }), "{}", undeleted.source);
    let text = undeleted.source.to_string();
    assert!(!text.contains("RDY stayed 1"), "{text}");
    assert!(text.contains("could not confirm the controller stopped"), "{text}");
    drop(undeleted);
    drop(stopped);
}

#[test]
fn an_active_namespace_list_refused_with_an_error_status_falls_back_to_scanning_nsids() {
    // Goal: a controller that reports NVMe 1.1 or later but answers Identify CNS 02h (the
    // Active Namespace List) with an error status still comes up: the driver identifies NSIDs
    // 1..=NN one by one, as for a pre-1.1 controller (Linux falls back the same way). A list
    // that gets no answer at all still fails bring-up: the controller itself is unwell then.
    use crate::spec::status::codes;
    use crate::spec::NvmeStatus;
    let refused = FakeScript {
        version: 0x0001_0400,
        identify_failures: vec![(0x02, NvmeStatus::generic(codes::INVALID_FIELD))],
        ..FakeScript::default()
    };
    let (_device, controller) = bring_up(refused);
    assert_eq!(controller.namespaces().iter().map(|namespace| namespace.id.0).collect::<Vec<_>>(), [1]);
    let unanswered = FakeScript { identify_unanswered: vec![0x02], ..FakeScript::default() };
    let outcome = Controller::init(FakeDevice::new(unanswered), config());
    assert!(matches!(outcome, Err(NvmeError::Timeout { queue: QueueId(0), .. })), "{outcome:?}");
}

#[test]
fn a_wait_goes_on_past_an_unexpected_completion_until_its_commands_completed() {
    // Goal: a completion naming nothing in flight is not fatal ("it completes nothing and the
    // pair goes on", queue.rs), so a wait that meets one keeps reaping until its condition holds
    // and only then reports it. On a ring of 8, commands 0 and 1 are in flight; the CQ holds 0's
    // completion, one naming nothing, then 1's. The wait used to return the unexpected
    // completion at once, with 1 still in flight and its completion not delivered: a caller of
    // read or write took the transfer as over while the controller could still move its data.
    let (_device, _controller, mut queue, ring) = hand_posted_flushes(2);
    post_completion(&ring, 0, 0, 2, 1);
    post_completion(&ring, 1, 0x7700, 2, 1);
    post_completion(&ring, 2, 1, 2, 1);
    let mut delivered = Vec::new();
    let started = std::time::Instant::now();
    let waited = queue.wait_idle(started + Duration::from_secs(5), |completion| delivered.push(completion.tag));
    assert!(matches!(waited, Err(NvmeError::UnexpectedCompletion { command_id: crate::CommandId(0x7700), .. })), "{waited:?}");
    assert_eq!(delivered, [0, 1], "every completion was delivered");
    assert_eq!(queue.in_flight(), 0, "the wait returned with a command in flight");
    assert!(!queue.failed());
    assert!(started.elapsed() < Duration::from_secs(1), "the wait ended when its commands completed, not at its deadline");
}

#[test]
fn a_wait_that_met_an_unexpected_completion_times_out_at_its_deadline() {
    // Goal: when the command a stray completion may have stood for never completes, the wait
    // still runs to its deadline (the command may yet complete, and its memory is the
    // controller's until then) and then reports a timeout, as any wait with commands still in
    // flight: callers take only Timeout as "still in flight, retry or settle later" (tuttid's
    // deletion retry, the metadata queue's count of timeouts in a row). It used to report the
    // unexpected completion there, so a Delete SQ that timed out after one was kept for good
    // instead of retried. The stray goes to the log.
    let (_device, _controller, mut queue, ring) = hand_posted_flushes(2);
    post_completion(&ring, 0, 0, 2, 1);
    post_completion(&ring, 1, 0x7700, 2, 1);
    let mut delivered = Vec::new();
    let asked = Duration::from_millis(100);
    let started = std::time::Instant::now();
    let waited = queue.wait_idle(started + asked, |completion| delivered.push(completion.tag));
    assert!(
        matches!(waited, Err(NvmeError::Timeout { queue: QueueId(1), command_id: crate::CommandId(1), outstanding: 1, .. })),
        "{waited:?}"
    );
    assert!(started.elapsed() >= asked, "the wait gave up after {:?}, before its deadline", started.elapsed());
    assert_eq!(delivered, [0]);
    assert_eq!(queue.in_flight(), 1, "command 1 is still in flight");
}

#[test]
fn a_wait_past_its_deadline_still_reads_the_completions_posted_behind_an_unexpected_one() {
    // Goal: a wait whose deadline has passed reports a timeout only for commands whose
    // completions are not in the CQ: what was posted before it looked is delivered first, as a
    // wait that met no stray delivers everything posted before its empty poll. A stray stops
    // `reap` at its entry; the wait then checked its deadline at once and, past it, returned
    // Timeout with the completions of commands 0 and 1 still sitting behind the stray (as when
    // objstore's last complete_all gets a zero timeout after earlier drains): the caller took
    // completed commands for ones still in flight.
    let (_device, _controller, mut queue, ring) = hand_posted_flushes(2);
    post_completion(&ring, 0, 0x7700, 2, 1);
    post_completion(&ring, 1, 0, 2, 1);
    post_completion(&ring, 2, 1, 2, 1);
    let mut delivered = Vec::new();
    let waited = queue.wait_idle(std::time::Instant::now(), |completion| delivered.push(completion.tag));
    assert!(matches!(waited, Err(NvmeError::UnexpectedCompletion { command_id: crate::CommandId(0x7700), .. })), "{waited:?}");
    assert_eq!(delivered, [0, 1], "the completions behind the stray were delivered");
    assert_eq!(queue.in_flight(), 0);
    assert!(!queue.failed());
}

#[test]
fn a_wait_ended_by_a_rejected_completion_logs_the_unexpected_ones_it_met() {
    // Goal: the completions naming nothing in flight a wait met go to the log however the wait
    // ends, also when a completion that breaks the protocol (here an SQ head past the tail)
    // ends it: they are logged only as the wait ends (one line, first and count). A wait ended
    // by such an error used to return it without a word about the stray before it.
    let (_device, _controller, mut queue, ring) = hand_posted_flushes(2);
    post_completion(&ring, 0, 0x7700, 2, 1);
    post_completion(&ring, 1, 0, 7, 1);
    let (waited, warnings) = warnings_during(|| queue.wait_idle(std::time::Instant::now() + Duration::from_secs(5), |_| {}));
    assert!(matches!(&waited, Err(error) if !matches!(error, NvmeError::UnexpectedCompletion { .. })), "{waited:?}");
    assert!(queue.failed(), "the head past the tail failed the pair");
    let logged = warnings.iter().filter(|warning| warning.contains("unexpected completions")).count();
    assert_eq!(logged, 1, "the stray was not logged: {warnings:?}");
}

#[test]
fn complete_all_reports_a_failed_command_before_an_unexpected_completion() {
    // Goal: complete_all turns the first failed command into its error; an unexpected
    // completion met on the way (with every command then completed) does not hide it: the
    // command's failure is what its caller must act on. Before, the wait's error came back at
    // once and the failure already delivered in the same reap was dropped.
    let (_device, _controller, mut queue, ring) = hand_posted_flushes(2);
    // Status: generic, Invalid Field in Command (02h), above the phase bit.
    post_completion(&ring, 0, 0, 2, 1 | 0x02 << 1);
    post_completion(&ring, 1, 0x7700, 2, 1);
    post_completion(&ring, 2, 1, 2, 1);
    let result = queue.complete_all(Duration::from_secs(5));
    assert!(matches!(result, Err(NvmeError::Command { command_id: crate::CommandId(0), .. })), "{result:?}");
    assert_eq!(queue.in_flight(), 0);
}

/// The NLB fields (1-based) of the first `count` entries of `queue`'s submission ring.
fn submitted_block_counts(device: &FakeDevice, queue: &IoQueuePair, count: usize) -> Vec<u32> {
    let ring = device.pool().translate(queue.submission_iova(), count * 64).expect("SQ entries");
    (0..count)
        .map(|index| {
            let mut bytes = [0u8; 64];
            ring.read(index * 64, &mut bytes).expect("read entry");
            (SubmissionEntry::from_bytes(&bytes).cdw12 & 0xFFFF) + 1
        })
        .collect()
}

#[test]
fn write_zeroes_is_split_at_the_controllers_write_zeroes_size_limit() {
    // Goal: WZSL (I/O Command Set specific Identify Controller, CNS 06h, for the NVM command
    // set) bounds the data one Write Zeroes may cover, as MDTS does a read's: a command past it
    // is failed by the controller (Invalid Field). WZSL 1 is 2^1 minimum pages (CAP.MPSMIN 4
    // KiB): 8 KiB, two 4 KiB blocks, so five blocks take three commands (2, 2, 1). The driver
    // used to ignore WZSL and send one command of five blocks. A controller older than 1.2
    // (whose CNS field is one or two bits: 06h would read as another CNS) is not asked, and
    // its Write Zeroes stay unbounded.
    for (version, expected) in [(0x0001_0400, vec![2, 2, 1]), (0x0001_0100, vec![5])] {
        let mut identify_controller = FakeScript::default().identify_controller;
        identify_controller[520..522].copy_from_slice(&(1u16 << 3).to_le_bytes()); // ONCS: Write Zeroes
        let mut nvm_identify_controller = vec![0u8; 4096];
        nvm_identify_controller[1] = 1; // WZSL
        let script = FakeScript { version, identify_controller, nvm_identify_controller, ..FakeScript::default() };
        let (device, controller) = bring_up(script);
        let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
        let commands = queue.submit_write_zeroes(crate::NamespaceId(1), Lba(0), 5, false, 0).expect("submit");
        assert_eq!(submitted_block_counts(&device, &queue, commands), expected, "VS {version:#x}");
        queue.complete_all(Duration::from_secs(5)).expect("the Write Zeroes complete");
    }
}

#[test]
fn a_write_zeroes_size_limit_below_one_block_is_refused_before_submitting() {
    // Goal: a WZSL smaller than one block of the namespace (8 KiB against 64 KiB blocks) leaves
    // no Write Zeroes the controller would take: the driver says so (Unsupported), queuing
    // nothing, rather than dividing it down to zero blocks per command.
    let mut identify_controller = FakeScript::default().identify_controller;
    identify_controller[520..522].copy_from_slice(&(1u16 << 3).to_le_bytes()); // ONCS: Write Zeroes
    let mut nvm_identify_controller = vec![0u8; 4096];
    nvm_identify_controller[1] = 1; // WZSL: 8 KiB
    let script = FakeScript {
        identify_controller,
        nvm_identify_controller,
        identify_namespaces: vec![identify_namespace_bytes(65536, 64, 0, false)],
        ..FakeScript::default()
    };
    let (_device, controller) = bring_up(script);
    assert_eq!(controller.write_zeroes_max_bytes(), Some(8192));
    let mut queue = controller.create_io_queue_pair(8).expect("queue pair");
    let refused = queue.submit_write_zeroes(crate::NamespaceId(1), Lba(0), 1, false, 0);
    assert!(matches!(refused, Err(NvmeError::Unsupported { .. })), "{refused:?}");
    assert_eq!(queue.unpublished_submissions(), 0, "nothing was queued");
}

#[test]
fn a_wait_meeting_unexpected_completions_without_end_still_ends_at_its_deadline() {
    // Goal: every wait is bounded, even against a controller that keeps posting completions
    // naming nothing in flight. Each is accepted (its SQ head lies between the last reported and
    // the tail) and consumed, and the CQ head doorbell that frees its entry has the controller
    // post the next, so the ring never runs empty. The wait used to take each as a reaped entry
    // and poll again at once, checking its deadline only on empty polls, and never returned (on
    // the admin path, under the admin mutex: bring-up, attach and delete all hung). The fake
    // refills the ring within the doorbell write itself, so no empty poll can end the wait by
    // chance, as a posting thread racing the reaper could.
    let (device, _controller, queue, _ring) = hand_posted_flushes(2);
    let stray = CompletionEntry { dw0: 0, dw1: 0, sq_head: 2, sq_id: 1, command_id: 0x7700, status_and_phase: 0 };
    device.keep_posting(1, stray);
    let (sender, receiver) = std::sync::mpsc::channel();
    // Detached: before the fix it never returns (the fake's posting ends with the process).
    std::thread::spawn(move || {
        let mut queue = queue;
        let waited = queue.wait_idle(std::time::Instant::now() + Duration::from_millis(50), |_| {});
        let _ = sender.send((waited, queue.in_flight(), queue.failed()));
    });
    let outcome = receiver.recv_timeout(Duration::from_secs(1));
    let (waited, in_flight, failed) = outcome.expect("the wait did not end within a second of its 50 ms deadline");
    assert!(matches!(waited, Err(NvmeError::Timeout { outstanding: 2, .. })), "{waited:?}");
    assert_eq!(in_flight, 2, "both flushes are still in flight");
    assert!(!failed, "a completion naming nothing in flight does not fail the pair");
}
