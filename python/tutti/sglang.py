"""`TuttiHiCacheStorage`: an SGLang HiCache storage backend (its "L3" tier) on a tutti pool
(docs/sglang.md).

Loaded by SGLang with
    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tutti", "module_path": "tutti.sglang",
        "class_name": "TuttiHiCacheStorage", "interface_v1": 1, "devices": "vfio:0000:01:00.0"}'

SGLang's HiCache moves pages between its host memory pool and the storage backend, whole pages
(every layer) at a time, naming each page by a hash string chained over the prefix. Each
scheduler process (one per tensor-parallel rank, pipeline stage, DP-attention group or DP
replica, and context-parallel rank) builds its own backend, so each opens its own tutti pool in-process
(`tutti.Store.open`; "{tp_rank}", "{pp_rank}", "{dp_rank}" and "{cp_rank}" in a device string are
replaced by the process's ranks, and a template that would give two processes the same devices
is refused) and registers SGLang's host pool where it lies: `batch_get_v1` / `batch_set_v1` move
bytes between the devices and the host pool's pages with no copy ("zero copy", `interface_v1`).

Host pool layouts (SGLang's `--hicache-mem-layout`):
- layer_first `[2, layers, tokens, heads, dim]`: a page of one layer's K (or V) is one run; the pool
  has the model's layers, and a page moves layer by layer.
- page_first `[2, tokens, layers, heads, dim]` (and page_first_direct, page_head): a page's K (or V)
  over all layers is one run; the pool has one layer of that size, and a page moves in one
  command pair.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Callable, List, Mapping, Optional

import torch

import tutti
from tutti._engine import (
    BYTE_GEOMETRY_BLOCK_TOKENS,
    ConfigError,
    Field,
    _COMMANDS_PER_IOCB,
    _IOCBS_MAX,
    abandon_request,
    bounded_timeout,
    byte_geometry,
    check_engine_version,
    fingerprint_from_config,
    hash_tokens,
    iocbs_for,
    layers_in_flight_field,
    parse_config,
    positive,
    queue_depth_field,
    refuses_crc_less_pool,
    requests_in_range,
    wait_s,
    wait_out_layer,
)
from tutti._sglang_keys import (
    _checkpoint_parts,
    _claim_devices,
    _claimed_identities,
    _device_identities,
    _device_strings_problem,
    _forget_cleared_pools,
    _kv_format_parts,
    _page_layout_parts,
    _refuse_cleared_pool,
    _release_devices,
    _remember_cleared_pool,
    _shard_parts,
    _unnamed_startup_weights,
    _watch_host_pool_clears,
    _WeightEpochs,
    check_rank_devices,
    rank_devices,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

logger = logging.getLogger("tutti.sglang")

# The SGLang release this backend was tested against (tools/python/engine-env.sh pins the same).
TESTED_SGLANG_VERSION = "0.5.23"

# SGLang's own HiCache settings, accepted and ignored: the hierarchical cache's path removes them
# before building the backend (HybridCacheController.parse_storage_backend_extra_config), but PD
# decode's KV offload manager (decode_kvcache_offload_manager.py) hands the backend the extra
# config as json.loads reads it. The kinds are what SGLang's parse takes, its isinstance checks
# (a boolean is an int there; an integer may be of any size), then float() of the timeouts;
# _without_sglang_own_fields checks them so, before parse_config, which would refuse a boolean
# where a number is meant and an integer past INT_FIELD_MAX, and take null (which SGLang refuses)
# for absent: a config one of SGLang's paths takes is taken on the other, and only such a config.
SGLANG_OWN_FIELDS = {
    "prefetch_threshold": Field((int, bool), "SGLang's: the fewest tokens a prefetch is started for (ignored by tutti)"),
    "prefetch_timeout_base": Field((int, float, bool), "SGLang's: a prefetch's base timeout, seconds (ignored by tutti)"),
    "prefetch_timeout_per_ki_token": Field(
        (int, float, bool), "SGLang's: a prefetch's timeout per 1024 tokens, seconds (ignored by tutti)"
    ),
    "hicache_storage_pass_prefix_keys": Field(bool, "SGLang's: whether it passes prefix keys to the backend (ignored by tutti)"),
}


def _without_sglang_own_fields(extra_config: Any) -> Any:
    """The extra config without SGLang's own HiCache fields (SGLANG_OWN_FIELDS), each one given
    checked as SGLang 0.5.23's parse checks it: an instance of its kinds, and a timeout one that
    float() takes. Raises ConfigError naming the field for a value SGLang's parse refuses. A
    config that is not a mapping is returned as it is (parse_config refuses it)."""
    if not isinstance(extra_config, Mapping):
        return extra_config
    for name, spec in SGLANG_OWN_FIELDS.items():
        if name not in extra_config:
            continue
        value = extra_config[name]
        kinds = spec.kind if isinstance(spec.kind, tuple) else (spec.kind,)
        if not isinstance(value, kinds):
            expected = " or ".join(kind.__name__ for kind in kinds)
            if value is None:
                shown = "null"
            elif isinstance(value, int) and value.bit_length() > 256:
                shown = f"an integer of {value.bit_length()} bits"  # str() of one past 4300 digits raises
            else:
                shown = repr(value)
            raise ConfigError(
                f"--hicache-storage-backend-extra-config: field {name!r} must be {expected}, as SGLang's own parse "
                f"takes it ({spec.description}), got {shown}"
            )
        if float in kinds:
            try:
                float(value)
            except OverflowError:
                raise ConfigError(
                    f"--hicache-storage-backend-extra-config: field {name!r} = an integer of {value.bit_length()} bits: "
                    f"too large for a float, which SGLang's own parse makes of it ({spec.description})"
                ) from None
    return {name: value for name, value in extra_config.items() if name not in SGLANG_OWN_FIELDS}


EXTRA_CONFIG_FIELDS = {
    # SGLang's own fields of the dynamic backend's extra config.
    "backend_name": Field(str, "SGLang's name for the backend, e.g. \"tutti\""),
    "module_path": Field(str, "\"tutti.sglang\""),
    "class_name": Field(str, "\"TuttiHiCacheStorage\""),
    "interface_v1": Field((int, bool), "must be 1: SGLang then calls the zero-copy batch_get_v1/batch_set_v1", required=True),
    "allocator": Field(str, "SGLang's host pool allocator (\"shm\" or absent)"),
    # Listed so that an unknown field's message names them; checked apart (_without_sglang_own_fields).
    **SGLANG_OWN_FIELDS,
    # tutti's.
    "devices": Field(
        (str, list),
        "the pool's devices, e.g. \"vfio:0000:01:00.0\" or \"emu:/var/tutti/pp{pp_rank}-tp{tp_rank}.img\" "
        "({tp_rank}, {pp_rank}, {dp_rank}, {cp_rank}: the scheduler process's ranks; {dp_rank} is the DP-attention "
        "group, or the replica with plain --dp-size)",
        required=True,
        check=_device_strings_problem,
    ),
    "format": Field(bool, "format a fresh pool for this host pool's page first (everything on it is lost)", default=False),
    "overwrite": Field(
        bool,
        "with format: format a device that holds something other than a tutti pool (a file system, a blank disk, "
        "a file of other bytes), refused without it",
        default=False,
    ),
    "create_bytes": Field(int, "with format: create or grow an emu:PATH file to this size (unused without format)", check=positive),
    "slots_max": Field(int, "at most this many pool slots per device when formatting", check=positive),
    "model_fingerprint": Field(
        str,
        "64 hex digits naming the model (the host pool's page layout, dtype and page size are always added); "
        "default: from SGLang's model name and its checkpoint (model path, revision, quantization, load format, "
        "draft model), private to the backend when those name no weights (a dummy or remote_instance load, "
        "a checkpoint engine's weights)",
    ),
    "lock_dir": Field(str, "where vfio: devices' lock files live (as tuttid's --lock-dir)", default="/run/tutti"),
    "timeout_s": Field(float, "the longest wait for one page's I/O, seconds", default=30.0, check=bounded_timeout),
    "call_timeout_s": Field(
        float,
        "how long one batch_get_v1 / batch_set_v1 call starts pages, seconds: pages not begun by then are misses; "
        "pages moving then get 1 s more, and one still moving after that closes the pool (lookups miss until a "
        "restart). SGLang's cache flush waits 10 s for each storage thread and then fails, so keep it under 8.5",
        default=7.0,
        check=bounded_timeout,
    ),
    "verify_retrieves": Field(
        bool,
        "check every page read against the CRC recorded when it was stored; a page that differs is not read "
        "(batch_get_v1 reports it False) and leaves the pool",
        default=True,
    ),
    "requests_max": Field(int, "pages moved at once", default=32, check=requests_in_range),
    "layers_in_flight": layers_in_flight_field("page"),
    "queue_depth": queue_depth_field(),
}

_PAGE_LAYOUTS = ("page_first", "page_first_direct", "page_head")

# How long SGLang 0.5.23 waits for each storage thread when it stops them (its cache flush, a weight
# update's flush, a detach: HiCacheController._stop_storage_threads joins each with timeout=10 and
# raises RuntimeError, which stops the scheduler, when one is still running).
_SGLANG_STORAGE_JOIN_S = 10.0

# How long past call_timeout_s (the call's soft deadline, after which it starts nothing) the
# layers already in flight may take to complete (its hard deadline): a device that is slow but
# working finishes the pages it was moving, and only one still moving then closes the pool.
_CALL_GRACE_S = 1.0

# The least a close at a call's hard deadline waits for the layers in flight (the other thread's
# included) before deleting the queue pairs. The default call_timeout_s (7 s) plus the grace and
# this wait (8.5 s) stays under SGLang's join with 1.5 s to spare for a loaded machine; the rest of the close is not bounded by the call: taking
# the store's lock, deleting the queue pairs (admin commands up to 10 s each per device; attached,
# tuttid's end of the session, at least 5 s) and the pool's staged header writes (up to 10 s),
# while SGLang's other thread waits on the store's lock and _close_lock (docs/sglang.md, "A
# call's deadline").
_CLOSE_AT_DEADLINE_MIN_S = 0.5

# The longest wait for request places (about 146 years): timeout_s x (layers + layers_in_flight)
# can exceed what Condition.wait takes (threading.TIMEOUT_MAX; tutti.Store allows timeout_s up to
# 1e9 s), which raises OverflowError. Half of it, since Condition.wait_for adds the timeout to the
# clock and subtracts the clock again in floats, which may round it past the maximum.
_PLACE_WAIT_MAX_S = threading.TIMEOUT_MAX / 2


def check_sglang_version() -> bool:
    """Warns (naming the tested version) when the installed SGLang is another release."""
    from sglang.version import __version__

    return check_engine_version("SGLang", __version__, TESTED_SGLANG_VERSION)


class TuttiHiCacheStorage(HiCacheStorage):
    """SGLang's HiCache storage backend on a tutti pool opened in this scheduler process."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        check_sglang_version()
        self._config = parse_config(
            "--hicache-storage-backend-extra-config", _without_sglang_own_fields(storage_config.extra_config), EXTRA_CONFIG_FIELDS
        )
        if not self._config["interface_v1"]:
            raise ConfigError(
                "--hicache-storage-backend-extra-config: set \"interface_v1\": 1; tutti moves pages straight "
                "into SGLang's host pool (batch_get_v1/batch_set_v1) and has no copying interface"
            )
        if storage_config.is_mla_model:
            raise ConfigError("tutti's SGLang backend stores MHA models; this model uses MLA (not supported)")
        if getattr(storage_config, "should_split_heads", False):
            # SGLang sets it for a page_head pool when "tp_lcm_size" (heterogeneous TP: instances
            # of other TP sizes sharing one store) exceeds this instance's TP size; the backend
            # would then have to store each page as head groups. tutti's pools are per rank.
            raise ConfigError(
                f"--hicache-storage-backend-extra-config: \"tp_lcm_size\": {storage_config.tp_lcm_size} asks for pages "
                f"split by heads across TP sizes (this instance's TP size is {storage_config.tp_size}); tutti stores "
                "each rank's pages on its own pool and cannot share them across TP sizes: remove \"tp_lcm_size\""
            )
        check_rank_devices(self._config["devices"], storage_config)
        self._storage_config = storage_config
        self._timeout_s = float(self._config["timeout_s"])
        self._call_timeout_s = float(self._config["call_timeout_s"])
        if self._call_timeout_s + _CALL_GRACE_S + _CLOSE_AT_DEADLINE_MIN_S >= _SGLANG_STORAGE_JOIN_S:
            logger.warning(
                "tutti: \"call_timeout_s\": %g (plus %g s for the pages in flight and %g s for a close's wait) lets a "
                "batch_get_v1 / batch_set_v1 call run past the %g s SGLang's cache "
                "flush waits for a storage thread: a device that stalls during a flush (/flush_cache, a weight "
                "update's) then stops the scheduler (RuntimeError: Failed to stop HiCache storage threads cleanly)",
                self._call_timeout_s, _CALL_GRACE_S, _CLOSE_AT_DEADLINE_MIN_S, _SGLANG_STORAGE_JOIN_S,
            )  # fmt: skip
        self._requests_max = int(self._config["requests_max"])
        # Layers of one page in flight at once (layer_first pools: a page moves layer by layer;
        # page layouts have one layer, and the store is opened for min(N, layers)).
        self._layers_ahead = int(self._config["layers_in_flight"])
        _iocbs(self._requests_max, self._layers_ahead)  # refused here
        self._store: Any = None
        # The pool's (device identities, fingerprint) once registered: what a clear records.
        self._pool_identity: Optional[tuple[tuple[str, ...], bytes]] = None
        self._layers = 0
        self._page_size = 0
        # SGLang's weight epochs (in-place weight updates) once the host pool is registered:
        # each names its pages in a key space of its own (_WeightEpochs).
        self._epochs: Optional[_WeightEpochs] = None
        # The last epoch whose backups were refused for want of SGLang's flush (logged once).
        self._unflushed_epoch_logged = -1
        # Why the pool was closed for good (a page's layer did not complete): nothing moves any
        # more, lookups miss.
        self._dead: Optional[str] = None
        # Set when that close could not confirm the queue pairs deleted: a read (this thread's or
        # another's: SGLang prefetches and backs up on two threads) may still write host pages,
        # so the process ends (_host_pages_unsafe) before any call returns to SGLang.
        self._unsafe: Optional[str] = None
        # Held while the pool is closed and its outcome recorded: a read that saw the store
        # closed under it checks the outcome under it before returning its pages.
        self._close_lock = threading.Lock()
        # The store's requests_max request places, shared by SGLang's prefetch and backup threads.
        self._places = _RequestPlaces(self._requests_max)

    # -- host pool registration -----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Opens the pool for this host pool's page shape and registers the host pool's memory
        in place (SGLang calls this once, right after building the backend)."""
        super().register_mem_pool_host(mem_pool_host)
        keys, values, layers, layer_block_bytes = host_pool_layout(mem_pool_host)
        # No more layers in flight than a page has: each holds a set of IOCBs from its prepare.
        self._layers_ahead = min(self._layers_ahead, layers)
        config = self._config
        storage = self._storage_config
        kv_format = _kv_format_parts(mem_pool_host)
        if kv_format is None and config["model_fingerprint"] is None:
            raise ConfigError(
                f"SGLang's host pool stores its KV as {mem_pool_host.dtype} (as SGLang stores every fp8 "
                "--kv-cache-dtype), and SGLang's --kv-cache-dtype could not be read in this process, so the "
                "default fingerprint cannot tell fp8 formats apart (fp8_e5m2 and fp8_e4m3 pages would be served "
                "for each other): set \"model_fingerprint\" in --hicache-storage-backend-extra-config to 64 hex "
                "digits naming this model and KV format"
            )
        checkpoint = _checkpoint_parts() if config["model_fingerprint"] is None else ()
        if checkpoint is None:
            raise ConfigError(
                f"SGLang's model path could not be read in this process (its runtime context, get_model()), and the "
                f"model name SGLang gives the backend ({storage.model_name!r}) is --served-model-name, an alias that "
                "stays the same when the checkpoint behind it changes (another checkpoint would be served this one's "
                "pages): set \"model_fingerprint\" in --hicache-storage-backend-extra-config to 64 hex digits naming "
                "this model's checkpoint"
            )
        # The model (the explicit fingerprint, or SGLang's model name and checkpoint), then
        # always how its pages' bytes are laid out: an explicit fingerprint names the model, not
        # the layout, and SGLang may change the layout between two starts on its own (page_first
        # becomes page_first_direct with --hicache-io-backend direct: the same bytes per page, so
        # the pool opens, and token-major pages would be read into layer-major ones).
        model = fingerprint_from_config(config["model_fingerprint"], "sglang hicache", str(storage.model_name), *checkpoint)
        fingerprint = tutti.fingerprint(model, *_page_layout_parts(mem_pool_host, kv_format))
        shard = _shard_parts(storage, mem_pool_host)
        if shard:
            # A pipeline stage (or context-parallel rank) holds other layers (or another slice)
            # of each page under the same page hash: its own key space, even on shared devices.
            fingerprint = tutti.fingerprint(fingerprint, *shard)
        devices = rank_devices(config["devices"], storage)
        identities = _device_identities(devices)
        # Weights no server arg names (an explicit fingerprint is trusted to name them): pages
        # of this process's startup epoch are found by nothing after it.
        unnamed = _unnamed_startup_weights() if config["model_fingerprint"] is None else None
        if unnamed is not None:
            logger.warning(
                "tutti: nothing in SGLang's server args names the weights this server serves (%s), so the "
                "pages it backs up are found by this backend only (not after a restart or a re-attach: the "
                "weights may be others by then); set \"model_fingerprint\" in --hicache-storage-backend-extra-config to 64 hex "
                "digits naming the weights to share pages across restarts",
                unnamed,
            )
        # Read before the pool opens: an update from here on is seen by the first call after.
        epochs = self._epochs = _WeightEpochs(private_startup=unnamed is not None)
        if not config["format"]:
            _refuse_cleared_pool(devices, identities, fingerprint)
        # Before the open: a second backend of this process on these devices (PD decode's KV
        # offload manager's) would fail on the first's device locks naming another daemon.
        _claim_devices(self, devices, _claimed_identities(devices))
        try:
            self._store = tutti.Store.open(
                devices,
                byte_geometry(layer_block_bytes, layers),
                format=config["format"],
                overwrite=config["overwrite"],
                create_bytes=config["create_bytes"],
                slots_max=config["slots_max"],
                model_fingerprint=fingerprint,
                tp_rank=storage.tp_rank,
                tp_world=storage.tp_size,
                lock_dir=config["lock_dir"],
                requests_max=self._requests_max,
                iocbs=_iocbs(self._requests_max, self._layers_ahead, layer_block_bytes // 2),
                queue_depth=config["queue_depth"],
                timeout_s=self._timeout_s,
                layers_in_flight=self._layers_ahead,
                verify_retrieves=config["verify_retrieves"],
            )
        except BaseException:
            _release_devices(self)
            raise
        try:
            # Again now that the pool is open, inside this try (refused, the pool is closed and
            # the devices released): a pool file the format just created has an identity (its
            # inode, the next backend's name for it) only from here on.
            _claim_devices(self, devices, _claimed_identities(devices))
            identities = _device_identities(devices)
            self._store.register_kv(tutti.KvLayout.separate(keys, values))
        except BaseException as error:
            try:
                self._store.close()
            finally:
                _release_devices(self)
            if config["verify_retrieves"] and refuses_crc_less_pool(error):
                # The pool's own refusal names only reformatting: say the other way out too.
                raise ConfigError(
                    f"--hicache-storage-backend-extra-config: the pool on {', '.join(devices)} was formatted without "
                    "payload CRCs (`tutti pool format` and tuttid --format without --payload-crc), which "
                    "\"verify_retrieves\" (on by default) needs to check each page it reads: set \"verify_retrieves\": "
                    "false to serve this pool unchecked, or format it again with --payload-crc (or \"format\": true, "
                    f"which records them; everything on it is lost) [{error}]"
                ) from error
            raise
        if config["format"]:
            _forget_cleared_pools(identities)  # formatted: nothing stored before the clear is left
        self._pool_identity = (identities, fingerprint)
        self._layers = layers
        self._page_size = mem_pool_host.page_size
        if not _watch_host_pool_clears(mem_pool_host, epochs):
            logger.warning(
                "tutti: SGLang's host pool (%s) does not let its clear be watched: after a weight change "
                "nothing is backed up until this server restarts (a backup may hold the old weights' KV)",
                type(mem_pool_host).__name__,
            )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's HybridCacheController (0.5.23) registers every entry of its host pool group
        here after register_mem_pool_host, the KV pool's own entry included; any other pool (a
        hybrid model's SWA, Mamba, indexer... state) makes it call batch_exists_v2 /
        batch_get_v2 / batch_set_v2, which tutti does not implement (every call would raise).
        Such a pool is refused: the attach fails (SGLang does not start, or the runtime attach
        reports failure), and the tutti pool is closed first so a backend left half-attached
        moves nothing and misses."""
        name = getattr(host_pool_name, "value", host_pool_name)
        if name == "kv" and host_pool is getattr(self, "mem_pool_host", None):
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        if name == "kv":
            reason = (
                f"SGLang registered a KV host pool ({type(host_pool).__name__}) other than the one it gave "
                "register_mem_pool_host: tutti moves only that one"
            )
        else:
            reason = (
                f"SGLang registered a host pool {name!r} ({type(host_pool).__name__}) besides the KV pool: "
                "hybrid models (SWA, Mamba, ...) whose extra pools move through batch_*_v2 are not supported by tutti"
            )
        if self._store is not None:
            self._close_pool(reason, pages_written=False)
        raise ConfigError(f"{reason}; run this model without --hicache-storage-backend")

    # -- the zero-copy interface ----------------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many pages from the first are in the pool (the hit prefix, in pages)."""
        store = self._registered_store()
        if self._dead is not None:
            return 0
        salt = self._salt_now()
        for index, key in enumerate(keys):
            if store.lookup(_key_tokens(key, salt)) < 1:
                return index
        return len(keys)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Reads page i (key i) into the host pool's page at host_indices[i * page_size];
        per page whether it was read."""
        return self._move(keys, host_indices, store=False)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Writes the host pool's page at host_indices[i * page_size] as key i (already stored:
        shared, not written again); per page whether it is in the pool afterwards."""
        return self._move(keys, host_indices, store=True)

    def exists(self, key: str) -> bool:
        store = self._registered_store()
        return self._dead is None and store.lookup(_key_tokens(key, self._salt_now())) >= 1

    # -- SGLang's copying interface: not offered ------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise _copying_interface("get")

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise _copying_interface("batch_get")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise _copying_interface("set")

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        raise _copying_interface("batch_set")

    def clear(self) -> None:
        """SGLang's storage flush (/hicache/storage-backend/clear, e.g. after a weight update).
        tutti cannot forget a pool's blocks (no bulk delete), and SGLang 0.5.23 reports the clear
        a success whatever happens here (the scheduler ignores the outcome: "cleared
        successfully", HTTP 200), so the clear must make sure nothing stored before is served
        again: the pool is retired for this process through the stuck layer's close path (its
        queue pairs deleted; lookups miss and nothing moves until a restart), logged at warning
        level with what a restart does. A second clear does nothing. The pool is also recorded as
        cleared in this process: a backend built later in it (SGLang's StorageAttachment.detach
        then attach) is refused that pool under the same fingerprint unless it formats it
        (_refuse_cleared_pool)."""
        self._retire(
            "SGLang cleared the storage tier (/hicache/storage-backend/clear): tutti cannot delete a pool's "
            "pages, so it stops using the pool until this server restarts; a restart opens the same pool and "
            "serves the pages stored before the clear (they are named by token-prefix hashes, not by the "
            "weights): after a weight update restart with \"format\": true, other devices or a new "
            "\"model_fingerprint\" in --hicache-storage-backend-extra-config"
        )

    def _retire(self, reason: str) -> None:
        """Retires the pool for this process (SGLang's storage clear): recorded as
        cleared (_refuse_cleared_pool), then closed through the locked close, logged at warning
        level with `reason`. A pool closed already (a stuck layer, an earlier retire) is only
        recorded: its pages are still there."""
        if self._pool_identity is not None:
            _remember_cleared_pool(*self._pool_identity)
        if self._store is None or self._dead is not None:
            return
        self._close_pool(reason, pages_written=False, level=logging.WARNING)

    def _salt_now(self) -> bytes:
        """The key salt of SGLang's weight epoch now (reads use it at once: an older epoch's
        pages are other weights' KV)."""
        epochs = self._epochs
        assert epochs is not None  # set before the store (_registered_store)
        return epochs.salt(epochs.current())

    def _backup_salt(self) -> Optional[bytes]:
        """The key salt of SGLang's weight epoch now for a backup, or None when SGLang has not
        flushed its cache since the epoch began: the host pages may be older weights' KV
        (_WeightEpochs), so nothing is stored (logged once per epoch SGLang's weight change
        began; an epoch the overrides log's being unreadable began was logged by _WeightEpochs,
        once for the spell)."""
        epochs = self._epochs
        assert epochs is not None
        # One read of the three: another thread's storage call between separate reads may move
        # the epochs on (`_WeightEpochs.for_backup`).
        epoch, storable, unseen = epochs.for_backup()
        if storable:
            return epochs.salt(epoch)
        if self._unflushed_epoch_logged != epoch and not unseen:
            self._unflushed_epoch_logged = epoch
            logger.warning(
                "tutti: SGLang changed its weights (a new weight version or an update from disk; change %d in this "
                "process) and has not flushed its cache since: backups are refused until it does (a host page may hold the old weights' KV); an "
                "update with flush_cache (the default) or /flush_cache resumes them",
                epoch,
            )
        return None

    def close(self) -> None:
        """Closes the pool (SGLang's shutdown) through the same path as a stuck layer's close, so
        a read still running on SGLang's other thread sees its outcome before it returns pages;
        a close that could not confirm its queue pairs deleted ends the process (a read on the
        other thread may still have host pages written)."""
        if self._store is not None:
            self._close_pool("SGLang closed the storage backend", pages_written=False, level=logging.INFO)

    # -----------------------------------------------------------------------------------------

    def _registered_store(self) -> Any:
        if self._unsafe is not None:
            _host_pages_unsafe(self._unsafe)
        if self._store is None:
            raise tutti.NotRegistered("TuttiHiCacheStorage: SGLang has not registered its host pool yet (register_mem_pool_host)")
        return self._store

    def _move(self, keys: List[str], host_indices: torch.Tensor, store: bool) -> List[bool]:
        pool = self._registered_store()
        pages = _pages(host_indices, len(keys), self._page_size)
        results = [False] * len(keys)
        # SGLang stops its storage threads (a flush) by joining each for 10 s. After `soft` the
        # call starts nothing (no wave, no layer); the layers in flight then may complete until
        # `hard`, and every wait ends by it: a layer still in flight then closes the pool.
        soft = time.monotonic() + self._call_timeout_s
        hard = soft + _CALL_GRACE_S
        # Each wave takes its request places from the budget shared with SGLang's other thread
        # (prefetch and backup run at once on this one store).
        self._places.enter()
        try:
            start = 0
            while start < len(keys):
                if self._dead is not None:
                    break
                # Long enough for the other thread's wave (served first, arrival order) when each
                # of its `layers + layers_ahead - 1` rounds of waits ends within timeout_s, as it
                # does when the devices answer in time. Not a bound on that wave (a round waits its
                # requests in turn, each up to timeout_s, and waits out a failed one again): a
                # slower one makes the rest of this batch misses, never wrong data. A wave that
                # stalls closes the pool, which wakes this wait at once. Never past the call's
                # soft deadline: the pages left then are misses.
                left_s = soft - time.monotonic()
                if left_s <= 0:
                    logger.warning(
                        "tutti: %d pages not %s: the call ran %.1f s (\"call_timeout_s\")",
                        len(keys) - start, "stored" if store else "read", self._call_timeout_s,
                    )  # fmt: skip
                    break
                wave_s = min(self._timeout_s * (self._layers + self._layers_ahead), _PLACE_WAIT_MAX_S)
                taken = self._places.take(len(keys) - start, min(wave_s, left_s), lambda: self._dead is not None)
                if taken == 0:
                    # The call's deadline, not one wave of the other thread, may have ended it.
                    if self._dead is None and left_s < wave_s:
                        logger.warning(
                            "tutti: %d pages not %s: no request place came free before the call's deadline "
                            "(\"call_timeout_s\" %.1f s; SGLang's other thread held them)",
                            len(keys) - start, "stored" if store else "read", self._call_timeout_s,
                        )  # fmt: skip
                    elif self._dead is None:
                        logger.warning(
                            "tutti: %d pages not %s: no request place came free in %.1f s (SGLang's other thread held them)",
                            len(keys) - start, "stored" if store else "read", wave_s,
                        )  # fmt: skip
                    break
                try:
                    # Every wave, once its places are taken: a weight update may land while a
                    # long batch moves (or waits). A wave already running goes on in its epoch (a
                    # backup of older KV stays in the older key space).
                    salt = self._backup_salt() if store else self._salt_now()
                    going = salt is not None and self._move_wave(pool, keys, pages, results, start, start + taken, store, salt, soft, hard)
                finally:
                    self._places.give(taken)
                start += taken
                if not going:
                    break
        finally:
            self._places.leave()
        if not store:
            # Another thread may have closed the pool under this read's requests: its pages go
            # back only if that close confirmed the queue pairs deleted (else the process ends).
            with self._close_lock:
                if self._unsafe is not None:
                    _host_pages_unsafe(self._unsafe)
        return results

    def _move_wave(
        self,
        pool: Any,
        keys: List[str],
        pages: list[Optional[int]],
        results: List[bool],
        start: int,
        end: int,
        store: bool,
        salt: bytes,
        soft: float,
        hard: float,
    ) -> bool:
        """Moves pages start..end (at most the request places taken for them) as one wave, noting
        each page moved in `results`; keys are named in the weight epoch of `salt`; no layer is
        issued after `soft` and every wait ends by `hard` (time.monotonic()). Returns False when
        the pool was closed (a stuck layer or a request that could not be ended): nothing more
        moves."""
        wave: list[tuple[int, Any]] = []
        for index in range(start, end):
            if pages[index] is None:
                continue
            tokens = _key_tokens(keys[index], salt)
            try:
                if store:
                    request = pool.prepare_store(tokens, [pages[index]])
                    if request.new_blocks == 0:
                        request.finish()
                        results[index] = True
                        continue
                else:
                    request = pool.prepare_retrieve(tokens, [pages[index]])
            except tutti.Error as error:
                logger.warning("tutti: page %s not %s: %s", keys[index], "stored" if store else "read", error)
                continue
            wave.append((index, request))
        if self._run_layers(wave, store, soft, hard):
            # Nothing of this wave is reported moved: its live requests end with the pool.
            self._close_pool("a layer of a page did not complete", pages_written=not store, deadline=hard)
            return False
        stuck = False
        for index, request in wave:
            if request is None:
                continue
            try:
                if store:
                    request.commit()
                else:
                    request.finish()
                results[index] = True
            except tutti.InvalidState as error:
                # The store still counts a layer in flight: the request stays live, and its
                # page may still be moved.
                logger.error("tutti: page %s could not be ended (a layer is still in flight): %s", keys[index], error)
                stuck = True
            except tutti.Error as error:
                logger.warning("tutti: page %s not %s: %s", keys[index], "stored" if store else "read", error)
        if stuck:
            self._close_pool("a page's request could not be ended", pages_written=not store, deadline=hard)
            return False
        return True

    def _run_layers(self, wave: list[tuple[int, Any]], store: bool, soft: float, hard: float) -> bool:
        """Every layer of every request of the wave, `layers_in_flight` layers in flight per
        request: layer l is issued on every request, then each one's oldest layer (l - N + 1)
        is waited for, each wait up to timeout_s and no later than `hard`. A request that fails
        (a layer not complete by then included) is finished and replaced by None in `wave`. A
        layer due to be issued after `soft` is not: every live request (none has all its layers
        issued) is then finished once its layers in flight completed, and replaced by None (its
        page a miss). Returns True (at once) when a failed or cut request's layer does not
        complete by `hard`: it is kept, and the devices may still move its page's bytes."""
        ahead = self._layers_ahead
        issue = "store_layer" if store else "retrieve_layer"
        # Round r issues layer r (while there is one) and waits for layer r - ahead + 1 (once
        # there is one): every layer issued, and waited for, in order.
        for round_index in range(self._layers + ahead - 1):
            if round_index < self._layers:
                layer = round_index
                if time.monotonic() >= soft:
                    return self._cut_wave(wave, store, hard)
                if self._each_request(
                    wave, lambda request: getattr(request, issue)(layer), f"layer {layer} of a page failed to issue", hard
                ):
                    return True
            oldest = round_index - ahead + 1
            if oldest >= 0 and self._each_request(
                wave, lambda request: request.wait(wait_s(self._timeout_s, hard)), f"layer {oldest} of a page failed", hard
            ):
                return True
        return False

    def _cut_wave(self, wave: list[tuple[int, Any]], store: bool, hard: float) -> bool:
        """Ends the wave's live requests at the call's soft deadline, before all their layers
        were issued: each is finished once its layers in flight completed (waited for until
        `hard`) and replaced by None, its page a miss. True (at once) when one's layer does not
        complete by then: it is kept, and the devices may still move its page's bytes."""
        live = [position for position, (_, request) in enumerate(wave) if request is not None]
        if live:
            logger.warning(
                "tutti: %d pages not %s: the call ran %.1f s (\"call_timeout_s\") before all their layers were issued",
                len(live), "stored" if store else "read", self._call_timeout_s,
            )  # fmt: skip
        for position in live:
            index, request = wave[position]
            if not _abandon(request, self._timeout_s, hard):
                return True
            wave[position] = (index, None)
        return False

    def _each_request(self, wave: list[tuple[int, Any]], action: Callable[[Any], Any], failed: str, deadline: float) -> bool:
        """`action` on every live request of the wave; one that raises is finished (after its
        layers in flight, waited for until `deadline`: an issue that failed after its commands
        were published leaves its layer in flight) and replaced by None. Returns True (at once)
        when such a request's layer does not complete: it is kept, and the devices may still
        move its page's bytes."""
        for position, (index, request) in enumerate(wave):
            if request is None:
                continue
            try:
                action(request)
            except tutti.Error as error:
                logger.warning("tutti: %s: %s", failed, error)
                if not _abandon(request, self._timeout_s, deadline):
                    return True
                wave[position] = (index, None)
        return False

    def _close_pool(self, reason: str, pages_written: bool, level: int = logging.ERROR, deadline: Optional[float] = None) -> None:
        """Closes the pool for good (its queue pairs deleted: no controller touches a host page
        after that) before a batch with a stuck layer returns, since SGLang reuses the host pages
        of pages reported not moved. When the close could not confirm its queue pairs deleted
        (memory registrations kept), a read of this thread or SGLang's other one may still have
        host pages written, and SGLang reuses them whatever the call does (it catches every
        exception): the process ends (_host_pages_unsafe) under the lock, so no read returns.
        `pages_written` (this batch was a read) only names what the log says. `deadline`: the
        calling batch's hard deadline (time.monotonic()); the close then waits for the layers in
        flight until it (at least _CLOSE_AT_DEADLINE_MIN_S) rather than timeout_s, so the wait
        still ends within SGLang's join of its storage threads."""
        with self._close_lock:
            if self._dead is None:
                self._dead = reason
                self._places.wake()
                logger.log(level, "tutti: %s; the pool is closed, the backend moves nothing more (lookups miss)", reason)
                close_s = self._timeout_s
                if deadline is not None:
                    close_s = min(close_s, max(deadline - time.monotonic(), _CLOSE_AT_DEADLINE_MIN_S))
                try:
                    self._store.close(timeout_s=close_s)
                finally:
                    _release_devices(self)  # a later backend of this process may open them
                kept = self._store.leaked_registrations()
                if kept:
                    # Whatever this thread moved: a read of another thread may have been in flight.
                    what = "a read" if pages_written else "not a read, but a read on SGLang's other thread may be in flight"
                    self._unsafe = (
                        f"{reason} ({what}), "
                        f"and closing the pool did not confirm that its queue pairs were deleted ({kept} memory "
                        "registrations kept): SGLang's host pages may still be written by a device"
                    )
            if self._unsafe is not None:
                _host_pages_unsafe(self._unsafe)


