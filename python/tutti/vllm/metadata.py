"""What the two sides of `tutti.vllm.TuttiConnector` share: the step's instructions from the
scheduler to the workers (`TuttiConnectorMetadata`, pickled to them by vLLM), how a failed
exchange with tuttid is judged, and the block-size check both sides make when they attach."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import tutti
from tutti._engine import ConfigError
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class LoadSpec:
    """Scheduler → worker: read the cached prefix `tokens` (whole blocks) into `block_ids`
    (block i of the prefix into block_ids[i]).

    Blocks before `first_block` are vLLM's own (its local prefix cache hit, possibly shared with
    other requests): the load neither reads nor writes them; it fills, and on failure reports,
    the blocks from `first_block` on."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    first_block: int = 0


@dataclass
class SaveSpec:
    """Scheduler → worker: store the prefix `tokens` (whole blocks) from `block_ids`, layer by layer
    during this step's forward."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]


@dataclass
class TuttiConnectorMetadata(KVConnectorMetadata):
    """One step's instructions for the workers (pickled to them by vLLM).

    `model_fingerprint` is the scheduler's (its lookups' key space) and `model_identity` what it
    was computed from (in the first step's metadata only; None after): each worker compares the
    fingerprint with its own when it binds the first metadata and stops
    on a difference (ConfigError), since every lookup would then miss the workers' saves. Each
    process computes its default fingerprint itself, from a config.json it reads on its own. None
    (metadata not built by the scheduler's connector): not compared."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    model_fingerprint: Optional[bytes] = None
    model_identity: Optional[str] = None


@dataclass
class TuttiWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler, in a step's output (vLLM's build_connector_worker_meta): the
    reporting ranks' tuttid sessions, rank → why it is ended (None: open). A worker reports while
    its session is ended, and once when a new one opened; vLLM's output aggregator merges the
    ranks' metadata (`aggregate`). While any rank's session is ended its loads fail, so the
    scheduler side matches nothing (`SchedulerSide.get_num_new_matched_tokens`)."""

    sessions_ended: dict[int, Optional[str]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "TuttiWorkerMetadata":
        merged = dict(self.sessions_ended)
        if isinstance(other, TuttiWorkerMetadata):
            merged.update(other.sessions_ended)
        return TuttiWorkerMetadata(merged)


def connection_lost(error: Exception) -> bool:
    """Whether a daemon call's failure leaves the connection unusable: a closed connection or a
    session tuttid ended, an exchange that timed out (the client no longer knows which reply is
    whose), or a failure of the exchange itself (no refusal code). Another refusal with a code
    (e.g. Busy, LimitReached) leaves it usable."""
    if isinstance(error, (tutti.TimeoutError, tutti.Disconnected)):
        return True  # Disconnected: also tuttid ending the connection (LeaseExpired, ShuttingDown, FrameTimeout, ...)
    return isinstance(error, tutti.DaemonError) and getattr(error, "code", None) is None


def check_block_size(attached, block_size: int, format_hint: bool) -> None:
    """Closes `attached` (a tuttid client or store) and raises ConfigError when its pool stores
    blocks of another size than vLLM's; `format_hint` adds the other way out (format the pool)."""
    if attached.block_tokens == block_size:
        return
    block_tokens = attached.block_tokens
    attached.close()
    other_way = f", or format the pool for {block_size}-token blocks" if format_hint else ""
    raise ConfigError(
        f"tuttid's pool stores blocks of {block_tokens} tokens but vLLM's block size is "
        f"{block_size}: start vLLM with --block-size {block_tokens}{other_way}"
    )
