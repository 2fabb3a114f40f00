"""KV memory tuttid reaches only by copies (docs/python.md, "GPU memory"), on a machine without a
GPU: the CPU stand-in (tutti.DeviceMemoryStandIn, a sealed memfd; tuttid --device-memory memfd)
takes the route CUDA tensors take (one allocation holding the layout, exported as device memory,
the tensors as offsets in it), and the refusals of that route are typed and say what to fix.

The GPU itself is tools/gpu/python-cuda-check.py's (tools/gpu/run-all.sh python)."""

from __future__ import annotations

import ctypes.util
import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

import tutti
from conftest import FINGERPRINT, GEOMETRY, Daemon, HandsOverOnExport, fill_block, holds, run_child, store_prompt, tokens

BLOCKS = 8
# A paged layer's bytes: per block its K and V (2 x 4 KiB objects).
LAYER_BYTES = BLOCKS * 2 * 4096
# Room before the first layer: the layout does not start at the allocation's first byte.
LEAD_BYTES = 3 * 4096


def stand_in_layout(stand_in: tutti.DeviceMemoryStandIn) -> tutti.KvLayout:
    """vLLM 0.32's shape of GPU KV: one allocation, a region per layer in it; here the layers
    lie in reverse order after LEAD_BYTES, so the offsets the daemon sees are not the order the
    layout lists them in."""
    return tutti.KvLayout.paged(stand_in_views(stand_in.numpy()))


def stand_in_views(data: np.ndarray) -> list[np.ndarray]:
    """The per-layer views of stand_in_layout over the stand-in's bytes `data`."""
    layers = GEOMETRY.layers
    views = []
    for layer in range(layers):
        start = LEAD_BYTES + (layers - 1 - layer) * LAYER_BYTES
        views.append(data[start : start + LAYER_BYTES].view(np.uint16).reshape(BLOCKS, 2, 16, 2 * 64))
    return views


def attach(daemon: Daemon) -> tutti.Store:
    return tutti.Store.attach(daemon.socket, model_fingerprint=FINGERPRINT, keepalive=False)


@pytest.fixture
def memfd_daemon(tmp_path):
    started = Daemon(tmp_path, extra=("--format", "--device-memory", "memfd"))
    yield started
    started.stop()


def test_device_memory_stored_by_one_process_is_retrieved_by_another(memfd_daemon):
    # Goal: the whole device-memory route across processes: this process registers its stand-in
    # (tuttid maps the memfd, copies out of it) and stores a prompt; a child process registers its
    # own stand-in, retrieves the prompt into other blocks and compares every byte. The layout's
    # tensors are not at the allocation's start and not in address order. The stand-in and
    # the arrays are dropped by the caller after registration: the store keeps them (the
    # registered layout holds producers that let go of their views at the export, so the
    # stand-in's bytes are reachable only through what the store consumed).
    stand_in = tutti.DeviceMemoryStandIn(LEAD_BYTES + GEOMETRY.layers * LAYER_BYTES + 4096)
    data = stand_in.numpy()
    watch = weakref.ref(data)
    registered = tutti.KvLayout.paged([HandsOverOnExport(view) for view in stand_in_views(data)])
    store = attach(memfd_daemon)
    store.register_kv(registered)
    del stand_in, data
    gc.collect()
    assert watch() is not None, "the store keeps the stand-in's memory alive"
    # The test's own views over what the store kept, to fill and check the blocks (the
    # helpers read a layout's kind, num_blocks and tensors).
    layout = SimpleNamespace(kind="paged", num_blocks=BLOCKS, tensors=stand_in_views(watch()))
    prompt = tokens(11, 4)
    for block in range(4):
        fill_block(layout, block, 50 + block)
    store_prompt(store, prompt, [0, 1, 2, 3])
    assert all(holds(layout, block, 50 + block) for block in range(4))
    done = run_child("device-retrieve", memfd_daemon.socket, "11", "4")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["found", "4", "wrong", "0"], done.stdout + done.stderr
    store.close()
    assert store.leaked_registrations() == 0


def test_device_memory_refused_by_a_daemon_without_it_says_why(formatted_daemon):
    # Goal: tuttid started without --device-memory refuses the registration; the exception is
    # UnsupportedMemory carrying tuttid's reason and code, and the store is closed after it.
    stand_in = tutti.DeviceMemoryStandIn(LEAD_BYTES + GEOMETRY.layers * LAYER_BYTES)
    store = attach(formatted_daemon)
    with pytest.raises(tutti.UnsupportedMemory, match="imports no device memory: start it with --device-memory") as raised:
        store.register_kv(stand_in_layout(stand_in))
    assert raised.value.code == "Unsupported"
    assert store.closed


