/*
 * gio_uring ABI: the single definition of the memory that the CPU runtime and an I/O executor (the
 * CUDA I/O kernel, or CPU worker threads playing its part) share. Rust bindings are generated from
 * this file by bindgen (crates/gio-uring/src/abi/bindings.rs, checked by tools/check-bindings.sh).
 *
 * Rules for this file:
 *  - fixed-width integer types only; addresses are uint64_t device-visible addresses (IOVAs or GPU
 *    virtual addresses), never pointers, so the layout is the same for every compiler and side;
 *  - every hole is an explicit reserved field, every size and offset is asserted below;
 *  - it compiles as C11, C++ and CUDA C++ (tools/cuda-build.sh checks all three).
 *
 * Protocol (see docs/gio-uring.md):
 *  1. init_queue(depth) allocates `depth` IOCBs, their IOCTX array, an SQ and a CQ of `depth` entries.
 *  2. The CPU fills IOCBs and IOCTXs once per request, then per layer writes `layer`, `issue_seq`,
 *     resets the executor-owned line, pushes the IOCB ids onto the SQ and publishes the SQ tail
 *     (release). The executor reads IOCBs only after an acquire load of that tail.
 *  3. The executor turns each IOCTX into one NVMe command, counts completions per IOCB, and when the
 *     last IOCTX of an IOCB completes it moves `status` off ISSUED with a compare-and-swap (so exactly
 *     one CQE is produced per issue) and publishes a gio_cqe on the CQ with release semantics.
 */
#ifndef TUTTI_GIO_ABI_H
#define TUTTI_GIO_ABI_H

#include <stddef.h>
#include <stdint.h>

#if defined(__cplusplus)
#define GIO_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define GIO_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif

/* Bumped on any layout change; the Rust side asserts it matches. */
#define GIO_ABI_VERSION 3u

/* Upper bound of IOCTXs in one IOCB: two H100 SMs of 64 warps x 32 threads, halved for register
 * pressure (Tutti §3.2). One IOCTX is one NVMe command. */
#define GIO_MAX_IOCTX_PER_IOCB 2048u
#define GIO_CACHE_LINE_BYTES 64u
/* The largest ring depth (entries, a power of two). */
#define GIO_RING_DEPTH_MAX 65536u

/* gio_iocb.opcode: the NVMe opcode of every IOCTX in the IOCB. */
#define GIO_OPCODE_WRITE 0x01u
#define GIO_OPCODE_READ 0x02u

/* gio_iocb.status (32-bit for atomicCAS) and gio_cqe.status. */
#define GIO_IOCB_STATUS_IDLE 0u          /* never issued, or reset by the CPU */
#define GIO_IOCB_STATUS_ISSUED 1u        /* owned by the executor */
#define GIO_IOCB_STATUS_SUCCESS 2u       /* every IOCTX completed with NVMe status 0 */
#define GIO_IOCB_STATUS_NVME_ERROR 3u    /* failed_ioctx completed with failed_nvme_status */
#define GIO_IOCB_STATUS_INVALID_IOCTX 4u /* the executor refused failed_ioctx (bad device index or kind) */
#define GIO_IOCB_STATUS_TIMEOUT 5u       /* a bounded wait in the executor expired */
#define GIO_IOCB_STATUS_CONTROLLER_FAULT 6u /* a controller posted an impossible completion
                                              * (another SQ, an SQ head outside what was published,
                                              * an unfetched command; gio_completion_verdict):
                                              * nothing it reports is trusted until the host resets
                                              * the queue pairs (like TIMEOUT, a reset is required) */

/* gio_iocb.failed_ioctx when nothing failed. */
#define GIO_NO_FAILED_IOCTX 0xFFFFFFFFu

/* gio_ioctx.descriptor_kind. */
#define GIO_DESCRIPTOR_SGL 0u /* desc_iova: 0 = one SGL Data Block (data_iova, data_bytes) inline in
                               * the SQE; else a Last Segment of desc_bytes bytes of descriptors */
