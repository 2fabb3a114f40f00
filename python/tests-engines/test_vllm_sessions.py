"""tutti.vllm.TuttiConnector: what the scheduler side learns of the workers' tuttid sessions, and
how a worker whose session ended (or whose daemon stopped answering) keeps serving without
tutti. The worker-side connectors run in this process (test_vllm_connector.LocalWorker)."""

from __future__ import annotations

import math
import time

import torch

import vllm_harness as harness
from test_vllm_connector import LocalWorker, StandInWorker, prompt
from tutti.vllm import TuttiConnectorMetadata
from tutti.vllm.connector import LoadSpec, SaveSpec
from tutti.vllm.metadata import TuttiWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput


def test_worker_metadata_aggregates_every_ranks_session_state():
    """Goal: vLLM's output aggregator folds each rank's metadata into one (aggregate): a rank
    whose session ended is named whatever the other ranks say, in either order."""
    alive, dead = TuttiWorkerMetadata({0: None}), TuttiWorkerMetadata({1: "ended"})
    assert alive.aggregate(dead).sessions_ended == {0: None, 1: "ended"}
    assert dead.aggregate(alive).sessions_ended == {0: None, 1: "ended"}


def test_the_scheduler_stops_matching_while_a_workers_session_is_ended(tuttid):
    """Goal: a worker with CPU KV (tuttid's window) whose session ended fails every load until it
    is restarted; each hit would compute the prompt on unfilled blocks, recompute it, and evict
    vLLM's own prefix cache entries for those blocks. The worker says its session is ended in
    its step's worker metadata (build_connector_worker_meta); once the scheduler side has it
    (update_connector_output) it answers 0 matched tokens, here for a request identical to the
    one whose load failed."""
    daemon = tuttid(harness.TUTTID_GEOMETRY)
    worker = LocalWorker(daemon.socket)
    scheduler = harness.make_connector(harness.vllm_config(daemon.socket, 1), KVConnectorRole.SCHEDULER)
    try:
        block = harness.BLOCK_TOKENS
        tokens = prompt(61, blocks=2, tail=3)
        worker.fill([1, 2], 61)
        worker.save("S", tokens[: 2 * block], [1, 2])
        assert worker.connector.build_connector_worker_meta() is None, "an open session reports nothing"
        request_a = harness.request("A", tokens)
        assert scheduler.get_num_new_matched_tokens(request_a, 0) == (2 * block, False)
        worker.connector._end_session("ended by the test")
        result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("A", tokens[: 2 * block], [5, 6])]))
        assert result["load_errors"] == {5, 6}
        scheduler.update_connector_output(
            KVConnectorOutput(invalid_block_ids=result["load_errors"], kv_connector_worker_meta=worker.connector.build_connector_worker_meta())
        )
        assert scheduler.get_num_new_matched_tokens(harness.request("B", tokens), 0) == (0, False)
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_the_scheduler_matches_again_once_the_worker_opened_a_new_session(tuttid):
    """Goal: a worker with device-memory KV opens a new session after its session ended; it says
    so in its next worker metadata, and the scheduler side finds the pool's blocks again."""
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--device-memory", "memfd"])
    worker = StandInWorker(daemon.socket)
    scheduler = harness.make_connector(harness.vllm_config(daemon.socket, 1), KVConnectorRole.SCHEDULER)
    try:
        block = harness.BLOCK_TOKENS
        tokens = prompt(62, blocks=2, tail=3)
        worker.fill([1, 2], 62)
        worker.save("S", tokens[: 2 * block], [1, 2])
        worker.connector._end_session("ended by the test")
        scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker.connector.build_connector_worker_meta()))
        assert scheduler.get_num_new_matched_tokens(harness.request("A", tokens), 0) == (0, False)
        deadline = time.monotonic() + 10.0
        while worker.connector._dead is not None:
            assert time.monotonic() < deadline, "the worker opened no new session"
            worker.step(TuttiConnectorMetadata())
            time.sleep(0.05)
        scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker.connector.build_connector_worker_meta()))
        assert scheduler.get_num_new_matched_tokens(harness.request("B", tokens), 0) == (2 * block, False)
        assert worker.connector.build_connector_worker_meta() is None, "the new session was reported once"
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_a_stalled_daemon_without_a_load_in_flight_does_not_stop_a_device_memory_worker(tuttid):
    """Goal: with device-memory KV (vLLM's GPU caches; here the CPU stand-in) a tuttid that stops
    answering ends the worker's session (a prepare times out), and the close cannot confirm that
    tuttid let go of the memory. No load was in flight, so nothing can write vLLM's blocks: the
    worker does not raise KvMemoryUnsafe (which stops the engine) but keeps that memory's
    registration for good, never registers it again, and serves without tutti (loads fail, the
    scheduler is told). A load in flight still stops it
    (test_vllm_connector.test_a_load_whose_layer_never_completes_stops_the_worker)."""
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--device-memory", "memfd"])
    worker = StandInWorker(daemon.socket, timeout_s=0.5)
    try:
        block = harness.BLOCK_TOKENS
        tokens = prompt(63, blocks=2, tail=0)
        worker.fill([1, 2], 63)
        worker.save("S", tokens, [1, 2])
        daemon.pause()
        try:
            worker.step(TuttiConnectorMetadata(saves=[SaveSpec("X", prompt(64, blocks=2, tail=0), [3, 4])]))
            connector = worker.connector
            assert connector._dead is not None
            assert connector._store.leaked_registrations() > 0, "the test needs a close tuttid did not confirm"
            result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("L", tokens[: 2 * block], [20, 21])]))
            assert result["load_errors"] == {20, 21}
            assert connector.build_connector_worker_meta().sessions_ended == {0: connector._dead}
        finally:
            daemon.resume()
        time.sleep(1.5)  # past the first re-attach back-off: it is never tried
        worker.step(TuttiConnectorMetadata())
        assert worker.connector._dead is not None and worker.connector.reattaches == 0
    finally:
        worker.shutdown()


