"""Fixtures of the core tests: a tuttid daemon of our own on a software controller in a temporary
directory (the binary comes from TUTTI_TUTTID, which tools/test.sh's python stage builds), byte
patterns, and helpers that look at a KV layout's blocks as bytes.

Every wait is bounded: a daemon that does not listen, does not stop, or a child that does not
exit fails the test with what it printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tutti
from tuttid_process import TuttidProcess

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WAIT_S = 30.0

# The daemon's model: 4 layers x 2 KV heads x dim 64, 2-byte elements, 16-token blocks:
# 4 KiB objects, 32 KiB per block.
DAEMON_MODEL = ["--layers", "4", "--kv-heads", "2", "--head-dim", "64"]
GEOMETRY = tutti.ModelGeometry(layers=4, kv_heads=2, head_dim=64, dtype_bytes=2, block_tokens=16)
FINGERPRINT = tutti.fingerprint("tutti core tests", 1)


def tuttid_binary() -> str:
    path = os.environ.get("TUTTI_TUTTID")
    if not path:
        for candidate in (REPO / "target" / "release" / "tuttid", REPO / "target" / "debug" / "tuttid"):
            if candidate.exists():
                return str(candidate)
        pytest.fail("TUTTI_TUTTID is not set and no target/*/tuttid exists: build it (cargo build -p tuttid) first")
    return path


class Daemon(TuttidProcess):
    """A tuttid process serving a socket in `directory`, its pool on `device`, for the core
    tests' model."""

    def __init__(self, directory: Path, device: str = "emu:mem:64m", extra: tuple[str, ...] = ()):
        super().__init__(directory, tuttid_binary(), ["--device", device, *DAEMON_MODEL, *extra], stop_timeout_s=WAIT_S)

    def stop(self) -> int:
        """SIGTERM, then a bounded wait; a daemon that does not exit is killed and fails the test."""
        returncode = super().stop()
        if returncode is None:
            pytest.fail(f"tuttid did not exit within {WAIT_S} s of SIGTERM: {self.output()}")
        return returncode


@pytest.fixture
def small_daemon(tmp_path):
    """A daemon whose pool has 8 slots (a store of more blocks is refused) and one connection."""
    started = Daemon(tmp_path, extra=("--format", "--slots", "8", "--clients-max", "1"))
    yield started
    started.stop()


def start_daemon(directory: Path, *extra: str) -> Daemon:
    return Daemon(directory, extra=("--format", *extra))


@pytest.fixture
def formatted_daemon(tmp_path):
    started = start_daemon(tmp_path)
    yield started
    if started.process.poll() is None:
        started.resume()
    started.stop()


def open_store(**options) -> tutti.Store:
    """An in-process store on a fresh 64 MiB memory-backed controller, formatted for GEOMETRY."""
    return tutti.Store.open("emu:mem:64m", GEOMETRY, format=True, **options)


def attach(daemon, **options) -> tutti.Store:
    """A store attached to `daemon` in the tests' key space (no keepalive thread: tests are short)."""
    return tutti.Store.attach(daemon.socket, model_fingerprint=FINGERPRINT, keepalive=False, **options)


def open_where(where: str, request, **options) -> tutti.Store:
    """An in-process store, or one attached to the test's formatted daemon ("tuttid")."""
    if where == "tuttid":
        return attach(request.getfixturevalue("formatted_daemon"), **options)
    return open_store(**options)


