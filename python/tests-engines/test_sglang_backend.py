"""tutti.sglang.TuttiHiCacheStorage against SGLang 0.5.23's real classes: built by SGLang's
StorageBackendFactory from the dynamic backend's extra config, registered on a real MHA host
pool (`MHATokenToKVPoolHost`, on the CPU) in its layer-first and page layouts, and driven as
SGLang's cache controller drives it (batch_exists for the hit prefix, batch_set_v1 to back pages
up, batch_get_v1 to prefetch them into other host pages); bytes checked per page."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import pytest
import torch

import tutti
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.runtime_context import get_context
from stalled import StalledLayer
from tutti.sglang import TESTED_SGLANG_VERSION, TuttiHiCacheStorage, check_sglang_version

# More layers than the backend's default layers_in_flight (2): layer_first pages have layers
# waiting to be issued behind the ones in flight.
LAYERS = 4
HEADS = 2
HEAD_DIM = 64
PAGE = 16
DEVICE_PAGES = 8
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
# The checkpoint the tests' "server" serves. SGLang publishes its server args in every scheduler
# process before it builds the cache (run_scheduler_process: runtime_context.publish), and the
# backend names the checkpoint from them; this process publishes them likewise, once at import,
# so the child processes some tests run (which import this module) have them too.
CHECKPOINT = "/models/tutti-test-model"
PUBLISHED = get_context().override_server_args(model_path=CHECKPOINT)
PUBLISHED.install()


@contextmanager
def unpublished() -> Iterator[None]:
    """SGLang's config not published in this process (as in a process SGLang did not start)."""
    PUBLISHED.restore()
    try:
        yield
    finally:
        PUBLISHED.install()


def host_pool(layout: str, start_layer: int = 0, dtype: torch.dtype = torch.bfloat16, layers: int = LAYERS) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool on the CPU, over device buffers that live on the CPU too;
    `start_layer`: the model's first layer this pipeline stage holds; `dtype`: the device pool's
    store dtype (torch.uint8 for every fp8 --kv-cache-dtype); `layers`: the stage's layers."""
    tokens = DEVICE_PAGES * PAGE
    keys = tuple(torch.zeros(tokens, HEADS, HEAD_DIM, dtype=dtype) for _ in range(layers))
    values = tuple(torch.zeros(tokens, HEADS, HEAD_DIM, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=keys,
            v=values,
            k_data_ptrs=torch.tensor([t.data_ptr() for t in keys], dtype=torch.uint64),
            v_data_ptrs=torch.tensor([t.data_ptr() for t in values], dtype=torch.uint64),
            layout=KVBufferLayout.NHD,
        ),
        page_size=PAGE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=tokens, start_layer=start_layer, end_layer=start_layer + layers - 1,
    )  # fmt: skip


def storage_config(layout: str, extra: dict, **ranks) -> HiCacheStorageConfig:
    """As SGLang's cache controller fills it in (`_generate_storage_config`); `ranks` overrides
    the parallel ranks and sizes (tp_rank, pp_size, dp_rank, attn_cp_size, ...)."""
    fields = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1)
    fields.update(ranks)
    return HiCacheStorageConfig(
        **fields, is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name="tutti-test-model", extra_config=extra,
    )  # fmt: skip


def tutti_warnings(caplog) -> list[str]:
    """The messages of the warnings (or worse) the tutti package logged into `caplog`."""
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING and record.name.startswith("tutti")]


def extra_config(pool_file: Path, format_pool: bool, **changes) -> dict:
    config = {
        "backend_name": "tutti",
        "module_path": "tutti.sglang",
        "class_name": "TuttiHiCacheStorage",
        "interface_v1": 1,
        "devices": f"emu:{pool_file}",
        "format": format_pool,
        "create_bytes": 64 << 20,
        "lock_dir": str(pool_file.parent / "locks"),
    }
    config.update(changes)
    return {key: value for key, value in config.items() if value is not None}


def backend(layout: str, pool: MHATokenToKVPoolHost, extra: dict, **ranks) -> HiCacheStorage:
    """As SGLang's cache controller attaches storage: the factory, then register_mem_pool_host."""
    created = StorageBackendFactory.create_backend("dynamic", storage_config(layout, extra, **ranks), pool)
    created.register_mem_pool_host(pool)
    return created


def page_keys(seed: int, count: int) -> list[str]:
    """Page hashes chained over the prefix, hex strings as SGLang's get_hash_str returns (its native
    hash extension is built on first use by a JIT compiler this machine lacks)."""
    keys, prior = [], b""
    for page in range(count):
        prior = hashlib.sha256(prior + f"{seed}:{page}".encode()).digest()
        keys.append(prior.hex())
    return keys


def page_view(pool: MHATokenToKVPoolHost, page: int) -> torch.Tensor:
    """The host pool's bytes of one page (K and V, every layer), as a view."""
    buffer = pool.kv_buffer
    if pool.layout == "layer_first":
        return buffer[:, :, page * PAGE : (page + 1) * PAGE]
    if pool.layout == "page_first":
        return buffer[:, page * PAGE : (page + 1) * PAGE]
    # page_first_direct [2, pages, layers, page, heads, dim], page_head [2, pages, heads, page, layers, dim].
    return buffer[:, page]


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(page * PAGE, (page + 1) * PAGE, dtype=torch.int64) for page in pages])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_backup_then_prefetch_byte_exact(tmp_path: Path, layout: str):
    """Goal: pages backed up with batch_set_v1 are the hit prefix of batch_exists, come back
    byte-exact into other host pages with batch_get_v1, and are still there after the pool is
    reopened by a new backend (a restarted server)."""
    pool = host_pool(layout)
    storage = backend(layout, pool, extra_config(tmp_path / "pool.img", True))
    assert isinstance(storage, TuttiHiCacheStorage)
    keys = page_keys(1, 3)
    sources, targets = [2, 5, 7], [10, 11, 13]
    generator = torch.Generator().manual_seed(7)
    for page in sources:
        view = page_view(pool, page)
        view.copy_(torch.randn(view.shape, generator=generator).to(view.dtype))
    expected = [page_view(pool, page).clone() for page in sources]

    assert storage.batch_exists(keys) == 0
    assert storage.batch_set_v1(keys, indices(sources)) == [True, True, True]
    assert storage.batch_exists(keys) == 3
    assert storage.batch_exists(keys[:2] + page_keys(2, 1)) == 2
    assert storage.exists(keys[1]) and not storage.exists(page_keys(3, 1)[0])
    # Backing up the same pages again shares them (nothing rewritten), still a success.
    assert storage.batch_set_v1(keys, indices(sources)) == [True, True, True]

    for page in targets:
        page_view(pool, page).zero_()
    assert storage.batch_get_v1(keys, indices(targets)) == [True, True, True]
    for page, want in zip(targets, expected):
        assert torch.equal(page_view(pool, page), want), f"host page {page} differs"
    # A page not in the pool fails alone; the others of the batch are read.
    assert storage.batch_get_v1([keys[0], page_keys(4, 1)[0]], indices([12, 14])) == [True, False]
    storage.close()

    reopened = backend(layout, pool, extra_config(tmp_path / "pool.img", False))
    assert reopened.batch_exists(keys) == 3
    reopened.close()