#define GIO_DESCRIPTOR_PRP 1u /* PRP1 = data_iova, PRP2 = desc_iova (second page or PRP list) */
/* The valid kinds are exactly 0 .. GIO_DESCRIPTOR_KIND_COUNT - 1; see gio_descriptor_kind_is_valid. */
#define GIO_DESCRIPTOR_KIND_COUNT 2u

/* gio_ioctx.flags. */
#define GIO_IOCTX_FLAG_FUA 0x01u /* Force Unit Access on the NVMe command */
#define GIO_IOCTX_FLAGS_KNOWN 0x01u

/* Rules shared by every side, as plain functions: `static inline` in C and C++, also callable from
 * device code under nvcc. bindgen does not translate them; the Rust side mirrors each one next to
 * its constants (crates/gio-uring/src/abi/mod.rs) and tests/gpu_rules.rs compiles this header with
 * the system C compiler and compares the two over the whole input domain. */
#if defined(__CUDACC__)
#define GIO_RULE static __host__ __device__ __forceinline__
#else
#define GIO_RULE static inline
#endif

/*
 * The descriptor-kind rule: an IOCTX whose descriptor_kind is not one of the GIO_DESCRIPTOR_*
 * values is invalid. Every executor refuses it (the IOCTX fails with GIO_IOCB_STATUS_INVALID_IOCTX
 * and no command is built): no executor may read an unknown kind as PRP or SGL.
 */
GIO_RULE int gio_descriptor_kind_is_valid(uint32_t descriptor_kind) {
    return descriptor_kind < GIO_DESCRIPTOR_KIND_COUNT;
}

/*
 * One I/O context = one NVMe read or write, 48 bytes. Written by the CPU when the request is
 * prepared; read-only to the executor. For layer L of an IOCB, the executor uses
 *   start_lba + L * iocb.lba_stride_blocks,  data_iova + L * iocb.mem_stride_bytes,
 *   desc_iova + L * iocb.desc_stride_bytes  (desc_iova != 0 only),
 * so a request is prepared once and reissued for every layer.
 */
typedef struct gio_ioctx {
    uint64_t desc_iova;      /* device address of the SGL segment or PRP list/second page; 0 = none */
    uint64_t data_iova;      /* device address of the first data byte (PRP1 / first data block) */
    uint64_t start_lba;      /* first logical block on the namespace */
    uint32_t nsid;           /* NVMe namespace id */
    uint32_t block_count;    /* logical blocks, 1..=65536 (NLB is 0-based in the SQE) */
    uint32_t data_bytes;     /* bytes transferred = block_count x LBA size */
    uint32_t desc_bytes;     /* bytes of SGL descriptors at desc_iova (SGL segment only) */
    uint16_t device_index;   /* index into the executor's NVMe device (queue pair) table */
    uint8_t descriptor_kind; /* GIO_DESCRIPTOR_* */
    uint8_t flags;           /* GIO_IOCTX_FLAG_* */
    uint32_t reserved0;
} gio_ioctx;

/*
 * An I/O control block, 128 bytes: line 0 is written by the CPU before issue and read-only to the
 * executor; line 1 is written by the executor while status == ISSUED. Separate lines keep the
 * executor's counter updates from bouncing the CPU-written line.
 */
