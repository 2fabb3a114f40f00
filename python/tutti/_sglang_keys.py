"""The key spaces of tutti's SGLang backend (`tutti.sglang`): which pool a scheduler process
opens, and under which model fingerprint it names its pages.

SGLang names a page by a hash chained over the prefix: every scheduler process of a server
(each TP rank, pipeline stage, DP-attention group, DP replica and CP rank) gives the same prefix
the same key, though a TP rank, stage or CP rank holds another share of the page's bytes, and a
restart with another model or page layout gives it the same key again. A page therefore belongs
to a key space, (devices, fingerprint), and a key is looked up only in its own:
- the devices: each scheduler process opens its own, from the "devices" template with its ranks
  filled in (`rank_devices`); a template that would give two processes one device is refused
  (`check_rank_devices`; `_replicas` and `_dp_rank` read the plain-DP replica SGLang states
  only in its runtime context).
- the fingerprint: the model (an explicit "model_fingerprint", or SGLang's model name and the
  checkpoint behind it, `_checkpoint_parts`), then always how a page's bytes are laid out
  (`_page_layout_parts`, with the KV format of an integer pool, `_kv_format_parts`), then the
  process's share of each page when the model is split across pipeline stages or CP ranks
  (`_shard_parts`): other layers or another slice under the same page hash, even on shared devices.
- the weight epoch: an in-place weight update SGLang records (a new weight version, an update
  from disk) starts a key space of its own within the pool (`_WeightEpochs`: the page keys are
  salted), where the older weights' pages miss; backups into it wait for SGLang's cache flush
  (`_watch_host_pool_clears`). Weights the server args do not name (dummy or remote_instance
  loads, a checkpoint engine's: `_unnamed_startup_weights`) get a salted startup epoch too.
- the cleared-pool record: a key space this process cleared (SGLang's storage clear) keeps its
  pages (tutti cannot delete them), so it is not opened again under that fingerprint unless it
  is formatted (`_refuse_cleared_pool`); devices are named by the storage behind them
  (`_device_identity`), however a device string spells it.
- the open-devices record: the devices this process's backends have open (`_claim_devices`), so
  a second backend on them (PD decode's KV offload manager builds one beside the hierarchical
  cache's, from the same config and ranks) is refused naming that, not by the devices' locks; a
  forked child starts with none (`_in_forked_child`).

Apart from tutti/sglang.py (the backend class and its page I/O) to keep each file to one concept;
tutti.sglang imports these names, and `rank_devices` / `check_rank_devices` stay public there.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from tutti._engine import ConfigError
from tutti._engine import device_strings_problem as _device_strings_problem  # noqa: F401 - tutti.sglang's "devices" check
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

logger = logging.getLogger("tutti.sglang")

# The pools this process cleared (SGLang's storage clear): (device identity, fingerprint) pairs.
# tutti cannot delete a pool's pages, so a backend built later in this process (SGLang's
# StorageAttachment.detach then attach) must not open such a pool again under the same
# fingerprint, unless it formats it.
_CLEARED_POOLS: set[tuple[str, bytes]] = set()
_CLEARED_POOLS_LOCK = threading.Lock()


# The devices the backends of this process have open: device identity (`_claimed_identities`) ->
# the backend holding it, weakly (a backend dropped without SGLang's close frees its devices with
# its store). On a PD decode server with --disaggregation-decode-enable-offload-kvcache SGLang
# builds two backends in one scheduler process from the one extra config and the same ranks (its
# decode KV offload manager's, beside the hierarchical radix cache's): both fill the device
# template in alike, and the second's open would fail on the first's device locks, blaming
# "another daemon" with this process's own pid (`_claim_devices` refuses it naming the cause).
_OPEN_DEVICES: dict[str, "weakref.ref[object]"] = {}
_OPEN_DEVICES_LOCK = threading.Lock()


def _in_forked_child() -> None:
    """After a fork, in the child: the backends it inherited are its parent's, whose stores refuse
    every call there ("open or attach again in the child", crates/python/src/process.rs) and whose
    devices the parent may close at any time, so the child starts with no device open; a parent
    backend left on record would refuse the child's own backend on those devices as the decode
    offload manager's. The module's locks are made anew: one a thread of the parent held at the
    fork stays held in the child, where no thread will let it go. The clear watchers are dropped
    too: they are the parent's backends' weight epochs, each with its own lock a storage thread
    of the parent may have held at the fork, and a clear of an inherited host pool in the child
    would wait on it for ever. The cleared-pool record is kept: the pages a clear left are on the
    devices for the child too."""
    global _OPEN_DEVICES, _OPEN_DEVICES_LOCK, _CLEARED_POOLS_LOCK, _CLEAR_WATCHERS, _CLEAR_WATCHERS_LOCK
    _CLEAR_WATCHERS = weakref.WeakKeyDictionary()
    _OPEN_DEVICES = {}
    _OPEN_DEVICES_LOCK = threading.Lock()
    _CLEARED_POOLS_LOCK = threading.Lock()
    _CLEAR_WATCHERS_LOCK = threading.Lock()


def _device_identities(devices: list[str]) -> tuple[str, ...]:
    """The identities of the devices that keep pages (see `_device_identity`), sorted, once each."""
    return tuple(sorted({identity for identity in map(_device_identity, devices) if identity is not None}))


def _claimed_identities(devices: list[str]) -> tuple[str, ...]:
    """What a backend claims its devices under (`_claim_devices`): their identities
    (`_device_identities`), and a file or block device's resolved path besides its file's: a pool
    file a format is about to create is named by its path alone until the open creates it, and a
    backend that comes after that names it by its inode, so both claim the path and collide there
    (a hard link made meanwhile, another path to the new file, is caught only by the claim after the
    open, by the inode)."""
    identities = set(_device_identities(devices))  # refuses a device tutti would not open, first
    for device in devices:
        kind, _, rest = device.partition(":")
        if kind in ("emu", "uring") and not _keeps_nothing(device):
            identities.add("path:" + os.path.realpath(rest))
    return tuple(sorted(identities))


class _UnopenableDevice(ConfigError):
    """A device string tutti would refuse to open (`_device_identity`); `clause` says why, to
    follow the device string in a message (which names the process it was filled in for)."""

    def __init__(self, device: str, clause: str) -> None:
        super().__init__(f"--hicache-storage-backend-extra-config: field 'devices': {device!r}, {clause}")
        self.clause = clause


def _keeps_nothing(device: str) -> bool:
    """A memory or no-storage device (emu:mem:SIZE, emu:null:SIZE): nothing of it outlives its
    close, and no two processes can share one."""
    kind, _, rest = device.partition(":")
    return kind == "emu" and rest.startswith(("mem:", "null:"))


# Hex digits each field of a PCI address may have at most: domain, bus, slot, function.
_PCI_FIELD_DIGITS = (4, 2, 2, 1)


def _pci_address(text: str) -> Optional[str]:
    """`text` as tutti's PciAddress parses it (crates/nvme-driver/src/hw/vfio/sysfs.rs):
    DOMAIN:BUS:SLOT.FUNCTION or BUS:SLOT.FUNCTION (domain 0), ASCII hex digits only, any case, a
    domain of at most 4 digits, a bus and a slot of at most 2, a function of 1, the slot at most
    0x1f and the function at most 7. Its canonical spelling (0000:01:00.0), or None where tutti
    refuses it (Python's int(..., 16) would also take a sign, a 0x prefix, underscores, spaces
    and a 3-digit bus, which name no device tutti opens)."""
    head, dot, function = text.rpartition(".")
    fields = head.split(":") if dot else []
    if len(fields) == 2:
        fields.insert(0, "0")
    if len(fields) != 3:
        return None
    fields.append(function)
    if not all(re.fullmatch(f"[0-9a-fA-F]{{1,{digits}}}", field) for field, digits in zip(fields, _PCI_FIELD_DIGITS)):
        return None
    domain, bus, slot, number = (int(field, 16) for field in fields)
    if slot > 0x1F or number > 7:
        return None
    return f"{domain:04x}:{bus:02x}:{slot:02x}.{number:x}"


def _device_identity(device: str) -> Optional[str]:
    """The storage behind a device string, however it is spelled: a file or block device
    (emu:PATH and uring:PATH open the same storage) by its resolved path, a vfio: PCI function
    by its address with the domain; None for memory and no-storage devices (`_keeps_nothing`).
    Raises _UnopenableDevice (a ConfigError) for a device tutti would refuse to open: a vfio:
    address that is not a PCI address (`_pci_address`), a path no file can have (a NUL byte, a
    name the file system's encoding cannot take)."""
    if _keeps_nothing(device):
        return None
    kind, _, rest = device.partition(":")
    if kind in ("emu", "uring"):
        try:
            # The file itself: a hard link or another path to it is the same storage.
            status = os.stat(rest)
            return f"file:{status.st_dev}:{status.st_ino}"
        except OSError:
            return "path:" + os.path.realpath(rest)
        except ValueError as error:
            raise _UnopenableDevice(device, f"which names a path no file can have ({error})") from None
    if kind == "vfio":
        # So that vfio:1:0.0 and vfio:0000:01:00.0 are one function.
        address = _pci_address(rest)
        if address is None:
            raise _UnopenableDevice(
                device,
                "which is not a PCI address as tutti reads one: DOMAIN:BUS:SLOT.FUNCTION (or BUS:SLOT.FUNCTION), hex "
                "digits only, a domain of at most 4, a bus and a slot of at most 2 (the slot at most 1f), a function "
                "of 1 (at most 7), e.g. vfio:0000:01:00.0",
            )
        return "vfio:" + address
    return device


def _remember_cleared_pool(identities: tuple[str, ...], fingerprint: bytes) -> None:
    with _CLEARED_POOLS_LOCK:
        _CLEARED_POOLS.update((identity, fingerprint) for identity in identities)


def _forget_cleared_pools(identities: tuple[str, ...]) -> None:
    """The devices were formatted: no page of a cleared pool is left on them."""
    with _CLEARED_POOLS_LOCK:
        _CLEARED_POOLS.difference_update({entry for entry in _CLEARED_POOLS if entry[0] in identities})


def _claim_devices(owner: object, devices: list[str], identities: tuple[str, ...]) -> None:
    """Records the devices of `identities` (`_claimed_identities`) as open by `owner` (a backend,
    before its pool opens, and again after).
    Raises ConfigError, recording nothing, when another backend of this process that is still
    alive holds one of them (`_OPEN_DEVICES`)."""
    with _OPEN_DEVICES_LOCK:
        holders = [_holder(identity) for identity in identities]
        if all(holder is None or holder is owner for holder in holders):
            for identity in identities:
                _OPEN_DEVICES[identity] = weakref.ref(owner)
            return
    raise ConfigError(
        f"--hicache-storage-backend-extra-config: field 'devices': another tutti backend of this process has "
        f"{', '.join(devices)} open. SGLang builds two storage backends in one scheduler process on a PD decode "
        "server with --disaggregation-decode-enable-offload-kvcache and --enable-hierarchical-cache: its decode KV "
        "offload manager's beside the hierarchical radix cache's, from the one extra config and with the same ranks, "
        "so both get the same devices, and the extra config cannot give them others. tutti does not support the two "
        "together: run the decode server without --enable-hierarchical-cache (the offload manager's backend is then "
        "the only one) or without --disaggregation-decode-enable-offload-kvcache"
    )


def _holder(identity: str) -> Optional[object]:
    """The live backend that recorded the device `identity` open, or None (call under the lock)."""
    reference = _OPEN_DEVICES.get(identity)
    return None if reference is None else reference()


def _release_devices(owner: object) -> None:
    """Forgets the devices `owner` recorded (its pool closed, or did not open), and any whose
    backend is gone."""
    with _OPEN_DEVICES_LOCK:
        for identity in list(_OPEN_DEVICES):
            holder = _holder(identity)
            if holder is None or holder is owner:
                del _OPEN_DEVICES[identity]


def _refuse_cleared_pool(devices: list[str], identities: tuple[str, ...], fingerprint: bytes) -> None:
    """Raises ConfigError when this process cleared a pool on one of these devices under this
    fingerprint: opening it again would serve the pages stored before the clear."""
    with _CLEARED_POOLS_LOCK:
        cleared = [identity for identity in identities if (identity, fingerprint) in _CLEARED_POOLS]
    if cleared:
        raise ConfigError(
            f"this process cleared the tutti pool on {', '.join(devices)} (SGLang's /hicache/storage-backend/clear, "
            "or a PD role switch, which clears the storage tier), and tutti cannot delete a pool's pages: opening it "
            "again under the same model fingerprint would serve the pages stored before the clear (e.g. the old "
            "weights'). Attach with \"format\": true (everything on the pool is lost), other devices, or a new "
            "\"model_fingerprint\" in --hicache-storage-backend-extra-config"
        )


def _replicas() -> tuple[Optional[int], int]:
    """(this process's data-parallel replica, the replica count) from SGLang's runtime context:
    with plain DP (--dp-size N, no DP attention) SGLang 0.5.23 gives every replica's storage
    config dp_rank 0, and states the replica only in get_parallel().dp_rank (numbered by its data
    parallel controller; None without one) and dp_size. (0, 1) when SGLang's config is not
    published here; (None, N) when it runs N replicas and did not state this one's."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        count = int(parallel.dp_size)
    except (ValueError, RuntimeError, AttributeError, TypeError):
        return 0, 1
    if count <= 1:
        return 0, 1
    try:
        rank = parallel.dp_rank
    except (ValueError, RuntimeError, AttributeError):
        rank = None
    return (None if rank is None else int(rank)), count


def _dp_rank(storage: HiCacheStorageConfig) -> int:
    """"{dp_rank}": the DP-attention group (the storage config's dp_rank), or with plain DP the
    replica (DP attention does not run inside replicas: one of the two is always 0)."""
    rank, count = _replicas()
    if count <= 1:
        return int(getattr(storage, "dp_rank", 0))
    if rank is None:
        raise ConfigError(
            f"SGLang runs {count} data-parallel replicas (--dp-size {count}) but did not state this process's "
            "replica rank (get_parallel().dp_rank), so \"{dp_rank}\" in field 'devices' of "
            "--hicache-storage-backend-extra-config cannot tell the replicas' devices apart"
        )
    return rank


# The device-string keys filled in per scheduler process: (key, what the message calls it, this
# process's value, whether processes of this server differ in it). SGLang 0.5.23 sets tp_rank to
# the attention-TP rank under --enable-dp-attention (group-local: dp_rank tells the groups apart);
# with plain DP the replica fills "{dp_rank}" (_dp_rank).
_RANK_KEYS: tuple[tuple[str, str, Callable[[HiCacheStorageConfig], int], Callable[[HiCacheStorageConfig], bool]], ...] = (
    ("tp_rank", "tp_rank", lambda storage: storage.tp_rank, lambda storage: storage.tp_size > 1),
    ("pp_rank", "pp_rank", lambda storage: storage.pp_rank, lambda storage: storage.pp_size > 1),
    ("dp_rank", "dp_rank", _dp_rank, lambda storage: getattr(storage, "dp_rank", 0) > 0 or _replicas()[1] > 1),
    ("cp_rank", "attn_cp_rank", lambda storage: storage.attn_cp_rank, lambda storage: storage.attn_cp_size > 1),
)


def rank_devices(devices: Any, storage: HiCacheStorageConfig) -> list[str]:
    """The device strings of this scheduler process: "{tp_rank}", "{pp_rank}", "{dp_rank}" and
    "{cp_rank}" replaced by its ranks (a key not in any string is not looked up)."""
    listed = [devices] if isinstance(devices, str) else list(devices)
    return _filled(listed, {key: value(storage) for key, _, value, _ in _RANK_KEYS if _in_template(key, listed)})


def _in_template(key: str, listed: list[str]) -> bool:
    return any("{" + key + "}" in device for device in listed)


def _filled(listed: list[str], ranks: dict[str, int]) -> list[str]:
    """The device strings with each "{key}" of `ranks` replaced by its rank."""
    for key, rank in ranks.items():
        listed = [device.replace("{" + key + "}", str(rank)) for device in listed]
    return listed


def _dp_attention(storage: HiCacheStorageConfig) -> Optional[bool]:
    """Whether SGLang runs DP attention: True when the storage config names a DP-attention group
    past 0 (SGLang gives dp_rank 0 without it), else SGLang's published attn_dp_enabled (what
    its is_dp_attention_enabled flag is set from); None when that cannot be read: SGLang's
    context is not published in this process, where get_parallel() raises RuntimeError (its
    is_dp_attention_enabled() would answer False there, taking an unset context for none)."""
    if int(getattr(storage, "dp_rank", 0)) > 0:
        return True
    try:
        from sglang.srt.runtime_context import get_parallel

        return bool(get_parallel().attn_dp_enabled)
    except (ImportError, ValueError, RuntimeError, AttributeError):
        return None


def _server_processes(storage: HiCacheStorageConfig, keys: list[str]) -> list[tuple[int, ...]]:
    """This server's scheduler processes as far as this process can tell, each by its ranks in
    `keys` (each tuple once): every TP rank and pipeline stage; every plain-DP replica, or the
    DP-attention groups up to this process's (group 0 cannot tell that others exist; a clash
    with a later group is refused by that group's process); and the CP ranks. Without DP
    attention a process's CP rank follows from its TP rank: SGLang lays ranks out (dp, cp, tp),
    tp fastest, so attn_cp_rank = (tp_rank // attn_tp_size) % attn_cp_size with attn_tp_size =
    tp_size / attn_cp_size (runtime_context.derive_attention_ranks; the cache controller's
    attn_cp group), and only those (tp, cp) pairs are processes. With DP attention the storage
    config's tp_rank is the attention-TP rank and every (tp, cp) pair is one; so is it where
    SGLang's flag cannot be read, tp_size is no multiple of attn_cp_size (which SGLang
    refuses), or this process's own attn_cp_rank is not the one derived from its tp_rank (the
    layout is not the one assumed): more pairs than the real ones may refuse a template they
    would not clash on, but miss no clash."""
    replicas = _replicas()[1]
    ranks = {
        "tp_rank": range(storage.tp_size),
        "pp_rank": range(storage.pp_size),
        "dp_rank": range(replicas if replicas > 1 else int(getattr(storage, "dp_rank", 0)) + 1),
        "cp_rank": range(storage.attn_cp_size),
    }
    cp_size = storage.attn_cp_size
    derived = (
        "cp_rank" in keys
        and cp_size > 1
        and storage.tp_size % cp_size == 0
        and storage.attn_cp_rank == (storage.tp_rank // (storage.tp_size // cp_size)) % cp_size
        and _dp_attention(storage) is False
    )
    # The keys enumerated: those asked for, and the TP rank a derived CP rank follows from.
    enumerated = [key for key in ranks if (key in keys or (derived and key == "tp_rank")) and not (derived and key == "cp_rank")]
    processes: dict[tuple[int, ...], None] = {}
    for combination in itertools.product(*(ranks[key] for key in enumerated)):
        process = dict(zip(enumerated, combination))
        if derived:
            process["cp_rank"] = (process["tp_rank"] // (storage.tp_size // cp_size)) % cp_size
        processes.setdefault(tuple(process[key] for key in keys), None)
    return list(processes)


def check_rank_devices(devices: Any, storage: HiCacheStorageConfig) -> None:
    """Raises ConfigError when another scheduler process of this server (another TP rank,
    pipeline stage, DP-attention group, DP replica or CP rank) would get the same device strings:
    its open of the same devices would fail, and SGLang would not start. Memory and no-storage
    devices (emu:mem:, emu:null:) are never shared, so they need no key."""
    listed = [devices] if isinstance(devices, str) else list(devices)
    # A memory device is each process's own (nothing of it is shared): it needs no key.
    stored = [device for device in listed if not _keeps_nothing(device)]
    for key, name, value, differs in _RANK_KEYS:
        if differs(storage) and not all("{" + key + "}" in device for device in stored):
            raise ConfigError(
                f"--hicache-storage-backend-extra-config: field 'devices' = {devices!r} gives every scheduler process "
                f"of this server the same device for each {name} (tp_size {storage.tp_size}, pp_size {storage.pp_size}, "
                f"attn_cp_size {storage.attn_cp_size}, DP-attention group {getattr(storage, 'dp_rank', 0)}, "
                f"dp_size {_replicas()[1]}); "
                f"put \"{{{key}}}\" in every device string, e.g. \"emu:/var/tutti/pp{{pp_rank}}-tp{{tp_rank}}.img\""
            )
    _check_distinct_devices(devices, listed, storage)
    rank_devices(devices, storage)  # a replica whose rank SGLang did not state is refused here


def _check_distinct_devices(devices: Any, listed: list[str], storage: HiCacheStorageConfig) -> None:
    """Raises ConfigError when the template, filled in for every scheduler process of this
    server (`_server_processes`), gives two of them one device, though each has every key it needs:
    keys side by side with no separator ("{pp_rank}{tp_rank}": pp 1 tp 11 and pp 11 tp 1 both
    read "111"), a PCI domain whose leading zeros do not count ("0010" and "010"), a key in a
    path component that names nothing ("{tp_rank}/../pool.img"). Devices are compared by the
    storage behind them (`_device_identity`), as the cleared-pool record compares them; memory
    devices keep nothing and are never shared. A device tutti would refuse to open (a vfio:
    address that is not a PCI address, such as a 3-digit bus: `_pci_address`) is refused
    naming the process that gets it."""
    names = {key: name for key, name, _, _ in _RANK_KEYS}
    present = [key for key in names if _in_template(key, listed)]
    # The first process (its ranks) and spelling each device was given.
    given: dict[str, tuple[tuple[int, ...], str]] = {}
    for combination in _server_processes(storage, present):
        for device in dict.fromkeys(_filled(listed, dict(zip(present, combination)))):
            try:
                identity = _device_identity(device)
            except _UnopenableDevice as unopenable:
                process = _process_name(names, present, combination)
                raise ConfigError(
                    f"--hicache-storage-backend-extra-config: field 'devices' = {devices!r}: {process} gets {device!r}, "
                    f"{unopenable.clause}"
                ) from None
            if identity is None:
                continue
            first, spelling = given.setdefault(identity, (combination, device))
            if first == combination:
                continue
            who = [_process_name(names, present, ranks) for ranks in (first, combination)]
            clash = (
                f"{who[0]} and {who[1]} both get {device!r}"
                if spelling == device
                else f"{who[0]} gets {spelling!r} and {who[1]} gets {device!r}, the same storage"
            )
            raise ConfigError(
                f"--hicache-storage-backend-extra-config: field 'devices' = {devices!r} gives two scheduler processes "
                f"one device: {clash}; give every process's devices distinct names, e.g. with a separator between "
                f"keys: \"emu:/var/tutti/pp{{pp_rank}}-tp{{tp_rank}}.img\""
            )


def _process_name(names: dict[str, str], keys: Any, ranks: tuple[int, ...]) -> str:
    """A scheduler process named by its ranks in the template's keys ("tp_rank 1, pp_rank 0")."""
    return ", ".join(f"{names[key]} {rank}" for key, rank in zip(keys, ranks)) or "this scheduler process"


