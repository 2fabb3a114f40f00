"""tutti.Request wrappers the engine tests share: a layer that is never seen to complete."""

from __future__ import annotations

import time

import tutti


class StalledLayer:
    """A tutti.Request whose layer, once issued, is never seen to complete: every wait times out
    and the layer stays in flight (the real one is left for the store's close to settle)."""

    def __init__(self, request) -> None:
        self._request = request

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    def wait(self, timeout_s=None):
        raise tutti.TimeoutError("injected: the layer did not complete")


class SleepingStall(StalledLayer):
    """A StalledLayer whose waits take all the time they are given (a device that does not answer)
    and whose layer stays in flight whatever is polled; with `calls`, every wait and poll is
    counted there as (what, `number`)."""

    def __init__(self, request, calls: list | None = None, number: int = 0) -> None:
        super().__init__(request)
        self._calls = calls
        self._number = number

    def _record(self, what: str) -> None:
        if self._calls is not None:
            self._calls.append((what, self._number))

    def wait(self, timeout_s=None):
        self._record("wait")
        time.sleep(timeout_s)
        raise tutti.TimeoutError("injected: the layer did not complete")

    def poll(self):
        self._record("poll")
        return None

    @property
    def layer_in_flight(self):
        return 0

    @property
    def layers_in_flight(self):
        return [0]