typedef struct gio_iocb {
    /* line 0: CPU-owned */
    uint32_t id;                 /* index of this IOCB in the pool (checked against its position) */
    uint32_t ioctx_count;        /* IOCTXs in use, 1..=GIO_MAX_IOCTX_PER_IOCB */
    uint32_t ioctx_first;        /* index of its first IOCTX in the shared IOCTX array */
    uint32_t layer_count;        /* layers the offset rule was validated for */
    uint32_t layer;              /* layer of the current issue, < layer_count */
    uint32_t issue_seq;          /* bumped on every issue; stale NVMe completions are recognised */
    uint8_t opcode;              /* GIO_OPCODE_* */
    uint8_t reserved0[7];
    uint64_t user_data;          /* opaque to the executor, returned with the completion */
    uint64_t lba_stride_blocks;  /* per-layer offset on the LBA side */
    uint64_t mem_stride_bytes;   /* per-layer offset of data_iova */
    uint64_t desc_stride_bytes;  /* per-layer offset of desc_iova */
    /* line 1: executor-owned while ISSUED */
    uint32_t status;                /* GIO_IOCB_STATUS_* */
    uint32_t completed_ioctx_count; /* IOCTXs completed in this issue, success or not */
    uint32_t failed_ioctx;          /* index (within the IOCB) of the first failure, or GIO_NO_FAILED_IOCTX */
    uint16_t failed_nvme_status;    /* CQE status field of that failure, phase bit cleared (SCT/SC/DNR) */
    uint16_t failed_status;         /* GIO_IOCB_STATUS_* the IOCB ends with because of that failure */
    uint8_t reserved1[48];
} gio_iocb;

/* A gio CQ entry, 16 bytes: one per issued IOCB. */
typedef struct gio_cqe {
    uint32_t iocb_id;
    uint32_t issue_seq;          /* gio_iocb.issue_seq of the issue this completes */
    uint32_t failed_ioctx;       /* GIO_NO_FAILED_IOCTX on success */
    uint16_t status;             /* GIO_IOCB_STATUS_* (never IDLE or ISSUED) */
    uint16_t failed_nvme_status; /* as gio_iocb.failed_nvme_status */
} gio_cqe;

/*
 * Ring header, 256 bytes; the entries follow in a separate array of `entry_count` elements
 * (uint32_t IOCB ids for the SQ, gio_cqe for the CQ). head and tail are free-running 32-bit counters
 * (position = counter & mask); each sits on its own cache line so producer and consumer do not
 * share a line. The producer publishes tail with release, the consumer head with release; each
 * reads the other's counter with acquire.
 */
typedef struct gio_ring_header {
    uint32_t head;          /* written by the consumer */
    uint8_t reserved0[60];
    uint32_t tail;          /* written by the producer */
    uint8_t reserved1[60];
    uint32_t mask;          /* entry_count - 1 */
    uint32_t entry_count;   /* a power of two, <= GIO_RING_DEPTH_MAX */
    uint8_t reserved2[56];
    uint32_t producer_lock; /* serialises many producers (GPU threads); 0 = free */
    uint32_t producer_claimed; /* entries published or claimed by GPU producers (free-running);
                                * a producer claims space before it needs it, so nobody waits for
                                * space while holding a lock; equals tail when no claim is open */
    uint32_t overflow_count;   /* CQEs a GPU producer could not post (the ring stayed full past
                                * its wait): the IOCB's final status is in memory, only the entry
                                * is missing; the host reads this and must not wait for them */
    uint32_t reset_requests;   /* bumped by the GPU executor's kernel whenever it leaves an NVMe
                                * queue pair in a state only a reset clears, whatever the IOCBs'
                                * statuses say: a reserved SQ ticket abandoned before its entry was
                                * written (no later tail passes it), a controller fault
                                * (controller_faults). The host resets the queue pairs when it
                                * differs from the value it last saw after a reset (free-running) */
    uint8_t reserved3[48];
} gio_ring_header;

/*
 * Per-slot tracker of an NVMe submission queue driven by the I/O kernel, 32 bytes. ticket is the
 * free-running SQ reservation number; the NVMe command id is gio_command_id(ticket)
 * (gio_kernel_rules.h): ticket & 0xFFFF, so slot = cid & mask and the upper bits are a generation
 * that tells a stale completion apart, except that it is never FFFFh (the top slot's last
 * generation carries 7FFFh). The host refuses queue pairs deeper than 16384 (GIO_SQ_DEPTH_MAX,
 * gpu::plan::GPU_QUEUE_DEPTH_MAX), which leaves each slot four generations, so that moved id still
 * differs from its slot's previous and next rounds.
 * The CPU initialises ready_ticket and done_ticket of slot s to s + 1 - sq_depth and ticket to
 * s - sq_depth (mod 2^32): "the previous round of this slot is complete", so no completion is
 * accepted for the slot before its first submission.
 */
