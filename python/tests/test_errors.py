"""Bad input and failures: every exception class is raised by some test here (checked at the end
of the module: `test_every_exception_class_was_raised`), each with a message that says what to
fix, and none crashes the interpreter."""

from __future__ import annotations

import ctypes

import os

import numpy as np
import pytest

import tutti
from dlpack_structs import DlTensor
from error_daemon import ErrorDaemon
from conftest import FINGERPRINT, GEOMETRY, WAIT_S, corrupted_pool, fill_block, open_store, start_daemon, store_prompt, tokens

RAISED: set[type] = set()


def raises(kind, match=None):
    """pytest.raises that also records the exact class raised."""

    class Recorder:
        def __enter__(self):
            self.context = pytest.raises(kind, match=match)
            self.info = self.context.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.context.__exit__(*exc)
            RAISED.add(type(self.info.value))
            return handled

    return Recorder()


def test_bad_values_are_invalid_arguments():
    # Goal: geometry, device strings, fingerprints, options and block ids out of range are
    # InvalidArgument (also a ValueError), naming the value and what was expected.
    with raises(tutti.InvalidArgument, match="head_dim = 0"):
        tutti.ModelGeometry(4, 2, 0, 2, 16)
    with raises(tutti.InvalidArgument, match="no model preset"):
        tutti.ModelGeometry.preset("gpt-9", 16)
    with raises(tutti.InvalidArgument):
        tutti.Store.open("disk:/dev/sda", GEOMETRY, format=True)
    with raises(tutti.InvalidArgument, match="expected 32"):
        tutti.Store.open("emu:mem:64m", GEOMETRY, format=True, model_fingerprint=b"short")
    with raises(tutti.InvalidArgument, match="rank 2 is not below"):
        tutti.Store.open("emu:mem:64m", GEOMETRY, format=True, model_fingerprint=FINGERPRINT, tp_rank=2, tp_world=2)
    assert issubclass(tutti.InvalidArgument, ValueError)
    with open_store() as store:
        store.allocate_kv(4, "paged")
        with raises(tutti.InvalidArgument, match="block id 4 outside the registered pool of 4 blocks"):
            store.prepare_store(tokens(1, 1), [4])
        with raises(tutti.InvalidArgument, match="expected 1..=2"):
            store.prepare_store(tokens(1, 2), [0, 1, 2])
        request = store.prepare_store(tokens(1, 1), [0])
        with raises(tutti.InvalidArgument, match="layer 4 past the model's 4 layers"):
            request.store_layer(4)
        request.finish()
        with raises(tutti.InvalidArgument, match="layout kind"):
            tutti.Store.open("emu:mem:64m", GEOMETRY, format=True).allocate_kv(4, "ragged")


def test_ints_past_their_argument_width_are_overflow_errors():
    # Goal: the widths the Exceptions table gives hold: block ids, tokens and a request's layer
    # (store_layer, retrieve_layer) are 32 bits, first_block and KvLayout's key/value/layer index
    # 64, so an int past them (or negative) is the builtin OverflowError, and one inside them but
    # out of range is InvalidArgument (a layout's layer 2**32: before, the docs said 32 bits for
    # every layer, which would make it an OverflowError).
    with open_store() as store:
        store.allocate_kv(4, "paged")
        with pytest.raises(OverflowError):
            store.prepare_store(tokens(2, 1), [2**32])
        with pytest.raises(OverflowError):
            store.prepare_store([2**32] * 20, [0])
        with pytest.raises(OverflowError):
            store.prepare_retrieve(tokens(2, 1), [0], first_block=2**64)
        with raises(tutti.InvalidArgument):
            store.prepare_retrieve(tokens(2, 1), [0], first_block=2**32)
        request = store.prepare_store(tokens(2, 1), [0])
        for layer in (2**32, -1):
            with pytest.raises(OverflowError):
                request.store_layer(layer)
        request.finish()
    layout = tutti.KvLayout.separate([np.zeros(8, dtype=np.uint8)], [np.zeros(8, dtype=np.uint8)])
    for pick in (layout.key, layout.value, layout.layer):
        with raises(tutti.InvalidArgument):
            pick(2**32)
        for layer in (2**64, -1):
            with pytest.raises(OverflowError):
                pick(layer)


