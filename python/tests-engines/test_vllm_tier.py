"""tutti.vllm.TuttiTier inside vLLM 0.32's real tiering: vLLM's TieringOffloadingSpec builds its
CPU primary tier (a shared-memory region of chunk rows) and, through its SecondaryTierFactory, our
tier from the "secondary_tiers" config, exactly as for `--kv-transfer-config`. Chunks stored into
the primary tier cascade to tutti; a second engine (new primary tier, same pool) finds them,
promotes them into its rows, and the bytes match."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest

import tutti
import vllm_harness as harness
from stalled import SleepingStall, StalledLayer
from tutti.vllm import TuttiTier
from tutti.vllm.connector import KvMemoryUnsafe
from vllm.v1.kv_offload.base import Locality, LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

WORLD = 2
# One worker's bytes of one block: 2 layers x 16 tokens x 2 heads x (64 + 64) x 2 bytes.
WORKER_BLOCK_BYTES = 2 * 16 * 2 * 128 * 2
CHUNKS = 32
DEADLINE_S = 60.0


def engine_config(pool_file: Path, revision=None, quantization=None) -> SimpleNamespace:
    """A stand-in for the engine's VllmConfig (what the tier's default key reads of it), over a
    local model directory beside the pool."""
    model_dir = pool_file.parent / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 1e6}))
    model = SimpleNamespace(model=str(model_dir), revision=revision, dtype="bfloat16", quantization=quantization, hf_overrides={})
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"))


class EngineSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec whose get_manager runs where vLLM's OffloadingConnectorScheduler
    calls it: with the engine's `vllm_config` and `kv_cache_config` in the calling frame."""

    engine: object = None

    def get_manager(self):
        vllm_config = self.engine  # noqa: F841 - read by the tier from this frame, as from vLLM's
        kv_cache_config = None  # noqa: F841
        return super().get_manager()


def offloading_spec(
    pool_file: Path, format_pool: bool, dtype: str = "bfloat16", tp_size: int = WORLD, pp_size: int = 1, engine=..., **tier_changes
) -> TieringOffloadingSpec:
    """`engine`: the engine's config the tier finds (default: engine_config(pool_file)); None:
    none (a spec built outside an engine)."""
    tier = {
        "type": "TuttiTier",
        "module_path": "tutti.vllm",
        "devices": f"emu:{pool_file}",
        "format": format_pool,
        "create_bytes": 64 << 20,
        "lock_dir": str(pool_file.parent / "locks"),
    }
    tier.update(tier_changes)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=WORKER_BLOCK_BYTES,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": CHUNKS * WORKER_BLOCK_BYTES * WORLD,
            "secondary_tiers": [{key: value for key, value in tier.items() if value is not None}],
        },
        engine_id=f"tutti-test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="tutti-test-model", dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=WORLD, tp_size=tp_size, pp_size=pp_size, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),  # fmt: skip
    )
    if engine is None:
        return TieringOffloadingSpec(config)
    spec = EngineSpec(config)
    spec.engine = engine_config(pool_file) if engine is ... else engine
    return spec


def keys(count: int, seed: int) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{seed}:{index}".encode()).digest(), 0) for index in range(count)]


def rows(tier: TuttiTier) -> np.ndarray:
    """The primary tier's chunk rows (the memoryview vLLM hands the tier), as numpy."""
    return np.asarray(tier._primary_kv_view).view(np.uint8)