def _shard_parts(storage: HiCacheStorageConfig, host_pool: Any) -> tuple[Any, ...]:
    """What sets this process's share of a page apart when the model is split across pipeline
    stages (other layers: the stage and its first layer) or context-parallel ranks (another
    slice of each page); empty when it is not (the fingerprint of an unsplit model is
    unchanged)."""
    if storage.pp_size <= 1 and storage.attn_cp_size <= 1:
        return ()
    return (
        "sglang shard",
        f"pp {storage.pp_rank}/{storage.pp_size}",
        f"layers from {getattr(host_pool, 'start_layer', 0)}",
        f"cp {storage.attn_cp_rank}/{storage.attn_cp_size}",
    )


# Server args beside the checkpoint's path that change the weights a page's KV was computed
# with (SGLang 0.5.23's model namespace): random weights (--load-format dummy, for benchmarks,
# whose startup key space is private to the backend besides: _unnamed_startup_weights; the
# other formats read the same checkpoint), ModelOpt quantization at load (--modelopt-quant, or a
# ModelOpt checkpoint restored in its stead, --quantize-and-serve) and FlashRL's quantization
# profile (--rl-quant-profile). Read with a default: a release without one of them names it None.
# The weight version (--weight-version) is named too (_checkpoint_parts): SGLang treats a new one
# as new weights when it changes live, so a restart under another one gets another key space.
_WEIGHT_ARGS = ("load_format", "modelopt_quant", "modelopt_checkpoint_restore_path", "quantize_and_serve", "rl_quant_profile")


