"""`TuttiConnector`: a vLLM `KVConnectorBase_V1` over tuttid (docs/vllm.md).

Loaded by vLLM with
    --kv-transfer-config '{"kv_connector": "TuttiConnector", "kv_connector_module_path": "tutti.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"socket": "/run/tutti/tuttid.sock"}}'

vLLM builds one connector in the scheduler process (role SCHEDULER) and one per worker (role
WORKER, one per tensor-parallel rank), each in its own process:
- the scheduler side asks tuttid through a lookup-only session which prefix of a prompt is cached
  on every rank (`lookup_all_ranks`), remembers the blocks vLLM allocated for it, and tells the
  workers in the step's metadata what to load and what to save;
- each worker attaches to tuttid with its own key space (model fingerprint, TP rank and world) and
  moves its own KV layer by layer: a load's layer l+1 is issued when layer l is waited for
  (`wait_for_layer_load`, before layer l's attention), a save's layer l when vLLM hands it over
  (`save_kv_layer`, after layer l's attention); `wait_for_save` hands each save's last layer to a
  committer thread, so a step never waits for a flush: the save is reported done through
  `get_finished` and vLLM keeps the request's blocks until then (`request_finished` returns True).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

import tutti
from tutti._engine import ConfigError, Field, fingerprint_from_config, non_empty, parse_config, positive
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("tutti.vllm")

EXTRA_CONFIG_FIELDS = {
    "socket": Field(str, "the path of tuttid's Unix socket, e.g. /run/tutti/tuttid.sock", required=True, check=non_empty),
    "model_fingerprint": Field(
        str, "64 hex digits naming the model's KV bytes; default: derived from vLLM's model config", check=non_empty
    ),
    "timeout_s": Field(float, "the longest wait for tuttid and for one layer's I/O, seconds", default=30.0, check=positive),
    "requests_max": Field(int, "requests a worker prepares at once", default=32, check=positive),
}

# How long the committer thread waits for one layer before it looks at its queue again.
_COMMIT_POLL_S = 0.05


@dataclass
class LoadSpec:
    """Scheduler → worker: read the cached prefix `tokens` (whole blocks) into `block_ids`."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Scheduler → worker: store the prefix `tokens` (whole blocks) from `block_ids`, layer by layer
    during this step's forward."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]


@dataclass
class TuttiConnectorMetadata(KVConnectorMetadata):
    """One step's instructions for the workers (pickled to them by vLLM)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)


@dataclass
class _SchedulerRequest:
    """The scheduler side's view of one request."""

    prompt: list[int]
    block_ids: list[int] = field(default_factory=list)
    hit_tokens: int = 0
    load_pending: Optional[int] = None  # blocks to load, set after allocation, emitted once
    save_emitted: bool = False


@dataclass
class _WorkerLoad:
    request: Any  # tutti.Request
    block_ids: list[int]
    issued: int = 0  # layers issued
    completed: int = 0  # layers completed


@dataclass
class _WorkerSave:
    request: Any  # tutti.Request
    issued: int = 0
    completed: int = 0