def step_until(manager, done, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        assert time.monotonic() < deadline, f"{what} within {DEADLINE_S} s"
        time.sleep(0.01)


def test_cascade_then_promotion_in_a_new_engine_byte_exact(tmp_path: Path):
    """Goal: chunks stored into vLLM's CPU tier are cascaded to tutti (submit_store on the tier's
    thread, results through get_finished_jobs), and a restarted engine's tiering manager finds
    them through the tier's lookup and promotes them (submit_load) byte-exact."""
    pool = tmp_path / "pool.img"
    chunk_keys = keys(4, 1)
    spec = offloading_spec(pool, True)
    manager = spec.get_manager()
    try:
        tier = manager.secondary_tiers[0]
        assert isinstance(tier, TuttiTier)
        context = ReqContext(req_id="store")
        manager.on_new_request(context)
        output = manager.prepare_store(chunk_keys, context)
        assert output is not None and list(output.keys_to_store) == chunk_keys
        chunks = [int(chunk) for chunk in output.store_spec.chunk_ids]
        generator = np.random.default_rng(5)
        view = rows(tier)
        for chunk in chunks:  # the workers' GPU → CPU copy
            view[chunk] = generator.integers(0, 256, view.shape[1], dtype=np.uint8)
        expected = [view[chunk].copy() for chunk in chunks]
        manager.complete_store(chunk_keys, context)
        step_until(manager, lambda: all(tier.lookup(key, context) is LookupResult.HIT for key in chunk_keys), "cascaded to tutti")
        step_until(manager, lambda: not manager.has_pending_work(), "cascade jobs reported")
        manager.on_request_finished(context)
        # vLLM's cache reset drains every tier's jobs (TuttiTier.drain_jobs) before it frees rows.
        manager.reset_cache()
    finally:
        manager.shutdown()

    restarted = offloading_spec(pool, False).get_manager()
    try:
        tier = restarted.secondary_tiers[0]
        context = ReqContext(req_id="load")
        restarted.on_new_request(context)
        assert restarted.lookup(chunk_keys[0], context) is not LookupResult.HIT  # not in its CPU tier
        step_until(
            restarted,
            lambda: all(restarted.lookup(key, context) is LookupResult.HIT for key in chunk_keys),
            "promoted from tutti",
        )
        spec_load = restarted.prepare_load(chunk_keys, context)
        view = rows(tier)
        for chunk, want in zip(spec_load.chunk_ids, expected):
            assert np.array_equal(view[int(chunk)], want), f"promoted chunk row {chunk} differs"
        restarted.complete_load(chunk_keys, context)
        assert tier.lookup(keys(1, 2)[0], context) is LookupResult.MISS
        restarted.on_request_finished(context)
    finally:
        restarted.shutdown()


def test_an_explicit_fingerprint_is_another_key_space_under_another_dtype(tmp_path: Path):
    """Goal: an explicit model_fingerprint names the model, not the bytes' layout: chunks stored
    in bfloat16 are not found by an engine of the same fingerprint in float16 (the same chunk
    size, other bytes), and are found again in bfloat16."""
    pool = tmp_path / "pool.img"
    chunk_keys = keys(2, 3)
    explicit = "ab" * 32

    def stored_then_found(dtype: str, format_pool: bool, store: bool) -> bool:
        manager = offloading_spec(pool, format_pool, dtype=dtype, model_fingerprint=explicit).get_manager()
        try:
            tier = manager.secondary_tiers[0]
            context = ReqContext(req_id=f"{dtype}-{store}")
            manager.on_new_request(context)
            if store:
                output = manager.prepare_store(chunk_keys, context)
                assert output is not None
                manager.complete_store(chunk_keys, context)
                step_until(manager, lambda: all(tier.lookup(key, context) is LookupResult.HIT for key in chunk_keys), "cascaded")
                step_until(manager, lambda: not manager.has_pending_work(), "cascade jobs reported")
            found = all(tier.lookup(key, context) is LookupResult.HIT for key in chunk_keys)
            manager.on_request_finished(context)
            manager.reset_cache()
            return found
        finally:
            manager.shutdown()

    assert stored_then_found("bfloat16", True, store=True)
    assert not stored_then_found("float16", False, store=False), "float16 found bfloat16's chunks"
    assert stored_then_found("bfloat16", False, store=False), "bfloat16 lost its own chunks"


def stored_chunks_found(pool: Path, store: bool, **spec_changes) -> bool:
    """Stores two chunks into the pool through a tier of `spec_changes` (store) or looks them up."""
    manager = offloading_spec(pool, store, **spec_changes).get_manager()
    try:
        tier = manager.secondary_tiers[0]
        chunk_keys = keys(2, 11)
        if store:
            assert tier._store_chunks(chunk_keys, [0, 1]) == chunk_keys
        context = ReqContext(req_id="found")
        return all(tier.lookup(key, context) is LookupResult.HIT for key in chunk_keys)
    finally:
        manager.shutdown()


def test_the_default_key_names_the_parallel_split_quantization_and_revision(tmp_path: Path):
    """Goal: chunks stored under TP=2 x PP=1 are not found under TP=1 x PP=2 (the same world size,
    each rank's bytes of other layers or heads), nor by the same model under another quantization
    or another revision (other weights, other KV): the default key is built from the engine's
    VllmConfig as the connector's is, plus the offloading config's parallel split and groups."""
    pool = tmp_path / "pool.img"
    assert stored_chunks_found(pool, True, tp_size=2, pp_size=1)
    assert stored_chunks_found(pool, False, tp_size=2, pp_size=1), "the same engine lost its own chunks"
    assert not stored_chunks_found(pool, False, tp_size=1, pp_size=2), "TP=1 x PP=2 found TP=2 x PP=1's chunks"
    assert not stored_chunks_found(pool, False, engine=engine_config(pool, quantization="fp8")), "fp8 found bf16's chunks"
    assert not stored_chunks_found(pool, False, engine=engine_config(pool, revision="r2")), "revision r2 found r1's chunks"
    given = "cd" * 32
    assert stored_chunks_found(pool, False, engine=None, model_fingerprint=given) is False
    assert not stored_chunks_found(pool, False, engine=None, tp_size=1, pp_size=2, model_fingerprint=given)


def test_the_default_key_is_the_same_whether_or_not_vllm_has_a_current_config(tmp_path: Path, monkeypatch):
    """Goal: the tier's default key names the engine's KV cache groups, read from the frame of
    vLLM's OffloadingConnectorScheduler.__init__ (its `vllm_config` and `kv_cache_config`); with
    vLLM's current config also set (set_current_vllm_config) the key is the same, not one
    without the groups: the frame is read first, the current config only where no frame has it."""
    import vllm.config
    from tutti.vllm.tier import _tier_fingerprint

    engine = engine_config(tmp_path / "pool.img")
    spec_config = offloading_spec(tmp_path / "pool.img", True).config

    def key_where_vllm_builds_the_tier():
        vllm_config = engine  # noqa: F841 - read by the tier from this frame
        kv_cache_config = harness.kv_cache_config()  # noqa: F841
        return _tier_fingerprint(spec_config, 4096, None, "t")

    without_current = key_where_vllm_builds_the_tier()
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: engine)
    assert key_where_vllm_builds_the_tier() == without_current, "the current config dropped the KV cache groups"
    # No frame has it: the current config is used (no KV cache groups to name).
    assert _tier_fingerprint(spec_config, 4096, None, "t") != without_current


@pytest.mark.parametrize("explicit", [None, "cd" * 32])
def test_a_model_with_non_causal_attention_is_refused(tmp_path: Path, explicit):
    """Goal: with non-causal (Prefix-LM, bidirectional) attention a chunk's KV depends on the
    prompt's later tokens, so a prompt sharing only its prefix would promote another prompt's KV
    (vLLM disables its own prefix caching for such a model; its offloading connector does not
    look). The tier refuses an engine whose KV cache groups say so (FullAttentionSpec.non_causal,
    read where vLLM builds the tier), with or without an explicit fingerprint; a causal one
    gets its key."""
    from tutti.vllm.tier import _tier_fingerprint
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    engine = engine_config(tmp_path / "pool.img")
    spec_config = offloading_spec(tmp_path / "pool.img", True).config

    def key_where_vllm_builds_the_tier(non_causal: bool):
        spec = FullAttentionSpec(
            block_size=harness.BLOCK_TOKENS, num_kv_heads=harness.KV_HEADS, head_size=harness.HEAD_DIM, dtype=harness.DTYPE,
            non_causal=non_causal,
        )  # fmt: skip
        vllm_config = engine  # noqa: F841 - read by the tier from this frame
        kv_cache_config = harness.kv_cache_config(spec=spec)  # noqa: F841
        return _tier_fingerprint(spec_config, 4096, explicit, "nvme")

    assert len(key_where_vllm_builds_the_tier(False)) == 32
    with pytest.raises(tutti.InvalidArgument, match="secondary tier 'nvme'.*non-causal.*Prefix-LM"):
        key_where_vllm_builds_the_tier(True)


