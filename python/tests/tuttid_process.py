"""A tuttid process of a test's own, shared by the core tests (python/tests/conftest.py) and the
engine tests (python/tests-engines/conftest.py, which puts this directory on sys.path): started
and waited for until it listens, paused, resumed and stopped. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import socket as socket_module
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

import pytest

START_TIMEOUT_S = 30.0
PAUSE_TIMEOUT_S = 5.0
# What a failure message shows of the daemon's output: its end.
OUTPUT_TAIL_CHARS = 4000


class TuttidProcess:
    """`binary` with `arguments` (devices, model, options), serving a socket in `directory`, where
    its lock files and its log are too."""

    def __init__(self, directory: Path, binary: str, arguments: Sequence[str], stop_timeout_s: float) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.socket = str(directory / "tuttid.sock")
        self.log_path = directory / "tuttid.log"
        self.stop_timeout_s = stop_timeout_s
        command = [
            binary,
            "--socket", self.socket,
            "--lock-dir", str(directory / "locks"),
            "--metrics", "off",
            *arguments,
        ]  # fmt: skip
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._listening():
            if self.process.poll() is not None:
                pytest.fail(f"tuttid exited with {self.process.returncode}: {self.output()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"tuttid did not listen within {START_TIMEOUT_S} s: {self.output()}")
            time.sleep(0.02)

    def _listening(self) -> bool:
        probe = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
        try:
            probe.connect(self.socket)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def output(self) -> str:
        """The end of what the daemon printed."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-OUTPUT_TAIL_CHARS:]

    def pause(self) -> None:
        """SIGSTOP: the software controller inside the daemon stops moving bytes and no request
        is answered. Returns once every thread of the daemon is stopped: the signal is delivered
        asynchronously, and a controller thread still running could complete I/O issued after
        `kill` returned (seen under load)."""
        os.kill(self.process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + PAUSE_TIMEOUT_S
        tasks = f"/proc/{self.process.pid}/task"
        while True:
            states = []
            for task in os.listdir(tasks):
                try:
                    with open(f"{tasks}/{task}/stat") as stat:
                        # The state follows the command name, which is in parentheses.
                        states.append(stat.read().rsplit(")", 1)[1].split()[0])
                except FileNotFoundError:
                    continue
            if states and all(state in ("T", "t") for state in states):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"tuttid did not stop within {PAUSE_TIMEOUT_S} s of SIGSTOP (thread states {states})")
            time.sleep(0.001)

    def resume(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> Optional[int]:
        """SIGCONT (a paused daemon cannot act on SIGTERM), SIGTERM (the daemon drains its
        sessions), then a bounded wait; SIGKILL if it has not exited by then. Returns its exit
        status, None when it had to be killed."""
        self.resume()
        returncode: Optional[int] = self.process.poll()
        if returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                returncode = self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                returncode = None
        self._log.close()
        return returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(self.stop_timeout_s)