def test_a_layout_across_two_stand_ins_is_not_one_allocation(memfd_daemon):
    # Goal: the layout's span must lie in one allocation: layers in two stand-ins are refused
    # before anything reaches tuttid, naming the fix; the store stays usable.
    first, second = (tutti.DeviceMemoryStandIn(2 * LAYER_BYTES) for _ in range(2))
    views = [
        memory.numpy()[offset : offset + LAYER_BYTES].reshape(BLOCKS, -1)
        for memory in (first, second)
        for offset in (0, LAYER_BYTES)
    ]
    store = attach(memfd_daemon)
    with pytest.raises(tutti.UnsupportedMemory, match="not inside one DeviceMemoryStandIn.*allocate the KV cache as one tensor"):
        store.register_kv(tutti.KvLayout.paged(views))
    assert not store.closed and not store.registered
    store.close()


def test_cuda_memory_is_refused_in_process_and_without_a_driver(memfd_daemon):
    # Goal: GPU memory with an in-process store is UnsupportedMemory naming tuttid; attached,
    # on a machine without libcuda, UnsupportedMemory saying there is no driver: never a crash.
    raw = tutti.RawMemory(0x7F00_0000_0000, GEOMETRY.block_bytes * BLOCKS, owner=None, device="cuda:0")
    with tutti.Store.open("emu:mem:16m", GEOMETRY, format=True) as local:
        with pytest.raises(tutti.UnsupportedMemory, match="in-process store reaches only CPU memory; attach to tuttid started with --device-memory cuda"):
            local.register_kv(tutti.KvLayout.block_major(raw))
    store = attach(memfd_daemon)
    if ctypes.util.find_library("cuda") is None:
        with pytest.raises(tutti.UnsupportedMemory, match="no CUDA driver could be loaded"):
            store.register_kv(tutti.KvLayout.block_major(raw))
    else:
        # A driver is here: the made-up pointer is no allocation of it, a typed error still.
        with pytest.raises(tutti.Error):
            store.register_kv(tutti.KvLayout.block_major(raw))
    store.close()


def test_a_stand_in_is_cpu_memory_to_an_in_process_store():
    # Goal: in-process, the stand-in is host memory like any other: mapped in place, and a
    # store and retrieve through it are byte-exact.
    stand_in = tutti.DeviceMemoryStandIn(LEAD_BYTES + GEOMETRY.layers * LAYER_BYTES)
    layout = stand_in_layout(stand_in)
    with tutti.Store.open("emu:mem:16m", GEOMETRY, format=True) as store:
        store.register_kv(layout)
        prompt = tokens(3, 2)
        for block in range(2):
            fill_block(layout, block, 7 + block)
        store_prompt(store, prompt, [0, 1])
        with store.prepare_retrieve(prompt, [4, 5]) as request:
            for layer in range(GEOMETRY.layers):
                request.retrieve_layer(layer)
                request.wait(10.0)
        assert holds(layout, 4, 7) and holds(layout, 5, 8)


def test_a_stand_in_a_closed_store_kept_for_good_is_refused_in_process(memfd_daemon):
    # Goal: an attached store's close that could not settle a layer through a paused tuttid
    # keeps its stand-in for good (tuttid's memfd copies may still write it); a numpy view of
    # that stand-in, registered with an in-process store of the same process (CPU memory it
    # would map), is refused as UnsupportedMemory saying why, so that store never commits and
    # serves bytes tuttid may still write. Before, the device-memory route forgot its keeps
    # without listing them, and the view was accepted.
    stand_in = tutti.DeviceMemoryStandIn(LEAD_BYTES + GEOMETRY.layers * LAYER_BYTES)
    layout = stand_in_layout(stand_in)
    store = tutti.Store.attach(memfd_daemon.socket, model_fingerprint=FINGERPRINT, keepalive=False, timeout_s=0.3)
    store.register_kv(layout)
    fill_block(layout, 1, 87)
    prompt = tokens(87, 1)
    store_prompt(store, prompt, [1])
    request = store.prepare_retrieve(prompt, [2])
    memfd_daemon.pause()
    try:
        request.retrieve_layer(0)
        store.close(timeout_s=0.3)
        assert store.leaked_registrations() > 0, "the close could not settle the layer"
        with tutti.Store.open("emu:mem:16m", GEOMETRY, format=True) as fresh:
            with pytest.raises(tutti.UnsupportedMemory, match="kept for good"):
                fresh.register_kv(tutti.KvLayout.paged(stand_in_views(stand_in.numpy())))
            assert not fresh.registered
    finally:
        memfd_daemon.resume()