def test_the_tiers_streamed_weights_warning_names_the_tiers_config(tmp_path: Path, caplog):
    """Goal: the tier's default key over weights streamed from object storage (vLLM's
    model_weights set) warns that the URL's objects are not named, and says to set
    model_fingerprint in the tier's own config (TIER_CONFIG_FIELDS), where the tier reads it, not
    in kv_connector_extra_config, where the connector reads it."""
    import logging

    from tutti.vllm.tier import _tier_fingerprint

    engine = engine_config(tmp_path / "pool.img")
    engine.model_config.model_weights = "s3://bucket/llama/"
    spec_config = offloading_spec(tmp_path / "pool.img", True).config
    caplog.set_level(logging.WARNING, logger="tutti.vllm")

    def key_where_vllm_builds_the_tier():
        vllm_config = engine  # noqa: F841 - read by the tier from this frame
        kv_cache_config = None  # noqa: F841
        return _tier_fingerprint(spec_config, 4096, None, "nvme")

    key_where_vllm_builds_the_tier()
    warnings = [record.getMessage() for record in caplog.records if "s3://bucket/llama/" in record.getMessage()]
    assert len(warnings) == 1, warnings
    assert "secondary tier 'nvme'" in warnings[0] and "kv_connector_extra_config" not in warnings[0], warnings
    caplog.clear()
    _tier_fingerprint(spec_config, 4096, "cd" * 32, "nvme")
    assert not [record for record in caplog.records if "s3://" in record.getMessage()], "warned with an explicit fingerprint"


def test_vllms_own_offloading_connector_gives_the_tier_one_key_with_or_without_a_current_config(tmp_path: Path, monkeypatch):
    """Goal: built by vLLM's real OffloadingConnector (SCHEDULER role, TieringOffloadingSpec
    from kv_connector_extra_config, a real VllmConfig over a local model), the tier's default key
    is the same whether or not vLLM's current config is set (set_current_vllm_config) while the
    connector is built."""
    import uuid

    import tutti.vllm.tier as tier_module
    from test_vllm_connector import llama_model_config
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    keys_made: list[bytes] = []
    real_fingerprint = tier_module._tier_fingerprint

    def recorded(*args, **kwargs):
        keys_made.append(real_fingerprint(*args, **kwargs))
        return keys_made[-1]

    monkeypatch.setattr(tier_module, "_tier_fingerprint", recorded)
    model = llama_model_config(tmp_path / "model")
    pool = tmp_path / "pool.img"

    def vllm_config(format_pool: bool) -> VllmConfig:
        tier = {
            "type": "TuttiTier", "module_path": "tutti.vllm", "devices": f"emu:{pool}", "format": format_pool,
            "create_bytes": 256 << 20, "lock_dir": str(tmp_path / "locks"),
        }  # fmt: skip
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=f"tutti-test-{uuid.uuid4().hex[:8]}",
            kv_connector_extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 << 20, "secondary_tiers": [tier]},
        )
        return VllmConfig(
            model_config=model,
            kv_transfer_config=transfer,
            cache_config=CacheConfig(block_size=harness.BLOCK_TOKENS),
            parallel_config=ParallelConfig(),
            device_config=DeviceConfig(device="cpu"),
        )

    OffloadingConnector(vllm_config(True), KVConnectorRole.SCHEDULER, harness.kv_cache_config()).shutdown()
    config = vllm_config(False)
    with set_current_vllm_config(config):
        OffloadingConnector(config, KVConnectorRole.SCHEDULER, harness.kv_cache_config()).shutdown()
    assert len(keys_made) == 2 and keys_made[0] == keys_made[1], "a current config changed the tier's key"


def test_without_the_engines_config_the_default_key_is_refused(tmp_path: Path):
    """Goal: a tier built where the engine's VllmConfig cannot be found cannot name the model's
    revision, quantization or RoPE: it refuses the default key and asks for model_fingerprint
    (with one, it opens)."""
    with pytest.raises(tutti.InvalidArgument, match="model_fingerprint"):
        offloading_spec(tmp_path / "pool.img", True, engine=None).get_manager()
    offloading_spec(tmp_path / "pool.img", True, engine=None, model_fingerprint="ef" * 32).get_manager().shutdown()


def test_a_pool_without_payload_crcs_is_refused_naming_verify_retrieves(tmp_path: Path):
    """Goal: the tier checks retrieved chunks by default (verify_retrieves), which a pool
    formatted without payload CRCs (`tutti pool format` or tuttid --format without
    --payload-crc, Store.open(payload_crcs=False)) cannot do: the refusal at engine start is a
    ConfigError naming both ways out, "verify_retrieves": false or a pool formatted with
    --payload-crc; with verify_retrieves false the same pool opens."""
    from tutti._engine import ConfigError, byte_geometry

    pool = tmp_path / "pool.img"
    manager = offloading_spec(pool, True).get_manager()
    block_bytes = manager.secondary_tiers[0].block_size_bytes
    manager.shutdown()
    store = tutti.Store.open(
        f"emu:{pool}", byte_geometry(block_bytes), format=True, payload_crcs=False, lock_dir=str(tmp_path / "locks")
    )
    store.close()
    with pytest.raises(ConfigError, match="payload CRC") as refused:
        offloading_spec(pool, False).get_manager()
    assert '"verify_retrieves": false' in str(refused.value) and "--payload-crc" in str(refused.value)
    offloading_spec(pool, False, verify_retrieves=False).get_manager().shutdown()


