/*
 * Host test of the rules the CUDA I/O kernel and the Rust side share: the plain functions of
 * gio_abi.h and gio_kernel_rules.h (GIO_RULE), compiled with the system C compiler (C11; also as C++ and CUDA C++ by
 * tools/cuda-build.sh). main() checks each rule against its specification written out here and
 * exits non-zero on any mismatch; `rules_check descriptor-kinds` also prints the verdict for every
 * descriptor kind 0..=255, one "KIND VALID" line each, which crates/gio-uring/tests/gpu_rules.rs
 * compares with the Rust rule; `rules_check ioctx-commands` reads IOCTX cases from stdin, one
 * "OPCODE LAYER LBA_STRIDE MEM_STRIDE DESC_STRIDE START_LBA DATA_IOVA DESC_IOVA BLOCK_COUNT KIND"
 * line each (decimal), and prints the command rule's verdict for each: "0", or "1 LBA DATA DESC".
 */
#include "gio_abi.h"
#include "gio_kernel_rules.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

static int failures = 0;

static void expect(int cond, const char *what, unsigned value) {
    if (!cond) {
        if (failures < 20) { /* the sweeps could print 65536 lines */
            fprintf(stderr, "rules_check: FAILED: %s (value %u)\n", what, value);
        }
        failures++;
    }
}

/* Only SGL and PRP exist; every other byte is invalid (the kernel once built it as PRP). */
static void check_descriptor_kinds(int print) {
    unsigned kind;
    for (kind = 0; kind <= 255u; kind++) {
        const int valid = gio_descriptor_kind_is_valid(kind);
        const int expected = kind == GIO_DESCRIPTOR_SGL || kind == GIO_DESCRIPTOR_PRP;
        expect(valid == expected, "descriptor kind valid exactly for SGL and PRP", kind);
        if (print) {
            printf("%u %d\n", kind, valid ? 1 : 0);
        }
    }
    /* descriptor_kind is a uint8_t; a wider value (a corrupted record read as a word) is invalid. */
    expect(!gio_descriptor_kind_is_valid(0x100u), "kind 0x100 invalid", 0x100u);
    expect(!gio_descriptor_kind_is_valid(0xFFFFFFFFu), "kind 0xFFFFFFFF invalid", 0xFFFFFFFFu);
}

/* The verdict for a ticket published and fetched in the simplest way: the SQ tail is just past
 * it, and the completion's SQ head (SQHD) reaches that tail, on a 64-entry SQ. */
static uint32_t fetched_verdict(uint32_t faulted, uint32_t sq_id, uint32_t queue, uint32_t command_id,
                                uint32_t ticket, uint32_t done) {
    const uint32_t depth = 64u;
    return gio_completion_verdict(faulted, sq_id, queue, command_id, (ticket + 1u) & (depth - 1u), ticket, done,
                                  ticket, ticket + 1u, depth);
}

/* Completion acceptance, as nvme-driver's reap: the SQ id first (a fault), then command id and
 * generation against the slot's ticket, then "not completed yet". */
