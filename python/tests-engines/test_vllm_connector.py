"""tutti.vllm.TuttiConnector against vLLM 0.32's real classes: built by vLLM's connector factory
from vLLM's config objects, the scheduler side in this process and one worker process per
tensor-parallel rank, driven through a request's life the way vLLM's scheduler and model runner
call it, with KV caches in vLLM's own per-layer view; bytes checked per rank, layer and block."""

from __future__ import annotations

import contextlib
import logging
import re
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import tutti
import vllm_harness as harness
from stalled import SleepingStall
from tutti.vllm import TuttiConnector, TuttiConnectorMetadata
from tutti._engine import ConfigError
from tutti.vllm.connector import KvMemoryUnsafe, LoadSpec, SaveSpec
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
    workers = harness.start_workers(daemon.socket, TP_WORLD)
    yield daemon, scheduler, workers
    for worker in workers:
        worker.stop()
    scheduler.shutdown()


def step(workers, metadata, finished=frozenset(), layerwise=True):
    return harness.call_all(workers, "step", metadata, set(finished), layerwise)


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
    # No synchronous load in this step: vLLM calls start_load_kv after the forward.
    assert results[0]["calls"] == [
        f"{call}:{name}" for name in harness.layer_names() for call in ("wait_for_layer_load", "save_kv_layer")
    ] + ["start_load_kv", "wait_for_save"]
    # The save ran during the forward: every layer issued, layers 0..L-3 completed (two layers in
    # flight by default), before wait_for_save (which then hands the last two to the committer).
    for result in results:
        issued, completed = result["saves_before_wait"]["A"]
        assert issued == harness.LAYERS, result["saves_before_wait"]
        assert set(range(harness.LAYERS - 2)) <= set(completed), result["saves_before_wait"]
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
    # A synchronous load: start_load_kv before the forward.
    assert results[0]["calls"][0] == "start_load_kv" and results[0]["calls"][-1] == "wait_for_save"
    for worker, digests in zip(workers, expected):
        assert worker.call("digest", blocks_b[:3]) == digests, f"rank {worker.rank} loaded other bytes"
    # B's save shares A's blocks: nothing new is written, and it is reported done all the same.
    assert [save.req_id for save in meta.saves] == ["B"]
    assert scheduler.request_finished(request_b, blocks_b) == (True, None)
    wait_finished(workers, "B")


class EagleSpeculativeConfig:
    """Stands for vLLM's SpeculativeConfig with an EAGLE/MTP method (building a real one loads
    the draft model's config)."""

    method = "eagle"

    def use_eagle(self) -> bool:
        return True

    def use_eagle_block_drop(self) -> bool:
        return True


def test_with_eagle_the_last_block_of_a_hit_is_not_loaded(tuttid):
    """Goal: with EAGLE/MTP speculative decoding vLLM drops the last block of its own prefix hit
    (FullAttentionManager.find_longest_cache_hit, drop_eagle_block): a drafter layer's KV at a
    block's last slot depends on the next token, which the block's key does not include. A hit
    in tutti is one block short likewise, whether or not vLLM holds the blocks before it."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    config = harness.vllm_config(daemon.socket, 1)
    config.speculative_config = EagleSpeculativeConfig()
    scheduler = harness.make_connector(config, KVConnectorRole.SCHEDULER)
    try:
        block = harness.BLOCK_TOKENS
        tokens = prompt(71, blocks=3, tail=2)
        worker.fill([1, 2, 3], 71)
        worker.save("P", tokens[: 3 * block], [1, 2, 3])
        request = harness.request("R", tokens)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * block, False)
        assert scheduler.get_num_new_matched_tokens(request, block) == (block, False)
        # vLLM holds two blocks (it dropped the third of its own hit): tutti's third is not loaded either.
        assert scheduler.get_num_new_matched_tokens(request, 2 * block) == (0, False)
        # Without EAGLE, every block of the hit is loaded.
        plain = harness.make_connector(harness.vllm_config(daemon.socket, 1), KVConnectorRole.SCHEDULER)
        try:
            assert plain.get_num_new_matched_tokens(harness.request("R2", tokens), 0) == (3 * block, False)
        finally:
            plain.shutdown()
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_local_prefix_counts_and_last_token_is_never_loaded(cluster):
    """Goal: the matched tokens exclude what vLLM already computed locally, and a prompt that is
    exactly whole blocks keeps its last block for vLLM to compute (it needs one token's logits)."""
    _, scheduler, workers = cluster
    whole = prompt(2, blocks=2, tail=0)
    save_prompt_on_every_rank(scheduler, workers, "W", whole, [1, 2], 2)

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


def test_a_load_failing_on_one_rank_cancels_the_same_step_save_on_every_rank(cluster):
    """Goal: a request that loads a cached prefix and saves its prompt in the same step saves on
    no rank when its load failed on one: the other rank's forward used the failed rank's heads
    (TP all-reduces), so its new blocks are wrong too, and committed they would later pair with
    the failed rank's good ones under one prefix. Both ranks report the save over (a miss); the
    prefix stays cached on no rank beyond what was there."""
    daemon, scheduler, workers = cluster
    prompt_a = prompt(5, blocks=2, tail=0)
    save_prompt_on_every_rank(scheduler, workers, "A", prompt_a, [1, 2], 5)

    # B: A's two blocks, then two blocks of its own; rank 0's load fails.
    prompt_b = prompt_a + prompt(6, blocks=2, tail=3)
    blocks_b = [10, 11, 12, 13, 14]
    request_b = harness.request("B", prompt_b)
    assert scheduler.get_num_new_matched_tokens(request_b, 0) == (2 * harness.BLOCK_TOKENS, False)
    scheduler.update_state_after_alloc(request_b, harness.blocks(blocks_b), 2 * harness.BLOCK_TOKENS)
    meta = scheduler.build_connector_meta(
        harness.scheduler_output(new=[("B", prompt_b, blocks_b, 2 * harness.BLOCK_TOKENS, len(prompt_b) - 2 * harness.BLOCK_TOKENS)])
    )
    assert [load.req_id for load in meta.loads] == ["B"] and [save.req_id for save in meta.saves] == ["B"]
    for worker in workers:
        worker.call("fill", blocks_b[2:], 6)
    workers[0].call("fail_loads")
    results = step(workers, meta)
    assert results[0]["load_errors"] == {10, 11} and results[1]["load_errors"] == set()
    assert scheduler.request_finished(request_b, blocks_b) == (True, None)
    wait_finished(workers, "B")  # reported over on both ranks: a miss, the blocks can be freed
    assert cached_blocks_per_rank(daemon, scheduler, prompt_b) == [2, 2], "a rank committed the blocks computed after a failed load"


def save_prompt_on_every_rank(scheduler, workers, req_id: str, tokens: list[int], block_ids: list[int], seed: int) -> None:
    """A whole request that saves `tokens` from `block_ids` (filled with `seed`) on every rank."""
    request = harness.request(req_id, tokens)
    scheduler.update_state_after_alloc(request, harness.blocks(block_ids), 0)
    meta = scheduler.build_connector_meta(harness.scheduler_output(new=[(req_id, tokens, block_ids, 0, len(tokens))]))
    for worker in workers:
        worker.call("fill", block_ids, seed)
    step(workers, meta)
    scheduler.request_finished(request, block_ids)
    wait_finished(workers, req_id)


def cached_blocks_per_rank(daemon, scheduler, tokens: list[int]) -> list[int]:
    counts = []
    for rank in range(TP_WORLD):
        with tutti.LookupClient.connect(
            daemon.socket, model_fingerprint=scheduler._fingerprint, tp_rank=rank, tp_world=TP_WORLD
        ) as lookup:
            counts.append(lookup.lookup(tokens))
    return counts


def test_loads_dropped_when_one_rank_ends_its_session_cancel_their_saves_on_every_rank(cluster):
    """Goal: rank 0 ends its session in a step (a prepare that timed out), dropping its other
    load of the step with it; that load counts as failed in the ranks' agreement, so the other
    rank does not commit the save computed against rank 0's stale blocks."""
    daemon, scheduler, workers = cluster
    prefix_a, prefix_b = prompt(21, blocks=2, tail=0), prompt(22, blocks=2, tail=0)
    save_prompt_on_every_rank(scheduler, workers, "PA", prefix_a, [1, 2], 21)
    save_prompt_on_every_rank(scheduler, workers, "PB", prefix_b, [3, 4], 22)
    prompt_a, prompt_b = prefix_a + prompt(23, blocks=1, tail=0), prefix_b + prompt(24, blocks=1, tail=0)
    blocks_a, blocks_b = [10, 11, 12], [20, 21, 22]
    meta = TuttiConnectorMetadata(
        loads=[LoadSpec("A", prefix_a, blocks_a[:2]), LoadSpec("B", prefix_b, blocks_b[:2])],
        saves=[SaveSpec("A", prompt_a, blocks_a), SaveSpec("B", prompt_b, blocks_b)],
    )
    for worker in workers:
        worker.call("fill", [blocks_a[2], blocks_b[2]], 25)
    workers[0].call("fail_loads", 1)  # A's prepare works, B's times out: the session ends
    results = step(workers, meta)
    assert results[0]["load_errors"] == {10, 11, 20, 21} and results[1]["load_errors"] == set()
    for req_id in ("A", "B"):
        wait_finished(workers, req_id)
    assert cached_blocks_per_rank(daemon, scheduler, prompt_a) == [2, 2], "A's save was committed after its load failed on rank 0"
    assert cached_blocks_per_rank(daemon, scheduler, prompt_b) == [2, 2]


def test_a_save_in_a_later_step_than_its_failed_load_is_cancelled_on_every_rank(cluster):
    """Goal: with chunked prefill and async scheduling vLLM may schedule a prompt's next chunk,
    and its save, before it learns that the load failed: the save, a step after the load, is
    cancelled on every rank (the chunk was computed against the stale blocks)."""
    daemon, scheduler, workers = cluster
    prefix = prompt(31, blocks=2, tail=0)
    save_prompt_on_every_rank(scheduler, workers, "P", prefix, [1, 2], 31)
    full = prefix + prompt(32, blocks=2, tail=0)
    blocks = [10, 11, 12, 13]
    workers[0].call("fail_loads")
    results = step(workers, TuttiConnectorMetadata(loads=[LoadSpec("C", prefix, blocks[:2])]))
    assert results[0]["load_errors"] == {10, 11} and results[1]["load_errors"] == set()
    for worker in workers:
        worker.call("fill", blocks[2:], 33)
    step(workers, TuttiConnectorMetadata(saves=[SaveSpec("C", full, blocks)]))
    wait_finished(workers, "C")
    assert cached_blocks_per_rank(daemon, scheduler, full) == [2, 2], "a save after a failed load was committed"
    # Another request saving the same prompt later is not affected (the mark went with C's save).
    for worker in workers:
        worker.call("fill", [14, 15, 16, 17], 33)
    step(workers, TuttiConnectorMetadata(saves=[SaveSpec("D", full, [14, 15, 16, 17])]))
    wait_finished(workers, "D")
    assert cached_blocks_per_rank(daemon, scheduler, full) == [4, 4]


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


def test_a_request_preempted_outside_schedule_then_aborted_is_freed(cluster):
    """Goal: vLLM's reset_prefix_cache(reset_running_requests=True) preempts every running
    request outside schedule() (Scheduler._preempt_request); aborted before the next metadata,
    the request is finished while the connector still holds its save as emitted. The workers
    forget that save when the next step names it preempted (and finished), so it would never
    be reported: request_finished must not ask vLLM to wait for it, or the request is never
    freed and the engine never goes idle."""
    _, scheduler, workers = cluster
    prompt_a = prompt(8, blocks=2, tail=3)
    request_a = harness.request("A", prompt_a)
    assert scheduler.get_num_new_matched_tokens(request_a, 0) == (0, False)
    scheduler.update_state_after_alloc(request_a, harness.blocks([5, 6, 7]), 0)
    meta = scheduler.build_connector_meta(harness.scheduler_output(new=[("A", prompt_a, [5, 6, 7], 0, len(prompt_a))]))
    assert [save.req_id for save in meta.saves] == ["A"]
    for worker in workers:
        worker.call("fill", [5, 6, 7], 8)
    step(workers, meta)
    # What Scheduler._preempt_request does to it (vLLM 0.32), outside schedule(); then the abort.
    request_a.num_preemptions += 1
    request_a.num_computed_tokens = 0
    keep, _ = scheduler.request_finished(request_a, [])
    assert keep is False, "vLLM would wait for a save the workers forget"
    meta = scheduler.build_connector_meta(harness.scheduler_output(preempted={"A"}, finished={"A"}))
    results = step(workers, meta, finished={"A"})
    assert all("A" not in result["finished_sending"] for result in results)

    # A request saved (not preempted since) is still kept until its save is reported.
    prompt_b = prompt(9, blocks=2, tail=3)
    request_b = harness.request("B", prompt_b)
    request_b.num_preemptions = 1  # preempted and resumed before its save was emitted
    scheduler.get_num_new_matched_tokens(request_b, 0)
    scheduler.update_state_after_alloc(request_b, harness.blocks([8, 9, 10]), 0)
    meta = scheduler.build_connector_meta(harness.scheduler_output(new=[("B", prompt_b, [8, 9, 10], 0, len(prompt_b))]))
    for worker in workers:
        worker.call("fill", [8, 9, 10], 9)
    step(workers, meta)
    assert scheduler.request_finished(request_b, [8, 9, 10]) == (True, None)
    wait_finished(workers, "B")


def test_every_abstract_method_of_the_base_class_is_implemented():
    """Goal: a vLLM upgrade that adds an abstract method to KVConnectorBase_V1 fails here, not in
    a user's server."""
    assert not TuttiConnector.__abstractmethods__
    # The connector's own classes: TuttiConnector and its scheduler- and worker-side mixins.
    own = TuttiConnector.__mro__[: TuttiConnector.__mro__.index(KVConnectorBase_V1)]
    for name in KVConnectorBase_V1.__abstractmethods__:
        assert any(name in cls.__dict__ for cls in own), f"{name} is abstract in vLLM and not implemented"


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
        ({"socket": daemon.socket, "layers_in_flight": 0}, "'layers_in_flight' = 0: must be 1..=4"),
        ({"socket": daemon.socket, "layers_in_flight": 5}, "'layers_in_flight' = 5: must be 1..=4"),
        ({"socket": daemon.socket, "requests_max": 300, "layers_in_flight": 4}, "= 1200 IOCB sets, more than 1024"),
        ({"socket": daemon.socket, "queue_depth": 1}, "'queue_depth' = 1: must be 2..=1024"),
        ({"socket": daemon.socket, "queue_depth": 2048}, "'queue_depth' = 2048: must be 2..=1024"),
        ({"socket": daemon.socket, "model_fingerprint": "abc"}, "64 hexadecimal digits"),
        ({"socket": daemon.socket, "timeout_s": float("inf")}, "'timeout_s' = inf: must be at most 1e+09 seconds"),
        ({"socket": daemon.socket, "lookup_timeout_s": 1e10}, "'lookup_timeout_s' = 10000000000.0: must be at most 1e+09"),
        ({"socket": daemon.socket, "timeout_s": float("nan")}, "'timeout_s' = nan: must be positive"),
    ]
    for extra, message in cases:
        with pytest.raises(tutti.InvalidArgument, match=re.escape(message)):
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


# ------------------------------------------------------------------------------------------------
# One worker-side connector in this process (TP 1), for tests that pause tuttid between its calls
# or wrap its store.
# ------------------------------------------------------------------------------------------------


class LocalWorker:
    """A worker-side connector built by vLLM's factory in this process, with its KV caches."""

    def __init__(self, socket: str, **extra) -> None:
        config = harness.vllm_config(socket, 1, extra={"socket": socket, "timeout_s": 20.0, **extra})
        self.connector = harness.make_connector(config, KVConnectorRole.WORKER)
        self.caches = self.connector.allocate_kv_caches(harness.kv_cache_config())
        self.connector.register_kv_caches(self.caches)
        self.state = {"connector": self.connector, "caches": self.caches}

    def step(self, metadata, finished=frozenset(), layerwise=True, sync_loads=None) -> dict:
        return harness._do_step(self.state, 0, metadata, set(finished), layerwise, sync_loads)

    def fill(self, block_ids: list[int], seed: int) -> None:
        harness._do_fill(self.state, 0, block_ids, seed)

    def blocks_bytes(self, block_ids: list[int]) -> list[torch.Tensor]:
        return [harness._block_bytes(self.caches, name, block) for name in harness.layer_names() for block in block_ids]

    def save(self, req_id: str, tokens: list[int], block_ids: list[int]) -> None:
        """A whole save (one step, then get_finished until it is reported)."""
        self.step(TuttiConnectorMetadata(saves=[SaveSpec(req_id, tokens, block_ids)]))
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while req_id not in (self.connector.get_finished({req_id})[0] or set()):
            assert time.monotonic() < deadline, f"the save of {req_id} was never reported"
            time.sleep(0.01)

    def shutdown(self) -> None:
        self.connector.shutdown()


def worker_sessions(socket: str) -> list[int]:
    """tuttid's sessions of vLLM workers (by their client name)."""
    with tutti.LookupClient.connect(socket, model_fingerprint=tutti.fingerprint("probe")) as probe:
        return [client["session"] for client in probe.status()["clients"] if client["name"].startswith("vllm-worker")]


def wait_no_worker_session(socket: str) -> None:
    deadline = time.monotonic() + FINISH_TIMEOUT_S
    while worker_sessions(socket):
        assert time.monotonic() < deadline, "tuttid still lists the worker's session"
        time.sleep(0.02)