def test_the_tier_says_its_locality(tmp_path: Path):
    """Goal: the configured locality is vLLM's Locality on the tier (as vLLM's own fs tier sets
    it), LOCAL by default; another word is refused naming the field."""
    for changes, expected in (({}, Locality.LOCAL), ({"locality": "REMOTE"}, Locality.REMOTE)):
        manager = offloading_spec(tmp_path / "pool.img", not changes, **changes).get_manager()
        try:
            assert manager.secondary_tiers[0].locality is expected
        finally:
            manager.shutdown()
    with pytest.raises(tutti.InvalidArgument, match="locality"):
        offloading_spec(tmp_path / "pool.img", False, locality="NEARBY").get_manager()


def test_a_chunk_whose_bytes_changed_in_the_pool_is_not_promoted(tmp_path: Path):
    """Goal: the tier checks every chunk it reads against the CRC recorded when it was stored
    (verify_retrieves, on by default: the chunk rows are vLLM's CPU tier, whose promoted bytes
    vLLM serves as KV): a chunk whose bytes changed on the device since is not reported loaded
    (vLLM keeps it a miss), the job's other chunks are, and the pool stays open."""
    pool = tmp_path / "pool.img"
    chunk_keys = keys(2, 21)
    manager = offloading_spec(pool, True).get_manager()
    try:
        tier = manager.secondary_tiers[0]
        view = rows(tier)
        generator = np.random.default_rng(21)
        for chunk in (0, 1):
            view[chunk] = generator.integers(0, 256, view.shape[1], dtype=np.uint8)
        stored = [view[chunk].copy() for chunk in (0, 1)]
        assert tier._store_chunks(chunk_keys, [0, 1]) == chunk_keys
    finally:
        manager.shutdown()
    image = bytearray(pool.read_bytes())
    at = image.find(stored[0][:64].tobytes())
    assert at >= 0, "the first chunk's bytes are not in the pool file"
    image[at + 7] ^= 0xFF
    pool.write_bytes(bytes(image))
    manager = offloading_spec(pool, False).get_manager()
    try:
        tier = manager.secondary_tiers[0]
        assert tier._load_chunks(chunk_keys, [2, 3]) == chunk_keys[1:]
        assert np.array_equal(rows(tier)[3], stored[1])
        assert tier._dead is None
    finally:
        manager.shutdown()


def test_every_abstract_method_of_the_base_class_is_implemented():
    """Goal: a vLLM upgrade that adds an abstract method to SecondaryTierManager fails here."""
    assert not TuttiTier.__abstractmethods__
    for name in SecondaryTierManager.__abstractmethods__:
        assert name in TuttiTier.__dict__, f"{name} is abstract in vLLM and not implemented"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"devices": None}, "missing required field 'devices'"),
        ({"devices": [1]}, "field 'devices' = \\[1\\]: must be a device string"),
        ({"devices": []}, "field 'devices' = \\[\\]: must be a device string"),
        ({"devices": ""}, "field 'devices' = '': must be a device string"),
        ({"devices": ["emu:a.img", ""]}, "field 'devices' = .*: must be a device string"),
        ({"device": "emu:x"}, "unknown field"),
        ({"format": 1}, "field 'format' must be bool"),
        ({"requests_max": 0}, "must be positive"),
        ({"queue_depth": 0}, "field 'queue_depth' = 0: must be 2..=1024"),
        ({"timeout_s": float("inf")}, r"field 'timeout_s' = inf: must be at most 1e\+09 seconds"),
    ],
)
def test_bad_tier_config_says_what_to_fix(tmp_path: Path, changes: dict, message: str):
    """Goal: a wrong secondary-tier config is an exception naming the field, raised when vLLM
    builds the tier."""
    with pytest.raises(tutti.InvalidArgument, match=message):
        offloading_spec(tmp_path / "pool.img", True, **changes).get_manager()


def test_chunks_that_fail_to_issue_are_finished_not_leaked(tmp_path: Path):
    """Goal: a chunk whose prepared request fails to issue its layer (store or load) is reported
    failed and its request finished: after more such failures than requests_max, chunks are
    still stored and loaded (no request place or pin is held by the failed ones)."""
    manager = offloading_spec(tmp_path / "pool.img", True, requests_max=4).get_manager()
    try:
        tier = manager.secondary_tiers[0]
        wrapped = harness.StoreWithFailingIssues(tier._store)
        tier._store = wrapped
        wrapped.failing = False
        stored = keys(2, 3)
        assert tier._store_chunks(stored, [0, 1]) == stored
        wrapped.failing = True
        for _ in range(3):
            assert tier._load_chunks(stored, [2, 3]) == []
            assert tier._store_chunks(keys(2, 4), [4, 5]) == []
        wrapped.failing = False
        assert tier._store_chunks(keys(2, 5), [6, 7]) == keys(2, 5)
        assert tier._load_chunks(stored, [2, 3]) == stored
    finally:
        manager.shutdown()


