"""Importing a tensor for register_kv: DLPack capsules (the versioned DLPack 1.0 one, which says
whether the memory is read-only, and the legacy one), refusals that name the tensor, and the
buffer protocol's raw-bytes formats. The producers here are made with ctypes (a real capsule over
a numpy array's bytes), so each case is exactly the struct a producer could hand out."""

from __future__ import annotations

import ctypes
import gc
import sys

import numpy as np
import pytest

import tutti
from conftest import GEOMETRY, open_store, store_prompt, tokens
from dlpack_structs import DlTensor

NBYTES = 4 * GEOMETRY.block_bytes


_LEGACY_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_VERSIONED_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DlManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DlTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _LEGACY_DELETER)]


class _DlManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _VERSIONED_DELETER),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DlTensor),
    ]


# Each live test capsule's struct and name (kept alive until the capsule's destructor ran: the
# capsule holds only their addresses), by the capsule's address.
_CAPSULE_STRUCTS: dict[int, tuple[ctypes.Structure, bytes]] = {}

# Every test capsule not yet dropped, with the producer that made it. A capsule's destructor is
# Python code, which must not run with an exception set (it would be replaced by a SystemError
# and lost), as it is while a raising call releases its arguments (a producer held by nothing
# else, and so its capsule). So no capsule is freed where a test lets go of it: only
# Producer.drop_capsule and the autouse fixture after each test release them, with nothing raised.
_LIVE_CAPSULES: list[tuple[Producer, object]] = []


def _release_capsules(made_by=None) -> None:
    """Frees the live capsules `made_by` made (every one when None), running their destructors."""
    _LIVE_CAPSULES[:] = [] if made_by is None else [(maker, capsule) for maker, capsule in _LIVE_CAPSULES if maker is not made_by]
    gc.collect()


@pytest.fixture(autouse=True)
def _release_leftover_capsules():
    yield
    _release_capsules()


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule):
    # As numpy's and torch's destructors: a capsule nobody consumed (not renamed "used_*") still
    # owns its tensor and calls the deleter; a consumed one leaves it to the consumer. The
    # capsule arrives as an address: it is being deallocated (a py_object would resurrect it).
    struct, _name = _CAPSULE_STRUCTS.pop(capsule)
    get = ctypes.pythonapi.PyCapsule_GetName
    get.restype, get.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    if not get(capsule).startswith(b"used_"):
        struct.deleter(ctypes.addressof(struct))


def _capsule(maker: Producer, struct: ctypes.Structure, name: bytes):
    """A capsule over `struct` with a numpy-style destructor, kept in _LIVE_CAPSULES (see there)
    until `maker.drop_capsule()` or the end of the test."""
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new(ctypes.addressof(struct), name, ctypes.cast(_capsule_destructor, ctypes.c_void_p))
    _CAPSULE_STRUCTS[id(capsule)] = (struct, name)
    _LIVE_CAPSULES.append((maker, capsule))
    return capsule


def _capsule_name(capsule) -> bytes:
    get = ctypes.pythonapi.PyCapsule_GetName
    get.restype, get.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return get(capsule)


