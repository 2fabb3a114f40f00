// The gio_uring I/O kernel: one launch per issue_io. GPU threads turn the IOCTXs of the issued
// IOCBs into NVMe Read/Write commands, write them into NVMe submission queues, ring the doorbell,
// reap NVMe completions and post one gio CQE per IOCB, with no CPU involvement per I/O (Tutti §3.2).
//
// STATUS: compiled (sm_80, sm_90 cubins + compute_80 PTX by tools/cuda-build.sh) but never run: no
// GPU was available while it was written. Treat it as unverified until the GPU test has run.
//
// Host side: crates/gio-uring/src/gpu/executor.rs. It passes a private "sink" ring as the gio CQ
// and posts the CQEs the CPU sees itself, after the launch's event (staged copies follow the
// kernel, and an IOCB must not be reissued while the kernel that completed it still polls).
//
// Shared records: kernels/gio_abi.h (IOCB, IOCTX, rings, per-queue-pair state), NVMe entries:
// kernels/nvme_spec.h. Launch: gio_io_kernel<<<blocks, threads_per_block (multiple of 32)>>>(params)
// on the I/O green context's stream, after cuStreamWaitEvent on the issue's dependency.
//
// Work split: the IOCTXs of each IOCB are cut into chunks of 32, one chunk per warp, round-robin
// over all warps of the grid. For a chunk, the lanes targeting the same device reserve their SQ
// slots with one atomicAdd (per device present in the warp), each lane writes its SQE, and one lane
// per device publishes the tail. Afterwards warp 0 of every block polls completions until every
// IOCB of the launch has its final status or the bounded wait expires.
//
// Launch requirements: threads per block a multiple of 32 (warp-wide intrinsics use a full mask),
// and a grid whose blocks are all resident at once (at most the I/O domain's SMs times the
// occupancy from cuOccupancyMaxActiveBlocksPerMultiprocessor): a block's polling thread waits for
// IOCTXs that other blocks submit, so a block that never gets scheduled would turn into a timeout.
//
// Every wait is bounded twice: by params.poll_iterations_max iterations with exponential
// __nanosleep backoff capped at params.backoff_ns_max, and by one deadline per block, read from
// %globaltimer when the block starts: poll_iterations_max x backoff_ns_max nanoseconds later (2 s
// with the executor's defaults). Without the deadline a warp that waits for several chunks in turn
// could wait that long for each. An expired wait fails the IOCB with GIO_IOCB_STATUS_TIMEOUT; it
// never spins forever. Past the deadline nothing waits: what is left of the launch (submitting the
// remaining chunks' free slots, finalising IOCBs, one claim attempt each) takes microseconds, so a
// launch ends about the budget after its last block started (docs/gio-uring.md: "Time bounds").
// A completion naming another SQ, reporting an SQ head outside [sq_head, sq_tail] and outside its
// command's own window (past its entry up to sq_tail: entries may be posted out of creation order,
// so an older head is believed there, and sq_head never moves back), or completing a command not
// published or not yet fetched by the controller is a controller fault (gio_completion_verdict,
// the rule of nvme-driver's reap): it completes nothing and fails the launch's unfinished IOCBs with GIO_IOCB_STATUS_CONTROLLER_FAULT. From then
// on the pair is faulted (controller_faults != 0): no reaper, in any block, accepts or consumes
// another of its completions, and no SQE is published to it. After either, the queue pairs may hold commands the kernel no longer tracks: the host must reset them
// before reuse (docs/gio-uring.md).

#include "gio_abi.h"
#include "gio_kernel_rules.h"
#include "nvme_spec.h"

// The ABI version this image was compiled with. The host reads it back with cuModuleGetGlobal when
// it loads the module and refuses any other (crates/gio-uring/src/gpu/mod.rs, ABI_VERSION_SYMBOL),
// as it refuses image file names of another version (tools/cuda-build.sh names them from
// GIO_ABI_VERSION): an old kernel must never run against new crates. Not const: an unreferenced
// const variable is dropped from the image (nvcc warning 177); this one is kept, a 4-byte object
// symbol of the cubin (local in whole-program mode, .global in the PTX) for cuModuleGetGlobal to
// find by name (as the runtime finds such variables; not yet run on a GPU). tools/cuda-build.sh
// checks that every image carries it.
extern "C" {
__device__ uint32_t gio_abi_version = GIO_ABI_VERSION;
}