class StoreWithStalledLoads:
    """The tier's tutti.Store whose loads stall; records the tier's results when the tier closes
    it, and can pretend its close kept the memory registered (queue pairs not deleted)."""

    def __init__(self, tier, close_keeps_memory: bool = False, raising_in: Optional[str] = None) -> None:
        self._tier = tier
        self._store = tier._store
        self.close_keeps_memory = close_keeps_memory
        # "close" or "leaked_registrations": that call raises Panic (a failure inside the close).
        self.raising_in = raising_in
        self.closed_by_tier = False
        self.reported_at_close = None

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    stall_stores = False

    def prepare_retrieve(self, tokens, block_ids):
        return StalledLayer(self._store.prepare_retrieve(tokens, block_ids))

    def prepare_store(self, tokens, block_ids):
        request = self._store.prepare_store(tokens, block_ids)
        return StalledLayer(request) if self.stall_stores else request

    def close(self, timeout_s=None):
        with self._tier._results_lock:
            self.reported_at_close = [result.job_id for result in self._tier._results]
        self.closed_by_tier = True
        if self.raising_in == "close":
            raise Panic("injected: a panic in the store's close")
        self._store.close(timeout_s=timeout_s)

    def leaked_registrations(self) -> int:
        if self.raising_in == "leaked_registrations":
            raise Panic("injected: a poisoned lock in leaked_registrations")
        return 1 if self.close_keeps_memory else self._store.leaked_registrations()


def submit_stalled_load(tmp_path: Path, close_keeps_memory: bool, raising_in: Optional[str] = None):
    """A tier with two chunks stored, then a promotion of both whose layers never complete."""
    manager = offloading_spec(tmp_path / "pool.img", True, timeout_s=0.2).get_manager()
    tier = manager.secondary_tiers[0]
    stored = keys(2, 6)
    assert tier._store_chunks(stored, [0, 1]) == stored
    wrapped = StoreWithStalledLoads(tier, close_keeps_memory, raising_in)
    tier._store = wrapped
    job = TransferJob(job_id=7, keys=stored, chunk_ids=np.array([2, 3]), is_promotion=True, req_context=ReqContext(req_id="r"))
    tier.submit_load(job)
    return manager, tier, wrapped


def test_a_load_whose_layer_never_completes_keeps_its_rows_until_the_pool_is_closed(tmp_path: Path):
    """Goal: a promotion whose layer does not complete is not reported while a controller may
    still write its chunk rows (vLLM frees a failed promotion's rows for reuse): the tier closes
    its pool (queue pairs deleted) first, then reports the job failed, and moves nothing more."""
    manager, tier, wrapped = submit_stalled_load(tmp_path, close_keeps_memory=False)
    try:
        results = []
        deadline = time.monotonic() + DEADLINE_S
        while not results:
            assert time.monotonic() < deadline, "the stalled job was never reported"
            results = list(tier.get_finished_jobs())
            time.sleep(0.01)
        assert wrapped.closed_by_tier, "the job was reported with the pool open: its rows may still be written"
        assert wrapped.reported_at_close == [], "the job was reported before the pool was closed"
        assert [(result.job_id, result.success, list(result.successful_keys or ())) for result in results] == [(7, False, [])]
        assert tier._store.closed
        context = ReqContext(req_id="later")
        assert tier.lookup(keys(2, 6)[0], context) is LookupResult.MISS
        tier.submit_load(TransferJob(job_id=8, keys=keys(1, 6), chunk_ids=np.array([4]), is_promotion=True, req_context=context))
        tier.drain_jobs()
        assert [(result.job_id, result.success) for result in tier.get_finished_jobs()] == [(8, False)]
    finally:
        manager.shutdown()


def test_a_load_failing_with_an_unexpected_exception_keeps_its_rows_until_the_pool_is_closed(tmp_path: Path, monkeypatch):
    """Goal: an Exception that is not a tutti.Error in the middle of a promotion's wave (here the
    chunk key's conversion fails on its second chunk; a MemoryError, an argument's TypeError)
    leaves the first chunk's layer issued and never settled: the job is not reported while a
    controller may still write that chunk's row (vLLM frees a failed promotion's rows for reuse);
    the tier closes its pool first, then reports the job failed."""
    import tutti.vllm.tier as tier_module

    manager = offloading_spec(tmp_path / "pool.img", True, timeout_s=0.2).get_manager()
    try:
        tier = manager.secondary_tiers[0]
        stored = keys(2, 9)
        assert tier._store_chunks(stored, [0, 1]) == stored
        wrapped = StoreWithStalledLoads(tier)
        tier._store = wrapped
        real_hash_tokens = tier_module.hash_tokens
        calls = []

        def failing_on_the_second_key(key, tokens):
            calls.append(key)
            if len(calls) == 2:
                raise RuntimeError("injected: the second chunk's key cannot be converted")
            return real_hash_tokens(key, tokens)

        monkeypatch.setattr(tier_module, "hash_tokens", failing_on_the_second_key)
        job = TransferJob(job_id=9, keys=stored, chunk_ids=np.array([2, 3]), is_promotion=True, req_context=ReqContext(req_id="r"))
        tier.submit_load(job)
        drain_within(tier, 20.0)
        results = list(tier.get_finished_jobs())
        assert [(result.job_id, result.success) for result in results] == [(9, False)]
        assert len(calls) == 2
        assert wrapped.closed_by_tier, "the job was reported with the pool open: its first row may still be written"
        assert wrapped.reported_at_close == [], "the job was reported before the pool was closed"
        assert tier._dead is not None
    finally:
        manager.shutdown()


def test_a_load_whose_rows_cannot_be_confirmed_safe_is_never_reported(tmp_path: Path):
    """Goal: when closing the pool does not confirm that its queue pairs were deleted, the
    stalled promotion is never reported (vLLM keeps its rows) and the tier's next call from vLLM
    raises KvMemoryUnsafe (a submit too), as a worker does, rather than let vLLM reuse the rows."""
    manager, tier, wrapped = submit_stalled_load(tmp_path, close_keeps_memory=True)
    try:
        deadline = time.monotonic() + DEADLINE_S
        with pytest.raises(KvMemoryUnsafe, match="chunk rows may still be written"):
            while True:
                assert not list(tier.get_finished_jobs()), "a job whose rows may still be written was reported"
                assert time.monotonic() < deadline, "the tier never gave up on the stalled job"
                time.sleep(0.01)
        assert wrapped.closed_by_tier and tier.has_pending_work()
        with pytest.raises(KvMemoryUnsafe):
            tier.get_finished_jobs()
        with pytest.raises(KvMemoryUnsafe):
            tier.drain_jobs()
        for submit in (tier.submit_load, tier.submit_store):
            job = TransferJob(job_id=8, keys=[], chunk_ids=np.array([], dtype=np.int64), is_promotion=False, req_context=ReqContext(req_id="s"))
            with pytest.raises(KvMemoryUnsafe):
                submit(job)
    finally:
        manager.shutdown()


