"""Several layers of one request in flight (`layers_in_flight` on Store.open / Store.attach):
every layer issued before any wait, waited for in issue order, byte-exact, in-process and through
tuttid; the limit refused with a message naming it; finish, the context manager and close wait
out every layer in flight; the completion thread, poll and LayerIo with several in flight; bad
values refused, and a prepare past the IOCBs they need.

Layers only move when the store's executor is driven (an issue, a wait, a poll, the completion
thread, close): a small queue_depth (2 NVMe entries) keeps all but the first commands of the
later layers from reaching the device while an earlier layer is waited for, so a close or exit that waited only for the oldest
layer would leave the others' bytes unmoved, which the byte checks see."""

from __future__ import annotations

import os
import select
import threading
import time

import numpy as np
import pytest

import tutti
from conftest import (
    FINGERPRINT,
    GEOMETRY,
    WAIT_S,
    attach,
    corrupted_pool,
    fill_block,
    holds,
    open_store,
    open_where,
    retrieve_prompt,
    store_prompt,
    tokens,
)

LAYERS = list(range(GEOMETRY.layers))
SOURCE_BLOCKS = [0, 1, 2, 3]
# Scattered targets: no two blocks of a layer merge into one command.
TARGET_BLOCKS = [7, 5, 6, 4]


def stored(store: tutti.Store, seed: int) -> tuple[tutti.KvLayout, list[int]]:
    """Allocates 8 paged blocks, fills blocks 0..3 and stores them as a prompt of 4 blocks (one
    layer at a time: the store path is not what these tests check)."""
    layout = store.allocate_kv(8, "paged")
    for block in SOURCE_BLOCKS:
        fill_block(layout, block, seed + block)
    prompt = tokens(seed, len(SOURCE_BLOCKS))
    store_prompt(store, prompt, SOURCE_BLOCKS)
    return layout, prompt


def retrieved_exactly(layout: tutti.KvLayout, seed: int) -> bool:
    return all(holds(layout, target, seed + source) for source, target in zip(SOURCE_BLOCKS, TARGET_BLOCKS))


def issue_every_layer_then_wait_in_order(store: tutti.Store, layout: tutti.KvLayout, prompt: list[int], seed: int) -> None:
    """Retrieves the stored prompt, then stores another, every layer issued before any wait;
    checks the order, the in-flight lists and the bytes."""
    with store.prepare_retrieve(prompt, TARGET_BLOCKS) as request:
        ios = [request.retrieve_layer(layer) for layer in LAYERS]
        assert request.layers_in_flight == LAYERS
        assert request.layer_in_flight == 0, "layer_in_flight names the oldest"
        for layer in LAYERS:
            assert request.wait(WAIT_S) == layer, "waits complete the layers in issue order"
            assert request.layers_in_flight == LAYERS[layer + 1 :]
        assert request.wait(WAIT_S) is None and request.layer_in_flight is None
        assert all(io.done for io in ios)
        assert request.layers_completed == LAYERS
    assert retrieved_exactly(layout, seed)
    # A store with every layer in flight, then its commit.
    for block in (4, 5):
        fill_block(layout, block, seed + 100 + block)
    other = tokens(seed + 1, 2)
    request = store.prepare_store(other, [4, 5])
    for layer in LAYERS:
        request.store_layer(layer)
    with pytest.raises(tutti.InvalidState, match="wait for every layer before commit"):
        request.commit()
    assert [request.wait(WAIT_S) for _ in LAYERS] == LAYERS
    assert request.commit() == 2
    assert store.lookup(other) == 2


def test_the_store_option_is_checked_and_exposed(tmp_path):
    # Goal: layers_in_flight outside 1..=4 (objstore's limit), or more than the IOCBs, is
    # InvalidArgument naming the value, for Store.open and for Store.attach before it connects
    # (nobody serves the socket: a refusal after connecting would be Disconnected); the value is
    # a read-only property, 1 by default.
    for bad in (0, 5, -1):
        with pytest.raises(tutti.InvalidArgument, match=f"layers_in_flight = {bad}: expected 1..=4"):
            open_store(layers_in_flight=bad)
        with pytest.raises(tutti.InvalidArgument, match=f"layers_in_flight = {bad}"):
            tutti.Store.attach(str(tmp_path / "nobody.sock"), model_fingerprint=FINGERPRINT, layers_in_flight=bad)
    with pytest.raises(tutti.InvalidArgument, match="iocbs = 2"):
        open_store(layers_in_flight=4, iocbs=2)
    with open_store() as store:
        assert store.layers_in_flight == 1
    with open_store(layers_in_flight=3) as store:
        assert store.layers_in_flight == 3
        with pytest.raises(AttributeError):
            store.layers_in_flight = 1