static void check_completion_verdicts(void) {
    const uint32_t queue = 3u;
    const uint32_t ticket = 0x00012345u; /* command id 0x2345, generation bits from the ticket */
    const uint32_t not_done = ticket + 1u - 64u; /* the previous round's ticket was completed */
    uint32_t sq_id;
    expect(fetched_verdict(0u, queue, queue, 0x2345u, ticket, not_done) == GIO_COMPLETION_ACCEPT,
           "a completion of the live ticket on the right SQ is accepted", ticket);
    /* Every other SQ id is a fault, even with a command id that matches a live ticket. */
    for (sq_id = 0; sq_id <= 0xFFFFu; sq_id++) {
        if (sq_id != queue) {
            expect(fetched_verdict(0u, sq_id, queue, 0x2345u, ticket, not_done) ==
                       GIO_COMPLETION_WRONG_QUEUE,
                   "a completion naming another SQ is a controller fault", sq_id);
        }
    }
    expect(fetched_verdict(0u, queue, queue, 0x2346u, ticket, not_done) == GIO_COMPLETION_UNEXPECTED,
           "a command id of another ticket is unexpected", 0x2346u);
    expect(fetched_verdict(0u, queue, queue, 0x2345u ^ 0x8000u, ticket, not_done) ==
               GIO_COMPLETION_UNEXPECTED,
           "a stale generation is unexpected", 0x2345u ^ 0x8000u);
    expect(fetched_verdict(0u, queue, queue, 0x2345u, ticket, ticket + 1u) == GIO_COMPLETION_UNEXPECTED,
           "a second completion of a completed ticket is unexpected", ticket);
    /* The ticket wraps at 2^32: the rule is modular, like the kernel's counters. Its command id
     * is 7FFFh (gio_command_id: never FFFFh). */
    expect(fetched_verdict(0u, queue, queue, 0x7FFFu, 0xFFFFFFFFu, 0u - 64u) == GIO_COMPLETION_ACCEPT,
           "the last ticket before the wrap is accepted", 0xFFFFFFFFu);
    expect(fetched_verdict(0u, queue, queue, 0x7FFFu, 0xFFFFFFFFu, 0u) == GIO_COMPLETION_UNEXPECTED,
           "the last ticket before the wrap completes once", 0xFFFFFFFFu);
    expect(fetched_verdict(0u, queue, queue, 0xFFFFu, 0xFFFFFFFFu, 0u - 64u) == GIO_COMPLETION_UNEXPECTED,
           "command id FFFFh completes nothing", 0xFFFFFFFFu);
    /* A fresh slot s (as plan.rs writes it: ticket s - depth, done_ticket s + 1 - depth, "the
     * previous round is complete") accepts no command id before its first submission. With
     * ticket 0, a stray completion of command id 0 would have completed slot 0. */
    {
        const uint32_t depth = 16u;
        uint32_t slot, command_id;
        for (slot = 0; slot < depth; slot++) {
            for (command_id = 0; command_id <= 0xFFFFu; command_id++) {
                expect(gio_completion_verdict(0u, queue, queue, command_id, 0u, slot - depth, slot + 1u - depth, 0u,
                                              0u, depth) ==
                           GIO_COMPLETION_UNEXPECTED,
                       "a fresh slot accepts no completion", command_id);
            }
        }
        expect(gio_completion_verdict(0u, queue, queue, 0u, 1u, 0u, 1u - depth, 0u, 1u, depth) ==
                   GIO_COMPLETION_ACCEPT,
               "(a slot left at ticket 0 would accept command id 0)", 0u);
    }
    /* Once a completion on the pair was a fault, nothing its controller reports is trusted until
     * the host resets the pair: not even an entry that would otherwise be accepted (another
     * block's reaper must not finish an IOCB off a faulted controller). */
    expect(fetched_verdict(1u, queue, queue, 0x2345u, ticket, not_done) == GIO_COMPLETION_PAIR_FAULTED,
           "a faulted pair accepts no completion", ticket);
    expect(fetched_verdict(1u, queue, queue, 0xFFFFu, 0xFFFFFFFFu, 0u - 64u) ==
               GIO_COMPLETION_PAIR_FAULTED,
           "a faulted pair accepts no completion at the wrap", 0xFFFFFFFFu);
    expect(fetched_verdict(0xFFFFFFFFu, queue, queue, 0x2345u, ticket, not_done) ==
               GIO_COMPLETION_PAIR_FAULTED,
           "any fault count is a fault", 0xFFFFFFFFu);
    /* A wrong SQ id wins over a stale id: nothing in the entry is trusted. */
    expect(fetched_verdict(0u, queue + 1u, queue, 0x2346u, ticket, ticket + 1u) ==
               GIO_COMPLETION_WRONG_QUEUE,
           "a wrong SQ id is reported as such even for a stale command id", queue + 1u);
}


