"""Across processes through tuttid: the GIL is released while a wait blocks (a second Python
thread runs), the eventfd becomes readable when a layer completes (without a wait), and a client
killed with SIGKILL mid-store loses nothing committed and leaves nothing of its own visible.

The daemon is paused with SIGSTOP where a test needs a layer that cannot complete yet: the
software controller runs inside it, so the client's command waits until SIGCONT."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

import tutti
from conftest import FINGERPRINT, GEOMETRY, HERE, WAIT_S, fill_block, run_child, store_prompt, tokens


def attached(daemon, **options) -> tuple[tutti.Store, tutti.KvLayout]:
    store = tutti.Store.attach(daemon.socket, model_fingerprint=FINGERPRINT, keepalive=False, **options)
    layout = store.allocate_kv(8, "paged")
    for block in range(4):
        fill_block(layout, block, block + 1)
    return store, layout


def test_a_blocked_wait_releases_the_gil(formatted_daemon):
    # Goal: while one thread waits for a layer that cannot complete (the controller is paused),
    # another Python thread runs freely; the wait then times out (the layer still in flight),
    # and completes once the controller resumes.
    store, _ = attached(formatted_daemon)
    request = store.prepare_store(tokens(1, 4), [0, 1, 2, 3])
    counter = [0]
    # When the spinning thread ran: a timestamp every 1000 increments.
    ran_at: list[float] = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1
            if counter[0] % 1000 == 0:
                ran_at.append(time.monotonic())

    formatted_daemon.pause()
    try:
        request.store_layer(0)
        thread = threading.Thread(target=spin)
        thread.start()
        started = time.monotonic()
        with pytest.raises(tutti.TimeoutError):
            request.wait(1.0)
        ended = time.monotonic()
        stop.set()
        thread.join(WAIT_S)
    finally:
        formatted_daemon.resume()
    waited = ended - started
    assert waited >= 0.95, f"the wait returned after {waited:.3f} s"
    # A thread behind a held GIL could not run at all inside the wait (only before it started
    # and after it returned); a Python loop counts thousands per millisecond even here.
    inside = [moment for moment in ran_at if started + 0.1 < moment < ended - 0.1]
    assert len(inside) >= 10, f"the second thread ran {len(inside)} x 1000 increments inside a {waited:.2f} s wait"
    assert request.wait(WAIT_S) == 0, "the layer completes once the controller runs"
    for layer in range(1, GEOMETRY.layers):
        request.store_layer(layer)
        request.wait(WAIT_S)
    request.commit()
    store.close()


def test_the_eventfd_becomes_readable_when_a_layer_completes(formatted_daemon):
    # Goal: a request's fileno() stays unreadable while its layer cannot complete and becomes
    # readable once it does, with nobody calling wait (the store's completion thread drives the
    # I/O); the completed layer is then returned by wait(0), and poll() agrees.
    store, _ = attached(formatted_daemon)
    request = store.prepare_store(tokens(2, 4), [0, 1, 2, 3])
    fd = request.fileno()
    assert fd == request.fileno(), "one eventfd per request"
    formatted_daemon.pause()
    try:
        io = request.store_layer(0)
        readable, _, _ = select.select([fd], [], [], 0.3)
        assert readable == [], "readable before the layer could complete"
        assert not io.done
    finally:
        formatted_daemon.resume()
    readable, _, _ = select.select([fd], [], [], WAIT_S)
    assert readable == [fd], "the eventfd did not become readable"
    assert int.from_bytes(os.read(fd, 8), "little") >= 1
    assert io.done and request.layers_completed == [0]
    assert request.wait(0) == 0 and request.poll()
    for layer in range(1, GEOMETRY.layers):
        io = request.store_layer(layer)
        assert io.fileno() == fd
        assert select.select([fd], [], [], WAIT_S)[0] == [fd]
        os.read(fd, 8)
        io.wait(WAIT_S)
    request.commit()
    store.close()


def test_the_eventfd_in_process():
    # Goal: the same without a daemon: the completion thread drives an in-process store's I/O;
    # wait(0) then returns the layer at once (until it does, the next issue is refused: the
    # layer is not returned yet).
    with tutti.Store.open("emu:mem:64m", GEOMETRY, format=True) as store:
        layout = store.allocate_kv(8, "block_major")
        fill_block(layout, 0, 9)
        request = store.prepare_store(tokens(3, 1), [0])
        fd = request.fileno()
        for layer in range(GEOMETRY.layers):
            request.store_layer(layer)
            assert select.select([fd], [], [], WAIT_S)[0] == [fd], f"layer {layer}"
            os.read(fd, 8)
            assert request.layers_completed[-1] == layer
            assert request.wait(0) == layer
        assert request.commit() == 1
        assert store.lookup(tokens(3, 1)) == 1


def test_kill_9_of_a_client_loses_nothing_committed(formatted_daemon):
    # Goal: process A stores and commits prompt 1; process B is killed with SIGKILL in the
    # middle of storing prompt 2 (two layers written); process C then finds prompt 1 whole and
    # byte-exact, and nothing of prompt 2; the daemon kept nothing of B (no session, pin or
    # reservation).
    socket = formatted_daemon.socket
    committed = run_child("store", socket, "1", "3")
    assert committed.returncode == 0 and "committed 3" in committed.stdout, committed.stderr
    hung = subprocess.Popen([sys.executable, str(HERE / "child.py"), "store-hang", socket, "2", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([hung.stdout], [], [], WAIT_S)
        assert ready, f"the storing child printed nothing: {hung.stderr.read() if hung.poll() is not None else ''}"
        assert hung.stdout.readline().strip() == "storing"
        os.kill(hung.pid, signal.SIGKILL)
        hung.wait(WAIT_S)
    finally:
        if hung.poll() is None:
            hung.kill()
            hung.wait(WAIT_S)
    assert hung.returncode == -signal.SIGKILL
    scheduler = tutti.LookupClient.connect(socket, model_fingerprint=FINGERPRINT)
    deadline = time.monotonic() + WAIT_S
    while any(client["name"].startswith("child-store-hang") for client in scheduler.status()["clients"]):
        assert time.monotonic() < deadline, "the killed client's session was not ended"
        time.sleep(0.05)
    pool = scheduler.status()["pool"]
    assert (pool["pinned_slots"], pool["writing_slots"]) == (0, 0), pool
    check = run_child("retrieve", socket, "1", "3")
    assert check.returncode == 0, check.stderr
    assert check.stdout.split() == ["found", "3", "wrong", "0"], check.stdout
    lost = run_child("retrieve", socket, "2", "3")
    assert lost.stdout.split() == ["found", "0"], lost.stdout
    assert scheduler.lookup(tokens(2, 3)) == 0
    scheduler.close()


def _store_again_completes_each_layer_at_once(store: tutti.Store, layout: tutti.KvLayout) -> None:
    prompt = tokens(21, 2)
    for block in (0, 1):
        fill_block(layout, block, block + 40)
    store_prompt(store, prompt, [0, 1])
    again = store.prepare_store(prompt, [0, 1])
    assert again.new_blocks == 0 and again.new_block_ids == []
    fd = again.fileno()
    for layer in range(GEOMETRY.layers):
        io = again.store_layer(layer)
        assert io.done and again.layer_in_flight is None
        assert select.select([fd], [], [], 1.0)[0] == [fd], f"layer {layer}: the eventfd was not signalled"
        os.read(fd, 8)
        if layer % 2:
            io.wait(1.0)  # its LayerIo returns it: Request.wait does not again
            assert again.wait(1.0) is None
        else:
            assert again.wait(1.0) == layer
    assert again.layers_completed == list(range(GEOMETRY.layers))
    again.commit()
    assert store.lookup(prompt) == 2


def test_storing_a_cached_prompt_again_completes_its_layers_at_once_in_process():
    # Goal: a store whose blocks the pool holds already moves nothing; each issued layer is
    # complete at once, as any layer is reported: its LayerIo's wait returns, Request.wait
    # returns the layer, the eventfd is signalled (an engine that epolls does not hang).
    with tutti.Store.open("emu:mem:64m", GEOMETRY, format=True) as store:
        layout = store.allocate_kv(4, "paged")
        _store_again_completes_each_layer_at_once(store, layout)


def test_storing_a_cached_prompt_again_completes_its_layers_at_once_through_tuttid(formatted_daemon):
    # Goal: the same through tuttid (docs/python.md's example, run twice on one prompt).
    store, layout = attached(formatted_daemon)
    try:
        _store_again_completes_each_layer_at_once(store, layout)
    finally:
        store.close()


def _sessions(daemon) -> list[int]:
    with tutti.LookupClient.connect(daemon.socket, model_fingerprint=FINGERPRINT) as probe:
        return [client["session"] for client in probe.status()["clients"]]


def test_status_lists_a_live_session_as_neither_kept_nor_awaiting_exit(formatted_daemon):
    # Goal: LookupClient.status() gives every field of tuttid's client entries, "kept" and
    # "retiring" (protocol version 7: a session whose queue pairs are not known deleted, its
    # memory kept for good; one whose deletion is being retried) included, as the stub lists them.
    store, _ = attached(formatted_daemon)
    try:
        with tutti.LookupClient.connect(formatted_daemon.socket, model_fingerprint=FINGERPRINT) as probe:
            status = probe.status()
            (entry,) = [client for client in status["clients"] if client["session"] == store.session]
        assert entry["kept"] is False and entry["awaiting_exit"] is False and entry["retiring"] is False, entry
        # Protocol version 8: each device says whether its metadata writes are fenced.
        assert [device["metadata_fenced"] for device in status["devices"]] == [False], status["devices"]
    finally:
        store.close()


def test_close_with_a_layer_in_flight_waits_until_tuttid_ended_the_session(formatted_daemon):
    # Goal: an attached store closed while a layer cannot complete (the controller paused) gives
    # its KV memory back only once tuttid dropped the session (its queue pairs deleted, none
    # leaked): close returns after tuttid resumed and the session is gone by then.
    store, _ = attached(formatted_daemon)
    session = store.session
    request = store.prepare_store(tokens(22, 2), [0, 1])
    formatted_daemon.pause()
    resumer = threading.Timer(1.0, formatted_daemon.resume)
    resumer.start()
    try:
        request.store_layer(0)
        store.close(timeout_s=0.2)
    finally:
        resumer.join()
    assert store.leaked_registrations() == 0
    assert session not in _sessions(formatted_daemon)
    del request


def test_close_with_a_layer_in_flight_keeps_the_memory_when_tuttid_does_not_answer(formatted_daemon):
    # Goal: when tuttid cannot confirm in time that the session ended (it stays paused), the KV
    # memory a layer in flight may still reach is kept for good and counted.
    store, _ = attached(formatted_daemon)
    request = store.prepare_store(tokens(23, 2), [0, 1])
    formatted_daemon.pause()
    try:
        request.store_layer(0)
        started = time.monotonic()
        store.close(timeout_s=0.2)
        assert time.monotonic() - started < WAIT_S
    finally:
        formatted_daemon.resume()
    assert store.leaked_registrations() == GEOMETRY.layers  # allocate_kv's paged regions, one per layer


_DEADLOCK_CHILD = """
import threading, numpy as np, tutti
geometry = tutti.ModelGeometry(layers=4, kv_heads=2, head_dim=64, dtype_bytes=2, block_tokens=16)
for round_ in range(40):
    store = tutti.Store.open("emu:mem:16m", geometry, format=True)
    tensors = [np.zeros((4, 2 * geometry.object_bytes), dtype=np.uint8) for _ in range(geometry.layers)]
    store.register_kv(tutti.KvLayout.paged(tensors))
    del tensors  # the store holds the only references: close runs numpy's DLPack deleters
    done = threading.Event()
    def read():
        while not done.is_set():
            store.registered, store.closed, store.requests_sent, repr(store), store.leaked_registrations()
    reader = threading.Thread(target=read)
    reader.start()
    store.close()
    done.set()
    reader.join()
print("no deadlock")
"""


def test_getters_never_wait_for_the_store_lock_holding_the_gil():
    # Goal: a thread reading a store's getters while another closes it (dropping numpy tensors
    # registered through DLPack, whose deleter takes the GIL) does not deadlock: getters take
    # the store's lock with the GIL released, and close drops the tensors after the lock.
    child = subprocess.run([sys.executable, "-c", _DEADLOCK_CHILD], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and "no deadlock" in child.stdout, child.stderr[-2000:]
