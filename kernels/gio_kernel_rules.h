/*
 * Decisions of the CUDA I/O kernel (kernels/gio_io_kernel.cu) as plain GIO_RULE functions, so that
 * they run on the host too: kernels/tests/rules_check.c checks each against its specification
 * (built by crates/gio-uring/tests/gpu_rules.rs with the system C compiler, and as C++ and CUDA C++
 * by tools/cuda-build.sh). The kernel calls these functions and keeps no second copy of the logic.
 * Not part of the ABI: bindgen does not read this file.
 */
#ifndef TUTTI_GIO_KERNEL_RULES_H
#define TUTTI_GIO_KERNEL_RULES_H

#include "gio_abi.h"

/* What an NVMe completion entry read from a queue pair's CQ does (gio_completion_verdict). */
#define GIO_COMPLETION_ACCEPT 0u       /* completes the command in the slot its command id names */
#define GIO_COMPLETION_UNEXPECTED 1u   /* stale or foreign command id: counted, completes nothing */
#define GIO_COMPLETION_WRONG_QUEUE 2u  /* names another SQ: a controller fault, completes nothing */
#define GIO_COMPLETION_PAIR_FAULTED 3u /* the pair's controller faulted before: not even read */
#define GIO_COMPLETION_BAD_SQ_HEAD 4u  /* SQHD outside [sq_head, sq_tail] and outside the live
                                        * ticket's own window: a controller fault */
#define GIO_COMPLETION_NOT_FETCHED 5u  /* completes a command not published, or whose entry SQHD
                                        * says was not fetched yet: a controller fault */

/* Whether a verdict is a controller fault: the entry is consumed, completes nothing, the pair is
 * faulted (controller_faults) and must be reset by the host. */
GIO_RULE int gio_completion_is_fault(uint32_t verdict) {
    return verdict == GIO_COMPLETION_WRONG_QUEUE || verdict == GIO_COMPLETION_BAD_SQ_HEAD ||
           verdict == GIO_COMPLETION_NOT_FETCHED;
}

/* The free-running SQ head an SQHD slot index names read forward: the one position in [sq_head,
 * sq_head + sq_depth) with that slot (sq_depth a power of two). */
GIO_RULE uint32_t gio_sq_head_from_sqhd(uint32_t sq_head, uint32_t sqhd, uint32_t sq_depth) {
    return sq_head + ((sqhd - sq_head) & (sq_depth - 1u));
}

/* The free-running SQ head an SQHD slot index names read in ticket `ticket`'s window: the one
 * position in (ticket, ticket + sq_depth] with that slot. The heads the controller can have had
 * once it fetched the ticket's entry lie there, up to the tail published, which is at most
 * ticket + sq_depth: ticket + sq_depth shares the ticket's slot and is not written before the
 * ticket completed. So for a live ticket the position is exact, whatever the order the
 * completions are posted in. */
GIO_RULE uint32_t gio_sq_head_in_ticket_window(uint32_t ticket, uint32_t sqhd, uint32_t sq_depth) {
    return ticket + 1u + ((sqhd - ticket - 1u) & (sq_depth - 1u));
}

/* The deepest NVMe queue pair the kernel drives (gpu::plan::GPU_QUEUE_DEPTH_MAX on the Rust side,
 * which refuses deeper pairs): at 16384 each slot has four generations of command id, so the one
 * gio_command_id moves off FFFFh still differs from its slot's previous and next rounds. */
#define GIO_SQ_DEPTH_MAX 16384u

/*
 * The NVMe command id of ticket `ticket`: its low 16 bits (the SQ slot index in the low bits,
 * since depths divide 2^16, and a generation in the rest), except that FFFFh is never used (NVMe:
 * the Error Information log's "no particular command"; nvme-driver skips it too): the ticket that
 * would carry it, the top slot's last generation, carries 7FFFh, the id of the round two
 * generations away at depth 16384 (further at smaller depths), never of the adjacent ones.
 */
GIO_RULE uint32_t gio_command_id(uint32_t ticket) {
    const uint32_t id = ticket & 0xFFFFu;
    return id == 0xFFFFu ? 0x7FFFu : id;
}