def test_queue_options_out_of_bounds_are_refused_at_open_and_attach(tmp_path):
    # Goal: iocbs not a power of two in 2..=65536 (gio_uring's ring depth bound), queue_depth
    # outside 2..=1024 and requests_max outside 1..=65536 are InvalidArgument from Store.open
    # and Store.attach, before a device is opened or tuttid is reached (attach to a socket
    # that does not exist says InvalidArgument, not Disconnected), and the in-process store
    # opens at the bounds. Before, iocbs = 1 or 1 << 17 was accepted (allocate_kv then raised
    # DeviceError and closed the store), a huge iocbs or requests_max aborted the process on
    # allocation, and attach checked none of them.
    missing = str(tmp_path / "no-daemon.sock")
    for options in (
        {"iocbs": 1},
        {"iocbs": 1 << 17},
        {"iocbs": 48},
        {"requests_max": 0},
        {"requests_max": 65537},
        {"requests_max": 1 << 28},
        {"queue_depth": 1},
        {"queue_depth": 1025},
    ):
        name, value = next(iter(options.items()))
        with raises(tutti.InvalidArgument, match=f"{name} = {value} "):
            tutti.Store.open("emu:mem:64m", GEOMETRY, format=True, **options)
        with raises(tutti.InvalidArgument, match=f"{name} = {value} "):
            tutti.Store.attach(missing, model_fingerprint=FINGERPRINT, keepalive=False, **options)
    # (iocbs = 65536 is accepted too, but its rings take seconds to set up: the unit test
    # store::tests checks that bound.)
    with open_store(iocbs=2, requests_max=1, queue_depth=2) as store:
        store.allocate_kv(4, "block_major")
    with open_store(requests_max=1 << 16, queue_depth=1024) as store:
        store.allocate_kv(4, "block_major")


def test_timeouts_past_the_clock_are_invalid_arguments_not_panics():
    # Goal: a timeout no deadline can hold (1e19 s, past the clock's range) is InvalidArgument
    # from every call that takes one, never a PanicException; the store stays usable.
    with raises(tutti.InvalidArgument, match="at most 1e9"):
        open_store(timeout_s=1e19)
    store = open_store()
    store.allocate_kv(8, "paged")
    request = store.prepare_store(tokens(1, 1), [0])
    layer = request.store_layer(0)
    with raises(tutti.InvalidArgument, match="at most 1e9"):
        request.wait(1e19)
    with raises(tutti.InvalidArgument, match="at most 1e9"):
        layer.wait(1e19)
    assert request.wait(WAIT_S) == 0
    request.finish()
    with raises(tutti.InvalidArgument, match="at most 1e9"):
        store.close(timeout_s=1e19)
    store.close()


def test_bad_tensors_say_what_to_fix():
    # Goal: the registration refuses (with the fix in the message) non-contiguous blocks, a
    # dtype of another size, a shape whose blocks are not an object, a read-only buffer,
    # overlapping K and V, and an object that is no tensor at all; the store stays usable.
    layers = GEOMETRY.layers

    def separate(make):
        return tutti.KvLayout.separate([make() for _ in range(layers)], [make() for _ in range(layers)])

    with open_store() as store:
        cases = [
            (lambda: np.zeros((4, 64, 2, 16), dtype=np.float16).transpose(0, 3, 2, 1)[:, :, :, ::2].copy()[:, ::2], "not dense within a block"),
            (lambda: np.zeros((4, 16, 2, 64), dtype=np.float32), "4-byte elements, the model's KV dtype has 2"),
            (lambda: np.zeros((4, 16, 2, 65), dtype=np.float16), "bytes per block"),
        ]
        for make, message in cases:
            with raises(tutti.InvalidArgument, match=message):
                store.register_kv(separate(make))
        readonly = np.zeros(4 * GEOMETRY.block_bytes, dtype=np.uint8)
        readonly.flags.writeable = False
        with raises(tutti.InvalidArgument, match="read-only|writable"):
            store.register_kv(tutti.KvLayout.block_major(readonly))
        with raises(tutti.InvalidArgument, match="read-only"):
            store.register_kv(tutti.KvLayout.block_major(memoryview(bytes(4 * GEOMETRY.block_bytes))))
        shared = np.zeros((4, 16, 2, 64), dtype=np.float16)
        with raises(tutti.InvalidArgument, match="overlap in memory"):
            store.register_kv(tutti.KvLayout.separate([shared] * layers, [np.zeros_like(shared) for _ in range(layers)]))
        with raises(tutti.InvalidArgument, match="is not a tensor"):
            store.register_kv(tutti.KvLayout.block_major(object()))
        with raises(tutti.InvalidArgument, match="has 4 tensors, got 2"):
            store.register_kv(tutti.KvLayout.fused([np.zeros((2, 4, 2048), dtype=np.float16)] * 2))
        # After every refusal the store registers good memory and works.
        keys = [np.zeros((4, 16, 2, 64), dtype=np.float16) for _ in range(layers)]
        values = [np.zeros((4, 16, 2, 64), dtype=np.float16) for _ in range(layers)]
        store.register_kv(tutti.KvLayout.separate(keys, values))
        store_prompt(store, tokens(2, 1), [0])


