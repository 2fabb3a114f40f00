"""Importing a tensor for register_kv: DLPack capsules (the versioned DLPack 1.0 one, which says
whether the memory is read-only, and the legacy one), refusals that name the tensor, and the
buffer protocol's raw-bytes formats. The producers here are made with ctypes (a real capsule over
a numpy array's bytes), so each case is exactly the struct a producer could hand out."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import tutti
from conftest import GEOMETRY, open_store, store_prompt, tokens

NBYTES = 4 * GEOMETRY.block_bytes


@pytest.mark.parametrize("element", [ctypes.c_char, ctypes.c_byte, ctypes.c_ubyte])
def test_ctypes_byte_arrays_are_raw_bytes(element):
    # Goal: a ctypes array of bytes (buffer format "<c", "<b", "<B": a byte-order prefix before a
    # byte format) registers as raw bytes; before, "<c" and "<b" were taken as 1-byte elements
    # of another dtype and refused ("1-byte elements, the model's KV dtype has 2").
    memory = (element * NBYTES)()
    assert memoryview(memory).format.lstrip("<>=!@") in ("c", "b", "B")
    with open_store() as store:
        store.register_kv(tutti.KvLayout.block_major(memory))
        store_prompt(store, tokens(9, 1), [0])