/*
 * The completion acceptance rule, the kernel's twin of nvme-driver's QueuePair::reap. A pair whose
 * controller already faulted (`pair_faulted`: its controller_faults counter, non-zero) trusts
 * nothing its controller reports until the host resets it, so every entry is refused unread: with
 * several reapers, one may consume the faulty entry while another, on a later entry, would
 * otherwise still complete a command. An entry whose SQ id is not the queue's is a controller
 * fault, checked next because none of its other fields (command id, SQ head) can then be trusted.
 * Then the SQ head it reports (`sqhd`, a slot index) is read against the head seen so far
 * (`sq_head`, free-running) and the tail published to the controller (`sq_tail`, free-running).
 * SQHD is the head when the controller created the entry (NVMe Base Spec 2.0, §4.6), and nothing
 * makes it post entries in that order, so a later entry may carry an older head:
 * - an entry whose command id is the slot's current ticket's (gio_command_id: slot index plus
 *   generation bits), not completed yet, is accepted when SQHD lies in that ticket's own window
 *   (gio_sq_head_in_ticket_window: past its entry up to sq_tail; the ticket must have been
 *   published, below sq_tail). Outside it the entry completes a command the controller cannot
 *   have fetched: NOT_FETCHED when SQHD lies in [sq_head, sq_tail], else BAD_SQ_HEAD;
 * - any other entry (stale, foreign or duplicated command id) has no window: UNEXPECTED when SQHD
 *   lies in [sq_head, sq_tail], else BAD_SQ_HEAD. That range only classifies it: its SQHD may be
 *   an old head that, read forward, lands inside it, so gio_sq_head_after never applies it.
 * A head past the tail would let the tail publication move past entries the controller has not
 * fetched (it re-fetches stale SQEs); a completion for a command it cannot have read would hand
 * its buffer back while the entry, published later, still names it. The head to apply after a
 * verdict is gio_sq_head_after's. Every counter is free-running and modular; the kernel keeps
 * sq_tail - sq_head below sq_depth and sq_tail - ticket at most sq_depth, so the windows below are
 * unambiguous (at sq_tail - ticket == sq_depth the ticket's own slot names the window's end, a
 * ring on). nvme-driver applies the same rule and the same head after every verdict, a fault
 * included (accept_submission_head: an entry short of its command's entry, NOT_FETCHED here and
 * CompletionBeforeFetch there, leaves the head on both sides, and a failed pair there still
 * judges later entries against it); only for a command published more than a ring ago, which
 * the kernel never sees, does it keep the head (the SQHD's place is then ambiguous).
 */
GIO_RULE uint32_t gio_completion_verdict(uint32_t pair_faulted, uint32_t reported_sq_id, uint32_t queue_id,
                                         uint32_t command_id, uint32_t sqhd, uint32_t slot_ticket,
                                         uint32_t slot_done_ticket, uint32_t sq_head, uint32_t sq_tail,
                                         uint32_t sq_depth) {
    int forward, names_live_ticket, published;
    if (pair_faulted != 0u) {
        return GIO_COMPLETION_PAIR_FAULTED;
    }
    if (reported_sq_id != queue_id) {
        return GIO_COMPLETION_WRONG_QUEUE;
    }
    /* sqhd is the device's: range-checked before any arithmetic on it. */
    if (sqhd >= sq_depth) {
        return GIO_COMPLETION_BAD_SQ_HEAD;
    }
    forward = (uint32_t)(gio_sq_head_from_sqhd(sq_head, sqhd, sq_depth) - sq_head) <= (uint32_t)(sq_tail - sq_head);
    names_live_ticket = gio_command_id(slot_ticket) == command_id && slot_done_ticket != slot_ticket + 1u;
    if (!names_live_ticket) {
        return forward ? GIO_COMPLETION_UNEXPECTED : GIO_COMPLETION_BAD_SQ_HEAD;
    }
    published = (uint32_t)(sq_tail - slot_ticket - 1u) < sq_depth;
    if (published && (uint32_t)(gio_sq_head_in_ticket_window(slot_ticket, sqhd, sq_depth) - slot_ticket - 1u) <=
                         (uint32_t)(sq_tail - slot_ticket - 1u)) {
        return GIO_COMPLETION_ACCEPT;
    }
    return forward ? GIO_COMPLETION_NOT_FETCHED : GIO_COMPLETION_BAD_SQ_HEAD;
}

/*
 * The free-running SQ head after an entry gio_completion_verdict judged with the same arguments.
 * Heads only move forward: an ACCEPTed entry moves sq_head to the position SQHD names in its
 * ticket's window only if that lies past sq_head, and leaves it otherwise (an entry posted after
 * one created later). Read forward instead, an SQHD behind sq_head would move the head almost a
 * lap ahead, and try_publish_sq would then publish over entries the controller has not fetched.
 * An UNEXPECTED entry names no ticket, so it has no window to place its SQHD in: it may be a
 * duplicate or a late entry created long ago, whose old SQHD read forward lands inside
 * [sq_head, sq_tail] (any SQHD k places behind sq_head does once sq_tail - sq_head >= sq_depth - k)
 * and would let try_publish_sq publish a whole ring. So it leaves sq_head, a lower bound, where
 * it is; so does a fault (or a faulted pair): nothing the entry says is applied. Both positions
 * lie at most sq_depth behind sq_tail, so comparing their distances to it is exact.
 */