def _checkpoint_parts() -> Optional[tuple[str, ...]]:
    """What names the weights whose KV the pool holds, for the default fingerprint: the
    storage config's model_name is --served-model-name in SGLang 0.5.23 (an alias; the model
    path only when none is given), so from SGLang's runtime context: the model path and
    revision, the quantization, the JSON overrides of the model config, how the weights are
    loaded and quantized at load (`_WEIGHT_ARGS`), the weight version the server started with
    (--weight-version; the weights after an in-place update get key spaces of their own,
    _WeightEpochs), and the speculative draft model's path,
    revision, quantization and load format. None when SGLang's config is not published in this
    process (or names no model path): the checkpoint cannot be named."""
    from sglang.srt.runtime_context import get_context, get_model, get_spec

    try:
        model = get_model()
        spec = get_spec()
        # The version the server started with (its resolved server args): get_serving() gives
        # the one a live update named since.
        startup_version = get_context().server_args.resolved_dict().get("weight_version")
        parts = (
            "model_path", model.model_path,
            "revision", model.revision,
            "quantization", model.quantization,
            "json_model_override_args", model.json_model_override_args,
            *(part for name in _WEIGHT_ARGS for part in (name, getattr(model, name, None))),
            "weight_version", startup_version,
            "draft model_path", spec.speculative_draft_model_path,
            "draft revision", spec.speculative_draft_model_revision,
            "draft quantization", spec.speculative_draft_model_quantization,
            "draft load_format", getattr(spec, "speculative_draft_load_format", None),
        )  # fmt: skip
    except (ValueError, RuntimeError, AttributeError):
        return None
    if not model.model_path:
        return None
    return tuple(str(part) for part in parts)


