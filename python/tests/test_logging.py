"""The extension's own warnings and errors reach standard error: importing `tutti` installs a
tracing subscriber writing to file descriptor 2, filtered by TUTTI_LOG (RUST_LOG syntax, default
`warn`). Before, no subscriber was installed and every event (an orphaned request, a leaked queue
pair) was discarded: the child's standard error was empty.

Each case runs in a child interpreter (the subscriber is the process's, installed once); every
wait is bounded: a child still running after WAIT_S is killed and fails the test."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Optional

import pytest

from conftest import WAIT_S

# Attaches to the daemon at argv[1] with a 0.3 s timeout, prepares a one-block store and says
# "ready"; on a line from the parent (the daemon is paused now) issues layer 0 and drops the
# request without finish: the drop waits the timeout out and orphans the request (an error
# event); says "dropped"; on the next line (the daemon runs again) closes the store.
ORPHANING_CHILD = r"""
import gc, sys
import tutti

store = tutti.Store.attach(sys.argv[1], model_fingerprint=tutti.fingerprint("tutti core tests", 1),
                           keepalive=False, timeout_s=0.3)
layout = store.allocate_kv(8, "block_major")
request = store.prepare_store([(i * 2654435761 ^ 1013) & 0x7FFFFFFF for i in range(21)], [1])
print("ready", flush=True)
sys.stdin.readline()
request.store_layer(0)
del request
gc.collect()
print("dropped", flush=True)
sys.stdin.readline()
store.close()
print("closed", flush=True)
"""

ORPHANED = "was dropped without finish"


def child_env(tutti_log: Optional[str]) -> dict[str, str]:
    """This environment with TUTTI_LOG set to `tutti_log`, or removed (the default filter,
    whatever the caller's environment holds)."""
    env = dict(os.environ)
    env.pop("TUTTI_LOG", None)
    if tutti_log is not None:
        env["TUTTI_LOG"] = tutti_log
    return env


def orphan_a_request(daemon, tutti_log: Optional[str]) -> str:
    """Runs ORPHANING_CHILD against `daemon` (paused while the layer is issued and dropped);
    returns the child's standard error."""
    child = subprocess.Popen(
        [sys.executable, "-c", ORPHANING_CHILD, daemon.socket],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(tutti_log),
    )  # fmt: skip
    watchdog = threading.Timer(WAIT_S, child.kill)
    watchdog.start()
    try:
        assert child.stdout.readline().strip() == "ready", child.communicate()[1]
        daemon.pause()
        try:
            child.stdin.write("\n")
            child.stdin.flush()
            dropped = child.stdout.readline().strip()
        finally:
            daemon.resume()
        assert dropped == "dropped", child.communicate()[1]
        stdout, stderr = child.communicate("\n")
    finally:
        watchdog.cancel()
        if child.poll() is None:
            child.kill()
        child.wait()
    assert child.returncode == 0 and stdout.strip() == "closed", f"status {child.returncode}: {stdout} {stderr}"
    return stderr


def test_an_orphaned_request_is_reported_on_standard_error_by_default(formatted_daemon):
    # Goal: with TUTTI_LOG unset, the error a request dropped without finish logs when a layer
    # of it outlives the store's timeout is on the child's standard error, once, as an ERROR
    # line. Before, standard error was empty.
    stderr = orphan_a_request(formatted_daemon, None)
    lines = [line for line in stderr.splitlines() if ORPHANED in line]
    assert len(lines) == 1 and "ERROR" in lines[0], stderr


def test_tutti_log_selects_the_events(formatted_daemon):
    # Goal: TUTTI_LOG filters as RUST_LOG does: `error` keeps the error, a directive for the
    # extension's target (`_tutti`) turns it off, `off` prints nothing at all.
    assert ORPHANED in orphan_a_request(formatted_daemon, "error")
    assert ORPHANED not in orphan_a_request(formatted_daemon, "warn,_tutti=off")
    assert orphan_a_request(formatted_daemon, "off") == ""


@pytest.mark.parametrize("value", ["tutti=loud", "warning", "objstore"])
def test_an_invalid_tutti_log_says_so_once_and_keeps_the_default(value):
    # Goal: a TUTTI_LOG that does not parse neither stops the import nor silences the
    # extension: one line names the variable and the value. A bare word that is not a level
    # (`warning`, or a target alone) is refused the same way: RUST_LOG syntax would read it as a
    # target and show nothing else; the line says a target alone is written `word=trace`.
    done = subprocess.run(
        [sys.executable, "-c", "import tutti; print('imported')"],
        capture_output=True, text=True, timeout=WAIT_S, env=child_env(value),
    )  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, "imported"), done.stderr
    complaints = [line for line in done.stderr.splitlines() if "TUTTI_LOG" in line]
    assert len(complaints) == 1 and value in complaints[0] and "default" in complaints[0], done.stderr
    if "=" not in value:
        assert f"{value}=trace" in complaints[0], done.stderr


def test_a_bare_word_that_is_not_a_level_keeps_the_default(formatted_daemon):
    # Goal: TUTTI_LOG=warning (Python's name for the level) keeps the default filter: the
    # orphaned request's error is still reported (parsed as a target, it showed nothing).
    assert ORPHANED in orphan_a_request(formatted_daemon, "warning")
