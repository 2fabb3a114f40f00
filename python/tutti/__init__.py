"""tutti: LLM KV cache on NVMe SSDs, layer by layer (docs/python.md).

`Store.open(...)` runs the pool in this process; `Store.attach(...)` attaches to the `tuttid`
daemon that owns it; `LookupClient.connect(...)` is a lookup-only session for an engine's
scheduler process. The API is the compiled extension's (`tutti._tutti`, typed in `_tutti.pyi`).

Importing tutti imports neither torch nor an inference engine: the engine connectors live in
`tutti.vllm` and `tutti.sglang` (extras `tutti[vllm]`, `tutti[sglang]`).
"""

from __future__ import annotations

import hashlib
from typing import Union

from tutti._tutti import (
    DaemonError,
    DeviceError,
    DeviceMemoryStandIn,
    Disconnected,
    Error,
    IntegrityError,
    InvalidArgument,
    InvalidState,
    KvBuffer,
    KvLayout,
    LayerIo,
    LimitReached,
    LookupClient,
    ModelGeometry,
    NotRegistered,
    PoolError,
    PoolFull,
    RawMemory,
    Request,
    StaleRequest,
    Store,
    TimeoutError,
    UnsupportedMemory,
    __version__,
)

__all__ = [
    "DaemonError",
    "DeviceError",
    "DeviceMemoryStandIn",
    "Disconnected",
    "Error",
    "IntegrityError",
    "InvalidArgument",
    "InvalidState",
    "KvBuffer",
    "KvLayout",
    "LayerIo",
    "LimitReached",
    "LookupClient",
    "ModelGeometry",
    "NotRegistered",
    "PoolError",
    "PoolFull",
    "RawMemory",
    "Request",
    "StaleRequest",
    "Store",
    "TimeoutError",
    "UnsupportedMemory",
    "__version__",
    "fingerprint",
]


def fingerprint(*parts: Union[str, bytes, int]) -> bytes:
    """A 32-byte model fingerprint for `Store.open/attach(model_fingerprint=...)` and
    `LookupClient.connect`: SHA-256 over the parts, each length-prefixed (so ("ab", "c") and
    ("a", "bc") differ). Give everything that changes the KV bytes: the model name and revision,
    the KV dtype, the attention layout, ... (tensor-parallel rank and world are separate
    arguments of the store). Raises TypeError for a part of another type."""
    digest = hashlib.sha256(b"tutti model fingerprint v1\0")
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (str, bytes, int)):
            raise TypeError(f"fingerprint parts are str, bytes or int, got {type(part).__name__}")
        if isinstance(part, str):
            data = b"s" + part.encode("utf-8")
        elif isinstance(part, bytes):
            data = b"b" + part
        else:
            data = b"i" + str(part).encode("ascii")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()