def test_a_clear_through_sglang_retires_the_pool_so_nothing_stored_before_is_served(tmp_path: Path, caplog):
    """Goal: SGLang's /hicache/storage-backend/clear (e.g. after a weight update) answers 200 and
    logs "cleared successfully" whatever the backend does (scheduler.py ignores the outcome), so
    after a clear nothing stored before may be served. tutti cannot forget a pool's blocks: the
    clear retires the pool for this process (closed; lookups miss, nothing moves) with a warning
    that says so and what a restart does, and SGLang's own clear path reports success. Driven
    through UnifiedRadixCache.clear_storage_backend -> StorageAttachment.clear ->
    HybridCacheController.clear_storage_backend -> the backend's clear() (SGLang's classes from
    StorageAttachment down; UnifiedRadixCache's module imports openai, which this environment
    lacks, so its three-line clear_storage_backend is restated here)."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.unified_cache.storage_attachment import StorageAttachment

    storage = backend("page_first", host_pool("page_first"), extra_config(tmp_path / "pool.img", True))
    try:
        keys = page_keys(8, 2)
        assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
        assert storage.batch_exists(keys) == 2
        controller = SimpleNamespace(enable_storage=True, storage_backend=storage)
        controller.clear_storage_backend = lambda: HybridCacheController.clear_storage_backend(controller)
        existence = {keys[0]}
        cache = SimpleNamespace(cache_controller=controller, storage_existence_cache=existence)
        cache._storage_attachment = StorageAttachment(cache)

        def clear_storage_backend() -> bool:
            # UnifiedRadixCache.clear_storage_backend (unified_radix_cache.py, SGLang 0.5.23).
            ok = cache._storage_attachment.clear()
            if ok:
                cache.storage_existence_cache.clear()
            return ok

        with caplog.at_level("WARNING"):
            assert clear_storage_backend() is True
        assert "SGLang cleared the storage tier" in caplog.text and "format" in caplog.text
        assert existence == set()
        assert storage.batch_exists(keys) == 0 and not storage.exists(keys[0])
        assert storage.batch_get_v1(keys, indices([3, 4])) == [False, False]
        assert storage.batch_set_v1(page_keys(9, 1), indices([5])) == [False]
        # A second clear is a no-op.
        storage.clear()
    finally:
        storage.close()
    # The pool's blocks are still on the devices: a restart (a new process, with no record of
    # the clear) that opens the pool again (not "format": true, same fingerprint) serves them;
    # the warning says so. This process refuses to open it again (the next test).
    restarted = subprocess.run(
        [sys.executable, "-c", RESTARTED_CHILD, str(tmp_path), *keys],
        cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "EXISTS 2" in restarted.stdout, (restarted.stdout, restarted.stderr[-3000:])


# A restarted server's process: opens tmp/pool.img again and prints batch_exists of the keys.
RESTARTED_CHILD = """
import pathlib, sys
from test_sglang_backend import *
reopened = backend("page_first", host_pool("page_first"), extra_config(pathlib.Path(sys.argv[1]) / "pool.img", False))
print("EXISTS", reopened.batch_exists(sys.argv[2:]), flush=True)
reopened.close()
"""


def test_the_cleared_pool_record_knows_a_device_however_it_is_spelled(tmp_path: Path):
    """Goal: the record of pools cleared in this process names the storage, not the string: a
    PCI function in any of the spellings tutti's parser takes (short fields, no domain, any
    case), and a pool file by a hard link or through emu: or uring:, are one device."""
    from tutti._sglang_keys import _device_identity

    spellings = ["vfio:1:0.0", "vfio:0:01:00.0", "vfio:01:0.0", "vfio:0000:01:00.0", "vfio:0000:01:00.0".upper().replace("VFIO", "vfio")]
    assert {_device_identity(spelling) for spelling in spellings} == {"vfio:0000:01:00.0"}
    assert _device_identity("vfio:0000:01:00.1") != _device_identity("vfio:0000:01:00.0")
    pool = tmp_path / "pool.img"
    pool.write_bytes(b"")
    (tmp_path / "link.img").hardlink_to(pool)
    assert _device_identity(f"emu:{pool}") == _device_identity(f"uring:{tmp_path / 'link.img'}")
    assert _device_identity("emu:mem:64m") is None


def test_a_pool_cleared_in_this_process_is_not_opened_again_in_it(tmp_path: Path):
    """Goal: a clear retires the pool of the backend it reached, and SGLang can build another
    backend in the same process: StorageAttachment.detach() then attach() (the admin API) makes
    a new one from the factory on the same host pool, which would open the same pool under the
    same fingerprint and serve the pages stored before the clear (the old weights'). So the
    process keeps a record of the pools it cleared (resolved devices and fingerprint), and
    opening one again without "format" is refused, naming the ways out: "format": true, other
    devices, or a new "model_fingerprint"; a pool formatted since is opened as any other."""
    pool = host_pool("page_first")
    first = backend("page_first", pool, extra_config(tmp_path / "pool.img", True))
    keys = page_keys(22, 2)
    assert first.batch_set_v1(keys, indices([1, 2])) == [True, True]
    first.clear()
    first.close()

    reopen = extra_config(tmp_path / "pool.img", False)
    created = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", reopen), pool)
    with pytest.raises(tutti.InvalidArgument, match=r"cleared.*\"format\": true.*\"model_fingerprint\""):
        created.register_mem_pool_host(pool)
    # The same file under another name is the same device.
    (tmp_path / "link.img").symlink_to(tmp_path / "pool.img")
    linked = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", extra_config(tmp_path / "link.img", False)), pool)
    with pytest.raises(tutti.InvalidArgument, match="cleared"):
        linked.register_mem_pool_host(pool)

    renamed = backend("page_first", pool, extra_config(tmp_path / "pool.img", False, model_fingerprint="ef" * 32))
    assert renamed.batch_exists(keys) == 0
    renamed.close()
    formatted = backend("page_first", pool, extra_config(tmp_path / "pool.img", True))
    assert formatted.batch_exists(keys) == 0
    assert formatted.batch_set_v1(keys, indices([1, 2])) == [True, True]
    formatted.close()
    again = backend("page_first", pool, reopen)
    assert again.batch_exists(keys) == 2, "a pool formatted after the clear is still refused"
    again.close()


def test_a_second_backend_on_the_devices_of_an_open_one_is_refused_naming_the_decode_offload_manager(tmp_path: Path):
    """Goal: on a PD decode server with --disaggregation-decode-enable-offload-kvcache, SGLang's
    decode KV offload manager (decode_kvcache_offload_manager.py) builds a cache controller, and
    so a backend, of its own beside the hierarchical radix cache's, from the same extra config and
    ranks: both fill the device template in alike and would open the same devices in one process.
    The second is refused with a ConfigError naming that cause and the way out (not the devices'
    "in use by another daemon ... held by pid <this process>", which blames another daemon); the
    devices are free again once the first backend closes."""
    from tutti._engine import ConfigError

    extra = extra_config(tmp_path / "pool.img", True)
    first = backend("page_first", host_pool("page_first"), extra)
    second = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", extra), None)
    with pytest.raises(ConfigError, match=r"disaggregation-decode-enable-offload-kvcache.*enable-hierarchical-cache") as refused:
        second.register_mem_pool_host(host_pool("page_first"))
    assert str(tmp_path / "pool.img") in str(refused.value)
    assert "daemon" not in str(refused.value)
    second.close()  # SGLang closes a backend whose attach failed: the first one's devices stay its own
    third = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", extra_config(tmp_path / "pool.img", False)), None)
    with pytest.raises(ConfigError, match="offload"):
        third.register_mem_pool_host(host_pool("page_first"))
    first.close()
    reopened = backend("page_first", host_pool("page_first"), extra_config(tmp_path / "pool.img", False))
    reopened.close()


def test_a_claim_refused_after_the_open_closes_the_pool_and_frees_its_devices(tmp_path: Path, monkeypatch):
    """Goal: the backend claims its devices again once its pool is open (a file the format just
    created has an inode only from then on); a claim refused there closes the pool and releases
    the devices, as a failed register_kv does, rather than leaving the store open (its device locks
    held) and the devices recorded for a backend whose attach failed: a new backend on the same
    devices opens."""
    import tutti.sglang as tutti_sglang
    from tutti._engine import ConfigError

    claim = tutti_sglang._claim_devices
    calls = []

    def claim_refused_after_the_open(owner: object, devices: list, identities: tuple) -> None:
        calls.append(identities)
        if len(calls) == 2:
            raise ConfigError("refused after the open (test)")
        claim(owner, devices, identities)

    monkeypatch.setattr(tutti_sglang, "_claim_devices", claim_refused_after_the_open)
    failed = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", extra_config(tmp_path / "pool.img", True)), None)
    with pytest.raises(ConfigError, match="refused after the open"):
        failed.register_mem_pool_host(host_pool("page_first"))
    assert len(calls) == 2
    assert failed._store is None or failed._store.closed
    monkeypatch.setattr(tutti_sglang, "_claim_devices", claim)
    # `failed` is still alive: its claim must be gone, not only dropped with it.
    backend("page_first", host_pool("page_first"), extra_config(tmp_path / "pool.img", False)).close()
    failed.close()


def test_a_backend_on_a_pool_file_another_one_is_creating_is_refused_naming_the_offload_manager(tmp_path: Path, monkeypatch):
    """Goal: a backend whose format creates its pool file claims it by its path before the open
    (the file has no inode yet) and by its inode after; a second backend of the process that comes
    between the two, and finds the file there, claims it by its path too, so it is refused naming
    the decode offload manager (as when it comes after the first's open), not by the first's device
    locks in a DeviceError that blames another daemon and this process's own pid."""
    import tutti.sglang as tutti_sglang
    from tutti._engine import ConfigError

    pool_file = tmp_path / "pool.img"
    # What the second backend's attach raised (None: it opened), once it was tried.
    between: list[Optional[BaseException]] = []

    class Store:
        @staticmethod
        def open(*args, **kwargs):
            store = tutti.Store.open(*args, **kwargs)
            if not between:  # the first backend's open (the second's, if it gets that far, opens plainly)
                between.append(None)
                assert pool_file.exists()  # created by the format
                second = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", extra_config(pool_file, False)), None)
                try:
                    second.register_mem_pool_host(host_pool("page_first"))
                except BaseException as error:
                    between[0] = error
                finally:
                    second.close()
            return store

    class Tutti:
        """tutti, but for a Store.open that lets the second backend in right after the first's open."""

        def __getattr__(self, name: str):
            return Store if name == "Store" else getattr(tutti, name)

    monkeypatch.setattr(tutti_sglang, "tutti", Tutti())
    first = backend("page_first", host_pool("page_first"), extra_config(pool_file, True))
    monkeypatch.undo()
    assert between and isinstance(between[0], ConfigError), f"the second backend got {between!r}"
    assert "disaggregation-decode-enable-offload-kvcache" in str(between[0])
    first.close()


def _child_exit_code(pid: int, still_waiting: str) -> int:
    """The exit code of forked child `pid`, waited for at most 20 s: past that the child is
    killed and the test fails with `still_waiting`."""
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(still_waiting)
        time.sleep(0.02)


@pytest.mark.parametrize("lock_held_at_fork", [False, True], ids=["lock-free", "lock-held-at-fork"])
def test_a_forked_child_claims_the_devices_its_parent_had_open(tmp_path: Path, lock_held_at_fork: bool):
    """Goal: a child forked from a process whose backend had devices open inherits no record of
    them: the parent's backend is not the child's (its store refuses every call there: "open or
    attach again in the child", crates/python/src/process.rs), so a backend the child builds on
    those devices, once the parent has closed its own, is not refused as the decode offload
    manager's second backend; and a fork taken while another thread of the parent held the
    record's lock leaves the child a lock it can take (not one no thread of the child will ever
    let go). The child reports by its exit code: 0 claimed, 2 refused."""
    from tutti import _sglang_keys as keys
    from tutti._engine import ConfigError

    class Owner:
        pass

    pool_file = tmp_path / "pool.img"
    pool_file.write_bytes(b"")
    devices = [f"emu:{pool_file}"]
    identities = keys._device_identities(devices)
    parent = Owner()
    keys._claim_devices(parent, devices, identities)
    held, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with keys._OPEN_DEVICES_LOCK:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_lock)
    if lock_held_at_fork:
        holder.start()
        assert held.wait(10)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            keys._claim_devices(Owner(), devices, identities)
            code = 0
        except ConfigError:
            code = 2
        finally:
            os._exit(code)
    release.set()
    if lock_held_at_fork:
        holder.join(10)
    keys._release_devices(parent)  # the parent closes its backend: the child's copy of it is no holder either
    code = _child_exit_code(pid, "the child's claim still waits, 20 s on, for the lock a thread of its parent held at the fork")
    assert code == 0, "the child was refused the devices its parent had open (2: refused)"


def test_a_forked_child_clears_an_inherited_host_pool_whatever_its_parent_s_threads_held():
    """Goal: a child forked while a storage thread of its parent held a backend's weight-epoch
    lock (SGLang's prefetch and backup threads take it on every page wave) can clear a host pool
    it inherited: the parent's backends are not told of the child's clears (their stores refuse
    every call in the child), so the wrapped clear does not wait on a lock no thread of the child
    will let go. Until 2026-12-02 the fork hook kept the clear watchers and the child's clear
    waited for ever."""
    from tutti import _sglang_keys as keys

    class HostPool:
        def __init__(self) -> None:
            self.cleared = 0

        def clear(self) -> None:
            self.cleared += 1

    host_pool = HostPool()
    epochs = keys._WeightEpochs(private_startup=True)
    assert keys._watch_host_pool_clears(host_pool, epochs)
    held, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with epochs._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            host_pool.clear()
            code = 0 if host_pool.cleared == 1 else 3
        finally:
            os._exit(code)
    release.set()
    holder.join(10)
    code = _child_exit_code(pid, "the child's clear still waits, 20 s on, for a weight-epoch lock a thread of its parent held at the fork")
    assert code == 0, "the child's clear of its inherited host pool failed"
    host_pool.clear()  # the parent's own clears still reach its watchers (and the pool)
    assert host_pool.cleared == 1


def test_sglang_s_own_hicache_fields_are_accepted(tmp_path: Path):
    """Goal: SGLang's PD decode KV offload manager hands the backend the extra config as json.loads
    reads it, with SGLang's own fields in it (the hierarchical cache's path removes them first:
    HybridCacheController.parse_storage_backend_extra_config); they are accepted (and ignored: they
    are SGLang's), with the types SGLang's own parse takes."""
    sglang_fields = dict(
        prefetch_threshold=512, prefetch_timeout_base=1, prefetch_timeout_per_ki_token=0.25, hicache_storage_pass_prefix_keys=True
    )
    backend("page_first", host_pool("page_first"), extra_config(tmp_path / "pool.img", True, **sglang_fields)).close()
    with pytest.raises(tutti.InvalidArgument, match="prefetch_threshold"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config("page_first", extra_config(tmp_path / "pool.img", True, prefetch_threshold="512")), None
        )


# Values of SGLang's own HiCache fields, as json.loads reads them from the extra config: booleans
# (ints to isinstance), integers past any u64 and past a float, NaN, Infinity, other types, null.
SGLANG_OWN_FIELD_VALUES = [512, 0, -1, True, False, 2**70, 10**400, 0.25, float("nan"), float("inf"), "512", None, [1]]


@pytest.mark.parametrize(
    "field", ["prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys"]
)
def test_sglang_s_own_hicache_fields_are_taken_exactly_as_sglang_s_own_parse_takes_them(tmp_path: Path, field: str):
    """Goal: a config that SGLang's hierarchical cache takes (its parse checks its own fields with
    isinstance, where a boolean is an int and an integer may be of any size, then float()s the
    timeouts: HybridCacheController.parse_storage_backend_extra_config) is not refused by the
    backend on the path where SGLang hands it the fields unchecked (PD decode's KV offload
    manager), and one SGLang refuses is refused too: each value against SGLang's parse itself.
    "prefetch_threshold": true opens a pool."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    differ = []
    for value in SGLANG_OWN_FIELD_VALUES:
        text = json.dumps({field: value})
        try:
            HybridCacheController.parse_storage_backend_extra_config(text)
            sglang_takes = True
        except (ValueError, OverflowError):
            sglang_takes = False
        extra = extra_config(tmp_path / "pool.img", True)
        extra[field] = json.loads(text)[field]
        try:
            StorageBackendFactory.create_backend("dynamic", storage_config("page_first", extra), None).close()
            tutti_takes = True
        except tutti.InvalidArgument as error:
            tutti_takes = False
            assert field in str(error)
        if tutti_takes != sglang_takes:
            differ.append(f"{text[:60]}: SGLang {'takes' if sglang_takes else 'refuses'} it, tutti {'takes' if tutti_takes else 'refuses'} it")
    assert not differ, differ
    if field == "prefetch_threshold":
        backend("page_first", host_pool("page_first"), extra_config(tmp_path / "pool.img", True, prefetch_threshold=True)).close()


def weight_version_change(version: str) -> None:
    """SGLang's Scheduler.record_weight_version_change (scheduler.py, SGLang 0.5.23), restated:
    Scheduler's module imports packages this environment lacks. An in-place weight update
    (update_weights_from_disk / _tensor / _distributed / _ipc) and /update_weight_version call it
    with the version they name."""
    get_context().override("scheduler.weight_version", weight_version=version)


def disk_weight_update(model_path: str, load_format: str = "auto") -> None:
    """SGLang's ModelRunner.update_model_fields (model_runner.py, SGLang 0.5.23), restated: every
    successful update_weights_from_disk of the target model records the path and load format it
    loaded, the same path too and whether it names a weight_version or not."""
    get_context().override("model_runner.update_model_fields", model_path=model_path, load_format=load_format)


def sglang_flush(pool: MHATokenToKVPoolHost) -> None:
    """SGLang's cache flush as it reaches the host pool (Scheduler.flush_cache ->
    UnifiedRadixCache._reset_full: cache_controller.reset(), which joins the storage threads and
    empties their queues, then mem_pool_host.clear())."""
    pool.clear()


def test_a_weight_version_that_comes_back_is_still_a_change(tmp_path: Path):
    """Goal: weight versions A -> B -> A between two storage calls are two in-place weight updates
    (a label may be reused for other weights): the pages stored under the first A were computed
    with the first A's weights and are not served after (batch_exists, exists, batch_get_v1)."""
    pool = host_pool("page_first")
    keys = page_keys(24, 2)
    with get_context().override_server_args(model_path=CHECKPOINT, weight_version="A"):
        storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True))
        try:
            assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
            assert storage.batch_exists(keys) == 2
            weight_version_change("B")
            weight_version_change("A")
            assert storage.batch_exists(keys) == 0, "the first A's pages are served after A -> B -> A"
            assert not storage.exists(keys[0])
            assert storage.batch_get_v1(keys, indices([3, 4])) == [False, False]
        finally:
            storage.close()


def test_after_a_weight_version_change_pages_are_stored_again_once_sglang_flushes(tmp_path: Path, caplog):
    """Goal: an in-place weight update (or /update_weight_version alone) does not retire the
    tier: the backend moves to a new key space, where the old weights' pages miss (they age out
    by LRU) and the new weights' pages are stored and found. A backup after the change but
    before SGLang's cache flush may carry the old weights' KV (a backup operation queued before
    the change, on a storage thread the flush has not joined yet; or no flush at all): it is
    refused, with a warning, until SGLang's flush clears the host pool; from then on pages are
    stored and read back byte-exact. Nothing is recorded as cleared: a backend built again in
    this process (detach then attach) opens the pool, and backs up once SGLang flushes."""
    pool = host_pool("page_first")
    keys = page_keys(25, 2)
    with get_context().override_server_args(model_path=CHECKPOINT):
        storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True))
        try:
            assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
            sglang_flush(pool)  # a flush before the change (e.g. /flush_cache, then an update without flush_cache)
            weight_version_change("rl-step-1")
            assert storage.batch_exists(keys) == 0, "the old weights' pages are served after a weight update"
            with caplog.at_level("WARNING"):
                assert storage.batch_set_v1(keys, indices([1, 2])) == [False, False], "a backup before the flush was stored"
            assert "flush" in caplog.text
            assert storage.batch_exists(keys) == 0
            sglang_flush(pool)
            generator = torch.Generator().manual_seed(25)
            for page in (3, 4):
                view = page_view(pool, page)
                view.copy_(torch.randn(view.shape, generator=generator).to(view.dtype))
            assert storage.batch_set_v1(keys, indices([3, 4])) == [True, True], "no page is stored after a weight update"
            assert storage.batch_exists(keys) == 2
            assert storage.exists(keys[1])
            assert storage.batch_get_v1(keys, indices([5, 6])) == [True, True]
            assert torch.equal(page_view(pool, 5), page_view(pool, 3)) and torch.equal(page_view(pool, 6), page_view(pool, 4))
            # The next update: its pages are refused again until the next flush.
            weight_version_change("rl-step-2")
            assert storage.batch_exists(keys) == 0
            assert storage.batch_set_v1(keys, indices([3, 4])) == [False, False]
        finally:
            storage.close()
        # Built after a change, its host pool may hold older KV: its backups wait for a flush too.
        again = backend("page_first", pool, extra_config(tmp_path / "pool.img", False))
        try:
            later = page_keys(26, 1)
            assert again.batch_set_v1(later, indices([7])) == [False]
            sglang_flush(pool)
            assert again.batch_set_v1(later, indices([7])) == [True]
            assert again.batch_exists(later) == 1
        finally:
            again.close()