def test_a_new_session_is_opened_off_the_step_path(tuttid):
    """Goal: a worker with device-memory KV whose session ended opens a new one without making
    vLLM's steps wait: against a tuttid that does not answer, each try would wait timeout_s for
    tuttid's Hello (here 2 s) inside the step. The try runs on a thread of its own; steps go on
    at once (loads failing) and the new session is taken up at the first step after it opened."""
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--device-memory", "memfd"])
    worker = StandInWorker(daemon.socket, timeout_s=2.0)
    try:
        block = harness.BLOCK_TOKENS
        tokens = prompt(65, blocks=2, tail=0)
        worker.fill([1, 2], 65)
        worker.save("S", tokens, [1, 2])
        worker.connector._end_session("ended by the test")
        daemon.pause()
        try:
            for _ in range(3):
                started = time.monotonic()
                result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("L", tokens[: 2 * block], [20, 21])]))
                took_s = time.monotonic() - started
                assert took_s < 0.5, f"a step waited {took_s:.1f} s for a new tuttid session"
                assert result["load_errors"] == {20, 21}
                time.sleep(0.4)
        finally:
            daemon.resume()
        deadline = time.monotonic() + 20.0
        while worker.connector._dead is not None:
            assert time.monotonic() < deadline, "the worker opened no new session"
            worker.step(TuttiConnectorMetadata())
            time.sleep(0.05)
        for part in worker.blocks_bytes([20, 21]):
            part.zero_()
        result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("L2", tokens[: 2 * block], [20, 21])]))
        assert result["load_errors"] == set()
        assert all(torch.equal(loaded, saved) for loaded, saved in zip(worker.blocks_bytes([20, 21]), worker.blocks_bytes([1, 2])))
    finally:
        worker.shutdown()