@pytest.mark.parametrize("raising_in", ["close", "leaked_registrations"])
def test_a_load_whose_pool_close_fails_is_never_reported(tmp_path: Path, raising_in: str):
    """Goal: when closing the pool after a stalled promotion fails inside the close (pyo3's
    PanicException out of close, a poisoned lock in leaked_registrations), the close confirmed
    nothing: the promotion is never reported (vLLM keeps its rows, which a controller may still
    write) and the tier's next call from vLLM raises KvMemoryUnsafe. The pool was already marked
    closed when the close failed, which must not count as closed."""
    manager, tier, wrapped = submit_stalled_load(tmp_path, close_keeps_memory=False, raising_in=raising_in)
    try:
        deadline = time.monotonic() + DEADLINE_S
        with pytest.raises(KvMemoryUnsafe, match="chunk rows may still be written"):
            while True:
                reported = [(result.job_id, result.success) for result in tier.get_finished_jobs()]
                assert not reported, f"a job whose rows may still be written was reported: {reported}"
                assert time.monotonic() < deadline, "the tier never gave up on the stalled job"
                time.sleep(0.01)
        assert wrapped.closed_by_tier and tier.has_pending_work()
        with pytest.raises(KvMemoryUnsafe):
            tier.get_finished_jobs()
    finally:
        wrapped.raising_in = None
        manager.shutdown()


def test_a_store_whose_layer_never_completes_closes_the_pool_instead_of_holding_its_request(tmp_path: Path):
    """Goal: a demotion whose layer does not complete is reported failed (a store only reads its
    row, so vLLM may reuse it) and closes the pool, rather than keep its request place and pins
    for good (enough of those would make every later job fail to prepare); later jobs fail at
    once."""
    manager = offloading_spec(tmp_path / "pool.img", True, timeout_s=0.2).get_manager()
    tier = manager.secondary_tiers[0]
    try:
        wrapped = StoreWithStalledLoads(tier)
        wrapped.stall_stores = True
        tier._store = wrapped
        context = ReqContext(req_id="r")
        tier.submit_store(TransferJob(job_id=9, keys=keys(2, 8), chunk_ids=np.array([0, 1]), is_promotion=False, req_context=context))
        tier.drain_jobs()
        assert [(result.job_id, result.success) for result in tier.get_finished_jobs()] == [(9, False)]
        assert wrapped.closed_by_tier, "a store whose layer never completed left the pool open, its request held"
        tier.submit_store(TransferJob(job_id=10, keys=keys(1, 9), chunk_ids=np.array([2]), is_promotion=False, req_context=context))
        tier.drain_jobs()
        assert [(result.job_id, result.success) for result in tier.get_finished_jobs()] == [(10, False)]
    finally:
        manager.shutdown()


class FinishRefusedLoad:
    """A tutti.Request whose wait fails and whose layer the binding no longer lists, while the
    store still counts it in flight: finish is refused as out of order (InvalidState)."""

    def __init__(self, request) -> None:
        self._request = request

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    @property
    def layer_in_flight(self):
        return None

    @property
    def layers_in_flight(self):
        return []

    def wait(self, timeout_s=None):
        raise tutti.DeviceError("injected: the layer failed")

    def finish(self):
        raise tutti.InvalidState("injected: a layer is still in flight")


def test_a_load_whose_finish_is_refused_keeps_its_rows_until_the_pool_is_closed(tmp_path: Path):
    """Goal: a failed chunk load whose finish is refused because the store still counts a layer in
    flight is treated as a layer that does not complete: the pool is closed (queue pairs deleted)
    before the job is reported, since vLLM reuses a failed promotion's rows at once."""
    manager = offloading_spec(tmp_path / "pool.img", True, timeout_s=0.2).get_manager()
    tier = manager.secondary_tiers[0]
    try:
        stored = keys(2, 11)
        assert tier._store_chunks(stored, [0, 1]) == stored
        wrapped = StoreWithStalledLoads(tier)
        wrapped.prepare_retrieve = lambda tokens, block_ids: FinishRefusedLoad(wrapped._store.prepare_retrieve(tokens, block_ids))
        tier._store = wrapped
        job = TransferJob(job_id=12, keys=stored, chunk_ids=np.array([2, 3]), is_promotion=True, req_context=ReqContext(req_id="r"))
        tier.submit_load(job)
        results = []
        deadline = time.monotonic() + DEADLINE_S
        while not results:
            assert time.monotonic() < deadline, "the job was never reported"
            results = list(tier.get_finished_jobs())
            time.sleep(0.01)
        assert wrapped.closed_by_tier, "the job was reported with the pool open: its rows may still be written"
        assert wrapped.reported_at_close == [], "the job was reported before the pool was closed"
        assert [(result.job_id, result.success) for result in results] == [(12, False)]
    finally:
        manager.shutdown()


def test_the_tier_opens_its_pool_with_its_queue_depth(tmp_path: Path, store_options: list):
    """Goal: the tier's pool is opened with the configured queue_depth (1024 by default)."""
    for changes, depth in (({}, 1024), ({"queue_depth": 16}, 16)):
        manager = offloading_spec(tmp_path / f"pool{depth}.img", True, **changes).get_manager()
        manager.shutdown()
        name, options = store_options[-1]
        assert (name, options["queue_depth"]) == ("open", depth)


