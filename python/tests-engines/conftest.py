"""Fixtures of the engine tests (tools/test.sh engines): a tuttid on a software NVMe controller,
started per test and stopped after it.

The daemon binary comes from $TUTTI_TUTTID (the stage builds it). These tests run in the engines'
own environments (tools/python/engine-env.sh), where vLLM or SGLang is installed; a test module
whose engine is missing fails at import (the stage never runs it there).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

# The tuttid process helper the core tests use (python/tests/tuttid_process.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tuttid_process import TuttidProcess  # noqa: E402

STOP_TIMEOUT_S = 15.0


class Daemon(TuttidProcess):
    """One tuttid process serving `socket` on an emu:mem: pool formatted for a geometry."""

    def __init__(self, directory: Path, geometry_args: list[str], extra: list[str]) -> None:
        binary = os.environ.get("TUTTI_TUTTID")
        if not binary or not Path(binary).is_file():
            pytest.fail("TUTTI_TUTTID must name the tuttid binary (tools/test.sh engines builds it and sets it)")
        arguments = ["--device", "emu:mem:64m", "--format", *geometry_args, *extra]
        super().__init__(directory, binary, arguments, stop_timeout_s=STOP_TIMEOUT_S)


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


@pytest.fixture
def store_options(monkeypatch) -> list:
    """What the connectors pass to tutti.Store.open / attach: `tutti.Store` is replaced, for the
    test, by a stand-in that records each call's name and keyword arguments (in the returned
    list) and opens the real store."""
    import tutti

    real = tutti.Store
    calls: list = []

    class RecordingStore:
        @staticmethod
        def open(*args, **kwargs):
            calls.append(("open", kwargs))
            return real.open(*args, **kwargs)

        @staticmethod
        def attach(*args, **kwargs):
            calls.append(("attach", kwargs))
            return real.attach(*args, **kwargs)

    monkeypatch.setattr(tutti, "Store", RecordingStore)
    return calls