def test_a_step_without_loads_saves_during_the_forward(tuttid):
    """Goal: in a step without synchronous loads vLLM calls start_load_kv only after the forward;
    the save is still issued layer by layer during the forward (prepared when the metadata was
    bound), so wait_for_save finds layers 0..L-3 complete and the last two issued."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    try:
        tokens = prompt(10, blocks=2, tail=0)
        worker.fill([1, 2], 10)
        result = worker.step(TuttiConnectorMetadata(saves=[SaveSpec("F", tokens, [1, 2])]))
        assert result["calls"][-2:] == ["start_load_kv", "wait_for_save"]
        issued, completed = result["saves_before_wait"]["F"]
        assert issued == harness.LAYERS and set(range(harness.LAYERS - 2)) <= set(completed), result
    finally:
        worker.shutdown()


def test_requires_kv_delivery_is_false(cluster):
    """Goal: vLLM does not drop a preempted request's output for tutti's sake: a save that does
    not happen is a future miss (vLLM's base class answers True for kv_both, the role here)."""
    _, scheduler, _ = cluster
    assert KVConnectorBase_V1.requires_kv_delivery.fget(scheduler) is True
    assert scheduler.requires_kv_delivery is False


def test_the_default_fingerprint_names_the_kv_layout(tuttid):
    """Goal: two deployments of one model whose KV caches differ only in layout (LBHNC and LBNHC:
    a block of the same size, heads and slots transposed) get different key spaces; the same
    layout the same one; and a worker whose caches are in the other order is refused."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)

    def fingerprint(layout):
        config = harness.vllm_config(daemon.socket, 1)
        config.cache_config.kv_cache_layout = layout
        scheduler = harness.make_connector(config, KVConnectorRole.SCHEDULER)
        scheduler.shutdown()
        return scheduler._fingerprint

    assert fingerprint("LBHNC") != fingerprint("LBNHC")
    assert fingerprint("LBNHC") == fingerprint("LBNHC")
    assert fingerprint(None) == fingerprint("LBHNC"), "unresolved: vLLM's identity layout"

    config = harness.vllm_config(daemon.socket, 1)
    config.cache_config.kv_cache_layout = "LBNHC"
    worker = harness.make_connector(config, KVConnectorRole.WORKER)
    try:
        caches = worker.allocate_kv_caches(harness.kv_cache_config())
        first = caches[harness.layer_names()[0]]
        assert first.stride(2) > first.stride(1), "allocate_kv_caches views the resolved layout (LBNHC)"
        transposed = {name: view.contiguous() for name, view in caches.items()}  # heads outside slots: LBHNC's order
        with pytest.raises(tutti.InvalidArgument, match="LBNHC"):
            worker.register_kv_caches(transposed)
        worker.register_kv_caches(caches)
    finally:
        worker.shutdown()


def test_an_explicit_fingerprint_still_names_the_kv_layout(tuttid):
    """Goal: an explicit model_fingerprint stands for the model, not for the deployment's KV
    layout: LBHNC and LBNHC (same block size, heads and slots transposed) under one explicit
    fingerprint are two key spaces, and neither is the default fingerprint's."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    explicit = "cd" * 32

    def fingerprint(layout, extra):
        config = harness.vllm_config(daemon.socket, 1, extra=extra)
        config.cache_config.kv_cache_layout = layout
        scheduler = harness.make_connector(config, KVConnectorRole.SCHEDULER)
        scheduler.shutdown()
        return scheduler._fingerprint

    given = {"socket": daemon.socket, "timeout_s": 20, "model_fingerprint": explicit}
    assert fingerprint("LBHNC", given) != fingerprint("LBNHC", given)
    assert fingerprint("LBNHC", given) == fingerprint("LBNHC", given)
    assert fingerprint("LBHNC", given) != fingerprint("LBHNC", None)


def test_the_default_fingerprint_names_rope_and_hf_overrides(tmp_path):
    """Goal: a model served with other RoPE parameters (rope_scaling / rope_parameters,
    rope_theta, partial_rotary_factor in its checkpoint's config.json, or a context extension
    through --hf-overrides) computes other KV bytes for the same tokens, so it gets another key
    space; the same configuration gets the same one in every process (no object ids, dict order
    ignored), and so does a callable hf_overrides (named by module and name). The model config
    is a stand-in over a config.json rewritten in one model directory (a real one is
    test_scheduler_and_workers_agree_on_the_fingerprint_when_model_code_rewrites_rope's)."""
    import json
    from types import SimpleNamespace

    from tutti._engine import fingerprint_from_config
    from tutti.vllm.connector import _model_identity

    model_dir = tmp_path / "m"
    model_dir.mkdir()

    def fingerprint(hf_overrides=None, **checkpoint_config):
        (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", **checkpoint_config}))
        model = SimpleNamespace(
            model=str(model_dir), revision=None, dtype="bfloat16", quantization=None,
            hf_overrides={} if hf_overrides is None else hf_overrides,
        )  # fmt: skip
        config = SimpleNamespace(model_config=model, cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"))
        return fingerprint_from_config(None, *_model_identity(config, harness.kv_cache_config(), "LBHNC"))

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    base = fingerprint(rope_scaling=None, rope_theta=1e6)
    assert fingerprint(rope_scaling=None, rope_theta=1e6) == base
    assert fingerprint(rope_scaling=yarn, rope_theta=1e6) != base
    assert fingerprint(rope_scaling=yarn, rope_theta=1e6) == fingerprint(rope_scaling=dict(reversed(list(yarn.items()))), rope_theta=1e6)
    assert fingerprint(rope_scaling=None, rope_theta=5e5) != base
    assert fingerprint(rope_parameters={"rope_type": "default", "rope_theta": 1e6}) != fingerprint(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert fingerprint(rope_scaling=None, rope_theta=1e6, partial_rotary_factor=0.5) != base
    assert fingerprint(text_config={"rope_scaling": yarn}, rope_theta=1e6) != fingerprint(text_config={}, rope_theta=1e6)
    assert fingerprint({"rope_scaling": yarn}, rope_scaling=None, rope_theta=1e6) != base
    assert fingerprint(json.loads, rope_scaling=None, rope_theta=1e6) == fingerprint(json.loads, rope_scaling=None, rope_theta=1e6)
    assert fingerprint(json.loads, rope_scaling=None, rope_theta=1e6) != fingerprint(json.dumps, rope_scaling=None, rope_theta=1e6)


def test_the_default_fingerprint_names_a_local_models_weights(tmp_path):
    """Goal: a fine-tune saved over a local model directory (config.json unchanged) computes other
    KV for the same tokens, so the default fingerprint names the directory's weight files (their
    names, sizes and modification times, and the index JSON): rewriting a weights file gives
    another key space, an unchanged directory the same one."""
    import json
    import os
    from types import SimpleNamespace

    from tutti._engine import fingerprint_from_config
    from tutti.vllm.connector import _model_identity

    model_dir = tmp_path / "ft"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 1e6}))
    weights = model_dir / "model.safetensors"
    weights.write_bytes(b"old weights")
    os.utime(weights, ns=(1_000_000_000, 1_000_000_000))

    def fingerprint():
        model = SimpleNamespace(model=str(model_dir), revision=None, dtype="bfloat16", quantization=None, hf_overrides={})
        config = SimpleNamespace(model_config=model, cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"))
        return fingerprint_from_config(None, *_model_identity(config, harness.kv_cache_config(), "LBHNC"))

    old = fingerprint()
    assert fingerprint() == old
    weights.write_bytes(b"new weights")  # the same size, another time
    os.utime(weights, ns=(2_000_000_000, 2_000_000_000))
    assert fingerprint() != old, "a fine-tune saved over the directory shares the old weights' key space"
    rewritten = fingerprint()
    (model_dir / "model.safetensors.index.json").write_text("{}")
    assert fingerprint() != rewritten, "the index JSON is not named"


def weights_fingerprint(model_dir, model_weights=""):
    """The default fingerprint of a stand-in model config over `model_dir` (vLLM's model_weights:
    where runai_streamer streams the weights from, "" otherwise), as the scheduler's connector
    computes it (a missing fingerprint over streamed weights warned of)."""
    from types import SimpleNamespace

    from tutti._engine import fingerprint_from_config
    from tutti.vllm.connector import _model_identity

    model = SimpleNamespace(
        model=str(model_dir), model_weights=model_weights, revision=None, dtype="bfloat16", quantization=None, hf_overrides={}
    )
    config = SimpleNamespace(model_config=model, cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"))
    identity = _model_identity(config, harness.kv_cache_config(), "LBHNC", fingerprint_setting="kv_connector_extra_config")
    return fingerprint_from_config(None, *identity)


def test_a_hugging_face_snapshots_weights_are_named_by_their_blobs_not_their_download_time(tmp_path):
    """Goal: a Hugging Face snapshot directory's weight files are links to blobs named by their
    content hash, each downloaded (and so timed) when that node fetched it: the default
    fingerprint names a linked file by its blob's name and size and an index JSON by its
    contents, so two nodes' downloads of one revision share a key space (a blob's time changes
    nothing), and another blob (other weights) or another index gives another one."""
    import json
    import os

    blobs = tmp_path / "blobs"
    blobs.mkdir()
    snapshot = tmp_path / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 1e6}))
    for name, blob, content in (("model.safetensors", "a" * 64, b"weights"), ("model.safetensors.index.json", "b" * 40, b"{}")):
        (blobs / blob).write_bytes(content)
        os.utime(blobs / blob, ns=(1_000_000_000, 1_000_000_000))
        (snapshot / name).symlink_to(os.path.join("..", "..", "blobs", blob))
    first = weights_fingerprint(snapshot)
    for blob in ("a" * 64, "b" * 40):  # another node's download: other times
        os.utime(blobs / blob, ns=(5_000_000_000, 5_000_000_000))
    assert weights_fingerprint(snapshot) == first, "a blob's download time changed the key space"
    (blobs / ("c" * 64)).write_bytes(b"WEIGHTS")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(os.path.join("..", "..", "blobs", "c" * 64))
    assert weights_fingerprint(snapshot) != first, "another blob shares the old weights' key space"


def test_a_plain_link_to_a_checkpoints_weights_is_named_by_its_target(tmp_path):
    """Goal: only a Hugging Face blob (a file named by 40 or 64 hex digits of its content's hash,
    in a directory named blobs) is named by its name and size alone. A serving directory whose
    weights link into checkpoint folders (w.safetensors -> ckpt/step-1000/w.safetensors) and are
    re-pointed to another step (the same sizes: fine-tunes of one architecture) is another key
    space: the link is resolved and its target named by its path's name, size and time, as a
    plain file is. With the target's name and size only, the new weights kept the old key space
    (stale KV). A blob reached through a chain of links is still a blob."""
    import json
    import os

    serving = tmp_path / "serving"
    serving.mkdir()
    (serving / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 1e6}))
    for step, content, time_ns in (("step-1000", b"weights-1", 1_000_000_000), ("step-2000", b"weights-2", 2_000_000_000)):
        folder = tmp_path / "ckpt" / step
        folder.mkdir(parents=True)
        (folder / "w.safetensors").write_bytes(content)
        os.utime(folder / "w.safetensors", ns=(time_ns, time_ns))
    (serving / "w.safetensors").symlink_to(tmp_path / "ckpt" / "step-1000" / "w.safetensors")
    first = weights_fingerprint(serving)
    (serving / "w.safetensors").unlink()
    (serving / "w.safetensors").symlink_to(tmp_path / "ckpt" / "step-2000" / "w.safetensors")
    assert weights_fingerprint(serving) != first, "weights re-pointed to another checkpoint kept the key space"

    # A blob through a chain of links (snapshot -> a link farm -> blobs/<sha256>): named by the
    # blob, whatever its time.
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / ("d" * 64)).write_bytes(b"weights-3")
    farm = tmp_path / "farm"
    farm.mkdir()
    (farm / "w.safetensors").symlink_to(blobs / ("d" * 64))
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "w.safetensors").symlink_to(farm / "w.safetensors")
    blob = weights_fingerprint(snapshot)
    os.utime(blobs / ("d" * 64), ns=(7_000_000_000, 7_000_000_000))
    assert weights_fingerprint(snapshot) == blob, "a blob's download time changed the key space"
    # A file in a directory named blobs whose name is no content hash is a plain file.
    (blobs / "w.safetensors").write_bytes(b"weights-4")
    (snapshot / "w.safetensors").unlink()
    (snapshot / "w.safetensors").symlink_to(blobs / "w.safetensors")
    plain = weights_fingerprint(snapshot)
    os.utime(blobs / "w.safetensors", ns=(8_000_000_000, 8_000_000_000))
    assert weights_fingerprint(snapshot) != plain, "a file that is no content-addressed blob was named without its time"


def test_a_snapshot_whose_blobs_directory_is_a_link_is_named_by_its_blobs(tmp_path, monkeypatch):
    """Goal: a Hugging Face cache whose blobs directory is itself a symbolic link to another disk
    (models--x/blobs -> /mnt/ssd/hfblobs) still names a snapshot's weights by their blobs: the
    link's own target (../../blobs/<hash>, as Hugging Face writes it) decides, not the fully
    resolved path, whose directory has another name; resolved, the blob's time (this node's
    download) entered the key. Such links are not resolved at all (realpath: an lstat per path
    component, each a round trip on NFS); a plain link re-pointed to other weights still changes
    the key."""
    import json
    import os

    elsewhere = tmp_path / "ssd" / "hfblobs"
    elsewhere.mkdir(parents=True)
    repo = tmp_path / "models--org--m"
    repo.mkdir()
    (repo / "blobs").symlink_to(elsewhere)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 1e6}))
    (elsewhere / ("a" * 64)).write_bytes(b"weights")
    os.utime(elsewhere / ("a" * 64), ns=(1_000_000_000, 1_000_000_000))
    (snapshot / "model.safetensors").symlink_to(os.path.join("..", "..", "blobs", "a" * 64))
    resolved: list[str] = []
    real_realpath = os.path.realpath

    def realpath(path, *args, **kwargs):
        resolved.append(os.fspath(path))
        return real_realpath(path, *args, **kwargs)

    monkeypatch.setattr(os.path, "realpath", realpath)
    first = weights_fingerprint(snapshot)
    os.utime(elsewhere / ("a" * 64), ns=(5_000_000_000, 5_000_000_000))  # another node's download
    assert weights_fingerprint(snapshot) == first, "a blob's download time changed the key space"
    assert not [path for path in resolved if path.endswith("model.safetensors")], f"a blob link was resolved: {resolved}"
    # An absolute link into a directory named blobs is a blob too.
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(repo / "blobs" / ("a" * 64))
    absolute = weights_fingerprint(snapshot)
    os.utime(elsewhere / ("a" * 64), ns=(6_000_000_000, 6_000_000_000))
    assert weights_fingerprint(snapshot) == absolute, "a blob's download time changed the key space"
    # A plain link re-pointed to other weights of the same size: another key space.
    for step in ("step-1", "step-2"):
        (tmp_path / step).mkdir()
        (tmp_path / step / "w.safetensors").write_bytes(b"weights")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(tmp_path / "step-1" / "w.safetensors")
    plain = weights_fingerprint(snapshot)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(tmp_path / "step-2" / "w.safetensors")
    os.utime(tmp_path / "step-2" / "w.safetensors", ns=(9_000_000_000, 9_000_000_000))
    assert weights_fingerprint(snapshot) != plain, "weights re-pointed to another checkpoint kept the key space"


def test_weights_streamed_from_object_storage_are_named_by_their_url(tmp_path):
    """Goal: with --load-format runai_streamer and an s3:// model, vLLM serves model_config.model
    from a local directory it fills with the model's *.json (the index JSON included) at every
    start and streams the weights from model_config.model_weights: the default fingerprint names
    that URL, not the directory's files (new times each start), so a restart finds its blocks;
    another URL is another key space."""
    import json
    import os

    pulled = tmp_path / "model_streamer" / "0123abcd"
    pulled.mkdir(parents=True)
    (pulled / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 1e6}))
    index = pulled / "model.safetensors.index.json"
    index.write_text('{"weight_map": {}}')
    os.utime(index, ns=(1_000_000_000, 1_000_000_000))
    first = weights_fingerprint(pulled, "s3://bucket/llama/")
    index.write_text('{"weight_map": {}}')  # pulled again at the next start
    os.utime(index, ns=(9_000_000_000, 9_000_000_000))
    assert weights_fingerprint(pulled, "s3://bucket/llama/") == first, "a restart's pull changed the key space"
    assert weights_fingerprint(pulled, "s3://bucket/llama-ft/") != first, "another URL shares the key space"


def test_weights_streamed_from_a_url_without_a_model_fingerprint_are_warned_of(tmp_path, caplog):
    """Goal: the default fingerprint of weights streamed from object storage names their URL (and
    vLLM's revision), not the objects, which cannot be listed here: weights replaced at that URL
    would keep the key space and load the old weights' KV. Without an explicit model_fingerprint
    the connector says so at start (a warning naming the URL and the fix); with one (only the
    layout parts are read: with_model False) it does not. A revision set is hashed."""
    import logging
    from types import SimpleNamespace

    from tutti.vllm.connector import _model_identity

    (tmp_path / "config.json").write_text('{"model_type": "llama", "rope_theta": 1e6}')
    caplog.set_level(logging.WARNING, logger="tutti.vllm")
    first = weights_fingerprint(tmp_path, "s3://bucket/llama/")
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any("s3://bucket/llama/" in message and "model_fingerprint" in message for message in warnings), warnings
    caplog.clear()
    model = SimpleNamespace(
        model=str(tmp_path), model_weights="s3://bucket/llama/", revision=None, dtype="bfloat16", quantization=None, hf_overrides={}
    )
    config = SimpleNamespace(model_config=model, cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"))
    _model_identity(config, harness.kv_cache_config(), "LBHNC", with_model=False, fingerprint_setting="kv_connector_extra_config")
    assert not [record for record in caplog.records if "s3://" in record.getMessage()], "warned with an explicit fingerprint"
    # Weights not streamed: no such warning.
    weights_fingerprint(tmp_path)
    assert not [record for record in caplog.records if "weights stream from" in record.getMessage()]
    model.revision = "step-2000"
    from tutti._engine import fingerprint_from_config

    assert fingerprint_from_config(None, *_model_identity(config, harness.kv_cache_config(), "LBHNC")) != first, (
        "another revision of the streamed weights shares the key space"
    )


def test_the_connectors_streamed_weights_warning_names_its_config_once(tuttid, tmp_path, caplog):
    """Goal: a connector over weights streamed from object storage (vLLM's model_weights set),
    without model_fingerprint, warns that the URL's objects are not named and says where the
    fingerprint goes (kv_connector_extra_config), once for the deployment: the scheduler's
    connector logs it, the workers' (one per TP rank) do not. Before, every rank and the
    scheduler each logged it."""
    import logging

    daemon = tuttid(harness.TUTTID_GEOMETRY)
    vllm_config = harness.vllm_config(daemon.socket, 1)
    vllm_config.model_config = llama_model_config(tmp_path / "m")
    vllm_config.model_config.model_weights = "s3://bucket/llama/"
    caplog.set_level(logging.WARNING, logger="tutti.vllm")

    def warnings():
        return [record.getMessage() for record in caplog.records if "s3://bucket/llama/" in record.getMessage()]

    # The worker first: it must say nothing; then the scheduler, once.
    worker = harness.make_connector(vllm_config, KVConnectorRole.WORKER)
    try:
        assert warnings() == [], "a worker's connector warned"
        scheduler = harness.make_connector(vllm_config, KVConnectorRole.SCHEDULER)
        try:
            assert worker._fingerprint == scheduler._fingerprint
        finally:
            scheduler.shutdown()
    finally:
        worker.shutdown()
    assert len(warnings()) == 1, warnings()
    assert "kv_connector_extra_config" in warnings()[0], warnings()


@pytest.mark.parametrize("rope_from", ["hf_overrides", "config.json"])
def test_scheduler_and_workers_agree_on_the_fingerprint_when_model_code_rewrites_rope(tuttid, tmp_path, rope_from):
    """Goal: the scheduler's connector and the workers' name the same key space although model
    code rewrites the RoPE parameters of vLLM's config in place while a worker loads the model
    (DeepSeek-V2/V3: rope_type "yarn" -> "deepseek_yarn"; GLM-4: partial_rotary_factor set),
    which vLLM 0.32's worker does before it builds its connector (initialize_from_config after
    load_model) and the scheduler's process never does (multiprocess executor, TP >= 2): with
    fingerprints of those in-memory fields every lookup missed. A real vLLM ModelConfig over a
    local config.json, yarn in it or through hf_overrides (whose dict vLLM makes the config's
    own rope_parameters object, rewritten with it); the worker's rewrite is made by hand, as the
    model constructors make it. And the yarn deployment's key space is not the plain model's."""

    daemon = tuttid(harness.TUTTID_GEOMETRY)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}

    def config(name, hf_overrides, **checkpoint):
        vllm_config = harness.vllm_config(daemon.socket, 1)
        vllm_config.model_config = llama_model_config(tmp_path / name, hf_overrides, **checkpoint)
        return vllm_config

    if rope_from == "hf_overrides":
        vllm_config, plain_config = config("m", {"rope_scaling": yarn}), config("m-plain", {})
        plain_config.model_config.model = vllm_config.model_config.model  # the same model, without the override
    else:
        # (the same path with another config.json: test_the_default_fingerprint_names_rope_and_hf_overrides)
        vllm_config, plain_config = config("m", {}, rope_scaling=yarn), None
    rope = vllm_config.model_config.hf_text_config.rope_parameters
    assert rope["rope_type"] == "yarn", rope
    scheduler = harness.make_connector(vllm_config, KVConnectorRole.SCHEDULER)
    # What DeepSeek-V2/V3's and GLM-4's constructors do to the worker's config at load_model.
    rope["rope_type"] = "deepseek_yarn"
    rope.setdefault("partial_rotary_factor", 0.5)
    worker = harness.make_connector(vllm_config, KVConnectorRole.WORKER)
    try:
        assert worker._fingerprint == scheduler._fingerprint, "the workers' key space is not the scheduler's"
        if plain_config is not None:
            plain = harness.make_connector(plain_config, KVConnectorRole.SCHEDULER)
            plain.shutdown()
            assert plain._fingerprint != scheduler._fingerprint, "yarn through hf_overrides shares the plain model's keys"
    finally:
        worker.shutdown()
        scheduler.shutdown()