class Producer:
    """A CPU DLPack producer over `array`'s bytes (1-D, uint8 unless `bits`/`lanes`/`code` say
    otherwise). `versioned`: hands out "dltensor_versioned" (DLPack `major`.0, `flags`) when the
    consumer passes max_version, else "dltensor". `keywords`: whether __dlpack__ takes the
    DLPack 1.0 keywords at all (a legacy producer raises TypeError on max_version); `unasked`:
    hands out the versioned capsule to a call without max_version too. `device`: what
    __dlpack_device__ returns (an exception: raises it); `raises`: an exception __dlpack__
    raises instead of handing out a capsule. Records each
    call's keywords, the capsule and the deleter's calls (with the struct's address): tutti's,
    for a capsule it consumed, or the capsule's destructor's, for one it left unconsumed."""

    def __init__(self, array, *, versioned=True, keywords=True, flags=0, major=1, bits=8, lanes=1, code=1, ndim=1,
                 shape=True, name=None, unasked=False, device=(1, 0), raises=None):
        self.array = array
        itemsize = max(bits * lanes // 8, 1)
        self.shape = (ctypes.c_int64 * 64)(*([array.nbytes // itemsize] + [1] * 63))
        tensor = DlTensor(array.ctypes.data, 1, 0, ndim, code, bits, lanes, self.shape if shape else None, None, 0)
        self.deleted: list[int] = []
        self.legacy_deleter = _LEGACY_DELETER(self.deleted.append)
        self.versioned_deleter = _VERSIONED_DELETER(self.deleted.append)
        self.legacy = _DlManagedTensor(tensor, None, self.legacy_deleter)
        self.versioned = _DlManagedTensorVersioned(major, 0, None, self.versioned_deleter, flags, tensor)
        self.offers_versioned, self.keywords, self.name, self.unasked, self.device = versioned, keywords, name, unasked, device
        self.raises = raises
        self.calls: list[dict] = []
        self.capsule = None

    def __dlpack_device__(self):
        if isinstance(self.device, BaseException):
            raise self.device
        return self.device

    def __dlpack__(self, **kwargs):
        if kwargs and not self.keywords:
            raise TypeError(f"__dlpack__() got an unexpected keyword argument {next(iter(kwargs))!r}")
        self.calls.append(kwargs)
        if self.raises is not None:
            raise self.raises
        if self.offers_versioned and (self.unasked or kwargs.get("max_version", (0, 0)) >= (1, 0)):
            self.capsule = _capsule(self, self.versioned, self.name or b"dltensor_versioned")
        else:
            self.capsule = _capsule(self, self.legacy, self.name or b"dltensor")
        return self.capsule

    def address(self) -> int:
        versioned = self.offers_versioned and (self.keywords or self.unasked)
        return ctypes.addressof(self.versioned) if versioned else ctypes.addressof(self.legacy)

    def drop_capsule(self) -> list[int]:
        """Drops the capsules this producer made (their destructors run) and returns every
        deleter call so far."""
        self.capsule = None
        _release_capsules(made_by=self)
        return self.deleted


def test_a_versioned_capsule_is_consumed_renamed_and_deleted_once():
    # Goal: register_kv asks for DLPack 1.0 (max_version=(1, 0)), takes a writable
    # "dltensor_versioned" capsule (before, it refused every versioned capsule with a TypeError),
    # renames it "used_dltensor_versioned" (the spec's consumed name), keeps it until close, and
    # then calls its deleter exactly once, with the struct's own address.
    array = np.zeros(NBYTES, dtype=np.uint8)
    producer = Producer(array)
    with open_store() as store:
        store.register_kv(tutti.KvLayout.block_major(producer))
        assert producer.calls == [{"max_version": (1, 0)}]
        assert _capsule_name(producer.capsule) == b"used_dltensor_versioned"
        store_prompt(store, tokens(5, 1), [0])
        assert producer.deleted == []
    assert producer.deleted == [producer.address()]
    # Renamed, so the capsule's destructor leaves the tensor alone: still one deletion.
    assert producer.drop_capsule() == [producer.address()]


def test_a_legacy_producer_is_asked_again_without_keywords():
    # Goal: a producer whose __dlpack__ knows no max_version (TypeError) is asked again without
    # arguments and its legacy capsule is consumed ("used_dltensor") and deleted once at close;
    # a producer that takes max_version but hands out a legacy capsule is taken as well.
    for producer in (Producer(np.zeros(NBYTES, dtype=np.uint8), keywords=False), Producer(np.zeros(NBYTES, dtype=np.uint8), versioned=False)):
        with open_store() as store:
            store.register_kv(tutti.KvLayout.block_major(producer))
            assert producer.calls[-1] in ({}, {"max_version": (1, 0)})
            assert _capsule_name(producer.capsule) == b"used_dltensor"
            store_prompt(store, tokens(6, 1), [0])
        assert producer.deleted == [ctypes.addressof(producer.legacy)]
        assert producer.drop_capsule() == [ctypes.addressof(producer.legacy)]


def test_a_read_only_dlpack_tensor_is_refused():
    # Goal: a versioned capsule flagged read-only (flags bit 0) is refused as InvalidArgument
    # naming the tensor (retrieves write into it), and the consumed capsule's deleter runs once;
    # a read-only numpy array (numpy flags it in the versioned capsule) is refused the same way;
    # the store then registers good memory.
    producer = Producer(np.zeros(NBYTES, dtype=np.uint8), flags=1)
    with open_store() as store:
        with pytest.raises(tutti.InvalidArgument, match="tensor is read-only"):
            store.register_kv(tutti.KvLayout.block_major(producer))
        assert producer.deleted == [ctypes.addressof(producer.versioned)]
        assert producer.drop_capsule() == [ctypes.addressof(producer.versioned)]
        readonly = np.zeros(NBYTES, dtype=np.uint8)
        readonly.flags.writeable = False
        with pytest.raises(tutti.InvalidArgument, match="tensor is read-only"):
            store.register_kv(tutti.KvLayout.block_major(readonly))
        store.register_kv(tutti.KvLayout.block_major(np.zeros(NBYTES, dtype=np.uint8)))
        store_prompt(store, tokens(7, 1), [0])


@pytest.mark.parametrize("flags", [2, 3])
def test_a_copy_the_producer_made_is_refused(flags):
    # Goal: a versioned capsule flagged IS_COPIED (flags bit 1: the producer exported a copy,
    # which the array API lets it do when not asked for copy=False) is refused as InvalidArgument
    # naming the tensor: registered, the copy would take the retrieves (which the engine never
    # reads) and give the stores its bytes, not the tensor's; before, it was registered. Refused
    # before it is consumed: tutti calls no deleter, the capsule's destructor deletes it once.
    producer = Producer(np.zeros(NBYTES, dtype=np.uint8), flags=flags)
    with open_store() as store:
        with pytest.raises(tutti.InvalidArgument, match=r"tensor: .*a copy the producer made \(DLPack IS_COPIED\): retrieves would write into the copy"):
            store.register_kv(tutti.KvLayout.block_major(producer))
        assert producer.deleted == []
        assert _capsule_name(producer.capsule) == b"dltensor_versioned"
        store.register_kv(tutti.KvLayout.block_major(np.zeros(NBYTES, dtype=np.uint8)))
        store_prompt(store, tokens(10, 1), [0])
    assert producer.drop_capsule() == [producer.address()]


@pytest.mark.parametrize("keywords", [True, False])
def test_a_capsule_of_another_major_version_says_how_it_was_asked_for(keywords):
    # Goal: the refusal of a DLPack 2.0 capsule says max_version=(1, 0) was given only when it
    # was: a producer that raised TypeError on max_version and then handed out a versioned
    # capsule to the call without it was never given one (before, the message said it was).
    producer = Producer(np.zeros(NBYTES, dtype=np.uint8), major=2, keywords=keywords, unasked=True)
    with open_store() as store:
        with pytest.raises(tutti.InvalidArgument, match=r"tensor: a DLPack 2\.0 capsule: tutti reads DLPack 1") as refused:
            store.register_kv(tutti.KvLayout.block_major(producer))
        assert producer.calls == ([{"max_version": (1, 0)}] if keywords else [{}])
        if keywords:
            assert "its __dlpack__ was given max_version=(1, 0)" in str(refused.value)
        else:
            assert "was given max_version" not in str(refused.value)
            assert "its __dlpack__ did not take max_version=(1, 0)" in str(refused.value)
        assert producer.deleted == []
    assert producer.drop_capsule() == [producer.address()]


@pytest.mark.parametrize(
    "device, message",
    [
        (RuntimeError("no device here"), r"tensor: its __dlpack_device__\(\) failed \(RuntimeError: no device here\)"),
        (ValueError("no device"), r"tensor: its __dlpack_device__\(\) failed \(ValueError: no device\)"),
        ("cpu", r"tensor: its __dlpack_device__\(\) returned 'cpu', not a \(device type, device id\) pair of ints"),
        ((1,), r"tensor: its __dlpack_device__\(\) returned \(1,\), not a"),
        ((1, 0, 0), r"tensor: its __dlpack_device__\(\) returned \(1, 0, 0\), not a"),
        ((1.0, 0), r"tensor: its __dlpack_device__\(\) returned \(1\.0, 0\), not a"),
        ((2**40, 0), r"tensor: its __dlpack_device__\(\) returned \(1099511627776, 0\), not a"),
        ("x" * 1000, r"tensor: its __dlpack_device__\(\) returned 'x{79}\.\.\., not a"),
    ],
)
def test_a_broken_dlpack_device_is_refused_naming_the_tensor(device, message):
    # Goal: a __dlpack_device__ that raises, or returns anything but two ints (each an int32, as
    # DLPack's DLDevice has them), is InvalidArgument naming the tensor, as every other refusal of
    # a tensor is; before, its own exception or a bare TypeError came out, naming nothing. The
    # answer is quoted cut to 80 characters. Its __dlpack__ is never called; the store stays usable.
    producer = Producer(np.zeros(NBYTES, dtype=np.uint8), device=device)
    with open_store() as store:
        with pytest.raises(tutti.InvalidArgument, match=message):
            store.register_kv(tutti.KvLayout.block_major(producer))
        assert producer.calls == []
        store.register_kv(tutti.KvLayout.block_major(np.zeros(NBYTES, dtype=np.uint8)))
        store_prompt(store, tokens(11, 1), [0])


def test_a_producer_dropped_while_its_refusal_propagates_keeps_the_error():
    # Goal (of this file's harness): a producer that nothing but the raising call holds is freed
    # while the refusal propagates (the call's arguments are released with the exception set).
    # Its unconsumed capsule must not be freed then: its destructor is Python code, which would
    # run with the exception set (SystemError, the refusal lost). The module's list of live
    # capsules keeps it until the test ends (the autouse fixture frees it, with nothing raised).
    with open_store() as store:
        with pytest.raises(tutti.InvalidArgument, match=r"DLPack IS_COPIED"):
            store.register_kv(tutti.KvLayout.block_major(Producer(np.zeros(NBYTES, dtype=np.uint8), flags=2)))
        store.register_kv(tutti.KvLayout.block_major(np.zeros(NBYTES, dtype=np.uint8)))
        store_prompt(store, tokens(13, 1), [0])


@pytest.mark.parametrize("where", ["device", "raises"])
@pytest.mark.parametrize("exception", [KeyboardInterrupt, SystemExit, MemoryError])
def test_an_interrupt_or_memory_error_in_the_producer_is_not_a_refusal(where, exception):
    # Goal: a KeyboardInterrupt or SystemExit (BaseException, not Exception) or a MemoryError (a
    # resource failure, not the producer refusing the tensor) raised by __dlpack_device__ or
    # __dlpack__ comes out as itself; before, each became InvalidArgument (a tutti.Error, which a
    # caller may retry: Ctrl-C was swallowed, a MemoryError retried). The store stays usable.
    producer = Producer(np.zeros(NBYTES, dtype=np.uint8), **{where: exception("from the producer")})
    with open_store() as store:
        with pytest.raises(exception, match="from the producer"):
            store.register_kv(tutti.KvLayout.block_major(producer))
        store.register_kv(tutti.KvLayout.block_major(np.zeros(NBYTES, dtype=np.uint8)))
        store_prompt(store, tokens(12, 1), [0])


class _RaisingIndex:
    """An int-like whose __index__ (what reading an int out of it calls) raises `exception`."""

    def __init__(self, exception):
        self.exception = exception

    def __index__(self):
        raise self.exception


@pytest.mark.parametrize("exception", [KeyboardInterrupt, SystemExit, MemoryError])
def test_an_interrupt_or_memory_error_reading_the_dlpack_device_is_not_a_refusal(exception):
    # Goal: an interrupt or MemoryError raised while the __dlpack_device__ answer is read (its
    # device id's __index__) comes out as itself; before, it became InvalidArgument "returned
    # ..., not a (device type, device id) pair of ints" (Ctrl-C swallowed into a tutti.Error).
    producer = Producer(np.zeros(NBYTES, dtype=np.uint8), device=(1, _RaisingIndex(exception("from the answer"))))
    with open_store() as store:
        with pytest.raises(exception, match="from the answer"):
            store.register_kv(tutti.KvLayout.block_major(producer))
        assert producer.calls == []
        store.register_kv(tutti.KvLayout.block_major(np.zeros(NBYTES, dtype=np.uint8)))
        store_prompt(store, tokens(14, 1), [0])


def test_a_failing_buffer_export_is_refused_quoting_its_error():
    # Goal: an exporter's own error from the buffer protocol (not a TypeError, which says the
    # object has no buffer at all) is InvalidArgument naming the tensor and quoting that error;
    # before, every exception became "... is not a tensor", the exporter's text lost. A released
    # memoryview refuses a new export with a ValueError.
    released = memoryview(bytearray(NBYTES))
    released.release()
    with open_store() as store:
        with pytest.raises(tutti.InvalidArgument, match=r"tensor \(memoryview\): its buffer export failed \(ValueError: operation forbidden on released memoryview"):
            store.register_kv(tutti.KvLayout.block_major(released))
        store.register_kv(tutti.KvLayout.block_major(np.zeros(NBYTES, dtype=np.uint8)))
        store_prompt(store, tokens(15, 1), [0])


@pytest.mark.skipif(sys.version_info < (3, 12), reason="a Python-level buffer exporter (__buffer__) needs Python 3.12")
@pytest.mark.parametrize("exception", [KeyboardInterrupt, SystemExit, MemoryError])
def test_an_interrupt_or_memory_error_in_a_buffer_export_is_not_a_refusal(exception):
    # Goal: a KeyboardInterrupt/SystemExit or MemoryError raised by a buffer exporter comes out as
    # itself; before, it became InvalidArgument "... is not a tensor" (a tutti.Error a caller may
    # retry: Ctrl-C swallowed, a MemoryError retried or reported as a bad tensor).
    class Exporter:
        def __buffer__(self, flags):
            raise exception("from the exporter")

    with open_store() as store:
        with pytest.raises(exception, match="from the exporter"):
            store.register_kv(tutti.KvLayout.block_major(Exporter()))
        store.register_kv(tutti.KvLayout.block_major(np.zeros(NBYTES, dtype=np.uint8)))
        store_prompt(store, tokens(16, 1), [0])


@pytest.mark.parametrize("keywords", [True, False])
def test_a_failing_dlpack_call_is_refused_naming_the_tensor(keywords):
    # Goal: an ordinary exception from __dlpack__ (also from the retry without max_version, after
    # a TypeError) is InvalidArgument naming the tensor and quoting the producer's error.
    producer = Producer(np.zeros(NBYTES, dtype=np.uint8), keywords=keywords, raises=ValueError("no export"))
    with open_store() as store:
        with pytest.raises(tutti.InvalidArgument, match=r"tensor: its __dlpack__\(\) failed \(ValueError: no export\)"):
            store.register_kv(tutti.KvLayout.block_major(producer))
        assert producer.calls == ([{"max_version": (1, 0)}] if keywords else [{}])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"name": b"used_dltensor"}, r"tensor: __dlpack__\(\) did not return an unused"),
        ({"versioned": False, "name": b"used_dltensor"}, r"tensor: __dlpack__\(\) did not return an unused"),
        ({"ndim": 33}, "tensor: a DLPack tensor with 33 dimensions"),
        ({"versioned": False, "ndim": -1}, "tensor: a DLPack tensor with -1 dimensions"),
        ({"shape": False}, "tensor: a DLPack tensor without a shape"),
        ({"major": 2}, r"tensor: a DLPack 2\.0 capsule"),
    ],
)
def test_dlpack_import_refusals_name_the_tensor(options, message):
    # Goal: a capsule the import refuses (already consumed, garbage dimensions, no shape, a
    # DLPack major version it does not know) is InvalidArgument naming the tensor, not a bare
    # TypeError or ValueError; the store stays usable. A refused capsule is left unconsumed
    # (not renamed): tutti never calls its deleter, the producer's capsule destructor does, once
    # (calling it as well would free the producer's tensor twice); a capsule already named
    # "used_*" belongs to someone else and is deleted by neither.
    producer = Producer(np.zeros(NBYTES, dtype=np.uint8), **options)
    with open_store() as store:
        with pytest.raises(tutti.InvalidArgument, match=message):
            store.register_kv(tutti.KvLayout.block_major(producer))
        assert producer.deleted == []
        unconsumed = b"dltensor_versioned" if options.get("versioned", True) else b"dltensor"
        assert _capsule_name(producer.capsule) == options.get("name", unconsumed)
        store.register_kv(tutti.KvLayout.block_major(np.zeros(NBYTES, dtype=np.uint8)))
        store_prompt(store, tokens(8, 1), [0])
    assert producer.drop_capsule() == ([] if "name" in options else [producer.address()])


@pytest.mark.parametrize("bits, lanes", [(20, 1), (4, 5), (12, 1)])
def test_a_dtype_of_a_fraction_of_a_byte_is_refused(bits, lanes):
    # Goal: a DLPack dtype whose bits x lanes is not a whole number of bytes is refused as
    # InvalidArgument naming it: before, 20 bits counted as a 2-byte element (the model's
    # dtype_bytes) and was registered with a wrong element size.
    # The refused capsule is left to its destructor, which deletes it once.
    producer = Producer(np.zeros(NBYTES, dtype=np.uint8), bits=bits, lanes=lanes, code=0)
    with open_store() as store:
        with pytest.raises(tutti.InvalidArgument, match=f"tensor: a DLPack dtype of {bits} bits x {lanes} lanes .*whole number of bytes"):
            store.register_kv(tutti.KvLayout.block_major(producer))
        assert producer.deleted == []
    assert producer.drop_capsule() == [producer.address()]


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