def test_a_prepare_past_the_iocbs_is_limit_reached():
    # Goal: each prepared request holds layers_in_flight sets of IOCBs; a prepare that finds
    # too few free is LimitReached (not a device failure), and the store is usable once a
    # request is finished.
    with open_store(layers_in_flight=4, iocbs=4) as store:
        _, prompt = stored(store, 5)
        first = store.prepare_retrieve(prompt, TARGET_BLOCKS)
        with pytest.raises(tutti.LimitReached, match="free IOCBs"):
            store.prepare_retrieve(prompt, TARGET_BLOCKS)
        first.finish()
        with store.prepare_retrieve(prompt, TARGET_BLOCKS) as second:
            for layer in LAYERS:
                second.retrieve_layer(layer)
            assert [second.wait(WAIT_S) for _ in LAYERS] == LAYERS


def test_every_layer_in_flight_in_process():
    # Goal: with layers_in_flight = the model's layers, a retrieve and a store issue every layer
    # before any wait; each wait returns the oldest layer; the bytes are exact; commit is
    # refused while any layer is in flight.
    with open_store(layers_in_flight=len(LAYERS), queue_depth=2) as store:
        layout, prompt = stored(store, 10)
        issue_every_layer_then_wait_in_order(store, layout, prompt, 10)


def test_every_layer_in_flight_through_tuttid(formatted_daemon):
    # Goal: the same through tuttid: the data half is this process's (no request per layer).
    store = attach(formatted_daemon, layers_in_flight=len(LAYERS), queue_depth=2)
    try:
        layout, prompt = stored(store, 20)
        sent = store.requests_sent
        issue_every_layer_then_wait_in_order(store, layout, prompt, 20)
        # prepare + release of the retrieve, prepare + commit of the store, one lookup: none
        # per layer.
        assert store.requests_sent - sent == 5
    finally:
        store.close()


@pytest.mark.parametrize("where", ["in-process", "tuttid"])
def test_the_limit_is_refused_with_its_value(where, request):
    # Goal: a layer past layers_in_flight is InvalidState naming the layers in flight and the
    # limit, and leaves the request usable: once the oldest is waited for, the next is issued.
    store = open_where(where, request, layers_in_flight=2)
    try:
        layout, prompt = stored(store, 30)
        retrieve = store.prepare_retrieve(prompt, TARGET_BLOCKS)
        retrieve.retrieve_layer(0)
        retrieve.retrieve_layer(1)
        with pytest.raises(tutti.InvalidState, match=r"layers 0, 1 still in flight \(layers_in_flight = 2 per request\)"):
            retrieve.retrieve_layer(2)
        with pytest.raises(tutti.InvalidState, match="layers 0, 1 still in flight: wait for every layer before finish"):
            retrieve.finish()
        assert retrieve.layers_in_flight == [0, 1]
        assert retrieve.wait(WAIT_S) == 0
        with pytest.raises(tutti.InvalidState, match="layer 1 is already in flight"):
            retrieve.retrieve_layer(1)  # the same layer twice: the store refuses it
        assert retrieve.layers_in_flight == [1], "a refused issue leaves the layers in flight as they were"
        retrieve.retrieve_layer(2)
        assert retrieve.layers_in_flight == [1, 2]
        assert retrieve.wait(WAIT_S) == 1
        retrieve.retrieve_layer(3)
        assert [retrieve.wait(WAIT_S), retrieve.wait(WAIT_S)] == [2, 3]
        retrieve.finish()
        assert retrieved_exactly(layout, 30)
    finally:
        store.close()