# The fewest bytes one NVMe command of a pool carries (but the last of a page's layer), for
# sizing IOCBs before the pool's devices are open (their MDTS is known only then, and the binding
# reports none): on the PRP path a command moves whole 4 KiB pages; on the SGL path as many whole
# parts of an object (each at most MDTS) as MDTS holds, more than half of it, and the smallest
# MDTS NVMe allows is 8 KiB (2^1 x a 4 KiB CAP.MPSMIN).
_COMMAND_BYTES_MIN = 4096
# The most bytes one NVMe command carries on any device: the driver caps MDTS at one PRP list
# page of pages (nvme-driver's TRANSFER_BYTES_MAX).
_COMMAND_BYTES_MAX = 2 << 20


def _iocbs(requests_max: int, layers_in_flight: int, object_bytes: int = 0) -> int:
    """The IOCBs a pool needs for `requests_max` pages of `layers_in_flight` layers in flight
    each. A request is one page, one block, and each layer in flight holds a set of IOCBs, one
    per 2048 NVMe commands of the page's layer: its K and V objects of `object_bytes` each, cut
    at MDTS. In a layer_first pool an object is one layer's (a page of Llama-3-8B, 64 tokens:
    128 KiB); in a page layout (page_first, page_first_direct, page_head) it spans every layer
    (4 MiB; a 70B model's at tp 1 and 1024-token pages, 160 MiB: 2560 commands at a 128 KiB
    MDTS). The MDTS is not known here, so a set is sized for commands of _COMMAND_BYTES_MIN:
    2 x object / 4 KiB commands, one IOCB up to 4 MiB objects (those a device of larger MDTS
    needs fewer of); at most 1024 IOCBs in all. That count is a worst case (a device of 8 KiB
    MDTS), so its passing 1024 is logged at info level, not as a shortfall: the 70B pages above
    at requests_max 32 want 1280 at 4 KiB but 64 at 128 KiB. Only where even commands of
    _COMMAND_BYTES_MAX (no device's are larger) would not fit the sets in 1024 is fewer requests
    being prepared at once than requests_max certain, and iocbs_for warns (its count for them,
    at most 1024 // IOCBs a set, is an upper bound). iocbs_for's default (two IOCBs a set) would
    give small pages twice the IOCBs and a false warning at requests_max 512. `object_bytes` 0:
    only the sets are checked. Raises ConfigError past 1024 sets."""
    where = "--hicache-storage-backend-extra-config"
    # iocbs_for counts two commands (a K and a V object) a block: a layer's commands are
    # commands / 2 of them. At the largest command, K and V may share one (SGL descriptors).
    fewest = -(-2 * object_bytes // _COMMAND_BYTES_MAX)
    # Refused, or warned here; the count it names is for 2 MiB commands: an upper bound.
    iocbs_for(where, requests_max, layers_in_flight, blocks_per_request_max=max(1, -(-fewest // 2)), upper_bound=True)
    commands = 2 * -(-object_bytes // _COMMAND_BYTES_MIN)
    per_set = max(1, -(-commands // _COMMANDS_PER_IOCB))
    wanted = requests_max * layers_in_flight * per_set
    if wanted > _IOCBS_MAX:
        logger.info(
            "%s: %d requests x %d layers in flight x %d IOCBs a page layer of %d-byte objects needs at 4 KiB a command "
            "= %d IOCBs, given %d: a worst case, for a device of 8 KiB MDTS (a larger MDTS needs fewer); where the "
            "devices' MDTS needs more than given, a prepare past them is a miss that says so",
            where, requests_max, layers_in_flight, per_set, object_bytes, wanted, _IOCBS_MAX,
        )  # fmt: skip
    return min(_IOCBS_MAX, max(64, 1 << (wanted - 1).bit_length()))


class _RequestPlaces:
    """The store's `requests_max` request places (and the IOCBs sized for them), shared by the
    threads that move pages at once (SGLang prefetches and backs up on two): a wave takes places
    before it prepares its requests and gives them back once they are ended, so no thread's page
    is refused for want of a place (LimitReached) while the other's wave runs. Takers are served
    in arrival order, and while several threads move pages each wave takes at most its share
    (requests_max / threads moving, at least 1)."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._free = total
        self._movers = 0
        self._queue: list[object] = []
        self._cond = threading.Condition()

    def enter(self) -> None:
        with self._cond:
            self._movers += 1

    def leave(self) -> None:
        with self._cond:
            self._movers -= 1
            self._cond.notify_all()

    def take(self, wanted: int, timeout_s: float, dead: Callable[[], bool]) -> int:
        """Up to `wanted` places (at least 1), waiting at most `timeout_s` for this thread's turn
        and a free place; 0 when none came free in time or `dead()` (the pool was closed)."""
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                ready = self._cond.wait_for(lambda: dead() or (self._queue[0] is ticket and self._free > 0), timeout_s)
                if not ready or dead():
                    return 0
                taken = min(wanted, self._free, max(1, self._total // max(1, self._movers)))
                self._free -= taken
                return taken
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def give(self, count: int) -> None:
        with self._cond:
            self._free += count
            self._cond.notify_all()

    def wake(self) -> None:
        """Wakes every taker (the pool was closed: they give up)."""
        with self._cond:
            self._cond.notify_all()


def _host_pages_unsafe(why: str) -> None:
    """Ends the process: a device may still write SGLang's host pages. There is no safe way back
    to SGLang 0.5.23: its cache controller catches every exception of batch_get_v1 (prefetch:
    0 pages read), batch_exists and batch_set_v1 and goes on serving, and the pages a prefetch does
    not count read are freed and reused; an exception outside Exception would only end that
    thread while the scheduler goes on serving. So: logged at critical
    level with why, logs flushed, os.abort() (SIGABRT: a crash a supervisor sees; SGLang's
    faulthandler dumps every thread's stack)."""
    logger.critical(
        "tutti: %s. SGLang would reuse those pages (it catches every error of a storage call and frees "
        "the pages it counts not moved), so tutti ends the process now (abort) rather than return to it; "
        "restart the server (the pool's devices may need a reset)",
        why,
    )
    _flush_logs()
    os.abort()


def _flush_logs() -> None:
    """Flushes this module's log handlers (and its ancestors'), stdout and stderr."""
    log: Optional[logging.Logger] = logger
    while log is not None:
        for handler in log.handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - flushing is best effort before the abort
                pass
        log = log.parent if log.propagate else None
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def host_pool_layout(host_pool: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int]:
    """SGLang's MHA host pool as tutti's "separate" layout over raw bytes: (keys, values, layers,
    bytes of one layer's K+V of a page). Raises ConfigError for a pool tutti cannot register."""
    # Only the pool class whose pages are wholly in kv_buffer, by exact class: a subclass may keep
    # part of a page elsewhere (SGLang 0.5.23's MHATokenToKVPoolMXFP8Host keeps each page's fp8
    # scales in k_scale_host / v_scale_host, which tutti would never store, so a page read back
    # would carry the scales of the host page's previous occupant; its own L3 page calls raise).
    if type(host_pool) is not MHATokenToKVPoolHost:
        raise ConfigError(
            f"tutti stores SGLang's MHATokenToKVPoolHost pages byte-exact; this server's host pool is "
            f"{type(host_pool).__module__}.{type(host_pool).__name__}, whose pages tutti cannot move exactly "
            "(not supported: run without --hicache-storage-backend, or with a KV cache format SGLang keeps "
            "in a plain MHA host pool)"
        )
    layout = getattr(host_pool, "layout", None)
    buffer = getattr(host_pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor) or buffer.dim() < 5 or buffer.shape[0] != 2:
        raise ConfigError(
            f"tutti stores SGLang's MHA host pools (a [2, ...] K/V buffer); {type(host_pool).__name__} is not one"
        )
    if getattr(host_pool, "head_dim", None) != getattr(host_pool, "v_head_dim", host_pool.head_dim):
        raise ConfigError("tutti needs K and V of the same head dimension (v_head_dim differs)")
    page_size = int(host_pool.page_size)
    page_num = int(host_pool.size) // page_size
    if page_num * page_size != int(host_pool.size):
        # Every layout: pages are views of whole pages of the buffer.
        raise ConfigError(f"the host pool's {host_pool.size} tokens are not whole pages of {page_size}")
    if layout != "layer_first" and layout not in _PAGE_LAYOUTS:
        raise ConfigError(
            f"SGLang host pool layout {layout!r} is not supported by tutti: use --hicache-mem-layout "
            f"layer_first or one of {', '.join(_PAGE_LAYOUTS)}"
        )
    # The buffer's token (or page) dimension holds the pool's `size` tokens, whole pages.
    if layout == "layer_first":
        rows, rows_expected = buffer.shape[2], page_num * page_size
    elif layout == "page_first":
        rows, rows_expected = buffer.shape[1], page_num * page_size
    else:
        rows, rows_expected = buffer.shape[1], page_num
    if rows != rows_expected:
        raise ConfigError(
            f"the {layout} host pool's K/V buffer {tuple(buffer.shape)} does not hold its {host_pool.size} tokens "
            f"as {page_num} pages of {page_size}"
        )
    raw = buffer.view(torch.uint8)
    try:
        if layout == "layer_first":
            layers = int(host_pool.layer_num)
            # view, never reshape: a copy would register memory SGLang never reads.
            keys = [raw[0, layer].view(page_num, -1) for layer in range(layers)]
            values = [raw[1, layer].view(page_num, -1) for layer in range(layers)]
        else:
            layers = 1
            keys = [raw[0].view(page_num, -1)]
            values = [raw[1].view(page_num, -1)]
    except RuntimeError as error:
        # A buffer that is not whole contiguous pages of `size` tokens (torch refuses the view).
        raise ConfigError(
            f"the {layout} host pool's K/V buffer {tuple(buffer.shape)} is not {page_num} whole pages of "
            f"{page_size} tokens that tutti can register in place: {error}"
        ) from error
    return keys, values, layers, 2 * keys[0].shape[1]


def _pages(host_indices: torch.Tensor, count: int, page_size: int) -> list[Optional[int]]:
    """The host pool page of each of `count` pages: host_indices[i * page_size] // page_size, or
    None for a page whose indices are not one aligned page (logged; that page fails)."""
    if host_indices.numel() < count * page_size:
        raise tutti.InvalidArgument(f"{count} keys need {count * page_size} host indices, got {host_indices.numel()}")
    starts = host_indices[: count * page_size : page_size].tolist()
    pages: list[Optional[int]] = []
    for start in starts:
        if start % page_size != 0:
            logger.warning("tutti: host index %d does not start a page of %d tokens", start, page_size)
            pages.append(None)
        else:
            pages.append(start // page_size)
    return pages


def _key_tokens(key: str, salt: bytes) -> list[int]:
    """The tokens naming SGLang's page `key` in the weight epoch of `salt` (_WeightEpochs.salt:
    empty in epoch 0, so the names pages had before epochs existed stay)."""
    return hash_tokens(salt + key.encode("utf-8"), BYTE_GEOMETRY_BLOCK_TOKENS)


def _abandon(request: Any, timeout_s: float, deadline: float) -> bool:
    """`abandon_request` with this module's log, its waits for the layers in flight ending by
    `deadline` (time.monotonic(): the batch call's)."""
    what = "tutti: a failed page request"
    if not wait_out_layer(request, timeout_s, logger, what, deadline=deadline):
        return False
    # No layer in flight any more: abandon_request only finishes it.
    return abandon_request(request, timeout_s, logger, what)


def _copying_interface(name: str) -> tutti.InvalidState:
    return tutti.InvalidState(
        f"TuttiHiCacheStorage.{name}: tutti offers only SGLang's zero-copy interface; set \"interface_v1\": 1 "
        "in --hicache-storage-backend-extra-config (the backend refuses to start without it)"
    )


__all__ = ["TESTED_SGLANG_VERSION", "TuttiHiCacheStorage", "check_rank_devices", "check_sglang_version", "host_pool_layout", "rank_devices"]