# Load formats whose weights nothing in the server args names (SGLang 0.5.23): "dummy" starts on
# random weights, which RL frameworks and checkpoint engines replace through
# update_weights_from_tensor / _distributed / _ipc, naming no weight_version (SGLang records
# nothing for those: _WEIGHT_CHANGE_SOURCE); "remote_instance" copies the weights of a live seed
# instance (--remote-instance-weight-loader-seed-instance-ip), whatever that instance serves now
# (it may have been updated in place).
_UNNAMED_LOAD_FORMATS = ("dummy", "remote_instance")


def _unnamed_startup_weights() -> Optional[str]:
    """Why nothing in SGLang's server args names the weights this server will serve from its
    start, for the default fingerprint (None when they are named, or SGLang's config cannot be
    read here: `_checkpoint_parts` refuses that case): the target's or the draft's load format is
    one of `_UNNAMED_LOAD_FORMATS`, or --checkpoint-engine-wait-weights-before-ready (the server
    waits for its real weights, which arrive by an update naming no version). Pages of such
    weights must not be found by a restart, whose weights may be others under the same
    fingerprint."""
    from sglang.srt.runtime_context import get_model, get_spec

    try:
        model = get_model()
        load_format = getattr(model, "load_format", None)
        waits = bool(getattr(model, "checkpoint_engine_wait_weights_before_ready", False))
        draft_load_format = getattr(get_spec(), "speculative_draft_load_format", None)
    except (ValueError, RuntimeError, AttributeError):
        return None
    reasons = []
    if waits:
        reasons.append("--checkpoint-engine-wait-weights-before-ready (the weights arrive after the start, by an update naming no version)")
    if load_format in _UNNAMED_LOAD_FORMATS:
        reasons.append(f"--load-format {load_format}")
    if draft_load_format in _UNNAMED_LOAD_FORMATS:
        reasons.append(f"--speculative-draft-load-format {draft_load_format}")
    return ", ".join(reasons) or None