def test_verify_retrieves_reaches_the_workers_store(tuttid, monkeypatch):
    """Goal: kv_connector_extra_config's verify_retrieves (off by default) attaches the worker's
    store with it: a load then checks every block against the CRC recorded at its save, and a
    sound block loads byte-exact."""
    import tutti
    from tutti.vllm import _worker

    attached = []
    real_attach = tutti.Store.attach

    class Recording:
        @staticmethod
        def attach(*args, **kwargs):
            attached.append(kwargs.get("verify_retrieves"))
            return real_attach(*args, **kwargs)

    monkeypatch.setattr(_worker.tutti, "Store", Recording)
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--payload-crc"])
    LocalWorker(daemon.socket).shutdown()
    worker = LocalWorker(daemon.socket, verify_retrieves=True)
    assert attached == [False, True]
    try:
        block = harness.BLOCK_TOKENS
        tokens = prompt(66, blocks=2, tail=0)
        worker.fill([1, 2], 66)
        worker.save("S", tokens, [1, 2])
        result = worker.step(TuttiConnectorMetadata(loads=[LoadSpec("L", tokens[: 2 * block], [20, 21])]))
        assert result["load_errors"] == set()
        assert all(torch.equal(loaded, saved) for loaded, saved in zip(worker.blocks_bytes([20, 21]), worker.blocks_bytes([1, 2])))
    finally:
        worker.shutdown()


class FakeSession:
    """Stands for a store a re-attach opened: says whether it was closed."""

    def __init__(self) -> None:
        self.closed = False

    def register_kv(self, layout) -> None:
        pass

    def close(self, timeout_s=None) -> None:
        self.closed = True


class CloseRaises:
    """The worker's store whose close raises once it closed the real one."""

    def __init__(self, store) -> None:
        self._real = store

    def __getattr__(self, name):
        return getattr(self._real, name)

    def close(self, timeout_s=None) -> None:
        self._real.close()
        raise RuntimeError("close failed (the test)")


def ended_worker_reattaching(daemon, attach):
    """A device-memory worker whose session ended and whose re-attach thread runs `attach`."""
    worker = StandInWorker(daemon.socket, timeout_s=2.0)
    worker.connector._end_session("ended by the test")
    worker.connector._attach = attach
    worker.step(TuttiConnectorMetadata())
    assert worker.connector._reattach_thread is not None, "the step started no re-attach"
    return worker


def test_a_reattach_finishing_after_a_failed_close_closes_its_store(tuttid):
    """Goal: a worker shutting down whose store's close raises still stops a re-attach in flight
    from parking its new session: the session the re-attach opens afterwards is closed, not left
    open for good (tuttid's session and device memory registration held)."""
    import threading

    import pytest

    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--device-memory", "memfd"])
    release, session = threading.Event(), FakeSession()

    def attach():
        release.wait(10.0)
        return session

    worker = ended_worker_reattaching(daemon, attach)
    connector = worker.connector
    connector._store = CloseRaises(connector._store)
    thread = connector._reattach_thread
    with pytest.raises(RuntimeError, match="close failed"):
        connector.shutdown()
    release.set()
    thread.join(5.0)
    assert not thread.is_alive()
    assert session.closed, "the re-attach's session was parked, never closed"


def test_shutdown_waits_a_little_for_a_reattach_in_flight(tuttid):
    """Goal: shutdown joins the re-attach thread (bounded): a try that ends within the wait is
    over, its session closed, when shutdown returns; one that does not is left to close its
    session itself, and shutdown still returns within its bound."""
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--device-memory", "memfd"])
    session = FakeSession()

    def attach():
        time.sleep(0.3)
        return session

    worker = ended_worker_reattaching(daemon, attach)
    thread = worker.connector._reattach_thread
    worker.shutdown()
    assert not thread.is_alive(), "shutdown returned with the re-attach thread running"
    assert session.closed


class RegisterRaises(FakeSession):
    """A store a re-attach opened whose register_kv raises `exception`."""

    def __init__(self, exception: BaseException) -> None:
        super().__init__()
        self.exception = exception

    def register_kv(self, layout) -> None:
        raise self.exception