class OtherDeviceTensor:
    """A tensor on a device tutti never registers: DLPack says device type 4 (OpenCL)."""

    def __dlpack_device__(self):
        return (4, 0)

    def __dlpack__(self, **kwargs):
        raise AssertionError("a tensor of another device must be refused before it is exported")


class _DlManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DlTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class CudaTensor:
    """A DLPack producer that says CUDA (device type 2) and hands out a real "dltensor" capsule
    (uint8, 1-D, at a made-up device address; no deleter): what torch gives for a CUDA tensor,
    without a GPU. The struct and shape live as long as this object."""

    def __init__(self, device_id: int, nbytes: int):
        self.shape = (ctypes.c_int64 * 1)(nbytes)
        tensor = DlTensor(0x7F00_0000_0000, 2, device_id, 1, 1, 8, 1, self.shape, None, 0)
        self.managed = _DlManagedTensor(tensor, None, None)
        self.device_id = device_id

    def __dlpack_device__(self):
        return (2, self.device_id)

    def __dlpack__(self, **kwargs):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self.managed), b"dltensor", None)


def test_memory_the_store_cannot_reach_is_unsupported(formatted_daemon):
    # Goal: GPU memory (a DLPack CUDA tensor, a RawMemory on cuda:N) with an in-process store, a
    # tensor of another device anywhere, and, for an attached store, CPU memory the process
    # allocated itself are refused as UnsupportedMemory naming the fix.
    with open_store() as store:
        cuda = CudaTensor(3, 4 * GEOMETRY.block_bytes)
        with raises(tutti.UnsupportedMemory, match="on cuda:3: an in-process store reaches only CPU memory; attach to tuttid"):
            store.register_kv(tutti.KvLayout.block_major(cuda))
        with raises(tutti.UnsupportedMemory, match="opencl:0 .*tutti registers CPU memory, and CUDA memory"):
            store.register_kv(tutti.KvLayout.block_major(OtherDeviceTensor()))
        owner = bytearray(4 * GEOMETRY.block_bytes)
        with raises(tutti.UnsupportedMemory, match="on cuda:1: an in-process store"):
            store.register_kv(tutti.KvLayout.block_major(tutti.RawMemory(0x10000, len(owner), owner=owner, device="cuda:1")))
    store = tutti.Store.attach(formatted_daemon.socket, model_fingerprint=FINGERPRINT)
    with raises(tutti.UnsupportedMemory, match="allocate_kv"):
        store.register_kv(tutti.KvLayout.block_major(np.zeros(4 * GEOMETRY.block_bytes, dtype=np.uint8)))
    assert issubclass(tutti.UnsupportedMemory, tutti.InvalidArgument)
    store.close()


class SaysCpuExportsOther:
    """A DLPack producer whose __dlpack_device__ says CPU while its capsule says `device_type`
    (a real "dltensor" over `array`'s bytes, uint8, 1-D, no deleter): the capsule is what the
    consumer reads, so its device is the one that counts."""

    def __init__(self, array: np.ndarray, device_type: int):
        self.array = array
        self.shape = (ctypes.c_int64 * 1)(array.nbytes)
        tensor = DlTensor(array.ctypes.data, device_type, 0, 1, 1, 8, 1, self.shape, None, 0)
        self.managed = _DlManagedTensor(tensor, None, None)

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kwargs):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self.managed), b"dltensor", None)


