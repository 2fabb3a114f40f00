/*
 * Host test of the rules the CUDA I/O kernel and the Rust side share: the plain functions of
 * gio_abi.h (GIO_RULE), compiled with the system C compiler (C11; also as C++ and CUDA C++ by
 * tools/cuda-build.sh). main() checks each rule against its specification written out here and
 * exits non-zero on any mismatch; `rules_check descriptor-kinds` also prints the verdict for every
 * descriptor kind 0..=255, one "KIND VALID" line each, which crates/gio-uring/tests/gpu_rules.rs
 * compares with the Rust rule.
 */
#include "gio_abi.h"

#include <stdio.h>
#include <string.h>

static int failures = 0;

static void expect(int cond, const char *what, unsigned value) {
    if (!cond) {
        fprintf(stderr, "rules_check: FAILED: %s (value %u)\n", what, value);
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

int main(int argc, char **argv) {
    const int print_kinds = argc > 1 && strcmp(argv[1], "descriptor-kinds") == 0;
    check_descriptor_kinds(print_kinds);
    if (failures != 0) {
        return 1;
    }
    if (!print_kinds) {
        printf("rules_check: OK\n");
    }
    return 0;
}