typedef struct gio_nvme_slot {
    uint32_t ready_ticket; /* ticket + 1 once the SQE for ticket is written and fenced */
    uint32_t done_ticket;  /* ticket + 1 once the completion for ticket was processed */
    uint32_t ticket;       /* ticket occupying the slot */
    uint32_t iocb_id;
    uint32_t ioctx_index;  /* within the IOCB */
    uint32_t issue_seq;    /* gio_iocb.issue_seq when submitted */
    uint32_t reserved0[2];
} gio_nvme_slot;

/*
 * One NVMe queue pair as the I/O kernel sees it, 320 bytes, in memory the GPU reaches. Line 0 is set
 * once by the CPU; the other lines are the kernel's own state, each on its own cache line.
 */
typedef struct gio_nvme_qp {
    uint64_t sq_entries;   /* device address of nvme_sqe[sq_depth] */
    uint64_t cq_entries;   /* device address of nvme_cqe[cq_depth] */
    uint64_t sq_doorbell;  /* device address of the SQ y Tail Doorbell register (BAR0) */
    uint64_t cq_doorbell;  /* device address of the CQ y Head Doorbell register (BAR0) */
    uint64_t slots;        /* device address of gio_nvme_slot[sq_depth] */
    uint32_t sq_depth;     /* a power of two, 2..=16384 (command ids keep generation bits) */
    uint32_t cq_depth;     /* a power of two, 2..=32768 */
    uint32_t qid;          /* NVMe SQ id: every completion on this pair must name it (CQE SQID) */
    uint32_t reserved0[3];
    /* line 1: reservation counter, one atomicAdd per warp */
    uint32_t sq_reserved;
    uint8_t reserved1[60];
    /* line 2: tail publication, guarded by sq_lock */
    uint32_t sq_lock;
    uint32_t sq_tail;      /* free-running tail last written to the doorbell */
    uint8_t reserved2[56];
    /* line 3: controller progress, from the SQHD field of completions */
    uint32_t sq_head;      /* free-running */
    uint32_t unexpected_completions; /* CQEs whose command id matched nothing in flight */
    uint32_t controller_faults;      /* CQEs naming another SQ, with an impossible SQ head or
                                      * completing an unfetched command (gio_completion_verdict);
                                      * non-zero fails the launch's IOCBs
                                      * and ends all use of the pair until the host resets it */
    uint8_t reserved3[52];
    /* line 4: completion polling, guarded by cq_lock */
    uint32_t cq_lock;
    uint32_t cq_head;      /* free-running; phase expected = ((cq_head / cq_depth) & 1) ^ 1 */
    uint8_t reserved4[56];
} gio_nvme_qp;

/* Arguments of one I/O kernel launch (one issue_io), passed by value, 80 bytes. */
typedef struct gio_launch_params {
    uint64_t iocbs;         /* device address of gio_iocb[iocb_capacity] */
    uint64_t ioctxs;        /* device address of gio_ioctx[ioctx_capacity] */
    uint64_t sq_entries;    /* device address of the gio SQ's uint32_t entries */
    uint64_t cq_header;     /* device address of the gio CQ's gio_ring_header */
    uint64_t cq_entries;    /* device address of the gio CQ's gio_cqe entries */
    uint64_t nvme_qps;      /* device address of gio_nvme_qp[device_count] */
    uint32_t sq_first;      /* free-running SQ position of the first IOCB id of this launch */
    uint32_t iocb_count;    /* IOCB ids in this launch */
    uint32_t sq_mask;       /* gio SQ entry_count - 1 */
    uint32_t iocb_capacity; /* ids at or above are ignored */
    uint32_t ioctx_capacity;
    uint32_t device_count;
    uint32_t poll_iterations_max; /* bound on every wait in the kernel */
    uint32_t backoff_ns_max;      /* cap of the exponential __nanosleep backoff */
} gio_launch_params;