def test_the_capsules_device_decides_not_dlpack_device():
    # Goal: a capsule of another device (OpenCL) from a producer whose __dlpack_device__ says CPU
    # is refused as UnsupportedMemory naming that device (it was registered as CPU memory), and
    # a capsule of a device other than the one __dlpack_device__ named (CUDA for CPU) is
    # InvalidArgument naming both; the store then registers good memory.
    with open_store() as store:
        pool = np.zeros(4 * GEOMETRY.block_bytes, dtype=np.uint8)
        with raises(tutti.UnsupportedMemory, match="opencl:0 .*tutti registers CPU memory"):
            store.register_kv(tutti.KvLayout.block_major(SaysCpuExportsOther(pool, 4)))
        with raises(tutti.InvalidArgument, match="__dlpack_device__ says DLPack device type 1 .*its capsule .*type 2"):
            store.register_kv(tutti.KvLayout.block_major(SaysCpuExportsOther(pool, 2)))
        store.register_kv(tutti.KvLayout.block_major(pool))
        store_prompt(store, tokens(3, 1), [0])


def test_raw_memory_shape_must_fit_in_its_nbytes():
    # Goal: a RawMemory whose shape (and strides) reach past the nbytes the caller vouched for
    # is refused when made, so the devices never write past it; one that fits exactly is fine.
    owner = bytearray(4 * GEOMETRY.block_bytes)
    address = ctypes.addressof(ctypes.c_char.from_buffer(owner))
    per_block = (GEOMETRY.layers, 2, 16, 2, 64)
    with raises(tutti.InvalidArgument, match="reaches 262144 bytes past its address, more than its nbytes = 131072"):
        tutti.RawMemory(address, len(owner), owner=owner, itemsize=2, shape=(8, *per_block))
    with raises(tutti.InvalidArgument, match="more than its nbytes = 131072"):
        tutti.RawMemory(address, len(owner), owner=owner, itemsize=2, shape=(4, 16384), strides_bytes=(65536, 2))
    with raises(tutti.InvalidArgument, match="more than its nbytes = 65536"):
        tutti.RawMemory(address, len(owner) // 2, owner=owner, itemsize=2, shape=(4, *per_block))
    fits = tutti.RawMemory(address, len(owner), owner=owner, itemsize=2, shape=(4, *per_block))
    with open_store() as store:
        store.register_kv(tutti.KvLayout.block_major(fits))
        store_prompt(store, tokens(4, 1), [0])


def test_a_block_major_tensor_must_hold_its_layers_outermost():
    # Goal: a block-major tensor is read as (layer, K/V) objects at 2 x layer + kind objects
    # into each block, so one whose block is ordered otherwise ([N, 2, layers, ...], or a
    # permuted view of [N, layers, 2, ...]) is refused naming the order expected, where per-layer
    # I/O would have moved another layer's bytes; [N, layers, 2, ...] and [N, 2 x layers, ...]
    # register and work.
    layers = GEOMETRY.layers
    with open_store() as store:
        refused = [
            np.zeros((4, 2, layers, 16, 2, 64), dtype=np.float16),
            np.zeros((4, 2, layers, 16, 2, 64), dtype=np.float16).transpose(0, 2, 1, 3, 4, 5),
            np.zeros((4, layers, 2, 16, 2, 64), dtype=np.float16).transpose(0, 2, 1, 3, 4, 5),
        ]
        for tensor in refused:
            with raises(tutti.InvalidArgument, match=r"\[num_blocks, layers, 2, \.\.\.\]"):
                store.register_kv(tutti.KvLayout.block_major(tensor))
    for shape in [(4, layers, 2, 16, 2, 64), (4, 2 * layers, 16, 2, 64), (4, 1, layers, 2, 16, 128)]:
        with open_store() as store:
            store.register_kv(tutti.KvLayout.block_major(np.zeros(shape, dtype=np.float16)))
            store_prompt(store, tokens(5, 1), [0])


def test_lookup_client_arguments_out_of_range_are_invalid_arguments(formatted_daemon):
    # Goal: LookupClient takes a timeout and a first block as Store does: a timeout no deadline
    # can hold (1e19 s) and a first block past what tuttid takes (2^32) are InvalidArgument,
    # never a PanicException or an OverflowError; the client stays usable.
    with raises(tutti.InvalidArgument, match="at most 1e9"):
        tutti.LookupClient.connect(formatted_daemon.socket, model_fingerprint=FINGERPRINT, timeout_s=1e19)
    with tutti.LookupClient.connect(formatted_daemon.socket, model_fingerprint=FINGERPRINT) as client:
        prompt = tokens(6, 2)
        with raises(tutti.InvalidArgument, match="first block 4294967296"):
            client.lookup(prompt, first_block=2**32)
        with raises(tutti.InvalidArgument, match="first block 4294967296"):
            client.lookup_all_ranks(prompt, first_block=2**32)
        assert client.lookup(prompt, first_block=1) == 1
        assert client.lookup_all_ranks(prompt) == 0
        # A lookup longer than one frame carries (262,142 tokens) is refused before anything is
        # sent: InvalidArgument (not a lost connection, which the connectors reconnect after),
        # and the connection stays usable.
        with raises(tutti.InvalidArgument, match="1048576"):
            client.lookup_all_ranks([1] * 262_143)
        assert client.lookup_all_ranks(prompt) == 0


def test_order_and_state_errors():
    # Goal: calls out of order are NotRegistered / InvalidState, finished or foreign requests
    # StaleRequest, too many requests LimitReached, and the request and store stay usable.
    store = open_store(requests_max=2)
    with raises(tutti.NotRegistered, match="register_kv"):
        store.prepare_retrieve(tokens(1, 1), [0])
    with raises(tutti.NotRegistered):
        store.lookup(tokens(1, 1))
    layout = store.allocate_kv(8, "block_major")
    with raises(tutti.InvalidState, match="once per store"):
        store.allocate_kv(8, "paged")
    prompt = tokens(3, 2)
    fill_block(layout, 0, 1)
    fill_block(layout, 1, 2)
    request = store.prepare_store(prompt, [0, 1])
    request.store_layer(0)
    with raises(tutti.InvalidState, match="still in flight"):
        request.store_layer(1)
    with raises(tutti.InvalidState, match="in flight"):
        request.finish()
    with raises(tutti.InvalidState, match="retrieve_layer on a store request"):
        request.retrieve_layer(1)
    request.wait(WAIT_S)
    with raises(tutti.InvalidState):
        request.commit()  # layers 1..3 not stored yet
    assert request.state == "prepared", "a refused commit leaves the request live"
    for layer in range(1, GEOMETRY.layers):
        request.store_layer(layer)
        request.wait(WAIT_S)
    second = store.prepare_store(tokens(4, 1), [2])
    with raises(tutti.LimitReached, match="too many requests"):
        store.prepare_store(tokens(5, 1), [3])
    second.finish()
    assert request.commit() == 2
    with raises(tutti.StaleRequest, match="committed"):
        request.store_layer(0)
    with raises(tutti.StaleRequest):
        request.wait()
    request.finish()  # idempotent after commit
    retrieve = store.prepare_retrieve(prompt, [4, 5])
    store.close()
    with raises(tutti.StaleRequest, match="closed"):
        retrieve.retrieve_layer(0)
    with raises(tutti.StaleRequest, match="closed"):
        store.lookup(prompt)


def test_a_full_pool_is_pool_full_in_process_and_through_tuttid(small_daemon):
    # Goal: more new blocks than the pool has slots: PoolFull (a LimitReached) in-process and
    # from tuttid (where it comes as the daemon's LimitReached refusal, classified); nothing is
    # left pinned (a smaller store then succeeds).
    with tutti.Store.open("emu:mem:64m", GEOMETRY, format=True, slots_max=4) as store:
        store.allocate_kv(8, "paged")
        with raises(tutti.PoolFull, match="pool full"):
            store.prepare_store(tokens(1, 6), list(range(6)))
        store_prompt(store, tokens(1, 3), [0, 1, 2])
    remote = tutti.Store.attach(small_daemon.socket, model_fingerprint=FINGERPRINT)
    remote.allocate_kv(16, "paged")
    with raises(tutti.PoolFull, match="pool full") as info:
        remote.prepare_store(tokens(2, 12), list(range(12)))
    assert info.value.code == "LimitReached"
    assert issubclass(tutti.PoolFull, tutti.LimitReached)
    store_prompt(remote, tokens(2, 2), [0, 1])
    # The daemon serves one connection: a second is refused with the daemon's Busy.
    with raises(tutti.DaemonError, match="Busy") as info:
        tutti.LookupClient.connect(small_daemon.socket, model_fingerprint=FINGERPRINT)
    assert info.value.code == "Busy"
    remote.close()


def test_an_attach_refused_busy_is_asked_again_until_its_timeout(small_daemon):
    # Goal: Busy is transient (every connection taken; a restarted engine's old session still
    # releasing its queue ids): Store.attach asks again on a new connection until timeout_s,
    # so an engine starting while the place frees attaches; one still refused at timeout_s
    # raises the daemon's Busy, not before.
    import threading
    import time

    first = tutti.Store.attach(small_daemon.socket, model_fingerprint=FINGERPRINT)
    started = time.monotonic()
    with raises(tutti.DaemonError, match="Busy") as info:
        tutti.Store.attach(small_daemon.socket, model_fingerprint=FINGERPRINT, timeout_s=0.5)
    assert info.value.code == "Busy"
    assert time.monotonic() - started >= 0.3, "asked again until (about) its timeout"
    closer = threading.Timer(0.5, first.close)
    closer.start()
    started = time.monotonic()
    second = tutti.Store.attach(small_daemon.socket, model_fingerprint=FINGERPRINT, timeout_s=WAIT_S)
    assert 0.4 <= time.monotonic() - started < WAIT_S
    closer.join()
    assert second.kind == "tuttid"
    second.close()


BUSY = 10  # ErrorCode::Busy


def test_an_attach_asked_again_after_busy_ends_within_its_timeout(tmp_path):
    # Goal: one deadline for the whole attach: a daemon slow to answer Busy (0.9 s) is asked
    # again only within timeout_s (1 s), and the attach ends about then, not after a second
    # whole Hello exchange (about 1.8 s before; the bound, 1.5 s, leaves room for a loaded machine).
    import time

    daemon = ErrorDaemon(tmp_path / "busy.sock", BUSY, b"every connection is taken", delay_s=0.9)
    try:
        started = time.monotonic()
        with pytest.raises(tutti.DaemonError):
            tutti.Store.attach(str(tmp_path / "busy.sock"), model_fingerprint=FINGERPRINT, keepalive=False, timeout_s=1.0)
        elapsed = time.monotonic() - started
    finally:
        daemon.stop()
    assert elapsed < 1.5, f"attach(timeout_s=1.0) took {elapsed:.2f} s"


def test_a_wait_past_its_deadline_is_a_timeout_and_the_layer_stays_in_flight(tmp_path):
    # Goal: a wait whose deadline passes with the layer not complete is TimeoutError (also the
    # builtin TimeoutError), the layer is still in flight, a later wait completes it. The
    # message's start is what tells it from a layer's own failure of class Timeout ("layer N
    # failed: ...", the layer ended), as _tutti.pyi and docs/python.md say: pinned here. The
    # layer cannot complete: tuttid, whose software controller moves the bytes, is stopped
    # (SIGSTOP). (A wait(0) right after an issue on a running controller may return the
    # completion: a wait polls once before it looks at its deadline.)
    still_in_flight = r"^request 0x[0-9a-f]+: layer 0 did not complete by the deadline; it is still in flight"
    daemon = start_daemon(tmp_path)
    try:
        store = tutti.Store.attach(daemon.socket, model_fingerprint=FINGERPRINT, keepalive=False)
        store.allocate_kv(8, "paged")
        request = store.prepare_store(tokens(1, 4), [0, 1, 2, 3])
        daemon.pause()
        try:
            request.store_layer(0)
            with raises(tutti.TimeoutError, match=still_in_flight):
                request.wait(0.2)
            assert request.layer_in_flight == 0
        finally:
            daemon.resume()
        assert request.wait(WAIT_S) == 0
        assert issubclass(tutti.TimeoutError, TimeoutError)
        request.finish()
        store.close()
    finally:
        daemon.stop()


def test_devices_and_pools_that_cannot_be_used(tmp_path):
    # Goal: a missing device file is DeviceError; a file without a pool, or a pool of another
    # geometry, is PoolError naming the fix; a pool file held by another opener is DeviceError
    # naming the holder.
    with raises(tutti.DeviceError, match="no such file"):
        tutti.Store.open(f"emu:{tmp_path}/missing/x.img", GEOMETRY)
    blank = tmp_path / "blank.img"
    blank.write_bytes(bytes(64 << 20))
    with raises(tutti.PoolError, match="--format|format"):
        tutti.Store.open(f"emu:{blank}", GEOMETRY)
    pool = tmp_path / "pool.img"
    first = tutti.Store.open(f"emu:{pool}", GEOMETRY, format=True, create_bytes=64 << 20)
    with raises(tutti.DeviceError, match=str(os.getpid())):
        tutti.Store.open(f"emu:{pool}", GEOMETRY)
    first.close()
    other = tutti.ModelGeometry(8, 2, 64, 2, 16)
    with raises(tutti.PoolError, match="formatted for"):
        tutti.Store.open(f"emu:{pool}", other)


def test_format_refuses_a_file_holding_something_else(tmp_path):
    # Goal: format=True over a file holding other bytes is PoolError naming what it found and
    # the keyword that allows it, and writes nothing; overwrite=True formats it; a tutti pool
    # is reformatted without it.
    image = tmp_path / "notes.img"
    contents = b"notes" + bytes(8187)
    image.write_bytes(contents)
    with raises(tutti.PoolError, match=r"non-zero bytes \(the first at byte 0\).*overwrite=True"):
        tutti.Store.open(f"emu:{image}", GEOMETRY, format=True, create_bytes=64 << 20)
    assert image.read_bytes() == contents
    tutti.Store.open(f"emu:{image}", GEOMETRY, format=True, overwrite=True, create_bytes=64 << 20).close()
    tutti.Store.open(f"emu:{image}", GEOMETRY, format=True).close()


def test_a_refused_format_leaves_the_directory_as_it_was(tmp_path):
    # Goal: Store.open(format=True, create_bytes=...) on emu: files makes a missing file only
    # for a format that succeeds, as `tutti pool format` and tuttid --format do. Two refusals:
    # one its parameters make before any file is made or grown (a size too small for the
    # model, alone or beside an existing file: objstore::check_format, through
    # tutti_daemon::pool_open), and one after the files were made and grown (a third device in
    # a directory that does not exist cannot be opened once the other two were): the format
    # removes the file it made and shrinks back the one it grew (tutti_devices::FileUndo).
    # Only the second reaches the undo: the first refuses before FileUndo::create_missing.
    pools = tmp_path / "pools"
    pools.mkdir()
    existing = pools / "existing.img"
    existing.write_bytes(bytes(4096))
    missing = pools / "missing.img"
    unopenable = pools / "no-such-dir" / "x.img"
    before = sorted((entry.name, entry.stat().st_size) for entry in pools.iterdir())
    with raises(tutti.PoolError):
        tutti.Store.open(f"emu:{missing}", GEOMETRY, format=True, create_bytes=64 << 10)
    assert sorted((entry.name, entry.stat().st_size) for entry in pools.iterdir()) == before
    with raises(tutti.PoolError):
        tutti.Store.open([f"emu:{missing}", f"emu:{existing}"], GEOMETRY, format=True, create_bytes=64 << 10)
    assert sorted((entry.name, entry.stat().st_size) for entry in pools.iterdir()) == before
    with raises(tutti.DeviceError, match="no-such-dir"):
        tutti.Store.open(
            [f"emu:{existing}", f"emu:{missing}", f"emu:{unopenable}"], GEOMETRY, format=True, create_bytes=64 << 20
        )
    assert sorted((entry.name, entry.stat().st_size) for entry in pools.iterdir()) == before
    assert existing.read_bytes() == bytes(4096)


def test_corrupted_block_is_an_integrity_error(tmp_path):
    # Goal: with verify_retrieves, a block whose bytes changed on the device behind the store's
    # back (the emu file edited) raises IntegrityError at the last layer's wait, naming the
    # block; it is evicted (no longer found).
    device, prompt = corrupted_pool(tmp_path, seed=5)
    with tutti.Store.open(device, GEOMETRY, verify_retrieves=True) as store:
        store.allocate_kv(4, "block_major")
        assert store.lookup(prompt) == 2
        request = store.prepare_retrieve(prompt, [2, 3])
        for layer in range(GEOMETRY.layers - 1):
            request.retrieve_layer(layer)
            request.wait(WAIT_S)
        request.retrieve_layer(GEOMETRY.layers - 1)
        with raises(tutti.IntegrityError, match="CRC mismatch in 1 block"):
            request.wait(WAIT_S)
        request.finish()
        assert store.lookup(prompt) == 1, "the corrupted block was evicted"


def test_no_daemon_and_a_daemon_that_goes_away_are_disconnected(tmp_path):
    # Goal: a socket nobody serves is Disconnected (a DaemonError); a daemon stopped under an
    # attached store makes its next request Disconnected, not a crash.
    with raises(tutti.Disconnected, match="connecting to tuttid"):
        tutti.Store.attach(str(tmp_path / "nobody.sock"), model_fingerprint=FINGERPRINT)
    with raises(tutti.Disconnected):
        tutti.LookupClient.connect(str(tmp_path / "nobody.sock"), model_fingerprint=FINGERPRINT)
    daemon = start_daemon(tmp_path / "d")
    store = tutti.Store.attach(daemon.socket, model_fingerprint=FINGERPRINT, keepalive=False)
    store.allocate_kv(4, "paged")
    daemon.stop()
    with raises(tutti.Disconnected):
        store.prepare_store(tokens(1, 1), [0])
    store.close()
    assert issubclass(tutti.Disconnected, tutti.DaemonError)


CONSUMED_CAPSULE_WHILE_RAISING = """
import ctypes, sys, tutti
rename = ctypes.pythonapi.PyCapsule_SetName
rename.argtypes = [ctypes.py_object, ctypes.c_char_p]
rename.restype = ctypes.c_int
buffer = tutti.DeviceMemoryStandIn(4096)
def consumed(versioned):
    # A consumer took the tensor: it renamed the capsule (the deleter is its job now).
    if versioned:
        capsule = buffer.__dlpack__(max_version=(1, 0))
        assert rename(capsule, b"used_dltensor_versioned") == 0
    else:
        capsule = buffer.__dlpack__()
        assert rename(capsule, b"used_dltensor") == 0
    return capsule
def boom():
    raise KeyError("mine")
def in_a_called_frame(versioned):
    return (consumed(versioned), boom())  # the capsule is on the value stack when boom() raises
for versioned in (False, True):
    try:
        in_a_called_frame(versioned)
    except KeyError as error:
        assert error.args == ("mine",), error
    try:
        (consumed(versioned), boom())  # in the handler's own frame
    except KeyError as error:
        assert error.args == ("mine",), error
print("propagated")
"""


def test_a_capsule_freed_while_an_exception_propagates_leaves_the_exception_alone():
    # Goal: the destructor of a capsule we handed out, renamed by its consumer and freed while
    # an exception propagates (on the value stack of the frame that raised), leaves the
    # exception in flight: the KeyError reaches its handler, legacy and versioned capsules
    # alike. Before, the destructor cleared it: SystemError "error return without exception
    # set" in a called frame, a segfault in the handler's frame. In a child interpreter: a
    # crash must fail the test, not end the run.
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", CONSUMED_CAPSULE_WHILE_RAISING], capture_output=True, text=True, timeout=WAIT_S)
    assert (child.returncode, child.stdout.strip()) == (0, "propagated"), child.stdout + child.stderr


def test_every_exception_class_was_raised():
    # Goal: the module's other tests raised every class the package defines (run last).
    classes = {value for value in vars(tutti).values() if isinstance(value, type) and issubclass(value, tutti.Error)}
    missing = sorted(cls.__name__ for cls in classes - RAISED - {tutti.Error})
    assert not missing, f"never raised by a test: {missing}"
    assert all(issubclass(cls, tutti.Error) for cls in RAISED)