GIO_RULE uint32_t gio_sq_head_after(uint32_t verdict, uint32_t sqhd, uint32_t slot_ticket, uint32_t sq_head,
                                    uint32_t sq_tail, uint32_t sq_depth) {
    uint32_t own;
    if (verdict != GIO_COMPLETION_ACCEPT) {
        return sq_head;
    }
    own = gio_sq_head_in_ticket_window(slot_ticket, sqhd, sq_depth);
    return (uint32_t)(sq_tail - own) < (uint32_t)(sq_tail - sq_head) ? own : sq_head;
}

/*
 * Whether a GPU producer may claim one more entry of a gio CQ: `claimed` is the ring's
 * producer_claimed (entries published or claimed, free-running), `head` the consumer's counter.
 * Claims, not the tail, are counted, so that every open claim is backed by a free entry and
 * posting into a claimed entry never waits for space. A head past `claimed` (a corrupt consumer
 * counter) reads as full, never as room to overwrite unconsumed entries.
 */
GIO_RULE int gio_cq_may_claim(uint32_t claimed, uint32_t head, uint32_t entry_count) {
    return (uint32_t)(claimed - head) < entry_count;
}

/* The most logical blocks one IOCTX moves: NLB in CDW12 is a 0-based 16-bit count (NVMe Base
 * Spec 2.0, Read/Write command, CDW12 bits 15:0). */
#define GIO_IOCTX_BLOCK_COUNT_MAX 65536u

/* Where layer `layer` of an IOCTX reads or writes (gio_ioctx_command's result). */
typedef struct gio_ioctx_target {
    uint64_t lba;       /* start_lba + layer x lba_stride_blocks */
    uint64_t data_iova; /* data_iova + layer x mem_stride_bytes */
    uint64_t desc_iova; /* 0, or desc_iova + layer x desc_stride_bytes */
} gio_ioctx_target;

/* base + layer x stride into *out, or 0 (and *out untouched) if it does not fit in 64 bits. */
GIO_RULE int gio_layer_address(uint64_t base, uint32_t layer, uint64_t stride, uint64_t *out) {
    const uint64_t max = ~(uint64_t)0;
    if (layer != 0u && stride > max / layer) {
        return 0;
    }
    if (base > max - (uint64_t)layer * stride) {
        return 0;
    }
    *out = base + (uint64_t)layer * stride;
    return 1;
}

/*
 * The IOCTX command rule: whether the IOCTX, at the IOCB's current layer, is a command an executor
 * may build, and if so where it reads or writes (*out). Valid exactly when the IOCB's opcode is
 * Read or Write (never Write Zeroes, Dataset Management or any other opcode a corrupted byte could
 * name: they destroy data), block_count is in 1..=GIO_IOCTX_BLOCK_COUNT_MAX (NLB is block_count - 1
 * in 16 bits: 0 would read as 65536 blocks, 65537 as one), the descriptor kind is valid, and every
 * per-layer address is computed without wrapping. Every executor refuses an invalid IOCTX
 * (GIO_IOCB_STATUS_INVALID_IOCTX, no command built); the CPU executor applies the Rust mirror
 * (abi::ioctx_command), and tests/gpu_rules.rs checks the two agree. The device index is checked
 * by each executor against its own table.
 */
GIO_RULE int gio_ioctx_command(const gio_iocb *iocb, const gio_ioctx *ioctx, gio_ioctx_target *out) {
    gio_ioctx_target command;
    if (iocb->opcode != GIO_OPCODE_READ && iocb->opcode != GIO_OPCODE_WRITE) {
        return 0;
    }
    if (ioctx->block_count < 1u || ioctx->block_count > GIO_IOCTX_BLOCK_COUNT_MAX) {
        return 0;
    }
    if (!gio_descriptor_kind_is_valid(ioctx->descriptor_kind)) {
        return 0;
    }
    if (!gio_layer_address(ioctx->start_lba, iocb->layer, iocb->lba_stride_blocks, &command.lba) ||
        !gio_layer_address(ioctx->data_iova, iocb->layer, iocb->mem_stride_bytes, &command.data_iova)) {
        return 0;
    }
    command.desc_iova = 0u;
    if (ioctx->desc_iova != 0u &&
        !gio_layer_address(ioctx->desc_iova, iocb->layer, iocb->desc_stride_bytes, &command.desc_iova)) {
        return 0;
    }
    *out = command;
    return 1;
}

#endif /* TUTTI_GIO_KERNEL_RULES_H */