def llama_model_config(model_dir, hf_overrides=None, **checkpoint):
    """A real vLLM ModelConfig over a small Llama config.json written into `model_dir`."""
    import json

    from vllm.config import ModelConfig

    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": harness.KV_HEADS, "num_hidden_layers": harness.LAYERS,
        "head_dim": harness.HEAD_DIM, "vocab_size": 1000, "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16", **checkpoint,
    }))  # fmt: skip
    return ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", hf_overrides=hf_overrides or {})


def test_a_rope_override_of_any_type_names_one_key_space_although_deepseek_rewrites_its_type(tuttid, tmp_path):
    """Goal: DeepSeek-V2/V3's constructors turn any rope_type but "default" of the config's RoPE
    parameters into "deepseek_yarn" or "deepseek_llama_scaling" at the worker's load_model, and a
    dict hf_overrides gives for rope_scaling is that very object in vLLM: with rope_type "linear"
    the scheduler hashed "linear" and the worker "yarn" (the rewrites were mapped back to "yarn"
    only), so no lookup ever hit. rope_type is now left out of hf_overrides' RoPE dicts; the
    override's factor still gives it another key space than the plain model. The rewrite is made
    by hand, as the model constructors make it."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    vllm_config = harness.vllm_config(daemon.socket, 1)
    vllm_config.model_config = llama_model_config(tmp_path / "m", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    rope = vllm_config.model_config.hf_text_config.rope_parameters
    assert rope["rope_type"] == "linear", rope
    scheduler = harness.make_connector(vllm_config, KVConnectorRole.SCHEDULER)
    # DeepSeek-V2/V3's DeepseekV2Attention / DeepseekV2MLAAttention at load_model.
    rope["rope_type"] = "deepseek_llama_scaling" if rope.get("attention_factor") == 1.0 else "deepseek_yarn"
    worker = harness.make_connector(vllm_config, KVConnectorRole.WORKER)
    try:
        assert worker._fingerprint == scheduler._fingerprint, "the workers' key space is not the scheduler's"
        worker.bind_connector_metadata(scheduler.build_connector_meta(harness.scheduler_output()))
        worker.clear_connector_metadata()
    finally:
        worker.shutdown()
        scheduler.shutdown()
    plain_config = harness.vllm_config(daemon.socket, 1)
    plain_config.model_config = llama_model_config(tmp_path / "plain")
    plain_config.model_config.model = vllm_config.model_config.model  # the same model, without the override
    plain = harness.make_connector(plain_config, KVConnectorRole.SCHEDULER)
    plain.shutdown()
    assert plain._fingerprint != scheduler._fingerprint, "the linear override shares the plain model's keys"


def test_the_fingerprints_inputs_go_to_the_workers_once_not_every_step(tuttid, tmp_path):
    """Goal: the scheduler's fingerprint inputs (which name every weight file of a local model
    directory: hundreds of KB for thousands of files) are sent with the first step's metadata,
    which every worker compares when it binds it; later steps carry the 32-byte fingerprint
    only, since vLLM pickles each step's metadata to every worker. Before: every step carried
    them all."""
    import pickle

    daemon = tuttid(harness.TUTTID_GEOMETRY)
    vllm_config = harness.vllm_config(daemon.socket, 1)
    vllm_config.model_config = llama_model_config(tmp_path / "m")
    for shard in range(2000):
        (tmp_path / "m" / f"model-{shard:05d}-of-02000.safetensors").write_bytes(b"")
    scheduler = harness.make_connector(vllm_config, KVConnectorRole.SCHEDULER)
    worker = harness.make_connector(vllm_config, KVConnectorRole.WORKER)
    try:
        first = scheduler.build_connector_meta(harness.scheduler_output())
        assert "model-01999-of-02000.safetensors" in first.model_identity
        worker.bind_connector_metadata(first)
        worker.clear_connector_metadata()
        for _ in range(3):
            later = scheduler.build_connector_meta(harness.scheduler_output())
            assert later.model_fingerprint == scheduler._fingerprint
            size = len(pickle.dumps(later))
            assert size < 2048, f"a later step's metadata is {size} bytes"
            worker.bind_connector_metadata(later)
            worker.clear_connector_metadata()
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_a_worker_whose_fingerprint_is_not_the_schedulers_stops_at_the_first_step(tuttid, tmp_path):
    """Goal: scheduler and workers compute their default fingerprints each on its own (each
    reads the checkpoint's config.json), and when one read failed (the file gone, unreadable, a
    revision that moved) their key spaces differ: every lookup would miss every save, with only a
    warning logged. The worker compares the scheduler's fingerprint, carried in each step's
    metadata, with its own when it binds it, and raises ConfigError naming both fingerprints,
    their inputs and the fix (an explicit model_fingerprint), at every later step too. A real
    vLLM ModelConfig over a local directory; config.json renamed away between the scheduler's
    connector and the worker's. Before: both connectors were built and the step ran, with
    different fingerprints."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    vllm_config = harness.vllm_config(daemon.socket, 1)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    vllm_config.model_config = llama_model_config(tmp_path / "m", rope_scaling=yarn)
    scheduler = harness.make_connector(vllm_config, KVConnectorRole.SCHEDULER)
    (tmp_path / "m" / "config.json").rename(tmp_path / "m" / "config.json.away")
    worker = harness.make_connector(vllm_config, KVConnectorRole.WORKER)
    try:
        meta = scheduler.build_connector_meta(harness.scheduler_output())
        assert meta.model_fingerprint == scheduler._fingerprint
        worker.handle_preemptions(meta)
        with pytest.raises(ConfigError) as raised:
            worker.bind_connector_metadata(meta)
        message = str(raised.value)
        for what in (scheduler._fingerprint.hex(), worker._fingerprint.hex(), '"model_fingerprint"', "rope_scaling"):
            assert what in message, f"{what} not in {message}"
        worker.clear_connector_metadata()
        with pytest.raises(ConfigError):
            worker.bind_connector_metadata(scheduler.build_connector_meta(harness.scheduler_output()))
    finally:
        worker.shutdown()
        scheduler.shutdown()
    # Both read it: the worker binds the scheduler's metadata.
    (tmp_path / "m" / "config.json.away").rename(tmp_path / "m" / "config.json")
    scheduler = harness.make_connector(vllm_config, KVConnectorRole.SCHEDULER)
    worker = harness.make_connector(vllm_config, KVConnectorRole.WORKER)
    try:
        worker.bind_connector_metadata(scheduler.build_connector_meta(harness.scheduler_output()))
        worker.clear_connector_metadata()
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_the_checkpoint_config_is_read_at_the_commit_vllm_resolved_and_read_again_after_a_failure(monkeypatch, tmp_path):
    """Goal: the config.json of a Hugging Face model is looked up at the commit vLLM resolved its
    revision to (huggingface_hub's ResolvedRevision: its str is "main", which may point to another
    commit by the time another process reads it), and that commit, not "main", is hashed; a read
    that fails is tried again (a transient failure in one process would split its key space from
    the others'), and whatever a read raises (RecursionError of a deeply nested file included)
    leaves the RoPE part out instead of failing the connector. Before: "main" was looked up and
    hashed, and one failed read was final."""
    import json
    from types import SimpleNamespace

    from huggingface_hub._revision import ResolvedRevision
    from tutti.vllm import connector as connector_module
    from vllm.transformers_utils import repo_utils

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"rope_theta": 5e5}))
    asked: list = []
    answers: list = []

    def try_get_local_file(model, file_name, revision="main"):
        asked.append(revision)
        answer = answers.pop(0) if answers else path
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(repo_utils, "try_get_local_file", try_get_local_file)
    commit = "0123456789abcdef0123456789abcdef01234567"
    model = SimpleNamespace(model="org/model", revision=ResolvedRevision(commit, None, "org/model"), hf_overrides={})
    assert str(model.revision) == "main"
    assert connector_module._read_checkpoint_config(model) == {"rope_theta": 5e5}
    assert asked == [commit], asked
    identity = connector_module._model_identity(
        SimpleNamespace(model_config=SimpleNamespace(dtype="bfloat16", quantization=None, **vars(model)), cache_config=SimpleNamespace(block_size=16, cache_dtype="auto")),
        None, "LBHNC",
    )  # fmt: skip
    assert commit in identity and "main" not in identity, identity

    asked.clear()
    answers[:] = [None, OSError("injected: the cache is being written")]
    assert connector_module._read_checkpoint_config(model) == {"rope_theta": 5e5}, "not read again after a failure"
    assert len(asked) == 3
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    for failure in ([nested] * 3, [tmp_path] * 3, [RecursionError("injected")] * 3):
        answers[:] = failure
        started = time.monotonic()
        assert connector_module._read_checkpoint_config(model) is None
        assert time.monotonic() - started < 1.0


def test_lookups_after_a_timeout_reconnect_and_back_off(tuttid):
    """Goal: a lookup that times out (tuttid stalled) is a miss after lookup_timeout_s; the
    connection it leaves out of step is dropped; the timeout starts a back-off during which
    lookups are misses at once (no timeout per request); once tuttid answers again, the next
    lookup after the back-off reconnects and is answered."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    extra = {"socket": daemon.socket, "timeout_s": 20.0, "lookup_timeout_s": 0.5}
    scheduler = harness.make_connector(harness.vllm_config(daemon.socket, 1, extra=extra), KVConnectorRole.SCHEDULER)
    request = harness.request("T", prompt(6, blocks=2, tail=1))
    try:
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        daemon.pause()
        try:
            started = time.monotonic()
            assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
            assert 0.4 < time.monotonic() - started < 5.0, "bounded by lookup_timeout_s"
            # The lookup that timed out started the back-off: the next ones are misses at once.
            assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
            started = time.monotonic()
            for _ in range(5):
                assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
            assert time.monotonic() - started < 0.3, "lookups during the back-off wait for nothing"
            assert scheduler.lookup_failures == 7
        finally:
            daemon.resume()
        time.sleep(1.2)  # past the first back-off
        reconnects = scheduler.lookup_reconnects
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        assert scheduler.lookup_failures == 7, "answered by tuttid"
        assert scheduler.lookup_reconnects == reconnects + 1
    finally:
        scheduler.shutdown()


def test_lookups_that_time_out_on_a_daemon_that_still_connects_back_off(monkeypatch):
    """Goal: a tuttid that accepts connections but does not answer lookups in time costs the
    scheduler's loop one lookup_timeout_s per back-off, not one per request: a lookup that timed
    out starts the back-off (1 s, doubling while lookups keep timing out, reset by an answered
    lookup), during which lookups are misses without a word to tuttid. Before, only a failed
    connect started it, and a connect that succeeded reset it, so every new request waited
    lookup_timeout_s. The lookup session and the clock are stand-ins (no tuttid can be told to
    answer connects but not lookups)."""
    from types import SimpleNamespace

    from tutti.vllm import _scheduler

    class Session:
        def __init__(self, answer):
            self.answer = answer

        def lookup_all_ranks(self, tokens, first_block=0):
            lookups.append(clock.now)
            if self.answer is None:
                raise tutti.TimeoutError("injected: tuttid did not answer the lookup in time")
            return self.answer

        def close(self):
            pass

    lookups: list = []
    connects: list = []
    answer: list = [None]

    def connect(self):
        connects.append(clock.now)
        return Session(answer[0])

    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(_scheduler, "time", SimpleNamespace(monotonic=lambda: clock.now))
    monkeypatch.setattr(_scheduler.SchedulerSide, "_connect_lookup", connect)
    scheduler = harness.make_connector(harness.vllm_config("/nonexistent/tuttid.sock", 1), KVConnectorRole.SCHEDULER)
    tokens = prompt(80, blocks=3, tail=1)

    def matched(at: float) -> int:
        clock.now = at
        request = harness.request(f"R{at}", tokens)
        tokens_matched, asynchronous = scheduler.get_num_new_matched_tokens(request, 0)
        assert asynchronous is False
        return tokens_matched

    assert matched(100.0) == 0 and lookups == [100.0]  # timed out: back-off 1 s
    assert matched(100.5) == 0 and lookups == [100.0], "a lookup during the back-off asked tuttid"
    assert matched(101.1) == 0 and lookups == [100.0, 101.1]  # again: back-off 2 s
    assert matched(102.5) == 0 and lookups == [100.0, 101.1]
    assert matched(103.2) == 0 and lookups == [100.0, 101.1, 103.2]  # back-off 4 s
    assert matched(107.0) == 0 and len(lookups) == 3
    answer[0] = 2
    assert matched(107.3) == 2 * harness.BLOCK_TOKENS and len(lookups) == 4
    answer[0] = None
    scheduler._lookup.answer = None
    assert matched(108.0) == 0 and len(lookups) == 5  # back-off reset by the answer: 1 s
    assert matched(108.9) == 0 and len(lookups) == 5
    assert matched(109.1) == 0 and len(lookups) == 6
    assert scheduler.lookup_failures == 9
    assert len(connects) == 1 + 4  # at start, then once after each back-off
    scheduler.shutdown()


def test_lookups_lost_twice_in_a_row_back_off(monkeypatch):
    """Goal: a lookup whose session is lost (Disconnected) is asked again at once on a new
    session, once; lost again, the back-off starts, so a daemon that keeps breaking its lookup
    sessions (a reply that does not decode is Disconnected since dba9cb3) costs two connects per
    back-off, not two per request. The lookup session and the clock are stand-ins."""
    from types import SimpleNamespace

    from tutti.vllm import _scheduler

    class Session:
        def lookup_all_ranks(self, tokens, first_block=0):
            lookups.append(clock.now)
            raise tutti.Disconnected("injected: tuttid's reply does not decode")

        def close(self):
            pass

    lookups: list = []
    connects: list = []

    def connect(self):
        connects.append(clock.now)
        return Session()

    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(_scheduler, "time", SimpleNamespace(monotonic=lambda: clock.now))
    monkeypatch.setattr(_scheduler.SchedulerSide, "_connect_lookup", connect)
    scheduler = harness.make_connector(harness.vllm_config("/nonexistent/tuttid.sock", 1), KVConnectorRole.SCHEDULER)
    tokens = prompt(81, blocks=3, tail=1)

    def matched(at: float) -> int:
        clock.now = at
        tokens_matched, _ = scheduler.get_num_new_matched_tokens(harness.request(f"R{at}", tokens), 0)
        return tokens_matched

    assert matched(100.0) == 0 and lookups == [100.0, 100.0]  # asked again once, then back-off 1 s
    assert matched(100.5) == 0 and len(lookups) == 2, "a lookup during the back-off asked tuttid"
    assert matched(101.1) == 0 and len(lookups) == 4  # back-off 2 s
    assert matched(102.0) == 0 and len(lookups) == 4
    assert len(connects) == 1 + 3  # at start, the retry, then after the back-off and its retry
    scheduler.shutdown()


def test_a_daemon_exchange_that_times_out_ends_the_worker_session(tuttid):
    """Goal: a worker whose tuttid exchange timed out (its connection out of step) ends its
    session (tuttid frees what it held) instead of sending more requests on it; later steps
    report their loads failed and skip their saves, at once."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket, timeout_s=0.5)
    try:
        assert len(worker_sessions(daemon.socket)) == 1
        tokens = prompt(13, blocks=2, tail=0)
        daemon.pause()
        try:
            result = worker.step(TuttiConnectorMetadata(saves=[SaveSpec("X", tokens, [1, 2])]))
        finally:
            daemon.resume()
        assert result["load_errors"] == set()
        assert worker.connector.get_finished({"X"})[0] == {"X"}, "a save that did not start is over at once"
        wait_no_worker_session(daemon.socket)
        assert worker.connector._dead is not None
        started = time.monotonic()
        result = worker.step(
            TuttiConnectorMetadata(loads=[LoadSpec("Y", tokens, [5, 6])], saves=[SaveSpec("Z", tokens, [7, 8])])
        )
        assert time.monotonic() - started < 0.3
        assert result["load_errors"] == {5, 6}
        assert worker.connector.get_finished({"Z"})[0] == {"Z"}
    finally:
        worker.shutdown()


def test_a_load_whose_layer_does_not_complete_ends_the_session_before_its_blocks_are_reported(tuttid):
    """Goal: a load whose layer does not complete (tuttid stalled) is not reported to vLLM while
    tuttid may still write its blocks: the worker ends its session and waits until tuttid dropped
    it (queue pairs deleted); only then are the blocks reported, and nothing writes them after."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket, timeout_s=0.5)
    try:
        tokens = prompt(11, blocks=2, tail=0)
        worker.fill([1, 2], 11)
        worker.save("S", tokens, [1, 2])
        connector = worker.connector
        meta = TuttiConnectorMetadata(loads=[LoadSpec("L", tokens, [20, 21])])
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)  # layers 0 and 1 issued
        daemon.pause()
        resumer = threading.Timer(2.0, daemon.resume)  # later than the step gives up on the layer
        resumer.start()
        try:
            for name in harness.layer_names():  # layers 2 and 3 are issued while tuttid is stalled
                connector.wait_for_layer_load(name)
            connector.wait_for_save()
            errors = connector.get_block_ids_with_load_errors()
            connector.clear_connector_metadata()
            # What vLLM does with reported blocks: computes them again (here: zeroes).
            for part in worker.blocks_bytes([20, 21]):
                part.zero_()
        finally:
            resumer.join()
            daemon.resume()
        assert errors == {20, 21}
        time.sleep(0.5)
        assert all(int(part.count_nonzero()) == 0 for part in worker.blocks_bytes([20, 21])), "written after they were reported"
        assert worker_sessions(daemon.socket) == []
        assert connector._store.leaked_registrations() == 0
    finally:
        worker.shutdown()


def test_a_load_whose_layer_never_completes_stops_the_worker(tuttid):
    """Goal: when tuttid cannot confirm that the session ended (stalled past the wait), the worker
    raises rather than hand back blocks tuttid may still write; the memory is kept for good."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket, timeout_s=0.5)
    try:
        tokens = prompt(14, blocks=2, tail=0)
        worker.fill([1, 2], 14)
        worker.save("S", tokens, [1, 2])
        connector = worker.connector
        meta = TuttiConnectorMetadata(loads=[LoadSpec("L", tokens, [20, 21])])
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)
        daemon.pause()
        try:
            with pytest.raises(KvMemoryUnsafe, match="may still be written"):
                for name in harness.layer_names():
                    connector.wait_for_layer_load(name)
            assert connector.get_block_ids_with_load_errors() == set(), "blocks tuttid may write were reported"
        finally:
            daemon.resume()
        assert connector._store.leaked_registrations() > 0
    finally:
        worker.shutdown()


@contextlib.contextmanager
def saves_stuck_at_the_committer(daemon, worker: "LocalWorker", saves: list[SaveSpec]):
    """One step of `worker` saving `saves` (their blocks filled): each save's layer 0 completes,
    then tuttid is stalled (SIGSTOP), layers 1.. are issued and wait_for_save hands the saves to
    the committer, where their layers stay stuck. The body runs with tuttid stalled; it is
    resumed on exit."""
    connector = worker.connector
    names = harness.layer_names()
    meta = TuttiConnectorMetadata(saves=list(saves))
    connector.handle_preemptions(meta)
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)  # (as in a step with synchronous loads)
    connector.wait_for_layer_load(names[0])
    connector.save_kv_layer(names[0], worker.caches[names[0]], None)
    deadline = time.monotonic() + FINISH_TIMEOUT_S
    for save in saves:  # layer 0 of every save complete before tuttid stalls
        request = connector._saves[save.req_id].request
        while not request.poll():
            assert time.monotonic() < deadline
            time.sleep(0.001)
    daemon.pause()
    try:
        for name in names[1:]:
            connector.wait_for_layer_load(name)
            connector.save_kv_layer(name, worker.caches[name], None)
        connector.wait_for_save()  # to the committer, layers 1..3 stuck
        connector.clear_connector_metadata()
        yield
    finally:
        daemon.resume()