class Panic(BaseException):
    """Stands for pyo3's PanicException (a panic in the binding): a BaseException."""


class StoreWithCommitsRaising:
    """The tier's tutti.Store whose store requests raise `error` at commit."""

    def __init__(self, store, error: BaseException) -> None:
        self._store = store
        self._error = error

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def prepare_store(self, tokens, block_ids):
        request = self._store.prepare_store(tokens, block_ids)
        error = self._error

        class Raising:
            def __getattr__(self, name: str):
                return getattr(request, name)

            def commit(self):
                raise error

        return Raising()


def drain_within(tier, seconds: float) -> None:
    """tier.drain_jobs(), failing the test (not hanging it) if it does not return in time."""
    outcome: list = []

    def drain() -> None:
        try:
            tier.drain_jobs()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001
            outcome.append(error)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"drain_jobs did not return within {seconds} s"
    if outcome[0] is not None:
        raise outcome[0]


@pytest.mark.parametrize("error", [Panic("injected: a panic in the binding"), SystemExit(3)], ids=["panic", "system-exit"])
def test_a_job_failing_with_a_base_exception_is_reported_and_nothing_hangs(tmp_path: Path, error):
    """Goal: a BaseException out of the binding in the tier's thread (pyo3's PanicException; an
    interrupt) does not end the thread silently, leaving its job never reported and drain_jobs
    spinning for ever: the job is reported failed, the pool closed (the job's requests are in an
    unknown state), later jobs fail at once, and drain_jobs returns."""
    manager = offloading_spec(tmp_path / "pool.img", True, timeout_s=0.2).get_manager()
    tier = manager.secondary_tiers[0]
    try:
        tier._store = StoreWithCommitsRaising(tier._store, error)
        context = ReqContext(req_id="r")
        tier.submit_store(TransferJob(job_id=20, keys=keys(2, 20), chunk_ids=np.array([0, 1]), is_promotion=False, req_context=context))
        drain_within(tier, 20.0)
        assert [(result.job_id, result.success) for result in tier.get_finished_jobs()] == [(20, False)]
        assert tier._dead is not None
        tier.submit_store(TransferJob(job_id=21, keys=keys(1, 21), chunk_ids=np.array([2]), is_promotion=False, req_context=context))
        drain_within(tier, 20.0)
        assert [(result.job_id, result.success) for result in tier.get_finished_jobs()] == [(21, False)]
        assert not tier.has_pending_work()
    finally:
        manager.shutdown()


def test_drain_jobs_raises_when_no_job_finishes_in_time(tmp_path: Path):
    """Goal: a job that makes no progress (every wait of its I/O is bounded, so it is stuck) does
    not make drain_jobs wait for ever: it raises a tutti timeout (it must not return while a job
    may still touch rows vLLM would free)."""
    manager = offloading_spec(tmp_path / "pool.img", True, timeout_s=0.1, requests_max=1).get_manager()
    tier = manager.secondary_tiers[0]
    release = threading.Event()
    try:
        tier._store_chunks = lambda keys_, chunks: (release.wait(30.0), [])[1]
        tier.submit_store(TransferJob(job_id=22, keys=keys(1, 22), chunk_ids=np.array([0]), is_promotion=False, req_context=ReqContext(req_id="r")))
        with pytest.raises(tutti.TimeoutError, match="none finished"):
            drain_within(tier, 20.0)
        release.set()
        drain_within(tier, 20.0)
        assert [(result.job_id, result.success) for result in tier.get_finished_jobs()] == [(22, False)]
    finally:
        release.set()
        manager.shutdown()


def test_a_stalled_wave_ends_within_drain_jobs_bound(tmp_path: Path):
    """Goal: a promotion whose every chunk stalls holds the tier's thread for one deadline of its
    wave, not timeout_s twice per chunk (a wait, then the abandon's wait): drain_jobs returns
    within its bound ((requests_max + 4) x timeout_s without a job finishing) instead of raising,
    and the job is reported failed after the pool was closed."""
    manager = offloading_spec(tmp_path / "pool.img", True, timeout_s=0.2, requests_max=4).get_manager()
    tier = manager.secondary_tiers[0]
    try:
        stored = keys(4, 30)
        assert tier._store_chunks(stored, [0, 1, 2, 3]) == stored
        wrapped = StoreWithStalledLoads(tier)
        wrapped.prepare_retrieve = lambda tokens, block_ids: SleepingStall(wrapped._store.prepare_retrieve(tokens, block_ids))
        tier._store = wrapped
        job = TransferJob(job_id=30, keys=stored, chunk_ids=np.array([4, 5, 6, 7]), is_promotion=True, req_context=ReqContext(req_id="r"))
        tier.submit_load(job)
        drain_within(tier, 20.0)  # raises tutti.TimeoutError past its bound
        assert [(result.job_id, result.success) for result in tier.get_finished_jobs()] == [(30, False)]
        assert wrapped.closed_by_tier, "the job was reported with the pool open: its rows may still be written"
        assert wrapped.reported_at_close == [], "the job was reported before the pool was closed"
    finally:
        manager.shutdown()


class LateLayer:
    """A tutti.Request whose layer, once issued, is reported in flight until `late_s` after the
    issue (a slow device, not a stuck one): a wait before then takes the time it is given (at
    most until then) and times out; after, the request behaves as the real one."""

    def __init__(self, request, late_s: float) -> None:
        self._request = request
        self._late_s = late_s
        self._ready_at: Optional[float] = None

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def _late(self) -> bool:
        return self._ready_at is not None and time.monotonic() < self._ready_at

    def retrieve_layer(self, layer: int):
        result = self._request.retrieve_layer(layer)
        self._ready_at = time.monotonic() + self._late_s
        return result

    def wait(self, timeout_s=None):
        if self._late():
            remaining = self._ready_at - time.monotonic()
            time.sleep(max(0.0, remaining if timeout_s is None else min(timeout_s, remaining)))
            if self._late():
                raise tutti.TimeoutError("injected: the layer did not complete yet")
        return self._request.wait(timeout_s)

    def poll(self):
        return None if self._late() else self._request.poll()

    @property
    def layer_in_flight(self):
        return 0 if self._late() else self._request.layer_in_flight

    @property
    def layers_in_flight(self):
        return [0] if self._late() else self._request.layers_in_flight


