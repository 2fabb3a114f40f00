"""How long what the package hands out stays valid, and whose it is: a Store or LookupClient
inherited across fork() stays the parent's (the child can neither use it nor end it), a
request's eventfd lives as long as its Request, and a Request dropped without finish gives
back what it held.

Every wait is bounded: a forked child that does not exit is killed and fails the test."""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import tutti
from conftest import FINGERPRINT, GEOMETRY, WAIT_S, attach, fill_block, holds, open_store, store_prompt, tokens

# The child's exit codes: what it saw (0: every call refused as inherited across fork).
CHILD_REFUSED = 0
CHILD_NOT_REFUSED = 3
CHILD_FAILED = 4


def wait_child(pid: int) -> int:
    """The child's exit code, waiting at most WAIT_S (a child still running is killed and
    fails the test)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the forked child did not exit within {WAIT_S} s")
        time.sleep(0.01)


def refused_as_inherited(call) -> bool:
    """Whether `call()` raises InvalidState saying the object was inherited across fork."""
    try:
        call()
    except tutti.InvalidState as error:
        return "inherited across fork" in str(error)
    except BaseException:  # noqa: BLE001 - any other outcome is "not refused"
        return False
    return False


def test_a_forked_child_neither_uses_nor_ends_the_parents_store(formatted_daemon):
    # Goal: a child forked while the parent's attached store has a layer in flight shares the
    # parent's session (socket, queue pair window): its calls are refused (InvalidState), its
    # close() too, and dropping the store in the child neither waits for, nor finishes, nor
    # closes anything. The parent's layer then completes, its request finishes and the bytes
    # round-trip. Before, the child's close drove the parent's queue pair and sent Finish for the
    # parent's request over the shared socket.
    store = attach(formatted_daemon)
    layout = store.allocate_kv(8, "paged")
    prompt = tokens(71, 2)
    for block in (0, 1):
        fill_block(layout, block, 80 + block)
    store_prompt(store, prompt, [0, 1])
    request = store.prepare_retrieve(prompt, [4, 5])
    formatted_daemon.pause()
    try:
        request.retrieve_layer(0)

        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = CHILD_FAILED
            try:
                refused = [
                    refused_as_inherited(store.close),
                    refused_as_inherited(lambda: store.lookup(prompt)),
                    refused_as_inherited(lambda: request.wait(1.0)),
                    refused_as_inherited(request.finish),
                ]
                # The child's references go: dropping them must leave the parent's session be.
                del store, request, layout
                gc.collect()
                code = CHILD_REFUSED if all(refused) else CHILD_NOT_REFUSED
            finally:
                os._exit(code)
        # The daemon runs again while the child may still act on the store (as it would in life).
        time.sleep(0.2)
    finally:
        formatted_daemon.resume()
    code = wait_child(pid)
    assert request.wait(WAIT_S) == 0, "the parent's layer completes (the child did not take its completion)"
    for layer in range(1, GEOMETRY.layers):
        request.retrieve_layer(layer)
        assert request.wait(WAIT_S) == layer
    request.finish()
    assert holds(layout, 4, 80) and holds(layout, 5, 81), "the parent's retrieve landed"
    assert store.lookup(prompt) == 2
    assert code == CHILD_REFUSED, f"the child's calls were not all refused as inherited across fork (exit {code})"
    store.close()
    assert store.leaked_registrations() == 0


def test_a_forked_child_cannot_use_the_parents_lookup_client(formatted_daemon):
    # Goal: a LookupClient inherited across fork is refused in the child (its calls would
    # interleave with the parent's on one stream), close() included, and dropping it there
    # leaves the parent's connection working.
    store = attach(formatted_daemon)
    layout = store.allocate_kv(4, "paged")
    prompt = tokens(72, 2)
    fill_block(layout, 0, 1)
    store_prompt(store, prompt, [0, 1])
    client = tutti.LookupClient.connect(formatted_daemon.socket, model_fingerprint=FINGERPRINT)

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = CHILD_FAILED
        try:
            refused = [
                refused_as_inherited(lambda: client.lookup(prompt)),
                refused_as_inherited(client.ping),
                refused_as_inherited(client.close),
            ]
            del client
            gc.collect()
            code = CHILD_REFUSED if all(refused) else CHILD_NOT_REFUSED
        finally:
            os._exit(code)
    code = wait_child(pid)
    assert client.lookup(prompt) == 2
    client.ping()
    assert code == CHILD_REFUSED, f"the child's calls were not all refused as inherited across fork (exit {code})"
    client.close()
    store.close()


def test_a_request_fileno_stays_open_as_long_as_the_request():
    # Goal: the integer fileno() returned names the request's eventfd for as long as the Request
    # object lives, also after commit (a selector may still hold it); a file opened afterwards
    # does not get its number. Before, commit closed the eventfd and the next open reused it.
    with open_store() as store:
        layout = store.allocate_kv(4, "block_major")
        fill_block(layout, 0, 3)
        request = store.prepare_store(tokens(73, 1), [0])
        fd = request.fileno()
        for layer in range(GEOMETRY.layers):
            request.store_layer(layer)
            assert request.wait(WAIT_S) == layer
        request.commit()
        os.fstat(fd)
        other = os.open(os.devnull, os.O_RDONLY)
        try:
            assert other != fd, "the eventfd's number was handed out again"
            assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
        finally:
            os.close(other)
        gc.collect()
        os.fstat(fd)


def test_a_request_dropped_without_finish_gives_back_its_place():
    # Goal: a Request garbage-collected without finish (nothing in flight) is finished then:
    # with requests_max = 1 the next prepare succeeds. Before, it held its place (and its pins
    # and IOCBs) until the store closed.
    with open_store(requests_max=1) as store:
        layout = store.allocate_kv(4, "block_major")
        fill_block(layout, 0, 4)
        prompt = tokens(74, 1)
        request = store.prepare_store(prompt, [0])
        del request
        gc.collect()
        store_prompt(store, prompt, [0])
        retrieve = store.prepare_retrieve(prompt, [1])
        del retrieve
        gc.collect()
        assert store.lookup(prompt) == 1
        again = store.prepare_retrieve(prompt, [2])
        for layer in range(GEOMETRY.layers):
            again.retrieve_layer(layer)
            assert again.wait(WAIT_S) == layer
        again.finish()
        assert holds(layout, 2, 4)


def test_a_request_dropped_with_a_layer_in_flight_writes_nothing_after_the_drop():
    # Goal: a retrieve of 16 blocks with queue_depth = 2 (the CPU executor sends the rest of a
    # layer's commands only when someone polls) dropped right after retrieve_layer(0): the drop
    # waits the layer out, so engine blocks 16..31, reused and rewritten by the engine after
    # the drop, keep the engine's bytes when a later request's wait drives the executor.
    # Before, the drop left the layer in flight, and that later wait sent its remaining
    # commands: blocks 17..31 were overwritten with the retrieved bytes.
    blocks = 16
    with open_store(queue_depth=2) as store:
        layout = store.allocate_kv(2 * blocks + 2, "paged")
        for block in range(blocks):
            fill_block(layout, block, 10 + block)
        prompt = tokens(75, blocks)
        store_prompt(store, prompt, list(range(blocks)))
        request = store.prepare_retrieve(prompt, list(range(blocks, 2 * blocks)))
        request.retrieve_layer(0)
        del request
        gc.collect()
        for block in range(blocks, 2 * blocks):
            fill_block(layout, block, 900 + block)
        store_prompt(store, tokens(76, 1), [2 * blocks], commit=False).finish()
        time.sleep(0.2)
        overwritten = [block for block in range(blocks, 2 * blocks) if not holds(layout, block, 900 + block)]
        assert overwritten == [], "engine blocks written after their request was dropped"


def test_requests_dropped_with_a_layer_in_flight_give_back_their_places():
    # Goal: with requests_max = 2, two store requests dropped each with layer 0 in flight (not
    # waited for) are finished by their drop once the layer ended, so the third prepare
    # succeeds. Before, they were held until the store closed: every later prepare raised
    # LimitReached.
    with open_store(requests_max=2) as store:
        layout = store.allocate_kv(8, "block_major")
        for seed in (1, 2):
            fill_block(layout, seed, 80 + seed)
            request = store.prepare_store(tokens(80 + seed, 1), [seed])
            request.store_layer(0)
            del request
            gc.collect()
        third = store.prepare_store(tokens(83, 1), [3])
        third.finish()


def test_a_layer_is_done_once_its_store_closed():
    # Goal: a layer issued and not waited for, whose store is then closed (the close waits it
    # out and ends the request), answers done = True. Before, done stayed False for ever.
    store = open_store()
    layout = store.allocate_kv(8, "block_major")
    fill_block(layout, 1, 85)
    request = store.prepare_store(tokens(85, 1), [1])
    layer = request.store_layer(0)
    store.close()
    assert layer.done


def test_a_layer_close_could_not_settle_is_not_done(formatted_daemon):
    # Goal: a retrieve layer in flight through a paused tuttid, whose store is closed with a
    # 0.3 s timeout (the close cannot wait it out: the memory is kept for good, counted in
    # leaked_registrations), answers done = False: done means the layer ended, and nothing
    # says it did. Before, done was True for every layer once its store was closed. It stays
    # so for good: the request still names the layer in flight (layer_in_flight 0), a finish
    # (refused: StaleRequest, the store is closed) does not make it done, and the engines'
    # give-up path (tutti._engine.abandon_request) says the request did not end. Before, the
    # getters answered None / [] once the store closed, and after the refused finish done was
    # True and abandon_request True (nothing in flight).
    import logging

    from tutti._engine import abandon_request

    store = attach(formatted_daemon, timeout_s=0.3)
    layout = store.allocate_kv(8, "block_major")
    fill_block(layout, 1, 85)
    prompt = tokens(85, 1)
    store_prompt(store, prompt, [1])
    fill_block(layout, 2, 900)
    request = store.prepare_retrieve(prompt, [2])
    formatted_daemon.pause()
    try:
        layer = request.retrieve_layer(0)
        store.close(timeout_s=0.3)
        assert store.leaked_registrations() == 1, "the close could not settle the layer"
        assert not layer.done, "the layer did not end (as far as anyone knows)"
        assert request.layer_in_flight == 0, "the layer the close left in flight"
        assert request.layers_in_flight == [0]
        try:
            request.finish()
            raise AssertionError("finish on a closed store did not raise")
        except tutti.StaleRequest:
            pass
        assert not layer.done, "a refused finish does not end the layer"
        assert request.layer_in_flight == 0
        assert not abandon_request(request, 0.1, logging.getLogger("tutti.test"), "x"), "a layer may still move bytes"
    finally:
        formatted_daemon.resume()


def test_kv_memory_a_closed_store_kept_for_good_is_refused_by_another_store(formatted_daemon):
    # Goal: a store's close that could not settle a layer keeps its allocate_kv memory for good
    # (leaked_registrations 1): a device may still write it. Its KvBuffers, registered with a
    # new in-process store, are refused (UnsupportedMemory, saying why), so the new store never
    # maps, commits and serves bytes the old queue may still write. Before, they were accepted.
    store = attach(formatted_daemon, timeout_s=0.3)
    layout = store.allocate_kv(8, "block_major")
    fill_block(layout, 1, 86)
    prompt = tokens(86, 1)
    store_prompt(store, prompt, [1])
    request = store.prepare_retrieve(prompt, [2])
    formatted_daemon.pause()
    try:
        request.retrieve_layer(0)
        store.close(timeout_s=0.3)
        assert store.leaked_registrations() == 1, "the close could not settle the layer"
        fresh = open_store()
        try:
            try:
                fresh.register_kv(layout)
                raise AssertionError("memory a closed store kept for good was registered again")
            except tutti.UnsupportedMemory as refused:
                assert "kept for good" in str(refused), refused
            assert not fresh.registered
            # The same memory through numpy views (DLPack, as an engine's own tensors over the
            # KvBuffers would be): the memory is refused, not only the KvBuffer objects.
            views = tutti.KvLayout.block_major(np.from_dlpack(layout.tensors[0]))
            try:
                fresh.register_kv(views)
                raise AssertionError("a view of memory a closed store kept for good was registered again")
            except tutti.UnsupportedMemory as refused:
                assert "kept for good" in str(refused), refused
            assert not fresh.registered
        finally:
            fresh.close()
    finally:
        formatted_daemon.resume()


def test_requests_dropped_with_a_stuck_layer_wait_the_store_timeout_once(formatted_daemon):
    # Goal: four store requests, each with layer 0 in flight through a paused tuttid (store
    # timeout 1 s), dropped one after another (as an exception unwinding, a dict cleared or
    # the interpreter's exit drops them): the first drop waits the timeout and orphans its
    # request, the later ones, finding the device still not answering, wait for nothing more
    # (they are orphaned at once): under 1.5 s in all. Once tuttid runs again the orphans
    # finish and their places come back: four prepares succeed. Before, each drop waited its
    # own full timeout, one after another (4 s here; 32 x 30 s with the defaults).
    store = attach(formatted_daemon, timeout_s=1.0, requests_max=4)
    layout = store.allocate_kv(8, "block_major")
    requests = []
    for seed in (1, 2, 3, 4):
        fill_block(layout, seed, 80 + seed)
        requests.append(store.prepare_store(tokens(80 + seed, 1), [seed]))
    formatted_daemon.pause()
    try:
        for request in requests:
            request.store_layer(0)
        del request
        started = time.monotonic()
        while requests:
            requests.pop(0)
        elapsed = time.monotonic() - started
    finally:
        formatted_daemon.resume()
    assert elapsed < 1.5, f"dropping four requests took {elapsed:.2f} s"
    deadline = time.monotonic() + WAIT_S
    again = []
    for seed in (1, 2, 3, 4):
        while True:  # the orphans finish once the completion thread saw their layers end
            try:
                again.append(store.prepare_store(tokens(90 + seed, 1), [seed]))
                break
            except tutti.LimitReached:
                assert time.monotonic() < deadline, "the dropped requests never gave back their places"
                time.sleep(0.05)
    for request in again:
        request.finish()
    store.close()


def test_a_wait_for_a_stuck_layer_is_interrupted_by_ctrl_c(formatted_daemon):
    # Goal: Request.wait and LayerIo.wait for a store layer in flight through a paused tuttid
    # (it never ends while paused) raise KeyboardInterrupt within 2 s of a Ctrl-C (here
    # _thread.interrupt_main 0.3 s in), not at their 10 s timeout: the wait looks for signals
    # between short sub-waits. The interrupted wait leaves the layer in flight, as a timeout
    # does: once tuttid runs again, a wait returns it. Before, Ctrl-C was seen only when the
    # wait returned (its timeout may be up to 1e9 s).
    store = attach(formatted_daemon)
    layout = store.allocate_kv(8, "block_major")
    fill_block(layout, 1, 86)
    request = store.prepare_store(tokens(86, 1), [1])
    formatted_daemon.pause()
    try:
        layer = request.store_layer(0)
        for name, wait in (("Request.wait", request.wait), ("LayerIo.wait", layer.wait)):
            interrupt = threading.Timer(0.3, _thread.interrupt_main)
            started = time.monotonic()
            try:
                interrupt.start()
                try:
                    wait(timeout_s=10.0)
                finally:
                    # Here at the latest a Ctrl-C the wait did not see is raised (still caught).
                    interrupt.join()
                raise AssertionError(f"{name} returned for a layer through a paused tuttid")
            except KeyboardInterrupt:
                elapsed = time.monotonic() - started
            assert elapsed < 2.0, f"{name} saw Ctrl-C after {elapsed:.2f} s"
            assert request.layer_in_flight == 0, f"{name}: the interrupted wait leaves the layer in flight"
    finally:
        formatted_daemon.resume()
    assert request.wait(timeout_s=WAIT_S) == 0
    layer.wait(timeout_s=WAIT_S)
    request.finish()
    store.close()


@contextlib.contextmanager
def a_request_on_a_stuck_layer(daemon, fill: int):
    """A request prepared to store one block (filled with `fill`) through a store with a 1 s
    timeout, tuttid paused while the body runs, so a layer it stores does not end there. tuttid
    runs again however the body ends; once it ended without raising, the request must wait out
    with 0 failures and finish, and the store close."""
    store = attach(daemon, timeout_s=1.0)
    layout = store.allocate_kv(8, "block_major")
    fill_block(layout, 1, fill)
    request = store.prepare_store(tokens(fill, 1), [1])
    daemon.pause()
    try:
        yield request
    finally:
        daemon.resume()
    assert request.wait(timeout_s=WAIT_S) == 0
    request.finish()
    store.close()


def test_ctrl_c_inside_a_with_on_a_stuck_layer_leaves_the_with_as_keyboard_interrupt(formatted_daemon):
    # Goal: Ctrl-C during Request.wait inside `with request:`, its layer through a paused tuttid
    # (it never ends while paused): the KeyboardInterrupt leaves the `with` as itself, so an
    # engine's `except KeyboardInterrupt` sees it. The exit still waits for the layer (up to the
    # store's 1 s timeout); its finish, refused for the layer in flight, is logged, not raised,
    # and the request stays held, prepared with its layer in flight, for a later wait and
    # finish (a drop or the store's close would end it too). Before, the exit raised
    # InvalidState ("still in flight") in the KeyboardInterrupt's place.
    with a_request_on_a_stuck_layer(formatted_daemon, 87) as request:
        interrupt = threading.Timer(0.3, _thread.interrupt_main)
        try:
            with request:
                request.store_layer(0)
                interrupt.start()
                try:
                    request.wait(timeout_s=10.0)
                finally:
                    interrupt.join()  # a Ctrl-C the wait did not see is raised here at the latest
                raise AssertionError("Request.wait returned for a layer through a paused tuttid")
        except KeyboardInterrupt:
            pass
        assert request.state == "prepared"
        assert request.layer_in_flight == 0, "the exit could not wait the layer out: still in flight"


def test_a_timeout_inside_a_with_on_a_stuck_layer_leaves_the_with_as_invalid_state(formatted_daemon):
    # Goal: an ordinary exception leaving `with request:` (here the TimeoutError of a wait for
    # a layer through a paused tuttid) does not hide that the exit could not finish the
    # request: the exit raises InvalidState ("still in flight"), the TimeoutError its
    # __context__, so that an engine's `except TimeoutError: recompute` does not write into
    # blocks the layer still in flight may write later. Before, the TimeoutError left the
    # `with` as if the request had finished.
    with a_request_on_a_stuck_layer(formatted_daemon, 88) as request:
        try:
            with request:
                request.store_layer(0)
                request.wait(timeout_s=0.2)
            raise AssertionError("the with ended for a layer through a paused tuttid")
        except tutti.InvalidState as refused:
            assert "still in flight" in str(refused), refused
            assert isinstance(refused.__context__, tutti.TimeoutError), repr(refused.__context__)
        assert request.state == "prepared"
        assert request.layer_in_flight == 0


def test_a_cancellation_inside_a_with_on_a_stuck_layer_leaves_the_with_as_invalid_state(formatted_daemon):
    # Goal: a cancellation leaving `with request:` (asyncio's CancelledError: a BaseException
    # that asyncio.timeout / wait_for turn into a TimeoutError the engine may catch and
    # recompute after) is not taken for Ctrl-C: the exit raises InvalidState ("still in
    # flight"), the CancelledError its __context__. Before, it was swallowed with the refusal as
    # KeyboardInterrupt is, and the engine recomputed into blocks the layer may still write.
    with a_request_on_a_stuck_layer(formatted_daemon, 87) as request:
        try:
            with request:
                request.store_layer(0)
                raise asyncio.CancelledError()
        except tutti.InvalidState as refused:
            assert "still in flight" in str(refused), refused
            assert isinstance(refused.__context__, asyncio.CancelledError), repr(refused.__context__)
        except asyncio.CancelledError:
            raise AssertionError("the cancellation left the with as Ctrl-C does, hiding the layer in flight")
        assert request.state == "prepared"


def test_a_with_ending_normally_on_a_stuck_layer_raises_invalid_state(formatted_daemon):
    # Goal: a `with request:` block that ends without an exception, its layer through a paused
    # tuttid, raises InvalidState ("still in flight") from the exit (after waiting up to the
    # store's 1 s timeout), and the request stays held for a later wait and finish.
    with a_request_on_a_stuck_layer(formatted_daemon, 89) as request:
        try:
            with request:
                layer = request.store_layer(0)
                # A LayerIo's deadline, told from the layer's own failure of class Timeout
                # ("layer N failed: ...") by the message's start and by done, as documented.
                try:
                    layer.wait(timeout_s=0.05)
                    raise AssertionError("LayerIo.wait returned for a layer through a paused tuttid")
                except tutti.TimeoutError as timed_out:
                    deadline = f"request {request.handle:#x}: layer 0 did not complete by the deadline; it is still in flight"
                    assert str(timed_out).startswith(deadline), timed_out
                assert not layer.done
            raise AssertionError("the with ended for a layer through a paused tuttid")
        except tutti.InvalidState as refused:
            assert "still in flight" in str(refused), refused
            assert refused.__context__ is None, repr(refused.__context__)
        assert request.state == "prepared"
        assert request.layer_in_flight == 0


def fork_sleeper(seconds: float) -> int:
    """A forked child that only sleeps (holding whatever it inherited) and exits without running
    the parent's cleanups."""
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(seconds)
        finally:
            os._exit(0)
    return pid