def test_a_preempted_save_that_does_not_settle_is_never_reported(tuttid):
    """Goal: handle_preemptions gives up on a save whose last layer does not complete in time
    (tuttid stalled); the committer's later outcome for it is ignored: get_finished never names
    the preempted request (vLLM would free a running request's blocks), and it is not committed."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    # Every layer in flight at once: the committer gets the save with layers 1..3 stuck.
    worker = LocalWorker(daemon.socket, timeout_s=0.5, layers_in_flight=harness.LAYERS)
    try:
        tokens = prompt(12, blocks=2, tail=0)
        worker.fill([3, 4], 12)
        connector = worker.connector
        with saves_stuck_at_the_committer(daemon, worker, [SaveSpec("P", tokens, [3, 4])]):
            connector.handle_preemptions(TuttiConnectorMetadata(preempted_req_ids={"P"}))
        time.sleep(2.0)  # the committer's outcome for P arrives
        assert connector.get_finished({"P"}) == (None, None)
        with tutti.LookupClient.connect(daemon.socket, model_fingerprint=connector._fingerprint) as lookup:
            assert lookup.lookup(tokens) == 0, "a save given up at preemption was committed"
    finally:
        worker.shutdown()


def test_preempted_saves_that_do_not_settle_are_given_up_within_one_timeout(tuttid):
    """Goal: handle_preemptions bounds all of its waits together by one timeout_s, not each
    preempted request's by its own: four saves stuck at the committer (tuttid stalled) are given
    up in about one timeout, none committed (four timeouts one after another before)."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    timeout_s = 0.5
    worker = LocalWorker(daemon.socket, timeout_s=timeout_s, layers_in_flight=harness.LAYERS)
    try:
        saves = []
        for index in range(4):
            tokens = prompt(40 + index, blocks=2, tail=0)
            blocks = [10 + 2 * index, 11 + 2 * index]
            worker.fill(blocks, 40 + index)
            saves.append(SaveSpec(f"P{index}", tokens, blocks))
        connector = worker.connector
        with saves_stuck_at_the_committer(daemon, worker, saves):
            started = time.monotonic()
            connector.handle_preemptions(TuttiConnectorMetadata(preempted_req_ids={save.req_id for save in saves}))
            elapsed_s = time.monotonic() - started
        assert elapsed_s < 2.5 * timeout_s, f"handle_preemptions took {elapsed_s:.2f} s for four stuck saves"
        time.sleep(3.0)  # the committer's outcomes arrive
        ids = {save.req_id for save in saves}
        assert connector.get_finished(ids) == (None, None)
        with tutti.LookupClient.connect(daemon.socket, model_fingerprint=connector._fingerprint) as lookup:
            for save in saves:
                assert lookup.lookup(save.tokens) == 0, f"{save.req_id}, given up at preemption, was committed"
    finally:
        worker.shutdown()


class SlowFirstCommit:
    """A tutti.Request whose commit first sets `started`, then sleeps `sleep_s` (a commit whose
    flush and header writes take long); the rest is the real request's."""

    def __init__(self, request, started: threading.Event, sleep_s: float) -> None:
        self._request = request
        self._started = started
        self._sleep_s = sleep_s

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def commit(self):
        self._started.set()
        time.sleep(self._sleep_s)
        return self._request.commit()


class StoreWithSlowFirstCommit:
    """A store whose first prepared save commits slowly (SlowFirstCommit); every prepared save's
    request is kept in `requests` by its block ids."""

    def __init__(self, store, sleep_s: float) -> None:
        self._store = store
        self._sleep_s = sleep_s
        self.commit_started = threading.Event()
        self.requests: dict = {}

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def prepare_store(self, tokens, block_ids):
        request = self._store.prepare_store(tokens, block_ids)
        self.requests[tuple(block_ids)] = request
        if len(self.requests) == 1:
            return SlowFirstCommit(request, self.commit_started, self._sleep_s)
        return request


def saves_a_and_r(worker, first_prompt: int) -> list:
    """Saves A and R of prompts `first_prompt` and `first_prompt` + 1, two blocks each (20-21
    and 22-23), their blocks filled: the SaveSpecs, not yet stepped."""
    saves = []
    for index, name in enumerate(["A", "R"]):
        blocks = [20 + 2 * index, 21 + 2 * index]
        worker.fill(blocks, first_prompt + index)
        saves.append(SaveSpec(name, prompt(first_prompt + index, blocks=2, tail=0), blocks))
    return saves


def step_until_r_waits_behind_a(worker, store, saves) -> None:
    """Steps saves [A, R] through `store` (whose first commit is slow) and waits until A's
    commit started and R's layers are all done: R then waits behind A's commit."""
    worker.step(TuttiConnectorMetadata(saves=saves))
    assert store.commit_started.wait(FINISH_TIMEOUT_S), "A's commit never started"
    r_request = store.requests[tuple(saves[1].block_ids)]
    deadline = time.monotonic() + FINISH_TIMEOUT_S
    while not r_request.poll():  # R's reads all done; it waits behind A's commit
        assert time.monotonic() < deadline, "R's layers never completed"
        time.sleep(0.001)


def test_a_preempted_save_whose_reads_are_done_is_neither_held_up_by_other_commits_nor_cancelled(tuttid):
    """Goal: handle_preemptions waits for a preempted save's layers in flight, the reads of vLLM's
    blocks, not for the committer's backlog: a save R handed to the committer behind another
    save A whose commit takes 0.8 x timeout_s, R's layers all complete, is committed at once by
    handle_preemptions itself (not cancelled), before vLLM reuses its blocks. Committed, not
    merely left to the committer: a pool that records payload CRCs computes them at the commit
    from vLLM's blocks, so a commit after their reuse would record the CRCs of other bytes and
    every verified load of R would fail. Before, handle_preemptions waited until the committer
    had committed A and then R, about 0.8 x timeout_s, and cancelled R (never committed) when
    that backlog took longer than timeout_s."""
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--payload-crc"])
    timeout_s = 2.0
    worker = LocalWorker(daemon.socket, timeout_s=timeout_s, verify_retrieves=True)
    try:
        connector = worker.connector
        real = connector._store
        store = StoreWithSlowFirstCommit(real, 0.8 * timeout_s)
        connector._store = store
        saves = saves_a_and_r(worker, 60)
        r_bytes = [block.clone() for block in worker.blocks_bytes(saves[1].block_ids)]
        step_until_r_waits_behind_a(worker, store, saves)
        started = time.monotonic()
        connector.handle_preemptions(TuttiConnectorMetadata(preempted_req_ids={"R"}))
        elapsed_s = time.monotonic() - started
        worker.fill(saves[1].block_ids, 99)  # vLLM reuses R's blocks
        assert elapsed_s < 0.3 * timeout_s, f"handle_preemptions took {elapsed_s:.2f} s for a save whose reads were done"
        wait_reported(worker, "A", connector.get_finished({"A"})[0] or set())
        with tutti.LookupClient.connect(daemon.socket, model_fingerprint=connector._fingerprint) as lookup:
            deadline = time.monotonic() + FINISH_TIMEOUT_S
            while lookup.lookup(saves[1].tokens) != 2:
                assert time.monotonic() < deadline, "R, its reads done at its preemption, was never committed"
                time.sleep(0.01)
            assert lookup.lookup(saves[0].tokens) == 2
        assert connector._cancelled == set()
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while connector._taken_over:  # the committer skips R's save when it comes to it
            assert time.monotonic() < deadline, "the committer never came to R's save"
            time.sleep(0.01)
        assert connector._committing == {}
        assert connector.get_finished({"R"}) == (None, None), "a preempted save is forgotten, never reported"
        result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("L", saves[1].tokens, [40, 41])]))
        assert result["load_errors"] == set(), "R's verified load failed: its CRCs were not those of its bytes"
        assert all(torch.equal(got, want) for got, want in zip(worker.blocks_bytes([40, 41]), r_bytes))
    finally:
        worker.shutdown()


def test_a_preempted_save_the_committer_is_committing_is_waited_for(tuttid):
    """Goal: a preempted save whose commit the committer has begun (it took the save up: it can
    no longer be taken over nor cancelled) is waited for, not left running: the commit computes
    the pool's payload CRCs from vLLM's blocks, so vLLM must not reuse them before it is over.
    Its commit takes 0.5 x timeout_s; handle_preemptions returns after it, R committed, and a
    verified load of R finds its CRCs right although R's blocks were rewritten at once after."""
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--payload-crc"])
    timeout_s = 2.0
    worker = LocalWorker(daemon.socket, timeout_s=timeout_s, verify_retrieves=True)
    try:
        connector = worker.connector
        store = StoreWithSlowFirstCommit(connector._store, 0.5 * timeout_s)
        connector._store = store
        save = SaveSpec("R", prompt(70, blocks=2, tail=0), [20, 21])
        worker.fill(save.block_ids, 70)
        r_bytes = [block.clone() for block in worker.blocks_bytes(save.block_ids)]
        worker.step(TuttiConnectorMetadata(saves=[save]))
        assert store.commit_started.wait(FINISH_TIMEOUT_S), "R's commit never started"
        started = time.monotonic()
        connector.handle_preemptions(TuttiConnectorMetadata(preempted_req_ids={"R"}))
        elapsed_s = time.monotonic() - started
        worker.fill(save.block_ids, 99)  # vLLM reuses R's blocks
        assert elapsed_s < timeout_s, f"handle_preemptions took {elapsed_s:.2f} s"
        with tutti.LookupClient.connect(daemon.socket, model_fingerprint=connector._fingerprint) as lookup:
            assert lookup.lookup(save.tokens) == 2, "R's commit was not over when handle_preemptions returned"
        assert connector._cancelled == set()
        result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("L", save.tokens, [40, 41])]))
        assert result["load_errors"] == set(), "R's verified load failed: its CRCs were not those of its bytes"
        assert all(torch.equal(got, want) for got, want in zip(worker.blocks_bytes([40, 41]), r_bytes))
    finally:
        worker.shutdown()


def test_a_preempted_save_the_committer_is_committing_past_the_deadline_is_waited_for(tuttid):
    """Goal: a preempted save whose commit the committer has begun, but which has not yet read
    vLLM's blocks for the payload CRCs by the preemption's deadline (its commit waits for the
    store's lock or connection: here a commit that starts 1.5 x timeout_s late), is waited for
    past that deadline, not cancelled: the committer has passed its cancel check, so a
    cancellation came too late and the commit ran after handle_preemptions returned, with the
    CRCs of the blocks' next contents (every verified load of R failed). R is committed when
    handle_preemptions returns, and a verified load of R finds its CRCs right although R's
    blocks were rewritten at once after."""
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--payload-crc"])
    timeout_s = 1.0
    worker = LocalWorker(daemon.socket, timeout_s=timeout_s, verify_retrieves=True)
    try:
        connector = worker.connector
        store = StoreWithSlowFirstCommit(connector._store, 1.5 * timeout_s)
        connector._store = store
        save = SaveSpec("R", prompt(75, blocks=2, tail=0), [20, 21])
        worker.fill(save.block_ids, 75)
        r_bytes = [block.clone() for block in worker.blocks_bytes(save.block_ids)]
        worker.step(TuttiConnectorMetadata(saves=[save]))
        assert store.commit_started.wait(FINISH_TIMEOUT_S), "R's commit never started"
        connector.handle_preemptions(TuttiConnectorMetadata(preempted_req_ids={"R"}))
        with tutti.LookupClient.connect(daemon.socket, model_fingerprint=connector._fingerprint) as lookup:
            committed = lookup.lookup(save.tokens)
        worker.fill(save.block_ids, 99)  # vLLM reuses R's blocks
        assert committed == 2, "R's commit was not over when handle_preemptions returned"
        assert connector._cancelled == set() and connector._dead is None
        result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("L", save.tokens, [40, 41])]))
        assert result["load_errors"] == set(), "R's verified load failed: its CRCs were not those of its bytes"
        assert all(torch.equal(got, want) for got, want in zip(worker.blocks_bytes([40, 41]), r_bytes))
    finally:
        worker.shutdown()


def test_a_preempted_save_whose_commit_outlasts_its_own_bounds_ends_the_session(tuttid, monkeypatch):
    """Goal: the wait past the deadline for a save the committer is committing is bounded too:
    the commit's own bounds (the store's lock, the keep-alive ping's connection, its exchange)
    and a margin. A commit that outlasts even that (here one that starts 10 x timeout_s late, past
    the deadline's timeout_s and 4 x timeout_s + 1 s, the margin taken away) ends the session,
    whose close takes the store's lock, so the commit can no longer read vLLM's blocks after
    handle_preemptions returned: R is never committed. Before, the save was cancelled too late
    at the deadline and committed after."""
    from tutti.vllm import _worker

    monkeypatch.setattr(_worker, "_COMMIT_WAIT_MARGIN_S", 0.0)
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--payload-crc"])
    timeout_s = 0.5
    worker = LocalWorker(daemon.socket, timeout_s=timeout_s)
    try:
        connector = worker.connector
        store = StoreWithSlowFirstCommit(connector._store, 10 * timeout_s)
        connector._store = store
        save = SaveSpec("R", prompt(76, blocks=2, tail=0), [20, 21])
        worker.fill(save.block_ids, 76)
        worker.step(TuttiConnectorMetadata(saves=[save]))
        assert store.commit_started.wait(FINISH_TIMEOUT_S), "R's commit never started"
        started = time.monotonic()
        connector.handle_preemptions(TuttiConnectorMetadata(preempted_req_ids={"R"}))
        elapsed_s = time.monotonic() - started
        assert connector._dead is not None, "the session outlived a commit past its bounds"
        assert elapsed_s < 10 * timeout_s, f"handle_preemptions took {elapsed_s:.2f} s"
        time.sleep(6 * timeout_s)  # the late commit's turn: it finds the store closed
        with tutti.LookupClient.connect(daemon.socket, model_fingerprint=connector._fingerprint) as lookup:
            assert lookup.lookup(save.tokens) == 0, "R was committed after handle_preemptions returned"
    finally:
        worker.shutdown()


def test_a_committed_save_is_waited_for_until_settled_never_logged_as_cancelled(tuttid, monkeypatch, caplog):
    """Goal: the committer's mark on a save it commits is kept until the save is settled, not
    cleared as the commit returns: handle_preemptions, past its deadline, must not see the save
    unmarked and unsettled in between, and cancel it and log at ERROR that it was cancelled
    although it was committed. Here the committer records R's outcome 0.3 s after R's commit,
    which starts 1.5 x timeout_s late, returned: handle_preemptions waits for it, logs no
    cancellation, and R is committed. Before, the mark was cleared first and R was logged as
    cancelled."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    timeout_s = 1.0
    worker = LocalWorker(daemon.socket, timeout_s=timeout_s)
    try:
        connector = worker.connector
        store = StoreWithSlowFirstCommit(connector._store, 1.5 * timeout_s)
        connector._store = store
        save_settled = connector._save_settled

        def late_save_settled(req_id, token, committed):
            if req_id == "R":
                time.sleep(0.3)  # R's commit has returned; its outcome is not yet recorded
            save_settled(req_id, token, committed)

        monkeypatch.setattr(connector, "_save_settled", late_save_settled)
        save = SaveSpec("R", prompt(77, blocks=2, tail=0), [20, 21])
        worker.fill(save.block_ids, 77)
        worker.step(TuttiConnectorMetadata(saves=[save]))
        assert store.commit_started.wait(FINISH_TIMEOUT_S), "R's commit never started"
        caplog.set_level(logging.ERROR, logger="tutti.vllm")
        connector.handle_preemptions(TuttiConnectorMetadata(preempted_req_ids={"R"}))
        cancelled = [record.getMessage() for record in caplog.records if "cancelled" in record.getMessage()]
        assert cancelled == [], f"a committed save was logged as cancelled: {cancelled}"
        assert connector._dead is None and connector._committing_now is None
        with tutti.LookupClient.connect(daemon.socket, model_fingerprint=connector._fingerprint) as lookup:
            assert lookup.lookup(save.tokens) == 2
    finally:
        worker.shutdown()


class SlowFinish:
    """A tutti.Request whose finish first sleeps `sleep_s` (tuttid answering just within
    timeout_s); the rest is the real request's."""

    def __init__(self, request, sleep_s: float) -> None:
        self._request = request
        self._sleep_s = sleep_s

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def finish(self):
        time.sleep(self._sleep_s)
        return self._request.finish()


class StoreWithSlowFirstCommitAndSlowLoadFinishes(StoreWithSlowFirstCommit):
    """As StoreWithSlowFirstCommit, and every prepared load's finish is slow (SlowFinish)."""

    def __init__(self, store, sleep_s: float, finish_s: float) -> None:
        super().__init__(store, sleep_s)
        self._finish_s = finish_s

    def prepare_retrieve(self, *args, **kwargs):
        return SlowFinish(self._store.prepare_retrieve(*args, **kwargs), self._finish_s)


def test_a_marked_commit_is_waited_for_from_when_handle_preemptions_comes_to_it(tuttid, monkeypatch):
    """Goal: the wait for a save whose commit the committer has begun is counted from when
    handle_preemptions comes to that save, not from its shared deadline: until then its own
    exchanges for the requests preempted before it (each just within timeout_s with a slow
    tuttid, which keeps the session) may hold the store's lock the commit waits for. Here nine
    loads preempted before R each take 0.9 x timeout_s to finish, and R's commit ends 0.6 s
    after them; R is committed and the session kept. Before, the bound was 3 x timeout_s + 1 s
    after the deadline whatever came first, so the session was ended as soon as
    handle_preemptions reached R."""
    from tutti.vllm import _worker

    monkeypatch.setattr(_worker, "_COMMIT_WAIT_MARGIN_S", 0.0)
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    timeout_s = 0.5
    loads = 9
    finish_s = 0.9 * timeout_s
    worker = LocalWorker(daemon.socket, timeout_s=timeout_s)
    try:
        connector = worker.connector
        tokens = prompt(85, blocks=2, tail=0)
        worker.fill([1, 2], 85)
        worker.save("S", tokens, [1, 2])
        store = StoreWithSlowFirstCommitAndSlowLoadFinishes(connector._store, loads * finish_s + 0.6, finish_s)
        connector._store = store
        save = SaveSpec("R", prompt(86, blocks=2, tail=0), [20, 21])
        worker.fill(save.block_ids, 86)
        worker.step(TuttiConnectorMetadata(saves=[save]))
        assert store.commit_started.wait(FINISH_TIMEOUT_S), "R's commit never started"
        names = [f"X{index}" for index in range(loads)]
        meta = TuttiConnectorMetadata(loads=[LoadSpec(name, tokens, [40 + 2 * i, 41 + 2 * i]) for i, name in enumerate(names)])
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)  # the loads' first layers issued
        assert all(name in connector._loads for name in names)
        connector.handle_preemptions(TuttiConnectorMetadata(preempted_req_ids=[*names, "R"]))  # R last
        assert connector._dead is None, "the session was ended while R's commit was within its bounds"
        with tutti.LookupClient.connect(daemon.socket, model_fingerprint=connector._fingerprint) as lookup:
            assert lookup.lookup(save.tokens) == 2, "R's commit was not over when handle_preemptions returned"
        for name in harness.layer_names():
            connector.wait_for_layer_load(name)
        connector.wait_for_save()
        connector.clear_connector_metadata()
    finally:
        worker.shutdown()


class StoreWithSlowFirstThenRaisingCommits(StoreWithSlowFirstCommit):
    """As StoreWithSlowFirstCommit, and the second prepared save's commit raises `error`."""

    def __init__(self, store, sleep_s: float, error: BaseException) -> None:
        super().__init__(store, sleep_s)
        self._error = error

    def prepare_store(self, tokens, block_ids):
        request = super().prepare_store(tokens, block_ids)
        if len(self.requests) == 2:
            return CommitRaising(request, self._error)
        return request


