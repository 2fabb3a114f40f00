"""The scheduler side of `tutti.vllm.TuttiConnector` (role SCHEDULER): asks tuttid through a
lookup-only session which prefix of a prompt every rank holds, remembers the blocks vLLM
allocated, and builds each step's metadata (loads, saves, preemptions) for the workers."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import tutti
from tutti.vllm.metadata import LoadSpec, SaveSpec, TuttiConnectorMetadata, TuttiWorkerMetadata, check_block_size, connection_lost
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("tutti.vllm")

# The scheduler's lookup session, once lost, is connected again at the next lookup; after a
# failed connect or a lookup that timed out, lookups are misses without asking tuttid for a
# back-off that doubles from the first to the last value while they keep failing (a dead or
# stalled daemon costs one lookup_timeout_s per back-off, not per request); an answered lookup
# resets it.
_RECONNECT_BACKOFF_FIRST_S = 1.0
_RECONNECT_BACKOFF_MAX_S = 30.0


class _LookupBackingOff(tutti.Disconnected):
    """A lookup answered as a miss without asking tuttid: the lookup session is lost and the
    back-off after a failed connect or a timed-out lookup is running."""


@dataclass
class _SchedulerRequest:
    """The scheduler side's view of one request."""

    prompt: list[int]
    block_ids: list[int] = field(default_factory=list)
    hit_tokens: int = 0
    load_pending: Optional[int] = None  # blocks to load, set after allocation, emitted once
    load_first_block: int = 0  # the first of them vLLM does not hold locally
    save_emitted: bool = False
    # vLLM's Request (None while only its NewRequestData was seen) and its num_preemptions when
    # the save was emitted: a request preempted outside schedule() since (reset_prefix_cache
    # with reset_running_requests) has a save the workers forget at the next step.
    request: Any = None
    save_preemptions: Optional[int] = None  # None: not known (no Request seen)
    # What makes the request's KV depend on more than its prompt tokens (vLLM's own prefix keys
    # include it: a LoRA adapter, multimodal inputs, a cache salt, prompt embeddings); tutti's
    # keys are the tokens only, so such a request is neither loaded nor saved. None: nothing.
    uncacheable: Optional[str] = None
    # The index of the request's first block whose bytes a failed load left stale (vLLM reported
    # it in invalid_block_ids): its blocks from there on hold, or were computed against, stale
    # bytes, so the request is not saved from then on and those blocks are kept out of vLLM's
    # prefix cache (`_evict_stale`). None: none. A preemption clears it (its blocks are freed and
    # the resumed request computes or loads them afresh).
    stale_from: Optional[int] = None