/* The SQ side of a completion, as nvme-driver's reap (accept_submission_head and its
 * CompletionBeforeFetch check): the completed ticket must have been published (below sq_tail, the
 * tail published to the controller) and SQHD must lie in its window, past its entry (fetched) up
 * to sq_tail; it may lie behind sq_head there (check_completion_out_of_creation_order). Any other
 * completion is a controller fault, never an ACCEPT: NOT_FETCHED when SQHD lies in [sq_head,
 * sq_tail], else BAD_SQ_HEAD. */
static void check_completion_sq_heads(void) {
    const uint32_t queue = 3u, depth = 64u;
    /* D = 64: tickets 0..62 published (sq_tail 63), ticket 63 written but held back (SQ full). */
    expect(gio_completion_verdict(0u, queue, queue, 63u, 63u, 63u, 0u, 0u, 63u, depth) ==
               GIO_COMPLETION_NOT_FETCHED,
           "a completion for a ticket at sq_tail (never published) is a fault", 63u);
    expect(gio_completion_verdict(0u, queue, queue, 62u, 63u, 62u, 62u + 1u - depth, 0u, 63u, depth) ==
               GIO_COMPLETION_ACCEPT,
           "the last published ticket, fetched, is accepted", 62u);
    expect(gio_completion_verdict(0u, queue, queue, 0x1045u, 0x10u, 0x1045u, 0x1046u - depth, 0x1000u, 0x1040u,
                                  depth) == GIO_COMPLETION_NOT_FETCHED,
           "a completion for a ticket after sq_tail is a fault", 0x1045u);
    /* sq_head 10, sq_tail 20, ticket 15 published. */
    expect(gio_completion_verdict(0u, queue, queue, 15u, 16u, 15u, 16u - depth, 10u, 20u, depth) ==
               GIO_COMPLETION_ACCEPT,
           "SQHD just past the ticket's entry is accepted", 16u);
    expect(gio_completion_verdict(0u, queue, queue, 15u, 15u, 15u, 16u - depth, 10u, 20u, depth) ==
               GIO_COMPLETION_NOT_FETCHED,
           "SQHD at the ticket's entry (not fetched yet) is a fault", 15u);
    expect(gio_completion_verdict(0u, queue, queue, 15u, 12u, 15u, 16u - depth, 10u, 20u, depth) ==
               GIO_COMPLETION_NOT_FETCHED,
           "SQHD before the ticket's entry is a fault", 12u);
    expect(gio_completion_verdict(0u, queue, queue, 15u, 21u, 15u, 16u - depth, 10u, 20u, depth) ==
               GIO_COMPLETION_BAD_SQ_HEAD,
           "SQHD beyond sq_tail is a fault", 21u);
    expect(gio_completion_verdict(0u, queue, queue, 15u, 9u, 15u, 16u - depth, 10u, 20u, depth) ==
               GIO_COMPLETION_BAD_SQ_HEAD,
           "SQHD behind sq_head (it would read as a whole lap forward) is a fault", 9u);
    expect(gio_completion_verdict(0u, queue, queue, 15u, 64u + 16u, 15u, 16u - depth, 10u, 20u, depth) ==
               GIO_COMPLETION_BAD_SQ_HEAD,
           "SQHD not below the depth is a fault (never masked into range)", 80u);
    /* A stale command id still moves nothing wrong: its SQHD is checked first. */
    expect(gio_completion_verdict(0u, queue, queue, 14u, 40u, 15u, 16u - depth, 10u, 20u, depth) ==
               GIO_COMPLETION_BAD_SQ_HEAD,
           "an impossible SQHD is a fault even on a stale command id", 40u);
    /* Sweep near the 2^32 wrap: every SQHD value and tickets around the published window, against
     * the specification in 64-bit arithmetic without wrapping. */
    {
        const uint64_t base = 0xFFFFFFF0u; /* sq_head, unwrapped */
        const uint64_t tail = base + 40u;  /* sq_tail, unwrapped: 2^32 + 24 */
        uint64_t ticket;
        uint32_t sqhd;
        unsigned accepted = 0, behind = 0;
        for (ticket = tail - depth - 4u; ticket <= tail + 4u; ticket++) {
            for (sqhd = 0; sqhd <= 0xFFFFu; sqhd++) {
                const uint32_t t = (uint32_t)ticket;
                const uint32_t verdict = gio_completion_verdict(0u, queue, queue, gio_command_id(t), sqhd, t,
                                                                t + 1u - depth, (uint32_t)base, (uint32_t)tail, depth);
                /* The head SQHD names read forward: the one position in [base, base + depth) with
                 * that slot; and read in the ticket's window: the one in (ticket, ticket + depth]. */
                const uint64_t head = base + ((sqhd + depth - (base % depth)) % depth);
                const uint64_t own = ticket + 1u + ((sqhd + 2u * depth - ((ticket + 1u) % depth)) % depth);
                const int forward = sqhd < depth && head <= tail;
                const int published = ticket < tail && ticket + depth >= tail;
                const int in_window = sqhd < depth && published && own <= tail;
                const uint32_t expected = in_window ? GIO_COMPLETION_ACCEPT
                                          : forward ? GIO_COMPLETION_NOT_FETCHED
                                                    : GIO_COMPLETION_BAD_SQ_HEAD;
                expect(verdict == expected, "SQ head sweep near the wrap", sqhd);
                accepted += verdict == GIO_COMPLETION_ACCEPT;
                behind += verdict == GIO_COMPLETION_ACCEPT && own < base;
                /* The head after it: the furthest of sq_head and the accepted SQHD's position,
                 * never a lap forward; unchanged after a fault. */
                expect(gio_sq_head_after(verdict, sqhd, t, (uint32_t)base, (uint32_t)tail, depth) ==
                           (uint32_t)(expected == GIO_COMPLETION_ACCEPT && own > base ? own : base),
                       "SQ head after, sweep near the wrap", sqhd);
            }
        }
        expect(accepted > 100u, "the sweep accepts some completions", accepted);
        expect(behind > 100u, "the sweep accepts some SQ heads behind sq_head", behind);
    }
}

