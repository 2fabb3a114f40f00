"""Plays vLLM around `tutti.vllm.TuttiConnector`: its config objects, its scheduler's calls (in the
test's process) and its workers' calls (one process per tensor-parallel rank, as in vLLM), with
vLLM's own classes for everything the connector receives (VllmConfig, KVCacheConfig, Request,
KVCacheBlocks, SchedulerOutput, the KV cache views).

A worker process owns a connector built by vLLM's KVConnectorFactory, its KV caches (allocated in
tuttid's shared memory, viewed the way vLLM's model runner views them) and answers commands sent
over a pipe. Every wait is bounded.
"""

from __future__ import annotations

import atexit
import hashlib
import multiprocessing
import os
import shutil
import tempfile
import traceback
from typing import Any, Optional

import torch

# Four layers: more than the connector's default layers_in_flight (2), so a load or save has
# layers waiting to be issued behind the ones in flight.
LAYERS = 4
KV_HEADS = 2
HEAD_DIM = 64
BLOCK_TOKENS = 16
NUM_BLOCKS = 64
DTYPE = torch.bfloat16
# tuttid's pool formatted for the same per-rank geometry.
TUTTID_GEOMETRY = [
    "--layers", str(LAYERS), "--kv-heads", str(KV_HEADS), "--head-dim", str(HEAD_DIM),
    "--dtype", "bf16", "--tokens-per-block", str(BLOCK_TOKENS),
]  # fmt: skip
REPLY_TIMEOUT_S = 120.0


def layer_names() -> list[str]:
    return [f"model.layers.{layer}.self_attn.attn" for layer in range(LAYERS)]


def vllm_config(
    socket: str, tp_world: int, rank: int = 0, extra: Optional[dict] = None, load_failure_policy: Optional[str] = "recompute"
) -> Any:
    """vLLM's own config objects, with the connector named as on vLLM's command line (with
    "kv_load_failure_policy": "recompute", which the connector requires; None: vLLM's default)."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ParallelConfig, VllmConfig

    policy = {} if load_failure_policy is None else {"kv_load_failure_policy": load_failure_policy}
    transfer = KVTransferConfig(
        kv_connector="TuttiConnector",
        kv_connector_module_path="tutti.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"socket": socket, "timeout_s": 20} if extra is None else extra,
        **policy,
    )
    parallel = ParallelConfig(tensor_parallel_size=tp_world)
    parallel.rank = rank
    return VllmConfig(
        kv_transfer_config=transfer,
        cache_config=CacheConfig(block_size=BLOCK_TOKENS),
        parallel_config=parallel,
        device_config=DeviceConfig(device="cpu"),
    )


def kv_cache_config(num_blocks: int = NUM_BLOCKS, spec: Any = None) -> Any:
    """vLLM's KVCacheConfig for the harness's layers: one group of `spec` (full attention by
    default)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    if spec is None:
        spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=DTYPE)
    page = spec.page_size_bytes
    tensors = [
        KVCacheTensor(size=page * num_blocks, layers=[name], layer_stride=page * num_blocks, block_stride=page)
        for name in layer_names()
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(layer_names=layer_names(), kv_cache_spec=spec)],
    )


def make_connector(config: Any, role: Any, cache_config: Any = None) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.create_connector(config, role, kv_cache_config() if cache_config is None else cache_config)


def request(req_id: str, prompt: list[int]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, prompt, SamplingParams(max_tokens=4), None)


def blocks(block_ids: list[int]) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(block_id) for block_id in block_ids],))