def test_the_default_keeps_one_layer_in_flight():
    # Goal: without the option, a second layer is refused as before (one layer per request).
    with open_store() as store:
        _, prompt = stored(store, 40)
        with store.prepare_retrieve(prompt, TARGET_BLOCKS) as retrieve:
            retrieve.retrieve_layer(0)
            with pytest.raises(tutti.InvalidState, match=r"layer 0 still in flight \(layers_in_flight = 1"):
                retrieve.retrieve_layer(1)


def test_leaving_the_with_waits_out_every_layer_in_process():
    # Goal: a request left (its `with` exited) with every layer in flight, none waited for, is
    # finished only after each layer completed: all of them reported complete, the bytes of
    # every layer there.
    with open_store(layers_in_flight=len(LAYERS), queue_depth=2) as store:
        layout, prompt = stored(store, 50)
        with store.prepare_retrieve(prompt, TARGET_BLOCKS) as retrieve:
            for layer in LAYERS:
                retrieve.retrieve_layer(layer)
        assert retrieve.state == "finished"
        assert retrieve.layers_completed == LAYERS
        assert retrieved_exactly(layout, 50)


def test_close_waits_out_every_layer_in_process():
    # Goal: closing an in-process store whose request has every layer in flight (none waited
    # for) first completes each of them: the caller's numpy memory, which outlives the store,
    # holds every layer's bytes afterwards, and nothing is kept for good.
    tensors = [np.zeros((8, 2 * GEOMETRY.object_bytes), dtype=np.uint8) for _ in LAYERS]
    layout = tutti.KvLayout.paged(tensors)
    store = open_store(layers_in_flight=len(LAYERS), queue_depth=2)
    store.register_kv(layout)
    for block in SOURCE_BLOCKS:
        fill_block(layout, block, 60 + block)
    prompt = tokens(60, len(SOURCE_BLOCKS))
    store_prompt(store, prompt, SOURCE_BLOCKS)
    retrieve = store.prepare_retrieve(prompt, TARGET_BLOCKS)
    for layer in LAYERS:
        retrieve.retrieve_layer(layer)
    store.close()
    assert store.leaked_registrations() == 0
    assert retrieved_exactly(layout, 60), "a layer in flight at close did not complete before close returned"


def paused_retrieve(daemon, store: tutti.Store, prompt: list[int]) -> tuple[tutti.Request, threading.Timer]:
    """A retrieve with every layer issued while the daemon (its controller) is paused, and a
    timer that resumes it after a second."""
    retrieve = store.prepare_retrieve(prompt, TARGET_BLOCKS)
    daemon.pause()
    resumer = threading.Timer(1.0, daemon.resume)
    try:
        for layer in LAYERS:
            retrieve.retrieve_layer(layer)
        with pytest.raises(tutti.TimeoutError, match="layer 0 did not complete.*still in flight"):
            retrieve.wait(0.05)
        assert retrieve.layers_in_flight == LAYERS, "a timed-out wait leaves every layer in flight"
    finally:
        resumer.start()
    return retrieve, resumer


def test_leaving_the_with_waits_out_every_layer_through_tuttid(formatted_daemon):
    # Goal: through tuttid, with the controller paused while every layer is issued and resumed a
    # second later, leaving the `with` waits until every layer completed (finish would refuse
    # with any in flight) and the bytes of every layer are there.
    store = attach(formatted_daemon, layers_in_flight=len(LAYERS), queue_depth=2)
    try:
        layout, prompt = stored(store, 70)
        retrieve, resumer = paused_retrieve(formatted_daemon, store, prompt)
        try:
            with retrieve:
                pass
        finally:
            resumer.join()
        assert retrieve.state == "finished" and retrieve.layers_completed == LAYERS
        assert retrieved_exactly(layout, 70)
    finally:
        store.close()