/* Completions posted out of creation order, as nvme-driver's reap takes them: SQHD is the SQ head
 * when the controller created the entry (NVMe Base Spec 2.0, §4.6), and nothing makes it post
 * entries in that order, so a completion may report a head behind the one seen so far. It is
 * accepted when that head lies in its own ticket's window (past the ticket's entry, up to the
 * tail published); anything else stays a fault. */
static void check_completion_out_of_creation_order(void) {
    const uint32_t queue = 3u, depth = 8u;
    /* Tickets 0, 1 and 2 published (sq_tail 3); ticket 2's completion came first with SQHD 3, so
     * sq_head is 3. Ticket 0's, created at head 1, comes next. */
    expect(gio_completion_verdict(0u, queue, queue, gio_command_id(0u), 1u, 0u, 1u - depth, 3u, 3u, depth) ==
               GIO_COMPLETION_ACCEPT,
           "SQHD behind sq_head but past the ticket's own entry is accepted", 1u);
    expect(gio_completion_verdict(0u, queue, queue, gio_command_id(1u), 3u, 1u, 2u - depth, 3u, 3u, depth) ==
               GIO_COMPLETION_ACCEPT,
           "ticket 1 at the head seen so far is accepted", 3u);
    /* The head only moves forward: ticket 0's SQHD 1 names position 1 in its window, behind 3.
     * Read forward from 3 it would name 9, almost a lap ahead (try_publish_sq would then publish
     * over entries not fetched). */
    expect(gio_sq_head_after(GIO_COMPLETION_ACCEPT, 1u, 0u, 3u, 3u, depth) == 3u,
           "an accepted SQHD behind sq_head leaves sq_head", gio_sq_head_after(GIO_COMPLETION_ACCEPT, 1u, 0u, 3u, 3u, depth));
    expect(gio_sq_head_after(GIO_COMPLETION_ACCEPT, 3u, 2u, 1u, 3u, depth) == 3u,
           "an accepted SQHD past sq_head moves it there", gio_sq_head_after(GIO_COMPLETION_ACCEPT, 3u, 2u, 1u, 3u, depth));
    /* A completion naming no command has no window to place its SQHD in: read forward it may be
     * an old head a lap behind, so it is never applied. */
    expect(gio_sq_head_after(GIO_COMPLETION_UNEXPECTED, 2u, 0u, 1u, 3u, depth) == 1u,
           "an unexpected completion's SQHD is not applied",
           gio_sq_head_after(GIO_COMPLETION_UNEXPECTED, 2u, 0u, 1u, 3u, depth));
    /* Depth 4: tickets 0..2 fetched; ticket 0's completion (SQHD 1) came after ticket 2's (SQHD 3),
     * so sq_head is 3; tickets 4..6 then published (sq_tail 6). A duplicate of ticket 0's entry
     * (command id 0, SQHD 1) names nothing (slot 0 holds ticket 4). Read forward from 3, SQHD 1
     * names 5, inside [3, 6]: applied, try_publish_sq would publish a whole ring (tail 7, head 3). */
    expect(gio_completion_verdict(0u, queue, queue, gio_command_id(0u), 1u, 4u, 1u, 3u, 6u, 4u) ==
               GIO_COMPLETION_UNEXPECTED,
           "a duplicate of a completed ticket's entry is unexpected",
           gio_completion_verdict(0u, queue, queue, gio_command_id(0u), 1u, 4u, 1u, 3u, 6u, 4u));
    expect(gio_sq_head_after(GIO_COMPLETION_UNEXPECTED, 1u, 4u, 3u, 6u, 4u) == 3u,
           "a duplicate's old SQHD does not move sq_head a lap forward",
           gio_sq_head_after(GIO_COMPLETION_UNEXPECTED, 1u, 4u, 3u, 6u, 4u));
    expect(gio_sq_head_after(GIO_COMPLETION_NOT_FETCHED, 2u, 0u, 1u, 3u, depth) == 1u &&
               gio_sq_head_after(GIO_COMPLETION_BAD_SQ_HEAD, 2u, 0u, 1u, 3u, depth) == 1u &&
               gio_sq_head_after(GIO_COMPLETION_WRONG_QUEUE, 2u, 0u, 1u, 3u, depth) == 1u &&
               gio_sq_head_after(GIO_COMPLETION_PAIR_FAULTED, 2u, 0u, 1u, 3u, depth) == 1u,
           "a fault's SQHD is not applied", 2u);
    expect(gio_sq_head_after(GIO_COMPLETION_ACCEPT, 7u, 0xFFFFFFFEu, 0u, 0u, depth) == 0u,
           "an accepted SQHD behind sq_head across the wrap leaves sq_head", 7u);
    /* Ticket 1 created at head 1 would say its entry was never fetched: not in its window. */
    expect(gio_completion_verdict(0u, queue, queue, gio_command_id(1u), 1u, 1u, 2u - depth, 3u, 3u, depth) ==
               GIO_COMPLETION_BAD_SQ_HEAD,
           "SQHD behind sq_head and not past the ticket's entry is a fault", 1u);
    /* A completion naming no live ticket has no window: behind sq_head is a fault, as before. */
    expect(gio_completion_verdict(0u, queue, queue, gio_command_id(1u), 1u, 1u, 2u, 3u, 3u, depth) ==
               GIO_COMPLETION_BAD_SQ_HEAD,
           "SQHD behind sq_head on a completed ticket is a fault", 1u);
    expect(gio_completion_verdict(0u, queue, queue, 0x7700u, 1u, 0u, 1u - depth, 3u, 3u, depth) ==
               GIO_COMPLETION_BAD_SQ_HEAD,
           "SQHD behind sq_head on a foreign command id is a fault", 0x7700u);
    /* A ticket never published (ticket 3, sq_tail 3) has no window either. */
    expect(gio_completion_verdict(0u, queue, queue, gio_command_id(3u), 1u, 3u, 4u - depth, 3u, 3u, depth) ==
               GIO_COMPLETION_BAD_SQ_HEAD,
           "SQHD behind sq_head on a ticket never published is a fault", 3u);
    /* The same across the 2^32 wrap: tickets 2^32 - 2 and 2^32 - 1 published (sq_tail 0 after the
     * wrap), the second completed with SQHD 0 (sq_head 0); the first one's completion was created
     * at head 2^32 - 1 (slot 7). */
    expect(gio_completion_verdict(0u, queue, queue, gio_command_id(0xFFFFFFFEu), 7u, 0xFFFFFFFEu, 0xFFFFFFFFu - depth,
                                  0u, 0u, depth) == GIO_COMPLETION_ACCEPT,
           "SQHD behind sq_head across the wrap is accepted in its window", 7u);
}