def test_a_weight_update_from_disk_without_a_version_is_a_change(tmp_path: Path):
    """Goal: update_weights_from_disk naming no weight_version (to another checkpoint, or the
    same path, whose files may have been rewritten) serves other weights: the pages stored
    before it miss, and the pages stored after it (once SGLang flushes) are in a key space of
    their own, not the startup one a restart on the startup checkpoint opens."""
    pool = host_pool("page_first")
    keys = page_keys(28, 2)
    later = page_keys(29, 2)
    again = page_keys(30, 1)
    with get_context().override_server_args(model_path=CHECKPOINT):
        storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True))
        try:
            assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
            disk_weight_update("/models/other-checkpoint")
            assert storage.batch_exists(keys) == 0, "the startup weights' pages are served after an update from disk"
            sglang_flush(pool)
            assert storage.batch_set_v1(later, indices([3, 4])) == [True, True]
            assert storage.batch_exists(later) == 2
            disk_weight_update(CHECKPOINT)  # back to the startup path: other files, maybe
            assert storage.batch_exists(later) == 0, "the pages of the first disk update are served after the second"
            sglang_flush(pool)
            assert storage.batch_set_v1(again, indices([5])) == [True]
        finally:
            storage.close()
    with get_context().override_server_args(model_path=CHECKPOINT):
        restarted = backend("page_first", pool, extra_config(tmp_path / "pool.img", False))
        try:
            assert restarted.batch_exists(later) == 0, "a restart on the startup checkpoint is served pages of weights loaded from disk"
            assert restarted.batch_exists(again) == 0, "a restart is served pages of weights reloaded from the startup path"
            assert restarted.batch_exists(keys) == 2
        finally:
            restarted.close()


class CountedLog(list):
    """SGLang's overrides log, counting the entries read from it (a whole iteration counts them
    all; a slice, its length)."""

    def __init__(self, entries: list) -> None:
        super().__init__(entries)
        self.read = 0

    def __iter__(self):
        self.read += len(self)
        return super().__iter__()

    def __getitem__(self, index):
        got = super().__getitem__(index)
        self.read += len(got) if isinstance(index, slice) else 1
        return got


def test_storage_calls_read_only_the_overrides_added_since_the_last(tmp_path: Path):
    """Goal: SGLang's overrides log grows for the life of the process (adaptive speculative
    decoding adds an entry at every step switch; attach, detach and /update_server_args too), and
    the backend reads it at every storage call: each call reads only the entries added since the
    one before, not the whole log (a copy of 50k entries took 71 ms per call), and still sees a
    weight change added after them."""
    pool = host_pool("page_first")
    keys = page_keys(31, 2)
    with get_context().override_server_args(model_path=CHECKPOINT):
        context = get_context()
        log = context._overrides_log = CountedLog(context._overrides_log)  # restored with the override
        storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True))
        try:
            assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
            # What get_context().override appends (adaptive speculative decoding's step switches),
            # appended directly: 200k validated overrides would take the test's time.
            for step in range(200_000):
                log.append(("adaptive_spec.restore", {"speculative_num_steps": 3 + step % 2}))
            log.read = 0
            for _ in range(100):
                assert storage.batch_exists(keys) == 2
            assert log.read < 250_000, f"100 storage calls read {log.read} entries of a log of {len(log)}"
            weight_version_change("after-the-switches")
            assert storage.batch_exists(keys) == 0, "a weight change after the switches is not seen"
        finally:
            storage.close()


@pytest.mark.parametrize("fingerprint", ["default", "explicit"])
def test_an_overrides_log_that_cannot_be_read_at_attach_is_refused(tmp_path: Path, fingerprint: str):
    """Goal: the backend sees in-place weight updates only through SGLang's overrides log; in a
    process where it cannot be read (another SGLang release keeping it elsewhere) the attach is
    refused, naming the log and the way out, before the pool is opened, not accepted blind to
    every later update (whose pages would then be served the old weights' KV). An explicit
    "model_fingerprint", which skips every other read of SGLang's config, is refused too."""
    pool = host_pool("page_first")
    explicit = {"model_fingerprint": "ab" * 32} if fingerprint == "explicit" else {}
    with get_context().override_server_args(model_path=CHECKPOINT):
        get_context()._overrides_log = None  # neither the list nor overrides_log() reads; restored with the override
        with pytest.raises(tutti.InvalidArgument, match=r"overrides log.*weight update.*SGLang 0\.5\.23"):
            backend("page_first", pool, extra_config(tmp_path / "pool.img", True, **explicit))
    assert not (tmp_path / "pool.img").exists(), "the pool was opened before the refusal"


def test_an_overrides_log_that_becomes_unreadable_is_a_change(tmp_path: Path, caplog):
    """Goal: a log read at the attach that cannot be read later may hide a weight update: each
    call that cannot read it counts as one more change, so the pages stored before miss and
    nothing is backed up, a flush or not, while it stays unreadable; once it reads again, the
    backend is in a key space of its own whose backups wait for SGLang's next flush. Logged twice
    in all, however many calls and backup waves meet it: one warning when the log becomes
    unreadable, one when it reads again (never "SGLang changed its weights", which it may not
    have); a weight change recorded after that is warned of as usual."""
    pool = host_pool("page_first")
    keys = page_keys(32, 2)
    later = page_keys(33, 1)

    with get_context().override_server_args(model_path=CHECKPOINT):
        context = get_context()
        storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True, model_fingerprint="ab" * 32))
        try:
            assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
            assert storage.batch_exists(keys) == 2
            log, context._overrides_log = context._overrides_log, None
            caplog.clear()
            with caplog.at_level("WARNING"):
                assert storage.batch_exists(keys) == 0, "pages stored before are served while the overrides log cannot be read"
                sglang_flush(pool)
                for _ in range(3):
                    assert storage.batch_set_v1(later, indices([3])) == [False], "a backup was stored while the overrides log cannot be read"
            blind = tutti_warnings(caplog)
            assert len(blind) == 1 and "overrides log" in blind[0] and "cannot be read" in blind[0], blind
            caplog.clear()
            context._overrides_log = log
            with caplog.at_level("WARNING"):
                assert storage.batch_exists(keys) == 0, "pages stored before the log became unreadable are served once it reads again"
                for _ in range(3):
                    assert storage.batch_set_v1(later, indices([3])) == [False], "a backup before SGLang's flush was stored"
            again = tutti_warnings(caplog)
            assert len(again) == 1 and "overrides log" in again[0] and "reads again" in again[0], again
            assert "flush" in again[0]
            sglang_flush(pool)
            assert storage.batch_set_v1(later, indices([3])) == [True]
            assert storage.batch_exists(later) == 1
            caplog.clear()
            weight_version_change("after-the-blind-spell")
            with caplog.at_level("WARNING"):
                assert storage.batch_set_v1(keys, indices([1, 2])) == [False, False]
            assert any("changed its weights" in message for message in tutti_warnings(caplog)), tutti_warnings(caplog)
        finally:
            storage.close()


def test_a_backup_as_the_log_reads_again_is_not_taken_for_a_weight_change(tmp_path: Path, caplog):
    """Goal: a backup whose read of the epoch is the overrides log's first good read after a spell
    it could not be read (an epoch no change SGLang recorded began) is refused without the
    warning "SGLang changed its weights", even when another thread's storage call meets the log
    unreadable again while the backup decides (which starts the next spell). Before, the backup
    read the epoch, whether it is storable and whether it began unseen under three holds of the
    lock: a call landing between them moved the spell on, and the backup warned of a change
    SGLang never recorded. The other thread's call is made to land right after the backup's
    first call into the weight epochs returns."""
    pool = host_pool("page_first")
    keys = page_keys(34, 1)

    with get_context().override_server_args(model_path=CHECKPOINT):
        context = get_context()
        storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True, model_fingerprint="ab" * 32))
        try:
            epochs = storage._epochs
            log, context._overrides_log = context._overrides_log, None
            with caplog.at_level("WARNING"):
                assert storage.batch_exists(keys) == 0  # the spell begins
            context._overrides_log = log
            calls = []

            def other_thread_meets_the_log_unreadable() -> None:
                context._overrides_log = None
                try:
                    type(epochs).current(epochs)
                finally:
                    context._overrides_log = log

            def interleaved(name: str):
                method = getattr(epochs, name)

                def call(*args, **kwargs):
                    calls.append(name)
                    result = method(*args, **kwargs)
                    if len(calls) == 1:
                        other_thread_meets_the_log_unreadable()
                    return result

                return call

            for name in [name for name in dir(type(epochs)) if not name.startswith("_") and name != "salt"]:
                setattr(epochs, name, interleaved(name))
            caplog.clear()
            with caplog.at_level("WARNING"):
                assert storage.batch_set_v1(keys, indices([1])) == [False], "a backup before SGLang's flush was stored"
            assert calls, "the backup did not ask the weight epochs"
            changed = [message for message in tutti_warnings(caplog) if "changed its weights" in message]
            assert not changed, f"calls {calls}: {changed}"
        finally:
            storage.close()


def test_the_startup_weight_version_names_the_key_space(tmp_path: Path):
    """Goal: a server restarted on the same checkpoint arguments with another --weight-version
    serves other weights (as a live version change says): it is not served the pages of the
    first version; restarted with the first version again, it is."""
    pool = host_pool("page_first")
    keys = page_keys(27, 2)
    with get_context().override_server_args(model_path=CHECKPOINT, weight_version="v1"):
        first = backend("page_first", pool, extra_config(tmp_path / "pool.img", True))
        assert first.batch_set_v1(keys, indices([1, 2])) == [True, True]
        first.close()
    with get_context().override_server_args(model_path=CHECKPOINT, weight_version="v2"):
        other = backend("page_first", pool, extra_config(tmp_path / "pool.img", False))
        assert other.batch_exists(keys) == 0, "a restart with --weight-version v2 is served v1's pages"
        other.close()
    with get_context().override_server_args(model_path=CHECKPOINT, weight_version="v1"):
        same = backend("page_first", pool, extra_config(tmp_path / "pool.img", False))
        assert same.batch_exists(keys) == 2
        same.close()


class SlowWait:
    """A tutti.Request whose every wait first sleeps: a wave's requests stay live long enough for
    SGLang's other thread to move pages meanwhile."""

    def __init__(self, request) -> None:
        self._request = request

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def wait(self, timeout_s=30.0):
        time.sleep(0.05)
        return self._request.wait(timeout_s)


class SlowStore:
    def __init__(self, store) -> None:
        self._store = store

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def prepare_retrieve(self, tokens, block_ids):
        return SlowWait(self._store.prepare_retrieve(tokens, block_ids))

    def prepare_store(self, tokens, block_ids):
        return SlowWait(self._store.prepare_store(tokens, block_ids))


@pytest.mark.parametrize("requests_max", [1, 2, 3])
def test_prefetch_and_backup_threads_share_requests_max(tmp_path: Path, requests_max: int):
    """Goal: SGLang prefetches (batch_get_v1) and backs up (batch_set_v1) on two threads at once,
    on one store of requests_max request places; each thread's waves must fit beside the other's
    (a page refused for want of a place ends SGLang's count of a prefetch there), so both
    threads move every page."""
    pool = host_pool("page_first")
    storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True, requests_max=requests_max))
    try:
        stored, fresh = page_keys(11, 6), page_keys(12, 4)
        generator = torch.Generator().manual_seed(11)
        for page in range(16):
            view = page_view(pool, page)
            view.copy_(torch.randn(view.shape, generator=generator).to(view.dtype))
        assert storage.batch_set_v1(stored, indices(list(range(6)))) == [True] * 6
        expected = [page_view(pool, page).clone() for page in range(6)]
        for page in range(6, 12):
            page_view(pool, page).zero_()
        storage._store = SlowStore(storage._store)
        start = threading.Barrier(2)
        results: dict = {}

        def move(name, call):
            start.wait()
            results[name] = call()

        threads = [
            threading.Thread(target=move, args=("prefetch", lambda: storage.batch_get_v1(stored, indices(list(range(6, 12)))))),
            threading.Thread(target=move, args=("backup", lambda: storage.batch_set_v1(fresh, indices(list(range(12, 16)))))),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert results == {"prefetch": [True] * 6, "backup": [True] * 4}
        for page, want in zip(range(6, 12), expected):
            assert torch.equal(page_view(pool, page), want), f"host page {page} differs"
        assert storage.batch_exists(fresh) == 4
    finally:
        storage.close()


def test_a_wait_for_a_request_place_is_bounded_and_ends_with_the_pool():
    """Goal: a wave waiting for a request place SGLang's other thread holds gives up after its
    bound, or at once when the pool is closed, rather than block SGLang's thread for good."""
    from tutti.sglang import _RequestPlaces

    places = _RequestPlaces(1)
    places.enter()
    assert places.take(5, 1.0, lambda: False) == 1
    began = time.monotonic()
    assert places.take(1, 0.2, lambda: False) == 0
    assert 0.15 < time.monotonic() - began < 5
    closed = threading.Event()
    threading.Timer(0.1, lambda: (closed.set(), places.wake())).start()
    began = time.monotonic()
    assert places.take(1, 30.0, closed.is_set) == 0
    assert time.monotonic() - began < 5
    places.give(1)
    assert places.take(1, 0.2, lambda: False) == 1
    places.leave()


class StoreWithStalledLayers:
    """The backend's tutti.Store whose reads (or stores) stall; notes whether the backend closed
    it, and can pretend the close kept the memory registered (queue pairs not deleted)."""

    def __init__(self, store, stall_stores: bool = False, close_keeps_memory: bool = False) -> None:
        self._store = store
        self.stall_stores = stall_stores
        self.close_keeps_memory = close_keeps_memory
        self.closed_by_backend = False

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def prepare_retrieve(self, tokens, block_ids):
        request = self._store.prepare_retrieve(tokens, block_ids)
        return request if self.stall_stores else StalledLayer(request)

    def prepare_store(self, tokens, block_ids):
        request = self._store.prepare_store(tokens, block_ids)
        return StalledLayer(request) if self.stall_stores else request

    def close(self, timeout_s=None):
        self.closed_by_backend = True
        self._store.close(timeout_s=timeout_s)

    def leaked_registrations(self) -> int:
        return 1 if self.close_keeps_memory else self._store.leaked_registrations()


def stalled_backend(tmp_path: Path, **stall) -> tuple[HiCacheStorage, StoreWithStalledLayers, list[str]]:
    """A backend with two pages backed up, then its store wrapped to stall."""
    pool = host_pool("page_first")
    storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True, timeout_s=0.2))
    keys = page_keys(5, 2)
    assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
    wrapped = StoreWithStalledLayers(storage._store, **stall)
    storage._store = wrapped
    return storage, wrapped, keys


