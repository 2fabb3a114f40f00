"""How long what the package hands out stays valid, and whose it is: a Store or LookupClient
inherited across fork() stays the parent's (the child can neither use it nor end it), a
request's eventfd lives as long as its Request, and a Request dropped without finish gives
back what it held.

Every wait is bounded: a forked child that does not exit is killed and fails the test."""

from __future__ import annotations

import gc
import os
import signal
import time

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