/* gio CQ claims (gio_cq_may_claim): a model of the kernel's protocol, with free-running counters
 * started just below the 2^32 wrap. Producers claim, then post into the entry at tail or give the
 * claim back; the consumer frees entries. Invariants: a post never lands on an unconsumed entry
 * (so posting never needs to wait for space), and a claim is refused only when every entry is
 * consumed-pending or claimed. */
static void check_cq_claims(void) {
    enum { depth = 8, steps = 200000 };
    const uint32_t start = 0xFFFFFFF0u;
    uint32_t head = start, tail = start, claimed = start;
    uint32_t open_claims = 0, rng = 12345u;
    int step;
    expect(gio_cq_may_claim(start, start, depth), "an empty ring has room", 0);
    expect(!gio_cq_may_claim(start + depth, start, depth), "depth claims fill the ring", depth);
    expect(!gio_cq_may_claim(start, start + 1u, depth), "a head past the claims reads as full", 1);
    expect(!gio_cq_may_claim(5u, 9u, depth), "a corrupt head never opens room", 9);
    expect(!gio_cq_may_claim(start, start, 0u), "a zero-entry ring never has room", 0);
    for (step = 0; step < steps; step++) {
        rng = rng * 1103515245u + 12345u;
        switch ((rng >> 16) % 4u) {
        case 0: /* claim */
            if (gio_cq_may_claim(claimed, head, depth)) {
                claimed++;
                open_claims++;
            } else {
                expect(claimed - head == depth, "a claim is refused only when the ring is committed", claimed - head);
            }
            break;
        case 1: /* post into a claimed entry: the entry at tail must be free */
            if (open_claims > 0) {
                expect(tail - head < depth, "a post never overwrites an unconsumed entry", tail - head);
                tail++;
                open_claims--;
            }
            break;
        case 2: /* a claim given back (the IOCB was finished by someone else) */
            if (open_claims > 0) {
                claimed--;
                open_claims--;
            }
            break;
        default: /* the consumer reaps one entry */
            if (head != tail) {
                head++;
            }
            break;
        }
        expect(claimed - tail == open_claims, "claimed = tail + open claims", claimed - tail);
        expect(claimed - head <= depth, "claims never exceed the ring", claimed - head);
    }
    expect(head - start > 1000u, "the model wrapped and made progress", head - start);
}