def load_behind_a_slow_commit(worker, seed: int, wrap_store) -> list:
    """The scene of the taken-over-save tests: prompt `seed` saved as S; the connector's store
    wrapped by `wrap_store` (whose first commit is slow); saves A and R of prompts seed + 1 and
    seed + 2 stepped, A's commit started and R's layers all done (R waits behind A's commit);
    then a load L of prompt `seed` bound and its first layers issued. Returns [A, R]'s SaveSpecs."""
    connector = worker.connector
    tokens = prompt(seed, blocks=2, tail=0)
    worker.fill([1, 2], seed)
    worker.save("S", tokens, [1, 2])
    store = wrap_store(connector._store)
    connector._store = store
    saves = saves_a_and_r(worker, seed + 1)
    step_until_r_waits_behind_a(worker, store, saves)
    connector.bind_connector_metadata(TuttiConnectorMetadata(loads=[LoadSpec("L", tokens, [40, 41])]))
    connector.start_load_kv(None)  # L's first layers issued
    assert "L" in connector._loads
    return saves


@pytest.mark.parametrize("error", [RuntimeError("injected"), SystemExit(3)], ids=["RuntimeError", "SystemExit"])
def test_a_taken_over_commit_that_raises_leaves_no_other_preempted_request_unsettled(tuttid, error):
    """Goal: whatever escapes the commit of a save handle_preemptions took over (a panic of the
    binding is a BaseException) makes that save a miss, as in the committer, and the other
    requests preempted with it are still settled before vLLM reuses their blocks: here a load L
    in flight, preempted after R. KeyboardInterrupt and SystemExit are raised again, but only
    once every preempted request is handled. Before, the exception left handle_preemptions at
    R, and L's load (layers in flight, writing vLLM's blocks) was never settled."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    timeout_s = 2.0
    worker = LocalWorker(daemon.socket, timeout_s=timeout_s)
    try:
        connector = worker.connector
        saves = load_behind_a_slow_commit(
            worker, 80, lambda store: StoreWithSlowFirstThenRaisingCommits(store, 1.5 * timeout_s, error)
        )
        preempted = TuttiConnectorMetadata(preempted_req_ids=["R", "L"])  # R first (a list: ordered)
        if isinstance(error, SystemExit):
            with pytest.raises(SystemExit):
                connector.handle_preemptions(preempted)
        else:
            connector.handle_preemptions(preempted)
        assert "L" not in connector._loads, "L's load was not settled"
        assert "R" not in connector._save_token and "L" not in connector._save_token
        assert connector._dead is None
        for name in harness.layer_names():
            connector.wait_for_layer_load(name)
        connector.wait_for_save()
        connector.clear_connector_metadata()
        wait_reported(worker, "A", connector.get_finished({"A"})[0] or set())
        assert connector._store.lookup(saves[1].tokens) == 0, "R's failed commit counted as committed"
    finally:
        worker.shutdown()


class CommitAndFinishRaising:
    """A tutti.Request whose commit raises `error` and whose finish raises `finish_error`; the
    rest is the real request's."""

    def __init__(self, request, error: BaseException, finish_error: BaseException) -> None:
        self._request = request
        self._error = error
        self._finish_error = finish_error

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def commit(self):
        raise self._error

    def finish(self):
        raise self._finish_error


class StoreWithSlowFirstThenFailingCommitAndFinish(StoreWithSlowFirstCommit):
    """As StoreWithSlowFirstCommit, and the second prepared save's commit and finish raise."""

    def __init__(self, store, sleep_s: float, error: BaseException, finish_error: BaseException) -> None:
        super().__init__(store, sleep_s)
        self._error = error
        self._finish_error = finish_error

    def prepare_store(self, tokens, block_ids):
        request = super().prepare_store(tokens, block_ids)
        if len(self.requests) == 2:
            return CommitAndFinishRaising(request, self._error, self._finish_error)
        return request


@pytest.mark.parametrize(
    ("error", "finish_error"),
    [
        (tutti.Disconnected("injected: tuttid's reply does not decode"), RuntimeError("injected finish")),
        (RuntimeError("injected"), SystemExit(4)),
    ],
    ids=["tutti-error-then-RuntimeError", "RuntimeError-then-SystemExit"],
)
def test_a_taken_over_save_whose_settle_raises_leaves_no_other_preempted_request_unsettled(tuttid, error, finish_error):
    """Goal: the settle of a taken-over save whose commit failed is guarded whatever the commit
    raised: anything escaping it (a PanicException out of finish, an interrupt during its wait)
    still leaves the other preempted requests settled (here a load L in flight, preempted after
    R), and the first KeyboardInterrupt or SystemExit, of the commit or of the settle, is raised
    once they are. Before, after a tutti.Error from the commit, a RuntimeError out of the settle
    left handle_preemptions at R with L's load unsettled; after a RuntimeError from the commit, a
    SystemExit out of the settle was swallowed."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    timeout_s = 2.0
    worker = LocalWorker(daemon.socket, timeout_s=timeout_s)
    try:
        connector = worker.connector
        load_behind_a_slow_commit(
            worker,
            87,
            lambda store: StoreWithSlowFirstThenFailingCommitAndFinish(store, 1.5 * timeout_s, error, finish_error),
        )
        preempted = TuttiConnectorMetadata(preempted_req_ids=["R", "L"])  # R first (a list: ordered)
        if isinstance(finish_error, SystemExit):
            with pytest.raises(SystemExit):
                connector.handle_preemptions(preempted)
        else:
            connector.handle_preemptions(preempted)
        assert "L" not in connector._loads, "L's load was not settled"
        assert "R" not in connector._save_token and "L" not in connector._save_token
        assert connector._broken is not None, "R's save, never settled, left the session to go on"
    finally:
        worker.shutdown()


class LayerOneInFlight:
    """A save's request whose layer 1 stays in flight (what handle_preemptions polls)."""

    layer_in_flight = 1

    def poll(self):
        return False


class SettleOnGiveUp(logging.Handler):
    """Settles the save `token` of `req_id` (as the committer does when it is done with it) at
    the moment handle_preemptions logs that it gives the save up: the race between that
    give-up and the committer."""

    def __init__(self, connector, req_id: str, token: int) -> None:
        super().__init__(logging.ERROR)
        self._connector = connector
        self._req_id = req_id
        self._token = token
        self.fired = False

    def emit(self, record: logging.LogRecord) -> None:
        if "preempted request" in record.getMessage():
            self.fired = True
            self._connector._save_settled(self._req_id, self._token, False)


def test_a_save_the_committer_settles_as_its_preemption_gives_up_on_it_leaves_no_cancelled_token(tuttid):
    """Goal: a preempted save that the committer settles just after handle_preemptions gave up
    waiting for it (its layer in flight at the deadline) is not marked cancelled after the
    committer's settle, which is what clears the mark: before, the token was added to the
    cancelled set unconditionally and stayed there for good (one leaked token per such race)."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket, timeout_s=0.2)
    connector = worker.connector
    token = 1_000_000  # not one of the connector's own
    handler = SettleOnGiveUp(connector, "P", token)
    log = logging.getLogger("tutti.vllm")
    log.addHandler(handler)
    try:
        with connector._lock:  # a save of P's with the committer, layer 1 in flight
            connector._save_token["P"] = token
            connector._save_done["P"] = None
            connector._committing[token] = (LayerOneInFlight(), connector._session)
        connector.handle_preemptions(TuttiConnectorMetadata(preempted_req_ids={"P"}))
        assert handler.fired, "handle_preemptions did not give the save up"
        assert token not in connector._cancelled, "the token of a save already settled stays cancelled for good"
        assert token not in connector._committing
    finally:
        log.removeHandler(handler)
        worker.shutdown()


def test_loads_and_saves_that_fail_to_issue_do_not_fail_the_step_or_leak(tuttid):
    """Goal: a load whose layer 0 raises at issue is reported failed per block (start_load_kv
    returns normally) and its prepared request is finished, as is a save's: more such failures
    than requests_max, then a load and a save that work."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket, requests_max=4)
    try:
        tokens = prompt(15, blocks=2, tail=0)
        worker.fill([1, 2], 15)
        worker.save("S", tokens, [1, 2])
        wrapped = harness.StoreWithFailingIssues(worker.connector._store)
        worker.connector._store = wrapped
        for round_ in range(6):
            other = prompt(100 + round_, blocks=2, tail=0)
            result = worker.step(
                TuttiConnectorMetadata(
                    loads=[LoadSpec(f"L{round_}", tokens, [20, 21])], saves=[SaveSpec(f"W{round_}", other, [30, 31])]
                )
            )
            assert result["load_errors"] == {20, 21}
            assert worker.connector.get_finished({f"W{round_}"})[0] == {f"W{round_}"}
        wrapped.failing = False
        for part in worker.blocks_bytes([20, 21]):
            part.zero_()
        result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("G", tokens, [20, 21])]))
        assert result["load_errors"] == set()
        assert any(int(part.count_nonzero()) for part in worker.blocks_bytes([20, 21]))
    finally:
        worker.shutdown()


class StoreWithFailingLoadsAndStalledSaves:
    """A tutti.Store whose loads fail when waited for and whose saves stall."""

    def __init__(self, store, calls: list) -> None:
        self._store = store
        self._calls = calls
        self._saves = 0

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def prepare_retrieve(self, tokens, block_ids, first_block=0):
        return harness.FailingWait(self._store.prepare_retrieve(tokens, block_ids, first_block=first_block))

    def prepare_store(self, tokens, block_ids):
        self._saves += 1
        return SleepingStall(self._store.prepare_store(tokens, block_ids), self._calls, self._saves)


def test_saves_cancelled_for_a_failed_load_wait_for_a_stalled_device_once(tuttid):
    """Goal: saves cancelled because they share blocks whose load failed (_agree_on_loads), their
    layers stalled, do not each wait timeout_s for their layer: the first that does not settle
    breaks the session, and the others are given up without a wait (settled when the session
    ends); all are reported as misses."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    # Every layer of a save issued during the forward without a wait: the stall is first met when
    # the saves are cancelled.
    worker = LocalWorker(daemon.socket, timeout_s=0.5, layers_in_flight=harness.LAYERS)
    try:
        tokens = prompt(19, blocks=2, tail=0)
        worker.fill([1, 2], 19)
        worker.save("S", tokens, [1, 2])
        calls: list = []
        worker.connector._store = StoreWithFailingLoadsAndStalledSaves(worker.connector._store, calls)
        saves = [SaveSpec(f"W{index}", prompt(120 + index, blocks=2, tail=0), [20, 30 + index]) for index in range(4)]
        result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("L", tokens, [20, 21])], saves=saves))
        assert result["load_errors"] == {20, 21}
        waits = [number for what, number in calls if what == "wait"]
        assert len(waits) == 1, f"the cancelled saves waited {len(waits)} times for their stalled layers"
        # The saves after the first are given up because the session broke, not because the
        # shared deadline ran out (which would still poll each of them once): none is waited
        # for or polled.
        looked_at = sorted({number for _, number in calls})
        assert looked_at == waits, f"saves {looked_at} were waited for or polled after save {waits[0]} broke the session: {calls}"
        names = {save.req_id for save in saves}
        assert worker.connector.get_finished(names)[0] == names
    finally:
        worker.shutdown()


def test_a_steps_saves_do_not_take_the_places_its_loads_need(tuttid):
    """Goal: in a step with loads, the loads are prepared before the saves: saves that would
    take every one of the store's requests_max places are the ones refused (misses), not the
    load, which fills its blocks (reported failed before: recompute, and its save cancelled)."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket, requests_max=2)
    try:
        tokens = prompt(16, blocks=2, tail=0)
        worker.fill([1, 2], 16)
        worker.save("S", tokens, [1, 2])
        expected = [part.clone() for part in worker.blocks_bytes([1, 2])]
        for part in worker.blocks_bytes([20, 21]):
            part.zero_()
        worker.fill([30, 31, 32, 33], 17)
        result = worker.step(
            TuttiConnectorMetadata(
                loads=[LoadSpec("L", tokens, [20, 21])],
                saves=[
                    SaveSpec("W0", prompt(117, blocks=2, tail=0), [30, 31]),
                    SaveSpec("W1", prompt(118, blocks=2, tail=0), [32, 33]),
                ],
            )
        )
        assert result["load_errors"] == set()
        assert all(torch.equal(got, want) for got, want in zip(worker.blocks_bytes([20, 21]), expected))
        # Every save is reported (at least one a miss: the load held a place).
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        pending = {"W0", "W1"}
        while pending:
            pending -= worker.connector.get_finished(set(pending))[0] or set()
            assert time.monotonic() < deadline, f"saves {pending} were never reported"
            time.sleep(0.01)
    finally:
        worker.shutdown()


def test_a_load_failing_in_a_layer_only_the_draft_model_waits_for_is_reported_in_its_step(tuttid):
    """Goal: with speculative decoding vLLM defers wait_for_save past the draft model's forward
    but asks get_block_ids_with_load_errors before it; a load whose failing layer only the draft
    model waits for (the last) is still reported in its own step, not the next one."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    try:
        tokens = prompt(17, blocks=2, tail=0)
        worker.fill([1, 2], 17)
        worker.save("S", tokens, [1, 2])
        connector = worker.connector
        connector._store = harness.StoreWithFailingLoads(connector._store, last_layer_only=True)
        connector.bind_connector_metadata(TuttiConnectorMetadata(loads=[LoadSpec("L", tokens, [20, 21])]))
        connector.start_load_kv(None)
        for name in harness.layer_names()[:-1]:  # the target model's layers
            connector.wait_for_layer_load(name)
            connector.save_kv_layer(name, worker.caches[name], None)
        assert connector.get_block_ids_with_load_errors() == {20, 21}  # (vLLM asks before the drafter)
        connector.wait_for_layer_load(harness.layer_names()[-1])  # the draft model's layer
        connector.wait_for_save()  # finalize_kv_connector
        connector.clear_connector_metadata()
        assert connector.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()


def test_a_load_leaves_vllms_own_prefix_blocks_alone_and_reports_only_its_own(tuttid):
    """Goal: a load of a request whose prefix vLLM holds locally (its own prefix cache hit,
    blocks possibly shared with other requests) reads only the blocks tutti is to fill
    (`prepare_retrieve(..., first_block=)`): vLLM's block keeps its bytes through a load that
    succeeds, and a failed one — at issue, in a read, or with the session dead — reports
    through get_block_ids_with_load_errors only the blocks tutti was to fill, so vLLM
    recomputes no more than it must and its shared block is never written."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    scheduler = harness.make_connector(harness.vllm_config(daemon.socket, 1), KVConnectorRole.SCHEDULER)
    worker = LocalWorker(daemon.socket)
    try:
        tokens = prompt(16, blocks=3, tail=5)
        worker.fill([1, 2, 3], 16)
        worker.save("S", tokens[: 3 * harness.BLOCK_TOKENS], [1, 2, 3])
        wrapped = harness.StoreWithFailingIssues(worker.connector._store)
        worker.connector._store = wrapped
        blocks = [30, 31, 32, 33]
        local = harness.BLOCK_TOKENS  # vLLM's own prefix cache holds the first block (as block 30)
        worker.fill([30], 77)  # bytes of vLLM's own, not the pool's
        own_bytes = [part.clone() for part in worker.blocks_bytes([30])]

        def load_step(req_id: str) -> dict:
            request = harness.request(req_id, tokens)
            external = 2 * harness.BLOCK_TOKENS
            assert scheduler.get_num_new_matched_tokens(request, local) == (external, False)
            scheduler.update_state_after_alloc(request, harness.blocks(blocks), external)
            scheduled = len(tokens) - local - external
            meta = scheduler.build_connector_meta(
                harness.scheduler_output(new=[(req_id, tokens, blocks, local + external, scheduled)])
            )
            (load,) = meta.loads
            assert load.block_ids == blocks[:3] and load.first_block == 1, load
            return worker.step(meta)

        def vllms_block_untouched() -> bool:
            return all(torch.equal(now, before) for now, before in zip(worker.blocks_bytes([30]), own_bytes))

        # A load that succeeds fills blocks 31 and 32 with the pool's bytes, and only them.
        wrapped.failing = False
        assert load_step("B0")["load_errors"] == set()
        assert all(torch.equal(loaded, saved) for loaded, saved in zip(worker.blocks_bytes([31, 32]), worker.blocks_bytes([2, 3])))
        assert vllms_block_untouched()
        # Layer 0 fails to issue.
        wrapped.failing = True
        assert load_step("B1")["load_errors"] == {31, 32}
        # Layer 0's read fails: its buffers are undefined, but block 30 was never read into.
        wrapped.failing, wrapped.failing_waits = False, True
        assert load_step("B2")["load_errors"] == {31, 32}
        # The dead session's loads start nothing: only their own blocks.
        worker.connector._dead = "ended by the test"
        assert load_step("B3")["load_errors"] == {31, 32}
        assert vllms_block_untouched()
    finally:
        worker.shutdown()
        scheduler.shutdown()


class StandInWorker(LocalWorker):
    """A LocalWorker whose KV caches are device memory (tutti.DeviceMemoryStandIn: what vLLM's
    one CUDA allocation is on a GPU, here a memfd tuttid --device-memory memfd reaches by copies),
    viewed per layer by vLLM's create_kv_cache_views, not tuttid's window."""

    def __init__(self, socket: str, **extra) -> None:
        from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout

        config = harness.vllm_config(socket, 1, extra={"socket": socket, "timeout_s": 20.0, **extra})
        self.connector = harness.make_connector(config, KVConnectorRole.WORKER)
        kv_config = harness.kv_cache_config()
        spec = kv_config.kv_cache_groups[0].kv_cache_spec
        layer_bytes = spec.page_size_bytes * kv_config.num_blocks
        self.stand_in = tutti.DeviceMemoryStandIn(layer_bytes * harness.LAYERS)
        raw = torch.from_dlpack(self.stand_in).view(torch.int8)
        self.caches = {}
        for index, name in enumerate(harness.layer_names()):
            part = raw[index * layer_bytes : (index + 1) * layer_bytes]
            placement = KVCacheTensor(size=layer_bytes, layers=[name], layer_stride=layer_bytes, block_stride=spec.page_size_bytes)
            (self.caches[name],) = create_kv_cache_views(part, spec, kv_config.num_blocks, KVCacheLayout.LBHNC, placement)
        self.connector.register_kv_caches(self.caches)
        self.state = {"connector": self.connector, "caches": self.caches}


def test_a_worker_with_device_memory_kv_opens_a_new_session_after_its_session_ended(tuttid):
    """Goal: a worker whose KV caches are device memory (vLLM's GPU caches; here the CPU
    stand-in) is not done for when its tuttid session ends (an exchange that timed out): the
    caches are not the session's window, so a later step opens a new session (on a thread of its
    own: test_vllm_sessions.test_a_new_session_is_opened_off_the_step_path), registers them
    again, and loads from the pool byte-exact. (Window KV, the CPU path, cannot: see
    test_a_daemon_exchange_that_times_out_ends_the_worker_session.)"""
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--device-memory", "memfd"])
    worker = StandInWorker(daemon.socket, timeout_s=0.5)
    try:
        tokens = prompt(17, blocks=2, tail=0)
        worker.fill([1, 2], 17)
        worker.save("S", tokens, [1, 2])
        daemon.pause()
        # Back before the end of the session is given up on: device memory is let go only once
        # tuttid dropped the session (KvMemoryUnsafe otherwise).
        resumer = threading.Timer(1.5, daemon.resume)
        resumer.start()
        try:
            worker.step(TuttiConnectorMetadata(saves=[SaveSpec("X", prompt(18, blocks=2, tail=0), [3, 4])]))
        finally:
            resumer.join()
            daemon.resume()
        wait_no_worker_session(daemon.socket)
        assert worker.connector._dead is not None
        # The new session is opened on a thread of its own and taken up at a later step.
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while worker.connector._dead is not None:
            assert time.monotonic() < deadline, "the worker opened no new session"
            worker.step(TuttiConnectorMetadata())
            time.sleep(0.05)
        for part in worker.blocks_bytes([20, 21]):
            part.zero_()
        result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("L", tokens, [20, 21])]))
        assert result["load_errors"] == set()
        assert worker.connector._dead is None and len(worker_sessions(daemon.socket)) == 1
        assert all(torch.equal(loaded, saved) for loaded, saved in zip(worker.blocks_bytes([20, 21]), worker.blocks_bytes([1, 2])))
    finally:
        worker.shutdown()