def reap(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def still_running(pid: int) -> bool:
    return os.waitpid(pid, os.WNOHANG) == (0, 0)


def test_a_forked_childs_copy_of_the_socket_does_not_keep_the_parents_session(formatted_daemon):
    # Goal: a child forked from a process with an attached store closes its copy of the socket
    # (at the fork), so when the parent closes its store tuttid sees the connection end at once:
    # the session is gone from its status within a few seconds while the child still lives, and
    # the parent's close found it ended (nothing kept). Before, the child's copy kept the
    # connection open: tuttid never saw EOF and the session stayed until the parent exited.
    store = attach(formatted_daemon)
    store.allocate_kv(8, "paged")
    session = store.session
    child = fork_sleeper(20.0)
    try:
        started = time.monotonic()
        store.close(timeout_s=10.0)
        close_s = time.monotonic() - started
        with tutti.LookupClient.connect(formatted_daemon.socket, model_fingerprint=FINGERPRINT) as probe:
            deadline = time.monotonic() + 5.0
            while session in [client["session"] for client in probe.status()["clients"]]:
                assert time.monotonic() < deadline, "tuttid kept the closed store's session while the forked child lives"
                time.sleep(0.02)
        assert still_running(child), "the child was to outlive the parent's close"
        assert close_s < 5.0, f"the parent's close waited {close_s:.1f} s for tuttid to end the session"
        assert store.leaked_registrations() == 0
    finally:
        reap(child)


def test_a_lookup_client_closed_then_dropped_leaves_a_later_stores_fork_record(formatted_daemon):
    # Goal: a closed LookupClient forgot its connection's fork-close record when it closed; its
    # drop must not forget again by descriptor number, which the next connection (this store's)
    # may have taken: then a forked child would keep the store's socket and tuttid keep its
    # session after the parent's close.
    import gc

    lookup = tutti.LookupClient.connect(formatted_daemon.socket, model_fingerprint=FINGERPRINT)
    lookup.close()
    store = attach(formatted_daemon)
    store.allocate_kv(8, "paged")
    session = store.session
    del lookup
    gc.collect()
    child = fork_sleeper(20.0)
    try:
        store.close(timeout_s=10.0)
        with tutti.LookupClient.connect(formatted_daemon.socket, model_fingerprint=FINGERPRINT) as probe:
            deadline = time.monotonic() + 5.0
            while session in [client["session"] for client in probe.status()["clients"]]:
                assert time.monotonic() < deadline, "tuttid kept the store's session: the child kept its socket"
                time.sleep(0.02)
        assert still_running(child), "the child was to outlive the parent's close"
    finally:
        reap(child)


# Opens an in-process store on an emu: file, forks a child that sleeps, prints the child's pid and
# dies by SIGKILL (no close, no unlock): only the fds the process had go.
OPEN_FORK_AND_DIE = """
import os, signal, sys, time
import tutti
sys.path.insert(0, sys.argv[3])
from conftest import GEOMETRY
store = tutti.Store.open("emu:" + sys.argv[1], GEOMETRY, format=True, lock_dir=sys.argv[2], create_bytes=64 << 20)
pid = os.fork()
if pid == 0:
    try:
        null = os.open(os.devnull, os.O_RDWR)  # the test reads the parent's output to its end
        os.dup2(null, 1)
        os.dup2(null, 2)
        time.sleep(20)
    finally:
        os._exit(0)
print(pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_forked_childs_copy_of_the_device_lock_does_not_keep_the_pool(tmp_path):
    # Goal: a child forked from a process with an in-process store on an emu: file closes its
    # copy of the device lock's fd at the fork (a flock belongs to the open file, which the
    # child's copy keeps), so when the opening process dies without closing, the pool can be
    # opened again while the child lives. Before, the open failed DeviceInUse until the child
    # exited.
    image = tmp_path / "pool.img"
    locks = str(tmp_path / "locks")
    opener = subprocess.run(
        [sys.executable, "-c", OPEN_FORK_AND_DIE, str(image), locks, str(Path(__file__).resolve().parent)],
        capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert opener.returncode == -signal.SIGKILL, opener.stderr
    child = int(opener.stdout.split()[0])
    try:
        assert os.path.exists(f"/proc/{child}"), "the child was to outlive its parent"
        again = tutti.Store.open(f"emu:{image}", GEOMETRY, lock_dir=locks)
        assert os.path.exists(f"/proc/{child}"), "the child was to outlive the re-open"
        again.close()
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_store_refused_for_its_geometry_leaves_its_files_to_forked_children(tmp_path):
    # Goal: Store.open of a pool formatted for another geometry raises PoolError and records
    # nothing for forked children to close: a file opened later under a number the refused
    # open used (the pool's image again: the same file, the identity a record is checked
    # against) stays open in a child forked after. Before, the mismatch was found after the
    # device fds were recorded, and the records outlived the closed files: the child closed
    # its copies of the later files.
    image = tmp_path / "pool.img"
    locks = str(tmp_path / "locks")
    tutti.Store.open(f"emu:{image}", GEOMETRY, format=True, lock_dir=locks, create_bytes=64 << 20).close()
    other = tutti.ModelGeometry(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2, block_tokens=16)
    try:
        tutti.Store.open(f"emu:{image}", other, lock_dir=locks)
        raise AssertionError("a pool of another geometry was opened")
    except tutti.PoolError as error:
        assert "geometry" in str(error).lower(), error
    # The image again under the lowest free numbers, the refused open's among them.
    later = [os.open(image, os.O_RDONLY) for _ in range(8)]
    try:
        pid = os.fork()
        if pid == 0:
            code = 0  # every later file open
            try:
                for fd in later:
                    os.fstat(fd)
            except OSError:
                code = 3
            os._exit(code)
        assert wait_child(pid) == 0, "the forked child found a later file of the image closed"
    finally:
        for fd in later:
            os.close(fd)


def test_with_store_in_a_forked_child_lets_the_blocks_exception_through():
    # Goal: a `with store:` block left by an exception in a forked child raises that exception,
    # not __exit__'s InvalidState (the store is the parent's: left as a drop leaves it). Before,
    # InvalidState replaced the block's exception.
    store = open_store()
    pid = os.fork()
    if pid == 0:
        code = CHILD_FAILED
        try:
            with store:
                raise KeyError("the block's own")
        except KeyError:
            code = CHILD_REFUSED
        except BaseException:  # noqa: BLE001 - anything else fails the test
            code = CHILD_NOT_REFUSED
        os._exit(code)
    try:
        assert wait_child(pid) == CHILD_REFUSED, "the child saw another exception than its block's"
    finally:
        store.close()


def test_a_keepalive_ping_to_a_stalled_daemon_does_not_hold_the_store(tmp_path):
    # Goal: the completion thread's keep-alive ping waits for tuttid without the store's lock,
    # so while a stalled daemon (SIGSTOP) leaves it unanswered, the store's calls that do not
    # talk to tuttid (the per-layer path: a layer's poll, the getters) answer at once instead
    # of waiting out the ping's timeout behind it. A lease of 300 ms: a ping every 100 ms.
    from conftest import start_daemon

    daemon = start_daemon(tmp_path, "--lease", "300ms")
    try:
        store = tutti.Store.attach(daemon.socket, model_fingerprint=FINGERPRINT, timeout_s=3.0)
        store.allocate_kv(4, "paged")
        request = store.prepare_store(tokens(1, 2), [0, 1])
        daemon.pause()  # its controller too: the layer stays in flight
        layer = request.store_layer(0)
        time.sleep(0.5)  # past a keep-alive interval: the ping is sent, and not answered
        longest = 0.0
        sampled = time.monotonic()
        while time.monotonic() - sampled < 1.0:
            asked = time.monotonic()
            assert not layer.poll()
            assert store.registered and not store.closed
            longest = max(longest, time.monotonic() - asked)
            time.sleep(0.01)
        assert longest < 0.3, f"a call that does not talk to tuttid waited {longest:.2f} s behind the ping"
    finally:
        daemon.resume()
    store.close()
    daemon.stop()



class _ThreadsStopped:
    """Stops the threads of process `pid` named `name` (ptrace: PTRACE_SEIZE, then
    PTRACE_INTERRUPT; each waited for until it stopped) while the block runs, the others running
    on; detached (resumed) at its end. tuttid's connection threads (`tuttid-client`) stopped
    this way leave the session's requests unanswered while its software controller moves bytes."""

    PTRACE_DETACH = 17
    PTRACE_SEIZE = 0x4206
    PTRACE_INTERRUPT = 0x4207
    WALL = 0x40000000

    def __init__(self, pid: int, name: str):
        import ctypes

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self.libc.ptrace.restype = ctypes.c_long
        tasks = f"/proc/{pid}/task"
        self.tids = [int(tid) for tid in os.listdir(tasks) if Path(f"{tasks}/{tid}/comm").read_text().strip() == name]
        self.stopped: list[int] = []

    def _ptrace(self, request: int, tid: int) -> None:
        import ctypes

        if self.libc.ptrace(request, tid, None, None) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"ptrace({request:#x}, {tid}): {os.strerror(errno)}")

    def __enter__(self):
        assert self.tids, "no thread to stop"
        import errno

        import pytest

        for tid in self.tids:
            try:
                self._ptrace(self.PTRACE_SEIZE, tid)
            except OSError as error:
                if error.errno in (errno.EPERM, errno.ENOSYS) and not self.stopped:
                    pytest.skip(f"ptrace is not allowed here: {error}")
                raise
            self.stopped.append(tid)
            self._ptrace(self.PTRACE_INTERRUPT, tid)
            os.waitpid(tid, self.WALL)
        return self

    def __exit__(self, *exc):
        for tid in self.stopped:
            self._ptrace(self.PTRACE_DETACH, tid)