# What SGLang 0.5.23 records in the scheduler process's overrides log when the served weights
# change (get_context().override, one entry each): Scheduler.record_weight_version_change (every
# in-place update that names a new weight_version, and /update_weight_version) overrides
# weight_version; ModelRunner.update_model_fields (every successful update_weights_from_disk of
# the target model, named version or not, the same path too) overrides model_path and
# load_format under its own source. Updates from tensors, a process group or IPC that name no new
# version record nothing.
_WEIGHT_CHANGE_SOURCE = "model_runner.update_model_fields"
_WEIGHT_CHANGE_FIELDS = ("weight_version", "model_path", "load_format")


def _weight_change(entry: Any) -> Optional[str]:
    """The weight change an overrides-log entry records, as its source and fields (None when it
    records none). An entry that cannot be read is taken for a change: a change missed would
    serve the old weights' pages, one too many only starts a key space."""
    try:
        source, fields = entry
        if source == _WEIGHT_CHANGE_SOURCE or any(name in fields for name in _WEIGHT_CHANGE_FIELDS):
            return f"{source}: {sorted(fields.items())}"
        return None
    except (ValueError, TypeError, AttributeError):
        return f"an entry not (source, fields): {entry!r}"


class _LogUnreadable(Exception):
    """SGLang's overrides log cannot be read in this process (the message says why)."""


