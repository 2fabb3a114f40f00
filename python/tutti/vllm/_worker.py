"""The worker side of `tutti.vllm.TuttiConnector` (role WORKER, one per tensor-parallel rank):
attaches to tuttid in the rank's key space, registers vLLM's KV caches and moves each step's
loads and saves layer by layer; a committer thread commits the saves (see the connector's module
documentation)."""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

import tutti
from tutti._engine import ConfigError, wait_out_layer
from tutti.vllm.metadata import SaveSpec, TuttiConnectorMetadata, TuttiWorkerMetadata, check_block_size, connection_lost
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("tutti.vllm")

# How long the committer thread waits for one layer before it looks at its queue again.
_COMMIT_POLL_S = 0.05
# How long a hand-over to a full commit queue waits before it checks that the committer runs.
_COMMIT_PUT_CHECK_S = 1.0
# handle_preemptions waits past its deadline for a preempted save whose commit the committer
# has begun (`_committing_now`: the commit may not have read vLLM's blocks for the payload CRCs
# yet), as long as the commit's own bounds allow, counted from the deadline or, if later, from
# when handle_preemptions began to wait for the mark (until then its own exchanges for the
# preempted requests before this one may hold the store's lock): the store's lock
# behind one other exchange (timeout_s), the keep-alive ping's connection (timeout_s + 1 s, the
# binding's lock_with_connection), the commit's own exchange (timeout_s) and, the mark being
# kept until the save is settled, a failed commit's finish (timeout_s): 4 x timeout_s + 1 s,
# plus this margin. Past that the session is ended (`_release_committing_save`). The waits
# add up per marked save, one after another.
_COMMIT_WAIT_MARGIN_S = 1.0
# A worker whose session ended and whose KV memory can be registered again (device memory)
# opens a new session at its next step; after a failed try, not before a back-off that doubles
# from the first to the last value.
_REATTACH_BACKOFF_FIRST_S = 1.0
_REATTACH_BACKOFF_MAX_S = 30.0
# How long shutdown waits for a re-attach in flight (it closes its store itself after).
_REATTACH_JOIN_S = 2.0


class KvMemoryUnsafe(RuntimeError):
    """A layer of a load could not be settled and nothing confirmed that its memory is no longer
    written: tuttid did not confirm that the worker's session ended (its queue pairs deleted),
    or the tier's pool could not delete its queue pairs. vLLM's KV blocks (or chunk rows) may
    still be written: the worker (or tier) stops rather than hand them back to vLLM."""


@dataclass
class _WorkerLoad:
    request: Any  # tutti.Request
    block_ids: list[int]  # the blocks it fills: the prefix's from LoadSpec.first_block on
    issued: int = 0  # layers issued
    completed: int = 0  # layers completed


@dataclass
class _WorkerSave:
    request: Any  # tutti.Request
    token: int  # this save of the request (a resumed request is saved anew, with another token)
    issued: int = 0
    completed: int = 0


@dataclass
class _ParkedSave:
    """A save given up at a full commit queue (a miss) whose last layers may still be in flight:
    finished once they complete; `since` (time.monotonic()) is when `layer`, its oldest layer in
    flight, was first seen in flight, which gets timeout_s to complete."""

    request: Any  # tutti.Request
    layer: Optional[int]
    since: float