def test_a_keepalive_ping_to_a_stalled_daemon_does_not_hold_back_armed_layers(tmp_path):
    # Goal: the keep-alive ping runs on a thread of its own, so while tuttid leaves it
    # unanswered (its connection thread stopped; its software controller runs on) the
    # completion thread goes on driving the requests armed on fileno(): a layer issued then is
    # reported on its eventfd within a fraction of timeout_s. Before, the ping ran on the
    # completion thread, which drove no request until tuttid answered or timeout_s passed. A
    # lease of 300 ms: a ping after 100 ms idle.
    import select

    from conftest import start_daemon

    daemon = start_daemon(tmp_path, "--lease", "300ms")
    try:
        store = tutti.Store.attach(daemon.socket, model_fingerprint=FINGERPRINT, timeout_s=3.0)
        store.allocate_kv(4, "paged")
        request = store.prepare_store(tokens(1, 2), [0, 1])
        eventfd = request.fileno()
        with _ThreadsStopped(daemon.process.pid, "tuttid-client"):
            time.sleep(0.5)  # past a keep-alive interval: the ping is sent, and not answered
            issued = time.monotonic()
            layer = request.store_layer(0)
            readable, _, _ = select.select([eventfd], [], [], 2.5)
            reported = time.monotonic() - issued
        assert readable, "the layer was not reported on the eventfd within 2.5 s"
        assert reported < 1.0, f"the layer was reported {reported:.2f} s after its issue (behind the ping)"
        assert layer.done
        request.wait(WAIT_S)
        for each in range(1, GEOMETRY.layers):
            request.store_layer(each)
            request.wait(WAIT_S)
        request.commit()
        store.close()
    finally:
        daemon.stop()


