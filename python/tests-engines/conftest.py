"""Fixtures of the engine tests (tools/test.sh engines): a tuttid on a software NVMe controller,
started per test and stopped after it.

The daemon binary comes from $TUTTI_TUTTID (the stage builds it). These tests run in the engines'
own environments (tools/python/engine-env.sh), where vLLM or SGLang is installed; a test module
whose engine is missing fails at import (the stage never runs it there).
"""

from __future__ import annotations

import os
import signal
import socket as socket_module
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


class Daemon:
    """One tuttid process serving `socket` on an emu:mem: pool formatted for a geometry."""

    def __init__(self, directory: Path, geometry_args: list[str], extra: list[str]) -> None:
        binary = os.environ.get("TUTTI_TUTTID")
        if not binary or not Path(binary).is_file():
            pytest.fail("TUTTI_TUTTID must name the tuttid binary (tools/test.sh engines builds it and sets it)")
        self.socket = str(directory / "tuttid.sock")
        self.log_path = directory / "tuttid.log"
        command = [
            binary,
            "--device", "emu:mem:64m",
            "--format",
            "--socket", self.socket,
            "--lock-dir", str(directory / "locks"),
            "--metrics", "off",
            *geometry_args,
            *extra,
        ]  # fmt: skip
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._listening():
            if self.process.poll() is not None:
                pytest.fail(f"tuttid exited with {self.process.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"tuttid did not listen within {START_TIMEOUT_S} s: {self.log()}")
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

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def pause(self) -> None:
        """SIGSTOP: the software controller inside the daemon stops moving bytes and no request
        is answered. Returns once every thread of the daemon is stopped (the signal is delivered
        asynchronously)."""
        os.kill(self.process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
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
                raise AssertionError(f"tuttid did not stop within 5 s of SIGSTOP (thread states {states})")
            time.sleep(0.001)

    def resume(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM (the daemon drains its sessions), then SIGKILL if it has not exited in time."""
        self.resume()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_TIMEOUT_S)
        self._log.close()


@pytest.fixture
def tuttid(tmp_path: Path) -> Iterator:
    """A factory: tuttid(geometry_args, extra=[]) starts a daemon; every one is stopped after the
    test."""
    daemons: list[Daemon] = []

    def start(geometry_args: list[str], extra: list[str] | None = None) -> Daemon:
        directory = tmp_path / f"tuttid{len(daemons)}"
        directory.mkdir()
        daemon = Daemon(directory, geometry_args, extra or [])
        daemons.append(daemon)
        return daemon

    yield start
    for daemon in daemons:
        daemon.stop()