class WorkerSide:
    """TuttiConnector's worker-side methods (a mixin: TuttiConnector sets the shared fields and
    calls `_init_worker` in each worker process)."""

    _config: dict[str, Any]
    _block_size: int
    _tp_world: int
    _fingerprint: bytes
    _fingerprint_inputs: str
    _kv_layout: str
    _timeout_s: float
    _iocbs: int

    def _init_worker(self, vllm_config: "VllmConfig") -> None:
        # KVConnectorBase_V1 keeps the KVCacheConfig vLLM built the connector with.
        _refuse_kv_writes_before_preemptions(vllm_config, getattr(self, "_kv_cache_config", None))
        self._tp_rank = _tp_rank(vllm_config, self._tp_world)
        # Layers of one load or save in flight at once: a load's next layers are read while
        # vLLM runs the current one's attention, a save's while it runs the next layers'.
        self._layers_ahead = int(self._config["layers_in_flight"])
        self._store = self._attach()
        # Whether the KV caches are tuttid's window (allocate_kv_caches): they go with the
        # session. Otherwise (device memory) the registered tensors, for a new session.
        self._kv_window = False
        self._kv_tensors: Optional[list[torch.Tensor]] = None
        self._reattach_at = 0.0
        self._reattach_backoff_s = 0.0
        self.reattaches = 0
        # A try at a new session runs on a thread of its own (an attach waits up to timeout_s for
        # tuttid, which a step must not): its result, (store, None) or (None, error), is taken
        # up at the next step (`_reattach_if_due`). After shutdown the thread closes what it
        # opened itself.
        self._reattach_thread: Optional[threading.Thread] = None
        self._reattached: Optional[tuple[Any, Optional[BaseException]]] = None
        self._stopping = False
        # Whether the scheduler's model fingerprint was compared with this worker's (once, at the
        # first metadata carrying it), and why they differ (raised at every later bind).
        self._fingerprint_checked = False
        self._fingerprint_mismatch: Optional[str] = None
        self._layer_index: dict[str, int] = {}
        self._cuda_device: Optional[torch.device] = None
        self._layer_names: list[str] = []
        self._layers = 0
        self._loads: dict[str, _WorkerLoad] = {}
        self._saves: dict[str, _WorkerSave] = {}
        self._failed_block_ids: set[int] = set()
        # Blocks whose load failed on this rank in this step and in the step before, and whether
        # those steps' metadata had loads: a save over such a block (another request sharing
        # them through vLLM's prefix cache; with async scheduling, scheduled a step before vLLM
        # learned of the failure) is cancelled on every rank (`_agree_on_loads`). The scheduler
        # side builds later steps' metadata knowing the failure and saves no such request.
        self._step_failed_blocks: set[int] = set()
        self._last_step_failed_blocks: set[int] = set()
        self._step_had_loads = False
        self._last_step_had_loads = False
        # Whether this step's loads were started (by start_load_kv, or by the first
        # wait_for_layer_load if vLLM had not called it before the forward), and its saves
        # prepared (`_start_step`: after the loads, which need their request places more).
        self._loads_started = False
        self._saves_prepared = False
        # Requests whose load failed on this rank before the step's saves were prepared: their
        # saves of the step are misses, never prepared (`_prepare_saves`).
        self._step_failed_loads: set[str] = set()
        # Requests that loaded blocks and have not saved yet (nor finished, nor been preempted):
        # whether this rank's load completed. Anything but a completed load counts as failed,
        # and the request's save, in that step or a later one, is cancelled (on every rank:
        # `_agree_on_loads`). Every rank keeps the same keys (they follow the metadata).
        self._load_completed: dict[str, bool] = {}
        # Saves past this worker's step: None while the committer holds one, then whether it was
        # committed. Kept until vLLM names the request finished and get_finished reports it.
        self._save_done: dict[str, Optional[bool]] = {}
        # The request's current save (a preempted request is saved anew): results of older ones
        # are ignored, and a cancelled one is never committed.
        self._save_token: dict[str, int] = {}
        # The saves the committer holds and has not taken up yet, by token: (request, session).
        # handle_preemptions polls a preempted one's layers itself, and takes it over to commit
        # it, rather than wait behind the committer's other saves; the committer takes a save up
        # (`_take_up`) before it ends it. Tokens of the saves handle_preemptions took over: the
        # committer skips them.
        self._committing: dict[int, tuple[Any, int]] = {}
        self._taken_over: set[int] = set()
        self._cancelled: set[int] = set()
        # The token of the save the committer is committing: set under the lock together with
        # its check of `_cancelled`, so that past it the save can no longer be cancelled;
        # handle_preemptions waits for such a save instead (its commit reads vLLM's blocks).
        self._committing_now: Optional[int] = None
        self._tokens = itertools.count(1)
        self._finished_req_ids: set[str] = set()
        # Why the worker's tuttid session is over (None: it is not); then every load is reported
        # failed and every save is a miss, without a word to tuttid.
        self._dead: Optional[str] = None
        # Whether the scheduler side was last told that the session is ended
        # (`build_connector_worker_meta`).
        self._reported_dead = False
        # A daemon exchange (of any thread) left the connection unusable: the session is ended
        # at the worker's next step (the main thread owns the requests).
        self._broken: Optional[str] = None
        # Counts the worker's tuttid sessions (a new one at each re-attach), read by the
        # committer under the lock: a late failure of an old session's request is not the new one's.
        self._session = 0
        # Requests of saves given up in a broken session without a wait or an exchange (either
        # could take timeout_s each): kept until the session is ended, which settles them.
        self._abandoned: list[Any] = []
        # Saves given up at a full commit queue (back-pressure): misses, their requests finished
        # once their layers complete (`_settle_parked`, at each step). Back-pressure says
        # nothing about the session: only a layer that does not complete in its own timeout_s
        # ends it.
        self._parked: list[_ParkedSave] = []
        self._lock = threading.Lock()
        self._commit_queue: queue.Queue = queue.Queue(maxsize=self._config["requests_max"])
        self._committer = threading.Thread(target=self._commit_loop, name="tutti-vllm-commit", daemon=True)
        self._committer.start()

    def _attach(self) -> Any:
        """A tuttid session in this rank's key space. Raises ConfigError for a pool of another
        block size."""
        store = tutti.Store.attach(
            self._config["socket"],
            model_fingerprint=self._fingerprint,
            tp_rank=self._tp_rank,
            tp_world=self._tp_world,
            client_name=f"vllm-worker-{self._tp_rank}",
            timeout_s=self._timeout_s,
            requests_max=self._config["requests_max"],
            layers_in_flight=self._layers_ahead,
            iocbs=self._iocbs,
            queue_depth=self._config["queue_depth"],
            verify_retrieves=self._config["verify_retrieves"],
        )
        check_block_size(store, self._block_size, format_hint=False)
        return store

    def allocate_kv_caches(self, kv_cache_config: "KVCacheConfig") -> dict[str, torch.Tensor]:
        """KV caches in tuttid's shared memory, in vLLM's own per-layer view (`[blocks, heads,
        slots, content]` built by vLLM's `create_kv_cache_views`, in vLLM's resolved layout,
        LBHNC when none was resolved), for `register_kv_caches`. This is what a CPU deployment
        (and the tests) hand to vLLM as its KV caches: tuttid can map only memory shared with it.
        On a GPU vLLM allocates its KV caches itself (one CUDA allocation) and
        `register_kv_caches` registers them through CUDA IPC (docs/vllm.md)."""
        from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout

        names, spec = _attention_layers(kv_cache_config)
        kv_layout = KVCacheLayout[self._kv_layout]
        if not (kv_layout.is_layer_compact and kv_layout.is_block_compact):
            raise ConfigError(
                f"allocate_kv_caches lays each layer out on its own (tutti's paged layout); vLLM resolved the KV "
                f"cache layout {self._kv_layout}: set VLLM_KV_CACHE_LAYOUT=LBHNC or LBNHC"
            )
        layout = self._store.allocate_kv(kv_cache_config.num_blocks, "paged")
        self._kv_window = True
        caches: dict[str, torch.Tensor] = {}
        for index, name in enumerate(names):
            raw = torch.from_dlpack(layout.layer(index)).view(torch.int8)
            page = raw.numel() // kv_cache_config.num_blocks
            placement = KVCacheTensor(size=raw.numel(), layers=[name], layer_stride=raw.numel(), block_stride=page)
            (view,) = create_kv_cache_views(raw, spec, kv_cache_config.num_blocks, kv_layout, placement)
            caches[name] = view
        return caches

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Registers vLLM's per-layer KV caches, in model layer order, as tutti's "paged" layout
        (a layer's block is one dense run holding its K and V). CUDA caches (vLLM 0.32 allocates
        every layer in one allocation) go to tuttid as device memory (CUDA IPC; tuttid started
        with --device-memory cuda); CPU caches must be this connector's allocate_kv_caches.
        Caches whose heads/slots order is not the one the model fingerprint names are refused
        (a pool written in one order must not be read in the other)."""
        from vllm.model_executor.models.utils import extract_layer_index

        ordered = sorted(kv_caches, key=extract_layer_index)
        geometry = self._store.geometry
        if len(ordered) != geometry.layers:
            raise ConfigError(
                f"vLLM registered {len(ordered)} attention layers but tuttid's pool is formatted for "
                f"{geometry.layers}: format the pool for this model (tuttid --format with its geometry)"
            )
        first = kv_caches[ordered[0]]
        order = _heads_slots_order(first)
        expected = "HN" if self._kv_layout.index("H") < self._kv_layout.index("N") else "NH"
        if order is not None and order != expected:
            raise ConfigError(
                f"vLLM's KV caches hold a block's {'heads outside slots' if order == 'HN' else 'slots outside heads'}, "
                f"but the model fingerprint names the layout {self._kv_layout}: vLLM's resolved layout "
                "(cache_config.kv_cache_layout) must be the one its caches use"
            )
        # GPU KV: a save's layer must be complete on the GPU before tuttid copies it out.
        self._cuda_device = first.device if first.device.type == "cuda" else None
        tensors = [kv_caches[name] for name in ordered]
        try:
            self._store.register_kv(tutti.KvLayout.paged(tensors))
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
        self._kv_tensors = None if self._kv_window else tensors
        self._layer_index = {name: index for index, name in enumerate(ordered)}
        self._layer_names = ordered
        self._layers = len(ordered)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before a preempted request's blocks are reused: its load or save stops after the layers
        in flight (waited for); nothing of an unfinished save becomes visible. A load whose layer
        does not complete ends the session first (the blocks may still be written); a save with
        the committer whose layer does not complete in time is cancelled (never committed: its
        bytes may have been read after vLLM reused the blocks), while one whose layers all
        completed is committed here, taken over from the committer, whose backlog of other
        saves is not waited for (`_release_committing_save`: a commit may read vLLM's blocks, for
        the payload CRCs). The waits share one timeout_s, however many requests were preempted:
        what is not settled by then is handled as above, but for a save whose commit the
        committer has begun, waited for past the deadline within the commit's own bounds (up to
        4 x timeout_s + 2 s from the deadline or, if later, from when this call reaches the save,
        for each such save; one that outlasts them ends the session:
        `_release_committing_save`). That is not the whole bound. A load still in flight at
        that deadline ends the session (`_end_session`, once per call): its
        `Store.close(timeout_s)` waits up to timeout_s for the layers still in flight, then up to
        5 s for tuttid's count of leaked queue pairs, up to 2 s for the commands still on the
        store's queue pairs (their retirement) and up to 5 s from the connection's close for
        tuttid to confirm that the session ended: up to about timeout_s + 12 s more in all
        (docs/python.md). And each exchange with
        tuttid takes up to timeout_s of its own: a settled request's finish, a taken-over save's
        commit, the committer's commit (which holds the store's lock: this call's waits wait
        behind it), a keep-alive
        ping under way (the close waits for it); the first that runs out leaves the connection
        unusable, so the later ones fail at once. With a stalled device and tuttid the call may
        thus take up to about 3 x timeout_s + 12 s. A slow tuttid, not stalled (each answer just
        within timeout_s), leaves the connection usable: each settled load's or save's finish
        (or a taken-over save's commit) may then take up to timeout_s on top, one per load or save
        settled (a request preempted while loading and saving has both: up to two)."""
        assert isinstance(kv_connector_metadata, TuttiConnectorMetadata)
        deadline = time.monotonic() + self._timeout_s
        stop: Optional[BaseException] = None  # KeyboardInterrupt, SystemExit: raised once all are handled
        for req_id in kv_connector_metadata.preempted_req_ids:
            self._load_completed.pop(req_id, None)  # resumed: allocated, loaded and saved anew
            load = self._loads.pop(req_id, None)
            if load is not None and not self._settle(load.request, deadline):
                self._end_session(f"a layer of preempted request {req_id}'s load did not complete", load_in_flight=True)
            save = self._saves.pop(req_id, None)
            if save is not None:
                self._settle_save(save.request, deadline=deadline)  # its device only reads vLLM's blocks; never committed
            stopped = self._release_committing_save(req_id, deadline)
            if stop is None:
                stop = stopped
            with self._lock:
                # Forgotten: the resumed request saves anew, and a late result of this save is
                # ignored (its token is no longer the request's).
                self._save_done.pop(req_id, None)
                self._save_token.pop(req_id, None)
        if stop is not None:
            raise stop

    def _bind_worker_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The worker's part of bind_connector_metadata: prepares the step's saves when it has no
        loads (vLLM then calls start_load_kv only after the forward, and save_kv_layer during
        it); otherwise they are prepared after the loads (`_start_step`)."""
        assert isinstance(connector_metadata, TuttiConnectorMetadata)
        self._check_scheduler_fingerprint(connector_metadata)
        self._loads_started = False
        self._saves_prepared = False
        self._step_failed_loads = set()
        self._last_step_failed_blocks, self._step_failed_blocks = self._step_failed_blocks, set()
        self._last_step_had_loads, self._step_had_loads = self._step_had_loads, bool(connector_metadata.loads)
        self._reattach_if_due()
        self._settle_parked()
        self._end_session_if_broken()
        if not connector_metadata.loads:
            self._prepare_step_saves(connector_metadata)

    def _start_step(self) -> None:
        """Starts the bound metadata's loads, then prepares its saves, each once per step. Loads
        come first: a step's saves could otherwise take every one of the store's requests_max
        places, and its loads, refused, would be reported failed (recomputed, their saves
        cancelled), while a save refused is only a future miss. vLLM calls start_load_kv before
        the forward in a step with loads (SchedulerOutput.has_sync_kv_loads), so the saves are
        still prepared before their first save_kv_layer; should it not, the first
        wait_for_layer_load (or save_kv_layer, wait_for_save) starts the step."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TuttiConnectorMetadata)
        self._start_loads(meta)
        self._prepare_step_saves(meta)

    def _prepare_step_saves(self, meta: TuttiConnectorMetadata) -> None:
        if self._saves_prepared:
            return
        self._saves_prepared = True
        self._prepare_saves(meta.saves)
        self._end_session_if_broken()

    def _check_scheduler_fingerprint(self, meta: TuttiConnectorMetadata) -> None:
        """Raises ConfigError when the scheduler's model fingerprint (in its metadata) is not this
        worker's or another rank's: each process computes its default fingerprint on its own
        (the checkpoint's config.json read in each), and a difference would make every lookup
        miss every save, silently. Compared once, at the first metadata that carries it; with
        tensor parallelism the ranks then agree in one all-reduce over vLLM's TP CPU group (every
        rank binds the same metadata), so that every rank raises, vLLM's executor reports the
        error and stops the engine, and no rank is left waiting in the forward's collectives for
        one that raised. Once raised, raised again at every later bind (nothing is loaded or
        saved)."""
        if self._fingerprint_mismatch is not None:
            raise ConfigError(self._fingerprint_mismatch)
        theirs = meta.model_fingerprint
        if theirs is None or self._fingerprint_checked:
            return
        self._fingerprint_checked = True
        differs_here = bytes(theirs) != self._fingerprint
        differs = [differs_here]
        ranks = [self._tp_rank]
        if self._tp_world > 1:
            ranks = list(range(self._tp_world))
            flags = [rank == self._tp_rank and differs_here for rank in ranks]
            try:
                differs = _failed_on_any_rank(flags)
            except Exception as error:  # noqa: BLE001 - this rank's own answer still stands
                logger.error("tutti: the tensor-parallel ranks could not compare their model fingerprints (%s)", error)
                differs = flags
        other = [rank for rank, flag in zip(ranks, differs) if flag]
        if not other:
            return
        here = (
            f"this worker's (rank {self._tp_rank}) is {self._fingerprint.hex()}, computed from {self._fingerprint_inputs}"
            if differs_here
            else f"this worker's (rank {self._tp_rank}) is the scheduler's, but tensor-parallel rank(s) {other} computed another"
        )
        self._fingerprint_mismatch = (
            f"tutti: the scheduler's model fingerprint is {bytes(theirs).hex()}, computed from "
            f"{meta.model_identity or 'inputs it sends with its first step only'}; {here}. The scheduler's lookups would never find "
            "the workers' saves: one process read other inputs than another (the checkpoint's config.json missing or "
            "unreadable in one of them, see the warnings logged; a Hugging Face revision that moved between their "
            'reads). Set an explicit "model_fingerprint" (64 hex digits naming the model, its weights and RoPE '
            "configuration) in kv_connector_extra_config, or make config.json readable in every process"
        )
        raise ConfigError(self._fingerprint_mismatch)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Prepares this step's loads and issues each one's first layers, `layers_in_flight` of
        them, then prepares the step's saves if the metadata had loads (`_start_step`; without
        loads they were prepared when it was bound). A load that cannot start is reported failed
        (vLLM recomputes it)."""
        self._start_step()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Blocks until every load of this step has layer `layer_name` in vLLM's blocks; each
        layer waited for makes room for the load's next layer, issued at once (`layers_in_flight`
        layers of a load stay in flight)."""
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        if not self._loads_started:
            # Loads are synchronous (vLLM starts them before the forward); should vLLM not have
            # done so, they start here, before the layers that need them.
            self._start_step()
        for req_id, state in list(self._loads.items()):
            if self._loads.get(req_id) is not state:
                continue  # ended meanwhile (the session ended)
            try:
                while state.completed <= layer:
                    state.request.wait(self._timeout_s)
                    state.completed += 1
                    self._issue_load(req_id, state)
            except tutti.Error as error:
                self._fail_load(req_id, state, error)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        """Issues the writes of layer `layer_name` for every save of this step, first waiting for
        the save's oldest layer when `layers_in_flight` of its layers are in flight."""
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        if not self._saves_prepared:
            self._start_step()  # vLLM called neither start_load_kv nor wait_for_layer_load first
        if self._saves:
            self._gpu_writes_done()
        for req_id, state in list(self._saves.items()):
            if self._session_broken():
                self._abandon_save(req_id, state)
                continue
            try:
                while state.issued <= layer:
                    self._advance_save(state)
            except tutti.Error as error:
                self._fail_save(req_id, state, error)

    def wait_for_save(self) -> None:
        """Issues what save_kv_layer did not (all layers, when vLLM called it for none), and hands
        each save, its last layers possibly in flight, to the committer thread. Raises
        tutti.InvalidState (after giving the step's saves up as misses) when the committer thread
        has stopped: its saves would never be reported."""
        # Loads are synchronous: one whose later layers vLLM did not wait for ends in this step.
        if self._layers:
            self.wait_for_layer_load(self._layer_names[-1])
        self._start_step()  # already done, unless there are no layers
        self._agree_on_loads()
        if self._saves:
            self._gpu_writes_done()
        # The step's hand-overs to a full commit queue wait at most timeout_s together.
        deadline = time.monotonic() + self._timeout_s
        for req_id, state in list(self._saves.items()):
            if self._session_broken():
                self._abandon_save(req_id, state)
                continue
            try:
                while state.issued < self._layers:
                    self._advance_save(state)
            except tutti.Error as error:
                self._fail_save(req_id, state, error)
                continue
            if not self._hand_to_committer(req_id, state, deadline):
                for other_id, other in list(self._saves.items()):
                    self._fail_save(other_id, other, tutti.InvalidState("the committer thread has stopped"))
                self._fail_orphaned_saves()
                raise tutti.InvalidState(
                    "tutti: the vLLM connector's committer thread has stopped (see the error logged by it): saves "
                    "can no longer be committed; restart the worker"
                )

    def _hand_to_committer(self, req_id: str, state: _WorkerSave, deadline: float) -> bool:
        """Hands the save to the committer. A queue with room takes it whatever the time; a full
        one is waited for (back-pressure) as long as the committer runs and at most until
        `deadline` (time.monotonic(), shared by the step's hand-overs), after which the save is
        given up: a miss, its request parked until its layers in flight complete
        (`_settle_parked`; the session goes on). False when the committer has stopped: the save
        is given up (a miss)."""
        del self._saves[req_id]
        with self._lock:
            self._save_done[req_id] = None  # with the committer
            self._committing[state.token] = (state.request, self._session)
        item = (req_id, state.token, state.request, self._session, state.issued - state.completed)
        while self._committer.is_alive():
            try:
                self._commit_queue.put_nowait(item)
                return True
            except queue.Full:
                pass
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                logger.warning(
                    "tutti: the commit queue stayed full for the step's %.1f s; save of request %s not committed (a miss)",
                    self._timeout_s, req_id,
                )  # fmt: skip
                self._park(state.request)
                self._save_settled(req_id, state.token, False)
                return True
            try:
                self._commit_queue.put(item, timeout=min(_COMMIT_PUT_CHECK_S, left_s))
                return True
            except queue.Full:
                continue
        logger.error("tutti: the committer thread has stopped; save of request %s not committed", req_id)
        self._give_up_save(req_id, state)
        return False

    def _fail_orphaned_saves(self) -> None:
        """With the committer stopped: the saves left in its queue are given up (misses), so that
        get_finished reports them."""
        if self._committer.is_alive():
            return
        # Their waits for their layers in flight share one timeout_s; none waits once the
        # session is broken (a layer that did not settle, a lost connection): the session's end
        # settles them.
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                item = self._commit_queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            req_id, token, request, session, _ = item
            if not self._take_up(token):
                continue  # handle_preemptions took it over and ended it
            if self._session_broken(session):
                self._keep_until_session_ends(request, session)
            else:
                self._settle_save(request, session, deadline)
            self._save_settled(req_id, token, False)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Requests (named finished now or earlier) whose save is over: committed, or failed and
        given up (their blocks can be freed either way). Loads are synchronous: none."""
        for req_id in finished_req_ids:
            self._load_completed.pop(req_id, None)
        self._fail_orphaned_saves()
        with self._lock:
            self._finished_req_ids |= finished_req_ids
            done = {req_id for req_id in self._finished_req_ids if self._save_done.get(req_id) is not None}
            for req_id in done:
                del self._save_done[req_id]
                self._save_token.pop(req_id, None)
            # Keep only requests whose save is still with the committer; a finished request
            # without a save of this worker's has nothing to report.
            self._finished_req_ids = {req_id for req_id in self._finished_req_ids if req_id in self._save_done}
        return (done or None), None

    def build_connector_worker_meta(self) -> Optional[TuttiWorkerMetadata]:
        """This rank's tuttid session for the scheduler side, at each step while it is ended (its
        loads fail: the scheduler then matches nothing) and once when a new one opened; None
        otherwise."""
        dead = self._dead is not None
        if not dead and not self._reported_dead:
            return None
        self._reported_dead = dead
        return TuttiWorkerMetadata({self._tp_rank: self._dead})

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads that failed since the last call (vLLM recomputes them). This step's
        loads are settled first: with speculative decoding vLLM asks before the draft model's
        forward (wait_for_save is deferred past it), so a failure in a layer only the draft
        model waits for would otherwise be reported a step late."""
        if self._layers:
            self.wait_for_layer_load(self._layer_names[-1])
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def _shutdown_worker(self) -> None:
        """Stops the committer (after the saves it holds), settles the loads, saves and parked
        saves left (all within one timeout_s, however many: on a stalled device each waiting its
        own timeout_s took up to requests_max x timeout_s), then closes the store, which waits
        for what is still in flight."""
        try:
            self._commit_queue.put(None, timeout=self._timeout_s)
        except queue.Full:
            logger.error("tutti: the committer did not take the stop in %.1f s", self._timeout_s)
        self._committer.join(timeout=self._timeout_s)
        with self._lock:
            # From here a re-attach still trying closes its store itself (whatever fails below);
            # one that finished left it here.
            self._stopping = True
            pending, self._reattached = self._reattached, None
        try:
            deadline = time.monotonic() + self._timeout_s
            for state in list(self._loads.values()) + list(self._saves.values()) + self._parked:
                self._settle(state.request, deadline)
            self._parked.clear()
            self._store.close()
            with self._lock:
                self._abandoned.clear()
        finally:
            if pending is not None and pending[0] is not None:
                pending[0].close()
            thread = self._reattach_thread
            if thread is not None:
                thread.join(timeout=min(self._timeout_s, _REATTACH_JOIN_S))
                if thread.is_alive():
                    logger.warning(
                        "tutti: a new tuttid session is still being opened after %.1f s; it closes its store itself",
                        min(self._timeout_s, _REATTACH_JOIN_S),
                    )

    def _gpu_writes_done(self) -> None:
        """With GPU KV: waits until the work queued on the current CUDA stream (the layers'
        attention, which wrote the KV a save moves or a load's blocks held before) has
        completed, since tuttid reads and writes GPU memory from its own process, unordered with
        that stream. A no-op for CPU KV."""
        if self._cuda_device is not None:
            torch.cuda.current_stream(self._cuda_device).synchronize()

    def _prepare_saves(self, saves: list[SaveSpec]) -> None:
        """Prepares each save (tuttid picks the slots of its new blocks); a save that cannot start
        is a future miss, not a failure of the step."""
        for save in saves:
            token = next(self._tokens)
            with self._lock:
                self._save_token[save.req_id] = token
                self._save_done.pop(save.req_id, None)
            if self._dead is not None:
                self._save_settled(save.req_id, token, False)
                continue
            if save.req_id in self._step_failed_loads:
                # Computed against blocks whose load failed: see _cancel_save_of_failed_load.
                logger.warning("tutti: save of request %s not started: its load failed", save.req_id)
                self._save_settled(save.req_id, token, False)
                continue
            try:
                request = self._store.prepare_store(save.tokens, save.block_ids)
            except tutti.Error as error:
                logger.warning("tutti: save of request %s not started: %s", save.req_id, error)
                self._note_daemon_failure(error)
                self._save_settled(save.req_id, token, False)
                continue
            if request.new_blocks == 0:
                # Nothing to write (the pool holds every block): over now.
                try:
                    request.finish()
                except tutti.Error as error:
                    logger.warning("tutti: a save of request %s with nothing to write did not finish: %s", save.req_id, error)
                    self._note_daemon_failure(error)
                self._save_settled(save.req_id, token, True)
                continue
            self._saves[save.req_id] = _WorkerSave(request, token)

    def _start_loads(self, meta: TuttiConnectorMetadata) -> None:
        """Prepares each load of the step and issues its first `layers_in_flight` layers, once
        per step."""
        if self._loads_started:
            return
        self._loads_started = True
        if meta.loads and self._dead is None:
            # GPU KV: the blocks a load fills may still be written by kernels queued on vLLM's
            # compute stream (with async scheduling, step N's kernels on blocks freed at N-1 and
            # given to this load at N+1), and tuttid writes them from its own process, unordered
            # with that stream: a late kernel would overwrite the loaded bytes. vLLM's own
            # offloading connector makes its copy stream wait for the current stream likewise.
            self._gpu_writes_done()
        for load in meta.loads:
            # Nothing of a load that does not start is written: only its own blocks are missing.
            # Blocks before first_block are vLLM's own (its local prefix hit, possibly shared
            # with other requests): never read, never written.
            own_blocks = load.block_ids[load.first_block :]
            if not own_blocks:
                continue
            self._load_completed[load.req_id] = False  # until every layer is in vLLM's blocks
            if self._dead is not None:
                self._load_blocks_failed(own_blocks)
                self._cancel_save_of_failed_load(load.req_id)
                continue
            try:
                request = self._store.prepare_retrieve(load.tokens, own_blocks, first_block=load.first_block)
            except tutti.Error as error:
                logger.warning("tutti: load of request %s failed to prepare (%s); its blocks are recomputed", load.req_id, error)
                self._note_daemon_failure(error)
                self._load_blocks_failed(own_blocks)
                self._cancel_save_of_failed_load(load.req_id)
                continue
            state = _WorkerLoad(request, own_blocks)
            self._loads[load.req_id] = state
            try:
                self._issue_load(load.req_id, state)
            except tutti.Error as error:
                self._fail_load(load.req_id, state, error)
        self._end_session_if_broken()

    def _issue_load(self, req_id: str, state: _WorkerLoad) -> None:
        """Issues the load's next layers while fewer than `layers_in_flight` are in flight; once
        every layer completed, finishes it."""
        # Each issue puts its commands on the device (up to queue_depth of them) before vLLM
        # computes the current layer.
        while state.issued < self._layers and state.issued - state.completed < self._layers_ahead:
            state.request.retrieve_layer(state.issued)
            state.issued += 1
        if state.completed >= self._layers:
            # Every layer is in vLLM's blocks: the load succeeded, whatever its release says.
            del self._loads[req_id]
            if req_id in self._load_completed:
                self._load_completed[req_id] = True
            try:
                state.request.finish()
            except tutti.Error as error:
                logger.warning("tutti: a completed load of request %s did not finish: %s", req_id, error)
                self._note_daemon_failure(error)

    def _advance_save(self, state: _WorkerSave) -> None:
        """Issues the save's next layer, after its oldest when `layers_in_flight` are in flight."""
        if state.issued - state.completed >= self._layers_ahead:
            state.request.wait(self._timeout_s)
            state.completed += 1
        state.request.store_layer(state.issued)
        state.issued += 1

    def _fail_load(self, req_id: str, state: _WorkerLoad, error: Exception) -> None:
        """Reports a failed load's blocks (vLLM recomputes them), once nothing can write them: a
        layer that does not settle ends the session first."""
        logger.warning(
            "tutti: load of request %s failed with %d of its %d layers complete (%s); its blocks are recomputed",
            req_id, state.completed, self._layers, error,
        )  # fmt: skip
        self._loads.pop(req_id, None)
        if not self._settle(state.request):
            self._end_session(f"a layer of request {req_id}'s load did not complete", load_in_flight=True)
        self._load_blocks_failed(state.block_ids)
        self._cancel_save_of_failed_load(req_id)

    def _load_blocks_failed(self, block_ids: list[int]) -> None:
        """Records blocks whose load failed: reported to vLLM (get_block_ids_with_load_errors),
        and kept for this step and the next, whose saves over them are cancelled."""
        self._failed_block_ids.update(block_ids)
        self._step_failed_blocks.update(block_ids)

    def _cancel_save_of_failed_load(
        self, req_id: str, on_this_rank: bool = True, shared: bool = False, deadline: Optional[float] = None
    ) -> None:
        """A request whose load failed saves nothing in this step: its blocks hold what vLLM had
        there before (recomputed only after the step), and the blocks after them were computed
        against those. Its save (prepared after the step's loads, if any, started; possibly with layers
        issued) is given up, never committed, and reported through get_finished as a miss.
        `on_this_rank`: False when the load failed on another TP rank (`_agree_on_loads`). A
        save not prepared yet (the step's loads start first) is never prepared. `deadline`: as
        `_give_up_save`'s."""
        self._step_failed_loads.add(req_id)
        state = self._saves.pop(req_id, None)
        if state is None:
            return
        where = "" if on_this_rank else " on another tensor-parallel rank"
        why = "it shares blocks whose load failed" if shared else "its load failed"
        logger.warning("tutti: save of request %s cancelled: %s%s", req_id, why, where)
        # Its layers in flight only read vLLM's blocks; see _give_up_save.
        self._give_up_save(req_id, state, deadline)

    def _agree_on_loads(self) -> None:
        """Cancels the step's saves computed against blocks whose load failed:
        - a request that loaded blocks saves nothing if its load did not complete, whether the
          save is in the load's step or a later one (with chunked prefill and async scheduling,
          vLLM may schedule the prompt's next chunk, and its save, before it learns of the
          failure: that chunk was computed against the stale blocks);
        - nor does a request whose save covers a block whose load (another request's) failed in
          this step or the step before: vLLM's prefix cache shares a loaded block from its
          allocation on (kv_cache_manager.allocate_slots caches it), so a request with a local
          hit on it computed against the stale bytes, and would save them under the real
          prefix keys. Saves emitted in later steps are the scheduler side's: it learns of the
          failure before it builds them and emits none for a request holding such a block
          (`SchedulerSide.update_connector_output`).
        With tensor parallelism a save is cancelled on every rank if it must be on any: every
        rank's forward mixes every rank's heads (the all-reduce after each layer), so what was
        computed after a failed load is wrong on every rank, and a rank's committed blocks
        would later pair with another rank's good ones under one prefix. The ranks agree in one
        all-reduce over vLLM's TP CPU group, one flag per save of the step, in steps with a save
        whose request loaded or with a save and loads in this step or the one before: every rank
        takes part whatever its own session's state, as that is decided by the metadata, which
        every rank gets the same. Ranks that cannot agree (no TP group, the collective failed)
        commit none of the saves they asked about."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TuttiConnectorMetadata)
        if not meta.saves:
            return
        joint = {save.req_id for save in meta.saves if save.req_id in self._load_completed}
        if not joint and not (self._step_had_loads or self._last_step_had_loads):
            return
        failed_blocks = self._step_failed_blocks | self._last_step_failed_blocks
        req_ids: list[str] = []
        failed_here: list[bool] = []
        shared: list[bool] = []
        for save in meta.saves:
            # A request saves once (again only after a preemption, which forgets it).
            own = save.req_id in joint and not self._load_completed.pop(save.req_id)
            overlaps = not failed_blocks.isdisjoint(save.block_ids)
            req_ids.append(save.req_id)
            failed_here.append(own or overlaps)
            shared.append(not own)
        failed_anywhere = failed_here
        if self._tp_world > 1:
            try:
                failed_anywhere = _failed_on_any_rank(failed_here)
            except Exception as error:  # noqa: BLE001 - whatever the failure, no rank may commit
                logger.error(
                    "tutti: the tensor-parallel ranks could not agree on the loads of the step's saves %s (%s); those saves are cancelled",
                    req_ids, error,
                )  # fmt: skip
                failed_anywhere = [True] * len(req_ids)
        # The cancelled saves' waits for their layers in flight share one timeout_s.
        deadline = time.monotonic() + self._timeout_s
        for req_id, anywhere, here, by_sharing in zip(req_ids, failed_anywhere, failed_here, shared):
            if anywhere:
                self._cancel_save_of_failed_load(req_id, on_this_rank=here, shared=by_sharing, deadline=deadline)

    def _fail_save(self, req_id: str, state: _WorkerSave, error: Exception) -> None:
        logger.warning("tutti: save of request %s failed (%s); nothing of it becomes visible", req_id, error)
        self._saves.pop(req_id, None)
        self._give_up_save(req_id, state)

    def _give_up_save(self, req_id: str, state: _WorkerSave, deadline: Optional[float] = None) -> None:
        """Ends a save that is not committed and records it as a miss. A layer that does not
        settle only reads vLLM's blocks and is never committed; after one (the session then
        broken), or a lost connection, later saves are given up without a wait
        (`_abandon_save`), rather than each wait timeout_s for a stalled device. `deadline`
        (time.monotonic()): no wait goes past it (several saves given up at once)."""
        if self._session_broken():
            self._abandon_save(req_id, state)
            return
        self._settle_save(state.request, deadline=deadline)
        self._save_settled(req_id, state.token, False)

    def _session_broken(self, session: Optional[int] = None) -> bool:
        """Whether the worker's session is over or will be ended at the next step (`session`: or
        is no longer the one a save belonged to): its saves are given up without a wait."""
        with self._lock:
            return self._broken is not None or self._dead is not None or (session is not None and session != self._session)

    def _abandon_save(self, req_id: str, state: _WorkerSave) -> None:
        """Gives up a save of a broken session at once (a miss): no wait for its layers and no
        exchange with tuttid, either of which could take timeout_s (a stalled device, a lost
        connection); its request is kept until the session is ended, which settles it."""
        logger.warning("tutti: save of request %s given up: the worker's tuttid session is ended at the next step", req_id)
        self._saves.pop(req_id, None)
        self._keep_until_session_ends(state.request, self._session)
        self._save_settled(req_id, state.token, False)

    def _park(self, request: Any) -> None:
        """Keeps a save given up at a full commit queue until its layers in flight complete: no
        wait now (the step's hand-overs already waited their timeout_s) and no end of the
        session, which back-pressure says nothing about."""
        try:
            request.poll()
        except tutti.Error:
            pass  # a failed layer is no longer in flight
        self._parked.append(_ParkedSave(request, request.layer_in_flight, time.monotonic()))

    def _settle_parked(self) -> None:
        """Finishes the parked saves whose layers completed (their request places and pins given
        back). One whose oldest layer stayed in flight for timeout_s did not complete within its
        own timeout: it holds its request place and pins, so the session is ended (now, at the
        step), as for a save the committer gave up with a layer in flight."""
        if not self._parked or self._dead is not None:
            return
        now = time.monotonic()
        kept: list[_ParkedSave] = []
        for parked in self._parked:
            try:
                parked.request.poll()
            except tutti.Error:
                pass  # a failed layer is no longer in flight
            layer = parked.request.layer_in_flight
            if layer is None:
                self._settle_save(parked.request, deadline=now)  # nothing in flight: no wait
                continue
            kept.append(parked)
            if layer != parked.layer:
                parked.layer, parked.since = layer, now
            elif now - parked.since >= self._timeout_s:
                logger.error(
                    "tutti: layer %d of a save given up at a full commit queue did not complete in %.1f s", layer, self._timeout_s
                )
                with self._lock:
                    if self._broken is None:
                        self._broken = (
                            "a layer of a save given up at a full commit queue did not complete (its request place and "
                            "pins are held)"
                        )
        self._parked = kept

    def _keep_until_session_ends(self, request: Any, session: int) -> None:
        with self._lock:
            if session == self._session and self._dead is None:
                self._abandoned.append(request)

    def _save_settled(self, req_id: str, token: int, committed: bool) -> None:
        """Records the outcome of the request's save `token` (ignored if it is not its current
        save any more: preempted and forgotten, or saved anew)."""
        with self._lock:
            self._cancelled.discard(token)
            self._committing.pop(token, None)
            if self._committing_now == token:
                self._committing_now = None
            if self._save_token.get(req_id) == token:
                self._save_done[req_id] = committed

    def _settle_save(self, request: Any, session: Optional[int] = None, deadline: Optional[float] = None) -> None:
        """Settles a save that is given up (`_settle`). One whose layer is still in flight keeps
        its request place and pins for as long as the session lasts (enough of them would fail
        every later prepare): the session is ended at the worker's next step, which is safe since
        a save's device only reads vLLM's blocks. `session`: the session the save belonged to (the
        committer's may be an earlier one, already ended). `deadline`: as `_settle`'s."""
        if self._settle(request, deadline):
            return
        with self._lock:
            if (session is None or session == self._session) and self._broken is None:
                self._broken = "a layer of a save given up did not complete (its request place and pins are held)"

    def _settle(self, request: Any, deadline: Optional[float] = None) -> bool:
        """Ends a request that is given up: waits for its layers in flight (the device may still
        move those blocks' bytes), then finishes it without committing. Returns False when a
        layer is still in flight (nothing was ended: its memory may still be written or read).
        `deadline` (time.monotonic()): no wait goes past it (several requests given up at once)."""
        if not wait_out_layer(request, self._timeout_s, logger, "tutti: an abandoned request", deadline):
            return False
        try:
            request.finish()
        except tutti.InvalidState as error:
            logger.error("tutti: an abandoned request could not be finished: %s", error)
            return False
        except tutti.Error as error:
            # The store let go of it (a lost session, a closed store): nothing is in flight.
            logger.warning("tutti: an abandoned request could not be finished: %s", error)
            self._note_daemon_failure(error)
        return True

    def _note_daemon_failure(self, error: Exception, session: Optional[int] = None) -> None:
        """A daemon exchange failed: if the connection is lost (closed, or an exchange that timed
        out and left it out of step), the session is ended at the worker's next step. `session`:
        the session the failed exchange belonged to (the committer's requests may outlive it); a
        failure of an earlier session than the current one says nothing about the current one."""
        if connection_lost(error):
            with self._lock:
                if session is not None and session != self._session:
                    return
                if self._broken is None:
                    self._broken = f"a tuttid exchange failed: {error}"

    def _end_session_if_broken(self) -> None:
        with self._lock:
            reason = self._broken
        if reason is not None and self._dead is None:
            self._end_session(reason)

    def _end_session(self, reason: str, load_in_flight: bool = False) -> None:
        """Ends the worker's tuttid session: tuttid deletes its queue pairs, after which nothing
        more is written to vLLM's blocks. This step's loads are reported failed and its saves
        are misses; so are later steps' until a new session is open. Only device-memory KV (not
        the session's window) can be registered with a new one: `_reattach_if_due` at the next
        steps; window KV loads and saves nothing more (restart the worker).

        When tuttid did not confirm that the session ended (the store keeps the KV memory's
        registrations): raises KvMemoryUnsafe if a load's layer was in flight (`load_in_flight`:
        one the caller gave up on; or one of the step's loads with a layer issued and not
        waited for), since the device may still write vLLM's blocks. Otherwise nothing can
        write them (a save only reads vLLM's blocks): the registrations are kept for good, the
        memory is never registered again, and the worker serves without tutti (loads fail,
        saves miss, the scheduler side is told: `build_connector_worker_meta`), rather than stop
        the engine because tuttid stopped answering."""
        if self._dead is not None:
            return
        self._dead = reason
        if self._kv_tensors is None:
            logger.error("tutti: the worker's tuttid session is ended (%s); this worker loads and saves nothing more", reason)
        else:
            logger.error("tutti: the worker's tuttid session is ended (%s); a new one is opened at the next step", reason)
            self._reattach_at = time.monotonic()
        loads, saves = list(self._loads.values()), list(self._saves.items())
        load_in_flight = load_in_flight or any(state.issued > state.completed for state in loads)
        self._loads.clear()
        self._saves.clear()
        # Waits for the layers still in flight (bounded), closes the connection; with a layer
        # still in flight, waits until tuttid dropped the session (its queue pairs deleted).
        self._store.close(timeout_s=self._timeout_s)
        self._parked.clear()  # settled by the close
        with self._lock:
            self._abandoned.clear()  # settled by the close
        kept = self._store.leaked_registrations()
        if kept:
            # Never re-registered (even if a caller above catches the exception): tuttid may
            # still hold the memory, and with a load in flight write it.
            self._reattach_at = math.inf
        if kept and not load_in_flight:
            logger.error(
                "tutti: tuttid did not confirm that the session ended (%d KV memory registrations kept for good); no "
                "load was in flight, so nothing writes vLLM's KV blocks: this worker serves without tutti until it "
                "is restarted",
                kept,
            )
        elif kept:
            raise KvMemoryUnsafe(
                f"tutti: {reason}, and tuttid did not confirm that the session's queue pairs were deleted "
                f"({kept} KV memory registrations kept): vLLM's KV blocks may still be written, so the "
                "worker stops rather than hand them back"
            )
        # Nothing moves their bytes any more: vLLM recomputes the loads; the saves are misses.
        for state in loads:
            self._load_blocks_failed(state.block_ids)
        for req_id, state in saves:
            self._save_settled(req_id, state.token, False)

    def _reattach_if_due(self) -> None:
        """Opens a new tuttid session for a worker whose session ended, when its KV memory can be
        registered again (device memory; tuttid's window went with the session), once the
        back-off after a failed try has passed. The try (attach, register_kv: each waits up to
        timeout_s for tuttid) runs on a thread of its own, so a step never waits for it; its
        result is taken up at the first step after it is over. A failure leaves the worker as it
        was (loads reported failed, saves missed) until the next try. A MemoryError is such a
        failed try too (host memory short, e.g. in torch's __dlpack__, which register_kv passes
        through as itself: transient, not a bug). Any other failure that is not a tutti.Error (a
        bug; a KeyboardInterrupt or SystemExit, which only a producer raising it itself gets to
        this thread) for good (logged, not raised: see below)."""
        if self._dead is None or self._kv_tensors is None:
            return
        thread = self._reattach_thread
        if thread is not None:
            if thread.is_alive():
                return
            self._reattach_thread = None
            with self._lock:
                result, self._reattached = self._reattached, None
            store, error = result if result is not None else (None, RuntimeError("the try ended without a result"))
            if result is not None and store is None and not isinstance(error, (tutti.Error, MemoryError)):
                # Neither a refusal of tutti's nor short memory (a bug): not retried for good, nor
                # raised. Each rank's re-attach is its own, so with tensor parallelism this rank
                # alone would raise: vLLM 0.32's MultiprocExecutor only logs a rank's exception
                # that is not the output rank's, and the others would wait in the forward's
                # all-reduce until VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS and stop the engine with a
                # timeout. Agreeing on it would take a collective in every step. The rank serves
                # without tutti until restarted (the scheduler side is told:
                # build_connector_worker_meta).
                self._reattach_at = math.inf
                logger.error(
                    "tutti: opening a new tuttid session failed with an unexpected error (a bug); this worker "
                    "serves without tutti until it is restarted (its session ended: %s)",
                    self._dead,
                    exc_info=(type(error), error, error.__traceback__),
                )
                return
            if store is None:
                self._reattach_backoff_s = min(max(2 * self._reattach_backoff_s, _REATTACH_BACKOFF_FIRST_S), _REATTACH_BACKOFF_MAX_S)
                self._reattach_at = time.monotonic() + self._reattach_backoff_s
                # repr for a bare MemoryError(), whose str is empty.
                logger.warning(
                    "tutti: a new tuttid session failed (%s); the next try in %.1f s", str(error) or repr(error), self._reattach_backoff_s
                )
                return
            logger.warning("tutti: the worker opened a new tuttid session (the last one ended: %s)", self._dead)
            self._store = store
            with self._lock:
                self._broken = None
                self._session += 1
            self._dead = None
            self._reattach_backoff_s = 0.0
            self.reattaches += 1
            return
        if time.monotonic() < self._reattach_at:
            return
        self._reattach_thread = threading.Thread(
            target=self._reattach, args=(list(self._kv_tensors),), name="tutti-vllm-reattach", daemon=True
        )
        self._reattach_thread.start()

    def _reattach(self, tensors: list[torch.Tensor]) -> None:
        """The re-attach thread: attaches and registers `tensors`; leaves its result for the next
        step (`_reattach_if_due`), or closes the store if the worker shut down meanwhile."""
        store: Any = None
        error: Optional[BaseException] = None
        try:
            store = self._attach()
            try:
                store.register_kv(tutti.KvLayout.paged(tensors))
            except BaseException:
                store.close()
                raise
        except (tutti.Error, MemoryError) as failure:  # a failed try: the step backs off and tries again
            store, error = None, failure
        except BaseException as failure:  # noqa: BLE001 - anything else: the next step logs it, tries no more
            store, error = None, failure
        with self._lock:
            if not self._stopping:
                self._reattached = (store, error)
                return
        if store is not None:
            store.close()

    def _release_committing_save(self, req_id: str, deadline: float) -> Optional[BaseException]:
        """For handle_preemptions: ends the request's save with the committer (if any) before vLLM
        reuses its blocks, waiting until `deadline` (time.monotonic()) for its layers in flight
        (the reads of vLLM's blocks), not for the committer's backlog of other saves' flushes
        and header writes. Once none is in flight the save is taken over from the committer and
        committed here: a pool that records payload CRCs computes them at the commit from
        vLLM's blocks, so the commit must not come after their reuse either. A save the
        committer has taken up already (it is ending it now: a commit, or a settle after a
        failure) is waited for until the deadline; past it, one whose commit the committer has
        begun (`_committing_now`, set with its cancel check: a cancellation would come too late,
        and the commit may not have read vLLM's blocks yet, waiting for the store's lock or
        connection) is still waited for, up to the commit's own bounds (4 x timeout_s + 1 s
        with the finish of a failed commit, since the mark is kept until the save is settled;
        `_COMMIT_WAIT_MARGIN_S` more; counted from the deadline or, if later, from when this
        call first saw the mark: before that, this call's own exchanges for the requests
        preempted before this one may have held the store's lock the commit waits for); a
        commit that outlasts even that ends the session (`_end_session`: the close takes the
        store's lock, after which the commit fails), so that nothing reads the blocks after
        this returns. A save not yet begun is cancelled at the
        deadline, as is one with a layer still in flight (never committed: its bytes may be read
        after vLLM reused the blocks).
        The layers are polled from this thread while the committer may wait for them (the
        binding's Request takes the store's lock for each call: a poll retires what ended, and
        the committer's wait still returns it). Returns the KeyboardInterrupt or SystemExit a
        taken-over commit raised (`_commit_taken_over`), for the caller to raise once every
        preempted request is handled."""
        with self._lock:
            token = self._save_token.get(req_id)
            if token is None or req_id not in self._save_done or self._save_done[req_id] is not None:
                return None  # no save of the request's with the committer
        commit_until: Optional[float] = None  # set once past the deadline with the commit begun
        waited_from = deadline  # from when commit_until is counted
        marked_since: Optional[float] = None  # when this call first saw the committer's mark
        while True:
            with self._lock:
                if self._save_token.get(req_id) != token or self._save_done.get(req_id) is not None:
                    return None  # settled by the committer meanwhile
                held = self._committing.get(token)
                committing = self._committing_now == token
            if committing and marked_since is None:
                marked_since = time.monotonic()
            if held is not None:
                request, session = held
                try:
                    request.poll()
                except tutti.Error:
                    pass  # a layer's failure is the committer's to take; only what is in flight counts here
                if request.layer_in_flight is None:
                    with self._lock:
                        taken = self._committing.pop(token, None) is not None
                        if taken:
                            self._taken_over.add(token)
                    if taken:
                        return self._commit_taken_over(req_id, request, session, deadline)
                    continue  # the committer took it up first: waited for below
            now = time.monotonic()
            if now < deadline:
                time.sleep(min(_COMMIT_POLL_S, deadline - now))
                continue
            if not committing:
                with self._lock:
                    if self._committing_now == token:
                        continue  # the committer began its commit meanwhile: not cancelled, waited for
                    # Only while the save is still the request's and unsettled: _save_settled
                    # (which discards the token) has not run, and will. The committer checks
                    # `_cancelled` under this lock before it commits.
                    cancelled = self._save_token.get(req_id) == token and self._save_done.get(req_id) is None
                    if cancelled:
                        self._cancelled.add(token)
                if not cancelled:
                    return None  # settled by the committer meanwhile
                # Logged only now, once cancelled: not for a save waited for or settled meanwhile.
                if held is not None:
                    logger.error(
                        "tutti: layer %s of preempted request %s's save was still in flight at the preemption's deadline "
                        "(%.1f s); the save is cancelled", held[0].layer_in_flight, req_id, self._timeout_s,
                    )  # fmt: skip
                else:
                    logger.error(
                        "tutti: the committer did not end the save of preempted request %s by the preemption's deadline "
                        "(%.1f s); the save is cancelled", req_id, self._timeout_s,
                    )  # fmt: skip
                return None
            # The committer is committing the save: it has passed its cancel check, and its
            # commit may not have read vLLM's blocks yet (it waits for the store's lock or
            # connection), so it is waited for, within the commit's own bounds.
            if commit_until is None:
                # Counted from when this call began to wait for the mark, not from the shared
                # deadline: until then this call's own exchanges (the preempted requests before
                # this one) may have held the store's lock the commit waits for.
                waited_from = max(deadline, marked_since if marked_since is not None else now)
                commit_until = waited_from + 4 * self._timeout_s + 1.0 + _COMMIT_WAIT_MARGIN_S
                logger.warning(
                    "tutti: the committer is committing the save of preempted request %s at the preemption's deadline "
                    "(%.1f s); waiting up to %.1f s more for it", req_id, self._timeout_s, commit_until - now,
                )  # fmt: skip
            if now >= commit_until:
                # Past the commit's own bounds: the session is ended, whose close takes the
                # store's lock (waiting for a commit that holds it) and leaves every later call
                # on its requests StaleRequest, so the commit reads nothing after this returns.
                self._end_session(
                    f"the commit of preempted request {req_id}'s save did not end within its bounds "
                    f"({commit_until - waited_from:.1f} s after this call began to wait for it)"
                )
                return None
            time.sleep(min(_COMMIT_POLL_S, commit_until - now))

    def _commit_taken_over(self, req_id: str, request: Any, session: int, deadline: float) -> Optional[BaseException]:
        """Commits a preempted save taken over from the committer (its layers all ended), as the
        committer would have: not in a broken session (kept until it ends), and a failure makes
        it a miss (settled; `deadline`: as `_settle`'s). Its outcome is not reported: the
        preemption forgets the save. Whatever else escapes the commit (a panic of the binding,
        PanicException, is a BaseException) makes it a miss too, as in `_commit_loop`, rather
        than leave handle_preemptions with the other preempted requests unsettled; so does
        whatever escapes the settle after either kind of failure (the session is then ended at
        the next step). The first KeyboardInterrupt or SystemExit, of the commit or of the
        settle, is returned, for handle_preemptions to raise at its end."""
        if self._session_broken(session):
            self._keep_until_session_ends(request, session)
            return None
        try:
            request.commit()
            return None
        except tutti.Error as error:
            logger.warning("tutti: save of preempted request %s not committed: %s", req_id, error)
            self._note_daemon_failure(error, session)
            failure: BaseException = error
        except BaseException as error:  # noqa: BLE001 - the other preempted requests must still be settled
            logger.error("tutti: the commit of preempted request %s's save failed (%r); it is not committed", req_id, error)
            failure = error
        # The first interrupt, of the commit or of the settle, is kept for the caller to raise.
        stop = failure if isinstance(failure, (KeyboardInterrupt, SystemExit)) else None
        try:
            self._settle_save(request, session, deadline)
        except BaseException as settle_error:  # noqa: BLE001 - whichever way the commit failed
            logger.error(
                "tutti: the save of preempted request %s could not be settled (%r); the session is ended at the "
                "next step", req_id, settle_error,
            )  # fmt: skip
            with self._lock:
                if session == self._session and self._broken is None:
                    self._broken = f"a taken-over save whose commit failed could not be settled: {settle_error!r}"
            if stop is None and isinstance(settle_error, (KeyboardInterrupt, SystemExit)):
                stop = settle_error
        return stop

    def _take_up(self, token: int) -> bool:
        """The committer's claim on a save before it ends it: False when handle_preemptions took
        it over (and ended it); otherwise handle_preemptions can no longer take it over."""
        with self._lock:
            if token in self._taken_over:
                self._taken_over.discard(token)
                return False
            self._committing.pop(token, None)
            return True

    def _commit_loop(self) -> None:
        """The committer thread. Every save handed to it is reported, whatever fails (a panic of
        the binding, PanicException, is a BaseException): one it could not handle is given up
        as a miss; KeyboardInterrupt and SystemExit stop the thread after that (wait_for_save
        then refuses to hand it more, and get_finished gives up what is left in its queue)."""
        while True:
            item = self._commit_queue.get()
            if item is None:
                return
            req_id, token, request, session, outstanding = item
            try:
                self._commit_save(req_id, token, request, session, outstanding)
            except BaseException as error:  # noqa: BLE001 - the save must be reported whatever failed
                if not self._take_up(token):  # handle_preemptions took it over and ended it
                    if isinstance(error, (KeyboardInterrupt, SystemExit)):
                        raise
                    continue
                logger.error("tutti: the committer failed on the save of request %s (%r); it is not committed", req_id, error)
                try:
                    self._settle_save(request, session)
                except BaseException as settle_error:  # noqa: BLE001
                    logger.error("tutti: the save of request %s could not be settled (%r); the session is ended at the next step", req_id, settle_error)
                    with self._lock:
                        if session == self._session and self._broken is None:
                            self._broken = f"a save the committer failed on could not be settled: {settle_error!r}"
                self._save_settled(req_id, token, False)
                if isinstance(error, (KeyboardInterrupt, SystemExit)):
                    raise

    def _commit_save(self, req_id: str, token: int, request: Any, session: int, outstanding: int) -> None:
        """Waits for the save's last layers, then commits it (unless it was cancelled, or taken
        over by handle_preemptions)."""
        committed = False
        failure: Optional[tutti.Error] = None
        try:
            for _ in range(outstanding):  # the save's layers still in flight, oldest first
                if self._session_broken(session):
                    break
                request.wait(self._timeout_s)
        except tutti.Error as error:
            failure = error
        if not self._take_up(token):
            return  # handle_preemptions took it over (its layers ended) and ended it
        if failure is not None:
            logger.warning("tutti: save of request %s not committed: one of its last layers failed or timed out (%s)", req_id, failure)
            self._settle_save(request, session)
            self._save_settled(req_id, token, False)
            return
        if self._session_broken(session):
            # Ended or to be ended at the worker's next step (a layer that did not complete, a
            # lost connection): neither its layers nor tuttid are waited for.
            logger.warning("tutti: save of request %s not committed: the worker's tuttid session is ended", req_id)
            self._keep_until_session_ends(request, session)
            self._save_settled(req_id, token, False)
            return
        with self._lock:
            cancelled = token in self._cancelled
            if not cancelled:
                # From here handle_preemptions no longer cancels the save: it waits for the
                # commit, which may read vLLM's blocks (the payload CRCs) until it is over.
                self._committing_now = token
        if cancelled:
            # Preempted while a layer was in flight: its bytes may have been read after
            # vLLM reused the blocks. Never committed.
            self._settle_save(request, session)
        else:
            # The mark stays until _save_settled, which every path from here reaches (whatever
            # else escapes, through _commit_loop's): cleared as the commit returned, it let
            # handle_preemptions see the save unmarked and unsettled in between, and cancel (log
            # as cancelled) a save that was committed.
            try:
                request.commit()
                committed = True
            except tutti.Error as error:
                logger.warning("tutti: save of request %s not committed: %s", req_id, error)
                self._note_daemon_failure(error, session)
                self._settle_save(request, session)
        self._save_settled(req_id, token, committed)


def _failed_on_any_rank(failed_here: list[bool]) -> list[bool]:
    """Element-wise OR of `failed_here` over vLLM's tensor-parallel group (its CPU group, gloo:
    bounded by the group's timeout, as vLLM's own collectives)."""
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        raise RuntimeError("vLLM's tensor-parallel group is not initialised")
    flags = torch.tensor(failed_here, dtype=torch.int32)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group)
    return [bool(flag) for flag in flags.tolist()]


def _refuse_kv_writes_before_preemptions(vllm_config: "VllmConfig", kv_cache_config: Optional["KVCacheConfig"]) -> None:
    """Raises ConfigError where vLLM would write KV blocks before the connector's
    handle_preemptions: its model runner V2 (vllm/v1/worker/gpu/model_runner.py, vLLM 0.32)
    runs update_requests, which zeroes newly allocated blocks
    (KVCacheConfig.needs_kv_cache_zeroing: Mamba layers, or KV caches of mixed precision) and
    applies the copy-on-write copies of partial prefix-cache hits (the scheduler's
    KVCacheCoordinator.enable_partial_hash_hits, which needs Mamba "align" groups:
    kv_cache_utils.partial_hash_hits_enabled), before pre_forward calls handle_preemptions. A
    block a preempted request freed and vLLM handed to another request in the same step would be
    written while the preempted save may still read it, or its load still write it. The
    connector refuses Mamba groups, and layers of mixed KV dtypes within a group, already
    (`_refuse_kv_cache_groups_freed_early`); this also covers groups of different precisions
    and whatever else vLLM zeroes or copies for. The worker has no coordinator: the
    partial hits are judged by vLLM's own predicate over the worker's KV cache groups (True
    whenever the coordinator could enable them; skipped, with a warning, on a vLLM without that
    predicate: `_partial_hash_hits_enabled`)."""
    if kv_cache_config is None:
        return
    writes: list[str] = []
    if getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        writes.append(
            "zeroes newly allocated KV blocks (KVCacheConfig.needs_kv_cache_zeroing: Mamba layers or KV caches of "
            "mixed precision)"
        )
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    cache = getattr(vllm_config, "cache_config", None)
    hash_block_size = (
        getattr(kv_cache_config, "hash_block_size", None)
        or getattr(cache, "hash_block_size", None)
        or getattr(cache, "block_size", None)
    )
    if groups and hash_block_size and _partial_hash_hits_enabled(vllm_config, groups, int(hash_block_size)):
        writes.append(
            "copies KV blocks for partial prefix-cache hits (copy-on-write: the KV cache coordinator's "
            "enable_partial_hash_hits, Mamba \"align\" groups)"
        )
    if writes:
        raise ConfigError(
            f"TuttiConnector cannot serve this model: vLLM's model runner V2 {' and '.join(writes)} in update_requests, "
            "before it calls the connector's handle_preemptions, so a block a preempted request freed could be "
            "written while that request's save still reads it or its load still writes it: serve it without the "
            "connector"
        )


_partial_hash_hits_unknown_logged = False


def _partial_hash_hits_enabled(vllm_config: "VllmConfig", groups: Any, hash_block_size: int) -> bool:
    """vLLM 0.32's kv_cache_utils.partial_hash_hits_enabled over the worker's KV cache groups.
    Another vLLM may lack it or call it otherwise (check_vllm_version only warns): then False,
    with a warning logged once, rather than fail every worker. Nothing the connector accepts
    is lost by that: partial hits need Mamba "align" groups, which
    `_refuse_kv_cache_groups_freed_early` refuses already."""
    global _partial_hash_hits_unknown_logged
    dcp = int(getattr(getattr(vllm_config, "parallel_config", None), "decode_context_parallel_size", 1) or 1)
    try:
        from vllm.v1.core.kv_cache_utils import partial_hash_hits_enabled

        return bool(partial_hash_hits_enabled(groups, hash_block_size, dcp))
    except (ImportError, TypeError) as error:
        if not _partial_hash_hits_unknown_logged:
            _partial_hash_hits_unknown_logged = True
            logger.warning(
                "tutti: this vLLM's kv_cache_utils.partial_hash_hits_enabled is missing or differs from vLLM 0.32's "
                "(%r); the check for partial prefix-cache hits' block copies is skipped (they need Mamba groups, "
                "which the connector refuses)", error,
            )  # fmt: skip
        return False


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


def _heads_slots_order(view: torch.Tensor) -> Optional[str]:
    """Whether a layer's `[blocks, heads, slots, content]` view keeps heads outside slots ("HN",
    LBHNC) or slots outside heads ("NH", LBNHC) in memory; None when the view does not say (not
    4-D, or one head or one slot)."""
    if view.dim() != 4 or view.shape[1] < 2 or view.shape[2] < 2:
        return None
    return "HN" if view.stride(1) > view.stride(2) else "NH"


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