def _overrides_log() -> tuple[list, bool]:
    """SGLang's overrides log in this process: (the runtime context's own list, True), which the
    caller reads only the new entries of (get_context().overrides_log() copies every entry, and
    the log grows for the life of the process: adaptive speculative decoding adds one at every
    step switch); (that copy, False) when the list itself cannot be read (a release that keeps it
    elsewhere). Raises _LogUnreadable when neither can (never in SGLang 0.5.23: its
    get_context() returns the process's one context, published or not, whose _overrides_log
    slot is a list from its construction on)."""
    try:
        from sglang.srt.runtime_context import get_context

        context = get_context()
        log = getattr(context, "_overrides_log", None)
        if isinstance(log, list):
            return log, True
        copy = context.overrides_log()
        if not isinstance(copy, list):
            raise TypeError(f"get_context().overrides_log() returned {type(copy).__name__}, not a list")
        return copy, False
    except (ImportError, ValueError, RuntimeError, AttributeError, TypeError) as error:
        raise _LogUnreadable(f"{type(error).__name__}: {error}") from error


# What _WeightEpochs records as its log when the last read failed: no list SGLang holds is it.
_LOG_LOST = object()


def _weight_changes(entries: list) -> tuple[str, ...]:
    """The weight changes among overrides-log `entries`, in order (`_weight_change`)."""
    return tuple(change for change in map(_weight_change, entries) if change is not None)