def scheduler_output(
    new: list[tuple[str, list[int], list[int], int, int]] = (),
    cached: list[tuple[str, Optional[list[int]], int, int, bool]] = (),
    finished: set[str] = frozenset(),
    preempted: Optional[set[str]] = None,
) -> Any:
    """vLLM's SchedulerOutput. new: (req_id, prompt, block_ids, num_computed, num_scheduled);
    cached: (req_id, new_block_ids or None, num_computed, num_scheduled, resumed)."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new_requests = [
        NewRequestData(
            req_id=req_id,
            prompt_token_ids=prompt,
            mm_features=[],
            sampling_params=None,
            pooling_params=None,
            block_ids=(block_ids,),
            num_computed_tokens=num_computed,
            lora_request=None,
        )
        for req_id, prompt, block_ids, num_computed, _ in new
    ]
    cached_data = CachedRequestData(
        req_ids=[entry[0] for entry in cached],
        resumed_req_ids={entry[0] for entry in cached if entry[4]},
        new_token_ids=[[] for _ in cached],
        all_token_ids={},
        new_block_ids=[None if entry[1] is None else (entry[1],) for entry in cached],
        num_computed_tokens=[entry[2] for entry in cached],
        num_output_tokens=[0 for _ in cached],
    )
    scheduled = {entry[0]: entry[4] for entry in new}
    scheduled.update({entry[0]: entry[3] for entry in cached})
    return SchedulerOutput(
        scheduled_new_reqs=new_requests,
        scheduled_cached_reqs=cached_data,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
        preempted_req_ids=preempted,
    )


class FailingIssue:
    """A tutti.Request whose layer issues raise (an I/O error at issue); the rest is the real
    request's."""

    def __init__(self, request: Any) -> None:
        self._request = request

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)

    def retrieve_layer(self, layer: int, **options: Any) -> Any:
        raise _tutti().DeviceError(f"injected: layer {layer} failed to issue")

    def store_layer(self, layer: int, **options: Any) -> Any:
        raise _tutti().DeviceError(f"injected: layer {layer} failed to issue")


class FailingWait:
    """A tutti.Request whose layers (only `only_layer`, when given) fail when waited for (an I/O
    error reported by the layer's completion): the real layer is waited for first, so nothing
    of it is left in flight."""

    def __init__(self, request: Any, only_layer: Optional[int] = None) -> None:
        self._request = request
        self._only_layer = only_layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)

    def wait(self, timeout_s: Optional[float] = None) -> Any:
        layer = self._request.wait(timeout_s)
        if self._only_layer is None or layer == self._only_layer:
            raise _tutti().DeviceError(f"injected: layer {layer} failed")
        return layer


