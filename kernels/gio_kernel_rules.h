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
#define GIO_COMPLETION_ACCEPT 0u      /* completes the command in the slot its command id names */
#define GIO_COMPLETION_UNEXPECTED 1u  /* stale or foreign command id: counted, completes nothing */
#define GIO_COMPLETION_WRONG_QUEUE 2u /* names another SQ: a controller fault, completes nothing */

/*
 * The completion acceptance rule, the kernel's twin of nvme-driver's QueuePair::reap: an entry
 * whose SQ id is not the queue's is a controller fault, checked first because none of its other
 * fields (command id, SQ head) can then be trusted; otherwise the command id must carry the slot's
 * current ticket (slot index plus generation bits) and that ticket must not be completed yet.
 */
GIO_RULE uint32_t gio_completion_verdict(uint32_t reported_sq_id, uint32_t queue_id, uint32_t command_id,
                                         uint32_t slot_ticket, uint32_t slot_done_ticket) {
    if (reported_sq_id != queue_id) {
        return GIO_COMPLETION_WRONG_QUEUE;
    }
    if ((slot_ticket & 0xFFFFu) != command_id || slot_done_ticket == slot_ticket + 1u) {
        return GIO_COMPLETION_UNEXPECTED;
    }
    return GIO_COMPLETION_ACCEPT;
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

#endif /* TUTTI_GIO_KERNEL_RULES_H */