namespace {

constexpr uint32_t kWarpLanes = 32;
constexpr uint32_t kFullMask = 0xFFFFFFFFu;
constexpr uint32_t kPublishRoundsMax = 4;

// ---- memory access helpers: every location another agent writes is read or written volatile ----

__device__ __forceinline__ uint32_t load_volatile(const uint32_t* address) {
    return *reinterpret_cast<const volatile uint32_t*>(address);
}
__device__ __forceinline__ uint16_t load_volatile(const uint16_t* address) {
    return *reinterpret_cast<const volatile uint16_t*>(address);
}
__device__ __forceinline__ void store_volatile(uint32_t* address, uint32_t value) {
    *reinterpret_cast<volatile uint32_t*>(address) = value;
}
__device__ __forceinline__ void store_volatile(uint16_t* address, uint16_t value) {
    *reinterpret_cast<volatile uint16_t*>(address) = value;
}

template <typename T>
__device__ __forceinline__ T* device_pointer(uint64_t address) {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

// Exponential backoff for polling loops; __nanosleep keeps a spinning warp from stealing issue
// slots from the warps that do useful work on the same SM.
struct Backoff {
    uint32_t sleep_ns;
    uint32_t max_ns;
    __device__ explicit Backoff(uint32_t cap_ns) : sleep_ns(32), max_ns(cap_ns < 32 ? 32 : cap_ns) {}
    __device__ void pause() {
        __nanosleep(sleep_ns);
        // Compared against half the cap: sleep_ns * 2 wraps past 2^32 for a cap of 2^31 ns or
        // more, which would drop the sleep to 0 and leave the wait spinning.
        sleep_ns = sleep_ns > max_ns / 2 ? max_ns : sleep_ns * 2;
    }
};

// ---- the launch's deadline ----

// Nanoseconds since an arbitrary epoch, the same for every SM (PTX %globaltimer).
__device__ __forceinline__ uint64_t global_time_ns() {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

// When this block's waits end: set once by thread 0 at the block's start, read by every wait.
__shared__ uint64_t block_deadline_ns;

__device__ __forceinline__ bool deadline_passed() {
    return global_time_ns() >= block_deadline_ns;
}

// Try-locks guard the two per-queue-pair critical sections (tail publication, completion
// reaping). Nobody ever blocks on them: a thread that fails to take one leaves the work to the
// holder, and the holder re-checks for such work after releasing (see try_publish_sq).
__device__ __forceinline__ bool try_lock(uint32_t* lock) {
    if (atomicCAS(lock, 0u, 1u) == 0u) {
        __threadfence();  // acquire: the previous holder's writes are visible to us
        return true;
    }
    return false;
}
__device__ __forceinline__ void unlock(uint32_t* lock) {
    __threadfence();  // release: our writes are visible before the lock reads free
    atomicExch(lock, 0u);
}

// ---- gio CQ: claim an entry first, post into it later ----
//
// No thread waits for gio CQ space while it holds a lock. A producer first claims an entry
// (producer_claimed, a lock-free compare-and-swap under gio_cq_may_claim); posting into a claimed
// entry only takes producer_lock, whose holders never wait while holding it. A reaper, which holds
// its queue pair's cq_lock, claims one entry before it consumes each NVMe completion and leaves the
// completion in the NVMe CQ if the gio CQ is full: the next reap (every polling iteration) retries,
// until the launch's bounded wait ends as TIMEOUT. Threads that hold no lock may wait for space with
// the usual bound. A CQE that still cannot be posted is counted in overflow_count; the IOCB's final
// status stays in memory. Nothing is lost silently.

// How finalize_iocb obtains the gio CQ entry for the IOCB's CQE.
enum class CqeClaim {
    kHeld,     // the caller (a reaper) claimed it beforehand and holds a lock: never wait
    kTryOnce,  // the launch's wait already expired: claim if there is room, else overflow
    kWait,     // no lock held: wait for room with the bounded backoff, then overflow
};

// Claims one gio CQ entry if the ring has room. Each failed compare-and-swap means another
// producer claimed meanwhile (lock-free progress); the attempts are bounded all the same.
//
// A refused room check re-reads producer_claimed before it gives up: `claimed` may be older than
// the head read after it. The consumer (the CPU) moves head up to tail, and tail up to claims other
// producers made after our read, so a stale `claimed` below the new head makes `claimed - head`
// wrap and read as full. Only a refusal with producer_claimed unchanged across the head read is
// believed.
__device__ bool try_claim_cqe(const gio_launch_params& params) {
    gio_ring_header* header = device_pointer<gio_ring_header>(params.cq_header);
    const uint32_t depth = load_volatile(&header->entry_count);
    uint32_t claimed = load_volatile(&header->producer_claimed);
    for (uint32_t attempt = 0; attempt < params.poll_iterations_max; ++attempt) {
        const uint32_t head = load_volatile(&header->head);
        if (!gio_cq_may_claim(claimed, head, depth)) {
            __threadfence();  // the re-read below happens after the head read above
            const uint32_t fresh = load_volatile(&header->producer_claimed);
            if (fresh == claimed) {
                return false;
            }
            claimed = fresh;
            continue;
        }
        const uint32_t seen = atomicCAS(&header->producer_claimed, claimed, claimed + 1);
        if (seen == claimed) {
            return true;
        }
        claimed = seen;
    }
    return false;
}

__device__ bool claim_cqe(const gio_launch_params& params, CqeClaim mode) {
    if (mode == CqeClaim::kHeld) {
        return true;
    }
    Backoff backoff(params.backoff_ns_max);
    for (uint32_t attempt = 0; attempt < params.poll_iterations_max; ++attempt) {
        if (try_claim_cqe(params)) {
            return true;
        }
        // Past the launch's deadline a waiting claim becomes a single try.
        if (mode == CqeClaim::kTryOnce || deadline_passed()) {
            return false;
        }
        backoff.pause();  // no lock is held here (kWait callers hold none)
    }
    return false;
}

// Gives back a claimed entry that will not be posted.
__device__ void release_cqe_claim(const gio_launch_params& params) {
    atomicSub(&device_pointer<gio_ring_header>(params.cq_header)->producer_claimed, 1u);
}

__device__ void count_cqe_overflow(const gio_launch_params& params) {
    atomicAdd(&device_pointer<gio_ring_header>(params.cq_header)->overflow_count, 1u);
}

// Tells the host that a queue pair needs a reset whatever the IOCBs' statuses say (see
// gio_ring_header.reset_requests): an IOCB's status is decided by its first failure, so the
// damage a later failure left (an abandoned ticket, a controller fault) may show in none of them.
// The counter lives in the host-mapped sink; the host reads it after the launch's event.
__device__ void request_queue_pair_reset(const gio_launch_params& params) {
    atomicAdd(&device_pointer<gio_ring_header>(params.cq_header)->reset_requests, 1u);
    __threadfence_system();
}

// Posts one gio CQE into an entry claimed beforehand: tail < producer_claimed and
// producer_claimed - head <= depth, so the entry at tail is free and this never waits for space.
// Producers serialise the in-order tail publication on producer_lock, held for a few stores only.
// The entry is written, then __threadfence_system() orders it (and the IOCB's final line) before
// the tail store that makes it visible to the CPU consumer: release at system scope.
__device__ bool post_claimed_cqe(const gio_launch_params& params, const gio_cqe& cqe) {
    gio_ring_header* header = device_pointer<gio_ring_header>(params.cq_header);
    gio_cqe* entries = device_pointer<gio_cqe>(params.cq_entries);
    for (uint32_t attempt = 0; attempt < params.poll_iterations_max; ++attempt) {
        if (try_lock(&header->producer_lock)) {
            const uint32_t tail = load_volatile(&header->tail);
            const uint32_t depth = load_volatile(&header->entry_count);
            gio_cqe* slot = &entries[tail & (depth - 1)];
            store_volatile(&slot->iocb_id, cqe.iocb_id);
            store_volatile(&slot->issue_seq, cqe.issue_seq);
            store_volatile(&slot->failed_ioctx, cqe.failed_ioctx);
            store_volatile(&slot->status, cqe.status);
            store_volatile(&slot->failed_nvme_status, cqe.failed_nvme_status);
            __threadfence_system();
            store_volatile(&header->tail, tail + 1);
            unlock(&header->producer_lock);
            return true;
        }
    }
    return false;  // only a lock word nobody releases gets here
}

// ---- per-IOCB completion accounting (mirrors crates/gio-uring/src/executor.rs) ----

// Moves an IOCB off ISSUED exactly once (compare-and-swap) and posts its CQE into a gio CQ entry
// obtained as `claim` says. Returns whether it used a held claim (kHeld callers keep it otherwise).
__device__ bool finalize_iocb(const gio_launch_params& params, gio_iocb* iocb, uint32_t final_status,
                              CqeClaim claim) {
    __threadfence();
    const uint32_t failed_ioctx = load_volatile(&iocb->failed_ioctx);
    if (final_status == GIO_IOCB_STATUS_SUCCESS && failed_ioctx != GIO_NO_FAILED_IOCTX) {
        final_status = load_volatile(&iocb->failed_status);
    }
    if (load_volatile(&iocb->status) != GIO_IOCB_STATUS_ISSUED) {
        return false;  // someone (a timeout) already finished this issue: claim nothing
    }
    // Claim before the compare-and-swap: the thread that ends the issue then posts without waiting.
    const bool claimed = claim_cqe(params, claim);
    if (atomicCAS(&iocb->status, GIO_IOCB_STATUS_ISSUED, final_status) != GIO_IOCB_STATUS_ISSUED) {
        if (claimed && claim != CqeClaim::kHeld) {
            release_cqe_claim(params);
        }
        return false;
    }
    if (!claimed) {
        count_cqe_overflow(params);  // the status is final in memory; the host reads the counter
        return false;
    }
    gio_cqe cqe;
    cqe.iocb_id = iocb->id;
    cqe.issue_seq = iocb->issue_seq;
    cqe.failed_ioctx = failed_ioctx;
    cqe.status = static_cast<uint16_t>(final_status);
    cqe.failed_nvme_status =
        failed_ioctx == GIO_NO_FAILED_IOCTX ? 0 : load_volatile(&iocb->failed_nvme_status);
    if (!post_claimed_cqe(params, cqe)) {
        release_cqe_claim(params);
        count_cqe_overflow(params);
    }
    return true;
}

// Counts one finished IOCTX. A failure first claims failed_ioctx (first failure wins) and records
// its status; the fence orders that record before the counter increment, so whichever thread takes
// the counter to ioctx_count sees it. Returns whether a held gio CQ claim was used.
__device__ bool complete_ioctx(const gio_launch_params& params, gio_iocb* iocb, uint32_t ioctx_index,
                               uint32_t failure_status, uint16_t nvme_status, CqeClaim claim) {
    if (failure_status != 0) {
        if (atomicCAS(&iocb->failed_ioctx, GIO_NO_FAILED_IOCTX, ioctx_index) == GIO_NO_FAILED_IOCTX) {
            store_volatile(&iocb->failed_nvme_status,
                           static_cast<uint16_t>(nvme_status & NVME_CQE_STATUS_NO_PHASE_MASK));
            store_volatile(&iocb->failed_status, static_cast<uint16_t>(failure_status));
        }
    }
    __threadfence();
    const uint32_t previous = atomicAdd(&iocb->completed_ioctx_count, 1u);
    if (previous + 1 == load_volatile(&iocb->ioctx_count)) {
        return finalize_iocb(params, iocb, GIO_IOCB_STATUS_SUCCESS, claim);
    }
    return false;
}

// ---- NVMe queue pair: tail publication ----

// Whether a completion on this queue pair was a controller fault (gio_completion_verdict): until
// the host resets the pair, nothing its controller reports is trusted and nothing more is given to
// it (no completion is accepted, no tail or head doorbell written, no SQE published).
__device__ __forceinline__ bool queue_pair_faulted(gio_nvme_qp* qp) {
    return load_volatile(&qp->controller_faults) != 0;
}

// Advances the SQ tail over the contiguous run of ready slots and rings the doorbell once.
//
// In-order publication: a slot's SQE becomes visible to the controller only when every earlier
// ticket's SQE is written, because the doorbell says "everything below this tail is valid".
//
// Why no ready slot is stranded: a writer stores ready_ticket, fences, then tries the lock. If the
// try fails, the holder at that moment has not yet released it; the holder releases, fences, and
// re-reads the ready flag of the next unpublished slot. With both fences, it is impossible that the
// writer reads "locked" and the holder reads "not ready" (store-buffering is forbidden across
// __threadfence), so either the writer publishes or the holder loops and does.
__device__ void try_publish_sq(const gio_launch_params& params, gio_nvme_qp* qp) {
    gio_nvme_slot* slots = device_pointer<gio_nvme_slot>(qp->slots);
    const uint32_t depth = qp->sq_depth;
    const uint32_t mask = depth - 1;
    // A few rounds suffice: another round is needed only when a slot turned ready while we held the
    // lock; anything left over is published by the next caller (every poll iteration calls this).
    for (uint32_t round = 0; round < kPublishRoundsMax; ++round) {
        if (!try_lock(&qp->sq_lock)) {
            return;
        }
        // A faulted controller gets no more commands: its ready slots stay unpublished, and their
        // IOCBs end as CONTROLLER_FAULT (end_launch), since no completion of the pair is accepted.
        if (queue_pair_faulted(qp)) {
            unlock(&qp->sq_lock);
            return;
        }
        const uint32_t head = load_volatile(&qp->sq_head);
        const uint32_t published = load_volatile(&qp->sq_tail);
        uint32_t tail = published;
        bool queue_full = false;
        // Bounded by the depth: at most depth - 1 commands are outstanding at the controller.
        for (uint32_t scanned = 0; scanned < depth; ++scanned) {
            if (load_volatile(&slots[tail & mask].ready_ticket) != tail + 1) {
                break;
            }
            if (tail + 1 - head > depth - 1) {
                queue_full = true;  // back-pressure: publish later, after completions move head
                break;
            }
            ++tail;
        }
        if (tail != published) {
            store_volatile(&qp->sq_tail, tail);
            // The SQEs were fenced by their writers; this orders our reads of their ready flags
            // (and so the SQEs) before the MMIO doorbell write the controller acts on.
            __threadfence_system();
            store_volatile(device_pointer<uint32_t>(qp->sq_doorbell), tail & mask);
        }
        unlock(&qp->sq_lock);
        __threadfence();
        if (queue_full || load_volatile(&slots[tail & mask].ready_ticket) != tail + 1) {
            return;
        }
    }
}

// ---- NVMe queue pair: completion reaping ----

// Applies one NVMe completion and returns gio_completion_verdict's verdict on it. `*sq_head` is the
// reaper's free-running SQ head before this entry, and after it the head gio_sq_head_after gives:
// moved forward only (an entry posted out of creation order may carry an older SQHD), unchanged
// after a fault or an entry naming no ticket (its SQHD has no window to place it in).
// `claim_held`: the caller holds one claimed gio CQ entry; cleared if this completion used it.
__device__ uint32_t process_nvme_completion(const gio_launch_params& params, gio_nvme_qp* qp,
                                            uint16_t sq_id, uint16_t command_id, uint16_t sqhd,
                                            uint16_t status, uint32_t* sq_head, bool* claim_held) {
    gio_nvme_slot* slots = device_pointer<gio_nvme_slot>(qp->slots);
    gio_nvme_slot* slot = &slots[command_id & (qp->sq_depth - 1)];
    const uint32_t ticket = load_volatile(&slot->ticket);
    // Acquire: submit_ioctx stores the ticket last, after a fence, so the tracker fields read
    // below belong to the ticket read here, never to the slot's previous round.
    __threadfence();
    // The tail published to the controller, read after the entry (the caller's acquire fence):
    // try_publish_sq stores sq_tail and fences before it writes the doorbell, and the controller
    // can fetch, so report, an entry only after the doorbell covered it. Were the value ever
    // older, the verdict would only be stricter (a spurious fault and reset, never a wrong accept).
    const uint32_t sq_tail = load_volatile(&qp->sq_tail);
    // The command id carries the ticket's generation bits: a completion whose id does not match
    // the slot's current ticket, or for a ticket already completed, is not ours to count. One
    // naming another SQ, reporting an SQ head outside both [sq_head, sq_tail] and its live
    // ticket's own window (an SQHD behind sq_head is believed inside it: SQHD is the head when
    // the entry was created, and entries need not be posted in that order), or completing a
    // ticket not published or not fetched yet is a controller fault (the rule of nvme-driver's
    // reap): it completes nothing, its slot stays busy, and the launch's polling threads fail
    // every unfinished IOCB of the launch with GIO_IOCB_STATUS_CONTROLLER_FAULT, which makes the
    // host reset the queue pairs.
    const uint32_t verdict =
        gio_completion_verdict(load_volatile(&qp->controller_faults), sq_id, qp->qid, command_id, sqhd, ticket,
                               load_volatile(&slot->done_ticket), *sq_head, sq_tail, qp->sq_depth);
    // Judged with the same ticket and tail as the verdict: those read above, not reread.
    *sq_head = gio_sq_head_after(verdict, sqhd, ticket, *sq_head, sq_tail, qp->sq_depth);
    if (verdict == GIO_COMPLETION_PAIR_FAULTED) {
        return verdict;  // counted once already; try_reap_cq leaves the entry in the CQ
    }
    if (gio_completion_is_fault(verdict)) {
        atomicAdd(&qp->controller_faults, 1u);
        // Also when every IOCB is final already (the launch then ends with no CONTROLLER_FAULT
        // status): the pair stays faulted until the host resets it.
        request_queue_pair_reset(params);
        return verdict;
    }
    if (verdict != GIO_COMPLETION_ACCEPT) {
        atomicAdd(&qp->unexpected_completions, 1u);
        return verdict;
    }
    const uint32_t iocb_id = load_volatile(&slot->iocb_id);
    const uint32_t ioctx_index = load_volatile(&slot->ioctx_index);
    const uint32_t issue_seq = load_volatile(&slot->issue_seq);
    __threadfence();
    store_volatile(&slot->done_ticket, ticket + 1);  // the slot may now be reused
    if (iocb_id >= params.iocb_capacity) {
        atomicAdd(&qp->unexpected_completions, 1u);
        return verdict;
    }
    gio_iocb* iocb = &device_pointer<gio_iocb>(params.iocbs)[iocb_id];
    // A completion of an issue that already timed out and was reissued must not count.
    if (load_volatile(&iocb->issue_seq) != issue_seq) {
        return verdict;
    }
    const bool failed = (status & NVME_CQE_STATUS_SC_SCT_MASK) != 0;
    if (complete_ioctx(params, iocb, ioctx_index, failed ? GIO_IOCB_STATUS_NVME_ERROR : 0u, status,
                       CqeClaim::kHeld)) {
        *claim_held = false;
    }
    return verdict;
}

// Reaps the completions posted so far (at most one queue's worth per call), then writes the CQ
// head doorbell once for the batch.
__device__ void try_reap_cq(const gio_launch_params& params, gio_nvme_qp* qp) {
    if (!try_lock(&qp->cq_lock)) {
        return;
    }
    // Faults are counted under this lock (process_nvme_completion), so a reaper that takes it after
    // a fault sees the count: it consumes nothing more and writes no head doorbell. The entries stay
    // in the CQ for the host's reset; the launch's pollers end its IOCBs as CONTROLLER_FAULT.
    if (queue_pair_faulted(qp)) {
        unlock(&qp->cq_lock);
        return;
    }
    const nvme_cqe* entries = device_pointer<const nvme_cqe>(qp->cq_entries);
    const uint32_t cq_depth = qp->cq_depth;
    uint32_t head = load_volatile(&qp->cq_head);
    uint32_t sq_head = load_volatile(&qp->sq_head);
    const uint32_t first = head;
    bool claim_held = false;
    for (uint32_t reaped = 0; reaped < cq_depth; ++reaped) {
        const nvme_cqe* entry = &entries[head & (cq_depth - 1)];
        const uint16_t status = load_volatile(&entry->status);
        const uint32_t expected_phase = ((head / cq_depth) & 1u) ^ 1u;
        if ((status & NVME_CQE_STATUS_PHASE) != expected_phase) {
            break;
        }
        // Any completion may be the one that ends an IOCB: hold a gio CQ entry for it before
        // consuming it. With the gio CQ full, leave it in the NVMe CQ and let go of cq_lock; the
        // next reap retries (we never wait for space while holding the lock).
        if (!claim_held) {
            claim_held = try_claim_cqe(params);
            if (!claim_held) {
                break;
            }
        }
        // Acquire: read the rest of the entry only after seeing its phase tag flip.
        __threadfence_system();
        const uint16_t sq_id = load_volatile(&entry->sq_id);
        const uint16_t command_id = load_volatile(&entry->command_id);
        const uint16_t sqhd = load_volatile(&entry->sq_head);
        const uint32_t verdict =
            process_nvme_completion(params, qp, sq_id, command_id, sqhd, status, &sq_head, &claim_held);
        if (verdict == GIO_COMPLETION_PAIR_FAULTED) {
            break;  // not consumed: nothing the faulted controller posts is applied
        }
        ++head;  // consumed either way, so the phase tag logic stays in step with the controller
        if (gio_completion_is_fault(verdict)) {
            break;  // its SQ head was not applied; the fault ends the launch (see above)
        }
    }
    if (head != first) {
        store_volatile(&qp->cq_head, head);
        store_volatile(&qp->sq_head, sq_head);
        // Our reads of the entries happen before the controller may overwrite them.
        __threadfence_system();
        store_volatile(device_pointer<uint32_t>(qp->cq_doorbell), head & (cq_depth - 1));
    }
    unlock(&qp->cq_lock);
    if (claim_held) {
        release_cqe_claim(params);
    }
}

__device__ void help_all_queue_pairs(const gio_launch_params& params) {
    gio_nvme_qp* qps = device_pointer<gio_nvme_qp>(params.nvme_qps);
    for (uint32_t device = 0; device < params.device_count; ++device) {
        try_reap_cq(params, &qps[device]);
        try_publish_sq(params, &qps[device]);
    }
}

// ---- submission ----

// Writes the SQE for `ticket` and marks its slot ready. Returns 0, or the status the IOCTX fails
// with: TIMEOUT if the slot did not become free within the bounded wait, CONTROLLER_FAULT if the
// queue pair's controller faulted meanwhile (its completions, so the slot's, will never be trusted).
__device__ uint32_t submit_ioctx(const gio_launch_params& params, gio_nvme_qp* qp, uint32_t ticket,
                             const gio_iocb* iocb, uint32_t ioctx_index, const gio_ioctx& ioctx,
                             uint8_t opcode, const gio_ioctx_target& at) {
    gio_nvme_slot* slot = &device_pointer<gio_nvme_slot>(qp->slots)[ticket & (qp->sq_depth - 1)];
    // The slot is free once the previous round's ticket (ticket - depth) was completed.
    const uint32_t previous_done = ticket + 1 - qp->sq_depth;
    Backoff backoff(params.backoff_ns_max);
    uint32_t attempt = 0;
    while (load_volatile(&slot->done_ticket) != previous_done) {
        if (queue_pair_faulted(qp)) {
            return GIO_IOCB_STATUS_CONTROLLER_FAULT;
        }
        if (++attempt >= params.poll_iterations_max || deadline_passed()) {
            return GIO_IOCB_STATUS_TIMEOUT;
        }
        help_all_queue_pairs(params);  // whoever waits also drives completions: no deadlock
        backoff.pause();
    }
    // Acquire, pairing with process_nvme_completion's fence before its done_ticket store: the
    // previous round's reaper read this slot's tracker before it freed the slot, so the SQE and
    // tracker writes below must not be ordered before the load that saw done_ticket; without the
    // fence that reaper could read this round's fields as its own.
    __threadfence();
    // Also when the slot was free at once (the loop above never ran its check): no SQE is written
    // for a faulted controller, whose completion of it would never be accepted.
    if (queue_pair_faulted(qp)) {
        return GIO_IOCB_STATUS_CONTROLLER_FAULT;
    }

    // submit_chunk applied the IOCTX command rule (gio_ioctx_command): the opcode is Read or
    // Write, block_count is in 1..=GIO_IOCTX_BLOCK_COUNT_MAX and the addresses did not wrap.
    const uint64_t lba = at.lba;
    const uint64_t data = at.data_iova;
    const uint64_t desc = at.desc_iova;

    alignas(16) nvme_sqe sqe = {};
    sqe.opcode = opcode;
    sqe.command_id = static_cast<uint16_t>(gio_command_id(ticket));  // never FFFFh
    sqe.nsid = ioctx.nsid;
    if (ioctx.descriptor_kind == GIO_DESCRIPTOR_SGL) {
        sqe.flags = static_cast<uint8_t>(NVME_PSDT_SGL_MPTR_CONTIGUOUS << NVME_PSDT_SHIFT);
        if (desc == 0) {
            sqe.dptr.sgl1.address = data;
            sqe.dptr.sgl1.length_bytes = ioctx.data_bytes;
            sqe.dptr.sgl1.identifier =
                static_cast<uint8_t>(NVME_SGL_TYPE_DATA_BLOCK << 4 | NVME_SGL_SUBTYPE_ADDRESS);
        } else {
            sqe.dptr.sgl1.address = desc;
            sqe.dptr.sgl1.length_bytes = ioctx.desc_bytes;
            sqe.dptr.sgl1.identifier =
                static_cast<uint8_t>(NVME_SGL_TYPE_LAST_SEGMENT << 4 | NVME_SGL_SUBTYPE_ADDRESS);
        }
    } else {  // GIO_DESCRIPTOR_PRP: submit_chunk let through only kinds the rule accepts
        sqe.flags = static_cast<uint8_t>(NVME_PSDT_PRP << NVME_PSDT_SHIFT);
        sqe.dptr.prp.prp1 = data;
        sqe.dptr.prp.prp2 = desc;
    }
    sqe.cdw10 = static_cast<uint32_t>(lba);
    sqe.cdw11 = static_cast<uint32_t>(lba >> 32);
    sqe.cdw12 = (ioctx.block_count - 1u) |
                ((ioctx.flags & GIO_IOCTX_FLAG_FUA) != 0 ? NVME_RW_CDW12_FUA : 0u);

    // Four 16-byte stores of the 64-byte entry (SQ entries are 64-byte aligned).
    const uint4* source = reinterpret_cast<const uint4*>(&sqe);
    uint4* target = reinterpret_cast<uint4*>(
        &device_pointer<nvme_sqe>(qp->sq_entries)[ticket & (qp->sq_depth - 1)]);
#pragma unroll
    for (int part = 0; part < 4; ++part) {
        target[part] = source[part];
    }
    store_volatile(&slot->iocb_id, iocb->id);
    store_volatile(&slot->ioctx_index, ioctx_index);
    store_volatile(&slot->issue_seq, iocb->issue_seq);
    // Release: the ticket last, so a reaper that reads this ticket (and fences) reads this
    // round's tracker, never the previous round's (process_nvme_completion).
    __threadfence();
    store_volatile(&slot->ticket, ticket);
    // Publish: the SQE and the tracker are visible system-wide (the controller reads the SQE over
    // PCIe) before the slot reads ready.
    __threadfence_system();
    store_volatile(&slot->ready_ticket, ticket + 1);
    __threadfence();
    return 0;
}

// One warp's chunk: up to 32 IOCTXs of one IOCB, one per lane.
__device__ void submit_chunk(const gio_launch_params& params, gio_iocb* iocb, uint32_t chunk) {
    const uint32_t lane = threadIdx.x % kWarpLanes;
    const uint32_t count = iocb->ioctx_count;
    const uint32_t index = chunk * kWarpLanes + lane;
    const bool active = index < count;
    const uint32_t array_index = iocb->ioctx_first + index;
    gio_ioctx ioctx = {};
    gio_ioctx_target target = {};
    // Read once: the command rule checks this value, and this value is what the SQE carries.
    const uint8_t opcode = *reinterpret_cast<const volatile uint8_t*>(&iocb->opcode);
    bool valid = false;
    if (active) {
        if (array_index < params.ioctx_capacity) {
            ioctx = device_pointer<const gio_ioctx>(params.ioctxs)[array_index];
            // The one IOCTX command rule of gio_kernel_rules.h (opcode, block count, descriptor
            // kind, per-layer addresses without wrapping): what it refuses is refused here, as the
            // CPU executor refuses it, and never built into a command.
            gio_iocb rule_iocb = {};
            rule_iocb.opcode = opcode;
            rule_iocb.layer = iocb->layer;
            rule_iocb.lba_stride_blocks = iocb->lba_stride_blocks;
            rule_iocb.mem_stride_bytes = iocb->mem_stride_bytes;
            rule_iocb.desc_stride_bytes = iocb->desc_stride_bytes;
            valid = ioctx.device_index < params.device_count &&
                    gio_ioctx_command(&rule_iocb, &ioctx, &target);
        }
        if (!valid) {
            complete_ioctx(params, iocb, index, GIO_IOCB_STATUS_INVALID_IOCTX, 0, CqeClaim::kWait);
        }
    }
    const uint32_t valid_lanes = __ballot_sync(kFullMask, valid);
    if (valid) {
        // Lanes of the same device share one reservation: one atomicAdd per device in the warp.
        const uint32_t group = __match_any_sync(valid_lanes, static_cast<uint32_t>(ioctx.device_index));
        const uint32_t leader = static_cast<uint32_t>(__ffs(group)) - 1;
        const uint32_t rank = static_cast<uint32_t>(__popc(group & ((1u << lane) - 1u)));
        gio_nvme_qp* qp = &device_pointer<gio_nvme_qp>(params.nvme_qps)[ioctx.device_index];
        uint32_t base = 0;
        if (lane == leader) {
            base = atomicAdd(&qp->sq_reserved, static_cast<uint32_t>(__popc(group)));
        }
        base = __shfl_sync(group, base, static_cast<int>(leader));
        const uint32_t failure = submit_ioctx(params, qp, base + rank, iocb, index, ioctx, opcode, target);
        if (failure != 0) {
            // Ticket base + rank was reserved and its SQE never written: try_publish_sq stops
            // before it for good. Only a reset clears that, even if this IOCB ends with another
            // IOCTX's NVMe error (first failure wins) rather than this TIMEOUT.
            request_queue_pair_reset(params);
            complete_ioctx(params, iocb, index, failure, 0, CqeClaim::kWait);
        }
        __syncwarp(group);
        if (lane == leader) {
            try_publish_sq(params, qp);
        }
    }
    __syncwarp(kFullMask);
}

__device__ bool launch_finished(const gio_launch_params& params) {
    const uint32_t* sq = device_pointer<const uint32_t>(params.sq_entries);
    gio_iocb* iocbs = device_pointer<gio_iocb>(params.iocbs);
    for (uint32_t i = 0; i < params.iocb_count; ++i) {
        const uint32_t id = sq[(params.sq_first + i) & params.sq_mask];
        if (id < params.iocb_capacity && load_volatile(&iocbs[id].status) == GIO_IOCB_STATUS_ISSUED) {
            return false;
        }
    }
    return true;
}

__device__ bool any_queue_pair_faulted(const gio_launch_params& params) {
    gio_nvme_qp* qps = device_pointer<gio_nvme_qp>(params.nvme_qps);
    for (uint32_t device = 0; device < params.device_count; ++device) {
        if (queue_pair_faulted(&qps[device])) {
            return true;
        }
    }
    return false;
}

// Finishes every IOCB of the launch that is still ISSUED with `status`: TIMEOUT when the bounded
// wait expired (its CQEs are posted only if the gio CQ has room now), CONTROLLER_FAULT when a
// controller posted a completion naming another SQ (they may wait for room, bounded).
__device__ void end_launch(const gio_launch_params& params, uint32_t status, CqeClaim claim) {
    const uint32_t* sq = device_pointer<const uint32_t>(params.sq_entries);
    gio_iocb* iocbs = device_pointer<gio_iocb>(params.iocbs);
    for (uint32_t i = 0; i < params.iocb_count; ++i) {
        const uint32_t id = sq[(params.sq_first + i) & params.sq_mask];
        if (id < params.iocb_capacity && load_volatile(&iocbs[id].status) == GIO_IOCB_STATUS_ISSUED) {
            finalize_iocb(params, &iocbs[id], status, claim);
        }
    }
}

}  // namespace

extern "C" __global__ void gio_io_kernel(gio_launch_params params) {
    // One deadline for every wait of this block (see the top of the file). The budget fits 64
    // bits (< 2^64); the sum saturates, since %globaltimer may count from the Unix epoch.
    if (threadIdx.x == 0) {
        // The backoff cap as Backoff clamps it (>= 32 ns), so a zero cap is no zero budget.
        const uint32_t backoff_ns = params.backoff_ns_max < 32 ? 32 : params.backoff_ns_max;
        const uint64_t budget_ns = static_cast<uint64_t>(params.poll_iterations_max) * backoff_ns;
        const uint64_t now_ns = global_time_ns();
        block_deadline_ns = now_ns > ~0ull - budget_ns ? ~0ull : now_ns + budget_ns;
    }
    __syncthreads();
    const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpLanes;
    const uint32_t warp_count = (gridDim.x * blockDim.x) / kWarpLanes;
    const uint32_t* sq = device_pointer<const uint32_t>(params.sq_entries);
    gio_iocb* iocbs = device_pointer<gio_iocb>(params.iocbs);

    // Submission: chunk k of the launch (counting over IOCBs in SQ order) goes to warp k % warps.
    uint32_t chunk_base = 0;
    for (uint32_t i = 0; i < params.iocb_count; ++i) {
        const uint32_t id = sq[(params.sq_first + i) & params.sq_mask];
        if (id >= params.iocb_capacity) {
            continue;  // the CPU validates ids; a bad one has no IOCB to report on
        }
        gio_iocb* iocb = &iocbs[id];
        const uint32_t count = iocb->ioctx_count;
        const uint32_t chunks = (count + kWarpLanes - 1) / kWarpLanes;
        uint32_t chunk = (warp + warp_count - chunk_base % warp_count) % warp_count;
        for (; chunk < chunks; chunk += warp_count) {
            submit_chunk(params, iocb, chunk);
        }
        chunk_base += chunks;
    }

    // Completion: one lane of warp 0 per block polls until the launch is done or the bound hits.
    if (threadIdx.x != 0) {
        return;
    }
    Backoff backoff(params.backoff_ns_max);
    for (uint32_t iteration = 0; iteration < params.poll_iterations_max; ++iteration) {
        help_all_queue_pairs(params);
        if (launch_finished(params)) {
            return;
        }
        if (deadline_passed()) {
            break;
        }
        // A controller fault ends the launch now rather than at the deadline: the IOCTX whose
        // completion it garbled would otherwise only end as a timeout.
        if (any_queue_pair_faulted(params)) {
            end_launch(params, GIO_IOCB_STATUS_CONTROLLER_FAULT, CqeClaim::kWait);
            return;
        }
        backoff.pause();
    }
    end_launch(params, GIO_IOCB_STATUS_TIMEOUT, CqeClaim::kTryOnce);
}
