"""`TuttiTier`: a secondary tier for vLLM's offloading connector (CPU tier ↔ tutti), the smallest
way to put tutti behind vLLM's own CPU offloading (docs/vllm.md).

vLLM's `TieringOffloadingSpec` keeps a CPU primary tier (a shared-memory region of chunk rows,
one row per offloaded chunk, every worker's bytes of that chunk side by side) and hands each
secondary tier a memoryview over it, in the scheduler process. This tier opens a tutti pool in
that process (`tutti.Store.open` on the configured devices) and registers the memoryview where it
lies: a chunk row is one pool block (the pool's "byte geometry": one layer, the row's first half
its K object, the second half its V), so moving a chunk is one command pair with no copy.

vLLM calls every method on the scheduler's thread and wants them non-blocking: jobs go to one
worker thread through a bounded queue; their results come back through `get_finished_jobs`.

A chunk row a device may still write is never handed back to vLLM: vLLM frees a failed
promotion's rows for reuse as soon as the job is reported, so a load whose layer does not
complete closes the pool (its queue pairs deleted, the controllers confirming it) before its job
is reported; the tier then moves nothing more (lookups miss, jobs fail). If the close cannot
confirm that, the job is never reported (its rows stay vLLM's promotion in flight) and the
tier's next call from vLLM raises `KvMemoryUnsafe`. A store whose layer does not complete closes
the pool too (it only read its row, so its job is reported either way): such a request would
otherwise hold its request place and pins for good, and enough of them stop every later job.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import tutti
from tutti._engine import _IOCBS_MAX as IOCBS_MAX
from tutti._engine import (
    BYTE_GEOMETRY_BLOCK_TOKENS,
    ConfigError,
    Field,
    abandon_request,
    bounded_timeout,
    byte_geometry,
    device_strings_problem,
    fingerprint_from_config,
    format_devices,
    hash_tokens,
    iocbs_for,
    parse_config,
    positive,
    queue_depth_field,
    refuses_crc_less_pool,
    requests_in_range,
    wait_s,
    wait_out_layer,
)
from tutti.vllm.connector import KvMemoryUnsafe, _model_identity, _refuse_non_causal_attention, _resolved_kv_layout
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger("tutti.vllm")

# How often drain_jobs looks at the tier's thread while it waits.
_DRAIN_POLL_S = 0.5

TIER_CONFIG_FIELDS = {
    "devices": Field(
        (str, list),
        "the pool's devices, e.g. \"vfio:0000:01:00.0\" or [\"emu:/var/tutti/pool.img\"]",
        required=True,
        check=device_strings_problem,
    ),
    "format": Field(bool, "format a fresh pool for this engine's chunk size first (everything on it is lost)", default=False),
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
        "64 hex digits naming the model and its weights (dtype, chunk shape, parallel split and KV layout are hashed with it); "
        "default: derived from the engine's VllmConfig as the connector's (refused where the tier cannot find it)",
    ),
    "lock_dir": Field(str, "where vfio: devices' lock files live (as tuttid's --lock-dir)", default="/run/tutti"),
    "timeout_s": Field(
        float,
        "the longest wait for one chunk's I/O, seconds (a wave of chunks waits at most timeout_s a chunk, and one more, in all)",
        default=30.0,
        check=bounded_timeout,
    ),
    "requests_max": Field(
        int, "chunks moved at once (at most 1024, the IOCBs the pool gives them; more is refused)", default=16, check=requests_in_range
    ),
    "queue_depth": queue_depth_field(),
    "queue_max": Field(int, "jobs waiting for the tier's thread; a store job beyond it is dropped (a future miss)", default=1024, check=positive),
    "verify_retrieves": Field(
        bool,
        "check every chunk read against the CRC recorded when it was stored; a chunk that differs is not loaded "
        "(vLLM keeps it a miss) and leaves the pool",
        default=True,
    ),
    "locality": Field(str, "vLLM's tier locality (LOCAL or REMOTE), the tier's `locality`", default="LOCAL"),
}


class TuttiTier(SecondaryTierManager):
    """A vLLM secondary offloading tier on a tutti pool opened in the scheduler process."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: "OffloadingSpec",
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Optional["BackpressureDetector"] = None,
        **tier_config: Any,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        from tutti.vllm import check_vllm_version

        check_vllm_version()
        config = parse_config(f"secondary tier {tier_type!r}", tier_config, TIER_CONFIG_FIELDS)
        self._timeout_s = float(config["timeout_s"])
        self._requests_max = int(config["requests_max"])
        # A chunk is one request of one block and one layer: one IOCB each, requests_max in all
        # (the store's default, 64, would refuse every request of a wave past the 64th).
        # Refused here, before the pool is opened, past 1024 (IOCBS_MAX), in the tier's own
        # words: iocbs_for's refusal names layers_in_flight, which the tier does not have.
        if self._requests_max > IOCBS_MAX:
            raise ConfigError(
                f"secondary tier {tier_type!r}: requests_max = {self._requests_max}: at most {IOCBS_MAX} for the "
                "tier (one IOCB per chunk moved at once, and a pool is given at most that many)"
            )
        iocbs = iocbs_for(f"secondary tier {tier_type!r}", self._requests_max, 1, blocks_per_request_max=1)
        geometry = byte_geometry(self.block_size_bytes)
        spec_config = offloading_spec.config
        try:
            self.locality = Locality(config["locality"])
        except ValueError:
            raise ConfigError(
                f"secondary tier {tier_type!r}: field 'locality' = {config['locality']!r}: must be one of "
                f"{', '.join(locality.value for locality in Locality)}"
            ) from None
        fingerprint = _tier_fingerprint(spec_config, self.block_size_bytes, config["model_fingerprint"], tier_type)
        self._store = tutti.Store.open(
            format_devices(config["devices"], 0),
            geometry,
            format=config["format"],
            overwrite=config["overwrite"],
            create_bytes=config["create_bytes"],
            slots_max=config["slots_max"],
            model_fingerprint=fingerprint,
            lock_dir=config["lock_dir"],
            requests_max=self._requests_max,
            iocbs=iocbs,
            queue_depth=config["queue_depth"],
            timeout_s=self._timeout_s,
            verify_retrieves=config["verify_retrieves"],
        )
        try:
            self._store.register_kv(tutti.KvLayout.paged([primary_kv_view]))
        except BaseException as error:
            self._store.close()
            if config["verify_retrieves"] and refuses_crc_less_pool(error):
                # The pool's own refusal names only reformatting: say the other way out too.
                raise ConfigError(
                    f"secondary tier {tier_type!r}: the pool on {config['devices']!r} was formatted without payload "
                    "CRCs (`tutti pool format` and tuttid --format without --payload-crc), which the tier's "
                    "verify_retrieves (on by default) needs to check each chunk it loads: set "
                    '"verify_retrieves": false in the tier\'s config to serve this pool unchecked, or format it '
                    "again with --payload-crc (or the tier's \"format\": true, which records them; everything on it "
                    f"is lost) [{error}]"
                ) from error
            raise
        self._jobs: queue.Queue = queue.Queue(maxsize=config["queue_max"])
        self._results: list[JobResult] = []
        self._results_lock = threading.Lock()
        self._idle = threading.Condition(self._results_lock)
        self._in_progress = 0
        # Waves of chunks the tier's thread ended (drain_jobs' progress within a job).
        self._waves_ended = 0
        self.dropped_store_jobs = 0
        # Why the pool was closed for good (a load's layer did not complete): jobs fail at once.
        self._dead: Optional[str] = None
        # Set at the end of a close that confirmed its queue pairs deleted (no registrations
        # kept). _dead is set before the close starts, so a close that raised leaves _dead set
        # and this False: that is no confirmation (`_close_pool_after`).
        self._close_confirmed = False
        # Set (by the tier's thread) when that close did not confirm that the controllers stopped
        # writing chunk rows: vLLM's next call raises KvMemoryUnsafe.
        self._unsafe: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="tutti-vllm-tier", daemon=True)
        self._thread.start()

    # -- vLLM's calls (scheduler thread) ---------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the chunk is committed in the pool (a chunk being stored is not yet)."""
        self._raise_if_unsafe()
        if self._dead is not None:
            return LookupResult.MISS
        try:
            found = self._store.lookup(hash_tokens(key, BYTE_GEOMETRY_BLOCK_TOKENS))
        except tutti.Error as error:
            logger.warning("tutti tier lookup failed, treated as a miss: %s", error)
            return LookupResult.MISS
        return LookupResult.HIT if found >= 1 else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._raise_if_unsafe()
        self._submit(job_metadata, store=True)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._raise_if_unsafe()
        self._submit(job_metadata, store=False)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._raise_if_unsafe()
        self._fail_orphaned_jobs()
        with self._results_lock:
            results, self._results = self._results, []
        return results

    def has_pending_work(self) -> bool:
        self._fail_orphaned_jobs()
        with self._results_lock:
            return self._in_progress > 0 or bool(self._results)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Waits until every submitted job finished. Every wait of a job's I/O is bounded: a wave
        of at most requests_max chunks waits at most timeout_s for the chunks that failed to
        issue (`_issue_deadline`), then timeout_s a chunk and one more for the issued ones
        (`_wave_deadline`), then closes the pool if a layer is stuck (timeout_s for the layers
        in flight, then the queue pairs' deletion). So when no job and no wave of one finished
        for timeout_s x (requests_max + 4) the tier is taken for stuck: raises
        tutti.TimeoutError rather than return (vLLM frees rows after drain_jobs, which a job
        may still touch) or wait for ever. The pool's metadata I/O is not in that bound: a
        prepare's header syncs and a commit's flush and header writes are bounded by the pool's
        own metadata timeout (10 s each, whatever timeout_s is), so a device that answers those
        late can make this raise while the job still runs (at most one commit of a wave fails
        that way past its deadline: the wave stops there and the pool is closed). Jobs queued
        for a thread that has stopped are reported failed (they touched no row)."""
        stall_s = self._timeout_s * (self._requests_max + 4)
        last_progress, progress_at = None, time.monotonic()
        while True:
            self._raise_if_unsafe()
            self._fail_orphaned_jobs()
            with self._idle:
                if self._in_progress == 0:
                    return
                progress = (-self._in_progress, self._waves_ended)
                if last_progress is None or progress != last_progress:
                    last_progress, progress_at = progress, time.monotonic()
                elif time.monotonic() - progress_at > stall_s:
                    raise tutti.TimeoutError(
                        f"tutti tier: {self._in_progress} jobs still running and none finished in {stall_s:.1f} s"
                        f"{'' if self._thread.is_alive() else ' (the tier thread has stopped)'}"
                    )
                self._idle.wait(timeout=_DRAIN_POLL_S)

    def _fail_orphaned_jobs(self) -> None:
        """Once the tier's thread has stopped (a KeyboardInterrupt or SystemExit in it): the jobs
        left in its queue are reported failed (never started, they touched no row)."""
        if self._thread.is_alive():
            return
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            with self._idle:
                self._results.append(JobResult(job_id=item[0], success=False))
                self._in_progress -= 1
                self._idle.notify_all()

    def shutdown(self) -> None:
        """Finishes the queued jobs, stops the thread, closes the pool (each wait bounded; the
        close keeps the registrations of memory a device may still write)."""
        try:
            self._jobs.put(None, timeout=self._timeout_s)
        except queue.Full:
            logger.error("tutti tier: the job thread did not take the stop in %.1f s", self._timeout_s)
        self._thread.join(timeout=self._timeout_s * 4)
        if self._thread.is_alive():
            logger.error("tutti tier: the job thread is still running after %.1f s; the pool is closed under it", self._timeout_s * 4)
        self._store.close()

    def _raise_if_unsafe(self) -> None:
        if self._unsafe is not None:
            raise KvMemoryUnsafe(self._unsafe)

    # -- the tier's thread -----------------------------------------------------------------------

    def _submit(self, job: TransferJob, store: bool) -> None:
        keys = list(job.keys)
        chunks = [int(chunk) for chunk in job.chunk_ids]
        if len(keys) != len(chunks):
            raise tutti.InvalidArgument(f"transfer job {job.job_id}: {len(keys)} keys but {len(chunks)} chunk ids")
        with self._results_lock:
            self._in_progress += 1
        try:
            if not self._thread.is_alive():
                logger.error("tutti tier: the tier's thread has stopped; job %d fails", job.job_id)
                raise queue.Full
            self._jobs.put_nowait((job.job_id, store, keys, chunks))
        except queue.Full:
            with self._idle:
                self._in_progress -= 1
                self._results.append(JobResult(job_id=job.job_id, success=False))
                self._idle.notify_all()
            if store:
                self.dropped_store_jobs += 1
            logger.warning("tutti tier: job queue full, job %d dropped", job.job_id)

    def _run(self) -> None:
        """The tier's thread: runs each job and reports it, whatever fails. Anything raised out
        of a job but _RowsUnsafe (tutti.Error is handled chunk by chunk, so this is an Exception
        of another kind in the middle of a wave, e.g. a MemoryError or an argument's TypeError;
        pyo3's PanicException: a panic in the binding; KeyboardInterrupt, SystemExit) closes the
        pool first: the wave's requests are in an unknown state, issued and never waited for, so
        a load's rows may still be written and a store's request holds its place and pins;
        KeyboardInterrupt and SystemExit then stop the thread, and the jobs after are reported
        failed (`_fail_orphaned_jobs`)."""
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job_id, store, keys, chunks = item
            fatal: Optional[BaseException] = None
            try:
                if self._dead is not None:
                    succeeded = []  # the pool is closed: the job touches no row
                else:
                    succeeded = self._store_chunks(keys, chunks) if store else self._load_chunks(keys, chunks)
            except _RowsUnsafe as error:
                # Never reported: vLLM keeps the job's rows (a promotion in flight) for good.
                logger.error("tutti tier: job %d is not reported: %s", job_id, error)
                with self._idle:
                    self._unsafe = str(error)
                    self._idle.notify_all()
                continue
            except BaseException as error:  # noqa: BLE001 - the thread must report every job, whatever failed
                logger.error("tutti tier: job %d failed: %r", job_id, error)
                succeeded = []
                if isinstance(error, (KeyboardInterrupt, SystemExit)):
                    fatal = error
                if not self._close_pool_after(job_id, f"job {job_id} failed: {error!r}", rows_written=not store):
                    if fatal is not None:
                        raise
                    continue
            result = JobResult(
                job_id=job_id,
                success=len(succeeded) == len(keys),
                successful_keys=None if store or len(succeeded) == len(keys) else succeeded,
                transfer_bytes=len(succeeded) * self.block_size_bytes,
            )
            with self._idle:
                self._results.append(result)
                self._in_progress -= 1
                self._idle.notify_all()
            if fatal is not None:
                raise fatal

    def _close_pool_after(self, job_id: int, reason: str, rows_written: bool) -> bool:
        """Closes the pool after a job failed in an unknown state; False (the job is not to be
        reported: its rows may still be written) when that cannot be confirmed. The pool already
        marked closed but not confirmed closed means this job's own close raised midway (only a
        running load or store job closes it, and none starts once it is marked), so its queue
        pairs may not be deleted: no confirmation."""
        try:
            if self._dead is None:
                self._close_pool(reason, rows_written=rows_written)
            elif not self._close_confirmed:
                raise _CloseFailed(f"the pool's close ({self._dead}) did not complete")
            return True
        except _RowsUnsafe as error:
            unsafe = str(error)
        except BaseException as error:  # noqa: BLE001
            if not rows_written:
                logger.error("tutti tier: closing the pool after job %d failed: %r", job_id, error)
                return True
            unsafe = f"tutti tier: {reason}, and closing the pool failed ({error!r}): vLLM's chunk rows may still be written"
        logger.error("tutti tier: job %d is not reported: %s", job_id, unsafe)
        with self._idle:
            self._unsafe = unsafe
            self._idle.notify_all()
        return False

    def _store_chunks(self, keys: list[OffloadKey], chunks: list[int]) -> list[OffloadKey]:
        """Stores each chunk not in the pool yet, `requests_max` at a time; returns the keys that
        are in the pool afterwards. A wave's waits end by its deadlines (`_issue_deadline`,
        `_wave_deadline`); at its first chunk whose layer does not complete, or whose commit
        fails with a timeout or device error past the deadline (the pool's flush and header
        writes, which the pool bounds itself), the wave stops and the pool is closed (the close
        settles the wave's other requests)."""
        done: list[OffloadKey] = []
        for start in range(0, len(keys), self._requests_max):
            if self._dead is not None:
                break
            wave_keys, wave_chunks = keys[start : start + self._requests_max], chunks[start : start + self._requests_max]
            issue_deadline: Optional[float] = None
            wave = []
            stuck = False
            for key, chunk in zip(wave_keys, wave_chunks):
                tokens = hash_tokens(key, BYTE_GEOMETRY_BLOCK_TOKENS)
                try:
                    request = self._store.prepare_store(tokens, [chunk])
                except tutti.Error as error:
                    logger.warning("tutti tier: chunk %d not stored: %s", chunk, error)
                    continue
                try:
                    if request.new_blocks == 0:
                        request.finish()
                        done.append(key)
                        continue
                    request.store_layer(0)
                    wave.append((key, request))
                except tutti.Error as error:
                    # Prepared: it holds a request place and pins until finished.
                    logger.warning("tutti tier: chunk %d not stored: %s", chunk, error)
                    issue_deadline = issue_deadline or self._issue_deadline()
                    if not _abandon(request, self._timeout_s, issue_deadline):
                        stuck = True
                        break
            deadline = self._wave_deadline(len(wave))
            commit_stuck = False
            for key, request in [] if stuck else wave:
                committing = False
                try:
                    request.wait(wait_s(self._timeout_s, deadline))
                    committing = True
                    request.commit()
                    done.append(key)
                except tutti.Error as error:
                    logger.warning("tutti tier: a chunk was not stored: %s", error)
                    if not _abandon(request, self._timeout_s, deadline):
                        stuck = True
                        break
                    if committing and isinstance(error, (tutti.TimeoutError, tutti.DeviceError)) and time.monotonic() >= deadline:
                        # A commit's flush and header writes are bounded by the pool's own
                        # metadata timeout (10 s each), not by the wave's deadline: one that
                        # failed that way past it would be paid again by every chunk left.
                        commit_stuck = True
                        break
            if stuck:
                # A store only reads its row, so vLLM may reuse it; but a request whose layer
                # never completes keeps its request place and pins for good, and enough of them
                # would stop every later job: a pool whose devices do not complete is closed.
                self._close_pool("a layer of a chunk store did not complete", rows_written=False)
            elif commit_stuck:
                self._close_pool(
                    "a chunk's commit (the pool's flush and header writes) failed past its wave's deadline", rows_written=False
                )
            self._wave_ended()
        return done

    def _load_chunks(self, keys: list[OffloadKey], chunks: list[int]) -> list[OffloadKey]:
        """Reads each chunk into its primary-tier row; returns the keys read. A chunk whose layer
        does not complete closes the pool before the job is reported (see the module
        documentation); raises _RowsUnsafe when that close does not confirm it. Waits end as
        `_store_chunks`' do."""
        done: list[OffloadKey] = []
        for start in range(0, len(keys), self._requests_max):
            if self._dead is not None:
                break
            wave_keys, wave_chunks = keys[start : start + self._requests_max], chunks[start : start + self._requests_max]
            issue_deadline: Optional[float] = None
            wave = []
            stuck = False
            for key, chunk in zip(wave_keys, wave_chunks):
                try:
                    request = self._store.prepare_retrieve(hash_tokens(key, BYTE_GEOMETRY_BLOCK_TOKENS), [chunk])
                except tutti.Error as error:
                    logger.warning("tutti tier: chunk %d not loaded: %s", chunk, error)
                    continue
                try:
                    request.retrieve_layer(0)
                    wave.append((key, request))
                except tutti.Error as error:
                    # Prepared: it holds a request place and pins until finished. An issue that
                    # failed after its commands were published leaves the layer in flight.
                    logger.warning("tutti tier: chunk %d not loaded: %s", chunk, error)
                    issue_deadline = issue_deadline or self._issue_deadline()
                    if not _abandon(request, self._timeout_s, issue_deadline):
                        stuck = True
                        break
            deadline = self._wave_deadline(len(wave))
            for key, request in [] if stuck else wave:
                try:
                    request.wait(wait_s(self._timeout_s, deadline))
                    request.finish()
                    done.append(key)
                except tutti.Error as error:
                    logger.warning("tutti tier: a chunk was not loaded: %s", error)
                    if not _abandon(request, self._timeout_s, deadline):
                        stuck = True
                        break
            if stuck:
                # The chunks not waited for are not reported loaded: the close deletes the queue
                # pairs that could still write their rows.
                self._close_pool("a layer of a chunk load did not complete")
            self._wave_ended()
        return done

    def _issue_deadline(self) -> float:
        """The deadline (time.monotonic()) shared by the waits of a wave's chunks that failed to
        issue (before they are finished: a layer may be in flight), counted from the first of
        them (the prepares before take none of it): timeout_s in all, not timeout_s each."""
        return time.monotonic() + self._timeout_s

    def _wave_deadline(self, chunks: int) -> float:
        """The deadline (time.monotonic()) of the waits of a wave's `chunks` issued chunks,
        counted once they are issued (their prepares, whose header syncs the pool bounds itself,
        take none of it): every wait for their layers and every abandon's wait ends by it,
        timeout_s a chunk and one more, so a chunk whose wait timed out still has up to
        timeout_s for its layer to complete (then it is finished and the pool stays open) even
        in a wave of one. A wave whose chunks all stall holds the tier's thread that long (then
        the pool's close: timeout_s for the layers in flight, and the queue pairs' deletion), not
        a wait and an abandon's wait of timeout_s each per chunk."""
        return time.monotonic() + self._timeout_s * (chunks + 1)

    def _wave_ended(self) -> None:
        """Progress for drain_jobs: a job of many waves is not stuck while its waves end."""
        with self._idle:
            self._waves_ended += 1
            self._idle.notify_all()

    def _close_pool(self, reason: str, rows_written: bool = True) -> None:
        """Closes the pool for good: its queue pairs are deleted, after which no controller
        touches a chunk row. When the stuck layer wrote rows (a load), raises _RowsUnsafe if the
        close could not confirm that (memory registrations kept); a stuck store only read its
        row, so that is logged, not raised."""
        self._dead = reason
        logger.error("tutti tier: %s; the pool is closed, the tier moves nothing more", reason)
        self._store.close(timeout_s=self._timeout_s)
        kept = self._store.leaked_registrations()
        self._close_confirmed = not kept
        if kept and not rows_written:
            logger.error("tutti tier: closing the pool kept %d memory registrations (queue pairs not deleted)", kept)
        elif kept:
            raise _RowsUnsafe(
                f"tutti tier: {reason}, and closing the pool did not confirm that its queue pairs were deleted "
                f"({kept} memory registrations kept): vLLM's chunk rows may still be written, so the job is not "
                "reported and the tier stops"
            )


# How far up the call stack the tier looks for the engine's VllmConfig (`_engine_config`).
_ENGINE_CONFIG_FRAMES_MAX = 32


def _engine_config() -> tuple[Any, Any]:
    """The engine's VllmConfig and KVCacheConfig (or None) where the tier is built, or (None,
    None). vLLM 0.32 hands a secondary tier only the OffloadingConfig (model name and cache
    dtype, no revision, quantization or RoPE), and builds it from OffloadingConnectorScheduler's
    __init__ (spec.get_manager()), whose frame holds the engine's `vllm_config` and
    `kv_cache_config`: found there, by those names, within _ENGINE_CONFIG_FRAMES_MAX frames,
    first (so the key names the KV cache groups wherever vLLM has a current config set too); only
    where no frame has them, vLLM's current config (and no KVCacheConfig)."""
    import sys

    frame = sys._getframe(1)
    for _ in range(_ENGINE_CONFIG_FRAMES_MAX):
        if frame is None:
            break
        found = frame.f_locals.get("vllm_config")
        if getattr(found, "model_config", None) is not None and getattr(found, "cache_config", None) is not None:
            return found, frame.f_locals.get("kv_cache_config")
        frame = frame.f_back
    try:
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
    except ImportError:
        current = None
    if getattr(current, "model_config", None) is not None:
        return current, None
    return None, None


def _tier_fingerprint(spec_config: Any, block_size_bytes: int, explicit: Optional[str], tier_type: str) -> bytes:
    """The pool's model fingerprint. How this deployment lays its chunk rows out (cache dtype,
    sizes, the TP/PP/PCP/DCP split: TP=2 x PP=1 and TP=1 x PP=2 have the same world size and
    other bytes in each rank's part of a row, the groups' layers, the KV layout, canonical and
    replicated layouts) is hashed with an explicit fingerprint too, which stands for the model
    only. The default names the model as the connector's does (`_model_identity`: pinned
    revision, quantization, RoPE parameters and hf_overrides, a local directory's weight files),
    read from the engine's VllmConfig (`_engine_config`); where that cannot be found the default
    is refused (ConfigError): the offloading config's model name alone would share one key
    space between revisions and quantizations of a model. A model with non-causal attention is
    refused whatever the fingerprint (`_refuse_non_causal_attention`), where the engine's
    KVCacheConfig is found."""
    vllm_config, kv_cache_config = _engine_config()
    _refuse_non_causal_attention(kv_cache_config, f"secondary tier {tier_type!r}", "the offloading connector")
    parallel = spec_config.parallel
    layout: list[Any] = [
        spec_config.model.dtype,
        spec_config.worker_kv_bytes_per_block,
        parallel.world_size,
        spec_config.cache.tokens_per_hash,
        spec_config.cache.blocks_per_chunk,
        block_size_bytes,
        str(spec_config.kv_cache_layout),
        "parallel", parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size,
        "canonical", int(bool(getattr(spec_config, "canonical_layout", False))),
        "replicated", int(bool(getattr(spec_config, "replicated_layout", False))),
    ]  # fmt: skip
    for group in spec_config.groups:
        layout += ["group", group.tokens_per_block, ",".join(group.layer_names)]
    if explicit is not None:
        return fingerprint_from_config(None, fingerprint_from_config(explicit), "vllm offloading tier", *layout)
    if vllm_config is None:
        raise ConfigError(
            f"secondary tier {tier_type!r}: the engine's VllmConfig was not found where the tier is built, so the "
            "default key cannot name the model's revision, quantization and RoPE parameters: set model_fingerprint "
            "(64 hex digits naming the model and its weights)"
        )
    # Built once for the deployment (in the scheduler's process): a missing fingerprint over
    # streamed weights is warned of here, naming where the tier reads model_fingerprint.
    identity = _model_identity(
        vllm_config,
        kv_cache_config,
        _resolved_kv_layout(vllm_config, kv_cache_config),
        fingerprint_setting=f"the config of secondary tier {tier_type!r} (its entry in secondary_tiers)",
    )
    return fingerprint_from_config(None, "vllm offloading tier", *identity, *layout)


class _RowsUnsafe(Exception):
    """The tier's thread: a job's chunk rows may still be written; the job is never reported."""


class _CloseFailed(Exception):
    """The tier's thread: a close of the pool raised before it confirmed anything."""


def _abandon(request: Any, timeout_s: float, deadline: float) -> bool:
    """`abandon_request` with this module's log, its waits for the layer in flight ending by
    `deadline` (time.monotonic(): the wave's)."""
    what = "tutti tier: a failed request"
    if not wait_out_layer(request, timeout_s, logger, what, deadline=deadline):
        return False
    # No layer in flight any more: abandon_request only finishes it.
    return abandon_request(request, timeout_s, logger, what)

