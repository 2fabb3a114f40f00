"""tutti.vllm.TuttiConnector against vLLM 0.32's real classes: built by vLLM's connector factory
from vLLM's config objects, the scheduler side in this process and one worker process per
tensor-parallel rank, driven through a request's life the way vLLM's scheduler and model runner
call it, with KV caches in vLLM's own per-layer view; bytes checked per rank, layer and block."""

from __future__ import annotations

import time

import subprocess
import sys
import warnings

import pytest
import torch

import tutti
import vllm_harness as harness
from tutti.vllm import TuttiConnector, TuttiConnectorMetadata
from tutti.vllm.connector import LoadSpec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

TP_WORLD = 2
FINISH_TIMEOUT_S = 30.0


def prompt(seed: int, blocks: int, tail: int) -> list[int]:
    return [(seed * 7919 + index * 31) % 50_000 + 1 for index in range(blocks * harness.BLOCK_TOKENS + tail)]


@pytest.fixture
def cluster(tuttid):
    """tuttid, the scheduler-side connector (this process) and TP_WORLD worker processes."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    scheduler = harness.make_connector(harness.vllm_config(daemon.socket, TP_WORLD), KVConnectorRole.SCHEDULER)
    workers = [harness.Worker(daemon.socket, TP_WORLD, rank) for rank in range(TP_WORLD)]
    yield daemon, scheduler, workers
    for worker in workers:
        worker.stop()
    scheduler.shutdown()


def step(workers, metadata, finished=frozenset(), layerwise=True):
    return [worker.call("step", metadata, set(finished), layerwise) for worker in workers]


def wait_finished(workers, req_id: str) -> None:
    """vLLM calls get_finished every step until every worker named the request."""
    pending = set(range(len(workers)))
    deadline = time.monotonic() + FINISH_TIMEOUT_S
    while pending:
        for rank in sorted(pending):
            if req_id in workers[rank].call("finished", {req_id}):
                pending.discard(rank)
        assert time.monotonic() < deadline, f"workers {sorted(pending)} never reported {req_id} finished"
        time.sleep(0.01)


def test_request_life_save_then_load_on_two_ranks(cluster):
    """Goal: a prompt saved by request A (per-layer save during its prefill, committed in the
    background, reported through get_finished) is found by request B's lookup on every rank and
    loaded layer by layer into other blocks, byte-exact on each rank."""
    _, scheduler, workers = cluster
    prompt_a = prompt(1, blocks=3, tail=5)
    blocks_a = [3, 9, 4, 20]

    # Request A: nothing cached yet.
    request_a = harness.request("A", prompt_a)
    assert scheduler.get_num_new_matched_tokens(request_a, 0) == (0, False)
    scheduler.update_state_after_alloc(request_a, harness.blocks(blocks_a), 0)
    meta = scheduler.build_connector_meta(harness.scheduler_output(new=[("A", prompt_a, blocks_a, 0, len(prompt_a))]))
    assert isinstance(meta, TuttiConnectorMetadata)
    assert [save.req_id for save in meta.saves] == ["A"] and meta.loads == []
    assert meta.saves[0].block_ids == blocks_a[:3]
    for worker in workers:
        worker.call("fill", blocks_a, 1)
    results = step(workers, meta)
    assert all(result["load_errors"] == set() for result in results)
    assert results[0]["calls"] == [
        f"{call}:{name}" for name in harness.layer_names() for call in ("wait_for_layer_load", "save_kv_layer")
    ]
    expected = [worker.call("digest", blocks_a[:3]) for worker in workers]
    assert expected[0] != expected[1], "ranks must hold different bytes for the check to mean anything"

    # A finishes: the connector keeps its blocks until every worker reported the save done.
    assert scheduler.request_finished(request_a, blocks_a) == (True, None)
    wait_finished(workers, "A")

    # Request B shares A's first three blocks: found on both ranks, loaded into other blocks.
    prompt_b = prompt_a[: 3 * harness.BLOCK_TOKENS] + [7, 7, 7]
    blocks_b = [30, 31, 32, 33]
    request_b = harness.request("B", prompt_b)
    assert scheduler.get_num_new_matched_tokens(request_b, 0) == (3 * harness.BLOCK_TOKENS, False)
    scheduler.update_state_after_alloc(request_b, harness.blocks(blocks_b), 3 * harness.BLOCK_TOKENS)
    for worker in workers:
        worker.call("zero", blocks_b)
    meta = scheduler.build_connector_meta(
        harness.scheduler_output(new=[("B", prompt_b, blocks_b, 3 * harness.BLOCK_TOKENS, 3)], finished={"A"})
    )
    assert [load.req_id for load in meta.loads] == ["B"] and meta.loads[0].block_ids == blocks_b[:3]
    results = step(workers, meta, finished={"A"})
    assert all(result["load_errors"] == set() for result in results)
    for worker, digests in zip(workers, expected):
        assert worker.call("digest", blocks_b[:3]) == digests, f"rank {worker.rank} loaded other bytes"
    # B's save shares A's blocks: nothing new is written, and it is reported done all the same.
    assert [save.req_id for save in meta.saves] == ["B"]
    assert scheduler.request_finished(request_b, blocks_b) == (True, None)
    wait_finished(workers, "B")


def test_local_prefix_counts_and_last_token_is_never_loaded(cluster):
    """Goal: the matched tokens exclude what vLLM already computed locally, and a prompt that is
    exactly whole blocks keeps its last block for vLLM to compute (it needs one token's logits)."""
    _, scheduler, workers = cluster
    whole = prompt(2, blocks=2, tail=0)
    request = harness.request("W", whole)
    scheduler.update_state_after_alloc(request, harness.blocks([1, 2]), 0)
    meta = scheduler.build_connector_meta(harness.scheduler_output(new=[("W", whole, [1, 2], 0, len(whole))]))
    for worker in workers:
        worker.call("fill", [1, 2], 2)
    step(workers, meta)
    scheduler.request_finished(request, [1, 2])
    wait_finished(workers, "W")

    again = harness.request("W2", whole)
    # Two blocks cached, but only the first may be loaded: the second holds the last token.
    assert scheduler.get_num_new_matched_tokens(again, 0) == (harness.BLOCK_TOKENS, False)
    # vLLM already has that block locally: nothing new to load.
    assert scheduler.get_num_new_matched_tokens(again, harness.BLOCK_TOKENS) == (0, False)


def test_load_errors_are_reported_per_block(cluster):
    """Goal: a load whose blocks are not in the pool (evicted after the lookup) is reported
    through get_block_ids_with_load_errors with exactly its blocks, so vLLM recomputes them, and
    the step goes on."""
    _, _, workers = cluster
    missing = prompt(3, blocks=2, tail=1)
    meta = TuttiConnectorMetadata(loads=[LoadSpec("X", missing[: 2 * harness.BLOCK_TOKENS], [40, 41])])
    results = step(workers, meta)
    assert all(result["load_errors"] == {40, 41} for result in results)
    # The scheduler side receives them in the step's KVConnectorOutput (vLLM then recomputes).
    from vllm.v1.outputs import KVConnectorOutput

    _, scheduler, _ = cluster
    scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids={40, 41}))
    # Reported once.
    assert all(result["load_errors"] == set() for result in step(workers, TuttiConnectorMetadata()))