def test_a_read_whose_layer_never_completes_closes_the_pool_before_its_pages_are_handed_back(tmp_path: Path):
    """Goal: SGLang reuses the host pages of pages batch_get_v1 reports not read, so a read whose
    layer does not complete returns only after the pool is closed (its queue pairs deleted: no
    controller writes those pages any more); the backend then moves nothing more and misses."""
    storage, wrapped, keys = stalled_backend(tmp_path)
    try:
        assert storage.batch_get_v1(keys, indices([3, 4])) == [False, False]
        assert wrapped.closed_by_backend and wrapped._store.closed, "the pages were handed back with the pool open"
        assert storage.batch_exists(keys) == 0 and not storage.exists(keys[0])
        assert storage.batch_get_v1(keys, indices([3, 4])) == [False, False]
        assert storage.batch_set_v1(page_keys(6, 1), indices([5])) == [False]
    finally:
        storage.close()


UNSAFE_SCENARIOS = {
    # The stuck read's own close is not confirmed.
    "read": "storage, wrapped, keys = stalled_backend(tmp, close_keeps_memory=True)\n"
    "storage.batch_get_v1(keys, indices([3, 4]))",
    # A stuck backup's close is not confirmed: a read on SGLang's other thread may have been in
    # flight on the queue pairs that were kept.
    "backup": "storage, wrapped, keys = stalled_backend(tmp, stall_stores=True, close_keeps_memory=True)\n"
    "storage.batch_set_v1(page_keys(7, 2), indices([3, 4]))",
    # The other thread's backup closes the pool unconfirmed while this read is in flight.
    "other thread": "storage, wrapped, keys = stalled_backend(tmp, close_keeps_memory=True)\n"
    "wrapped.prepare_retrieve = lambda tokens, block_ids: ClosedUnderIt(wrapped._store.prepare_retrieve(tokens, block_ids), storage)\n"
    "storage.batch_get_v1(keys, indices([3, 4]))",
    # SGLang's own close (shutdown or detach), not confirmed, with its other thread maybe reading.
    "close": "storage, wrapped, keys = stalled_backend(tmp, close_keeps_memory=True)\nstorage.close()",
}

UNSAFE_CHILD = """
import logging, pathlib, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from test_sglang_backend import *
tmp = pathlib.Path(sys.argv[1])
try:
{body}
except BaseException as error:
    print("RAISED", type(error).__name__, error, flush=True)
    sys.exit(3)
print("RETURNED", flush=True)
"""


@pytest.mark.parametrize("scenario", sorted(UNSAFE_SCENARIOS))
def test_a_pool_whose_close_is_not_confirmed_ends_the_process(tmp_path: Path, scenario: str):
    """Goal: when closing the pool does not confirm that its queue pairs were deleted, a device
    may still write SGLang's host pages; SGLang catches every exception of a storage call (and
    frees the pages it counts not moved), so no call returns or raises to it: the process logs
    why at critical level and aborts (SIGABRT, a crash a supervisor sees). Run in a child."""
    body = "\n".join("    " + line for line in UNSAFE_SCENARIOS[scenario].splitlines())
    child = subprocess.run(
        [sys.executable, "-c", UNSAFE_CHILD.format(body=body), str(tmp_path)],
        cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -signal.SIGABRT, (child.returncode, child.stdout, child.stderr[-3000:])
    assert "RETURNED" not in child.stdout and "RAISED" not in child.stdout
    assert "CRITICAL" in child.stderr and "host pages may still be written" in child.stderr, child.stderr[-3000:]
    assert "ends the process" in child.stderr, child.stderr[-3000:]


def test_a_backup_whose_layer_never_completes_closes_the_pool_and_does_not_raise(tmp_path: Path):
    """Goal: a backup only reads its host page, so a stuck one is reported not stored (SGLang may
    reuse the page); the pool is closed rather than left holding a request place and pins for
    good. (When that close is not confirmed the process ends: see the test above.)"""
    storage, wrapped, _ = stalled_backend(tmp_path, stall_stores=True, close_keeps_memory=False)
    try:
        assert storage.batch_set_v1(page_keys(7, 2), indices([3, 4])) == [False, False]
        assert wrapped.closed_by_backend
        assert storage.batch_exists(page_keys(7, 2)) == 0
    finally:
        storage.close()


class ClosedUnderIt:
    """A tutti.Request whose wait finds the pool closed by SGLang's other thread (a stuck backup)
    whose close kept the memory registered: the wait fails and the store is closed under it."""

    def __init__(self, request, storage) -> None:
        self._request = request
        self._storage = storage

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def wait(self, timeout_s=None):
        self._storage._close_pool("the other thread's backup did not complete", pages_written=False)
        raise tutti.TimeoutError("injected: the store was closed under this layer")


class FinishRefused:
    """A tutti.Request whose layers complete but whose finish is refused as out of order (the
    store still counts a layer in flight the binding did not see)."""

    def __init__(self, request) -> None:
        self._request = request

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def finish(self):
        raise tutti.InvalidState("injected: a layer is still in flight")


def test_a_read_whose_request_cannot_be_ended_closes_the_pool(tmp_path: Path):
    """Goal: a read whose finish is refused because a layer is still in flight is not reported
    read, and its page is not handed back while the pool is open: the pool is closed first."""
    storage, wrapped, keys = stalled_backend(tmp_path)
    try:
        wrapped.prepare_retrieve = lambda tokens, block_ids: FinishRefused(wrapped._store.prepare_retrieve(tokens, block_ids))
        assert storage.batch_get_v1(keys, indices([3, 4])) == [False, False]
        assert wrapped.closed_by_backend, "a page whose request could not be ended was handed back with the pool open"
    finally:
        storage.close()


def test_every_abstract_method_of_the_base_class_is_implemented():
    """Goal: an SGLang upgrade that adds an abstract method to HiCacheStorage fails here."""
    assert not TuttiHiCacheStorage.__abstractmethods__
    for name in HiCacheStorage.__abstractmethods__:
        assert name in TuttiHiCacheStorage.__dict__, f"{name} is abstract in SGLang and not implemented"


def test_copying_interface_says_to_use_interface_v1(tmp_path: Path):
    """Goal: SGLang's copying calls (used only without interface_v1) raise an error naming it."""
    storage = backend("page_first", host_pool("page_first"), extra_config(tmp_path / "pool.img", True))
    try:
        for call in (lambda: storage.get("k"), lambda: storage.set("k"), lambda: storage.batch_get(["k"]), lambda: storage.batch_set(["k"])):
            with pytest.raises(tutti.InvalidState, match="interface_v1"):
                call()
    finally:
        storage.close()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"devices": None}, "missing required field 'devices'"),
        ({"devices": [1]}, "field 'devices' = \\[1\\]: must be a device string"),
        ({"devices": []}, "field 'devices' = \\[\\]: must be a device string"),
        ({"devices": ""}, "field 'devices' = '': must be a device string"),
        ({"devices": ["emu:a.img", ""]}, "field 'devices' = .*: must be a device string"),
        ({"interface_v1": 0}, "interface_v1"),
        ({"interface_v1": None}, "missing required field 'interface_v1'"),
        ({"device": "emu:x"}, "unknown field"),
        ({"timeout_s": -1}, "must be positive"),
        ({"timeout_s": float("inf")}, r"field 'timeout_s' = inf: must be at most 1e\+09 seconds"),
        ({"call_timeout_s": float("inf")}, r"field 'call_timeout_s' = inf: must be at most 1e\+09 seconds"),
        ({"call_timeout_s": 10**400}, r"field 'call_timeout_s' = an integer of 1329 bits: too large"),
        ({"format": "yes"}, "field 'format' must be bool"),
        ({"layers_in_flight": 5}, "field 'layers_in_flight' = 5: must be 1..=4"),
        ({"requests_max": 300, "layers_in_flight": 4}, "= 1200 IOCB sets, more than 1024"),
        ({"queue_depth": 4096}, "field 'queue_depth' = 4096: must be 2..=1024"),
        ({"slots_max": 2**64}, r"field 'slots_max' = 18446744073709551616: must be at most 18446744073709551615"),
        ({"create_bytes": 10**20}, r"field 'create_bytes' = 100000000000000000000: must be at most 18446744073709551615"),
        ({"requests_max": 2**64}, r"field 'requests_max' = 18446744073709551616: must be at most"),
        ({"requests_max": 65537}, r"field 'requests_max' = 65537: must be at most 65536"),
    ],
)
def test_bad_extra_config_says_what_to_fix(tmp_path: Path, changes: dict, message: str):
    """Goal: a missing, unknown or mistyped field of the extra config is an exception naming it,
    raised when SGLang's factory builds the backend."""
    with pytest.raises(tutti.InvalidArgument, match=message):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config("page_first", extra_config(tmp_path / "pool.img", True, **changes)), None
        )


def test_mla_models_are_refused(tmp_path: Path):
    config = storage_config("page_first", extra_config(tmp_path / "pool.img", True))
    config.is_mla_model = True
    with pytest.raises(tutti.InvalidArgument, match="MLA"):
        StorageBackendFactory.create_backend("dynamic", config, None)


def test_version_check_names_the_tested_version(monkeypatch):
    import sglang.version

    assert check_sglang_version() is True
    monkeypatch.setattr(sglang.version, "__version__", "0.5.22")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_sglang_version() is False
    assert any(TESTED_SGLANG_VERSION in str(warning.message) for warning in caught)


@pytest.mark.parametrize(
    ("layout", "requests_max", "layers_in_flight", "iocbs"),
    [
        # One layer a page: one IOCB set (one IOCB: a page is one block) per request.
        ("page_first", 32, 2, 64),
        ("page_first", 512, 2, 512),
        # requests_max x layers_in_flight sets of one IOCB, up to the 1024 the config allows.
        ("layer_first", 32, LAYERS, 128),
        ("layer_first", 512, 2, 1024),
    ],
)
def test_a_pool_is_given_one_iocb_per_page_layer_in_flight(
    tmp_path: Path, store_options: list, caplog, layout: str, requests_max: int, layers_in_flight: int, iocbs: int
):
    """Goal: an SGLang request is one page, one block: each layer in flight holds one IOCB (a
    page layer of up to 4 MiB of K: see the next test), so
    the pool gets requests_max x (its layers in flight) IOCBs (at least the store's 64), and a
    requests_max the config allows (up to 1024 / layers_in_flight) is never warned about as
    preparing fewer requests than it (iocbs_for's sizing for layers of up to 2048 blocks would
    double the IOCBs and warn at 512 x 2)."""
    extra = extra_config(tmp_path / "pool.img", True, requests_max=requests_max, layers_in_flight=layers_in_flight)
    with caplog.at_level("WARNING"):
        storage = backend(layout, host_pool(layout), extra)
    storage.close()
    assert [(name, options["iocbs"]) for name, options in store_options] == [("open", iocbs)]
    assert not any("longest" in message for message in tutti_warnings(caplog)), tutti_warnings(caplog)


def test_a_page_layer_of_more_commands_than_an_iocb_holds_gets_more_iocbs_per_request():
    """Goal: a request is one page, but in a page layout its K and V are each one object across
    every layer, cut into commands at the devices' MDTS (not known before the pool opens, so
    sized for the smallest transfer a command is sure to carry, 4 KiB): 2 x object / 4 KiB
    commands, one IOCB per 2048. Sized for two commands a page layer (bf62e81), a page past
    4 MiB of K (a 70B model's 160 MiB at tp 1 and 1024-token pages: 2560 commands at a 128 KiB
    MDTS) got one IOCB a request and half its prepares failed for want of IOCBs."""
    from tutti.sglang import _iocbs

    # Up to 4 MiB of K (Llama-3-8B, 64-token pages): 2048 commands, one IOCB a set.
    assert _iocbs(64, 1, 4 << 20) == 64
    assert _iocbs(512, 1, 4 << 20) == 512
    assert _iocbs(512, 2, 128 << 10) == 1024
    # One 4 KiB more: 2050 commands, two IOCBs a set, twice the IOCBs.
    assert _iocbs(64, 1, (4 << 20) + 4096) == 128
    assert _iocbs(32, 2, (4 << 20) + 4096) == 128
    # 160 MiB: 81920 commands at 4 KiB, 40 IOCBs a set; 8 requests take 320 (rounded to 512).
    assert _iocbs(8, 1, 160 << 20) == 512
    # More than 1024 are not given (see the next test for what is logged).
    assert _iocbs(32, 1, 160 << 20) == 1024


def test_iocbs_capped_for_the_smallest_command_are_not_warned_about_unless_no_mdts_would_fit(caplog):
    """Goal: the count sized for 4 KiB commands is a worst case (a device of 8 KiB MDTS), so
    capping it at 1024 is no shortfall on a device of larger MDTS: a 70B model's 160 MiB page
    object at requests_max 32 (40 IOCBs a set at 4 KiB, 1024 given) needs 64 at 128 KiB, and
    iocbs_for's "only 25 requests of the longest length" warning was false. It is logged below
    warning level; a warning comes only where even the largest transfer a command carries (2
    MiB, the driver's cap on MDTS) would not fit the sets in 1024."""
    from tutti.sglang import _iocbs

    with caplog.at_level("DEBUG", logger="tutti"):
        assert _iocbs(32, 1, 160 << 20) == 1024
    assert not tutti_warnings(caplog), tutti_warnings(caplog)
    assert any("8 KiB" in record.getMessage() for record in caplog.records), caplog.records
    caplog.clear()
    # 4 GiB objects: 4096 commands of K and V even at 2 MiB, 2 IOCBs a set, 2048 for 1024 sets.
    with caplog.at_level("DEBUG", logger="tutti"):
        assert _iocbs(512, 2, 4 << 30) == 1024
    warned = [message for message in tutti_warnings(caplog) if "longest" in message]
    assert warned, caplog.records
    # Its figure is for 2 MiB commands, the most any device carries: an upper bound, said so.
    assert all("at most 256 requests" in message and "smaller MDTS" in message for message in warned), warned