/* The IOCTX command rule (gio_ioctx_command): only Read and Write, 1..=65536 blocks, a known
 * descriptor kind, and every per-layer address computed without wrapping. */
static gio_iocb layer_iocb(uint8_t opcode, uint32_t layer, uint64_t stride) {
    gio_iocb iocb;
    memset(&iocb, 0, sizeof iocb);
    iocb.opcode = opcode;
    iocb.layer = layer;
    iocb.lba_stride_blocks = stride;
    iocb.mem_stride_bytes = stride;
    iocb.desc_stride_bytes = stride;
    return iocb;
}

static void check_ioctx_commands(void) {
    const uint64_t max = ~(uint64_t)0;
    gio_ioctx ioctx;
    gio_iocb iocb;
    gio_ioctx_target command;
    unsigned opcode;
    memset(&ioctx, 0, sizeof ioctx);
    ioctx.start_lba = 5u;
    ioctx.data_iova = 0x10000u;
    ioctx.desc_iova = 0x8000u;
    ioctx.block_count = 8u;
    ioctx.descriptor_kind = GIO_DESCRIPTOR_PRP;
    for (opcode = 0; opcode <= 255u; opcode++) {
        iocb = layer_iocb((uint8_t)opcode, 3u, 0x20u);
        expect(gio_ioctx_command(&iocb, &ioctx, &command) ==
                   (opcode == GIO_OPCODE_READ || opcode == GIO_OPCODE_WRITE),
               "only Read and Write are valid opcodes (0x08 Write Zeroes, 0x09 DSM destroy data)", opcode);
    }
    iocb = layer_iocb(GIO_OPCODE_READ, 3u, 0x20u);
    expect(gio_ioctx_command(&iocb, &ioctx, &command) && command.lba == 5u + 0x60u &&
               command.data_iova == 0x10060u && command.desc_iova == 0x8060u,
           "layer 3 of stride 0x20", 3u);
    ioctx.block_count = 0u;
    expect(!gio_ioctx_command(&iocb, &ioctx, &command), "0 blocks is invalid (NLB would read 65536)", 0u);
    ioctx.block_count = GIO_IOCTX_BLOCK_COUNT_MAX;
    expect(gio_ioctx_command(&iocb, &ioctx, &command), "65536 blocks is valid", GIO_IOCTX_BLOCK_COUNT_MAX);
    ioctx.block_count = GIO_IOCTX_BLOCK_COUNT_MAX + 1u;
    expect(!gio_ioctx_command(&iocb, &ioctx, &command), "65537 blocks is invalid (NLB would read 1)", 65537u);
    ioctx.block_count = 8u;
    ioctx.descriptor_kind = 2u;
    expect(!gio_ioctx_command(&iocb, &ioctx, &command), "an unknown descriptor kind is invalid", 2u);
    ioctx.descriptor_kind = GIO_DESCRIPTOR_SGL;
    /* Overflow of layer x stride, and of base + offset, on each of the three addresses. */
    iocb = layer_iocb(GIO_OPCODE_WRITE, 2u, max / 2u + 1u);
    expect(!gio_ioctx_command(&iocb, &ioctx, &command), "layer x stride overflowing is invalid", 2u);
    iocb = layer_iocb(GIO_OPCODE_WRITE, 1u, 0u);
    iocb.lba_stride_blocks = max - 4u;
    expect(!gio_ioctx_command(&iocb, &ioctx, &command), "start_lba + offset overflowing is invalid", 1u);
    iocb.lba_stride_blocks = max - 5u;
    expect(gio_ioctx_command(&iocb, &ioctx, &command) && command.lba == max, "the last LBA is reachable", 1u);
    iocb = layer_iocb(GIO_OPCODE_WRITE, 1u, 0u);
    iocb.mem_stride_bytes = max - 0xFFFFu;
    expect(!gio_ioctx_command(&iocb, &ioctx, &command), "data_iova + offset overflowing is invalid", 1u);
    iocb = layer_iocb(GIO_OPCODE_WRITE, 1u, 0u);
    iocb.desc_stride_bytes = max - 0x7FFFu;
    expect(!gio_ioctx_command(&iocb, &ioctx, &command), "desc_iova + offset overflowing is invalid", 1u);
    /* desc_iova 0 means "no descriptors": no offset is applied, so its stride cannot overflow. */
    ioctx.desc_iova = 0u;
    expect(gio_ioctx_command(&iocb, &ioctx, &command) && command.desc_iova == 0u, "desc_iova 0 stays 0", 1u);
}