def test_close_waits_out_every_layer_through_tuttid(formatted_daemon):
    # Goal: an attached store closed while every layer of a retrieve is in flight on a paused
    # controller (resumed a second later) completes each layer before it ends the session: the
    # KV buffers (kept alive by the layout) hold every layer's bytes, nothing is kept for good,
    # and tuttid then ends the session.
    store = attach(formatted_daemon, layers_in_flight=len(LAYERS), queue_depth=2)
    session = store.session
    layout, prompt = stored(store, 80)
    retrieve, resumer = paused_retrieve(formatted_daemon, store, prompt)
    try:
        started = time.monotonic()
        store.close(timeout_s=WAIT_S)
        assert time.monotonic() - started < WAIT_S
    finally:
        resumer.join()
    assert store.leaked_registrations() == 0
    assert retrieved_exactly(layout, 80), "a layer in flight at close did not complete before close returned"
    # Every layer settled: close did not need to wait for tuttid to drop the session (it does
    # so once it sees the connection closed).
    with tutti.LookupClient.connect(formatted_daemon.socket, model_fingerprint=FINGERPRINT) as probe:
        deadline = time.monotonic() + WAIT_S
        while session in [client["session"] for client in probe.status()["clients"]]:
            assert time.monotonic() < deadline, "tuttid kept the closed store's session"
            time.sleep(0.02)
    del retrieve


def test_the_completion_thread_poll_and_layer_io_with_several_in_flight():
    # Goal: with every layer in flight, the store's completion thread completes them all with
    # nobody waiting (the eventfd readable), and Request.wait then returns each, in issue order,
    # without blocking; poll retires every completed layer; a LayerIo's wait for a later layer
    # completes the ones before it and takes only its own completion (the others stay for
    # Request.wait).
    with open_store(layers_in_flight=len(LAYERS)) as store:
        layout, prompt = stored(store, 90)
        with store.prepare_retrieve(prompt, TARGET_BLOCKS) as retrieve:
            fd = retrieve.fileno()
            for layer in LAYERS:
                retrieve.retrieve_layer(layer)
            deadline = time.monotonic() + WAIT_S
            while retrieve.layers_completed != LAYERS:
                assert time.monotonic() < deadline, f"the completion thread completed {retrieve.layers_completed}"
                assert select.select([fd], [], [], WAIT_S)[0] == [fd]
                os.read(fd, 8)
            assert retrieve.layers_in_flight == []
            assert [retrieve.wait(0) for _ in LAYERS] == LAYERS
            assert retrieve.wait(0) is None
        assert retrieved_exactly(layout, 90)
        for block in TARGET_BLOCKS:
            fill_block(layout, block, 0)
        with store.prepare_retrieve(prompt, TARGET_BLOCKS) as retrieve:
            retrieve.retrieve_layer(0)
            retrieve.retrieve_layer(1)
            deadline = time.monotonic() + WAIT_S
            while not retrieve.poll():
                assert time.monotonic() < deadline, "poll never saw both layers complete"
            assert retrieve.layers_completed == [0, 1] and retrieve.layers_in_flight == []
            ios = [retrieve.retrieve_layer(2), retrieve.retrieve_layer(3)]
            assert retrieve.wait(WAIT_S) == 0, "poll's completions are returned in issue order"
            ios[1].wait(WAIT_S)
            assert ios[0].done and retrieve.layers_completed == LAYERS
            assert [retrieve.wait(0), retrieve.wait(0), retrieve.wait(0)] == [1, 2, None], "layer 3's LayerIo took its own"
        assert retrieved_exactly(layout, 90)


class StuckAfter:
    """A tutti.Request whose waits time out from layer `stuck` on (that layer stays in flight,
    the real one left for close to settle)."""

    def __init__(self, request: tutti.Request, stuck: int) -> None:
        self._request = request
        self._stuck = stuck

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def wait(self, timeout_s=None):
        if self._request.layer_in_flight == self._stuck:
            raise tutti.TimeoutError("injected: the layer did not complete")
        return self._request.wait(timeout_s)