def test_a_pool_is_sized_from_its_page_s_object_bytes(tmp_path: Path, store_options: list, monkeypatch):
    """Goal: register_mem_pool_host sizes the pool's IOCBs from the bytes of its page's K
    object: the test's 16 KiB page object at a smallest command of 4 bytes (2 x 4096 commands, 4
    IOCBs a set) gets 4 x requests_max IOCBs."""
    import tutti.sglang

    monkeypatch.setattr(tutti.sglang, "_COMMAND_BYTES_MIN", 4)
    pool = host_pool("page_first")
    assert pool.kv_buffer[0, 0:PAGE].numel() * pool.kv_buffer.element_size() == 16 << 10
    storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True, requests_max=32))
    storage.close()
    assert [(name, options["iocbs"]) for name, options in store_options] == [("open", 128)]


class RecordingRequest:
    """A tutti.Request that notes, at each wait, how many of its layers were issued and how many
    returned by a wait before it."""

    def __init__(self, request, waits: list) -> None:
        self._request = request
        self._waits = waits
        self.issued = 0
        self.returned = 0

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def retrieve_layer(self, layer, **kwargs):
        assert layer == self.issued, "layers issued out of order"
        self.issued += 1
        return self._request.retrieve_layer(layer, **kwargs)

    def store_layer(self, layer, **kwargs):
        assert layer == self.issued, "layers issued out of order"
        self.issued += 1
        return self._request.store_layer(layer, **kwargs)

    def wait(self, timeout_s=30.0):
        self._waits.append((self.issued, self.returned))
        layer = self._request.wait(timeout_s)
        assert layer == self.returned, f"wait returned layer {layer}, expected {self.returned}"
        self.returned += 1
        return layer


class RecordingStore:
    def __init__(self, store) -> None:
        self._store = store
        self.waits: list = []

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def prepare_retrieve(self, tokens, block_ids):
        return RecordingRequest(self._store.prepare_retrieve(tokens, block_ids), self.waits)

    def prepare_store(self, tokens, block_ids):
        return RecordingRequest(self._store.prepare_store(tokens, block_ids), self.waits)


@pytest.mark.parametrize("layers_in_flight", [1, 2, LAYERS])
def test_a_layer_first_page_keeps_layers_in_flight(tmp_path: Path, layers_in_flight: int, store_options: list):
    """Goal: with layers_in_flight N a layer_first page's layers are issued N ahead of its waits
    (every wait finds N layers issued and not yet returned, fewer only at the page's last
    layers), for backups and prefetches alike, and the pages come back byte-exact."""
    pool = host_pool("layer_first")
    storage = backend("layer_first", pool, extra_config(tmp_path / "pool.img", True, layers_in_flight=layers_in_flight))
    try:
        assert storage._store.layers_in_flight == layers_in_flight
        # A page layout has one layer: its store holds one layer in flight, whatever N.
        paged = backend("page_first", host_pool("page_first"), extra_config(tmp_path / "paged.img", True, layers_in_flight=layers_in_flight))
        assert paged._store.layers_in_flight == 1
        paged.close()
        # The pools were opened with the default queue depth and the IOCBs their requests need.
        assert [(name, options["queue_depth"], options["layers_in_flight"], options["iocbs"]) for name, options in store_options] == [
            ("open", 1024, layers_in_flight, max(64, 32 * layers_in_flight)),
            ("open", 1024, 1, 64),
        ]
        recording = RecordingStore(storage._store)
        storage._store = recording
        keys = page_keys(9, 2)
        generator = torch.Generator().manual_seed(9)
        for page in (1, 2):
            view = page_view(pool, page)
            view.copy_(torch.randn(view.shape, generator=generator).to(view.dtype))
        expected = [page_view(pool, page).clone() for page in (1, 2)]
        assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
        for page in (3, 4):
            page_view(pool, page).zero_()
        assert storage.batch_get_v1(keys, indices([3, 4])) == [True, True]
        assert all(torch.equal(page_view(pool, page), want) for page, want in zip((3, 4), expected))
        # Two pages, stored then read: LAYERS waits each, every one with N layers ahead of it.
        assert len(recording.waits) == 4 * LAYERS
        for issued, returned in recording.waits:
            assert issued - returned == min(layers_in_flight, LAYERS - returned), recording.waits
    finally:
        storage.close()


def test_a_wait_for_request_places_is_bounded_by_one_wave_of_the_other_thread(tmp_path: Path, caplog):
    """Goal: SGLang's prefetch thread is serial, so a batch waiting for request places the other
    thread holds gives up after one wave of that thread takes when its rounds of waits end in
    time (timeout_s per round of layers + layers_in_flight - 1 rounds), not minutes later:
    timeout_s x (layers + layers_in_flight), here 0.2 s x (4 + 2) = 1.2 s (it was 0.2 s x
    (2 x 6 + 2) = 2.8 s)."""
    storage = backend("layer_first", host_pool("layer_first"), extra_config(tmp_path / "pool.img", True, timeout_s=0.2, requests_max=2))
    try:
        keys = page_keys(13, 2)
        assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
        # SGLang's other thread holds every request place.
        storage._places.enter()
        assert storage._places.take(2, 1.0, lambda: False) == 2
        began = time.monotonic()
        with caplog.at_level("WARNING"):
            assert storage.batch_get_v1(keys, indices([3, 4])) == [False, False]
        waited_s = time.monotonic() - began
        assert 1.1 < waited_s < 2.2, waited_s
        assert "no request place came free in 1.2 s" in caplog.text
        storage._places.give(2)
        storage._places.leave()
        assert storage.batch_get_v1(keys, indices([3, 4])) == [True, True]
    finally:
        storage.close()


def test_a_wait_for_request_places_cut_by_the_call_s_deadline_says_so(tmp_path: Path, caplog):
    """Goal: a batch whose wait for request places ends at the call's deadline (call_timeout_s),
    not after one wave of the other thread, says that the deadline ended it."""
    storage = backend("layer_first", host_pool("layer_first"), extra_config(tmp_path / "pool.img", True, requests_max=2, call_timeout_s=0.5))
    try:
        keys = page_keys(14, 2)
        assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
        # SGLang's other thread holds every request place.
        storage._places.enter()
        assert storage._places.take(2, 1.0, lambda: False) == 2
        began = time.monotonic()
        with caplog.at_level("WARNING"):
            assert storage.batch_get_v1(keys, indices([3, 4])) == [False, False]
        assert time.monotonic() - began < 2.0
        assert "before the call's deadline" in caplog.text and "call_timeout_s" in caplog.text, caplog.text
        storage._places.give(2)
        storage._places.leave()
    finally:
        storage.close()


def test_a_wait_for_request_places_with_a_huge_timeout_is_capped_not_an_error(tmp_path: Path):
    """Goal: the wait for request places is timeout_s x (layers + layers_in_flight), which for a
    large timeout_s (tutti.Store takes up to 1e9 s) and a model of more than a few layers exceeds
    what Python's Condition.wait takes (threading.TIMEOUT_MAX, about 9.2e9 s), and the wait
    raised OverflowError out of batch_get_v1 whenever SGLang's other thread held every place.
    It is capped: the wave waits and moves its pages once a place comes free."""
    layers = 12
    assert 1e9 * (layers + 2) > threading.TIMEOUT_MAX
    pool = host_pool("layer_first", layers=layers)
    storage = backend("layer_first", pool, extra_config(tmp_path / "pool.img", True, timeout_s=1e9, requests_max=2))
    try:
        keys = page_keys(26, 2)
        assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
        # SGLang's other thread holds every request place, and gives them back a little later.
        storage._places.enter()
        assert storage._places.take(2, 1.0, lambda: False) == 2
        results: dict = {}

        def prefetch():
            try:
                results["read"] = storage.batch_get_v1(keys, indices([3, 4]))
            except BaseException as error:  # noqa: BLE001 - the test reports it
                results["read"] = error

        reader = threading.Thread(target=prefetch)
        reader.start()
        time.sleep(0.3)
        storage._places.give(2)
        storage._places.leave()
        reader.join(30)
        assert not reader.is_alive(), "the prefetch did not take the places given back"
        assert results["read"] == [True, True], results["read"]
    finally:
        storage.close()


@pytest.mark.parametrize(
    ("ranks", "key"),
    [
        ({"tp_rank": 1, "tp_size": 2}, "tp_rank"),
        ({"pp_rank": 0, "pp_size": 2}, "pp_rank"),
        # --enable-dp-attention: tp_rank is the rank in the attention-TP group (0 in both groups
        # when attn_tp_size is 1); dp_rank tells the groups apart.
        ({"dp_rank": 1}, "dp_rank"),
        ({"attn_cp_rank": 0, "attn_cp_size": 2}, "cp_rank"),
    ],
)
def test_a_device_template_that_gives_two_scheduler_processes_one_device_is_refused(tmp_path: Path, ranks: dict, key: str):
    """Goal: SGLang runs one scheduler process per TP rank, pipeline stage, DP-attention group and
    CP rank, each building this backend from one extra config; a "devices" template without the
    key that tells this process from another would open the same devices twice (the second
    attach fails, the server does not start): refused when SGLang's factory builds the backend,
    naming the key to add."""
    # Every key but the one this process differs in.
    devices = f"emu:{tmp_path}/pool.img" if key == "tp_rank" else f"emu:{tmp_path}/pool-tp{{tp_rank}}.img"
    config = storage_config("page_first", extra_config(tmp_path / "pool.img", True, devices=devices), **ranks)
    with pytest.raises(tutti.InvalidArgument, match=r"field 'devices'.*put \"\{" + key + r"\}\" in every device string"):
        StorageBackendFactory.create_backend("dynamic", config, None)


@pytest.mark.parametrize(
    ("template", "ranks", "clash"),
    [
        # tp_rank 0 + pp_rank 11 and tp_rank 10 + pp_rank 1 both read "110".
        ("emu:{dir}/pools/{{pp_rank}}{{tp_rank}}.img", {"pp_size": 12, "tp_size": 12},
         r"tp_rank 0, pp_rank 11 and tp_rank 10, pp_rank 1 both get 'emu:.*/pools/110\.img'"),
        # pp_rank 1 + tp_rank 0 ("010") and pp_rank 0 + tp_rank 10 ("0010"): one PCI domain, 0x10
        # (a domain takes up to 4 hex digits; a bus of 3 is no PCI address, see below).
        ("vfio:0{{pp_rank}}{{tp_rank}}:00:00.0", {"pp_size": 2, "tp_size": 11},
         r"tp_rank 0, pp_rank 1 gets 'vfio:010:00:00\.0' and tp_rank 10, pp_rank 0 gets 'vfio:0010:00:00\.0', the same storage"),
        # A DP-attention group's process (dp_rank 11) knows the groups before it exist.
        ("emu:{dir}/dp{{dp_rank}}{{tp_rank}}.img", {"dp_rank": 11, "tp_size": 12},
         r"tp_rank 0, dp_rank 11 and tp_rank 10, dp_rank 1 both get 'emu:.*/dp110\.img'"),
        # A key in a path component that names no part of the storage.
        ("emu:{dir}/{{tp_rank}}/../pool.img", {"tp_size": 2},
         r"tp_rank 0 gets 'emu:.*/0/\.\./pool\.img' and tp_rank 1 gets 'emu:.*/1/\.\./pool\.img', the same storage"),
    ],
    ids=["pp-tp", "vfio domain", "dp-tp", "dot-dot"],
)  # fmt: skip
def test_a_device_template_whose_keys_give_two_processes_one_device_is_refused(tmp_path: Path, template: str, ranks: dict, clash: str):
    """Goal: a template with every key can still give two scheduler processes one device (keys
    side by side with no separator once a size reaches 11, a PCI domain read in hex whatever its
    leading zeros, a key in a path component that does not count): every process's devices,
    filled in for each rank the server's sizes imply, are compared, and a device two get is
    refused when SGLang's factory builds the backend, naming both processes' ranks and their
    spellings of it. The docs' own examples pass at the sizes they fit."""
    devices = template.format(dir=tmp_path)
    config = storage_config("page_first", extra_config(tmp_path / "pool.img", True, devices=devices), **ranks)
    with pytest.raises(tutti.InvalidArgument, match=r"field 'devices'.*gives two scheduler processes one device: " + clash):
        StorageBackendFactory.create_backend("dynamic", config, None)
    examples = [("vfio:0000:{pp_rank}{tp_rank}:00.0", {}), ("emu:/var/tutti/dp{dp_rank}-pp{pp_rank}-tp{tp_rank}.img", {"dp_rank": 3})]
    for example, more in examples:
        config = storage_config("page_first", extra_config(tmp_path / "pool.img", True, devices=example), pp_size=2, tp_size=8, **more)
        StorageBackendFactory.create_backend("dynamic", config, None)