class _WeightEpochs:
    """A backend's weight epochs: epoch n is the weights served after the n-th weight change
    SGLang recorded in this process (0: the weights it started with; an update from disk that
    names a version records two changes, which costs nothing). Changes are counted,
    not versions compared: A -> B -> A is two changes, and the second A may be other weights.
    Each epoch is a key space of its own (`salt`): epoch 0 names pages as the model fingerprint
    alone does (pages a restart on the same checkpoint and --weight-version may share), a later
    one adds this backend's random nonce and the epoch (pages only this backend can find: the
    weights of an in-place update are named by nothing that outlives the process), so a change
    makes the older epochs' pages miss (they age out by LRU) without retiring the pool. With
    `private_startup` (the startup weights are named by nothing either: `_unnamed_startup_weights`)
    epoch 0 is salted the same way, so no restart finds its pages.

    The log is the only way a change is seen, so a log that cannot be read fails safe: at
    construction it is a ConfigError (the backend would be blind to every update, and serve the
    old weights' pages after one); later, each read that fails counts as one more change (one
    may have happened unseen), so nothing stored before is found and no backup is stored while
    it stays unreadable, and the first read that succeeds after counts as one more (the log is
    taken as another list). Logged once when it becomes unreadable and once when it reads again
    (`for_backup` tells those epochs, which are no change SGLang recorded, from the others).

    A page backed up in epoch n must be KV of epoch n's weights, and SGLang does not say when a
    host page was computed: a backup operation queued before the change may run after it (the
    storage threads run their queues until SGLang's cache flush joins them, and an update may
    not flush at all). SGLang's flush (Scheduler.flush_cache -> UnifiedRadixCache._reset_full:
    cache_controller.reset() joins the storage threads and empties every queue, then
    mem_pool_host.clear()) comes after the change is recorded, on the same scheduler thread, and
    leaves no page and no queued operation of older weights. So `flushed` (called from the host
    pool's clear, `_watch_host_pool_clears`) notes the epoch that clear happened in, and
    `for_backup` allows backups only in an epoch a clear happened in; reads use the current epoch
    at once. A backend registered after a change (a re-attach) starts in that epoch unflushed:
    its host pool may hold older KV.

    The log restarts only when SGLang publishes its config again (at process start in 0.5.23):
    the context then holds another list. The log grows for the life of the process (adaptive
    speculative decoding adds an entry at every step switch; attach, detach and
    /update_server_args too), so each read scans only the entries added to the same list since
    the last (`_overrides_log`); another list, or a shorter one, counts as one more change (a new
    key space, whose backups wait for a flush). Where only a copy of the log can be read, the
    changes in it are compared with those seen (a whole copy at every read). Thread-safe:
    SGLang's prefetch and backup threads and its scheduler thread (the clear) use it at once."""

    def __init__(self, private_startup: bool = False) -> None:
        self._lock = threading.Lock()
        self._nonce = os.urandom(16)
        self._private_startup = private_startup
        # The context's own log and how many of its entries were scanned (None: not read yet,
        # or only a copy could be read; _LOG_LOST: the last read failed); the changes seen in a copy.
        self._log: Any = None
        self._scanned = 0
        self._seen: tuple[str, ...] = ()
        self._epoch = 0
        # The epochs of the last spell the log could not be read: its first, through the one the
        # first read after it began (None: still unreadable); (1, 0), no epoch, before any spell.
        self._unseen: tuple[int, Optional[int]] = (1, 0)
        try:
            self._read_log(first=True)
        except _LogUnreadable as error:
            raise ConfigError(
                f"SGLang's overrides log (get_context()._overrides_log, or get_context().overrides_log()) cannot be "
                f"read in this process ({error}), and it is how tutti sees an in-place weight update "
                "(update_weights_from_disk, a new weight_version): after one the old weights' pages would be served "
                "(an explicit \"model_fingerprint\" does not change that). Run the SGLang release tutti is tested "
                "with (SGLang 0.5.23), or run this server without --hicache-storage-backend"
            ) from None
        # The epoch SGLang's last host pool clear happened in (-1: none since a change).
        self._flushed = 0 if self._epoch == 0 else -1

    def _read_log(self, first: bool = False) -> None:
        """Counts the changes SGLang recorded since the last read (under the lock, or at init).
        Raises _LogUnreadable only at init (`first`): later, a log that cannot be read counts as
        a change."""
        try:
            log, own = _overrides_log()
        except _LogUnreadable as error:
            if first:
                raise
            if self._log is not _LOG_LOST:
                # Once per spell: every call of it is one more epoch, and SGLang's backup thread
                # calls at each backup operation.
                logger.warning(
                    "tutti: SGLang's overrides log, read when the host pool was registered, cannot be read now (%s): "
                    "a weight update may go unseen, so every storage call counts as one (nothing stored before is "
                    "served, nothing is backed up) until it reads again and SGLang then flushes its cache",
                    error,
                )
                self._unseen = (self._epoch + 1, None)
            # One more change, and the next read that succeeds is another list: one more again.
            self._epoch += 1
            self._log, self._seen = _LOG_LOST, ()
            return
        lost = self._log is _LOG_LOST
        self._count(log, own, first)
        if lost:
            self._unseen = (self._unseen[0], self._epoch)
            logger.warning(
                "tutti: SGLang's overrides log reads again: taken as one more weight change (one may have gone unseen "
                "while it could not be read), so pages stored before are not served, and backups resume at SGLang's "
                "next cache flush (an update with flush_cache, the default, or /flush_cache)"
            )

    def _count(self, log: list, own: bool, first: bool) -> None:
        """Counts the changes in `log` (`_overrides_log`'s answer) not counted before."""
        if own:
            if log is self._log and len(log) >= self._scanned:
                # A slice is taken under the GIL: entries appended meanwhile wait for the next read.
                entries = log[self._scanned :]
                self._epoch += len(_weight_changes(entries))
                self._scanned += len(entries)
                return
            # Another list (SGLang published its config again) or a shorter one: whatever it
            # holds, the weights may be others (at init: every change in it).
            entries = log[:]
            self._epoch += len(_weight_changes(entries)) if first else 1
            self._log, self._scanned = log, len(entries)
            return
        changes = _weight_changes(log)
        if first:
            self._epoch = len(changes)
        elif self._log is not None or changes[: len(self._seen)] != self._seen:
            self._epoch += 1  # another log, or a copy of the list read before
        else:
            self._epoch += len(changes) - len(self._seen)
        self._log, self._seen = None, changes

    def current(self) -> int:
        """The epoch now (the log read again; one more than the last when it cannot be read)."""
        with self._lock:
            # Read under the lock: the log only grows between publishes, so each read extends
            # the one before (no thread's older read can undo a newer one).
            self._read_log()
            return self._epoch

    def for_backup(self) -> tuple[int, bool, bool]:
        """(the epoch now; whether a backup in it holds its KV, SGLang having flushed since it
        began; whether it began because the log could not be read, while it could not or at the
        first read after, not at a change SGLang recorded: `_read_log` warned of it), in one hold
        of the lock. Apart, another thread's read between them that meets the log unreadable
        again starts the next spell (only the last is kept), and the epoch read first (the first
        good read after a spell) would no longer be one the log's being unreadable began: a
        backup would warn of a weight change SGLang never recorded."""
        with self._lock:
            self._read_log()
            epoch = self._epoch
            first, last = self._unseen
            return epoch, self._flushed >= epoch, first <= epoch and (last is None or epoch <= last)

    def salt(self, epoch: int) -> bytes:
        """What goes before a page's key in `epoch`'s key space (nothing in epoch 0, unless the
        startup weights are private to this backend)."""
        if epoch == 0 and not self._private_startup:
            return b""
        return b"tutti sglang weight epoch\0" + self._nonce + epoch.to_bytes(8, "little") + b"\0"

    def flushed(self) -> None:
        """SGLang cleared the host pool (its cache flush): backups of the epoch now are its KV."""
        epoch = self.current()
        with self._lock:
            self._flushed = max(self._flushed, epoch)


