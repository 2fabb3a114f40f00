/*
 * NVMe submission and completion queue entries as the gio_uring I/O kernel builds and reads them.
 * NVM Express Base Specification 2.0, §4.2 (SQE, "Common Command Format"), §4.3.3 (SGL descriptors),
 * §4.6 (CQE), and the NVM Command Set Specification 1.0, §3.3.4 (Read) and §3.3.6 (Write).
 *
 * Only what the kernel needs. Plain fixed-width fields, explicit padding, sizes asserted. This
 * header has no dependency on gio_abi.h and can be included from C11, C++ and CUDA C++.
 */
#ifndef TUTTI_NVME_SPEC_H
#define TUTTI_NVME_SPEC_H

#include <stddef.h>
#include <stdint.h>

#if defined(__cplusplus)
#define NVME_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define NVME_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif

/* NVM command set opcodes (NVM Command Set Spec, Fig. 17). */
#define NVME_OPC_WRITE 0x01u
#define NVME_OPC_READ 0x02u

/* CDW0 bits 15:14, PRP or SGL for Data Transfer (Base Spec Fig. 91). */
#define NVME_PSDT_PRP 0x0u
#define NVME_PSDT_SGL_MPTR_CONTIGUOUS 0x1u
#define NVME_PSDT_SHIFT 6u /* within the flags byte (CDW0 bits 15:8) */

/* CDW12 of Read/Write: bit 30 Force Unit Access; bits 15:0 Number of Logical Blocks, 0-based. */
#define NVME_RW_CDW12_FUA (1u << 30)
#define NVME_RW_NLB_MAX 65536u

/* SGL descriptor identifier byte: type in bits 7:4, sub type in 3:0 (Base Spec Fig. 116-117). */
#define NVME_SGL_TYPE_DATA_BLOCK 0x0u
#define NVME_SGL_TYPE_SEGMENT 0x2u
#define NVME_SGL_TYPE_LAST_SEGMENT 0x3u
#define NVME_SGL_SUBTYPE_ADDRESS 0x0u
#define NVME_SGL_DESCRIPTOR_BYTES 16u

/* CQE status field (DW3 bits 31:16): bit 0 phase tag, bits 8:1 SC, 11:9 SCT, 15 DNR. */
#define NVME_CQE_STATUS_PHASE 0x1u
#define NVME_CQE_STATUS_SC_SHIFT 1u
#define NVME_CQE_STATUS_SCT_SHIFT 9u
#define NVME_CQE_STATUS_SC_SCT_MASK 0x0FFEu
/* Status with the phase tag removed; zero means "Successful Completion". */
#define NVME_CQE_STATUS_NO_PHASE_MASK 0xFFFEu

/* An SGL descriptor (16 bytes), here only the address form: Data Block, Segment, Last Segment. */
typedef struct nvme_sgl_descriptor {
    uint64_t address;
    uint32_t length_bytes;
    uint8_t reserved[3];
    uint8_t identifier; /* type << 4 | sub type */
} nvme_sgl_descriptor;

/* The data pointer (DPTR, CDW6-9): either PRP1/PRP2 or the first SGL descriptor. */
typedef union nvme_data_pointer {
    struct {
        uint64_t prp1;
        uint64_t prp2;
    } prp;
    nvme_sgl_descriptor sgl1;
} nvme_data_pointer;

/* Submission queue entry, 64 bytes (Base Spec §4.2, Fig. 88). */
typedef struct nvme_sqe {
    uint8_t opcode;        /* CDW0 7:0 */
    uint8_t flags;         /* CDW0 15:8: FUSE 1:0, PSDT 7:6 */
    uint16_t command_id;   /* CDW0 31:16 */
    uint32_t nsid;         /* CDW1 */
    uint32_t cdw2;
    uint32_t cdw3;
    uint64_t mptr;         /* CDW4-5, metadata pointer */
    nvme_data_pointer dptr; /* CDW6-9 */
    uint32_t cdw10;        /* Read/Write: starting LBA 31:0 */
    uint32_t cdw11;        /* Read/Write: starting LBA 63:32 */
    uint32_t cdw12;        /* Read/Write: NLB (0-based) 15:0, FUA 30, LR 31 */
    uint32_t cdw13;
    uint32_t cdw14;
    uint32_t cdw15;
} nvme_sqe;

/* Completion queue entry, 16 bytes (Base Spec §4.6, Fig. 98). */
typedef struct nvme_cqe {
    uint32_t dw0;          /* command specific */
    uint32_t dw1;          /* reserved for Read/Write */
    uint16_t sq_head;      /* SQHD: how far the controller consumed the SQ */
    uint16_t sq_id;        /* SQID */
    uint16_t command_id;   /* CID echoed from the SQE */
    uint16_t status;       /* phase tag (bit 0) and status field (bits 15:1) */
} nvme_cqe;

NVME_STATIC_ASSERT(sizeof(nvme_sgl_descriptor) == 16, "SGL descriptor is 16 bytes");
NVME_STATIC_ASSERT(sizeof(nvme_data_pointer) == 16, "DPTR is 16 bytes");
NVME_STATIC_ASSERT(sizeof(nvme_sqe) == 64, "SQE is 64 bytes");
NVME_STATIC_ASSERT(offsetof(nvme_sqe, nsid) == 4, "SQE CDW1");
NVME_STATIC_ASSERT(offsetof(nvme_sqe, mptr) == 16, "SQE CDW4");
NVME_STATIC_ASSERT(offsetof(nvme_sqe, dptr) == 24, "SQE CDW6");
NVME_STATIC_ASSERT(offsetof(nvme_sqe, cdw10) == 40, "SQE CDW10");
NVME_STATIC_ASSERT(offsetof(nvme_sqe, cdw15) == 60, "SQE CDW15");
NVME_STATIC_ASSERT(sizeof(nvme_cqe) == 16, "CQE is 16 bytes");
NVME_STATIC_ASSERT(offsetof(nvme_cqe, sq_head) == 8, "CQE DW2");
NVME_STATIC_ASSERT(offsetof(nvme_cqe, command_id) == 12, "CQE DW3");
NVME_STATIC_ASSERT(offsetof(nvme_cqe, status) == 14, "CQE status");

#endif /* TUTTI_NVME_SPEC_H */