GIO_STATIC_ASSERT(sizeof(gio_ioctx) == 48, "gio_ioctx is 48 bytes");
GIO_STATIC_ASSERT(offsetof(gio_ioctx, desc_iova) == 0, "gio_ioctx.desc_iova");
GIO_STATIC_ASSERT(offsetof(gio_ioctx, data_iova) == 8, "gio_ioctx.data_iova");
GIO_STATIC_ASSERT(offsetof(gio_ioctx, start_lba) == 16, "gio_ioctx.start_lba");
GIO_STATIC_ASSERT(offsetof(gio_ioctx, nsid) == 24, "gio_ioctx.nsid");
GIO_STATIC_ASSERT(offsetof(gio_ioctx, block_count) == 28, "gio_ioctx.block_count");
GIO_STATIC_ASSERT(offsetof(gio_ioctx, data_bytes) == 32, "gio_ioctx.data_bytes");
GIO_STATIC_ASSERT(offsetof(gio_ioctx, desc_bytes) == 36, "gio_ioctx.desc_bytes");
GIO_STATIC_ASSERT(offsetof(gio_ioctx, device_index) == 40, "gio_ioctx.device_index");
GIO_STATIC_ASSERT(offsetof(gio_ioctx, descriptor_kind) == 42, "gio_ioctx.descriptor_kind");
GIO_STATIC_ASSERT(offsetof(gio_ioctx, flags) == 43, "gio_ioctx.flags");

GIO_STATIC_ASSERT(sizeof(gio_iocb) == 2 * GIO_CACHE_LINE_BYTES, "gio_iocb is two cache lines");
GIO_STATIC_ASSERT(offsetof(gio_iocb, ioctx_count) == 4, "gio_iocb.ioctx_count");
GIO_STATIC_ASSERT(offsetof(gio_iocb, ioctx_first) == 8, "gio_iocb.ioctx_first");
GIO_STATIC_ASSERT(offsetof(gio_iocb, layer_count) == 12, "gio_iocb.layer_count");
GIO_STATIC_ASSERT(offsetof(gio_iocb, layer) == 16, "gio_iocb.layer");
GIO_STATIC_ASSERT(offsetof(gio_iocb, issue_seq) == 20, "gio_iocb.issue_seq");
GIO_STATIC_ASSERT(offsetof(gio_iocb, opcode) == 24, "gio_iocb.opcode");
GIO_STATIC_ASSERT(offsetof(gio_iocb, user_data) == 32, "gio_iocb.user_data");
GIO_STATIC_ASSERT(offsetof(gio_iocb, lba_stride_blocks) == 40, "gio_iocb.lba_stride_blocks");
GIO_STATIC_ASSERT(offsetof(gio_iocb, mem_stride_bytes) == 48, "gio_iocb.mem_stride_bytes");
GIO_STATIC_ASSERT(offsetof(gio_iocb, desc_stride_bytes) == 56, "gio_iocb.desc_stride_bytes");
GIO_STATIC_ASSERT(offsetof(gio_iocb, status) == GIO_CACHE_LINE_BYTES, "gio_iocb.status opens line 1");
GIO_STATIC_ASSERT(offsetof(gio_iocb, completed_ioctx_count) == 68, "gio_iocb.completed_ioctx_count");
GIO_STATIC_ASSERT(offsetof(gio_iocb, failed_ioctx) == 72, "gio_iocb.failed_ioctx");
GIO_STATIC_ASSERT(offsetof(gio_iocb, failed_nvme_status) == 76, "gio_iocb.failed_nvme_status");
GIO_STATIC_ASSERT(offsetof(gio_iocb, failed_status) == 78, "gio_iocb.failed_status");