class SchedulerSide:
    """TuttiConnector's scheduler-side methods (a mixin: TuttiConnector sets the shared fields
    and calls `_init_scheduler` in the scheduler process)."""

    _config: dict[str, Any]
    _block_size: int
    _tp_world: int
    _fingerprint: bytes
    _fingerprint_inputs: str

    def _init_scheduler(self) -> None:
        self._lookup_timeout_s = float(self._config["lookup_timeout_s"])
        self._lookup: Any = self._connect_lookup()
        self._requests: dict[str, _SchedulerRequest] = {}
        self._uncacheable_logged: set[str] = set()
        # Requests allocated (update_state_after_alloc) since the last build_connector_meta: one
        # of them also named preempted in that metadata was preempted before this step's
        # schedule() resumed it (reset_prefix_cache(reset_running_requests=True) preempts every
        # running request; the next schedule() resumes them), so its new load stands.
        self._allocated: set[str] = set()
        # Blocks of requests that left `_requests` (finished, aborted) or gave their blocks up
        # (preempted) in the last two metadata builds, with the build they left in. vLLM reports
        # a failed load (invalid_block_ids) with the step's output, and with async scheduling an
        # abort is processed before that output: a request that computed blocks against the
        # stale ones in the failure's step may be gone by then, its blocks freed but still in
        # vLLM's prefix cache. `update_connector_output` evicts those too.
        self._metadata_builds = 0
        self._released: list[tuple[int, list[int]]] = []
        # With EAGLE/MTP speculative decoding vLLM drops the last block of its own prefix hit
        # (FullAttentionManager.find_longest_cache_hit, drop_eagle_block): a drafter layer's KV
        # at a block's last slot depends on the next token, which the block's key does not
        # include. A hit in tutti is cut one block short likewise, as vLLM's own CPU offloading
        # does (SpeculativeConfig.use_eagle_block_drop).
        speculative = getattr(self._vllm_config, "speculative_config", None)
        self._eagle_block_drop = speculative is not None and bool(speculative.use_eagle_block_drop())
        self.lookup_failures = 0
        self.lookup_reconnects = 0
        # Ranks whose tuttid session is ended, and why, as their worker metadata last said: their
        # loads fail, so nothing is matched while there is one.
        self._ranks_ended: dict[int, str] = {}
        # After a failed connect or a timed-out lookup: no attempt before _lookup_retry_at
        # (monotonic seconds).
        self._lookup_retry_at = 0.0
        self._lookup_backoff_s = 0.0

    def _connect_lookup(self) -> Any:
        """A lookup-only session whose every exchange waits at most lookup_timeout_s (the
        scheduler's loop waits for it). Raises ConfigError for a pool of another block size."""
        client = tutti.LookupClient.connect(
            self._config["socket"],
            model_fingerprint=self._fingerprint,
            tp_rank=0,
            tp_world=self._tp_world,
            client_name="vllm-scheduler",
            timeout_s=self._lookup_timeout_s,
        )
        check_block_size(client, self._block_size, format_hint=True)
        return client

    def _reconnect_lookup(self) -> None:
        """Connects the lost lookup session again, unless a back-off from a failed connect is
        running (then raises: the lookup is a miss without a word to tuttid)."""
        now = time.monotonic()
        if now < self._lookup_retry_at:
            raise _LookupBackingOff(f"no session with tuttid; the next connect in {self._lookup_retry_at - now:.1f} s")
        try:
            self._lookup = self._connect_lookup()
        except tutti.Error as error:
            self._back_off_lookups(f"connecting to tuttid for lookups failed ({error})")
            raise
        self.lookup_reconnects += 1

    def _back_off_lookups(self, why: str) -> None:
        """Starts the back-off, or doubles it while lookups keep failing (an answered lookup
        resets it, not a connect: a daemon that connects but does not answer in time keeps
        doubling it)."""
        self._lookup_backoff_s = min(max(2 * self._lookup_backoff_s, _RECONNECT_BACKOFF_FIRST_S), _RECONNECT_BACKOFF_MAX_S)
        self._lookup_retry_at = time.monotonic() + self._lookup_backoff_s
        logger.warning("tutti: %s; lookups are misses for %.1f s", why, self._lookup_backoff_s)

    def _drop_lookup(self) -> None:
        if self._lookup is not None:
            self._lookup.close()
            self._lookup = None

    def _lookup_all_ranks(self, tokens: list[int], first_block: int) -> int:
        """Where the run of blocks from `first_block` cached on every rank ends, in blocks (the
        blocks before are vLLM's own: they need not be in tutti). A lost session (closed by tuttid after a
        scheduler idle past its lease, or an exchange that timed out, after which the connection
        cannot be trusted) is dropped and connected again before the next use; a session tuttid
        closed is connected again at once, and the lookup asked again (once; lost again, the
        back-off starts). A lookup that
        timed out starts (or doubles) the back-off: the scheduler's loop waited lookup_timeout_s
        for it, and a daemon that connects but answers late would cost that per request."""
        for attempt in range(2):
            if self._lookup is None:
                self._reconnect_lookup()
            try:
                hit_blocks = self._lookup.lookup_all_ranks(tokens, first_block=first_block)
            except tutti.Error as error:
                if not connection_lost(error):
                    raise
                self._drop_lookup()
                if isinstance(error, tutti.TimeoutError):
                    self._back_off_lookups(f"a lookup timed out after {self._lookup_timeout_s:.1f} s ({error})")
                if attempt == 1 and isinstance(error, tutti.Disconnected):
                    # Lost again on a fresh session: a daemon that keeps breaking its sessions
                    # (a reply that does not decode or answer the lookup) costs two connects per
                    # back-off, not two per request.
                    self._back_off_lookups(f"the lookup session was lost twice in a row ({error})")
                if attempt == 1 or not isinstance(error, tutti.Disconnected):
                    raise
                continue
            self._lookup_backoff_s = 0.0
            return hit_blocks
        raise AssertionError("unreachable")

    def _scheduler_request(self, request: "Request") -> _SchedulerRequest:
        state = self._requests.get(request.request_id)
        if state is None:
            state = _SchedulerRequest(prompt=list(request.prompt_token_ids or []), uncacheable=self._uncacheable(request))
            self._requests[request.request_id] = state
        state.request = request
        return state

    def _uncacheable(self, request: Any) -> Optional[str]:
        """Why the request's KV is not a function of its prompt tokens alone (a vLLM Request or
        NewRequestData), logged once per kind; None when it is."""
        kind = None
        if getattr(request, "lora_request", None) is not None:
            kind = "a LoRA adapter"
        elif getattr(request, "mm_features", None):
            kind = "multimodal inputs"
        elif getattr(request, "cache_salt", None) is not None:
            kind = "a cache salt"
        elif getattr(request, "prompt_embeds", None) is not None:
            kind = "prompt embeddings"
        if kind is not None and kind not in self._uncacheable_logged:
            self._uncacheable_logged.add(kind)
            logger.warning(
                "tutti: requests with %s are neither loaded from nor saved to tutti (its keys are the prompt's "
                "tokens only, which would share KV across them); logged once",
                kind,
            )
        return kind

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Tokens beyond `num_computed_tokens` that every rank can load from tutti: whole blocks of
        the prompt, never its last token (vLLM computes at least one token to sample from), and
        with EAGLE/MTP never the hit's last block (vLLM recomputes it).
        Loads are synchronous (layer by layer during the step's forward): the bool is False.
        A daemon that does not answer is a miss (logged and counted), not a failed request; so is
        every request while a rank's tuttid session is ended (its worker metadata said so:
        `update_connector_output`), since that rank's loads fail."""
        state = self._scheduler_request(request)
        if state.uncacheable is not None or self._ranks_ended:
            return 0, False
        usable_blocks = max(0, len(state.prompt) - 1) // self._block_size
        # vLLM's local prefix hit is whole blocks; tutti needs only the blocks after it.
        local_blocks = num_computed_tokens // self._block_size
        if usable_blocks <= local_blocks:
            return 0, False
        try:
            hit_blocks = self._lookup_all_ranks(state.prompt[: usable_blocks * self._block_size], local_blocks)
        except tutti.Error as error:
            self.lookup_failures += 1
            log = logger.debug if isinstance(error, _LookupBackingOff) else logger.warning
            log("tutti lookup for request %s failed, treated as a miss: %s", request.request_id, error)
            return 0, False
        hit_blocks = min(hit_blocks, usable_blocks)
        if self._eagle_block_drop:
            # The whole hit's last block (vLLM's local blocks are already one short of its own).
            hit_blocks -= 1
        state.hit_tokens = max(0, hit_blocks) * self._block_size
        return max(0, state.hit_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Remembers the request's blocks; with external tokens, a load of the cached prefix into
        them for the next metadata."""
        state = self._scheduler_request(request)
        self._allocated.add(request.request_id)
        state.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens > 0:
            # The load fills the blocks from the first one vLLM does not hold (docs/vllm.md,
            # "Loads"); those before are vLLM's own and left alone.
            state.load_pending = state.hit_tokens // self._block_size
            state.load_first_block = max(0, state.hit_tokens - num_external_tokens) // self._block_size

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's loads (allocated since the last step), saves (requests whose prompt is
        complete by the end of this step: its whole blocks) and preemptions."""
        # The workers check that they share the scheduler's key space (`_check_scheduler_fingerprint`)
        # when they bind the first step's metadata: the inputs, which name every weight file of a
        # local model directory (hundreds of KB for thousands of files), go with that one only
        # (vLLM pickles every step's metadata to every worker); the 32-byte fingerprint with each.
        meta = TuttiConnectorMetadata(
            model_fingerprint=self._fingerprint,
            model_identity=self._fingerprint_inputs if self._metadata_builds == 0 else None,
        )
        preempted = set(scheduler_output.preempted_req_ids or ())
        meta.preempted_req_ids = preempted
        allocated, self._allocated = self._allocated, set()
        self._metadata_builds += 1
        self._released = [entry for entry in self._released if entry[0] >= self._metadata_builds - 2]
        for req_id in preempted:
            state = self._requests.get(req_id)
            if state is not None:
                # Its blocks are freed; a resumed request is allocated (and saved) anew. One
                # allocated since the last metadata was resumed in this step, after the
                # preemption: its new blocks and load stand (the workers settle the old
                # transfers in handle_preemptions before this step's).
                state.save_emitted = False
                if state.stale_from is not None:
                    # Its freed blocks, those cached since the last step included, leave vLLM's
                    # prefix cache (one resumed in this step holds new blocks already: the old
                    # ones were evicted up to the last step). Resumed, it computes or loads its
                    # blocks afresh.
                    if req_id not in allocated:
                        self._evict_stale(state.block_ids[state.stale_from :])
                    state.stale_from = None
                if req_id not in allocated:
                    self._release(state.block_ids)
                    state.block_ids = []
                    state.load_pending = None

        scheduled: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                state = _SchedulerRequest(prompt=list(new.prompt_token_ids or []), uncacheable=self._uncacheable(new))
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
            if state.uncacheable is not None:
                state.load_pending = None
                continue
            if state.stale_from is not None:
                # vLLM caches a block once it is computed, possibly in this step's allocation:
                # those after the stale ones were computed against them.
                state.load_pending = None
                self._evict_stale(state.block_ids[state.stale_from :])
                continue
            if state.load_pending:
                blocks = state.load_pending
                meta.loads.append(
                    LoadSpec(
                        req_id,
                        state.prompt[: blocks * self._block_size],
                        state.block_ids[:blocks],
                        min(state.load_first_block, blocks),
                    )
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
                    state.save_preemptions = None if state.request is None else _preemptions(state.request)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Workers' transfer results: vLLM itself frees a request's blocks once every worker named
        it in finished_sending. Blocks whose load failed (invalid_block_ids) hold stale bytes,
        and vLLM's prefix cache has shared them since their allocation (a synchronous load's
        blocks are cached when allocated). vLLM ("recompute") keeps them cached, and keeps as
        computed what another request sharing them computed against them (with async
        scheduling, a chunk of a request scheduled in the step after the failure); the workers
        cancel saves over them only in the failure's step and the next. So every request
        holding one is not saved from then on (whenever its prompt completes), and the failed
        blocks and every later block of such a request are evicted from vLLM's prefix cache,
        now and at each later step and its end (`_evict_stale`): no later request gets a local
        hit on stale bytes (and saves them). The request that loaded recomputes its blocks;
        they are simply not cached again.

        The workers' metadata (TuttiWorkerMetadata) says which ranks' sessions are ended: while
        one is, every load fails on it, so nothing is matched (each hit would compute on
        unfilled blocks, then recompute, and evict vLLM's own cache entries for them)."""
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, TuttiWorkerMetadata):
            self._note_sessions(worker_meta.sessions_ended)
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not invalid:
            return
        stale = set(invalid)
        affected = []
        for req_id, state in self._requests.items():
            first = next((index for index, block_id in enumerate(state.block_ids) if block_id in invalid), None)
            if first is None:
                continue
            state.stale_from = first if state.stale_from is None else min(state.stale_from, first)
            stale.update(state.block_ids[state.stale_from :])
            affected.append(req_id)
        for _, block_ids in self._released:
            # Freed since (their request gone or preempted) and possibly handed to another
            # request meanwhile: evicting such a block costs that one a cache entry, no more.
            first = next((index for index, block_id in enumerate(block_ids) if block_id in invalid), None)
            if first is not None:
                stale.update(block_ids[first:])
        self._evict_stale(stale)
        logger.warning(
            "tutti: %d blocks failed to load and are recomputed; requests %s, computed against them, are not saved "
            "and %d blocks are evicted from vLLM's prefix cache",
            len(invalid), sorted(affected), len(stale),
        )  # fmt: skip

    def _note_sessions(self, sessions_ended: dict[int, Optional[str]]) -> None:
        """Records the ranks' session states a worker metadata reported (logged when one changes)."""
        for rank, reason in sessions_ended.items():
            if reason is None:
                if self._ranks_ended.pop(rank, None) is not None:
                    logger.warning("tutti: rank %d opened a new tuttid session; lookups resume", rank)
            elif rank not in self._ranks_ended:
                self._ranks_ended[rank] = reason
                logger.error("tutti: rank %d's tuttid session is ended (%s); nothing is loaded from tutti until it opens a new one", rank, reason)

    def _release(self, block_ids: list[int]) -> None:
        """Remembers the blocks a request gave up (see `_released`)."""
        if block_ids:
            self._released.append((self._metadata_builds, list(block_ids)))

    def _evict_stale(self, block_ids: Any) -> None:
        """Evicts blocks from vLLM's prefix cache (held ones stay allocated to their requests;
        vLLM caches nothing it already counted cached, so they are not cached again)."""
        block_ids = set(block_ids)
        if not block_ids:
            return
        manager = getattr(self, "_kv_cache_manager", None)
        if manager is None:
            # vLLM 0.32's scheduler binds its manager at construction (bind_kv_cache_manager).
            logger.error(
                "tutti: vLLM bound no KV cache manager to the connector: %d blocks with stale bytes stay in vLLM's "
                "prefix cache",
                len(block_ids),
            )
            return
        manager.evict_blocks(block_ids)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """True (keep the blocks) when a save of this request was handed to the workers: they
        report it through get_finished once its last layer completed (and it was committed).
        False when the request was preempted since its save was emitted, outside schedule()
        (vLLM's reset_prefix_cache(reset_running_requests=True) preempts every running request;
        an abort can then come before the next metadata names it preempted): the workers forget
        that save when they handle the preemption and never report it, so vLLM would keep the
        request forever. Its blocks were freed by the preemption already. (Not judged by
        num_computed_tokens == 0: vLLM's invalid-block handling resets that too.)"""
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.stale_from is not None:
            self._evict_stale(list(block_ids)[state.stale_from :])
        self._release(list(block_ids))
        keep = (
            state is not None
            and state.save_emitted
            and state.save_preemptions in (None, _preemptions(request))
        )
        return keep, None


def _preemptions(request: Any) -> int:
    """vLLM's count of the request's preemptions (Scheduler._preempt_request adds one)."""
    return int(getattr(request, "num_preemptions", 0) or 0)