def test_without_dp_attention_cp_ranks_follow_the_tp_rank(tmp_path: Path):
    """Goal: without DP attention SGLang derives each process's attention-CP rank from its TP
    rank (ranks laid out (dp, cp, tp), tp fastest: attn_cp_rank = (tp_rank // attn_tp_size) %
    attn_cp_size, attn_tp_size = tp_size / attn_cp_size; runtime_context.derive_attention_ranks),
    so at tp 4, cp 2 the processes are (tp 0, cp 0), (1, 0), (2, 1), (3, 1): the distinct-devices
    check fills the template in for those, not for tp x cp (which made up (tp 0, cp 1) and
    refused a template that gives the real processes distinct devices), and a refusal names two
    real processes. With DP attention the storage config's tp_rank is the attention-TP rank and
    every (tp, cp) pair is a process. SGLang's published attn_dp_enabled says which."""
    from sglang.srt.runtime_context import get_parallel
    from tutti.sglang import check_rank_devices

    def config(tp_rank: int, cp_rank: int) -> HiCacheStorageConfig:
        return storage_config("page_first", {}, tp_rank=tp_rank, tp_size=4, attn_cp_rank=cp_rank, attn_cp_size=2)

    processes = [(0, 0), (1, 0), (2, 1), (3, 1)]
    # The CP rank's component names nothing: the TP rank alone tells the real processes apart.
    distinct = f"emu:{tmp_path}/cp{{cp_rank}}/../tp{{tp_rank}}.img"
    shared = f"emu:{tmp_path}/tp{{tp_rank}}-cp{{cp_rank}}/../pool.img"
    with get_parallel().override(attn_dp_enabled=False):
        for tp_rank, cp_rank in processes:
            check_rank_devices(distinct, config(tp_rank, cp_rank))
        # Every process gets one device: the first two real processes are named.
        with pytest.raises(tutti.InvalidArgument, match=r"tp_rank 0, attn_cp_rank 0 gets .* and tp_rank 1, attn_cp_rank 0 gets"):
            check_rank_devices(shared, config(2, 1))
    with get_parallel().override(attn_dp_enabled=True):
        with pytest.raises(tutti.InvalidArgument, match=r"tp_rank 0, attn_cp_rank 0 gets .* and tp_rank 0, attn_cp_rank 1 gets"):
            check_rank_devices(distinct, config(0, 1))


def test_cp_ranks_are_not_derived_where_sglang_s_context_is_unset_or_disagrees(tmp_path: Path):
    """Goal: CP ranks are derived from TP ranks only where SGLang says DP attention is off
    (get_parallel().attn_dp_enabled, which raises while nothing is published) and this process's
    own CP rank is the one derived from its TP rank; else every (tp, cp) pair is taken to be a
    process. is_dp_attention_enabled() (read before) returns False with nothing published, so an
    unset context was taken as no DP attention and (tp 0, cp 1), no process under that
    derivation, had its template accepted though tp 0's of the other CP rank gets its device."""
    from sglang.srt.runtime_context import get_parallel
    from tutti.sglang import check_rank_devices

    def config(tp_rank: int, cp_rank: int) -> HiCacheStorageConfig:
        return storage_config("page_first", {}, tp_rank=tp_rank, tp_size=4, attn_cp_rank=cp_rank, attn_cp_size=2)

    distinct = f"emu:{tmp_path}/cp{{cp_rank}}/../tp{{tp_rank}}.img"
    clash = r"tp_rank 0, attn_cp_rank 0 gets .* and tp_rank 0, attn_cp_rank 1 gets"
    with unpublished():
        with pytest.raises(RuntimeError):
            get_parallel().attn_dp_enabled
        with pytest.raises(tutti.InvalidArgument, match=clash):
            check_rank_devices(distinct, config(0, 1))
    # Published as off, but this process's CP rank is not (0 // 2) % 2 = 0: not SGLang's layout.
    with get_parallel().override(attn_dp_enabled=False):
        with pytest.raises(tutti.InvalidArgument, match=clash):
            check_rank_devices(distinct, config(0, 1))


@pytest.mark.parametrize("devices", ["emu:mem:64m", "emu:null:1g", ["emu:mem:64m", "emu:{dir}/pool-pp{{pp_rank}}-tp{{tp_rank}}.img"]])
def test_memory_devices_need_no_rank_key(tmp_path: Path, devices):
    """Goal: a memory or no-storage device (emu:mem:SIZE, emu:null:SIZE) is each process's own
    and keeps nothing, so a template that names one without "{tp_rank}" gives no two processes
    one device: accepted at tp_size 2 (it was refused as giving every process the same device,
    though the distinct-devices check already excepted memory devices)."""
    from tutti.sglang import check_rank_devices

    listed = devices.format(dir=tmp_path) if isinstance(devices, str) else [device.format(dir=tmp_path) for device in devices]
    for tp_rank in (0, 1):
        check_rank_devices(listed, storage_config("page_first", {}, tp_rank=tp_rank, tp_size=2, pp_size=2))


@pytest.mark.parametrize(
    ("template", "ranks", "refusal"),
    [
        # A bus of 3 hex digits: tutti's PciAddress takes at most 2 (it would read as bus 0x10).
        ("vfio:0000:{{pp_rank}}{{tp_rank}}:00.0", {"pp_size": 2, "tp_size": 11},
         r"tp_rank 10, pp_rank 0 gets 'vfio:0000:010:00\.0', which is not a PCI address"),
        # A function past 7, and a slot past 0x1f.
        ("vfio:0000:01:00.{{tp_rank}}", {"tp_size": 9}, r"tp_rank 8 gets 'vfio:0000:01:00\.8', which is not a PCI address"),
        ("vfio:0000:01:{{tp_rank}}.0", {"tp_size": 21}, r"tp_rank 20 gets 'vfio:0000:01:20\.0', which is not a PCI address"),
        # What Python's int(..., 16) takes and tutti does not: a sign, a 0x prefix, an underscore.
        ("vfio:+1:00.0", {}, r"this scheduler process gets 'vfio:\+1:00\.0', which is not a PCI address"),
        ("vfio:0x1:00.0", {}, r"this scheduler process gets 'vfio:0x1:00\.0', which is not a PCI address"),
        ("vfio:0000:0_1:00.0", {}, r"this scheduler process gets 'vfio:0000:0_1:00\.0', which is not a PCI address"),
        # A path no file can have: os.stat raised a bare ValueError (embedded null byte).
        ("emu:{dir}/pool\0-tp{{tp_rank}}.img", {"tp_size": 2}, r"tp_rank 0 gets 'emu:.*/pool\\x00-tp0\.img', which names a path no file"),
    ],
    ids=["bus of 3 digits", "function 8", "slot 0x20", "sign", "0x prefix", "underscore", "nul byte"],
)  # fmt: skip
def test_a_device_tutti_cannot_open_is_refused_naming_the_process_that_gets_it(tmp_path: Path, template: str, ranks: dict, refusal: str):
    """Goal: a device template is filled in for every scheduler process and each device compared
    by the storage behind it; a vfio: device is parsed as tutti's PciAddress parses it (a domain
    of at most 4 hex digits, a bus and a slot of at most 2, the slot at most 0x1f, a function of
    1 digit at most 7, nothing but hex digits), so one that tutti would refuse to open is refused
    when SGLang's factory builds the backend, naming the ranks of the process that gets it, not
    taken for the address Python's int() reads in it; a path with a NUL byte is refused the same
    way, not a bare ValueError."""
    devices = template.format(dir=tmp_path)
    config = storage_config("page_first", extra_config(tmp_path / "pool.img", True, devices=devices), **ranks)
    with pytest.raises(tutti.InvalidArgument, match=r"field 'devices'.*: " + refusal):
        StorageBackendFactory.create_backend("dynamic", config, None)


def test_pipeline_stages_and_dp_attention_groups_open_their_own_pools_in_their_own_key_spaces(tmp_path: Path, store_options: list):
    """Goal: with pipeline parallelism (and DP attention) two scheduler processes share tp_rank
    0; "{pp_rank}", "{dp_rank}" and "{cp_rank}" in the devices template give each its own pool,
    and each pipeline stage (which holds other layers of the same page hashes) gets a key space
    of its own: a model fingerprint naming its stage and first layer. An unsplit model's
    fingerprint is the one it had."""
    template = f"emu:{tmp_path}/pool-pp{{pp_rank}}-dp{{dp_rank}}-cp{{cp_rank}}-tp{{tp_rank}}.img"
    stages = []
    for pp_rank in (0, 1):
        stage = backend("page_first", host_pool("page_first", start_layer=pp_rank * LAYERS),
                        extra_config(tmp_path / "unused.img", True, devices=template), pp_rank=pp_rank, pp_size=2, dp_rank=1)  # fmt: skip
        stages.append(stage)
    try:
        assert (tmp_path / "pool-pp0-dp1-cp0-tp0.img").is_file() and (tmp_path / "pool-pp1-dp1-cp0-tp0.img").is_file()
        for stage in stages:
            keys = page_keys(14, 1)
            assert stage.batch_set_v1(keys, indices([1])) == [True]
            assert stage.batch_exists(keys) == 1
    finally:
        for stage in stages:
            stage.close()
    unsplit = backend("page_first", host_pool("page_first"), extra_config(tmp_path / "pool.img", True))
    unsplit.close()
    fingerprints = [options["model_fingerprint"] for _, options in store_options]
    assert fingerprints[0] != fingerprints[1], "two pipeline stages share a key space"
    assert fingerprints[2] == tutti.fingerprint(
        tutti.fingerprint(
            "sglang hicache", "tutti-test-model", "model_path", CHECKPOINT, "revision", "None", "quantization", "None",
            "json_model_override_args", "{}", "load_format", "auto", "modelopt_quant", "None",
            "modelopt_checkpoint_restore_path", "None", "quantize_and_serve", "False", "rl_quant_profile", "None",
            "weight_version", "default", "draft model_path", "None", "draft revision", "None", "draft quantization", "None", "draft load_format", "None",
        ),
        "sglang page layout", "MHATokenToKVPoolHost", "page_first", LAYERS, HEADS, HEAD_DIM, str(torch.bfloat16), PAGE,
    ), "an unsplit model's fingerprint changed"  # fmt: skip


def test_heterogeneous_tp_head_splitting_is_refused(tmp_path: Path):
    """Goal: SGLang asks a backend to store page_head pages split by heads when "tp_lcm_size"
    (instances of other TP sizes sharing the store) exceeds this instance's TP size; tutti's
    pools are per rank and cannot do that: refused, naming the field, not silently ignored."""
    config = storage_config("page_head", extra_config(tmp_path / "pool.img", True), tp_size=2, tp_rank=0)
    config.extra_config["devices"] = f"emu:{tmp_path}/pool{{tp_rank}}.img"
    config.tp_lcm_size = 4
    config.should_split_heads = True
    with pytest.raises(tutti.InvalidArgument, match="tp_lcm_size"):
        StorageBackendFactory.create_backend("dynamic", config, None)


# page_first_direct's buffer is [2, pages, layers, page, ...]: whole pages by its shape.
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("short", ["size", "buffer"])
def test_a_host_pool_of_part_pages_is_refused_in_every_layout(tmp_path: Path, layout: str, short: str):
    """Goal: a host pool whose token count is not whole pages, or whose buffer does not hold its
    tokens, cannot be registered as pages; it is refused with a configuration error naming the
    pages in every layout (a page_first one was registered with pages of the wrong size, or
    fewer pages than SGLang addresses)."""
    pool = host_pool(layout)
    if short == "size":
        pool.size -= 1
        message = "271 tokens are not whole pages of 16"
    else:
        message = "does not hold its 272 tokens as 17 pages of 16"
    tokens = pool.size if short == "size" else pool.size - PAGE
    pool.kv_buffer = pool.kv_buffer[:, :, :tokens] if layout == "layer_first" else pool.kv_buffer[:, :tokens]
    created = StorageBackendFactory.create_backend("dynamic", storage_config(layout, extra_config(tmp_path / "pool.img", True)), pool)
    with pytest.raises(tutti.InvalidArgument, match=message):
        created.register_mem_pool_host(pool)


def test_a_host_pool_class_tutti_does_not_move_exactly_is_refused(tmp_path: Path, store_options: list):
    """Goal: only host pools whose every byte of a page tutti moves are registered. SGLang's
    MXFP8 host pool keeps the fp8 payload in a kv_buffer shaped like a page_first MHA pool's,
    but each page's scales in k_scale_host / v_scale_host, which tutti never stores: a page
    read back would carry the scales of the host page's previous occupant (wrong KV). It is
    refused at registration, naming the class. (Its constructor needs CUDA's JIT kernels, so
    the instance is the real class over a real MHA pool's state plus its scale buffers.)"""
    from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host

    real = host_pool("page_first")
    pool = object.__new__(MHATokenToKVPoolMXFP8Host)
    pool.__dict__.update(real.__dict__)
    pool.k_scale_host = torch.zeros(real.page_num, LAYERS, 64, dtype=torch.uint8)
    pool.v_scale_host = torch.zeros(real.page_num, LAYERS, 64, dtype=torch.uint8)
    created = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", extra_config(tmp_path / "pool.img", True)), pool)
    with pytest.raises(tutti.InvalidArgument, match="MHATokenToKVPoolMXFP8Host"):
        created.register_mem_pool_host(pool)
    assert store_options == [], "the pool was opened for a host pool tutti does not store exactly"


def test_fp8_kv_formats_get_their_own_key_spaces(tmp_path: Path, store_options: list):
    """Goal: SGLang stores every fp8 --kv-cache-dtype as torch.uint8 (the device pool's
    store_dtype, which the host pool takes), so the host pool's dtype cannot tell fp8_e5m2 from
    fp8_e4m3: the default fingerprint names SGLang's kv_cache_dtype, and two servers differing
    only in it never serve each other's pages. When it cannot be read (SGLang's config not
    published in this process), a uint8 host pool is refused unless "model_fingerprint" names
    the KV bytes."""
    from sglang.srt.runtime_context import get_context

    for kv_cache_dtype in ("fp8_e5m2", "fp8_e4m3"):
        with get_context().override_server_args(kv_cache_dtype=kv_cache_dtype):
            storage = backend("page_first", host_pool("page_first", dtype=torch.uint8), extra_config(tmp_path / "pool.img", True))
            storage.close()
    e5m2, e4m3 = (options["model_fingerprint"] for _, options in store_options)
    assert e5m2 != e4m3, "fp8_e5m2 and fp8_e4m3 pages share a key space"

    with unpublished():
        created = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", extra_config(tmp_path / "pool.img", True)), None)
        with pytest.raises(tutti.InvalidArgument, match="kv-cache-dtype.*model_fingerprint"):
            created.register_mem_pool_host(host_pool("page_first", dtype=torch.uint8))
        assert len(store_options) == 2
        explicit = backend("page_first", host_pool("page_first", dtype=torch.uint8), extra_config(tmp_path / "pool.img", True, model_fingerprint="ab" * 32))
        explicit.close()
    assert len(store_options) == 3, "an explicit model_fingerprint did not open the uint8 pool"