def issued_layers(request) -> list[int]:
    """The layers a request has issued: in flight, or completed (returned by a wait or not)."""
    return sorted(set(request.layers_in_flight) | set(request.layers_completed))


@pytest.mark.parametrize("layers_in_flight", [1, 2, harness.LAYERS])
def test_loads_and_saves_keep_layers_in_flight_ahead_of_the_forward(tuttid, layers_in_flight):
    """Goal: with layers_in_flight N a load has layers l+1..l+N issued (their reads queued on the
    device) while vLLM runs layer l's attention, and a save waits for a layer only when N of its
    layers are in flight, so the device's queue does not drain at each layer boundary; the
    committer waits out the save's last N layers; the loaded bytes are the saved ones."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket, layers_in_flight=layers_in_flight)
    connector = worker.connector
    names = harness.layer_names()
    try:
        assert connector._store.layers_in_flight == layers_in_flight
        tokens = prompt(21, blocks=3, tail=0)
        worker.fill([1, 2, 3], 21)
        meta = TuttiConnectorMetadata(saves=[SaveSpec("S", tokens, [1, 2, 3])])
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        for layer, name in enumerate(names):
            connector.wait_for_layer_load(name)
            connector.save_kv_layer(name, worker.caches[name], None)
            save = connector._saves["S"]
            assert issued_layers(save.request) == list(range(layer + 1))
            # Waited for only the layers that would have been past N in flight.
            assert save.completed == max(0, layer + 1 - layers_in_flight), (layer, save.completed)
        connector.start_load_kv(None)
        connector.wait_for_save()
        connector.clear_connector_metadata()
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while connector.get_finished({"S"})[0] != {"S"}:
            assert time.monotonic() < deadline, "the save was never reported"
            time.sleep(0.01)
        with tutti.LookupClient.connect(daemon.socket, model_fingerprint=connector._fingerprint) as lookup:
            assert lookup.lookup(tokens) == 3, "the committer did not commit the save"

        for part in worker.blocks_bytes([20, 21, 22]):
            part.zero_()
        meta = TuttiConnectorMetadata(loads=[LoadSpec("L", tokens, [20, 21, 22])])
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)
        load = connector._loads["L"]
        assert issued_layers(load.request) == list(range(min(layers_in_flight, harness.LAYERS)))
        for layer, name in enumerate(names[:-1]):
            connector.wait_for_layer_load(name)
            assert issued_layers(load.request) == list(range(min(harness.LAYERS, layer + 1 + layers_in_flight))), layer
        connector.wait_for_layer_load(names[-1])
        assert "L" not in connector._loads, "a load whose every layer completed was not finished"
        connector.wait_for_save()
        assert connector.get_block_ids_with_load_errors() == set()
        connector.clear_connector_metadata()
        assert all(torch.equal(loaded, saved) for loaded, saved in zip(worker.blocks_bytes([20, 21, 22]), worker.blocks_bytes([1, 2, 3])))
    finally:
        worker.shutdown()


def test_the_worker_attaches_with_its_queue_depth_layers_in_flight_and_iocbs(tuttid, store_options):
    """Goal: the worker's store is attached with the configured queue_depth and layers_in_flight
    and the IOCBs its requests need (1024 entries, 2 layers and 2 x 32 x 2 = 128 by default), and
    a save and load on an 8-entry queue (a layer's commands past the queue wait for the worker's
    calls) is byte-exact."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    default = LocalWorker(daemon.socket)
    default.shutdown()
    assert [(name, options["queue_depth"], options["layers_in_flight"], options["iocbs"]) for name, options in store_options] == [
        ("attach", 1024, 2, 128)
    ]
    worker = LocalWorker(daemon.socket, queue_depth=8, layers_in_flight=3, requests_max=5)
    try:
        name, options = store_options[-1]
        assert (name, options["queue_depth"], options["layers_in_flight"], options["iocbs"]) == ("attach", 8, 3, 64)
        tokens = prompt(22, blocks=20, tail=0)
        source, target = list(range(1, 21)), list(range(30, 50))
        worker.fill(source, 22)
        worker.save("Q", tokens, source)
        for part in worker.blocks_bytes(target):
            part.zero_()
        result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("R", tokens, target)]))
        assert result["load_errors"] == set()
        assert all(torch.equal(loaded, saved) for loaded, saved in zip(worker.blocks_bytes(target), worker.blocks_bytes(source)))
    finally:
        worker.shutdown()


def test_issued_layers_reach_the_device_before_vllm_computes(tuttid):
    """Goal: the layers start_load_kv issues are on the device when it returns, not at the
    worker's next call (the CPU executor builds an issue's commands at its next drive, on the
    calling thread): while vLLM computes, with no call into tutti, layers 0 and 1 (two in flight)
    land in vLLM's blocks, and layers 2 and 3, not issued yet, do not."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    connector = worker.connector
    names = harness.layer_names()
    try:
        tokens = prompt(23, blocks=3, tail=0)
        source, target = [1, 2, 3], [20, 21, 22]
        worker.fill(source, 23)
        worker.save("S", tokens, source)
        for part in worker.blocks_bytes(target):
            part.zero_()
        meta = TuttiConnectorMetadata(loads=[LoadSpec("L", tokens, target)])
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)

        def landed(layer: int) -> bool:
            return all(
                torch.equal(harness._block_bytes(worker.caches, names[layer], loaded), harness._block_bytes(worker.caches, names[layer], saved))
                for loaded, saved in zip(target, source)
            )

        deadline = time.monotonic() + 5.0
        while not (landed(0) and landed(1)):  # vLLM computing: no call into tutti
            assert time.monotonic() < deadline, "the issued layers did not reach the device without another call"
            time.sleep(0.01)
        assert not landed(2) and not landed(3), "layers not issued yet landed"
        for name in names:
            connector.wait_for_layer_load(name)
        connector.wait_for_save()
        assert connector.get_block_ids_with_load_errors() == set()
        connector.clear_connector_metadata()
        assert all(landed(layer) for layer in range(harness.LAYERS))
    finally:
        worker.shutdown()


def test_a_failed_load_cancels_the_requests_save_in_the_same_step(tuttid):
    """Goal: a request whose load fails (a block evicted since the lookup) and whose prompt save
    runs in the same step saves nothing: its blocks were never loaded (vLLM recomputes them after
    the step), so the save would store vLLM's stale bytes under the prompt's keys, and blocks
    after them computed against those. The save is still reported through get_finished."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    try:
        tokens = prompt(12, blocks=3, tail=2)
        worker.fill([1], 12)
        worker.save("S", tokens[: harness.BLOCK_TOKENS], [1])  # block 0 only: block 1 is missing
        worker.fill([5, 6, 7], 13)
        meta = TuttiConnectorMetadata(
            loads=[LoadSpec("R", tokens[: 2 * harness.BLOCK_TOKENS], [5, 6])],
            saves=[SaveSpec("R", tokens[: 3 * harness.BLOCK_TOKENS], [5, 6, 7])],
        )
        result = worker.step(meta, finished={"R"})
        assert result["load_errors"] == {5, 6}
        reported = result["finished_sending"]
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while "R" not in reported:
            assert time.monotonic() < deadline, "the save of R was never reported"
            time.sleep(0.01)
            reported = worker.connector.get_finished(set())[0] or set()
        assert worker.connector._store.lookup(tokens[: 3 * harness.BLOCK_TOKENS]) < 2
    finally:
        worker.shutdown()


def wait_reported(worker, req_id: str, reported=frozenset()) -> None:
    deadline = time.monotonic() + FINISH_TIMEOUT_S
    while req_id not in reported:
        assert time.monotonic() < deadline, f"the save of {req_id} was never reported"
        time.sleep(0.01)
        reported = worker.connector.get_finished(set())[0] or set()


@pytest.mark.parametrize("later_step", [False, True], ids=["same-step", "next-step"])
def test_a_failed_load_cancels_the_saves_of_requests_sharing_its_blocks(tuttid, later_step):
    """Goal: a request B that shares a failed load's blocks through vLLM's own prefix cache (vLLM
    caches a loaded block when it allocates it) saves nothing either, in the load's step or the
    next (async scheduling: B scheduled before vLLM learned of the failure): those blocks hold
    stale bytes, and B's blocks after them were computed against them. Committed, they would
    serve wrong KV under the real prefix keys to every later request."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    try:
        tokens = prompt(12, blocks=3, tail=2)
        worker.fill([1], 12)
        worker.save("S", tokens[: harness.BLOCK_TOKENS], [1])  # block 0 only: block 1 is missing
        worker.fill([5, 6, 7, 8, 9], 13)
        tokens_b = tokens[: 2 * harness.BLOCK_TOKENS] + prompt(19, blocks=2, tail=1)
        load = LoadSpec("R", tokens[: 2 * harness.BLOCK_TOKENS], [5, 6])
        save_r = SaveSpec("R", tokens[: 3 * harness.BLOCK_TOKENS], [5, 6, 7])
        save_b = SaveSpec("B", tokens_b[: 4 * harness.BLOCK_TOKENS], [5, 6, 8, 9])  # R's blocks, then its own
        if later_step:
            result = worker.step(TuttiConnectorMetadata(loads=[load], saves=[save_r]), finished={"R"})
            assert result["load_errors"] == {5, 6}
            wait_reported(worker, "R", result["finished_sending"])
            result = worker.step(TuttiConnectorMetadata(saves=[save_b]), finished={"B"})
        else:
            # B's save first: it, not R's, prepares the shared blocks' writes.
            result = worker.step(TuttiConnectorMetadata(loads=[load], saves=[save_b, save_r]), finished={"R", "B"})
            assert result["load_errors"] == {5, 6}
            wait_reported(worker, "R", result["finished_sending"])
        wait_reported(worker, "B", result["finished_sending"])
        assert worker.connector._store.lookup(tokens_b[: 4 * harness.BLOCK_TOKENS]) < 2, "B's save over R's failed blocks was committed"
        # The step after that, the mark is gone: B saved again (recomputed) is committed.
        worker.fill([5, 6, 8, 9], 14)
        worker.step(TuttiConnectorMetadata())
        worker.save("B2", tokens_b[: 4 * harness.BLOCK_TOKENS], [5, 6, 8, 9])
        assert worker.connector._store.lookup(tokens_b[: 4 * harness.BLOCK_TOKENS]) == 4
    finally:
        worker.shutdown()


class RecordingKvCacheManager:
    """Stands for vLLM's KVCacheManager as the scheduler binds it to the connector
    (bind_kv_cache_manager): records the blocks evicted from vLLM's prefix cache."""

    block_pool = None

    def __init__(self) -> None:
        self.evicted: set[int] = set()

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.evicted |= set(block_ids)


@contextlib.contextmanager
def evicting_scheduler(tuttid):
    """A tuttid, a LocalWorker on it and the scheduler side with a RecordingKvCacheManager bound:
    (worker, scheduler, manager), both connectors shut down at the end."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    scheduler = harness.make_connector(harness.vllm_config(daemon.socket, 1), KVConnectorRole.SCHEDULER)
    manager = RecordingKvCacheManager()
    scheduler.bind_kv_cache_manager(manager)
    try:
        yield worker, scheduler, manager
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_a_failed_load_stops_the_saves_of_requests_computed_on_its_blocks_in_any_later_step(tuttid):
    """Goal: with async scheduling and chunked prefill (vLLM's defaults), a request Q scheduled
    in the step after R's load failed (before vLLM learned of it) gets a local prefix hit on R's
    blocks, which vLLM caches at allocation, and computes its chunk against their stale bytes;
    vLLM keeps that chunk as computed (Q's invalid blocks were marked by R), so Q's prompt
    completes two or more steps after the failure. Its save must not commit that KV under the
    real prefix keys (the workers remember failed blocks for two steps only): once vLLM reports
    the failed blocks, the scheduler side saves no request holding them, and evicts them and
    every block after them in such a request from vLLM's prefix cache (nothing later gets a
    local hit on stale bytes, nor saves it), at each step and when the request finishes."""
    with evicting_scheduler(tuttid) as (worker, scheduler, manager):
        block = harness.BLOCK_TOKENS
        prefix = prompt(51, blocks=2, tail=0)
        worker.fill([1, 2], 51)
        worker.save("P", prefix, [1, 2])
        tokens_r = prefix + prompt(52, blocks=1, tail=2)
        tokens_q = prefix + prompt(53, blocks=2, tail=1)
        # Step N: R loads the prefix into blocks 5 and 6 and computes its third block; the load fails.
        request_r = harness.request("R", tokens_r)
        assert scheduler.get_num_new_matched_tokens(request_r, 0) == (2 * block, False)
        scheduler.update_state_after_alloc(request_r, harness.blocks([5, 6, 7]), 2 * block)
        meta = scheduler.build_connector_meta(harness.scheduler_output(new=[("R", tokens_r, [5, 6, 7], 2 * block, block)]))
        assert [load.req_id for load in meta.loads] == ["R"]
        worker.fill([5, 6, 7], 54)  # what vLLM had in them
        real_store = worker.connector._store
        worker.connector._store = harness.StoreWithFailingLoads(real_store)
        assert worker.step(meta)["load_errors"] == {5, 6}
        worker.connector._store = real_store
        # Step N+1, scheduled before vLLM learned: Q hits R's blocks locally, computes blocks 8 and 9 against them.
        request_q = harness.request("Q", tokens_q)
        assert scheduler.get_num_new_matched_tokens(request_q, 2 * block) == (0, False)
        scheduler.update_state_after_alloc(request_q, harness.blocks([5, 6, 8, 9, 10]), 0)
        meta = scheduler.build_connector_meta(harness.scheduler_output(new=[("Q", tokens_q, [5, 6, 8, 9, 10], 2 * block, 2 * block)]))
        assert meta.saves == []
        worker.fill([8, 9], 55)
        worker.step(meta)
        # Step N's output reaches the scheduler side.
        from vllm.v1.outputs import KVConnectorOutput

        scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids={5, 6}))
        assert manager.evicted >= {5, 6, 7, 8, 9, 10}
        # Step N+2: Q's prompt completes (block 10, computed on top of them, cached now too); R recomputes.
        manager.evicted.clear()
        meta = scheduler.build_connector_meta(
            harness.scheduler_output(cached=[("Q", None, 4 * block, 1, False), ("R", None, 2 * block, block + 2, False)])
        )
        assert meta.saves == [], "a save over blocks computed against a failed load's stale bytes was emitted"
        assert manager.evicted >= {5, 6, 8, 9, 10}
        worker.step(meta, finished={"Q", "R"})
        manager.evicted.clear()
        assert scheduler.request_finished(request_q, [5, 6, 8, 9, 10]) == (False, None)
        assert scheduler.request_finished(request_r, [5, 6, 7]) == (False, None)
        assert manager.evicted >= {5, 6, 7, 8, 9, 10}
        assert worker.connector._store.lookup(tokens_q[: 4 * block]) == 2, "Q's KV computed on stale bytes was committed"
        # A request that is not affected still saves.
        tokens_s = prompt(56, blocks=2, tail=1)
        request_s = harness.request("S", tokens_s)
        scheduler.get_num_new_matched_tokens(request_s, 0)
        scheduler.update_state_after_alloc(request_s, harness.blocks([20, 21, 22]), 0)
        meta = scheduler.build_connector_meta(harness.scheduler_output(new=[("S", tokens_s, [20, 21, 22], 0, len(tokens_s))]))
        assert [save.req_id for save in meta.saves] == ["S"]


def test_the_failed_blocks_of_a_request_preempted_before_recomputing_them_are_evicted(tuttid):
    """Goal: a request whose load failed and that is preempted (or aborted) before it rewrote the
    failed blocks frees them with their prefix keys still in vLLM's prefix cache (vLLM's
    "recompute" policy evicts nothing); a later request would get a local hit on the stale bytes
    and save them. The scheduler side evicts them when vLLM reports them, and a resumed request
    (allocated anew, its blocks computed afresh) saves again."""
    with evicting_scheduler(tuttid) as (worker, scheduler, manager):
        block = harness.BLOCK_TOKENS
        prefix = prompt(61, blocks=2, tail=0)
        worker.fill([1, 2], 61)
        worker.save("P", prefix, [1, 2])
        tokens = prefix + prompt(62, blocks=1, tail=2)
        request = harness.request("R", tokens)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * block, False)
        scheduler.update_state_after_alloc(request, harness.blocks([5, 6, 7]), 2 * block)
        scheduler.build_connector_meta(harness.scheduler_output(new=[("R", tokens, [5, 6, 7], 2 * block, block)]))
        from vllm.v1.outputs import KVConnectorOutput

        scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids={5, 6}))
        assert manager.evicted >= {5, 6, 7}
        # Preempted, then resumed into other blocks: computed afresh, saved.
        meta = scheduler.build_connector_meta(harness.scheduler_output(preempted={"R"}))
        assert meta.saves == []
        assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * block, False)
        scheduler.update_state_after_alloc(request, harness.blocks([11, 12, 13]), 2 * block)
        manager.evicted.clear()
        meta = scheduler.build_connector_meta(
            harness.scheduler_output(cached=[("R", [11, 12, 13], 2 * block, len(tokens) - 2 * block, True)])
        )
        assert [(save.req_id, save.block_ids) for save in meta.saves] == [("R", [11, 12, 13])]
        assert manager.evicted == set()


def test_the_stale_blocks_of_a_request_gone_before_the_failure_is_reported_are_evicted(tuttid):
    """Goal: with async scheduling vLLM processes aborts before the step's output, so a request
    whose load failed (or one that computed against the failed blocks) can be finished before
    update_connector_output names the invalid blocks; its freed blocks, the ones computed after
    the failed ones included, must still leave vLLM's prefix cache. And a stale request
    preempted later evicts the blocks it was given since (cached as they were computed)."""
    with evicting_scheduler(tuttid) as (worker, scheduler, manager):
        from vllm.v1.outputs import KVConnectorOutput

        block = harness.BLOCK_TOKENS
        prefix = prompt(63, blocks=2, tail=0)
        worker.fill([1, 2], 63)
        worker.save("P", prefix, [1, 2])
        tokens = prefix + prompt(64, blocks=2, tail=2)
        # Aborted before the failure is reported.
        request = harness.request("R", tokens)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * block, False)
        scheduler.update_state_after_alloc(request, harness.blocks([5, 6, 7]), 2 * block)
        scheduler.build_connector_meta(harness.scheduler_output(new=[("R", tokens, [5, 6, 7], 2 * block, block)]))
        assert scheduler.request_finished(request, [5, 6, 7]) == (False, None)
        scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids={5, 6}))
        assert manager.evicted >= {5, 6, 7}, manager.evicted
        # Preempted after being given another block (cached as computed, after the last eviction).
        manager.evicted.clear()
        other = harness.request("S", tokens)
        assert scheduler.get_num_new_matched_tokens(other, 0) == (2 * block, False)
        scheduler.update_state_after_alloc(other, harness.blocks([9, 10, 11]), 2 * block)
        scheduler.build_connector_meta(harness.scheduler_output(new=[("S", tokens, [9, 10, 11], 2 * block, block)]))
        scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids={9, 10}))
        scheduler.build_connector_meta(harness.scheduler_output(cached=[("S", [12], 3 * block, block, False)]))
        manager.evicted.clear()
        meta = scheduler.build_connector_meta(harness.scheduler_output(preempted={"S"}))
        assert meta.saves == []
        assert manager.evicted >= {9, 10, 11, 12}, manager.evicted


def test_a_load_failing_on_one_rank_cancels_other_requests_saves_over_its_blocks_on_every_rank(cluster):
    """Goal: B's save over blocks whose load (by another request) failed on rank 0 is cancelled
    on rank 1 too (the ranks agree per save), as the failed request's own save is."""
    daemon, scheduler, workers = cluster
    prefix = prompt(41, blocks=2, tail=0)
    save_prompt_on_every_rank(scheduler, workers, "P", prefix, [1, 2], 41)
    tokens_b = prefix + prompt(42, blocks=2, tail=0)
    for worker in workers:
        worker.call("fill", [12, 13], 43)
    workers[0].call("fail_loads")
    meta = TuttiConnectorMetadata(loads=[LoadSpec("A", prefix, [10, 11])], saves=[SaveSpec("B", tokens_b, [10, 11, 12, 13])])
    results = step(workers, meta)
    assert results[0]["load_errors"] == {10, 11} and results[1]["load_errors"] == set()
    wait_finished(workers, "B")
    assert cached_blocks_per_rank(daemon, scheduler, tokens_b) == [2, 2], "a rank committed B's save over A's failed blocks"


