/*
 * Compile-and-run check of the shared headers: the static asserts inside them fire at compile time
 * (as C11 with gcc, as C++ with g++, as CUDA C++ with nvcc), and main() re-checks at run time the
 * few values the Rust side relies on, so a wrong constant fails loudly here too.
 * Built and run by tools/cuda-build.sh.
 */
#include "gio_abi.h"
#include "nvme_spec.h"

#include <stdio.h>

static int failures = 0;

static void expect(int cond, const char *what) {
    if (!cond) {
        fprintf(stderr, "abi_check: FAILED: %s\n", what);
        failures++;
    }
}

int main(void) {
    expect(sizeof(gio_ioctx) == 48, "sizeof(gio_ioctx) == 48");
    expect(sizeof(gio_iocb) == 128, "sizeof(gio_iocb) == 128");
    expect(sizeof(gio_cqe) == 16, "sizeof(gio_cqe) == 16");
    expect(sizeof(gio_ring_header) == 256, "sizeof(gio_ring_header) == 256");
    expect(sizeof(gio_nvme_qp) == 320, "sizeof(gio_nvme_qp) == 320");
    expect(sizeof(nvme_sqe) == 64, "sizeof(nvme_sqe) == 64");
    expect(sizeof(nvme_cqe) == 16, "sizeof(nvme_cqe) == 16");
    expect(GIO_MAX_IOCTX_PER_IOCB == 2048u, "GIO_MAX_IOCTX_PER_IOCB == 2048");
    /* The command id is the low 16 bits of the ticket, so every ring depth must divide 2^16. */
    expect(GIO_RING_DEPTH_MAX == 65536u, "GIO_RING_DEPTH_MAX == 2^16");
    expect(offsetof(gio_iocb, status) % GIO_CACHE_LINE_BYTES == 0, "IOCB executor line aligned");
    if (failures == 0) {
        printf("abi_check: OK\n");
    }
    return failures == 0 ? 0 : 1;
}