def test_an_explicit_fingerprint_keeps_the_page_layout_in_the_key_space(tmp_path: Path):
    """Goal: an explicit "model_fingerprint" names the model, not the bytes of its pages: the
    key space is extended with the host pool's layout, dtype, page size and class, as the
    default fingerprint's is. SGLang turns page_first into page_first_direct on its own when
    --hicache-io-backend direct is given (hicache_hook.py, resolve_layout_io_compatibility):
    same bytes per page, so the pool opens, but a page_first page (token-major) read into a
    page_first_direct page (layer-major) would be scrambled KV. bf16 and fp16 pages are alike."""
    explicit = "cd" * 32
    pool = host_pool("page_first")
    storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True, model_fingerprint=explicit))
    keys = page_keys(20, 2)
    assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
    storage.close()

    reopened = extra_config(tmp_path / "pool.img", False, model_fingerprint=explicit)
    same = backend("page_first", pool, reopened)
    assert same.batch_exists(keys) == 2, "the same layout under the same fingerprint lost its pages"
    same.close()
    direct = backend("page_first_direct", host_pool("page_first_direct"), reopened)
    assert direct.batch_exists(keys) == 0, "page_first pages are served to a page_first_direct pool"
    direct.close()
    fp16 = backend("page_first", host_pool("page_first", dtype=torch.float16), reopened)
    assert fp16.batch_exists(keys) == 0, "bf16 pages are served to an fp16 pool"
    fp16.close()


def test_the_checkpoint_not_the_served_alias_names_the_key_space(tmp_path: Path):
    """Goal: the model name SGLang 0.5.23 gives the backend is --served-model-name (an alias,
    the model path only when none is given), so a server restarted with the same alias on
    another checkpoint must not be served the first one's pages: the default fingerprint names
    SGLang's model path and revision, its quantization, the JSON overrides of the model config
    and the speculative draft model's path, revision and quantization (its runtime context).
    When they cannot be read (SGLang's config not published in this process), the backend is
    refused unless "model_fingerprint" names the model."""
    pool = host_pool("page_first")
    keys = page_keys(21, 2)
    served = dict(served_model_name="tutti-test-model")
    with get_context().override_server_args(model_path="/ckpt/v1", **served):
        first = backend("page_first", pool, extra_config(tmp_path / "pool.img", True))
        assert first.batch_set_v1(keys, indices([1, 2])) == [True, True]
        first.close()
        again = backend("page_first", pool, extra_config(tmp_path / "pool.img", False))
        assert again.batch_exists(keys) == 2, "the same checkpoint lost its pages"
        again.close()
    others = [
        dict(model_path="/ckpt/v2"),
        dict(model_path="/ckpt/v1", revision="0123abcd"),
        dict(model_path="/ckpt/v1", quantization="fp8"),
        dict(model_path="/ckpt/v1", json_model_override_args='{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}'),
        dict(model_path="/ckpt/v1", speculative_draft_model_path="/ckpt/draft"),
    ]
    for changed in others:
        with get_context().override_server_args(**changed, **served):
            other = backend("page_first", pool, extra_config(tmp_path / "pool.img", False))
            assert other.batch_exists(keys) == 0, f"pages of /ckpt/v1 are served to {changed}"
            other.close()

    with unpublished():
        created = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", extra_config(tmp_path / "pool.img", False)), pool)
        with pytest.raises(tutti.InvalidArgument, match="model path.*model_fingerprint"):
            created.register_mem_pool_host(pool)
        explicit = backend("page_first", pool, extra_config(tmp_path / "pool.img", False, model_fingerprint="ab" * 32))
        explicit.close()


@pytest.mark.parametrize(
    "changed",
    [
        dict(load_format="dummy"),
        dict(modelopt_quant="fp8"),
        dict(modelopt_checkpoint_restore_path="/ckpt/modelopt"),
        dict(rl_quant_profile="/ckpt/flash_rl_profile.pt"),
        dict(quantize_and_serve=True),
        dict(speculative_draft_model_path="/ckpt/draft", speculative_draft_load_format="dummy"),
    ],
    ids=["load_format", "modelopt_quant", "modelopt_checkpoint_restore_path", "rl_quant_profile", "quantize_and_serve", "draft load_format"],
)
def test_server_args_that_change_the_weights_name_the_key_space(tmp_path: Path, changed: dict):
    """Goal: server args beside the checkpoint's path change the weights whose KV a page holds:
    --load-format dummy (random weights, for benchmarks), ModelOpt quantization (--modelopt-quant,
    a restored ModelOpt checkpoint, --quantize-and-serve), FlashRL's --rl-quant-profile, a draft
    model loaded with dummy weights. A server started with one of them must not be served the
    pages of one started without (nor the other way round): each is in the default fingerprint.
    Pages stored with random weights were found by the real server (3 of 3)."""
    pool = host_pool("page_first")
    keys = page_keys(22, 2)
    base = dict(model_path="/ckpt/v1", **({"speculative_draft_model_path": "/ckpt/draft"} if "speculative_draft_model_path" in changed else {}))
    with get_context().override_server_args(**{**base, **changed}):
        first = backend("page_first", pool, extra_config(tmp_path / "pool.img", True))
        assert first.batch_set_v1(keys, indices([1, 2])) == [True, True]
        first.close()
    with get_context().override_server_args(**base):
        other = backend("page_first", pool, extra_config(tmp_path / "pool.img", False))
        assert other.batch_exists(keys) == 0, f"pages stored with {changed} are served without it"
        other.close()


def test_an_fp8_kv_scale_file_names_the_key_space(tmp_path: Path):
    """Goal: SGLang stores every fp8 --kv-cache-dtype as torch.uint8 scaled by the KV scales of
    --quantization-param-path (1.0 without one): a page stored with scale 1.0 means other values
    under a scale file, so the scale file is named with the KV format, for the default
    fingerprint and an explicit one alike (pages stored with scale 1.0 were found once a scale
    file was added)."""
    pool = host_pool("page_first", dtype=torch.uint8)
    keys = page_keys(23, 2)
    for explicit in (None, "ef" * 32):
        pool_file = tmp_path / f"pool-{explicit is None}.img"
        with get_context().override_server_args(model_path="/ckpt/v1", kv_cache_dtype="fp8_e4m3"):
            first = backend("page_first", pool, extra_config(pool_file, True, model_fingerprint=explicit))
            assert first.batch_set_v1(keys, indices([1, 2])) == [True, True]
            first.close()
            again = backend("page_first", pool, extra_config(pool_file, False, model_fingerprint=explicit))
            assert again.batch_exists(keys) == 2, "the same fp8 KV format lost its pages"
            again.close()
        with get_context().override_server_args(model_path="/ckpt/v1", kv_cache_dtype="fp8_e4m3", quantization_param_path="/ckpt/kv_scales.json"):
            scaled = backend("page_first", pool, extra_config(pool_file, False, model_fingerprint=explicit))
            assert scaled.batch_exists(keys) == 0, f"pages stored with KV scales 1.0 are served with a scale file (model_fingerprint {explicit})"
            scaled.close()


def test_hybrid_models_with_extra_host_pools_are_refused_at_attach(tmp_path: Path, caplog):
    """Goal: for hybrid models (SWA, Mamba, ...) SGLang's HybridCacheController registers each
    host pool entry with register_mem_host_pool_v2 after register_mem_pool_host, then calls
    batch_exists_v2 / batch_get_v2 / batch_set_v2, which tutti does not implement (every call
    would raise). A pool other than the KV one is refused when it is registered (failing the
    attach, as on_host_pools_registered would), naming it, and the tutti pool is closed so a
    half-attached backend moves nothing; the KV pool's own entry is accepted."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pool = host_pool("page_first")
    storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True))
    try:
        keys = page_keys(15, 1)
        assert storage.batch_set_v1(keys, indices([1])) == [True]
        # HybridCacheController.attach_storage_backend: each entry of the host pool group.
        storage.register_mem_host_pool_v2(pool, PoolName.KV)
        with pytest.raises(tutti.InvalidArgument, match="'swa'.*not supported"):
            storage.register_mem_host_pool_v2(host_pool("page_first"), PoolName.SWA)
        with pytest.raises(tutti.InvalidArgument, match="KV host pool .* other than the one"):
            storage.register_mem_host_pool_v2(host_pool("page_first"), PoolName.KV)
        assert storage.batch_exists(keys) == 0
        assert storage.batch_get_v1(keys, indices([2])) == [False]
    finally:
        storage.close()
    plain = backend("page_first", pool, extra_config(tmp_path / "pool.img", False))
    try:
        plain.register_mem_host_pool_v2(pool, PoolName.KV)
        plain.on_host_pools_registered()
        assert plain.batch_exists(page_keys(15, 1)) == 1
    finally:
        plain.close()


def test_plain_data_parallel_replicas_get_their_own_devices(tmp_path: Path, store_options: list):
    """Goal: with plain data parallelism (--dp-size 2 without DP attention) SGLang 0.5.23 gives
    every replica's storage config dp_rank 0, but states the replica in its runtime context
    (get_parallel().dp_rank, dp_size): "{dp_rank}" in a device template is filled from it, so two
    replicas never open the same devices; a template without it is refused when the backend is
    built, naming the key, and so is a replica whose rank SGLang did not state."""
    from sglang.srt.runtime_context import get_parallel

    shared = extra_config(tmp_path / "pool.img", True)
    with get_parallel().override(dp_size=2, dp_rank=1):
        with pytest.raises(tutti.InvalidArgument, match=r"field 'devices'.*dp_size 2.*put \"\{dp_rank\}\" in every device string"):
            StorageBackendFactory.create_backend("dynamic", storage_config("page_first", shared), None)
        replica = backend("page_first", host_pool("page_first"), extra_config(tmp_path / "unused.img", True, devices=f"emu:{tmp_path}/pool-dp{{dp_rank}}.img"))
        replica.close()
    assert (tmp_path / "pool-dp1.img").is_file() and not (tmp_path / "pool-dp0.img").exists()
    with get_parallel().override(dp_size=2):
        templated = extra_config(tmp_path / "unused.img", True, devices=f"emu:{tmp_path}/pool-dp{{dp_rank}}.img")
        with pytest.raises(tutti.InvalidArgument, match="replica"):
            StorageBackendFactory.create_backend("dynamic", storage_config("page_first", templated), None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_page_whose_bytes_changed_in_the_pool_is_not_read(tmp_path: Path, layout: str):
    """Goal: the backend checks every page it reads against the CRC recorded when it was stored
    (verify_retrieves, on by default: SGLang serves a page batch_get_v1 reports read as KV): a
    page whose bytes changed on the device since is reported not read and leaves the pool (the
    next batch_exists misses it), the batch's other pages are read byte-exact, and the pool
    stays open."""
    pool_file = tmp_path / "pool.img"
    pool = host_pool(layout)
    keys = page_keys(40, 2)
    storage = backend(layout, pool, extra_config(pool_file, True))
    try:
        generator = torch.Generator().manual_seed(40)
        for page in (1, 2):
            view = page_view(pool, page)
            view.copy_(torch.randn(view.shape, generator=generator).to(view.dtype))
        stored = [page_view(pool, page).clone() for page in (1, 2)]
        assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
    finally:
        storage.close()
    image = bytearray(pool_file.read_bytes())
    at = image.find(bytes(stored[0].contiguous().view(torch.uint8).flatten()[:64].tolist()))
    assert at >= 0, "the first page's bytes are not in the pool file"
    image[at + 7] ^= 0xFF
    pool_file.write_bytes(bytes(image))
    reopened = backend(layout, pool, extra_config(pool_file, False))
    try:
        for page in (3, 4):
            page_view(pool, page).zero_()
        assert reopened.batch_get_v1(keys, indices([3, 4])) == [False, True], "a page whose bytes changed was served"
        assert torch.equal(page_view(pool, 4), stored[1])
        assert reopened.batch_exists(keys) == 0, "the page whose bytes changed is still in the pool"
        assert reopened.batch_exists(keys[1:]) == 1
        assert reopened._dead is None
    finally:
        reopened.close()


def test_a_pool_without_payload_crcs_is_refused_naming_verify_retrieves(tmp_path: Path):
    """Goal: the backend checks the pages it reads by default (verify_retrieves), which a pool
    formatted without payload CRCs (`tutti pool format` or tuttid --format without
    --payload-crc, Store.open(payload_crcs=False)) cannot do: the refusal when SGLang registers
    its host pool is a ConfigError naming both ways out, "verify_retrieves": false or a pool
    formatted with --payload-crc; with verify_retrieves false the same pool opens."""
    from tutti._engine import ConfigError, byte_geometry
    from tutti.sglang import host_pool_layout

    pool_file = tmp_path / "pool.img"
    pool = host_pool("page_first")
    _, _, layers, layer_block_bytes = host_pool_layout(pool)
    tutti.Store.open(
        f"emu:{pool_file}", byte_geometry(layer_block_bytes, layers), format=True, create_bytes=64 << 20,
        payload_crcs=False, lock_dir=str(tmp_path / "locks"),
    ).close()  # fmt: skip
    created = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", extra_config(pool_file, False)), pool)
    with pytest.raises(ConfigError, match="payload CRC") as refused:
        created.register_mem_pool_host(pool)
    assert '"verify_retrieves": false' in str(refused.value) and "--payload-crc" in str(refused.value)
    unchecked = backend("page_first", pool, extra_config(pool_file, False, verify_retrieves=False))
    try:
        keys = page_keys(41, 1)
        assert unchecked.batch_set_v1(keys, indices([1])) == [True]
        assert unchecked.batch_get_v1(keys, indices([2])) == [True]
    finally:
        unchecked.close()


@pytest.mark.parametrize(
    "unnamed",
    [
        dict(load_format="remote_instance", remote_instance_weight_loader_seed_instance_ip="10.0.0.1"),
        dict(load_format="dummy", checkpoint_engine_wait_weights_before_ready=True),
        # Each check alone: a checkpoint engine over weights loaded from the checkpoint (load
        # format auto), and a draft model on random weights under a named target.
        dict(checkpoint_engine_wait_weights_before_ready=True),
        dict(speculative_draft_load_format="dummy"),
    ],
    ids=["remote_instance", "dummy + checkpoint engine", "checkpoint engine alone", "dummy draft alone"],
)
def test_weights_the_server_args_do_not_name_are_not_shared_across_restarts(tmp_path: Path, unnamed: dict, caplog):
    """Goal: a server whose weights arrive by a way its server args do not name (copied from a
    live seed instance, --load-format remote_instance; random weights replaced by a checkpoint
    engine's update, which names no weight_version, --load-format dummy
    --checkpoint-engine-wait-weights-before-ready) has the same default fingerprint at every
    start whatever weights it serves: a restart must not be served the previous run's pages.
    Its pages are found within the process (a warning says why not across restarts); with an
    explicit model_fingerprint (trusted to name the weights) a restart finds them."""
    pool = host_pool("page_first")
    keys = page_keys(42, 2)
    with get_context().override_server_args(model_path=CHECKPOINT, **unnamed):
        with caplog.at_level("WARNING"):
            first = backend("page_first", pool, extra_config(tmp_path / "pool.img", True))
        assert "model_fingerprint" in caplog.text and "restart" in caplog.text
        try:
            assert first.batch_set_v1(keys, indices([1, 2])) == [True, True]
            assert first.batch_exists(keys) == 2
            assert first.batch_get_v1(keys, indices([3, 4])) == [True, True]
        finally:
            first.close()
        restarted = backend("page_first", pool, extra_config(tmp_path / "pool.img", False))
        try:
            assert restarted.batch_exists(keys) == 0, f"a restart with {unnamed} is served the previous run's pages"
        finally:
            restarted.close()
        named = extra_config(tmp_path / "pool.img", False, model_fingerprint="cd" * 32)
        explicit = backend("page_first", pool, named)
        try:
            assert explicit.batch_set_v1(keys, indices([1, 2])) == [True, True]
        finally:
            explicit.close()
        again = backend("page_first", pool, named)
        try:
            assert again.batch_exists(keys) == 2, "pages under an explicit model_fingerprint are lost at a restart"
        finally:
            again.close()


class LateLayer:
    """A tutti.Request whose layers are seen to complete only at `until` (time.monotonic()), as
    on a device that stalls: a wait sleeps until then, or for its timeout and then raises
    TimeoutError (the layer still in flight); a poll before then drives nothing."""

    def __init__(self, request, until: float) -> None:
        self._request = request
        self._until = until

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def wait(self, timeout_s=30.0):
        left_s = self._until - time.monotonic()
        if left_s > timeout_s:
            time.sleep(timeout_s)
            raise tutti.TimeoutError("injected: the layer is late")
        time.sleep(max(0.0, left_s))
        return self._request.wait(timeout_s)

    def poll(self):
        return False if time.monotonic() < self._until else self._request.poll()


@pytest.mark.parametrize("store", [True, False], ids=["backup", "prefetch"])
def test_a_call_ends_within_sglang_s_join_of_its_storage_threads(tmp_path: Path, store: bool):
    """Goal: SGLang's cache flush (/flush_cache, a weight update's) stops its storage threads by
    joining each for 10 s and raises RuntimeError (the scheduler stops) when one is still in a
    storage call, so a call on a device that stalls 15 s (timeout_s 30 s, the default) ends
    within 10 s: by call_timeout_s (7 s) and its 1 s grace for the layers in flight the pages
    are reported not moved and the pool is closed (nothing late writes host pages SGLang reuses)."""
    pool = host_pool("page_first")
    storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True))
    keys = page_keys(43, 2)
    try:
        assert storage.batch_set_v1(keys, indices([1, 2])) == [True, True]
        wrapped = StoreWithStalledLayers(storage._store)
        until = time.monotonic() + 15.0
        late = "prepare_store" if store else "prepare_retrieve"
        real = getattr(wrapped._store, late)
        setattr(wrapped, late, lambda tokens, block_ids: LateLayer(real(tokens, block_ids), until))
        storage._store = wrapped
        results: dict = {}

        def call():
            began = time.monotonic()
            moved = storage.batch_set_v1(page_keys(44, 2), indices([3, 4])) if store else storage.batch_get_v1(keys, indices([3, 4]))
            results["call"] = (moved, time.monotonic() - began)

        thread = threading.Thread(target=call)
        thread.start()
        thread.join(10.0)
        alive = thread.is_alive()
        thread.join(30.0)  # let a late call end before the pool is closed under it
        assert not alive, f"the call was still running after SGLang's 10 s join ({results})"
        moved, took_s = results["call"]
        assert moved == [False, False] and took_s < 10.0, results
        assert wrapped.closed_by_backend, "the call returned with the stalled pages' requests live"
    finally:
        storage.close()


class SlowLayer(LateLayer):
    """A tutti.Request whose layers are seen to complete `delay_s` after the latest issue, as on a
    device that is slow but working: one `until` for all, so a layer issued later holds back the
    ones issued before it too (PerLayerLate keeps one per layer)."""

    def __init__(self, request, delay_s: float) -> None:
        super().__init__(request, time.monotonic())
        self._delay_s = delay_s

    def retrieve_layer(self, layer):
        self._until = time.monotonic() + self._delay_s
        return self._request.retrieve_layer(layer)

    def store_layer(self, layer):
        self._until = time.monotonic() + self._delay_s
        return self._request.store_layer(layer)


@pytest.mark.parametrize("store", [True, False], ids=["backup", "prefetch"])
def test_a_slow_call_stops_at_its_deadline_and_keeps_the_pool(tmp_path: Path, store: bool):
    """Goal: a call that runs past call_timeout_s on a device that is slow but working starts no
    new page after it, waits out the pages already moving (a short grace) and reports them moved,
    and leaves the rest as misses with the pool open: a later call moves them. Only a layer still
    in flight after the grace closes the pool (test_a_call_ends_within_sglang_s_join_of_its_storage_threads).
    The first wave (2 pages, each one layer: a page layout) is issued at once and completes 1.3 s
    later: after the soft deadline (1.0 s) however soon it is issued, and before the hard one
    (2.0 s) if issued within 0.7 s of the call's start (room for a loaded machine); the third page
    is not begun. Only the slow call runs under the 1 s call_timeout_s: the setup's and the
    later call's real commits keep the default."""
    pool = host_pool("page_first")
    storage = backend("page_first", pool, extra_config(tmp_path / "pool.img", True, requests_max=2))
    keys = page_keys(45, 3)
    try:
        if not store:
            assert storage.batch_set_v1(keys, indices([1, 2, 3])) == [True] * 3
        wrapped = StoreWithStalledLayers(storage._store)
        late = "prepare_store" if store else "prepare_retrieve"
        real = getattr(wrapped._store, late)
        setattr(wrapped, late, lambda tokens, block_ids: SlowLayer(real(tokens, block_ids), 1.3))
        storage._store = wrapped
        host = [1, 2, 3] if store else [8, 9, 10]
        default_call_timeout_s, storage._call_timeout_s = storage._call_timeout_s, 1.0
        moved = storage.batch_set_v1(keys, indices(host)) if store else storage.batch_get_v1(keys, indices(host))
        storage._call_timeout_s = default_call_timeout_s
        assert storage._dead is None and not wrapped.closed_by_backend, f"a slow call closed the pool ({moved})"
        assert moved == [True, True, False], moved
        storage._store = wrapped._store
        assert (storage.batch_set_v1(keys[2:], indices(host[2:])) if store else storage.batch_get_v1(keys[2:], indices(host[2:]))) == [True]
        if store:
            assert storage.batch_exists(keys) == 3
    finally:
        storage.close()