class Panic(BaseException):
    """Stands for pyo3's PanicException (a panic in the binding): a BaseException."""


class CommitRaising:
    """A tutti.Request whose commit raises `error`; the rest is the real request's."""

    def __init__(self, request, error: BaseException) -> None:
        self._request = request
        self._error = error

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def commit(self):
        raise self._error


class StoreWithCommitsRaising:
    def __init__(self, store, error: BaseException) -> None:
        self._store = store
        self._error = error

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def prepare_store(self, tokens, block_ids):
        return CommitRaising(self._store.prepare_store(tokens, block_ids), self._error)


def test_a_save_whose_commit_panics_is_reported_and_the_committer_goes_on(tuttid):
    """Goal: a BaseException out of the binding in the committer thread (pyo3's PanicException)
    does not end the thread silently, leaving the save never reported (vLLM would keep the
    request forever) and every later save stuck: the save is a miss, reported, and the next
    save is committed."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    try:
        connector = worker.connector
        real = connector._store
        tokens = prompt(51, blocks=2, tail=0)
        worker.fill([1, 2], 51)
        connector._store = StoreWithCommitsRaising(real, Panic("injected: a panic in the binding"))
        result = worker.step(TuttiConnectorMetadata(saves=[SaveSpec("P", tokens, [1, 2])]), finished={"P"})
        wait_reported(worker, "P", result["finished_sending"])
        assert real.lookup(tokens) == 0
        assert connector._committer.is_alive()
        connector._store = real
        worker.save("Q", tokens, [1, 2])
        assert real.lookup(tokens) == 2
    finally:
        worker.shutdown()


def test_a_stopped_committer_fails_later_saves_instead_of_hanging(tuttid):
    """Goal: a committer stopped by SystemExit (or KeyboardInterrupt) reports the save it held; a
    later wait_for_save gives its saves up (reported, misses) and raises a tutti error naming the
    stopped committer, rather than hand them to a thread that never reports them."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    try:
        connector = worker.connector
        real = connector._store
        tokens = prompt(52, blocks=2, tail=0)
        worker.fill([1, 2], 52)
        connector._store = StoreWithCommitsRaising(real, SystemExit(3))
        result = worker.step(TuttiConnectorMetadata(saves=[SaveSpec("P", tokens, [1, 2])]), finished={"P"})
        wait_reported(worker, "P", result["finished_sending"])
        connector._committer.join(timeout=FINISH_TIMEOUT_S)
        assert not connector._committer.is_alive()
        connector._store = real
        with pytest.raises(tutti.InvalidState, match="committer thread has stopped"):
            worker.step(TuttiConnectorMetadata(saves=[SaveSpec("Q", tokens, [1, 2])]), finished={"Q"})
        wait_reported(worker, "Q", connector.get_finished({"Q"})[0] or set())
        assert real.lookup(tokens) == 0
    finally:
        worker.shutdown()


def test_requests_whose_kv_is_not_their_tokens_alone_neither_load_nor_save(tuttid):
    """Goal: tutti's keys are the prompt's tokens only, so a request with a cache salt, a LoRA
    adapter, multimodal inputs or prompt embeddings (vLLM's own prefix keys include them) is
    never served another request's KV (0 matched tokens) and saves nothing under the bare tokens."""
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    scheduler = harness.make_connector(harness.vllm_config(daemon.socket, 1), KVConnectorRole.SCHEDULER)
    try:
        tokens = prompt(14, blocks=2, tail=3)
        worker.fill([1, 2], 14)
        worker.save("A", tokens[: 2 * harness.BLOCK_TOKENS], [1, 2])
        plain = harness.request("plain", tokens)
        assert scheduler.get_num_new_matched_tokens(plain, 0) == (2 * harness.BLOCK_TOKENS, False)
        others = {
            "salted": Request("salted", tokens, SamplingParams(max_tokens=4), None, cache_salt="salt"),
            "lora": Request("lora", tokens, SamplingParams(max_tokens=4), None, lora_request=LoRARequest("adapter", 1, "/adapter")),
            "multimodal": Request(
                "multimodal", tokens, SamplingParams(max_tokens=4), None,
                mm_features=[MultiModalFeatureSpec(data=None, modality="image", identifier="image-0", mm_position=PlaceholderRange(offset=0, length=4))],
            ),  # fmt: skip
            "embeds": Request("embeds", tokens, SamplingParams(max_tokens=4), None, prompt_embeds=torch.zeros(len(tokens), 8)),
        }
        for req_id, request in others.items():
            assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False), req_id
            scheduler.update_state_after_alloc(request, harness.blocks([7, 8, 9]), 0)
            meta = scheduler.build_connector_meta(harness.scheduler_output(new=[(req_id, tokens, [7, 8, 9], 0, len(tokens))]))
            assert meta.saves == [] and meta.loads == [], req_id
            assert scheduler.request_finished(request, [7, 8, 9]) == (False, None)
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_a_request_preempted_and_resumed_in_one_step_keeps_its_load(tuttid):
    """Goal: reset_prefix_cache(reset_running_requests=True) preempts every running request and
    the next schedule() resumes them: the scheduler side is asked for the matched tokens and told
    the allocation, then builds the step's metadata with the same request among the preempted.
    The load set up for the resumed request is sent (vLLM counts its tokens computed)."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    scheduler = harness.make_connector(harness.vllm_config(daemon.socket, 1), KVConnectorRole.SCHEDULER)
    try:
        tokens = prompt(15, blocks=2, tail=3)
        worker.fill([1, 2], 15)
        worker.save("A", tokens[: 2 * harness.BLOCK_TOKENS], [1, 2])
        request = harness.request("R", tokens)
        hit = 2 * harness.BLOCK_TOKENS
        assert scheduler.get_num_new_matched_tokens(request, 0) == (hit, False)
        scheduler.update_state_after_alloc(request, harness.blocks([7, 8, 9]), hit)
        meta = scheduler.build_connector_meta(
            harness.scheduler_output(cached=[("R", [7, 8, 9], hit, len(tokens) - hit, True)], preempted={"R"})
        )
        assert meta.preempted_req_ids == {"R"}
        assert [(load.req_id, load.block_ids) for load in meta.loads] == [("R", [7, 8])]
        assert [(save.req_id, save.block_ids) for save in meta.saves] == [("R", [7, 8])]
        # A preemption of a request not allocated since the last metadata still resets it.
        meta = scheduler.build_connector_meta(harness.scheduler_output(preempted={"R"}))
        assert meta.loads == [] and meta.saves == []
    finally:
        scheduler.shutdown()
        worker.shutdown()


@pytest.mark.parametrize("field", ["pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"])
def test_pipeline_and_context_parallelism_are_refused(field):
    """Goal: tutti's keys name the tensor-parallel rank only (pipeline stages would share them
    while holding other layers; context parallelism changes the scheduler's block size): vLLM
    configured with either is refused when it builds the connector, naming the setting. Checked
    before tuttid is asked (the socket here does not exist)."""
    config = harness.vllm_config("/nonexistent/tuttid.sock", 1)
    object.__setattr__(config.parallel_config, field, 2)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(tutti.InvalidArgument, match=f"{field} = 2"):
            harness.make_connector(config, role)


def test_vllms_default_load_failure_policy_is_refused_naming_the_field():
    """Goal: vLLM's kv_load_failure_policy defaults to "fail": every load the connector reports
    failed (get_block_ids_with_load_errors) would fail the user's request and every running
    request sharing the block (Scheduler._handle_invalid_blocks), where tutti is a best-effort
    cache whose failed loads vLLM must recompute. vLLM's default is refused when vLLM builds the
    connector, naming the kv_transfer_config field to set; "recompute" is accepted. Checked
    before tuttid is asked (the socket here does not exist)."""
    for policy in (None, "fail"):
        config = harness.vllm_config("/nonexistent/tuttid.sock", 1, load_failure_policy=policy)
        assert config.kv_transfer_config.kv_load_failure_policy == "fail"
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(ConfigError, match='"kv_load_failure_policy": "recompute"'):
                harness.make_connector(config, role)
    config = harness.vllm_config("/nonexistent/tuttid.sock", 1)
    with pytest.raises(tutti.Disconnected):  # past the configuration: tuttid is asked
        harness.make_connector(config, KVConnectorRole.SCHEDULER)


@pytest.mark.parametrize("kind", ["sliding_window", "chunked_local", "full_with_window", "full_non_causal"])
def test_kv_cache_groups_whose_blocks_vllm_frees_early_are_refused(kind):
    """Goal: for a group of sliding-window (or chunked local) attention vLLM frees the blocks
    outside the window while the request runs (SlidingWindowManager.remove_skipped_blocks, during
    chunked prefill and before request_finished), so a save naming the prompt's blocks would
    store other requests' bytes, written into them after they were reused, under this prompt's
    keys. Such a KVCacheConfig is refused when vLLM builds the connector (both roles, before
    tuttid is asked), naming the spec and --disable-sliding-window. A full-attention group whose
    layers compute a sliding window (vLLM's FullAttentionSpec with sliding_window set, as with
    the hybrid KV cache manager disabled) keeps every block and is accepted. A full-attention
    group whose layers attend non-causally (FullAttentionSpec.non_causal: Prefix-LM, bidirectional
    over the prompt) is refused too: a block's KV then depends on the prompt's later tokens, so a
    prompt sharing only a prefix would load another prompt's KV (vLLM disables its own prefix
    caching for such a model, but still asks the connector)."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    shape = dict(block_size=harness.BLOCK_TOKENS, num_kv_heads=harness.KV_HEADS, head_size=harness.HEAD_DIM, dtype=harness.DTYPE)
    spec = {
        "sliding_window": lambda: SlidingWindowSpec(sliding_window=32, **shape),
        "chunked_local": lambda: ChunkedLocalAttentionSpec(attention_chunk_size=64, **shape),
        "full_with_window": lambda: FullAttentionSpec(sliding_window=32, **shape),
        "full_non_causal": lambda: FullAttentionSpec(non_causal=True, **shape),
    }[kind]()
    config = harness.vllm_config("/nonexistent/tuttid.sock", 1)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        if kind == "full_with_window":
            with pytest.raises(tutti.Disconnected):  # past the configuration: tuttid is asked
                harness.make_connector(config, role, harness.kv_cache_config(spec=spec))
        elif kind == "full_non_causal":
            with pytest.raises(ConfigError, match="non-causal.*Prefix-LM"):
                harness.make_connector(config, role, harness.kv_cache_config(spec=spec))
        else:
            with pytest.raises(ConfigError, match=f"{type(spec).__name__}.*--disable-sliding-window"):
                harness.make_connector(config, role, harness.kv_cache_config(spec=spec))


def test_layers_of_different_kv_shapes_are_refused_naming_that_not_sliding_window():
    """Goal: a full-attention model whose layers have different KV shapes (head counts or sizes
    per layer) reaches the workers as one group of vLLM's UniformTypeKVCacheSpecs (the scheduler
    sees one layer's FullAttentionSpec: generate_scheduler_kv_cache_config); the worker's
    refusal says that the layers' KV shapes differ, not that the model uses a sliding window
    (--disable-sliding-window would change nothing). Checked before tuttid is asked."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    names = harness.layer_names()
    spec = UniformTypeKVCacheSpecs(
        block_size=harness.BLOCK_TOKENS,
        kv_cache_specs={
            name: FullAttentionSpec(
                block_size=harness.BLOCK_TOKENS, num_kv_heads=harness.KV_HEADS * (1 + index % 2), head_size=harness.HEAD_DIM,
                dtype=harness.DTYPE,
            )  # fmt: skip
            for index, name in enumerate(names)
        },
    )
    config = harness.vllm_config("/nonexistent/tuttid.sock", 1)
    with pytest.raises(ConfigError, match="different KV shapes.*they differ in num_kv_heads:") as refused:
        harness.make_connector(config, KVConnectorRole.WORKER, harness.kv_cache_config(spec=spec))
    assert "--disable-sliding-window" not in str(refused.value)
    assert str(refused.value).endswith("serve it without the connector")  # one dtype would not help


def test_layers_of_different_kv_dtypes_are_refused_naming_the_dtype():
    """Goal: a UniformTypeKVCacheSpecs group also arises when layers differ only in KV-cache
    dtype: --kv-cache-dtype with --kv-cache-dtype-skip-layers (which vLLM adds by itself for
    turboquant_* and ultraquant_4bit KV dtypes). The refusal names the dtype as what differs
    (not head counts or sizes) and one KV-cache dtype for every layer (no
    --kv-cache-dtype-skip-layers) as a way out."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    names = harness.layer_names()
    spec = UniformTypeKVCacheSpecs(
        block_size=harness.BLOCK_TOKENS,
        kv_cache_specs={
            name: FullAttentionSpec(
                block_size=harness.BLOCK_TOKENS, num_kv_heads=harness.KV_HEADS, head_size=harness.HEAD_DIM,
                dtype=harness.DTYPE if index == 0 else torch.uint8,
            )  # fmt: skip
            for index, name in enumerate(names)
        },
    )
    config = harness.vllm_config("/nonexistent/tuttid.sock", 1)
    with pytest.raises(ConfigError, match="different KV shapes or dtypes") as refused:
        harness.make_connector(config, KVConnectorRole.WORKER, harness.kv_cache_config(spec=spec))
    message = str(refused.value)
    assert "they differ in dtype:" in message, message
    assert "--kv-cache-dtype-skip-layers" in message.split("hold:")[1], message  # a way out


def test_layers_of_a_packed_kv_dtype_beside_skip_layers_are_refused_naming_one_dtype():
    """Goal: the one-dtype way out also shows for the case that makes vLLM add skip layers by
    itself: a turboquant_* --kv-cache-dtype. Its layers' specs are not the skip layers' but for
    the dtype alone: the worker's model runner passes each through its backend's customize_spec
    (customize_attention_spec), which gives TurboQuant's packed layers state_content_bytes, and
    block_stride_alignment (its kernel block sizes are fixed), while the skip layers (FlashAttention,
    the model's dtype) get neither. Fields that follow from the dtype count as the dtype's
    difference; the refusal still names them."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, UniformTypeKVCacheSpecs
    from vllm.v1.worker.utils import customize_attention_spec

    def layer_spec(skipped: bool) -> FullAttentionSpec:
        dtype, quant_mode = (harness.DTYPE, KVQuantMode.NONE) if skipped else (torch.uint8, KVQuantMode.TURBOQUANT_K8V4)
        spec = FullAttentionSpec(
            block_size=harness.BLOCK_TOKENS, num_kv_heads=harness.KV_HEADS, head_size=harness.HEAD_DIM, dtype=dtype,
            kv_quant_mode=quant_mode,
        )  # fmt: skip
        return customize_attention_spec(FlashAttentionBackend if skipped else TurboQuantAttentionBackend, spec)

    names = harness.layer_names()
    specs = {name: layer_spec(skipped=index in (0, len(names) - 1)) for index, name in enumerate(names)}
    packed = specs[names[1]]
    assert packed.state_content_bytes is not None and packed.block_stride_alignment is not None, packed  # the case
    spec = UniformTypeKVCacheSpecs(block_size=harness.BLOCK_TOKENS, kv_cache_specs=specs)
    config = harness.vllm_config("/nonexistent/tuttid.sock", 1)
    with pytest.raises(ConfigError, match="different KV shapes or dtypes") as refused:
        harness.make_connector(config, KVConnectorRole.WORKER, harness.kv_cache_config(spec=spec))
    message = str(refused.value)
    assert "they differ in block_stride_alignment, dtype, kv_quant_mode, state_content_bytes:" in message, message
    assert "--kv-cache-dtype-skip-layers" in message.split("hold:")[1], message  # a way out
    assert "  " not in message, message


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_full_cuda_graphs_left_by_vllm_are_refused_at_the_worker(mode):
    """Goal: the connector asks vLLM for PIECEWISE CUDA graphs (requires_piecewise_for_cudagraph),
    but vLLM's config can undo that after applying it: with pass_config.fuse_attn_quant and no
    inductor graph partition, set_splitting_ops_for_attn_fusion switches to FULL with no
    splitting ops. A replayed full graph never calls wait_for_layer_load or save_kv_layer, so
    attention would read blocks tuttid is still writing. A worker whose (final) config still has
    full CUDA graphs is refused when vLLM builds its connector, naming the setting; PIECEWISE
    and NONE (the harness's) pass. Checked before tuttid is asked."""
    from vllm.config import CUDAGraphMode

    config = harness.vllm_config("/nonexistent/tuttid.sock", 1)
    for passing in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        config.compilation_config.cudagraph_mode = passing
        with pytest.raises(tutti.Disconnected):  # past the configuration: tuttid is asked
            harness.make_connector(config, KVConnectorRole.WORKER)
    config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    with pytest.raises(ConfigError, match=f"cudagraph_mode {mode}.*fuse_attn_quant"):
        harness.make_connector(config, KVConnectorRole.WORKER)


@pytest.mark.parametrize("write", ["zeroing", "partial-hash-hits"])
def test_kv_block_writes_vllm_makes_before_handle_preemptions_are_refused_at_the_worker(monkeypatch, write):
    """Goal: vLLM's model runner V2 runs update_requests, which zeroes newly allocated blocks
    (KVCacheConfig.needs_kv_cache_zeroing) and applies the copy-on-write copies of partial
    prefix-cache hits, before pre_forward calls handle_preemptions: a block a preempted request
    freed could be written while its save still reads it. A worker whose KVCacheConfig (stubbed:
    the connector refuses the Mamba layers behind both already) asks for either is refused when
    vLLM builds its connector, naming the write and the order; the harness's passes. Checked
    before tuttid is asked."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import KVCacheConfig

    config = harness.vllm_config("/nonexistent/tuttid.sock", 1)
    with pytest.raises(tutti.Disconnected):  # past the configuration: tuttid is asked
        harness.make_connector(config, KVConnectorRole.WORKER)
    if write == "zeroing":
        monkeypatch.setattr(KVCacheConfig, "needs_kv_cache_zeroing", property(lambda self: True))
        match = "zeroes newly allocated KV blocks.*needs_kv_cache_zeroing"
    else:
        monkeypatch.setattr(kv_cache_utils, "partial_hash_hits_enabled", lambda *args, **kwargs: True)
        match = "partial prefix-cache hits"
    with pytest.raises(ConfigError, match=f"{match}.*before it calls the connector's handle_preemptions"):
        harness.make_connector(config, KVConnectorRole.WORKER)


def test_a_vllm_without_partial_hash_hits_enabled_still_builds_the_worker(monkeypatch, caplog):
    """Goal: the partial-prefix-cache-hits guard uses a vLLM 0.32 helper
    (kv_cache_utils.partial_hash_hits_enabled); a vLLM without it, or with another signature,
    must not make every worker fail to build (check_vllm_version only warns on another vLLM).
    The guard is skipped with a warning and the harness's configuration goes on to tuttid."""
    from vllm.v1.core import kv_cache_utils

    from tutti.vllm import _worker

    config = harness.vllm_config("/nonexistent/tuttid.sock", 1)
    monkeypatch.delattr(kv_cache_utils, "partial_hash_hits_enabled")
    monkeypatch.setattr(_worker, "_partial_hash_hits_unknown_logged", False)  # logged once per process
    with caplog.at_level(logging.WARNING, logger="tutti.vllm"):
        with pytest.raises(tutti.Disconnected):  # past the configuration: tuttid is asked
            harness.make_connector(config, KVConnectorRole.WORKER)
    assert "partial_hash_hits_enabled" in caplog.text, caplog.text

    def other_signature(groups):
        raise AssertionError("not reached with three arguments")

    monkeypatch.setattr(kv_cache_utils, "partial_hash_hits_enabled", other_signature, raising=False)
    with pytest.raises(tutti.Disconnected):
        harness.make_connector(config, KVConnectorRole.WORKER)


def test_each_way_out_the_full_cuda_graph_refusal_names_leaves_no_full_graphs():
    """Goal: every way out the full-CUDA-graph refusal names works. vLLM reaches full graphs
    for the connector only through pass_config.fuse_attn_quant without inductor graph partition
    under VLLM_COMPILE: set_splitting_ops_for_attn_fusion then turns any mode with piecewise
    graphs (PIECEWISE included) into FULL, so "set cudagraph_mode PIECEWISE" would be refused
    again. Each remedy the message names is applied to such a config (as the connector's
    requires_piecewise_for_cudagraph leaves it: PIECEWISE), and vLLM's own
    set_splitting_ops_for_v1 must leave no full graphs."""
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode, PassConfig

    config = harness.vllm_config("/nonexistent/tuttid.sock", 1)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    config.compilation_config.pass_config.fuse_attn_quant = True
    with pytest.raises(ConfigError) as refused:
        harness.make_connector(config, KVConnectorRole.WORKER)
    message = str(refused.value)

    def fused(**changes):
        fields = {"mode": CompilationMode.VLLM_COMPILE, "cudagraph_mode": CUDAGraphMode.PIECEWISE}
        fields.update(changes)
        return CompilationConfig(pass_config=PassConfig(fuse_attn_quant=True), **fields)

    unchanged = fused()
    unchanged.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    assert unchanged.cudagraph_mode.has_full_cudagraphs()  # the case the refusal is for

    remedies = {}
    if "fuse_attn_quant=false" in message:
        remedies["fuse_attn_quant=false"] = fused()
        remedies["fuse_attn_quant=false"].pass_config.fuse_attn_quant = False
    if "use_inductor_graph_partition" in message:
        remedies["use_inductor_graph_partition"] = fused(use_inductor_graph_partition=True)
    named_modes = re.search(r"set cudagraph_mode ([A-Z_]+(?: or [A-Z_]+)*)", message)
    for mode in named_modes.group(1).split(" or ") if named_modes else []:
        remedies[f"cudagraph_mode {mode}"] = fused(cudagraph_mode=CUDAGraphMode[mode])
    assert set(remedies) >= {"fuse_attn_quant=false", "use_inductor_graph_partition", "cudagraph_mode NONE"}, message
    for remedy, compilation in remedies.items():
        compilation.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
        assert not compilation.cudagraph_mode.has_full_cudagraphs(), f"{remedy}: {compilation.cudagraph_mode.name}"


def test_the_full_cuda_graph_refusal_without_fuse_attn_quant_names_piecewise():
    """Goal: with pass_config.fuse_attn_quant off, nothing in vLLM undoes the PIECEWISE the
    connector asks for, so full graphs came from elsewhere (a platform hook, a test), and
    cudagraph_mode PIECEWISE is a way out: the refusal names it, and does not say that PIECEWISE
    does not help (true only under fuse_attn_quant). Each mode it names, applied with fusion
    off, leaves no full graphs after vLLM's own set_splitting_ops_for_v1."""
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode, PassConfig

    config = harness.vllm_config("/nonexistent/tuttid.sock", 1)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    config.compilation_config.pass_config.fuse_attn_quant = False
    with pytest.raises(ConfigError, match="cudagraph_mode FULL") as refused:
        harness.make_connector(config, KVConnectorRole.WORKER)
    message = str(refused.value)
    assert "does not help" not in message, message
    named_modes = re.search(r"set cudagraph_mode ([A-Z_]+(?: or [A-Z_]+)*)", message)
    assert named_modes and "PIECEWISE" in named_modes.group(1).split(" or "), message
    for mode in named_modes.group(1).split(" or "):
        compilation = CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode[mode],
            pass_config=PassConfig(fuse_attn_quant=False),
        )  # fmt: skip
        compilation.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
        assert not compilation.cudagraph_mode.has_full_cudagraphs(), f"{mode}: {compilation.cudagraph_mode.name}"