/* Reads the cases of `rules_check ioctx-commands` from stdin and prints one verdict per case. */
static void print_ioctx_commands(void) {
    unsigned opcode, kind;
    uint32_t layer, block_count;
    uint64_t lba_stride, mem_stride, desc_stride, start_lba, data_iova, desc_iova;
    while (scanf("%u %" SCNu32 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu32
                 " %u",
                 &opcode, &layer, &lba_stride, &mem_stride, &desc_stride, &start_lba, &data_iova, &desc_iova,
                 &block_count, &kind) == 10) {
        gio_iocb iocb = layer_iocb((uint8_t)opcode, layer, 0u);
        gio_ioctx ioctx;
        gio_ioctx_target command;
        iocb.lba_stride_blocks = lba_stride;
        iocb.mem_stride_bytes = mem_stride;
        iocb.desc_stride_bytes = desc_stride;
        memset(&ioctx, 0, sizeof ioctx);
        ioctx.start_lba = start_lba;
        ioctx.data_iova = data_iova;
        ioctx.desc_iova = desc_iova;
        ioctx.block_count = block_count;
        ioctx.descriptor_kind = (uint8_t)kind;
        if (gio_ioctx_command(&iocb, &ioctx, &command)) {
            printf("1 %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", command.lba, command.data_iova, command.desc_iova);
        } else {
            printf("0\n");
        }
    }
}