def test_a_memory_error_in_a_reattach_is_a_failed_try_and_an_interrupt_is_for_good(tuttid):
    """Goal: a MemoryError in a re-attach (torch's __dlpack__ out of host memory: register_kv
    passes it through, not as a tutti.Error) is a failed try like a tutti.Error: the store it
    opened is closed, the rank backs off and its next try opens a session; before, the rank
    re-attached no more, logged as a bug. A KeyboardInterrupt there (raised by a producer itself)
    still ends the rank's re-attaching for good."""
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--device-memory", "memfd"])
    for exception, retried in [(MemoryError("out of memory (the test)"), True), (KeyboardInterrupt("the test"), False)]:
        failing = RegisterRaises(exception)
        worker = ended_worker_reattaching(daemon, lambda failing=failing: failing)
        connector = worker.connector
        try:
            connector._reattach_thread.join(5.0)
            worker.step(TuttiConnectorMetadata())
            assert failing.closed, "the store the failed try opened was left open"
            assert connector._dead is not None
            if not retried:
                assert connector._reattach_at == math.inf, f"{exception!r} was retried"
                continue
            assert time.monotonic() < connector._reattach_at < math.inf, f"{exception!r} is not retried after a back-off"
            del connector._attach  # the next try attaches for real
            connector._reattach_at = 0.0
            worker.step(TuttiConnectorMetadata())
            connector._reattach_thread.join(10.0)
            worker.step(TuttiConnectorMetadata())
            assert connector._dead is None and connector.reattaches == 1
        finally:
            worker.shutdown()


def test_a_programming_error_in_a_reattach_stops_that_ranks_reattaching_without_raising(tuttid, monkeypatch, caplog):
    """Goal: the re-attach thread treats tutti.Error as a failed try (retried after a back-off);
    anything else (a bug) is logged at error level with its traceback and the rank re-attaches no
    more (it serves without tutti until restarted, which the scheduler side learns from its
    worker metadata), rather than retried for good. It is not raised: each rank's re-attach is
    its own, so with tensor parallelism only the failing rank would raise, vLLM 0.32's
    MultiprocExecutor only logs a rank's exception that is not the output rank's, and rank 0
    would wait in the forward's all-reduce until VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s) and
    stop the engine with a timeout instead of the error. Two ranks over a stubbed TP group: only
    rank 1's re-attach raises TypeError; both ranks' steps return alike, rank 0 with its new
    session, and no collective is added to a step."""
    import logging

    import tutti
    import tutti.vllm._worker as worker_module

    collectives: list[list[bool]] = []

    def stubbed_group(failed_here):
        collectives.append(list(failed_here))
        return list(failed_here)

    monkeypatch.setattr(worker_module, "_failed_on_any_rank", stubbed_group)
    daemon = tuttid(harness.TUTTID_GEOMETRY, ["--device-memory", "memfd"])
    ranks = [StandInWorker(daemon.socket, timeout_s=2.0) for _ in range(2)]
    try:
        for rank, worker in enumerate(ranks):
            worker.connector._tp_world, worker.connector._tp_rank = 2, rank
            worker.connector._end_session("ended by the test")

        def attach_refused():
            raise tutti.DaemonError("refused (the test)")

        ranks[1].connector._attach = attach_refused
        ranks[1].step(TuttiConnectorMetadata())
        ranks[1].connector._reattach_thread.join(5.0)
        ranks[1].step(TuttiConnectorMetadata())
        assert ranks[1].connector._reattach_at > time.monotonic(), "a failed try is retried after a back-off"

        def attach_buggy():
            raise TypeError("a bug (the test)")

        ranks[1].connector._attach = attach_buggy
        ranks[1].connector._reattach_at = 0.0
        for worker in ranks:
            worker.step(TuttiConnectorMetadata())
        for worker in ranks:
            worker.connector._reattach_thread.join(10.0)
        caplog.set_level(logging.ERROR, logger="tutti.vllm")
        for worker in ranks:
            worker.step(TuttiConnectorMetadata())  # raised TypeError on rank 1 alone
        assert ranks[0].connector._dead is None and ranks[0].connector.reattaches == 1
        assert ranks[1].connector._dead is not None and ranks[1].connector._reattach_at == math.inf
        assert any(
            record.levelno == logging.ERROR and record.exc_info and "a bug (the test)" in str(record.exc_info[1])
            for record in caplog.records
        ), caplog.text
        assert ranks[1].connector.build_connector_worker_meta().sessions_ended, "the scheduler side is not told"
        ranks[1].step(TuttiConnectorMetadata())
        assert ranks[1].connector._reattach_thread is None, "the rank tried again"
        assert collectives == [], "a step without a failure ran a collective"
    finally:
        for worker in ranks:
            worker.shutdown()