@pytest.mark.parametrize("field, value", [("enable_dbo", True), ("ubatch_size", 2)])
def test_micro_batching_is_refused(field, value):
    """Goal: with micro-batching (dual batch overlap, ubatch_size > 1: ParallelConfig.use_ubatching)
    vLLM runs the forward as micro-batches in two threads, each calling save_kv_layer per layer:
    the connector would issue a layer's save on the first call, before the second micro-batch
    wrote its KV. Refused when vLLM builds the connector, naming the setting."""
    config = harness.vllm_config("/nonexistent/tuttid.sock", 1)
    object.__setattr__(config.parallel_config, field, value)
    assert config.parallel_config.use_ubatching
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(tutti.InvalidArgument, match=f"micro-batching.*{field}"):
            harness.make_connector(config, role)


def test_reset_cache_says_the_pool_was_not_cleared(cluster):
    """Goal: vLLM treats any answer of reset_cache but False as a cleared connector cache
    (pause_scheduler(clear_cache=True), sleep); tutti cannot forget its pool's blocks, so it
    answers False (and logs what to do after a weight update). vLLM 0.32's scheduler then says
    the connector's cache was not reset, and its engine core's cache reset (pause_scheduler with
    clear_cache, sleep at level 1 or more, release_kv_cache_memory) raises: what docs/vllm.md
    says, checked through vLLM's own methods."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    _, scheduler, _ = cluster
    assert scheduler.reset_cache() is False
    vllm_scheduler = SimpleNamespace(connector=scheduler, log_stats=False)
    assert Scheduler.reset_connector_cache(vllm_scheduler) is False
    engine = SimpleNamespace(
        reset_prefix_cache=lambda reset_running_requests, reset_connector: Scheduler.reset_connector_cache(vllm_scheduler),
        reset_mm_cache=lambda: None,
        reset_encoder_cache=lambda: None,
    )
    with pytest.raises(RuntimeError, match="Failed to reset the KV connector cache"):
        EngineCore._reset_caches(engine)


def test_a_save_whose_layer_never_completes_ends_the_session_at_the_next_step(tuttid):
    """Goal: a save given up with a layer still in flight (tuttid stalled past timeout_s while
    the committer waited) would hold its request place and pins for the session's life, and
    requests_max of them would fail every later prepare: the session is ended at the worker's
    next step instead (safe: a save's device only reads vLLM's blocks)."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket, timeout_s=0.5, layers_in_flight=harness.LAYERS)
    try:
        tokens = prompt(16, blocks=2, tail=0)
        worker.fill([3, 4], 16)
        connector = worker.connector
        with saves_stuck_at_the_committer(daemon, worker, [SaveSpec("P", tokens, [3, 4])]):
            deadline = time.monotonic() + FINISH_TIMEOUT_S
            while connector._save_done.get("P") is None:  # the committer gives up on it
                assert time.monotonic() < deadline, "the committer never gave up on P"
                time.sleep(0.01)
        assert connector._dead is None
        result = worker.step(TuttiConnectorMetadata(), finished={"P"})
        assert result["finished_sending"] == {"P"}
        assert connector._dead is not None, "the session holding the unsettled save was not ended"
        wait_no_worker_session(daemon.socket)
    finally:
        worker.shutdown()


class RecordingIssues:
    """A tutti.Store whose prepared requests record each layer issue in `events`."""

    def __init__(self, store, events: list) -> None:
        self._store = store
        self._events = events

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def prepare_retrieve(self, tokens, block_ids, first_block=0):
        return RecordingRequest(self._store.prepare_retrieve(tokens, block_ids, first_block=first_block), self._events)


class RecordingRequest:
    def __init__(self, request, events: list) -> None:
        self._request = request
        self._events = events

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def retrieve_layer(self, layer: int, **options):
        self._events.append(f"retrieve_layer:{layer}")
        return self._request.retrieve_layer(layer, **options)


def test_a_load_into_gpu_kv_waits_for_the_compute_stream_before_its_first_layer(tuttid, monkeypatch):
    """Goal: with GPU KV the blocks a load fills may still be written by kernels of an earlier
    step on vLLM's compute stream (async scheduling: a block freed at step N-1, still written by
    step N's kernels, handed to a request with a tutti hit at N+1), while tuttid writes them from
    another process through CUDA IPC, unordered with that stream: the worker synchronizes the
    current CUDA stream once per step with loads, before the first layer is issued (vLLM's own
    offloading connector makes its copy stream wait for the current stream for the same reason).
    Runs with CPU KV here (no GPU): the worker is told its KV is on a CUDA device and
    torch.cuda.current_stream is replaced by a stand-in recording synchronize; a CUDA run is
    tools/gpu's."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    try:
        tokens = prompt(61, blocks=2, tail=0)
        worker.fill([1, 2], 61)
        worker.save("S", tokens, [1, 2])
        events: list = []

        class Stream:
            def synchronize(self):
                events.append("synchronize")

        devices: list = []

        def current_stream(device=None):
            devices.append(device)
            return Stream()

        monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
        connector = worker.connector
        connector._cuda_device = torch.device("cuda", 0)
        connector._store = RecordingIssues(connector._store, events)
        result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("L", tokens, [20, 21])]))
        assert result["load_errors"] == set()
        assert events and events[0] == "synchronize", events
        assert events.count("synchronize") == 1, events
        assert [event for event in events if event != "synchronize"] == [f"retrieve_layer:{layer}" for layer in range(harness.LAYERS)]
        assert devices == [torch.device("cuda", 0)]
        events.clear()
        worker.step(TuttiConnectorMetadata())
        assert events == [], "a step without loads waits for nothing"
        connector._cuda_device = None
    finally:
        worker.shutdown()


@pytest.mark.parametrize("layers_in_flight", [2, harness.LAYERS], ids=["in-the-step", "at-the-committer"])
def test_saves_on_a_stalled_device_are_given_up_within_about_two_timeouts(tuttid, layers_in_flight):
    """Goal: once one save's layer did not complete (tuttid stalled: its device moves nothing),
    the worker's session is broken (ended at its next step), and the step's other saves, and
    those queued at the committer, are given up as misses at once instead of each waiting its
    own timeout_s twice (a wait, then the settle's): four stalled saves are all reported within
    about two timeouts, not eight (vLLM's execute timeout is 300 s; with timeout_s 30 that was
    240 s of one step). layers_in_flight 2: the step itself waits (save_kv_layer waits for layer
    l-2); 4: every layer is issued and the committer waits. The session is ended at the next
    step."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    timeout_s = 1.0
    worker = LocalWorker(daemon.socket, timeout_s=timeout_s, layers_in_flight=layers_in_flight)
    try:
        saves = []
        for index in range(4):
            blocks = [10 + 2 * index, 11 + 2 * index]
            worker.fill(blocks, 70 + index)
            saves.append(SaveSpec(f"T{index}", prompt(70 + index, blocks=2, tail=0), blocks))
        ids = {save.req_id for save in saves}
        connector = worker.connector
        meta = TuttiConnectorMetadata(saves=saves)
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)  # prepared while tuttid answers
        daemon.pause()
        try:
            started = time.monotonic()
            connector.start_load_kv(None)
            for name in harness.layer_names():
                connector.wait_for_layer_load(name)
                connector.save_kv_layer(name, worker.caches[name], None)
            connector.wait_for_save()
            connector.clear_connector_metadata()
            reported: set = set()
            deadline = started + 8 * timeout_s + 5.0
            while reported != ids and time.monotonic() < deadline:
                reported |= connector.get_finished(ids)[0] or set()
                time.sleep(0.01)
            elapsed_s = time.monotonic() - started
        finally:
            daemon.resume()
        assert reported == ids
        assert elapsed_s < 3.5 * timeout_s, f"four stalled saves took {elapsed_s:.2f} s to be reported"
        assert connector._broken is not None
        worker.step(TuttiConnectorMetadata())
        assert connector._dead is not None, "the broken session was not ended at the next step"
        wait_no_worker_session(daemon.socket)
        with tutti.LookupClient.connect(daemon.socket, model_fingerprint=connector._fingerprint) as lookup:
            for save in saves:
                assert lookup.lookup(save.tokens) == 0, f"{save.req_id}, given up, was committed"
    finally:
        worker.shutdown()


@pytest.mark.parametrize("case", ["full-queue", "room-after-the-deadline"])
def test_a_save_given_up_at_a_full_commit_queue_is_a_miss_not_the_sessions_end(tuttid, monkeypatch, case):
    """Goal: a save that waited out the step's hand-over deadline (back-pressure) is a miss and
    nothing more: its last layers, still in flight, are left to complete (its request is finished
    at a later step), the session is not ended (with CPU KV that would end tutti for the worker
    until it is restarted), and later saves and loads work. And a commit queue with room takes a
    save even when the step's deadline has passed. tuttid is stalled (SIGSTOP) from layer 1 on,
    so the saves' last layers are in flight at the hand-over. full-queue: a committer that fell
    behind (held on an event, its queue given one place: with requests_max places a real store's
    prepare limit keeps it from filling), two saves: the first is queued, the second waits
    timeout_s and is given up. room-after-the-deadline: the step's earlier work used its deadline
    (a sleep before the first hand-over) while the queue has room. Before: the give-up settled the
    save with no wait, found its layer in flight and broke the session (ended at the next step);
    in room-after-the-deadline both saves were misses."""
    import queue

    from tutti.vllm._worker import WorkerSide

    daemon = tuttid(harness.TUTTID_GEOMETRY)
    timeout_s = 1.0
    gate = threading.Event()
    if case == "full-queue":
        commit_loop = WorkerSide._commit_loop

        def held_commit_loop(self):
            gate.wait(FINISH_TIMEOUT_S)
            commit_loop(self)

        monkeypatch.setattr(WorkerSide, "_commit_loop", held_commit_loop)
    else:
        gate.set()
    worker = LocalWorker(daemon.socket, timeout_s=timeout_s, requests_max=2, layers_in_flight=harness.LAYERS)
    connector = worker.connector
    try:
        saves = []
        for index, name in enumerate(["A", "B"]):
            blocks = [10 + 2 * index, 11 + 2 * index]
            worker.fill(blocks, 80 + index)
            saves.append(SaveSpec(name, prompt(80 + index, blocks=2, tail=0), blocks))
        if case == "full-queue":
            connector._commit_queue = queue.Queue(maxsize=1)  # before the held committer's first get
        else:
            hand_to_committer = connector._hand_to_committer

            def late_hand_to_committer(req_id, state, deadline):
                if req_id == "A":
                    time.sleep(max(0.0, deadline - time.monotonic()) + 0.1)
                return hand_to_committer(req_id, state, deadline)

            connector._hand_to_committer = late_hand_to_committer
        with saves_stuck_at_the_committer(daemon, worker, saves):
            assert connector._broken is None, f"the give-up broke the session: {connector._broken}"
            if case == "full-queue":
                assert connector.get_finished({"B"})[0] == {"B"}, "the save given up is reported at once"
        gate.set()
        worker.step(TuttiConnectorMetadata())
        assert connector._dead is None, f"the session was ended: {connector._dead}"
        committed = {"A"} if case == "full-queue" else {"A", "B"}
        for save in saves:
            if save.req_id in committed:
                wait_reported(worker, save.req_id, connector.get_finished({save.req_id})[0] or set())
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while connector._parked:  # finished once its layers completed, at a step
            assert time.monotonic() < deadline, "a parked save was never finished"
            worker.step(TuttiConnectorMetadata())
            time.sleep(0.01)
        assert connector._broken is None and connector._dead is None
        with tutti.LookupClient.connect(daemon.socket, model_fingerprint=connector._fingerprint) as lookup:
            for save in saves:
                expected = 2 if save.req_id in committed else 0  # blocks
                assert lookup.lookup(save.tokens) == expected, save.req_id
        # Later saves and loads work in the same session.
        tokens = prompt(90, blocks=2, tail=0)
        worker.fill([30, 31], 90)
        worker.save("C", tokens, [30, 31])
        result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("L", tokens, [40, 41])]))
        assert result["load_errors"] == set()
        assert all(torch.equal(got, want) for got, want in zip(worker.blocks_bytes([40, 41]), worker.blocks_bytes([30, 31])))
        assert connector._dead is None
    finally:
        gate.set()
        worker.shutdown()


def test_shutdown_settles_its_requests_on_a_stalled_device_within_one_timeout(tuttid):
    """Goal: a worker shut down with requests in flight on a stalled device (tuttid SIGSTOPped)
    gives them up within one timeout_s together, as handle_preemptions does, before it closes the
    store (which waits for the rest): each waiting its own timeout_s, up to requests_max x
    timeout_s (32 x 30 s by default) went by before the close. Three saves with every layer
    issued, timeout_s 1: before, the close came after three timeouts."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    timeout_s = 1.0
    worker = LocalWorker(daemon.socket, timeout_s=timeout_s, layers_in_flight=harness.LAYERS)
    connector = worker.connector
    store = connector._store
    closed_at: list[float] = []

    class RecordingStore:
        """The store, its close recorded and tuttid resumed first (the close then waits for the
        layers still in flight, and confirms the session's end)."""

        def __getattr__(self, name):
            return getattr(store, name)

        def close(self, *args, **kwargs):
            closed_at.append(time.monotonic())
            daemon.resume()
            return store.close(*args, **kwargs)

    saves = []
    for index in range(3):
        blocks = [10 + 2 * index, 11 + 2 * index]
        worker.fill(blocks, 60 + index)
        saves.append(SaveSpec(f"S{index}", prompt(60 + index, blocks=2, tail=0), blocks))
    meta = TuttiConnectorMetadata(saves=saves)
    connector.handle_preemptions(meta)
    connector.bind_connector_metadata(meta)  # prepared while tuttid answers
    daemon.pause()
    try:
        for name in harness.layer_names():
            connector.save_kv_layer(name, worker.caches[name], None)
        assert len(connector._saves) == 3 and all(state.issued == harness.LAYERS for state in connector._saves.values())
        connector._store = RecordingStore()
        started = time.monotonic()
        connector.shutdown()
    finally:
        daemon.resume()
    assert closed_at, "the store was not closed"
    assert closed_at[0] - started < 2 * timeout_s, f"three stalled saves took {closed_at[0] - started:.2f} s to be given up"
    assert store.closed


def test_the_connector_sizes_its_iocbs_for_vllms_longest_request():
    """Goal: the connector's IOCBs are sized from vLLM's max_model_len (in blocks) when its model
    config has one (tutti._engine.iocbs_for), and as before when it has none (these tests'
    configs, which carry no model)."""
    from types import SimpleNamespace

    from tutti.vllm.connector import _blocks_per_request_max

    assert _blocks_per_request_max(SimpleNamespace(model_config=SimpleNamespace(max_model_len=131072)), 16) == 8192
    assert _blocks_per_request_max(SimpleNamespace(model_config=SimpleNamespace(max_model_len=100)), 16) == 7
    assert _blocks_per_request_max(SimpleNamespace(model_config=None), 16) is None
    assert _blocks_per_request_max(harness.vllm_config("unused", 1), 16) is None