/* The command id of a ticket (gio_command_id): never FFFFh (NVMe: the Error Information log's "no
 * particular command"; nvme-driver never issues it), its slot index in the low bits at every depth
 * the kernel takes, and different from the ids of the same slot's previous and next rounds (the
 * generation check), across the 16-bit and 32-bit wraps. */
static void check_command_ids(void) {
    uint32_t depth;
    uint64_t t;
    for (depth = 2u; depth <= GIO_SQ_DEPTH_MAX; depth <<= 1) {
        for (t = 0; t < 0x30000u; t++) {
            const uint32_t tickets[2] = {(uint32_t)t, (uint32_t)(0xFFFE0000u + t)};
            unsigned k;
            for (k = 0; k < 2u; k++) {
                const uint32_t ticket = tickets[k];
                const uint32_t id = gio_command_id(ticket);
                expect(id != 0xFFFFu, "no command id FFFFh", ticket);
                expect(id <= 0xFFFFu, "a command id fits 16 bits", ticket);
                expect((id & (depth - 1u)) == (ticket & (depth - 1u)), "the command id names the ticket's slot", ticket);
                expect(id != gio_command_id(ticket - depth) && id != gio_command_id(ticket + depth),
                       "the command id differs from its slot's previous and next rounds", ticket);
            }
        }
    }
    expect(gio_command_id(0x12345u) == 0x2345u, "otherwise the ticket's low 16 bits", 0x12345u);
}

int main(int argc, char **argv) {
    const int print_kinds = argc > 1 && strcmp(argv[1], "descriptor-kinds") == 0;
    const int print_commands = argc > 1 && strcmp(argv[1], "ioctx-commands") == 0;
    if (print_commands) {
        print_ioctx_commands();
        return 0;
    }
    check_descriptor_kinds(print_kinds);
    check_completion_verdicts();
    check_command_ids();
    check_completion_sq_heads();
    check_completion_out_of_creation_order();
    check_cq_claims();
    check_ioctx_commands();
    if (failures != 0) {
        fprintf(stderr, "rules_check: %d failed checks\n", failures);
        return 1;
    }
    if (!print_kinds) {
        printf("rules_check: OK\n");
    }
    return 0;
}