def test_calls_that_talk_to_tuttid_wait_for_the_connection_the_keepalive_ping_has(tmp_path):
    # Goal: while the keep-alive ping has the store's connection (its wait for tuttid holds no
    # lock), a call that talks to tuttid waits for its return and never reaches what stands in
    # for it: a lookup made while tuttid, stopped, leaves the ping unanswered succeeds once
    # tuttid answers the ping. A lease of 3 s: a ping after 1 s idle.
    import threading

    from conftest import start_daemon

    daemon = start_daemon(tmp_path, "--lease", "3s")
    try:
        store = tutti.Store.attach(daemon.socket, model_fingerprint=FINGERPRINT, timeout_s=5.0)
        assert store.lookup(tokens(1, 2)) == 0
        idle_from = time.monotonic()
        sent = store.requests_sent
        time.sleep(0.2)
        daemon.pause()
        time.sleep(1.3 - (time.monotonic() - idle_from))  # the ping went at 1 s, unanswered
        resumer = threading.Timer(0.4, daemon.resume)
        resumer.start()
        asked = time.monotonic()
        assert store.lookup(tokens(1, 2)) == 0
        waited = time.monotonic() - asked
        resumer.join()
        assert 0.2 < waited < 3.0, f"the lookup waited {waited:.2f} s for the ping's answer"
        assert store.requests_sent == sent + 2, "the ping, then the lookup"
        store.close()
    finally:
        daemon.stop()