class TuttiConnector(KVConnectorBase_V1):
    """vLLM's KV connector over tuttid. See the module documentation and docs/vllm.md."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from tutti.vllm import check_vllm_version

        check_vllm_version()
        self._config = parse_config(
            "kv_connector_extra_config", self._kv_transfer_config.kv_connector_extra_config, EXTRA_CONFIG_FIELDS
        )
        self._block_size = int(vllm_config.cache_config.block_size)
        parallel = vllm_config.parallel_config
        self._tp_world = int(parallel.tensor_parallel_size)
        self._fingerprint = fingerprint_from_config(self._config["model_fingerprint"], *_model_identity(vllm_config))
        self._timeout_s = float(self._config["timeout_s"])
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker(vllm_config)

    # ==============================================================================================
    # Scheduler side
    # ==============================================================================================

    def _init_scheduler(self) -> None:
        self._lookup = self._connect_lookup()
        if self._lookup.block_tokens != self._block_size:
            block_tokens = self._lookup.block_tokens
            self._lookup.close()
            raise ConfigError(
                f"tuttid's pool stores blocks of {block_tokens} tokens but vLLM's block size is "
                f"{self._block_size}: start vLLM with --block-size {block_tokens}, or format the pool for "
                f"{self._block_size}-token blocks"
            )
        self._requests: dict[str, _SchedulerRequest] = {}
        self.lookup_failures = 0
        self.lookup_reconnects = 0

    def _connect_lookup(self) -> Any:
        return tutti.LookupClient.connect(
            self._config["socket"],
            model_fingerprint=self._fingerprint,
            tp_rank=0,
            tp_world=self._tp_world,
            client_name="vllm-scheduler",
            timeout_s=self._timeout_s,
        )

    def _lookup_all_ranks(self, tokens: list[int]) -> int:
        """The cached prefix on every rank, in blocks. A scheduler idle longer than tuttid's lease
        (no requests for a while) finds its session ended: it connects again, once per call."""
        try:
            return self._lookup.lookup_all_ranks(tokens)
        except tutti.Disconnected:
            self._lookup.close()
            self._lookup = self._connect_lookup()
            self.lookup_reconnects += 1
            return self._lookup.lookup_all_ranks(tokens)

    def _scheduler_request(self, request: "Request") -> _SchedulerRequest:
        state = self._requests.get(request.request_id)
        if state is None:
            state = _SchedulerRequest(prompt=list(request.prompt_token_ids or []))
            self._requests[request.request_id] = state
        return state

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Tokens beyond `num_computed_tokens` that every rank can load from tutti: whole blocks of
        the prompt, never its last token (vLLM computes at least one token to sample from).
        Loads are synchronous (layer by layer during the step's forward): the bool is False.
        A daemon that does not answer is a miss (logged and counted), not a failed request."""
        state = self._scheduler_request(request)
        usable_blocks = max(0, len(state.prompt) - 1) // self._block_size
        if usable_blocks == 0:
            return 0, False
        try:
            hit_blocks = self._lookup_all_ranks(state.prompt[: usable_blocks * self._block_size])
        except tutti.Error as error:
            self.lookup_failures += 1
            logger.warning("tutti lookup for request %s failed, treated as a miss: %s", request.request_id, error)
            return 0, False
        state.hit_tokens = min(hit_blocks, usable_blocks) * self._block_size
        return max(0, state.hit_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Remembers the request's blocks; with external tokens, a load of the cached prefix into
        them for the next metadata."""
        state = self._scheduler_request(request)
        state.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens > 0:
            # The store reads a prefix from its first block: blocks vLLM already holds are read
            # again with the same bytes (see docs/vllm.md, "Loads").
            state.load_pending = state.hit_tokens // self._block_size

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's loads (allocated since the last step), saves (requests whose prompt is
        complete by the end of this step: its whole blocks) and preemptions."""
        meta = TuttiConnectorMetadata()
        preempted = set(scheduler_output.preempted_req_ids or ())
        meta.preempted_req_ids = preempted
        for req_id in preempted:
            state = self._requests.get(req_id)
            if state is not None:
                # Its blocks are freed; a resumed request is allocated (and saved) anew.
                state.block_ids = []
                state.load_pending = None
                state.save_emitted = False

        scheduled: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                state = _SchedulerRequest(prompt=list(new.prompt_token_ids or []))
                self._requests[new.req_id] = state
            state.block_ids = list(new.block_ids[0])
            scheduled.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_block_ids = cached.new_block_ids[index]
            if new_block_ids is not None:
                if req_id in cached.resumed_req_ids:
                    state.block_ids = list(new_block_ids[0])
                else:
                    state.block_ids.extend(new_block_ids[0])
            scheduled.append((req_id, cached.num_computed_tokens[index]))

        for req_id, num_computed in scheduled:
            state = self._requests[req_id]
            if state.load_pending:
                blocks = state.load_pending
                meta.loads.append(
                    LoadSpec(req_id, state.prompt[: blocks * self._block_size], state.block_ids[:blocks])
                )
            state.load_pending = None
            done_tokens = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full_blocks = len(state.prompt) // self._block_size
            if not state.save_emitted and done_tokens >= len(state.prompt) and full_blocks > 0:
                if len(state.block_ids) >= full_blocks:
                    meta.saves.append(
                        SaveSpec(req_id, state.prompt[: full_blocks * self._block_size], state.block_ids[:full_blocks])
                    )
                    state.save_emitted = True
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Workers' transfer results: vLLM itself frees a request's blocks once every worker named
        it in finished_sending; nothing to keep here beyond logging failed loads."""
        if getattr(connector_output, "invalid_block_ids", None):
            logger.info("tutti: %d blocks failed to load and are recomputed", len(connector_output.invalid_block_ids))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """True (keep the blocks) when a save of this request was handed to the workers: they
        report it through get_finished once its last layer completed (and it was committed)."""
        state = self._requests.pop(request.request_id, None)
        return (state is not None and state.save_emitted), None

    # ==============================================================================================
    # Worker side
    # ==============================================================================================

    def _init_worker(self, vllm_config: "VllmConfig") -> None:
        self._tp_rank = _tp_rank(vllm_config, self._tp_world)
        self._store = tutti.Store.attach(
            self._config["socket"],
            model_fingerprint=self._fingerprint,
            tp_rank=self._tp_rank,
            tp_world=self._tp_world,
            client_name=f"vllm-worker-{self._tp_rank}",
            timeout_s=self._timeout_s,
            requests_max=self._config["requests_max"],
        )
        if self._store.block_tokens != self._block_size:
            block_tokens = self._store.block_tokens
            self._store.close()
            raise ConfigError(
                f"tuttid's pool stores blocks of {block_tokens} tokens but vLLM's block size is "
                f"{self._block_size}: start vLLM with --block-size {block_tokens}"
            )
        self._layer_index: dict[str, int] = {}
        self._cuda_device: Optional[torch.device] = None
        self._layer_names: list[str] = []
        self._layers = 0
        self._loads: dict[str, _WorkerLoad] = {}
        self._saves: dict[str, _WorkerSave] = {}
        self._failed_block_ids: set[int] = set()
        # Saves past this worker's step: None while the committer holds one, then whether it was
        # committed. Kept until vLLM names the request finished and get_finished reports it.
        self._save_done: dict[str, Optional[bool]] = {}
        self._finished_req_ids: set[str] = set()
        self._lock = threading.Lock()
        self._commit_queue: queue.Queue = queue.Queue(maxsize=self._config["requests_max"])
        self._committer = threading.Thread(target=self._commit_loop, name="tutti-vllm-commit", daemon=True)
        self._committer.start()

    def allocate_kv_caches(self, kv_cache_config: "KVCacheConfig") -> dict[str, torch.Tensor]:
        """KV caches in tuttid's shared memory, in vLLM's own per-layer view (`[blocks, heads,
        slots, content]` built by vLLM's `create_kv_cache_views`, layout LBHNC), for
        `register_kv_caches`. This is what a CPU deployment (and the tests) hand to vLLM as its
        KV caches: tuttid can map only memory shared with it. On a GPU vLLM allocates its KV
        caches itself (one CUDA allocation) and `register_kv_caches` registers them through
        CUDA IPC (docs/vllm.md)."""
        from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout

        names, spec = _attention_layers(kv_cache_config)
        layout = self._store.allocate_kv(kv_cache_config.num_blocks, "paged")
        caches: dict[str, torch.Tensor] = {}
        for index, name in enumerate(names):
            raw = torch.from_dlpack(layout.layer(index)).view(torch.int8)
            page = raw.numel() // kv_cache_config.num_blocks
            placement = KVCacheTensor(size=raw.numel(), layers=[name], layer_stride=raw.numel(), block_stride=page)
            (view,) = create_kv_cache_views(raw, spec, kv_cache_config.num_blocks, KVCacheLayout.LBHNC, placement)
            caches[name] = view
        return caches

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Registers vLLM's per-layer KV caches, in model layer order, as tutti's "paged" layout
        (a layer's block is one dense run holding its K and V). CUDA caches (vLLM 0.32 allocates
        every layer in one allocation) go to tuttid as device memory (CUDA IPC; tuttid started
        with --device-memory cuda); CPU caches must be this connector's allocate_kv_caches."""
        from vllm.model_executor.models.utils import extract_layer_index

        ordered = sorted(kv_caches, key=extract_layer_index)
        geometry = self._store.geometry
        if len(ordered) != geometry.layers:
            raise ConfigError(
                f"vLLM registered {len(ordered)} attention layers but tuttid's pool is formatted for "
                f"{geometry.layers}: format the pool for this model (tuttid --format with its geometry)"
            )
        first = kv_caches[ordered[0]]
        # GPU KV: a save's layer must be complete on the GPU before tuttid copies it out.
        self._cuda_device = first.device if first.device.type == "cuda" else None
        try:
            self._store.register_kv(tutti.KvLayout.paged([kv_caches[name] for name in ordered]))
        except tutti.UnsupportedMemory as error:
            if self._cuda_device is not None:
                hint = (
                    "vLLM's GPU KV caches go to tuttid through CUDA IPC: start tuttid with --device-memory cuda "
                    "on emu: devices, and keep vLLM's KV cache in one cudaMalloc allocation (not PyTorch's "
                    "expandable segments)"
                )
            else:
                hint = (
                    "CPU KV caches vLLM allocated itself cannot be mapped by tuttid: allocate them with "
                    "TuttiConnector.allocate_kv_caches"
                )
            raise tutti.UnsupportedMemory(f"{error}. {hint}") from error
        self._layer_index = {name: index for index, name in enumerate(ordered)}
        self._layer_names = ordered
        self._layers = len(ordered)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before a preempted request's blocks are reused: its load or save stops after the layer
        in flight (waited for); nothing of an unfinished save becomes visible."""
        assert isinstance(kv_connector_metadata, TuttiConnectorMetadata)
        for req_id in kv_connector_metadata.preempted_req_ids:
            load = self._loads.pop(req_id, None)
            if load is not None:
                self._settle(load.request)
            save = self._saves.pop(req_id, None)
            if save is not None:
                self._settle(save.request)
            with self._lock:
                # A save already with the committer keeps its blocks until its layer completed:
                # wait for that outcome, then forget it (the resumed request saves anew).
                pending = req_id in self._save_done and req_id not in self._finished_req_ids
            if pending:
                self._wait_for_commit(req_id)
                with self._lock:
                    self._save_done.pop(req_id, None)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Prepares this step's loads and saves; issues every load's layer 0."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, TuttiConnectorMetadata)
        for load in meta.loads:
            try:
                request = self._store.prepare_retrieve(load.tokens, load.block_ids)
            except tutti.Error as error:
                logger.warning("tutti: load of request %s failed to prepare (%s); its blocks are recomputed", load.req_id, error)
                self._failed_block_ids.update(load.block_ids)
                continue
            state = _WorkerLoad(request, load.block_ids)
            self._loads[load.req_id] = state
            self._issue_load(load.req_id, state)
        for save in meta.saves:
            try:
                request = self._store.prepare_store(save.tokens, save.block_ids)
            except tutti.Error as error:
                # A save that cannot start is a future miss, not a failure of the step.
                logger.warning("tutti: save of request %s not started: %s", save.req_id, error)
                with self._lock:
                    self._save_done[save.req_id] = False
                continue
            if request.new_blocks == 0:
                request.finish()
                with self._lock:
                    self._save_done[save.req_id] = True
                continue
            self._saves[save.req_id] = _WorkerSave(request)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Blocks until every load of this step has layer `layer_name` in vLLM's blocks, issuing
        each load's next layer as soon as the previous completes."""
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for req_id, state in list(self._loads.items()):
            try:
                while state.completed <= layer:
                    state.request.wait(self._timeout_s)
                    state.completed += 1
                    self._issue_load(req_id, state)
            except tutti.Error as error:
                self._fail_load(req_id, state, error)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        """Issues the writes of layer `layer_name` for every save of this step (after the previous
        layer of that save completed: one layer in flight per request)."""
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        if self._saves:
            self._gpu_writes_done()
        for req_id, state in list(self._saves.items()):
            try:
                while state.issued <= layer:
                    self._advance_save(state)
            except tutti.Error as error:
                self._fail_save(req_id, state, error)

    def wait_for_save(self) -> None:
        """Issues what save_kv_layer did not (all layers, when vLLM called it for none), and hands
        each save, its last layer possibly in flight, to the committer thread."""
        # Loads are synchronous: one whose later layers vLLM did not wait for ends in this step.
        if self._layers:
            self.wait_for_layer_load(self._layer_names[-1])
        if self._saves:
            self._gpu_writes_done()
        for req_id, state in list(self._saves.items()):
            try:
                while state.issued < self._layers:
                    self._advance_save(state)
            except tutti.Error as error:
                self._fail_save(req_id, state, error)
                continue
            del self._saves[req_id]
            with self._lock:
                self._save_done[req_id] = None  # with the committer
            # Bounded: a full queue waits here for the committer (back-pressure, not a leak).
            self._commit_queue.put((req_id, state.request))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Requests (named finished now or earlier) whose save is over: committed, or failed and
        given up (their blocks can be freed either way). Loads are synchronous: none."""
        with self._lock:
            self._finished_req_ids |= finished_req_ids
            done = {req_id for req_id in self._finished_req_ids if self._save_done.get(req_id) is not None}
            for req_id in done:
                del self._save_done[req_id]
            # Keep only requests whose save is still with the committer; a finished request
            # without a save of this worker's has nothing to report.
            self._finished_req_ids = {req_id for req_id in self._finished_req_ids if req_id in self._save_done}
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads that failed since the last call (vLLM recomputes them)."""
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def shutdown(self) -> None:
        """Stops the committer (after the saves it holds), then closes the store or the lookup
        session."""
        if self._role == KVConnectorRole.SCHEDULER:
            self._lookup.close()
            return
        self._commit_queue.put(None)
        self._committer.join(timeout=self._timeout_s)
        for state in list(self._loads.values()) + list(self._saves.values()):
            self._settle(state.request)
        self._store.close()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: wait_for_layer_load and save_kv_layer run between layers, which a full CUDA graph
        would skip on replay."""
        return True

    # ----------------------------------------------------------------------------------------------

    def _gpu_writes_done(self) -> None:
        """With GPU KV: waits until the work queued on the current CUDA stream (the layers'
        attention, which wrote the KV a save moves) has completed, since tuttid copies the
        bytes as they are in GPU memory. A no-op for CPU KV."""
        if self._cuda_device is not None:
            torch.cuda.current_stream(self._cuda_device).synchronize()

    def _issue_load(self, req_id: str, state: _WorkerLoad) -> None:
        if state.issued < self._layers:
            state.request.retrieve_layer(state.issued)
            state.issued += 1
        elif state.completed >= self._layers:
            state.request.finish()
            del self._loads[req_id]

    def _advance_save(self, state: _WorkerSave) -> None:
        if state.issued > state.completed:
            state.request.wait(self._timeout_s)
            state.completed += 1
        state.request.store_layer(state.issued)
        state.issued += 1

    def _fail_load(self, req_id: str, state: _WorkerLoad, error: Exception) -> None:
        logger.warning("tutti: load of request %s failed at layer %d (%s); its blocks are recomputed", req_id, state.issued - 1, error)
        self._failed_block_ids.update(state.block_ids)
        self._loads.pop(req_id, None)
        self._settle(state.request)

    def _fail_save(self, req_id: str, state: _WorkerSave, error: Exception) -> None:
        logger.warning("tutti: save of request %s failed (%s); nothing of it becomes visible", req_id, error)
        self._saves.pop(req_id, None)
        self._settle(state.request)
        with self._lock:
            self._save_done[req_id] = False

    def _settle(self, request: Any) -> None:
        """Ends a request that is given up: waits for its layer in flight (the device may still
        move those blocks' bytes), then finishes it without committing."""
        try:
            if request.layer_in_flight is not None:
                request.wait(self._timeout_s)
        except tutti.Error as error:
            logger.error("tutti: a layer of an abandoned request did not complete: %s", error)
        try:
            request.finish()
        except tutti.Error as error:
            logger.error("tutti: an abandoned request could not be finished: %s", error)

    def _wait_for_commit(self, req_id: str) -> None:
        # The committer sets _save_done[req_id] to a bool once the save's I/O is over.
        for _ in range(int(self._timeout_s / _COMMIT_POLL_S) + 1):
            with self._lock:
                if self._save_done.get(req_id) is not None:
                    return
            time.sleep(_COMMIT_POLL_S)
        logger.error("tutti: the save of preempted request %s did not finish in %.1f s", req_id, self._timeout_s)

    def _commit_loop(self) -> None:
        while True:
            item = self._commit_queue.get()
            if item is None:
                return
            req_id, request = item
            committed = False
            try:
                request.wait(self._timeout_s)
                request.commit()
                committed = True
            except tutti.Error as error:
                logger.warning("tutti: save of request %s not committed: %s", req_id, error)
                self._settle(request)
            with self._lock:
                self._save_done[req_id] = committed


def _tp_rank(vllm_config: "VllmConfig", tp_world: int) -> int:
    """This worker's tensor-parallel rank: vLLM's TP group once initialised, else the parallel
    config's rank (set per worker by vLLM before the connector is built)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

        if model_parallel_is_initialized():
            return int(get_tensor_model_parallel_rank())
    except ImportError:
        pass
    return int(vllm_config.parallel_config.rank) % tp_world


def _model_identity(vllm_config: "VllmConfig") -> list[Any]:
    """What changes a model's KV bytes, for the default fingerprint."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parts: list[Any] = ["vllm", cache.block_size, str(cache.cache_dtype)]
    if model is not None:
        parts += [model.model, str(model.revision), str(model.dtype), str(model.quantization)]
    return parts


def _attention_layers(kv_cache_config: "KVCacheConfig") -> tuple[list[str], Any]:
    """The layer names (model order) and spec of the one full-attention group tutti stores."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = [group for group in kv_cache_config.kv_cache_groups if isinstance(group.kv_cache_spec, AttentionSpec)]
    if len(groups) != 1:
        raise ConfigError(
            f"tutti stores models with one group of attention layers; this model has {len(groups)} "
            "(hybrid models are not supported)"
        )
    return sorted(groups[0].layer_names, key=extract_layer_index), groups[0].kv_cache_spec