GIO_STATIC_ASSERT(sizeof(gio_cqe) == 16, "gio_cqe is 16 bytes");
GIO_STATIC_ASSERT(offsetof(gio_cqe, issue_seq) == 4, "gio_cqe.issue_seq");
GIO_STATIC_ASSERT(offsetof(gio_cqe, failed_ioctx) == 8, "gio_cqe.failed_ioctx");
GIO_STATIC_ASSERT(offsetof(gio_cqe, status) == 12, "gio_cqe.status");
GIO_STATIC_ASSERT(offsetof(gio_cqe, failed_nvme_status) == 14, "gio_cqe.failed_nvme_status");

GIO_STATIC_ASSERT(sizeof(gio_ring_header) == 4 * GIO_CACHE_LINE_BYTES, "ring header is four lines");
GIO_STATIC_ASSERT(offsetof(gio_ring_header, head) == 0, "ring head on line 0");
GIO_STATIC_ASSERT(offsetof(gio_ring_header, tail) == 64, "ring tail on line 1");
GIO_STATIC_ASSERT(offsetof(gio_ring_header, mask) == 128, "ring mask on line 2");
GIO_STATIC_ASSERT(offsetof(gio_ring_header, entry_count) == 132, "ring entry_count");
GIO_STATIC_ASSERT(offsetof(gio_ring_header, producer_lock) == 192, "ring producer lock on line 3");
GIO_STATIC_ASSERT(offsetof(gio_ring_header, producer_claimed) == 196, "ring producer_claimed");
GIO_STATIC_ASSERT(offsetof(gio_ring_header, overflow_count) == 200, "ring overflow_count");
GIO_STATIC_ASSERT(offsetof(gio_ring_header, reset_requests) == 204, "ring reset_requests");

GIO_STATIC_ASSERT(sizeof(gio_nvme_slot) == 32, "gio_nvme_slot is 32 bytes");
GIO_STATIC_ASSERT(offsetof(gio_nvme_slot, ticket) == 8, "gio_nvme_slot.ticket");
GIO_STATIC_ASSERT(offsetof(gio_nvme_slot, issue_seq) == 20, "gio_nvme_slot.issue_seq");

GIO_STATIC_ASSERT(sizeof(gio_nvme_qp) == 5 * GIO_CACHE_LINE_BYTES, "gio_nvme_qp is five lines");
GIO_STATIC_ASSERT(offsetof(gio_nvme_qp, slots) == 32, "gio_nvme_qp.slots");
GIO_STATIC_ASSERT(offsetof(gio_nvme_qp, sq_depth) == 40, "gio_nvme_qp.sq_depth");
GIO_STATIC_ASSERT(offsetof(gio_nvme_qp, sq_reserved) == 64, "gio_nvme_qp.sq_reserved on line 1");
GIO_STATIC_ASSERT(offsetof(gio_nvme_qp, sq_lock) == 128, "gio_nvme_qp.sq_lock on line 2");
GIO_STATIC_ASSERT(offsetof(gio_nvme_qp, sq_tail) == 132, "gio_nvme_qp.sq_tail");
GIO_STATIC_ASSERT(offsetof(gio_nvme_qp, sq_head) == 192, "gio_nvme_qp.sq_head on line 3");
GIO_STATIC_ASSERT(offsetof(gio_nvme_qp, controller_faults) == 200, "gio_nvme_qp.controller_faults");
GIO_STATIC_ASSERT(offsetof(gio_nvme_qp, cq_lock) == 256, "gio_nvme_qp.cq_lock on line 4");
GIO_STATIC_ASSERT(offsetof(gio_nvme_qp, cq_head) == 260, "gio_nvme_qp.cq_head");

GIO_STATIC_ASSERT(sizeof(gio_launch_params) == 80, "gio_launch_params is 80 bytes");
GIO_STATIC_ASSERT(offsetof(gio_launch_params, sq_first) == 48, "gio_launch_params.sq_first");
GIO_STATIC_ASSERT(offsetof(gio_launch_params, backoff_ns_max) == 76, "gio_launch_params.backoff_ns_max");

#endif /* TUTTI_GIO_ABI_H */