def test_a_layer_first_page_cut_at_the_deadline_is_a_miss_and_keeps_the_pool(tmp_path: Path, caplog):
    """Goal: a layer-first page whose next layer falls due after call_timeout_s is not issued
    further: the layers in flight are waited out (the grace), the page is a miss (not all its
    layers moved) and its request is finished, the pool open: a later call reads it."""
    pool = host_pool("layer_first")
    storage = backend("layer_first", pool, extra_config(tmp_path / "pool.img", True, requests_max=1, call_timeout_s=0.5))
    keys = page_keys(46, 1)
    source = page_view(pool, 1)
    source.copy_(torch.randn(source.shape, generator=torch.Generator().manual_seed(46)).to(source.dtype))
    try:
        assert storage.batch_set_v1(keys, indices([1])) == [True]
        wrapped = StoreWithStalledLayers(storage._store)
        real = wrapped._store.prepare_retrieve
        wrapped.prepare_retrieve = lambda tokens, block_ids: SlowLayer(real(tokens, block_ids), 0.3)
        storage._store = wrapped
        with caplog.at_level("WARNING"):
            assert storage.batch_get_v1(keys, indices([2])) == [False]
        assert storage._dead is None and not wrapped.closed_by_backend, "a slow call closed the pool"
        assert "before all their layers were issued" in caplog.text
        storage._store = wrapped._store
        assert storage.batch_get_v1(keys, indices([2])) == [True]
        assert torch.equal(page_view(pool, 2), page_view(pool, 1))
    finally:
        storage.close()


class PerLayerLate:
    """A tutti.Request whose layer n is seen to complete `delays_s[n]` (the last entry for later
    layers) after its issue, each layer by its own time: layer_in_flight / layers_in_flight name
    the issued layers not yet waited for whose time has not come, a wait takes the oldest one
    (sleeping until its time, or for its timeout and then raising the deadline's TimeoutError),
    and finish raises InvalidState while a layer is in flight, as the store does. `finished_at`
    (time.monotonic()) and `last_until` (the latest layer's time) let a test check that the
    request was finished only once no layer could still move its page's bytes."""

    def __init__(self, request, delays_s: list[float]) -> None:
        self._request = request
        self._delays_s = delays_s
        self._pending: list[tuple[int, float]] = []  # (layer, until), oldest first
        self.last_until = 0.0
        self.issued = 0
        self.finished_at: float | None = None

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def _issued(self, layer: int) -> None:
        until = time.monotonic() + self._delays_s[min(layer, len(self._delays_s) - 1)]
        self._pending.append((layer, until))
        self.last_until = max(self.last_until, until)
        self.issued += 1

    def retrieve_layer(self, layer):
        self._issued(layer)
        return self._request.retrieve_layer(layer)

    def store_layer(self, layer):
        self._issued(layer)
        return self._request.store_layer(layer)

    @property
    def layers_in_flight(self):
        now = time.monotonic()
        return [layer for layer, until in self._pending if until > now] or list(self._request.layers_in_flight)

    @property
    def layer_in_flight(self):
        flying = self.layers_in_flight
        return flying[0] if flying else None

    def wait(self, timeout_s=30.0):
        if not self._pending:
            return self._request.wait(timeout_s)
        layer, until = self._pending[0]
        left_s = until - time.monotonic()
        if left_s > timeout_s:
            time.sleep(timeout_s)
            raise tutti.TimeoutError(f"injected: layer {layer} did not complete by the deadline; it is still in flight")
        time.sleep(max(0.0, left_s))
        self._pending.pop(0)
        return self._request.wait(timeout_s)

    def poll(self):
        if self._pending and time.monotonic() < self._pending[0][1]:
            return False
        if self._pending:
            self._pending.pop(0)
        return self._request.poll()

    def finish(self):
        flying = self.layers_in_flight
        if flying:
            raise tutti.InvalidState(f"injected: layers {flying} are still in flight")
        self.finished_at = time.monotonic()
        return self._request.finish()


def test_a_layer_first_page_cut_at_the_deadline_is_finished_only_after_its_layers_in_flight(tmp_path: Path):
    """Goal: the request of a layer-first page cut at call_timeout_s is finished only once its
    layers in flight completed (a device may still write the page's host bytes until then), and
    that wait keeps the pool open. Layer 0 (1.05 s) completes after the soft deadline (1.0 s)
    however soon it is issued, while layer 1 (issued with it, 1.3 s) is still in flight; the hard
    deadline is 2.0 s, so the layers may be issued up to 0.7 s after the call's start (room for a
    loaded machine). Only the cut call runs under the 1 s call_timeout_s."""
    pool = host_pool("layer_first")
    storage = backend("layer_first", pool, extra_config(tmp_path / "pool.img", True, requests_max=1))
    keys = page_keys(47, 1)
    source = page_view(pool, 1)
    source.copy_(torch.randn(source.shape, generator=torch.Generator().manual_seed(47)).to(source.dtype))
    try:
        assert storage.batch_set_v1(keys, indices([1])) == [True]
        wrapped = StoreWithStalledLayers(storage._store)
        real = wrapped._store.prepare_retrieve
        requests: list[PerLayerLate] = []

        def prepare(tokens, block_ids):
            requests.append(PerLayerLate(real(tokens, block_ids), [1.05, 1.3]))
            return requests[-1]

        wrapped.prepare_retrieve = prepare
        storage._store = wrapped
        default_call_timeout_s, storage._call_timeout_s = storage._call_timeout_s, 1.0
        moved = storage.batch_get_v1(keys, indices([2]))
        storage._call_timeout_s = default_call_timeout_s
        assert moved == [False], moved
        assert storage._dead is None and not wrapped.closed_by_backend, "the cut page's request was finished with a layer in flight"
        [request] = requests
        # Both layers were issued before the cut (else nothing here was tested).
        assert request.issued == 2, request.issued
        assert request.finished_at is not None and request.finished_at >= request.last_until, (request.finished_at, request.last_until)
        storage._store = wrapped._store
        assert storage.batch_get_v1(keys, indices([2])) == [True]
        assert torch.equal(page_view(pool, 2), page_view(pool, 1))
    finally:
        storage.close()


def test_a_call_timeout_past_sglang_s_join_is_warned(tmp_path: Path, caplog):
    """Goal: a call_timeout_s whose waits (the grace for the pages in flight and a close's
    included) reach SGLang's 10 s join of its storage threads is allowed but warned about, naming
    what it risks."""
    with caplog.at_level("WARNING"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config("page_first", extra_config(tmp_path / "pool.img", True, call_timeout_s=12.0)), None
        )
    assert "call_timeout_s" in caplog.text and "Failed to stop HiCache storage threads" in caplog.text
    caplog.clear()
    # 9 s: its waits (1 s past it for the pages in flight, then at least 0.5 s for a close) reach 10 s.
    with caplog.at_level("WARNING"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config("page_first", extra_config(tmp_path / "pool.img", True, call_timeout_s=9.0)), None
        )
    assert "call_timeout_s" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        StorageBackendFactory.create_backend("dynamic", storage_config("page_first", extra_config(tmp_path / "pool.img", True)), None)
    assert "call_timeout_s" not in caplog.text