def test_a_chunk_late_by_less_than_a_timeout_past_its_wait_does_not_close_the_pool(tmp_path: Path):
    """Goal: a one-chunk promotion whose layer completes half a timeout_s after its wait timed out
    is given up (finished, the job reported) and the pool stays open: its wave has one timeout_s
    beyond its chunks' waits for that follow-up, counted from the end of its issues. Before, the
    wave's deadline (timeout_s a chunk, counted before the chunks were prepared) was all spent by
    the chunk's wait, the follow-up only polled once, and the pool was closed for good."""
    # timeout_s 0.5, the layer late by 1.5 of it: a quarter of a second either side of the
    # follow-up's end, for a loaded machine.
    manager = offloading_spec(tmp_path / "pool.img", True, timeout_s=0.5).get_manager()
    tier = manager.secondary_tiers[0]
    try:
        stored = keys(1, 40)
        assert tier._store_chunks(stored, [0]) == stored
        wrapped = StoreWithStalledLoads(tier)
        wrapped.prepare_retrieve = lambda tokens, block_ids: LateLayer(wrapped._store.prepare_retrieve(tokens, block_ids), 0.75)
        tier._store = wrapped
        job = TransferJob(job_id=40, keys=stored, chunk_ids=np.array([1]), is_promotion=True, req_context=ReqContext(req_id="r"))
        tier.submit_load(job)
        drain_within(tier, 20.0)
        assert [result.job_id for result in tier.get_finished_jobs()] == [40]
        assert tier._dead is None, f"the pool was closed for a chunk late by half a timeout: {tier._dead}"
        assert not wrapped.closed_by_tier
        tier._store = wrapped._store
        later = keys(2, 41)
        assert tier._store_chunks(later, [2, 3]) == later
        assert tier._load_chunks(later, [4, 5]) == later
        assert np.array_equal(rows(tier)[4:6], rows(tier)[2:4])
    finally:
        manager.shutdown()


class StoreWithSlowFailingCommits:
    """The tier's tutti.Store whose commits take `slow_s` and then fail with a timeout (the pool's
    flush or header writes not answering), counted in `commits`."""

    def __init__(self, store, slow_s: float) -> None:
        self._store = store
        self._slow_s = slow_s
        self.commits = 0

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def prepare_store(self, tokens, block_ids):
        request = self._store.prepare_store(tokens, block_ids)
        owner = self

        class SlowCommit:
            def __getattr__(self, name: str):
                return getattr(request, name)

            def commit(self):
                owner.commits += 1
                time.sleep(owner._slow_s)
                raise tutti.TimeoutError("injected: the pool's header write did not complete")

        return SlowCommit()


def test_a_commit_failing_past_its_waves_deadline_stops_the_wave_and_closes_the_pool(tmp_path: Path):
    """Goal: a chunk's commit that fails with a timeout past its wave's deadline (the pool's
    flush and header writes run under the pool's own 10 s metadata timeout, not the wave's)
    stops the wave and closes the pool, as a stuck layer does, rather than have every chunk of
    the wave pay it (and drain_jobs raise while the job still runs): the job is reported
    failed, the wave's other chunks are not committed."""
    manager = offloading_spec(tmp_path / "pool.img", True, timeout_s=0.2, requests_max=4).get_manager()
    tier = manager.secondary_tiers[0]
    try:
        wrapped = StoreWithSlowFailingCommits(tier._store, 1.2)
        tier._store = wrapped
        job = TransferJob(job_id=42, keys=keys(4, 42), chunk_ids=np.array([0, 1, 2, 3]), is_promotion=False, req_context=ReqContext(req_id="r"))
        tier.submit_store(job)
        # Not drain_jobs: its bound does not cover the pool's metadata I/O (here 1.2 s a commit,
        # more than the test's timeout_s x (requests_max + 3)).
        results = []
        deadline = time.monotonic() + DEADLINE_S
        while not results:
            assert time.monotonic() < deadline, "the job was never reported"
            results = list(tier.get_finished_jobs())
            time.sleep(0.01)
        assert [(result.job_id, result.success) for result in results] == [(42, False)]
        assert wrapped.commits == 1, f"{wrapped.commits} commits were tried past the wave's deadline"
        assert tier._dead is not None and "commit" in tier._dead
    finally:
        manager.shutdown()


def test_a_wave_of_more_than_64_chunks_is_not_refused_for_want_of_iocbs(tmp_path: Path):
    """Goal: the tier's pool is opened with the IOCBs its requests_max requests need (the store's
    default, 64, would refuse every chunk of a wave past the 64th with LimitReached); a
    requests_max whose IOCBs cannot be given is refused with a ConfigError naming it."""
    manager = offloading_spec(tmp_path / "pool.img", True, requests_max=128).get_manager()
    try:
        tier = manager.secondary_tiers[0]
        stored = keys(128, 31)
        # The primary tier has CHUNKS rows: several chunks are stored from one row (a store only reads it).
        assert tier._store_chunks(stored, [index % CHUNKS for index in range(128)]) == stored
    finally:
        manager.shutdown()
    from tutti._engine import ConfigError

    with pytest.raises(ConfigError, match="requests_max = 2048") as refused:
        offloading_spec(tmp_path / "pool2.img", True, requests_max=2048).get_manager()
    # The tier has no layers_in_flight: its refusal names only what it has.
    assert "layers_in_flight" not in str(refused.value)