# The host pools whose clear is watched: pool -> the weight epochs told of each clear.
_CLEAR_WATCHERS: "weakref.WeakKeyDictionary[Any, weakref.WeakSet[_WeightEpochs]]" = weakref.WeakKeyDictionary()
_CLEAR_WATCHERS_LOCK = threading.Lock()
# Registered once the locks it replaces exist.
os.register_at_fork(after_in_child=_in_forked_child)


def _watch_host_pool_clears(host_pool: Any, epochs: _WeightEpochs) -> bool:
    """Has `epochs.flushed()` called after every clear() of SGLang's host pool (its cache flush,
    see _WeightEpochs): the pool's clear is wrapped once (an attribute of this instance, which
    UnifiedRadixCache and HostPoolGroup call), and every backend registered on the pool is told.
    False when the pool's clear cannot be wrapped (backups then stay refused after a change)."""
    with _CLEAR_WATCHERS_LOCK:
        try:
            watchers = _CLEAR_WATCHERS.get(host_pool)
        except TypeError:  # not weakly referable
            return False
        if watchers is None:
            original = host_pool.clear
            pool_ref = weakref.ref(host_pool)

            def clear(*args: Any, **kwargs: Any) -> Any:
                result = original(*args, **kwargs)
                pool = pool_ref()
                with _CLEAR_WATCHERS_LOCK:
                    told = list(_CLEAR_WATCHERS.get(pool, ())) if pool is not None else []
                for watcher in told:
                    watcher.flushed()
                return result

            try:
                host_pool.clear = clear
            except (AttributeError, TypeError):
                return False
            watchers = weakref.WeakSet()
            _CLEAR_WATCHERS[host_pool] = watchers
        watchers.add(epochs)
        return True


def _page_layout_parts(host_pool: Any, kv_format: Optional[tuple[str, ...]]) -> tuple[Any, ...]:
    """How the bytes of this host pool's pages are laid out, added to every fingerprint (an
    explicit one too): the pool's class, layout (--hicache-mem-layout, as SGLang resolved it),
    layers, heads, head dimension, dtype and page size, and for an integer pool its KV format
    (`_kv_format_parts`) when it can be read."""
    return (
        "sglang page layout",
        type(host_pool).__name__,
        host_pool.layout,
        host_pool.layer_num,
        host_pool.head_num,
        host_pool.head_dim,
        str(host_pool.dtype),
        host_pool.page_size,
        *(kv_format or ()),
    )


def _kv_format_parts(host_pool: Any) -> Optional[tuple[str, ...]]:
    """What tells this host pool's KV format apart beyond its dtype, for the fingerprint's page layout:
    empty for a floating-point pool (its dtype is the KV format). SGLang 0.5.23 stores every fp8
    --kv-cache-dtype as torch.uint8 (memory_pool.py: store_dtype; the host pool takes it), so for
    an integer pool: SGLang's kv_cache_dtype and speculative_draft_kv_cache_dtype (the packed
    draft layers' format), the platform (on ROCm fp8 strings resolve to the platform's fp8
    type; "auto" resolves from the model's quant config, which the checkpoint (_checkpoint_parts) covers)
    and the KV scale file (--quantization-param-path: without one the scales are 1.0, so the same
    bytes mean other values). None when SGLang's config is not published in this process (it
    cannot be read)."""
    if host_pool.dtype.is_floating_point:
        return ()
    from sglang.srt.runtime_context import get_model, get_spec

    try:
        model = get_model()
        kv_cache_dtype = model.kv_cache_dtype
        draft_kv_cache_dtype = get_spec().speculative_draft_kv_cache_dtype
    except (ValueError, RuntimeError, AttributeError):
        return None
    scales = getattr(model, "quantization_param_path", None)
    platform = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return (
        "kv_cache_dtype", str(kv_cache_dtype), "draft kv_cache_dtype", str(draft_kv_cache_dtype), platform,
        "quantization_param_path", str(scales),
    )  # fmt: skip


__all__ = ["check_rank_devices", "rank_devices"]