def test_preemption_resets_and_saves_again_after_resume(cluster):
    """Goal: a request preempted after its save was handed over is settled by handle_preemptions
    (its save's I/O over before the blocks are reused, then forgotten), and after it resumes on
    new blocks it is saved again and reported finished once."""
    _, scheduler, workers = cluster
    prompt_p = prompt(4, blocks=2, tail=3)
    request = harness.request("P", prompt_p)
    scheduler.update_state_after_alloc(request, harness.blocks([5, 6, 7]), 0)
    meta = scheduler.build_connector_meta(harness.scheduler_output(new=[("P", prompt_p, [5, 6, 7], 0, len(prompt_p))]))
    for worker in workers:
        worker.call("fill", [5, 6, 7], 4)
    step(workers, meta)

    # Next step: P is preempted (its blocks go back to vLLM's pool).
    meta = scheduler.build_connector_meta(harness.scheduler_output(preempted={"P"}))
    assert meta.preempted_req_ids == {"P"} and meta.saves == []
    step(workers, meta)
    # Resumed on new blocks, recomputed: saved again (the pool shares what is already there).
    meta = scheduler.build_connector_meta(
        harness.scheduler_output(cached=[("P", [10, 11, 12], 0, len(prompt_p), True)])
    )
    assert [save.block_ids for save in meta.saves] == [[10, 11]]
    for worker in workers:
        worker.call("fill", [10, 11, 12], 4)
    step(workers, meta)
    assert scheduler.request_finished(request, [10, 11, 12]) == (True, None)
    wait_finished(workers, "P")


