"""A connection tuttid ended (an Error under request id 0, then closed) is a lost connection in
Python too: `Disconnected`, keeping the daemon's code, so that a connector's `connection_lost`
(vLLM: `tutti.vllm.metadata.connection_lost`, true for `Disconnected`) reconnects at once."""

from __future__ import annotations

import time

import pytest

import tutti
from conftest import FINGERPRINT
from error_daemon import ErrorDaemon

FRAME_TIMEOUT = 8  # ErrorCode::FrameTimeout


def test_a_connection_the_daemon_ended_is_disconnected_with_its_code(tmp_path):
    # Goal: FrameTimeout under id 0 (tuttid cut a frame and closed) raises Disconnected with the
    # code, not a DaemonError refusal that reads as "the connection is usable" (before, the
    # connector kept the dead client for one more failed call).
    daemon = ErrorDaemon(tmp_path / "ending.sock", FRAME_TIMEOUT, b"the rest of a frame: no answer within 2000 ms", goodbye=True)
    try:
        with pytest.raises(tutti.Error) as raised:
            tutti.Store.attach(str(tmp_path / "ending.sock"), model_fingerprint=FINGERPRINT, keepalive=False, timeout_s=2.0)
    finally:
        daemon.stop()
    error = raised.value
    assert isinstance(error, tutti.Disconnected), f"{type(error).__name__}: {error}"
    assert error.code == "FrameTimeout"


def test_a_store_call_on_a_session_the_daemon_ended_is_disconnected_with_its_code(tmp_path):
    # Goal: an attached Store's calls go through RemoteKvStore, whose error (not the daemon
    # client's) reaches Python; a goodbye (here LeaseExpired: no frame within a 300 ms lease,
    # keep-alive off) is Disconnected there too, keeping the daemon's code as attach's does.
    # Before, the Store path raised Disconnected with code None.
    from conftest import attach, start_daemon, tokens

    daemon = start_daemon(tmp_path, "--lease", "300ms")
    try:
        store = attach(daemon, timeout_s=3.0)
        store.allocate_kv(4, "paged")
        time.sleep(1.0)  # past the lease: tuttid ends the session with LeaseExpired
        with pytest.raises(tutti.Error) as raised:
            store.prepare_store(tokens(1, 2), [0, 1])
        store.close()
    finally:
        daemon.stop()
    error = raised.value
    assert isinstance(error, tutti.Disconnected), f"{type(error).__name__}: {error}"
    assert error.code == "LeaseExpired", f"{error.code!r}: {error}"


KEEPALIVE_FAILED = "keep-alive ping to tuttid failed"


def test_a_goodbye_the_keepalive_ping_read_keeps_its_code_for_the_next_call(tmp_path, capfd):
    # Goal: with keep-alive on (the default), the ping is often what reads tuttid's goodbye (an
    # idle engine while tuttid is restarted); the next Store call on that connection raises
    # Disconnected with the daemon's code all the same. Before, only the call that read the
    # goodbye kept the code: after the ping had, the next call's Disconnected had code None.
    # A 3 s lease (a ping a second): the session cannot expire before the SIGTERM that follows
    # allocate_kv however slow the machine, and the ping's failure is waited for (bounded, on
    # its warning on standard error), so the ping, not the call, has read the goodbye.
    from conftest import WAIT_S, start_daemon, tokens

    daemon = start_daemon(tmp_path, "--lease", "3s")
    try:
        store = tutti.Store.attach(daemon.socket, model_fingerprint=FINGERPRINT, keepalive=True, timeout_s=3.0)
        store.allocate_kv(4, "paged")
    finally:
        daemon.stop()  # SIGTERM: tuttid says ShuttingDown to the idle session and exits
    stderr = ""
    deadline = time.monotonic() + WAIT_S
    while KEEPALIVE_FAILED not in stderr and time.monotonic() < deadline:
        time.sleep(0.05)
        stderr += capfd.readouterr().err
    try:
        assert KEEPALIVE_FAILED in stderr, f"no failed keep-alive ping within {WAIT_S} s: {stderr}"
        assert "ShuttingDown" in stderr, stderr
        with pytest.raises(tutti.Error) as raised:
            store.prepare_store(tokens(1, 2), [0, 1])
    finally:
        store.close()
    error = raised.value
    assert isinstance(error, tutti.Disconnected), f"{type(error).__name__}: {error}"
    assert error.code == "ShuttingDown", f"{error.code!r}: {error}"