def test_the_connectors_iocbs_cover_the_longest_request_up_to_the_cap(caplog):
    # Goal: the IOCBs a connector asks for hold requests_max requests of layers_in_flight
    # layers of the engine's longest request (one IOCB per 2048 commands, two commands a
    # block): a 128k-token request at 16 tokens a block needs 8 a layer; past 1024 the count
    # is capped and the shortfall logged; without the longest length, two a layer as before.
    from tutti._engine import iocbs_for

    assert iocbs_for("test", 16, 2) == 64
    assert iocbs_for("test", 64, 2) == 256
    assert iocbs_for("test", 16, 2, blocks_per_request_max=100) == 64
    assert iocbs_for("test", 16, 2, blocks_per_request_max=131072 // 16) == 256
    assert iocbs_for("test", 16, 2, blocks_per_request_max=131072 // 16 + 1) == 512
    with caplog.at_level("WARNING", logger="tutti"):
        assert iocbs_for("test", 32, 4, blocks_per_request_max=65536) == 1024
    assert "only 4 requests of the longest length can be prepared at once" in caplog.text


def test_the_engines_wait_out_takes_every_layer_in_flight_and_keeps_a_request_with_one_stuck():
    # Goal: the connectors' give-up path (tutti._engine.wait_out_layer) waits out every layer a
    # request has in flight, not only the oldest, before it lets the request go; with a later
    # layer stuck it answers False (the request must be kept) after the earlier ones completed.
    import logging

    from tutti._engine import wait_out_layer

    log = logging.getLogger("test")
    with open_store(layers_in_flight=3, queue_depth=2) as store:
        layout, prompt = stored(store, 70)
        request = store.prepare_retrieve(prompt, TARGET_BLOCKS)
        for layer in LAYERS[:3]:
            request.retrieve_layer(layer)
        assert wait_out_layer(request, WAIT_S, log, "test") is True
        assert request.layer_in_flight is None
        request.finish()
        stuck = store.prepare_retrieve(prompt, TARGET_BLOCKS)
        for layer in LAYERS[:3]:
            stuck.retrieve_layer(layer)
        assert wait_out_layer(StuckAfter(stuck, 1), 0.2, log, "test") is False
        assert stuck.layers_in_flight == [1, 2], "layer 0 was waited out, layer 1 is kept in flight"


def test_the_engines_wait_out_is_not_fooled_by_a_completion_not_yet_returned():
    # Goal: with layer 0 completed through its LayerIo (not yet returned by Request.wait) and
    # layer 1 in flight, wait_out_layer spends a wait on the completed layer and still waits
    # layer 1 out: True, nothing in flight (it used to answer False after one wait).
    import logging

    from tutti._engine import wait_out_layer

    with open_store(layers_in_flight=2, queue_depth=2) as store:
        layout, prompt = stored(store, 80)
        request = store.prepare_retrieve(prompt, TARGET_BLOCKS)
        ios = [request.retrieve_layer(layer) for layer in LAYERS[:2]]
        ios[0].wait(WAIT_S)
        assert request.layers_in_flight == [1]
        assert wait_out_layer(request, WAIT_S, logging.getLogger("test"), "test") is True
        assert request.layer_in_flight is None
        request.finish()


class _FinishRefused:
    """A request stub with nothing in flight whose finish raises `error`; `ends` says whether
    the refusal ended it (as Request.finish does when the store let go of it)."""

    layer_in_flight = None
    layers_in_flight: list[int] = []

    def __init__(self, error: tutti.Error, ends: bool):
        self.error = error
        self.ends = ends
        self.state = "prepared"

    def finish(self) -> None:
        if self.ends:
            self.state = "finished"
        raise self.error


def test_the_engines_abandon_says_whether_the_request_ended():
    # Goal: tutti._engine.abandon_request answers True only when the request ended: a finish
    # refused with the request still live (state "prepared", whatever the error class) is
    # False, so the caller keeps it and the memory it names; a refusal that ended it is True.
    import logging

    from tutti._engine import abandon_request

    log = logging.getLogger("test")
    for error in (tutti.Disconnected("tuttid went away"), tutti.InvalidState("a layer in flight")):
        assert abandon_request(_FinishRefused(error, ends=False), WAIT_S, log, "test") is False, error
        assert abandon_request(_FinishRefused(error, ends=True), WAIT_S, log, "test") is True, error


def last_layer_then_a_failing_reread(store: tutti.Store, prompt: list[int]) -> tuple[tutti.Request, tutti.LayerIo, tutti.LayerIo]:
    """With layers_in_flight = 2: layers 0..2 retrieved and returned by waits, then the last
    layer (3) in flight with layer 0 issued again behind it. Issuing layer 0 again unfolds it
    from the blocks' CRCs, so layer 3 completes without a comparison and the completion of
    layer 0's re-read (the last layer missing) compares and fails. Nothing drives them yet (no
    completion thread)."""
    request = store.prepare_retrieve(prompt, [2, 3])
    request.retrieve_layer(0)
    request.retrieve_layer(1)
    assert request.wait(WAIT_S) == 0
    request.retrieve_layer(2)
    assert request.wait(WAIT_S) == 1
    last = request.retrieve_layer(3)
    assert request.wait(WAIT_S) == 2
    again = request.retrieve_layer(0)
    assert request.layers_in_flight == [3, 0]
    return request, last, again


@pytest.mark.parametrize("driven_by", ["the layer's wait", "the completion thread"])
def test_a_layer_io_raises_its_own_layers_failure_and_request_wait_the_others(tmp_path, driven_by):
    # Goal: with layer 3 completing ahead of layer 0 (issued again behind it, failing), layer
    # 0's LayerIo raises layer 0's own failure, saying so, whether it drove layer 3 itself or
    # the completion thread had seen it end; Request.wait then returns layer 3, once, and
    # nothing of layer 0 (its failure was its LayerIo's); layer 3's LayerIo answers completed
    # and layer 0's its failure, as often as asked; both LayerIos are done.
    device, prompt = corrupted_pool(tmp_path)
    with tutti.Store.open(device, GEOMETRY, verify_retrieves=True, layers_in_flight=2) as store:
        store.allocate_kv(4, "block_major")
        request, last, again = last_layer_then_a_failing_reread(store, prompt)
        if driven_by == "the completion thread":
            fd = request.fileno()
            assert select.select([fd], [], [], WAIT_S)[0] == [fd], "the completion thread did not signal layer 3's end"
        with pytest.raises(tutti.IntegrityError, match=r"^layer 0 failed: .*CRC mismatch in 1 block"):
            again.wait(WAIT_S)
        assert request.layers_in_flight == [] and last.done and again.done
        assert request.wait(WAIT_S) == 3
        assert request.wait(0) is None, "layer 0's failure was raised by its own LayerIo"
        for _ in range(2):
            last.wait(WAIT_S)
            assert last.poll()
            with pytest.raises(tutti.IntegrityError, match=r"^layer 0 failed: "):
                again.wait(0)
        assert request.layers_completed == [0, 1, 2, 3]
        request.finish()
        assert store.lookup(prompt) == 1, "the corrupted block was evicted"


def test_a_layer_io_after_its_request_ended_says_how_its_issue_ended(tmp_path):
    # Goal: once its request ended (finish, leaving the `with`), a LayerIo's wait and poll
    # return only for an issue that completed and raise the failure of one that failed, as
    # often as asked (they used to return as if every layer had completed).
    device, prompt = corrupted_pool(tmp_path)
    with tutti.Store.open(device, GEOMETRY, verify_retrieves=True, layers_in_flight=2) as store:
        store.allocate_kv(4, "block_major")
        with store.prepare_retrieve(prompt[: GEOMETRY.block_tokens], [0]) as request:
            completed = request.retrieve_layer(0)
            assert request.wait(WAIT_S) == 0
        request, last, again = last_layer_then_a_failing_reread(store, prompt)
        assert request.wait(WAIT_S) == 3
        with pytest.raises(tutti.IntegrityError, match=r"^layer 0 failed: "):
            request.wait(WAIT_S)
        request.finish()
        for _ in range(2):
            completed.wait(0)
            assert completed.poll()
            last.wait(0)
            assert last.poll()
            with pytest.raises(tutti.IntegrityError, match=r"^layer 0 failed: .*CRC mismatch"):
                again.wait(0)
            with pytest.raises(tutti.IntegrityError, match=r"^layer 0 failed: "):
                again.poll()


def test_request_wait_reports_each_outcome_once_in_issue_order(tmp_path):
    # Goal: with nobody waiting on a LayerIo, Request.wait returns layer 3 and then raises
    # layer 0's failure, each once and naming its layer, after the completions before them; a
    # poll that saw both end raises nothing (the failure is the waits' to report).
    device, prompt = corrupted_pool(tmp_path)
    with tutti.Store.open(device, GEOMETRY, verify_retrieves=True, layers_in_flight=2) as store:
        store.allocate_kv(4, "block_major")
        request, _, _ = last_layer_then_a_failing_reread(store, prompt)
        deadline = time.monotonic() + WAIT_S
        while not request.poll():
            assert time.monotonic() < deadline, "poll never saw both layers end"
        assert request.wait(0) == 3
        with pytest.raises(tutti.IntegrityError, match=r"^layer 0 failed: .*CRC mismatch"):
            request.wait(0)
        assert request.wait(0) is None
        request.finish()


def test_a_layer_io_answers_for_its_own_issue_when_the_layer_is_issued_again():
    # Goal: a LayerIo whose issue's outcome Request.wait returned answers with that issue's
    # result once its layer is issued again: it neither drives nor takes the new issue's
    # outcome (it used to, so that Request.wait then found nothing), and the new issue's
    # LayerIo answers for its own.
    with open_store(layers_in_flight=2) as store:
        layout, prompt = stored(store, 40)
        with store.prepare_retrieve(prompt, TARGET_BLOCKS) as request:
            first = request.retrieve_layer(0)
            assert request.wait(WAIT_S) == 0
            second = request.retrieve_layer(0)
            first.wait(WAIT_S)
            assert first.poll() and first.done
            assert not second.done, "nothing drove the second issue"
            assert request.wait(WAIT_S) == 0, "the second issue's outcome is left for the waits"
            second.wait(0)
            assert second.done and request.wait(0) is None


@pytest.mark.parametrize("seen_by", ["poll", "the completion thread"])
def test_completions_not_yet_returned_count_against_the_limit(seen_by):
    # Goal: a layer that a poll or the completion thread completed still counts against
    # layers_in_flight until a wait returns it: with layers 0 and 1 issued and completed
    # (N = 2), issuing layer 2 is refused naming the layers to wait for first (it used to be
    # accepted and forget layer 0, so the next wait returned 1); the waits then return every
    # layer in issue order and the bytes are exact.
    with open_store(layers_in_flight=2) as store:
        layout, prompt = stored(store, 100)
        with store.prepare_retrieve(prompt, TARGET_BLOCKS) as retrieve:
            if seen_by == "the completion thread":
                retrieve.fileno()
            retrieve.retrieve_layer(0)
            retrieve.retrieve_layer(1)
            deadline = time.monotonic() + WAIT_S
            while retrieve.layers_completed != [0, 1]:
                assert time.monotonic() < deadline, f"{seen_by} completed {retrieve.layers_completed}"
                if seen_by == "poll":
                    retrieve.poll()
                else:
                    time.sleep(0.001)
            with pytest.raises(
                tutti.InvalidState,
                match=r"layers 0, 1 not yet returned by a wait \(layer 0 completed, layer 1 completed; "
                r"layers_in_flight = 2 per request\): wait for layer 0 before issuing layer 2",
            ):
                retrieve.retrieve_layer(2)
            assert retrieve.layers_in_flight == []
            assert retrieve.wait(0) == 0
            retrieve.retrieve_layer(2)
            with pytest.raises(tutti.InvalidState, match=r"layers 1, 2 not yet returned by a wait \(layer 1 completed, layer 2 "):
                retrieve.retrieve_layer(3)
            assert [retrieve.wait(WAIT_S), retrieve.wait(WAIT_S)] == [1, 2]
            retrieve.retrieve_layer(3)
            assert [retrieve.wait(WAIT_S), retrieve.wait(0)] == [3, None]
        assert retrieved_exactly(layout, 100)


def test_one_layer_in_flight_refuses_an_issue_before_the_last_layer_is_returned():
    # Goal: with the default of one layer, a layer completed by poll and not returned by a wait
    # refuses the next issue (it used to be forgotten at the issue); issue, wait, issue (the
    # engines' loop) and a LayerIo's wait or poll (which return their own layer) are accepted.
    with open_store() as store:
        _, prompt = stored(store, 105)
        with store.prepare_retrieve(prompt, TARGET_BLOCKS) as retrieve:
            io = retrieve.retrieve_layer(0)
            deadline = time.monotonic() + WAIT_S
            while not retrieve.poll():
                assert time.monotonic() < deadline
            assert io.done
            with pytest.raises(tutti.InvalidState, match=r"layer 0 not yet returned by a wait \(layer 0 completed; layers_in_flight = 1"):
                retrieve.retrieve_layer(1)
            assert retrieve.wait(0) == 0
            retrieve.retrieve_layer(1).wait(WAIT_S)
            io = retrieve.retrieve_layer(2)
            while not io.poll():
                assert time.monotonic() < deadline
            retrieve.retrieve_layer(3)
            assert [retrieve.wait(WAIT_S), retrieve.wait(0)] == [3, None], "the LayerIos returned layers 1 and 2"
        assert io.poll() and io.wait(0) is None, "a LayerIo of a finished request is done, as before"


@pytest.mark.parametrize("where", ["in-process", "tuttid"])
def test_a_prepare_past_the_iocbs_says_what_each_request_holds_and_what_to_raise(where, request):
    # Goal: the defaults iocbs = 64 and requests_max = 32 with layers_in_flight = 4 are accepted
    # at open, and 16 prepared requests hold every IOCB (4 each: one per layer in flight); the
    # 17th prepare is LimitReached saying how many IOCBs each request holds, that
    # requests_max x layers_in_flight is past iocbs, and to raise iocbs.
    store = open_where(where, request, layers_in_flight=4)
    try:
        _, prompt = stored(store, 110)
        held = [store.prepare_retrieve(prompt, TARGET_BLOCKS) for _ in range(16)]
        with pytest.raises(tutti.LimitReached) as refused:
            store.prepare_retrieve(prompt, TARGET_BLOCKS)
        message = str(refused.value)
        for part in (
            "0 of iocbs = 64 free, 4 needed",
            "each prepared request holds layers_in_flight = 4 sets of its IOCBs (here 4 IOCBs per request)",
            "requests_max x layers_in_flight = 32 x 4 = 128 is more than iocbs = 64",
            "raise iocbs",
        ):
            assert part in message, message
        for prepared in held:
            prepared.finish()
        retrieve_prompt(store, prompt, TARGET_BLOCKS)
    finally:
        store.close()


class LaterLayerInFlight:
    """A request whose layer 1 ended with its own failure of class Timeout (tuttid's timeout for
    that layer: "layer 1 failed: ...", raised by the first wait) while layer 2, issued after it,
    is still in flight until `until`: later waits take layer 2 at its time."""

    def __init__(self, until: float) -> None:
        self.until = until
        self.waits = 0
        self._failure_raised = False

    @property
    def layers_in_flight(self):
        return [2] if time.monotonic() < self.until else []

    @property
    def layer_in_flight(self):
        return 2 if time.monotonic() < self.until else None

    def wait(self, timeout_s=30.0):
        self.waits += 1
        if not self._failure_raised:
            self._failure_raised = True
            raise tutti.TimeoutError("layer 1 failed: injected: tuttid's timeout for the layer")
        left_s = self.until - time.monotonic()
        if left_s > timeout_s:
            time.sleep(timeout_s)
            raise tutti.TimeoutError("injected: request 0x1: layer 2 did not complete by the deadline; it is still in flight")
        time.sleep(max(0.0, left_s))
        return 2

    def poll(self):
        return time.monotonic() >= self.until


@pytest.mark.parametrize("deadline", [False, True], ids=["timeout_s", "deadline"])
def test_a_layer_s_own_timeout_failure_does_not_make_the_next_layer_stuck(deadline: bool):
    """Goal: waiting out a request's layers (before a failed request is finished: tutti._engine, shared by the vLLM
    connector and tier and the SGLang backend)
    takes a layer's own failure of class Timeout ("layer N failed: ...", that layer ended) as a
    failure, not as the layer in flight missing its wait: the later layer in flight is waited
    for, and the request can be finished (SGLang's pool kept), rather than kept as stuck."""
    import logging

    from tutti._engine import wait_out_layer

    request = LaterLayerInFlight(time.monotonic() + 0.3)
    began = time.monotonic()
    ended = wait_out_layer(request, 5.0, logging.getLogger("test"), "a test request", deadline=began + 5.0 if deadline else None)
    assert ended, "a layer's own Timeout-class failure kept the request as stuck (its next layer was still in flight)"
    assert time.monotonic() >= request.until and request.layer_in_flight is None and request.waits == 2
