"""A tutti.Request wrapper the engine tests share: a layer that is never seen to complete."""

from __future__ import annotations

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