def test_every_abstract_method_of_the_base_class_is_implemented():
    """Goal: a vLLM upgrade that adds an abstract method to KVConnectorBase_V1 fails here, not in
    a user's server."""
    assert not TuttiConnector.__abstractmethods__
    for name in KVConnectorBase_V1.__abstractmethods__:
        assert name in TuttiConnector.__dict__, f"{name} is abstract in vLLM and not implemented"


def test_requires_piecewise_cudagraph():
    """Goal: the answer is True: the connector's per-layer calls run between layers, which a full
    CUDA graph would skip."""
    assert TuttiConnector.requires_piecewise_for_cudagraph({"socket": "/x"}) is True


def test_bad_connector_config_says_what_to_fix(cluster):
    """Goal: a missing, unknown or mistyped field of kv_connector_extra_config is an exception
    naming the field and the fix, raised when vLLM builds the connector."""
    daemon, _, _ = cluster
    cases = [
        ({}, "missing required field 'socket'"),
        ({"socket": daemon.socket, "timeout": 3}, "unknown field(s) 'timeout'"),
        ({"socket": daemon.socket, "timeout_s": "3"}, "field 'timeout_s' must be float"),
        ({"socket": daemon.socket, "requests_max": 0}, "must be positive"),
        ({"socket": daemon.socket, "model_fingerprint": "abc"}, "64 hexadecimal digits"),
    ]
    for extra, message in cases:
        with pytest.raises(tutti.InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
            harness.make_connector(harness.vllm_config(daemon.socket, 1, extra=extra), KVConnectorRole.SCHEDULER)


def test_wrong_block_size_says_what_to_fix(cluster):
    """Goal: a vLLM block size other than the pool's is refused with the --block-size to use."""
    from vllm.config import CacheConfig

    daemon, _, _ = cluster
    config = harness.vllm_config(daemon.socket, 1)
    config.cache_config = CacheConfig(block_size=32)
    with pytest.raises(tutti.InvalidArgument, match="--block-size 16"):
        harness.make_connector(config, KVConnectorRole.SCHEDULER)


def test_vllm_own_memory_is_refused_with_the_fix(cluster):
    """Goal: KV caches tuttid cannot map (vLLM's own allocation) are an UnsupportedMemory that
    names the way out, not a crash."""
    daemon, _, _ = cluster
    worker = harness.make_connector(harness.vllm_config(daemon.socket, 1), KVConnectorRole.WORKER)
    try:
        spec = harness.kv_cache_config().kv_cache_groups[0].kv_cache_spec
        own = {
            name: torch.zeros(harness.NUM_BLOCKS, harness.KV_HEADS, harness.BLOCK_TOKENS, 2 * harness.HEAD_DIM, dtype=spec.dtype)
            for name in harness.layer_names()
        }
        with pytest.raises(tutti.UnsupportedMemory, match="allocate_kv_caches"):
            worker.register_kv_caches(own)
    finally:
        worker.shutdown()


def test_version_check_names_the_tested_version(monkeypatch):
    """Goal: another vLLM release gives a warning naming the tested one."""
    import vllm

    from tutti.vllm import TESTED_VLLM_VERSION, check_vllm_version

    assert check_vllm_version() is True
    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_vllm_version() is False
    assert any(TESTED_VLLM_VERSION in str(warning.message) and "0.31.9" in str(warning.message) for warning in caught)


def test_import_tutti_imports_no_engine():
    """Goal: `import tutti` stays light: neither torch nor an engine is imported with it."""
    code = "import sys, tutti; print(sorted(m for m in ('torch', 'vllm', 'sglang') if m in sys.modules))"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert output.stdout.strip() == "[]"


def test_scheduler_idle_past_the_lease_still_looks_up(tuttid):
    """Goal: a scheduler idle longer than tuttid's lease (its session ended by the daemon) connects
    again on its next lookup instead of answering "miss" for good."""
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--lease", "1s"])
    scheduler = harness.make_connector(harness.vllm_config(daemon.socket, 1), KVConnectorRole.SCHEDULER)
    try:
        request = harness.request("I", prompt(5, blocks=2, tail=1))
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        time.sleep(2.5)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        assert scheduler.lookup_failures == 0
        assert scheduler.lookup_reconnects == 1
    finally:
        scheduler.shutdown()