class StoreWithFailingIssues:
    """A tutti.Store whose prepared requests fail to issue their layers while `failing` is set
    (with `failing_waits` set instead: fail when their layers are waited for)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.failing = True
        self.failing_waits = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _wrap(self, request: Any) -> Any:
        if self.failing:
            return FailingIssue(request)
        return FailingWait(request) if self.failing_waits else request

    def prepare_retrieve(self, tokens: list[int], block_ids: list[int], first_block: int = 0) -> Any:
        return self._wrap(self._store.prepare_retrieve(tokens, block_ids, first_block=first_block))

    def prepare_store(self, tokens: list[int], block_ids: list[int]) -> Any:
        return self._wrap(self._store.prepare_store(tokens, block_ids))


def _tutti() -> Any:
    import tutti

    return tutti


# ------------------------------------------------------------------------------------------------
# Worker processes
# ------------------------------------------------------------------------------------------------


class Worker:
    """The test's handle on one worker process (one TP rank). With `distributed_init` (a
    `file://` rendezvous), the process joins vLLM's distributed environment first (gloo over loopback, as vLLM's own CPU
    workers do): its TP group is then real, and the workers of a TP group must be started
    together (`start_workers`) and stepped together (`call_all`)."""

    def __init__(self, socket: str, tp_world: int, rank: int, distributed_init: Optional[str] = None, ready: bool = True) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self.process = context.Process(
            target=_worker_main, args=(child, socket, tp_world, rank, distributed_init), daemon=True
        )
        self.process.start()
        self.rank = rank
        if ready:
            self._expect_ready()

    def _expect_ready(self) -> None:
        self.call("ping")

    def call(self, command: str, *args: Any) -> Any:
        self.send(command, *args)
        return self.receive(command)

    def send(self, command: str, *args: Any) -> None:
        self._pipe.send((command, args))

    def receive(self, command: str) -> Any:
        if not self._pipe.poll(REPLY_TIMEOUT_S):
            raise AssertionError(f"worker {self.rank} did not answer {command} within {REPLY_TIMEOUT_S} s")
        status, value = self._pipe.recv()
        if status == "error":
            raise AssertionError(f"worker {self.rank} failed in {command}:\n{value}")
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("shutdown")
            except (AssertionError, OSError, EOFError):
                pass
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


def start_workers(socket: str, tp_world: int) -> list[Worker]:
    """A TP group's worker processes in one real vLLM distributed environment. They meet through
    a file store (vLLM's `file://` init method) in a directory of their own: a port picked free
    here and released could be taken by another process before rank 0 bound it."""
    directory = tempfile.mkdtemp(prefix="tutti-tp-")
    atexit.register(shutil.rmtree, directory, True)
    rendezvous = "file://" + os.path.join(directory, "store")
    workers = [Worker(socket, tp_world, rank, distributed_init=rendezvous, ready=False) for rank in range(tp_world)]
    for worker in workers:
        worker.send("ping")
    for worker in workers:
        worker.receive("ping")
    return workers


def call_all(workers: list[Worker], command: str, *args: Any) -> list[Any]:
    """`command` on every worker at once (a step: the ranks meet in collectives)."""
    for worker in workers:
        worker.send(command, *args)
    return [worker.receive(command) for worker in workers]


def _join_distributed(socket: str, tp_world: int, rank: int, rendezvous: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vllm_config(socket, tp_world, rank)):
        init_distributed_environment(
            world_size=tp_world,
            rank=rank,
            distributed_init_method=rendezvous,
            local_rank=rank,
            backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=tp_world, backend="gloo")


def _worker_main(pipe: Any, socket: str, tp_world: int, rank: int, distributed_init: Optional[str]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    state: dict[str, Any] = {}
    if distributed_init is not None:
        _join_distributed(socket, tp_world, rank, distributed_init)
    while True:
        command, args = pipe.recv()
        try:
            if command == "ping":
                if "connector" not in state:
                    connector = make_connector(vllm_config(socket, tp_world, rank), KVConnectorRole.WORKER)
                    caches = connector.allocate_kv_caches(kv_cache_config())
                    connector.register_kv_caches(caches)
                    state.update(connector=connector, caches=caches)
                value: Any = rank
            elif command == "shutdown":
                state["connector"].shutdown()
                pipe.send(("ok", None))
                return
            else:
                value = globals()[f"_do_{command}"](state, rank, *args)
            pipe.send(("ok", value))
        except BaseException:
            pipe.send(("error", traceback.format_exc()))


def _block_bytes(caches: dict[str, torch.Tensor], name: str, block: int) -> torch.Tensor:
    return caches[name][block].view(torch.uint8).reshape(-1)


class StoreWithFailingLoads:
    """A tutti.Store whose loads fail when their layers are waited for (only their last, with
    `last_layer_only`); its saves are real."""

    def __init__(self, store: Any, last_layer_only: bool = False) -> None:
        self._store = store
        self._only_layer = LAYERS - 1 if last_layer_only else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def prepare_retrieve(self, tokens: list[int], block_ids: list[int], first_block: int = 0) -> Any:
        return FailingWait(self._store.prepare_retrieve(tokens, block_ids, first_block=first_block), self._only_layer)


class StoreLosingItsConnection:
    """A tutti.Store whose prepare_retrieve works `loads_left` times, then raises TimeoutError:
    an exchange that timed out, after which the worker ends its session (its other loads of
    the step are dropped with it)."""

    def __init__(self, store: Any, loads_left: int) -> None:
        self._store = store
        self._loads_left = loads_left

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def prepare_retrieve(self, tokens: list[int], block_ids: list[int], first_block: int = 0) -> Any:
        if self._loads_left == 0:
            raise _tutti().TimeoutError("injected: tuttid did not answer the prepare")
        self._loads_left -= 1
        return self._store.prepare_retrieve(tokens, block_ids, first_block=first_block)


def _do_fail_loads(state: dict, rank: int, loads_left: Optional[int] = None) -> None:
    """From now on this worker's loads fail when waited for; with `loads_left`, the prepares
    after that many raise TimeoutError instead (its session's store wrapped)."""
    connector = state["connector"]
    if loads_left is None:
        connector._store = StoreWithFailingLoads(connector._store)
    else:
        connector._store = StoreLosingItsConnection(connector._store, loads_left)


def _do_fill(state: dict, rank: int, block_ids: list[int], seed: int) -> None:
    """Writes the bytes a forward pass would have produced: different per rank, layer and block."""
    for layer, name in enumerate(layer_names()):
        for position, block in enumerate(block_ids):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + rank * 1009 + layer * 101 + position)
            target = _block_bytes(state["caches"], name, block)
            target.copy_(torch.randint(0, 256, target.shape, dtype=torch.uint8, generator=generator))


def _do_zero(state: dict, rank: int, block_ids: list[int]) -> None:
    for name in layer_names():
        for block in block_ids:
            _block_bytes(state["caches"], name, block).zero_()


def _do_digest(state: dict, rank: int, block_ids: list[int]) -> list[str]:
    """SHA-256 of each (layer, block)'s bytes, layer-major."""
    return [
        hashlib.sha256(_block_bytes(state["caches"], name, block).numpy().tobytes()).hexdigest()
        for name in layer_names()
        for block in block_ids
    ]


def _do_step(state: dict, rank: int, metadata: Any, finished: set[str], layerwise: bool, sync_loads: Optional[bool] = None) -> dict:
    """One engine step of a worker, in the model runner's order (vLLM 0.32's
    kv_connector_model_runner_mixin._get_kv_connector_output and gpu/kv_connector.py):
    handle_preemptions, bind_connector_metadata, start_load_kv before the forward only when the
    step has synchronous loads (SchedulerOutput.has_sync_kv_loads: the scheduler sets it when it
    schedules a request with external tokens and load_kv_async False, i.e. when the step's
    metadata has loads) and after it otherwise, per layer wait_for_layer_load / save_kv_layer
    (inside the forward), wait_for_save, get_transfer_results (→ get_finished),
    get_block_ids_with_load_errors, clear_connector_metadata. `sync_loads` overrides the rule.

    Returns the transfer results, the calls made, and each save's progress just before
    wait_for_save (layers issued, layers completed)."""
    connector = state["connector"]
    calls: list[str] = []
    if sync_loads is None:
        sync_loads = bool(metadata.loads)
    connector.handle_preemptions(metadata)
    connector.bind_connector_metadata(metadata)
    if sync_loads:
        connector.start_load_kv(None)
        calls.append("start_load_kv")
    try:
        if layerwise:
            for name in layer_names():
                connector.wait_for_layer_load(name)
                calls.append(f"wait_for_layer_load:{name}")
                connector.save_kv_layer(name, state["caches"][name], None)
                calls.append(f"save_kv_layer:{name}")
    finally:
        if not sync_loads:
            connector.start_load_kv(None)
            calls.append("start_load_kv")
    saves_before_wait = {
        req_id: (save.issued, list(save.request.layers_completed)) for req_id, save in connector._saves.items()
    }
    connector.wait_for_save()
    calls.append("wait_for_save")
    results = connector.get_transfer_results(set(finished))
    errors = connector.get_block_ids_with_load_errors()
    connector.clear_connector_metadata()
    return {
        "finished_sending": set(results.finished_sending),
        "finished_recving": set(results.finished_recving),
        "load_errors": set(errors),
        "calls": calls,
        "saves_before_wait": saves_before_wait,
    }


def _do_finished(state: dict, rank: int, finished: set[str]) -> set[str]:
    """An empty step's get_finished (vLLM calls it every step)."""
    sending, _ = state["connector"].get_finished(set(finished))
    return set(sending or ())