def tokens(seed: int, blocks: int, extra: int = 5) -> list[int]:
    """A prompt of `blocks` full blocks (and a partial one) that differs per seed."""
    count = blocks * GEOMETRY.block_tokens + extra
    return [(i * 2654435761 ^ (seed * 97 + 13)) & 0x7FFFFFFF for i in range(count)]


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """Bytes that differ per seed and offset."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def as_bytes(tensor) -> np.ndarray:
    """A writable flat uint8 view of a layout tensor (a KvBuffer or a C-contiguous array)."""
    if isinstance(tensor, tutti.KvBuffer):
        return np.from_dlpack(tensor)
    array = np.asarray(tensor)
    assert array.flags.c_contiguous, "the helper needs contiguous tensors"
    return array.reshape(-1).view(np.uint8)


def block_parts(layout: tutti.KvLayout, block: int) -> list[np.ndarray]:
    """Views of engine block `block`'s bytes in every tensor of `layout` (its blocks must be
    packed, as allocate_kv makes them)."""
    n = layout.num_blocks
    parts = []
    for tensor in layout.tensors:
        data = as_bytes(tensor)
        if layout.kind == "fused":
            halves = data.reshape(2, n, -1)
            parts.extend([halves[0, block], halves[1, block]])
        else:
            parts.append(data.reshape(n, -1)[block])
    return parts


def fill_block(layout: tutti.KvLayout, block: int, seed: int) -> None:
    for index, part in enumerate(block_parts(layout, block)):
        part[:] = pattern(seed * 1000 + index, part.size)


def holds(layout: tutti.KvLayout, block: int, seed: int) -> bool:
    return all((part == pattern(seed * 1000 + index, part.size)).all() for index, part in enumerate(block_parts(layout, block)))


def store_prompt(store: tutti.Store, prompt: list[int], blocks: list[int], commit: bool = True) -> tutti.Request:
    request = store.prepare_store(prompt, blocks)
    for layer in range(store.geometry.layers):
        request.store_layer(layer)
        assert request.wait(WAIT_S) == layer
    if commit:
        request.commit()
    return request


def retrieve_prompt(store: tutti.Store, prompt: list[int], blocks: list[int], first_block: int = 0) -> None:
    """Retrieves blocks first_block.. of `prompt`'s prefix into `blocks`, every layer."""
    with store.prepare_retrieve(prompt, blocks, first_block=first_block) as request:
        for layer in range(store.geometry.layers):
            request.retrieve_layer(layer)
            assert request.wait(WAIT_S) == layer


class HandsOverOnExport:
    """A DLPack producer that lets go of its array when it exports it: afterwards the array is
    reachable only through the DLPack export (numpy's capsule holds it until the consumer's
    deleter call), so whether it stays alive is up to the store's keep, not to the layout
    that holds this producer."""

    def __init__(self, array: np.ndarray):
        self.array: np.ndarray | None = array

    def __dlpack_device__(self):
        assert self.array is not None
        return self.array.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        assert self.array is not None
        capsule = self.array.__dlpack__(**kwargs)
        self.array = None
        return capsule


def run_child(*args: str, timeout: float = WAIT_S) -> subprocess.CompletedProcess:
    """Runs python/tests/child.py in a fresh interpreter (bounded)."""
    return subprocess.run([sys.executable, str(HERE / "child.py"), *args], capture_output=True, text=True, timeout=timeout)


def corrupted_pool(tmp_path, seed: int = 120) -> tuple[str, list[int]]:
    """A pool file holding a prompt of 2 blocks whose second block was changed on the device
    behind the store's back. A verified retrieve of it fails at the wait that completes its last
    layer, and every wait after that (objstore keeps the verification's failure), so a layer
    issued again behind the last one fails too."""
    pool = tmp_path / "pool.img"
    prompt = tokens(seed, 2)
    with tutti.Store.open(f"emu:{pool}", GEOMETRY, format=True, create_bytes=64 << 20) as store:
        layout = store.allocate_kv(4, "block_major")
        block = np.from_dlpack(layout.layer(0)).reshape(4, -1)
        block[:2] = 0
        block[1, :16] = np.frombuffer(b"tutti-corruption", dtype=np.uint8)
        store_prompt(store, prompt, [0, 1])
    data = bytearray(pool.read_bytes())
    at = data.find(b"tutti-corruption")
    assert at > 0, "the stored block is on the device file"
    data[at] ^= 0xFF
    pool.write_bytes(bytes(data))
    return f"emu:{pool}", prompt
