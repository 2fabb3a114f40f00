"""Round trips byte for byte: in-process and through tuttid, every layout kind, several layers
and blocks, a prefix hit after a store, memory tutti allocated (KvBuffers through DLPack) and
memory the caller owns (numpy through DLPack, bytearray and mmap through the buffer protocol,
RawMemory by address)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import time
import weakref

import numpy as np
import pytest

import tutti
from conftest import (
    FINGERPRINT,
    GEOMETRY,
    HandsOverOnExport,
    WAIT_S,
    block_parts,
    fill_block,
    holds,
    open_store,
    open_where,
    retrieve_prompt,
    store_prompt,
    tokens,
)

KINDS = ["separate", "fused", "paged", "block_major"]


@pytest.mark.parametrize("kind", KINDS)
def test_in_process_allocated_memory_round_trips_every_layout(kind):
    # Goal: blocks filled in tutti's own KV memory are stored layer by layer, found by lookup
    # (a prefix hit), and retrieved into other engine blocks byte for byte; a longer prompt
    # then shares the stored prefix and writes only its new blocks.
    with open_store() as store:
        assert store.kind == "in-process" and not store.registered
        layout = store.allocate_kv(16, kind)
        assert (layout.kind, layout.num_blocks, store.registered) == (kind, 16, True)
        assert store.kv is layout or store.kv.tensors == layout.tensors
        prompt = tokens(1, 4)
        for block in range(4):
            fill_block(layout, block, seed=block + 1)
        assert store.lookup(prompt) == 0
        request = store_prompt(store, prompt, [0, 1, 2, 3])
        assert (request.state, request.new_block_ids, request.layers_completed) == ("committed", [0, 1, 2, 3], [0, 1, 2, 3])
        assert store.lookup(prompt) == 4
        assert store.lookup(prompt[: 2 * 16]) == 2, "a prefix of the prompt is a hit too"
        retrieve_prompt(store, prompt, [15, 9, 12, 4])
        for source, target in zip(range(4), [15, 9, 12, 4]):
            assert holds(layout, target, seed=source + 1), f"block {source} -> {target}"
        # Six blocks of which the first four are cached: only blocks 4 and 5 are written.
        longer = prompt[: 4 * 16] + tokens(7, 2, extra=0)
        fill_block(layout, 5, seed=50)
        fill_block(layout, 6, seed=60)
        request = store.prepare_store(longer, [10, 11, 13, 14, 5, 6])
        assert (request.new_blocks, request.shared_blocks, request.new_block_ids) == (2, 4, [5, 6])
        for layer in range(GEOMETRY.layers):
            request.store_layer(layer).wait(WAIT_S)
        assert request.commit() == 2
        assert store.lookup(longer) == 6


def test_in_process_caller_numpy_memory_round_trips_through_dlpack():
    # Goal: the engine's own numpy tensors (float16, [N, tokens, heads, dim], K and V apart)
    # are registered in place: what the store writes lands in them, nothing is copied.
    keys = [np.zeros((8, 16, 2, 64), dtype=np.float16) for _ in range(GEOMETRY.layers)]
    values = [np.zeros((8, 16, 2, 64), dtype=np.float16) for _ in range(GEOMETRY.layers)]
    rng = np.random.default_rng(3)
    for tensor in keys + values:
        tensor[:3] = rng.standard_normal((3, 16, 2, 64)).astype(np.float16)
    with open_store() as store:
        store.register_kv(tutti.KvLayout.separate(keys, values))
        assert (store.kv.num_blocks, store.kv.block_stride_bytes) == (8, GEOMETRY.object_bytes)
        prompt = tokens(2, 3)
        store_prompt(store, prompt, [0, 1, 2])
        retrieve_prompt(store, prompt, [7, 5, 6])
        for tensor in keys + values:
            assert np.array_equal(tensor[[7, 5, 6]], tensor[:3])


def test_vllm_paged_view_and_fused_tensors_register_in_place():
    # Goal: vLLM 0.32's per-layer view [blocks, heads, slots, 2*dim] over an [blocks, slots,
    # heads, 2*dim] allocation (a permuted, non-contiguous view whose blocks are dense) and the
    # FlashAttention layout [2, blocks, slots, heads, dim] both round-trip.
    base = [np.zeros((6, 16, 2, 128), dtype=np.uint16) for _ in range(GEOMETRY.layers)]
    views = [array.transpose(0, 2, 1, 3) for array in base]
    assert not views[0].flags.c_contiguous
    with open_store() as store:
        store.register_kv(tutti.KvLayout.paged(views))
        assert store.kv.block_stride_bytes == 2 * GEOMETRY.object_bytes
        for layer, array in enumerate(base):
            array[:2] = np.random.default_rng(layer).integers(0, 65535, array[:2].shape, dtype=np.uint16)
        prompt = tokens(3, 2)
        store_prompt(store, prompt, [0, 1])
        retrieve_prompt(store, prompt, [4, 3])
        for array in base:
            assert np.array_equal(array[[4, 3]], array[:2])
    fused = [np.zeros((2, 6, 16, 2, 64), dtype=np.float16) for _ in range(GEOMETRY.layers)]
    with open_store() as store:
        store.register_kv(tutti.KvLayout.fused(fused))
        for layer, array in enumerate(fused):
            array[:, :2] = np.random.default_rng(10 + layer).standard_normal(array[:, :2].shape)
        prompt = tokens(4, 2)
        store_prompt(store, prompt, [0, 1])
        retrieve_prompt(store, prompt, [5, 2])
        for array in fused:
            assert np.array_equal(array[:, [5, 2]], array[:, :2])


def test_buffer_protocol_objects_and_raw_memory_register():
    # Goal: objects without DLPack register through the buffer protocol (a bytearray as the
    # block-major pool) or by address (RawMemory over an mmap, the owner kept), and round-trip.
    n = 6
    pool = bytearray(n * GEOMETRY.block_bytes)
    with open_store() as store:
        store.register_kv(tutti.KvLayout.block_major(pool))
        with pytest.raises(BufferError):
            pool.extend(b"x")  # the export is held: the pool cannot move while registered
        view = np.frombuffer(pool, dtype=np.uint8).reshape(n, -1)
        view[:2] = np.random.default_rng(5).integers(0, 256, view[:2].shape, dtype=np.uint8)
        prompt = tokens(5, 2)
        store_prompt(store, prompt, [0, 1])
        retrieve_prompt(store, prompt, [3, 5])
        assert np.array_equal(view[[3, 5]], view[:2])
        del view
    pool.extend(b"x")  # the store's export is released at close
    mapping = mmap.mmap(-1, n * 2 * GEOMETRY.object_bytes * GEOMETRY.layers)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    per_layer = n * 2 * GEOMETRY.object_bytes
    layers = [tutti.RawMemory(address + layer * per_layer, per_layer, owner=mapping) for layer in range(GEOMETRY.layers)]
    with open_store() as store:
        store.register_kv(tutti.KvLayout.paged(layers))
        data = np.frombuffer(mapping, dtype=np.uint8).reshape(GEOMETRY.layers, n, -1)
        data[:, :2] = np.random.default_rng(6).integers(0, 256, data[:, :2].shape, dtype=np.uint8)
        prompt = tokens(6, 2)
        store_prompt(store, prompt, [0, 1])
        retrieve_prompt(store, prompt, [4, 2])
        assert np.array_equal(data[:, [4, 2]], data[:, :2])
        del data


def test_registered_memory_stays_alive_while_the_store_may_use_it():
    # Goal: the engine drops its last reference to the registered tensors while a store is
    # prepared and a layer in flight: the store keeps them alive (through the DLPack export it
    # consumed: the watched array is reachable by nothing else), the retrieve lands, and they
    # are freed only after the store closed.
    keys = [np.zeros((4, 4096), dtype=np.uint8) for _ in range(GEOMETRY.layers)]
    values = [np.zeros((4, 4096), dtype=np.uint8) for _ in range(GEOMETRY.layers)]
    for index, tensor in enumerate(keys + values):
        tensor[0] = index + 1
    watch = weakref.ref(keys[0])
    watch_values = weakref.ref(values[0])
    store = open_store()
    store.register_kv(tutti.KvLayout.separate([HandsOverOnExport(keys[0]), *keys[1:]], values))
    prompt = tokens(8, 1)
    store_prompt(store, prompt, [0])
    request = store.prepare_retrieve(prompt, [3])
    request.retrieve_layer(0)
    del keys, values
    gc.collect()
    assert watch() is not None, "the store keeps the registered tensor alive"
    assert request.wait(WAIT_S) == 0
    for layer in range(1, GEOMETRY.layers):
        request.retrieve_layer(layer)
        request.wait(WAIT_S)
    request.finish()
    assert (watch()[3] == 1).all() and (watch_values()[3] == GEOMETRY.layers + 1).all()
    store.close()
    gc.collect()
    assert watch() is None and watch_values() is None, "released after close"
    assert store.leaked_registrations() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_through_tuttid_allocated_window_round_trips(formatted_daemon, kind):
    # Goal: two sessions of the same model through tuttid: one stores from tutti-allocated KV
    # memory (the daemon maps it), the other finds the prompt and retrieves it byte for byte;
    # per-layer calls send nothing to the daemon; the engine's tensors handed back to
    # register_kv are accepted (they are the allocation).
    writer = tutti.Store.attach(formatted_daemon.socket, model_fingerprint=FINGERPRINT, client_name="writer")
    assert writer.kind == "tuttid" and writer.geometry == GEOMETRY and writer.session is not None
    layout = writer.allocate_kv(8, kind)
    # The engine's typed views over the allocation, handed back as it would hand any store
    # its KV cache: accepted, as they are the allocation.
    writer.register_kv(getattr(tutti.KvLayout, kind)(*_typed_views(layout)))
    prompt = tokens(11, 3)
    for block in range(3):
        fill_block(layout, block, seed=20 + block)
    before = writer.requests_sent
    request = writer.prepare_store(prompt, [0, 1, 2])
    for layer in range(GEOMETRY.layers):
        request.store_layer(layer)
        request.wait(WAIT_S)
    assert writer.requests_sent == before + 1, "the per-layer path sends nothing to tuttid"
    request.commit()
    reader = tutti.Store.attach(formatted_daemon.socket, model_fingerprint=FINGERPRINT, client_name="reader")
    assert reader.lookup(prompt) == 3, "a lookup before registering memory"
    other = reader.allocate_kv(8, "paged" if kind != "paged" else "separate")
    retrieve_prompt(reader, prompt, [7, 6, 5])
    for source, target in zip(range(3), [7, 6, 5]):
        # The block's bytes, layer by layer, K then V, whatever the layout.
        assert np.array_equal(np.concatenate(_block_objects(other, target)), np.concatenate(_block_objects(layout, source)))
    with tutti.LookupClient.connect(formatted_daemon.socket, model_fingerprint=FINGERPRINT) as scheduler:
        assert scheduler.lookup(prompt) == 3 and scheduler.lookup_all_ranks(prompt) == 3
        assert scheduler.geometry == GEOMETRY and scheduler.lease_s > 0
        status = scheduler.status()
        assert {client["name"] for client in status["clients"]} >= {"writer", "reader", "python-scheduler"}
    writer.close()
    reader.close()


@pytest.mark.parametrize("where", ["in-process", "tuttid"])
def test_a_retrieve_from_a_first_block_leaves_the_engines_own_blocks_alone(formatted_daemon, where, request):
    # Goal: an engine that holds the first blocks of a cached prefix itself (a local prefix
    # hit) looks up and retrieves only the rest with `first_block`: lookups answer where the
    # cached run from there ends, the blocks land byte for byte, the engine's own blocks keep
    # their bytes, and ranges past the prompt are refused as InvalidArgument.
    with open_where(where, request) as store:
        layout = store.allocate_kv(12, "paged")
        prompt = tokens(31, 4)
        for block in range(4):
            fill_block(layout, block, seed=40 + block)
        store_prompt(store, prompt, [0, 1, 2, 3])
        longer = prompt + tokens(32, 1)
        assert [store.lookup(longer, first_block=first) for first in (0, 2, 4, 5, 9)] == [4, 4, 4, 5, 5]
        assert store.lookup_all_ranks(longer, first_block=2) == 4
        if where == "tuttid":
            with tutti.LookupClient.connect(formatted_daemon.socket, model_fingerprint=FINGERPRINT) as scheduler:
                assert scheduler.lookup(longer, first_block=2) == 4 and scheduler.lookup_all_ranks(longer, first_block=3) == 4
        # Engine blocks 8..11 receive the prompt; 8 and 9 are the engine's own (other bytes).
        fill_block(layout, 8, seed=90)
        fill_block(layout, 9, seed=91)
        retrieve_prompt(store, prompt, [10, 11], first_block=2)
        assert holds(layout, 10, seed=42) and holds(layout, 11, seed=43), "blocks 2 and 3 of the prompt"
        assert holds(layout, 8, seed=90) and holds(layout, 9, seed=91), "the engine's own blocks are left alone"
        for block_ids, first_block in [([10, 11, 4], 2), ([], 1), ([10], 4)]:
            with pytest.raises(tutti.InvalidArgument):
                store.prepare_retrieve(prompt, block_ids, first_block=first_block)
        with pytest.raises(OverflowError):
            store.prepare_retrieve(prompt, [10], first_block=-1)


@pytest.mark.parametrize("where", ["in-process", "tuttid"])
def test_an_issued_layer_reaches_the_device_without_a_wait(where, request):
    # Goal: retrieve_layer puts the layer's commands on the device (the CPU executor builds an
    # issue's commands only when it is polled, on the polling thread: the issue polls it once),
    # so an engine that issues a layer and goes off to compute finds its bytes landing with no
    # further call into tutti; the next layer, not issued, does not land.
    with open_where(where, request) as store:
        layout = store.allocate_kv(12, "paged")
        assert len(layout.tensors) == GEOMETRY.layers, "paged: one tensor per layer"
        prompt = tokens(33, 3)
        sources, targets = [0, 1, 2], [5, 6, 7]
        for block in sources:
            fill_block(layout, block, seed=60 + block)
        store_prompt(store, prompt, sources)
        for block in targets:
            for part in block_parts(layout, block):
                part[:] = 0

        def landed(layer: int) -> bool:
            return all((block_parts(layout, target)[layer] == block_parts(layout, source)[layer]).all() for source, target in zip(sources, targets))

        with store.prepare_retrieve(prompt, targets) as request:
            request.retrieve_layer(0)
            deadline = time.monotonic() + WAIT_S
            while not landed(0):  # the engine computing: no call into tutti
                assert time.monotonic() < deadline, "the issued layer did not reach the device without a wait"
                time.sleep(0.005)
            assert not landed(1)
            assert request.wait(WAIT_S) == 0
            for layer in range(1, GEOMETRY.layers):
                request.retrieve_layer(layer)
                assert request.wait(WAIT_S) == layer
        assert all(landed(layer) for layer in range(GEOMETRY.layers))


def _typed_views(layout: tutti.KvLayout):
    """float16 numpy views over an allocation, shaped as an engine would use them."""
    n, layers = layout.num_blocks, GEOMETRY.layers
    shape = {
        "separate": (n, 16, 2, 64),
        "fused": (2, n, 16, 2, 64),
        "paged": (n, 2, 16, 128),
        "block_major": (n, layers, 2, 16, 2, 64),
    }[layout.kind]
    views = [np.from_dlpack(tensor).view(np.float16).reshape(shape) for tensor in layout.tensors]
    if layout.kind == "separate":
        return (views[:layers], views[layers:])
    if layout.kind == "block_major":
        return (views[0],)
    return (views,)


def _block_objects(layout: tutti.KvLayout, block: int) -> list[np.ndarray]:
    """Engine block `block` as its 2 x layers objects (layer l's K, then V), whatever the layout."""
    n, layers, size = layout.num_blocks, GEOMETRY.layers, GEOMETRY.object_bytes
    tensors = [np.from_dlpack(tensor) for tensor in layout.tensors]
    objects = []
    for layer in range(layers):
        if layout.kind == "separate":
            objects += [tensors[layer].reshape(n, -1)[block], tensors[layers + layer].reshape(n, -1)[block]]
        elif layout.kind == "fused":
            halves = tensors[layer].reshape(2, n, -1)
            objects += [halves[0, block], halves[1, block]]
        elif layout.kind == "paged":
            run = tensors[layer].reshape(n, -1)[block]
            objects += [run[:size], run[size:]]
        else:
            run = tensors[0].reshape(n, -1)[block]
            objects += [run[2 * layer * size:(2 * layer + 1) * size], run[(2 * layer + 1) * size:(2 * layer + 2) * size]]
    return objects


def test_tensor_parallel_ranks_and_the_in_process_key_space(formatted_daemon, tmp_path):
    # Goal: TP 2 through tuttid: rank 0's blocks are not rank 1's; the scheduler's all-ranks
    # lookup sees the prompt only once both stored it.
    prompt = tokens(21, 2)
    ranks = [tutti.Store.attach(formatted_daemon.socket, model_fingerprint=FINGERPRINT, tp_rank=rank, tp_world=2) for rank in (0, 1)]
    layouts = [store.allocate_kv(4, "paged") for store in ranks]
    scheduler = tutti.LookupClient.connect(formatted_daemon.socket, model_fingerprint=FINGERPRINT, tp_world=2)
    fill_block(layouts[0], 0, 1)
    fill_block(layouts[0], 1, 2)
    store_prompt(ranks[0], prompt, [0, 1])
    assert (ranks[0].lookup(prompt), ranks[1].lookup(prompt), scheduler.lookup_all_ranks(prompt)) == (2, 0, 0)
    assert ranks[0].lookup_all_ranks(prompt) == 0
    store_prompt(ranks[1], prompt, [2, 3])
    assert (ranks[1].lookup(prompt), scheduler.lookup_all_ranks(prompt), ranks[1].lookup_all_ranks(prompt)) == (2, 2, 2)
    scheduler.close()
    for store in ranks:
        store.close()
