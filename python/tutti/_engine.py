"""What the engine connectors (tutti.vllm, tutti.sglang) share: the version check, checking a
connector's configuration dict, keys derived from an engine's own block hashes, and the
"byte geometry" of a pool whose blocks are opaque runs of bytes.

Imports neither torch nor an engine: the connectors import those themselves.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import tutti

logger = logging.getLogger("tutti")

# The smallest number of 32-bit words a key derived from a hash may have: tutti's block keys are
# 64-bit chained hashes of the tokens, so a block of one word would carry only 32 bits of the
# engine's hash and two different prefixes would meet after ~65,000 blocks (birthday bound).
HASH_TOKENS_MIN = 2
# Words of a SHA-256 digest.
_DIGEST_WORDS = 8


class ConfigError(tutti.InvalidArgument):
    """A connector's configuration (the engine's extra-config JSON) is missing a field, has one of
    the wrong type or value, or names one the connector does not know. The message names the
    field, what was found and what to write instead."""


@dataclass(frozen=True)
class Field:
    """One field of a connector configuration: its type(s), whether it is required, its default,
    an optional check returning an error sentence (or None), and a one-line description for the
    error messages."""

    kind: type | tuple[type, ...]
    description: str
    required: bool = False
    default: Any = None
    check: Optional[Callable[[Any], Optional[str]]] = None


def parse_config(where: str, given: Optional[Mapping[str, Any]], fields: Mapping[str, Field]) -> dict[str, Any]:
    """Checks `given` (a JSON object from the engine's command line) against `fields` and returns
    it with defaults filled in. Raises ConfigError naming `where` (e.g. "kv_connector_extra_config")
    and the field, for a missing required field, an unknown field (a typo must not silently fall
    back to a default), a wrong type, or a value its check refuses."""
    if given is None:
        given = {}
    if not isinstance(given, Mapping):
        raise ConfigError(f"{where} must be a JSON object, got {type(given).__name__}")
    unknown = sorted(set(given) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; the fields are: {known}")
    parsed: dict[str, Any] = {}
    for name, spec in fields.items():
        if name not in given or given[name] is None:
            if spec.required:
                raise ConfigError(f"{where}: missing required field {name!r} ({spec.description})")
            parsed[name] = spec.default
            continue
        value = given[name]
        kinds = spec.kind if isinstance(spec.kind, tuple) else (spec.kind,)
        # bool is an int in Python: refuse True where a number is meant, and 1 where a bool is.
        type_ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            type_ok = True
            try:
                value = float(value)
            except OverflowError:
                # json.loads reads integers of up to 4300 digits; a float holds ~1.8e308. Named
                # by its size: str() of an int past 4300 digits raises too.
                raise ConfigError(f"{where}: field {name!r} = an integer of {value.bit_length()} bits: too large ({spec.description})") from None
        if not type_ok:
            expected = " or ".join(kind.__name__ for kind in kinds)
            raise ConfigError(f"{where}: field {name!r} must be {expected} ({spec.description}), got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and value > INT_FIELD_MAX:
            # Before the field's check, which may print the value: str() of an int past 4300
            # digits raises.
            shown = str(value) if value.bit_length() <= 256 else f"an integer of {value.bit_length()} bits"
            raise ConfigError(f"{where}: field {name!r} = {shown}: must be at most {INT_FIELD_MAX} (2**64 - 1) ({spec.description})")
        if spec.check is not None:
            problem = spec.check(value)
            if problem is not None:
                raise ConfigError(f"{where}: field {name!r} = {value!r}: {problem}")
        parsed[name] = value
    return parsed


# The largest integer any configuration field takes (parse_config refuses more, naming the field):
# tutti.Store.open takes create_bytes and slots_max as u64 (crates/python/src/store.rs), and PyO3
# raises a bare OverflowError, naming no field, for an int past it; json.loads reads integers of
# up to 4300 digits. Fields the binding bounds tighter say so in their own check.
INT_FIELD_MAX = 2**64 - 1


def positive(value: Any) -> Optional[str]:
    return None if value > 0 else "must be positive"


# The most requests tutti.Store keeps prepared at once (its REQUESTS_MAX_LIMIT, crates/python/
# src/store.rs: open and attach refuse more).
REQUESTS_MAX_LIMIT = 65536


def requests_in_range(value: Any) -> Optional[str]:
    """The connectors' `requests_max` check: 1..=REQUESTS_MAX_LIMIT, as tutti.Store takes it."""
    if not value > 0:
        return "must be positive"
    return None if value <= REQUESTS_MAX_LIMIT else f"must be at most {REQUESTS_MAX_LIMIT} (tutti.Store's limit)"


# The longest wait tutti's binding takes (its TIMEOUT_MAX_S, crates/python/src/store.rs: it refuses
# longer ones, and infinity).
TIMEOUT_MAX_S = 1e9


def bounded_timeout(value: Any) -> Optional[str]:
    """A configuration field's check for a timeout in seconds: positive, finite, at most
    TIMEOUT_MAX_S (refused here, naming the field, rather than by the binding at attach, or
    not at all for a wait the binding does not take: json.loads reads Infinity)."""
    if not value > 0:
        return "must be positive"
    if not value <= TIMEOUT_MAX_S:
        return f"must be at most {TIMEOUT_MAX_S:.0e} seconds (and finite)"
    return None


def non_empty(value: Any) -> Optional[str]:
    return None if len(value) > 0 else "must not be empty"


# tutti.Store's layers_in_flight range (objstore's LAYERS_IN_FLIGHT_LIMIT).
LAYERS_IN_FLIGHT_MAX = 4


def layers_in_flight_field(what: str) -> Field:
    """The connectors' `layers_in_flight` field: how many layers of one `what` (a load, a page)
    are in flight at once. Two by default: the next layer's commands are queued while the
    current one drains, so the device's queue does not empty at each layer boundary (docs/
    objstore.md, "Layers in flight": 1.26x the retrieve bandwidth of one layer at a time)."""

    def in_range(value: Any) -> Optional[str]:
        return None if 1 <= value <= LAYERS_IN_FLIGHT_MAX else f"must be 1..={LAYERS_IN_FLIGHT_MAX}"

    return Field(int, f"layers of one {what} in flight at once, 1..={LAYERS_IN_FLIGHT_MAX}", default=2, check=in_range)


# tutti.Store's queue_depth range.
QUEUE_DEPTH_MAX = 1024


def queue_depth_field() -> Field:
    """The connectors' `queue_depth` field: NVMe entries of the store's queue pair on each
    device. 1024 by default: a layer's commands (one or two per block) are all on the device's
    queue at its issue, so the device works through them while the engine computes; at 64 the
    rest wait for the engine's next call into tutti (the CPU executor runs on the calling
    thread). A device whose CAP.MQES allows fewer entries refuses the depth, naming its
    maximum (tuttid: at register_kv / allocate_kv; in-process: at register_kv)."""

    def in_range(value: Any) -> Optional[str]:
        return None if 2 <= value <= QUEUE_DEPTH_MAX else f"must be 2..={QUEUE_DEPTH_MAX}"

    return Field(int, f"NVMe queue entries per device, 2..={QUEUE_DEPTH_MAX}", default=QUEUE_DEPTH_MAX, check=in_range)


# The most IOCBs iocbs_for gives a store (each holds ~96 KiB of queue memory).
_IOCBS_MAX = 1024
# NVMe commands one IOCB carries (the gio_uring ABI's GIO_MAX_IOCTX_PER_IOCB).
_COMMANDS_PER_IOCB = 2048
# NVMe commands a block takes in one layer, at most (its K and V objects; one when they merge).
_COMMANDS_PER_BLOCK_MAX = 2


def iocbs_for(
    where: str, requests_max: int, layers_in_flight: int, blocks_per_request_max: Optional[int] = None, upper_bound: bool = False
) -> int:
    """The gio_uring IOCBs a store needs for `requests_max` prepared requests of
    `layers_in_flight` layers each (tutti.Store's `iocbs`, a power of two): one set per layer
    in flight, a set being one IOCB per 2048 commands of a layer. With
    `blocks_per_request_max` (the engine's longest request, in blocks) a set is sized for it;
    without, two IOCBs (layers up to 2048 blocks). At least the store's default of 64 and at
    most 1024 (each IOCB holds ~96 KiB of queue memory): past that, fewer requests of the
    longest length are prepared at once than requests_max (a prepare that finds no free IOCBs
    is refused and says so: a miss), which is logged here. `upper_bound`: the set size is the
    fewest commands any device could take (the SGLang backend's, for 2 MiB commands), so the
    count logged is said to be at most that. Raises ConfigError naming `where` when not even one
    set per request fits in 1024."""
    sets = requests_max * layers_in_flight
    if sets > _IOCBS_MAX:
        raise ConfigError(
            f"{where}: requests_max x layers_in_flight = {requests_max} x {layers_in_flight} = {sets} IOCB sets, more than "
            f"{_IOCBS_MAX}: lower requests_max or layers_in_flight"
        )
    per_set = 2
    if blocks_per_request_max is not None:
        per_set = max(1, -(-blocks_per_request_max * _COMMANDS_PER_BLOCK_MAX // _COMMANDS_PER_IOCB))
    wanted = sets * per_set
    if wanted > _IOCBS_MAX:
        logger.warning(
            "%s: requests_max x layers_in_flight x IOCBs a layer of the longest request needs = %d x %d x %d = %d IOCBs, "
            "more than %d: %s %d requests of the longest length can be prepared at once (a prepare past them is a miss)%s",
            where, requests_max, layers_in_flight, per_set, wanted, _IOCBS_MAX, "at most" if upper_bound else "only",
            _IOCBS_MAX // (layers_in_flight * per_set), ", fewer on a device of smaller MDTS" if upper_bound else "",
        )  # fmt: skip
    return min(_IOCBS_MAX, max(64, 1 << (wanted - 1).bit_length()))


def check_engine_version(engine: str, installed: str, tested: str) -> bool:
    """Warns (warnings.warn, UserWarning, and the "tutti" logger) when the installed engine's
    version is not the one the connector was tested with. Returns whether it was."""
    if installed == tested:
        return True
    message = (
        f"tutti's {engine} connector was tested with {engine} {tested}; the installed {engine} is "
        f"{installed}. Its connector interfaces change between releases: run tutti's engine tests "
        f"against this version (tools/test.sh engines) or install {engine}=={tested}."
    )
    warnings.warn(message, UserWarning, stacklevel=3)
    logger.warning("%s", message)
    return False


def fingerprint_from_config(explicit: Optional[str], *parts: Any) -> bytes:
    """The model fingerprint: the configuration's explicit one (64 hex digits), or tutti.fingerprint
    over `parts` (the engine's model identity and everything that changes the KV bytes)."""
    if explicit is not None:
        try:
            raw = bytes.fromhex(explicit)
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise ConfigError(f"model_fingerprint must be 64 hexadecimal digits (32 bytes), got {explicit!r}")
        return raw
    return tutti.fingerprint(*[part if isinstance(part, (str, bytes, int)) else str(part) for part in parts])


def hash_tokens(key: bytes, block_tokens: int) -> list[int]:
    """The token sequence of one block standing for an engine's block key.

    Engines that hand a storage tier a hash per block (vLLM's offloading tiers, SGLang's HiCache)
    already chain it over the whole prefix, so each block is stored as a prefix of one block of
    its own: its "tokens" are the words of SHA-256 over the tag b"tutti engine block key v1\\0"
    then `key` (the 32-byte digest read as eight little-endian u32 words), the first block_tokens
    of them, or all eight then zeroes up to block_tokens. tutti then chains
    those words into its 64-bit block key in the store's key space (model fingerprint and TP rank
    for a store attached to tuttid). Needs block_tokens >= HASH_TOKENS_MIN (the caller checks, with
    a message about its own configuration)."""
    if block_tokens < HASH_TOKENS_MIN:
        raise ValueError(f"block_tokens {block_tokens} < {HASH_TOKENS_MIN}")
    digest = hashlib.sha256(b"tutti engine block key v1\0" + key).digest()
    words = [int.from_bytes(digest[4 * index : 4 * index + 4], "little") for index in range(_DIGEST_WORDS)]
    if block_tokens <= _DIGEST_WORDS:
        return words[:block_tokens]
    return words + [0] * (block_tokens - _DIGEST_WORDS)


# Tokens per block of a byte geometry: the key words (hash_tokens) of one engine block.
BYTE_GEOMETRY_BLOCK_TOKENS = _DIGEST_WORDS
_GEOMETRY_FIELD_MAX = 65536


def byte_geometry(layer_block_bytes: int, layers: int = 1) -> tutti.ModelGeometry:
    """A geometry of `layers` layers whose block holds, per layer, `layer_block_bytes` opaque bytes
    (its "K" object the first half, its "V" the second), for pools that store an engine's blocks
    as they lie in host memory (vLLM's CPU tier rows, SGLang's host pages). block_tokens is
    BYTE_GEOMETRY_BLOCK_TOKENS (the words of a hash key), dtype_bytes 1: register such memory as
    raw bytes (uint8 views). Raises ConfigError when the bytes cannot be cut that way (not a
    multiple of 2 x block_tokens, or too large for the geometry's fields)."""
    per_token_half = layer_block_bytes // (2 * BYTE_GEOMETRY_BLOCK_TOKENS)
    if layer_block_bytes <= 0 or per_token_half * 2 * BYTE_GEOMETRY_BLOCK_TOKENS != layer_block_bytes:
        raise ConfigError(
            f"a block of {layer_block_bytes} bytes per layer cannot be stored as {BYTE_GEOMETRY_BLOCK_TOKENS} "
            f"key words x 2 halves: it must be a positive multiple of {2 * BYTE_GEOMETRY_BLOCK_TOKENS} bytes"
        )
    # kv_heads x head_dim = per_token_half, each at most 65536: the smallest kv_heads that divides.
    for kv_heads in range(max(1, -(-per_token_half // _GEOMETRY_FIELD_MAX)), _GEOMETRY_FIELD_MAX + 1):
        if per_token_half % kv_heads == 0 and per_token_half // kv_heads <= _GEOMETRY_FIELD_MAX:
            return tutti.ModelGeometry(
                layers=layers,
                kv_heads=kv_heads,
                head_dim=per_token_half // kv_heads,
                dtype_bytes=1,
                block_tokens=BYTE_GEOMETRY_BLOCK_TOKENS,
            )
    raise ConfigError(f"a block of {layer_block_bytes} bytes per layer is too large for one pool block")


def device_strings_problem(devices: Any) -> Optional[str]:
    """The "devices" field's check of the connectors that open a pool themselves (SGLang's
    backend, vLLM's TuttiTier; parse_config has checked it is a str or a list): one device
    string, or a non-empty list of them, none empty; what is wrong otherwise. Unchecked, a
    non-string failed later with an error naming no field (a TypeError or AttributeError where
    the rank templates are filled in), and an empty list or string reached tutti.Store.open,
    whose refusal names no field either."""
    listed = [devices] if isinstance(devices, str) else devices
    if not listed or not all(isinstance(device, str) and device for device in listed):
        return (
            "must be a device string or a non-empty list of device strings, none empty, "
            "e.g. \"vfio:0000:01:00.0\" or [\"emu:/var/tutti/a.img\", \"emu:/var/tutti/b.img\"]"
        )
    return None


def format_devices(devices: Sequence[str] | str, tp_rank: int) -> list[str]:
    """Device strings with "{tp_rank}" replaced: one pool per rank where each rank opens its own
    devices in-process (one process per pool)."""
    listed = [devices] if isinstance(devices, str) else list(devices)
    return [device.replace("{tp_rank}", str(tp_rank)) for device in listed]


# Waits wait_out_layer may spend: each returns a completed layer not yet returned, raises a
# layer's failure, or completes (or times out on) the oldest layer in flight; a request holds at
# most 4 layers in flight and not yet returned together (tutti.Store's layers_in_flight), so this
# covers every layer with room to spare.
_WAIT_OUT_PASSES = 16


def refuses_crc_less_pool(error: BaseException) -> bool:
    """Whether the store refused verify_retrieves (at register_kv) because the pool records no
    payload CRCs (objstore's refusal names both; the binding raises it as InvalidArgument): the
    connectors then name both ways out, unchecked reads or a pool formatted with CRCs."""
    message = str(error)
    return isinstance(error, tutti.InvalidArgument) and "verify_retrieves" in message and "payload CRC" in message


def wait_s(timeout_s: float, deadline: float) -> float:
    """A layer's wait: timeout_s, ending no later than `deadline` (time.monotonic(); 0 once it
    has passed: a layer complete by then is still returned)."""
    return max(0.0, min(timeout_s, deadline - time.monotonic()))


def wait_out_layer(
    request: Any, timeout_s: float, log: logging.Logger, what: str, deadline: Optional[float] = None
) -> bool:
    """Waits (each wait bounded by `timeout_s`) until `request` has no layer in flight, before
    the caller gives the request up. False when a layer is still in flight after its wait timed
    out, or after as many waits as a request can need (the devices may still move its blocks'
    bytes: the request must be kept); `what` names the request in the error logged then. A wait
    may first return a layer that completed earlier (a poll, the completion thread) or raise a
    failure stored for an earlier layer: neither counts against the layer in flight.
    `deadline` (time.monotonic()): when given, no wait goes past it, so a caller giving up
    several requests bounds them all together rather than each by `timeout_s`."""
    for _ in range(_WAIT_OUT_PASSES):
        oldest = request.layer_in_flight
        if oldest is None:
            return True
        wait_s = timeout_s
        if deadline is not None:
            wait_s = min(timeout_s, deadline - time.monotonic())
            if wait_s <= 0:
                try:
                    request.poll()  # a layer done by now is not held against the request
                except tutti.Error:
                    pass  # a layer's failure: its wait raises it; only what is in flight counts here
                if request.layer_in_flight is None:
                    return True
                log.error("%s: layer %d is still in flight at the deadline; the request is kept", what, request.layer_in_flight)
                return False
        try:
            request.wait(wait_s)
        except tutti.TimeoutError as error:
            # A layer's own failure can be of class Timeout too ("layer N failed: ...": tuttid's
            # timeout for it, or a deadline the store passed), that layer ended, raised while a
            # later layer is still in flight: a failure, as below, not the wait running out.
            if not _is_layer_failure(error) and request.layer_in_flight == oldest:
                log.error("%s: layer %d did not complete; the request is kept: %s", what, oldest, error)
                return False
        except tutti.Error:
            pass  # that layer (or an earlier one) failed; the next pass looks again
    if request.layer_in_flight is None:
        return True
    log.error("%s: layers %s are still in flight; the request is kept", what, list(request.layers_in_flight))
    return False


def _is_layer_failure(error: tutti.Error) -> bool:
    """Whether a wait's error is a layer's own failure ("layer N failed: ...", that layer ended;
    Request.wait's message), not its deadline ("request 0x...: layer N did not complete by the
    deadline"). Only the message tells a TimeoutError of either kind apart."""
    return re.match(r"layer \d+ failed: ", str(error)) is not None


def abandon_request(request: Any, timeout_s: float, log: logging.Logger, what: str) -> bool:
    """Finishes a failed request once no layer of it is in flight (`wait_out_layer`); whether it
    ended. False when a layer does not complete, or the finish is refused and the store still
    holds the request (its state stays "prepared": a layer still in flight, InvalidState, or a
    failure part way): the request is kept (its pins, its request place), and the devices may
    still move its blocks' bytes; protecting the memory it names is the caller's part. A refusal
    is logged either way; one after which the store let go of the request (a daemon gone) is
    True: nothing of it is live."""
    if not wait_out_layer(request, timeout_s, log, what):
        return False
    try:
        request.finish()
    except tutti.Error as error:
        # The request's state, not the error's class, says whether the store let go of it.
        live = request.state == "prepared"
        log.error("%s could not be finished%s: %s", what, " (the request is kept)" if live else "", error)
        return not live
    return True
