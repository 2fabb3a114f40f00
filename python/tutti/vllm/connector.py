"""`TuttiConnector`: a vLLM `KVConnectorBase_V1` over tuttid (docs/vllm.md).

Loaded by vLLM with
    --kv-transfer-config '{"kv_connector": "TuttiConnector", "kv_connector_module_path": "tutti.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"socket": "/run/tutti/tuttid.sock"}}'
(kv_load_failure_policy "recompute" is required: a failed load is recomputed, not an error).

vLLM builds one connector in the scheduler process (role SCHEDULER) and one per worker (role
WORKER, one per tensor-parallel rank), each in its own process:
- the scheduler side asks tuttid through a lookup-only session which prefix of a prompt is cached
  on every rank (`lookup_all_ranks`), remembers the blocks vLLM allocated for it, and tells the
  workers in the step's metadata what to load and what to save;
- each worker attaches to tuttid with its own key space (model fingerprint, TP rank and world) and
  moves its own KV layer by layer, `layers_in_flight` layers of a load or save in flight at once
  (2 by default): a load's layer l+N is issued when layer l is waited for (`wait_for_layer_load`,
  before layer l's attention), a save's layer l when vLLM hands it over (`save_kv_layer`, after
  layer l's attention; it first waits for layer l-N); `wait_for_save` hands each save's last
  layers to a committer thread, so a step never waits for a flush: the save is reported done through
  `get_finished` and vLLM keeps the request's blocks until then (`request_finished` returns True).
  A step's saves are prepared when vLLM binds its metadata (`bind_connector_metadata`) if it has
  no loads (vLLM then calls `start_load_kv` only after the forward), and after its loads, in
  `start_load_kv` (before the forward), if it has: saves refused for want of request places are
  misses, a load refused would be recomputed.

Memory a device may still write is never handed back to vLLM: a load whose layer cannot be
settled ends the worker's tuttid session (tuttid deletes its queue pairs) before its blocks are
reported, and the worker raises if tuttid cannot confirm that.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

from tutti._engine import (
    Field,
    bounded_timeout,
    fingerprint_from_config,
    iocbs_for,
    layers_in_flight_field,
    non_empty,
    parse_config,
    queue_depth_field,
    requests_in_range,
)
from tutti.vllm._scheduler import SchedulerSide
from tutti.vllm._worker import KvMemoryUnsafe, WorkerSide
from tutti.vllm.metadata import LoadSpec, SaveSpec, TuttiConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["EXTRA_CONFIG_FIELDS", "KvMemoryUnsafe", "LoadSpec", "SaveSpec", "TuttiConnector", "TuttiConnectorMetadata"]

EXTRA_CONFIG_FIELDS = {
    "socket": Field(str, "the path of tuttid's Unix socket, e.g. /run/tutti/tuttid.sock", required=True, check=non_empty),
    "model_fingerprint": Field(
        str, "64 hex digits naming the model and its weights (the KV layout is hashed with it); default: derived from vLLM's model config", check=non_empty
    ),
    "timeout_s": Field(float, "the longest wait for tuttid and for one layer's I/O, seconds", default=30.0, check=bounded_timeout),
    "lookup_timeout_s": Field(
        float, "the longest wait for one lookup by the scheduler (a late answer is a miss), seconds", default=1.0, check=bounded_timeout
    ),
    "requests_max": Field(int, "requests a worker prepares at once", default=32, check=requests_in_range),
    "verify_retrieves": Field(
        bool,
        "check every block a worker loads against the CRC recorded when it was stored (a block that differs is "
        "recomputed); CPU KV only: tuttid refuses it for device memory",
        default=False,
    ),
    "layers_in_flight": layers_in_flight_field("load or save"),
    "queue_depth": queue_depth_field(),
}

# vLLM's identity layout, what allocate_kv_caches views when vLLM has not resolved one.
_DEFAULT_KV_LAYOUT = "LBHNC"


class TuttiConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1):
    """vLLM's KV connector over tuttid. See the module documentation and docs/vllm.md. The
    scheduler side's methods are `SchedulerSide`'s (tutti/vllm/_scheduler.py), the workers'
    `WorkerSide`'s (tutti/vllm/_worker.py); what both roles answer is here."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from tutti.vllm import check_vllm_version

        check_vllm_version()
        self._config = parse_config(
            "kv_connector_extra_config", self._kv_transfer_config.kv_connector_extra_config, EXTRA_CONFIG_FIELDS
        )
        _refuse_failing_loads(self._kv_transfer_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        parallel = vllm_config.parallel_config
        _refuse_unsupported_parallelism(parallel)
        _refuse_kv_cache_groups_freed_early(kv_cache_config)
        self._tp_world = int(parallel.tensor_parallel_size)
        self._kv_layout = _resolved_kv_layout(vllm_config, kv_cache_config)
        explicit = self._config["model_fingerprint"]
        # An explicit fingerprint stands for the model (nothing of it is read), not for how this
        # deployment lays its KV out: the layout parts are hashed with it, so that a restart on
        # another attention backend (LBHNC and LBNHC blocks are the same size) cannot read the
        # other order's blocks.
        # A missing fingerprint over streamed weights is warned of once for the deployment: by the
        # scheduler's connector, not by each worker's (one per TP rank).
        identity = _model_identity(
            vllm_config,
            kv_cache_config,
            self._kv_layout,
            with_model=explicit is None,
            fingerprint_setting="kv_connector_extra_config" if role == KVConnectorRole.SCHEDULER else None,
        )
        if explicit is None:
            self._fingerprint = fingerprint_from_config(None, *identity)
        else:
            self._fingerprint = fingerprint_from_config(None, fingerprint_from_config(explicit), *identity)
        # What the fingerprint was computed from, for the message of a scheduler and a worker
        # that disagree (TuttiConnectorMetadata.model_identity).
        self._fingerprint_inputs = json.dumps(identity, default=str, separators=(",", ":"))
        if explicit is not None:
            self._fingerprint_inputs = f"the explicit model_fingerprint of kv_connector_extra_config and {self._fingerprint_inputs}"

        self._timeout_s = float(self._config["timeout_s"])
        # Checked in both roles, so that a bad pair is refused where vLLM builds the connector.
        self._iocbs = iocbs_for(
            "kv_connector_extra_config",
            self._config["requests_max"],
            self._config["layers_in_flight"],
            _blocks_per_request_max(vllm_config, self._block_size),
        )
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            _refuse_full_cuda_graphs(vllm_config)
            self._init_worker(vllm_config)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: tutti is a best-effort cache (a save that does not happen is a future miss), so
        vLLM need not drop a preempted request's output to protect a hand-off (vLLM's base class
        answers True for kv_both; its offloading connectors answer False, as here)."""
        return False

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Takes the step's metadata and, in a step without loads, prepares its saves: vLLM calls
        save_kv_layer during the forward, while start_load_kv comes after the forward in a step
        without synchronous loads (vLLM 0.32's SchedulerOutput.has_sync_kv_loads). A step with
        loads prepares its saves after them, in start_load_kv (before the forward)."""
        super().bind_connector_metadata(connector_metadata)
        if self._role != KVConnectorRole.SCHEDULER:
            self._bind_worker_metadata(connector_metadata)

    def shutdown(self) -> None:
        """Stops the committer (after the saves it holds), then closes the store or the lookup
        session."""
        if self._role == KVConnectorRole.SCHEDULER:
            self._drop_lookup()
        else:
            self._shutdown_worker()

    def reset_cache(self) -> bool:
        """False: tutti cannot forget the blocks its pool holds (vLLM treats anything but False as
        a cleared cache). vLLM 0.32's engine core then raises RuntimeError("Failed to reset the
        KV connector cache.") from the calls that clear its caches: pause_scheduler with
        clear_cache=True (its default), sleep at level 1 or more, release_kv_cache_memory
        (docs/vllm.md). After a weight update use a new pool or another model_fingerprint, or the
        pool serves KV computed with the old weights."""
        logging.getLogger("tutti.vllm").warning(
            "tutti: reset_cache: tuttid's pool keeps its blocks (tutti cannot forget them); after a weight update "
            "use a new pool or another model_fingerprint"
        )
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: wait_for_layer_load and save_kv_layer run between layers, which a full CUDA graph
        would skip on replay. vLLM can undo the PIECEWISE it sets for this (fuse_attn_quant), so
        each worker checks its final config too (`_refuse_full_cuda_graphs`)."""
        return True


def _blocks_per_request_max(vllm_config: "VllmConfig", block_size: int) -> Optional[int]:
    """vLLM's longest request in blocks (max_model_len), when its model config says."""
    model = getattr(vllm_config, "model_config", None)
    max_model_len = getattr(model, "max_model_len", None)
    if not isinstance(max_model_len, int) or max_model_len <= 0:
        return None
    return -(-max_model_len // block_size)


# The RoPE fields of a checkpoint's config that change its KV for the same weights and tokens
# (rotary_emb_base: the older name of rope_theta, which vLLM reads as such).
_HF_KV_FIELDS = ("rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor", "rotary_emb_base")
# How deep the checkpoint's config is searched for them (a text config inside a multimodal one).
_CONFIG_DEPTH_MAX = 8
# The Hugging Face config file vLLM's HF config parser reads.
_HF_CONFIG_NAME = "config.json"
# The waits before each new try of a config.json read that failed (1 s in all at most: vLLM
# builds the connector at start-up).
_CONFIG_READ_RETRIES_S = (0.1, 0.3)
# RoPE fields of a dict vLLM holds as its config's RoPE parameters that model code rewrites in
# place at load_model (vLLM 0.32), left out of hf_overrides' RoPE dicts: GLM-4/4.5 setdefault
# partial_rotary_factor 0.5; DeepSeek-V2/V3 turn any rope_type but "default" ("linear", "yarn",
# "dynamic", ...) into "deepseek_yarn" or "deepseek_llama_scaling", so the worker's value does not
# say what the override gave (the override's other parameters, e.g. factor, stay hashed). Falcon-H1,
# Bailing, GPT-J, MiniMax-M2 write rotary_dim / head_dim (named by the checkpoint's config.json).
_REWRITTEN_ROPE_FIELDS = ("partial_rotary_factor", "rope_type")


# The files of a local model directory that hold its weights (or say which files do).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


# An index JSON (which weights file holds each tensor) is named by its contents up to this size,
# by its size and time beyond (never seen: a few hundred KiB for thousands of tensors).
_INDEX_HASHED_BYTES_MAX = 16 << 20


def _is_hf_blob(path: str) -> bool:
    """Whether `path` (a link's own target, or a resolved path) is a Hugging Face cache blob:
    named by its content's hash (40 hex digits: git's SHA-1; 64: SHA-256 of an LFS file) in a
    directory named blobs."""
    import os
    import string

    name = os.path.basename(path)
    return (
        os.path.basename(os.path.dirname(path)) == "blobs"
        and len(name) in (40, 64)
        and all(char in string.hexdigits for char in name)
    )


def _local_weights_identity(model_path: Any) -> Optional[str]:
    """For a model served from a local directory: its weight files (top level: *.safetensors,
    *.bin, *.pt, *.pth, *.gguf and the *.index.json naming them), as canonical JSON; None for a
    model that is not a local directory (a Hugging Face model id: its pinned revision names its
    weights). Each file is named by
    - an *.index.json: its contents' SHA-256 (what it says, not when it was written);
    - a symbolic link to a Hugging Face blob (a file named by 40 or 64 hex digits, its content's
      hash, in a directory named blobs: `_is_hf_blob`): the blob's name and size, not its time,
      which is when this node downloaded it. The link's own target decides first (os.readlink:
      ../../blobs/<hash> as Hugging Face writes it, or an absolute path into a directory named
      blobs), so a cache whose blobs directory is itself a link to a directory of another name
      still names blobs, and such a link is never resolved (realpath: an lstat per path
      component, each a round trip on NFS); any other link is resolved fully and its target
      checked again (a chain of links ending at a blob);
    - any other symbolic link (weights linked into a checkpoint folder, re-pointed to another
      step of the same sizes): its resolved target's file name, size and modification time;
    - any other file: name, size and modification time (ns): one stat, no read of the weights.
    A fine-tune saved over the same directory, config.json unchanged, gets another key space. So
    does a plain directory materialised again without its times (a copy without cp -p or
    rsync -t, an unpacked archive, another node's download into a plain directory): every
    process and every node must see the same files with the same times, or set
    model_fingerprint."""
    import hashlib
    import os

    if not isinstance(model_path, str) or not os.path.isdir(model_path):
        return None
    files = []
    try:
        with os.scandir(model_path) as entries:
            for entry in entries:
                if not (entry.name.endswith(_WEIGHT_SUFFIXES) and entry.is_file()):
                    continue
                stat = entry.stat()
                if entry.name.endswith(".index.json") and stat.st_size <= _INDEX_HASHED_BYTES_MAX:
                    with open(entry.path, "rb") as index:
                        digest = hashlib.sha256(index.read(_INDEX_HASHED_BYTES_MAX + 1)).hexdigest()
                    files.append([entry.name, "sha256", digest])
                elif entry.is_symlink():
                    target = os.readlink(entry.path)
                    if not _is_hf_blob(target):
                        target = os.path.realpath(entry.path)
                    if _is_hf_blob(target):
                        files.append([entry.name, "link", os.path.basename(target), stat.st_size])
                    else:
                        # `stat` followed the links: the resolved target's size and time.
                        files.append([entry.name, "link", os.path.basename(target), stat.st_size, stat.st_mtime_ns])
                else:
                    files.append([entry.name, stat.st_size, stat.st_mtime_ns])
    except OSError as error:
        logging.getLogger("tutti.vllm").warning(
            "tutti: cannot list the weight files of %s (%s): the default model fingerprint does not name them", model_path, error
        )
        return None
    return json.dumps(sorted(files, key=lambda file: file[0]), separators=(",", ":"))


def _hf_config_identity(model: Any) -> str:
    """The RoPE parameters of the model's checkpoint config and vLLM's hf_overrides, as
    canonical JSON: the same in every process, role and run (keys sorted, no object ids; a
    callable hf_overrides by its module and name).

    Not vLLM's hf_config / hf_text_config: model code rewrites them in place when the worker
    loads the model (DeepSeek-V2/V3 rope_type "yarn" -> "deepseek_yarn", GLM-4 and GLM-4.5
    partial_rotary_factor, Falcon-H1, Bailing), and vLLM 0.32's worker builds its connector
    after load_model, while the scheduler's process (multiprocess executor, TP >= 2) never loads
    the model: the two roles would hash different values and never find each other's blocks.
    vLLM derives the RoPE parameters from the checkpoint's config.json, read here fresh from the
    model's directory or the Hugging Face cache (never downloaded), which no model code
    changes, and from hf_overrides. A dict hf_overrides gives for a RoPE field is the config's
    own object in vLLM (rewritten with it), so the fields model code rewrites are left out of it
    (`_rope_rewrites_undone`): two overrides that differ only there (e.g. rope_type "linear" and
    "dynamic" with the same factor) share a key space, and need their own model_fingerprint. A
    config.json that cannot be read locally (a GGUF file, a Mistral params.json-only checkpoint,
    ModelScope) leaves the checkpoint's part out (logged): the
    fingerprint then names the model, its revision and hf_overrides, and a changed config at the
    same path needs its own model_fingerprint."""
    identity = {
        "checkpoint rope": _checkpoint_rope_fields(model),
        "hf_overrides": _rope_rewrites_undone(_stable_value(getattr(model, "hf_overrides", None))),
    }
    return json.dumps(identity, sort_keys=True, separators=(",", ":"))


def _rope_rewrites_undone(overrides: Any, in_rope: bool = False, depth_left: int = _CONFIG_DEPTH_MAX) -> Any:
    """hf_overrides (as `_stable_value` gives them) with the RoPE fields model code rewrites in
    place left out (`_REWRITTEN_ROPE_FIELDS`), inside the dicts given for a RoPE field. vLLM
    sets such a dict as the config's attribute itself (ModelConfig._apply_dict_overrides), so the
    worker's hf_overrides are rewritten with its config at load_model, and the scheduler's are
    not."""
    if not isinstance(overrides, dict) or depth_left <= 0:
        return overrides
    undone: dict[str, Any] = {}
    for key, value in overrides.items():
        if in_rope and key in _REWRITTEN_ROPE_FIELDS:
            continue
        undone[key] = _rope_rewrites_undone(value, in_rope or key in _HF_KV_FIELDS, depth_left - 1)
    return undone


def _checkpoint_rope_fields(model: Any) -> Optional[dict[str, Any]]:
    """The RoPE fields of the checkpoint's config.json wherever they are (top level, a text
    config), by their dotted path; None when the file cannot be read locally."""
    raw = _read_checkpoint_config(model)
    if raw is None:
        return None
    found: dict[str, Any] = {}
    _collect_rope_fields(raw, "", found, _CONFIG_DEPTH_MAX)
    return found


def _collect_rope_fields(config: dict, prefix: str, found: dict[str, Any], depth_left: int) -> None:
    for key, value in config.items():
        if key in _HF_KV_FIELDS:
            found[prefix + str(key)] = _stable_value(value)
        elif isinstance(value, dict) and depth_left > 1:
            _collect_rope_fields(value, f"{prefix}{key}.", found, depth_left - 1)


def _read_checkpoint_config(model: Any) -> Optional[dict]:
    """The checkpoint's config.json as a dict, read from the model's directory or from the
    Hugging Face cache where vLLM's config loading put it (vLLM's try_get_local_file: no
    download, no network), with vLLM's hf_config_path and the commit its revision was resolved
    to (`_pinned_revision`: the revision's name, e.g. "main", may move between the reads of two
    processes). A read that fails is tried again (`_CONFIG_READ_RETRIES_S`: a file being
    replaced, the cache being written; vLLM retries its own config parsing likewise); None
    (logged) when there is none locally or it cannot be read. Scheduler and workers each read
    it: a difference between them is caught when the workers bind the scheduler's first
    metadata (WorkerSide._check_scheduler_fingerprint)."""
    source = getattr(model, "hf_config_path", None) or getattr(model, "model", None)
    revision = _pinned_revision(getattr(model, "_hf_config_revision", None) or getattr(model, "revision", None))
    if not source:
        return None
    why = ""
    for retry_s in (0.0, *_CONFIG_READ_RETRIES_S):
        time.sleep(retry_s)
        config, why, final = _try_read_config(source, revision)
        if config is not None:
            return config
        if final:
            break
    logging.getLogger("tutti.vllm").warning(
        "tutti: no readable local %s for model %s (%s): the default model fingerprint names the model, its revision and "
        "hf_overrides, not the checkpoint's RoPE parameters; set model_fingerprint if the config at this path changes",
        _HF_CONFIG_NAME, source, why,
    )  # fmt: skip
    return None


def _try_read_config(source: Any, revision: Any) -> tuple[Optional[dict], str, bool]:
    """One read of the checkpoint's config.json: (the config or None, why not, whether the
    answer is final: read, or known not to exist in the cache)."""
    from pathlib import Path

    try:
        from vllm.transformers_utils.repo_utils import try_get_local_file

        path = try_get_local_file(model=source, file_name=_HF_CONFIG_NAME, revision=revision)
        if not isinstance(path, Path):
            # None: not found; huggingface_hub's _CACHED_NO_EXIST: known not to exist there.
            return None, "not in the model's directory nor in the Hugging Face cache", path is not None
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except Exception as error:  # noqa: BLE001 - OSError, ValueError (JSON, UnicodeDecodeError), RecursionError, the lookup's
        return None, f"{type(error).__name__}: {error}", False
    if not isinstance(config, dict):
        return None, f"{path} holds no JSON object", True
    return config, "", True


def _pinned_revision(revision: Any) -> Any:
    """The commit a Hugging Face revision was resolved to: vLLM resolves the model's revision
    once (huggingface_hub's ResolvedRevision, pickled to the workers with it), whose str is the
    name asked for ("main") and `.resolved` the commit loaded; the name looked up again later
    could give another commit. Any other revision (a local model: None) as given."""
    resolved = getattr(revision, "resolved", None)
    return str(resolved) if resolved else revision


def _stable_value(value: Any) -> Any:
    """`value` as plain JSON data that reads the same in every process: dicts (keys as strings),
    lists, numbers, strings; a callable by its module and qualified name; anything else by its
    str() unless that names an object id, then by its type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(key): _stable_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_stable_value(item) for item in value]
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    text = str(value)
    return type(value).__qualname__ if " at 0x" in text else text


def _refuse_failing_loads(kv_transfer_config: Any) -> None:
    """Raises ConfigError unless vLLM recomputes the blocks of a failed load
    (kv_load_failure_policy "recompute"). vLLM's default, "fail", ends the request whose load
    failed with an error, and every running request sharing one of its blocks
    (Scheduler._handle_invalid_blocks), while tutti is a best-effort cache: a block evicted since
    the lookup, an I/O error or a worker whose session ended makes a load fail, and a worker with
    CPU KV whose session ended fails every load until it is restarted."""
    from tutti._engine import ConfigError

    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "fail")
    if policy != "recompute":
        raise ConfigError(
            f"TuttiConnector needs vLLM to recompute the blocks of a failed load, but kv_load_failure_policy = "
            f"{policy!r} (vLLM's default, 'fail', fails the request and every request sharing its blocks): add "
            '"kv_load_failure_policy": "recompute" to --kv-transfer-config (kv_transfer_config)'
        )


def _refuse_kv_cache_groups_freed_early(kv_cache_config: Optional["KVCacheConfig"]) -> None:
    """Raises ConfigError for a KV cache group that is not full attention (vLLM's
    FullAttentionSpec, MLA's included): vLLM frees a sliding-window or chunked-local group's
    blocks outside the window while the request runs (SlidingWindowManager.remove_skipped_blocks,
    during chunked prefill and before request_finished), so the blocks a save names may hold
    another request's bytes by the time it is written; other kinds (Mamba state, cross
    attention) are not a prompt's paged KV at all. A FullAttentionSpec whose layers compute a
    sliding window (the hybrid KV cache manager disabled) keeps every block: accepted; one whose
    layers attend non-causally is not (`_refuse_non_causal_attention`). Nor is a group of vLLM's
    UniformTypeKVCacheSpecs: layers of one kind whose KV shapes or dtypes differ (head counts or
    sizes per layer, or a KV-cache dtype with --kv-cache-dtype-skip-layers, which vLLM adds by
    itself for turboquant_* and ultraquant_4bit), which only the workers see (the scheduler gets
    one layer's spec: generate_scheduler_kv_cache_config); its refusal names the spec fields
    that differ, not sliding window, and one KV-cache dtype as the way out where only the dtype
    and the fields vLLM derives from it (packing, alignment, padding) differ."""
    from tutti._engine import ConfigError
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            layer_specs = list(spec.kv_cache_specs.values())
            kinds = sorted({type(layer_spec).__name__ for layer_spec in layer_specs})
            differing = _fields_that_differ(layer_specs)
            # Only a dtype difference has a way out besides dropping the connector: the shapes are
            # the model's. Where the dtype differs, the fields vLLM derives from it differ too:
            # the worker passes each layer's spec through its backend's customize_spec
            # (customize_attention_spec), which gives packed KV (turboquant_*, ultraquant_4bit,
            # nvfp4) state_content_bytes or num_head_slots, and block_stride_alignment where the
            # backend's kernel block sizes are fixed, while the skip layers (the model's dtype,
            # another backend) get none of them; page_size_padded follows the page size.
            dtype_fields = {"dtype", "kv_quant_mode", "cache_dtype_str"}
            derived_fields = {"state_content_bytes", "num_head_slots", "block_stride_alignment", "page_size_padded"}
            only_dtype = bool(dtype_fields & set(differing)) and set(differing) <= dtype_fields | derived_fields
            way_out = (
                "serve it with one KV-cache dtype for every layer (no --kv-cache-dtype-skip-layers; vLLM adds skip "
                "layers by itself for a turboquant_* or ultraquant_4bit --kv-cache-dtype) or without the connector"
                if only_dtype
                else "serve it without the connector"
            )
            raise ConfigError(
                f"TuttiConnector needs every layer of a KV cache group to have one KV shape and dtype; this model's "
                f"{len(group.layer_names)} layers of {', '.join(kinds)} have different KV shapes or dtypes per layer "
                f"(they differ in {', '.join(differing) or 'their spec type'}: vLLM's UniformTypeKVCacheSpecs), which "
                f"a tutti pool (one KV shape and dtype for all layers) cannot hold: {way_out}"
            )
        if not isinstance(spec, FullAttentionSpec):
            raise ConfigError(
                f"TuttiConnector stores full-attention KV only; this model has a KV cache group of "
                f"{type(spec).__name__} ({len(group.layer_names)} layers), whose blocks vLLM frees or reuses while a "
                "request runs (a save would store other requests' bytes under its prompt's keys): serve it with "
                "--disable-sliding-window (all layers full attention) or without the connector"
            )
    _refuse_non_causal_attention(kv_cache_config, "TuttiConnector", "the connector")


def _fields_that_differ(layer_specs: list[Any]) -> list[str]:
    """The dataclass fields (vLLM's KV cache specs are dataclasses) whose values are not the same
    in every one of `layer_specs`, in field order, so that a refusal names what differs (dtype,
    num_kv_heads, ...) rather than guessing."""
    import dataclasses

    names: list[str] = []
    for layer_spec in layer_specs:
        for spec_field in dataclasses.fields(layer_spec) if dataclasses.is_dataclass(layer_spec) else ():
            if spec_field.name not in names:
                names.append(spec_field.name)
    return [
        name
        for name in names
        if len({repr(getattr(layer_spec, name, None)) for layer_spec in layer_specs}) > 1
    ]


def _refuse_non_causal_attention(kv_cache_config: Optional["KVCacheConfig"], who: str, without: str) -> None:
    """Raises ConfigError for a KV cache group whose layers attend non-causally (vLLM's
    FullAttentionSpec.non_causal: Prefix-LM, bidirectional attention over the prompt). A block's
    KV then depends on the prompt's later tokens, so a prompt sharing only a prefix would load KV
    computed attending to another prompt's suffix (wrong output), and its own save would store
    such KV for the next. vLLM disables its own prefix caching for such a model
    (EngineCore._initialize_kv_caches) but still asks a connector for external tokens. A group of
    per-layer specs (UniformTypeKVCacheSpecs) is looked at layer by layer. `who` names the
    refusing component, `without` what to serve the model without."""
    from tutti._engine import ConfigError

    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = group.kv_cache_spec
        layer_specs = getattr(spec, "kv_cache_specs", None)
        specs = list(layer_specs.values()) if isinstance(layer_specs, dict) else [spec]
        if any(getattr(layer_spec, "non_causal", False) for layer_spec in specs):
            raise ConfigError(
                f"{who} cannot cache the KV of non-causal attention: a KV cache group of this model "
                f"({len(group.layer_names)} layers) attends non-causally (vLLM's FullAttentionSpec.non_causal: "
                "Prefix-LM, bidirectional attention over the prompt), so a block's KV depends on the prompt's later "
                "tokens and a prompt sharing only its prefix would load another prompt's KV (vLLM disables its own "
                f"prefix caching for such a model): serve it without {without}"
            )


def _refuse_full_cuda_graphs(vllm_config: "VllmConfig") -> None:
    """Raises ConfigError when a worker's config still has full CUDA graphs
    (compilation_config.cudagraph_mode FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE). vLLM 0.32
    sets PIECEWISE for a connector that asks for it (requires_piecewise_for_cudagraph, in
    VllmConfig.__post_init__), but then set_splitting_ops_for_v1 runs: with
    compilation_config.pass_config.fuse_attn_quant and no inductor graph partition it empties
    splitting_ops and switches to FULL (set_splitting_ops_for_attn_fusion). A replayed full graph
    never calls wait_for_layer_load or save_kv_layer: attention would read blocks tuttid is still
    writing, and saves would store blocks not yet computed. A worker's config is final when vLLM
    builds its connector (later changes, in the model runner, only step down to fewer full
    graphs), and PIECEWISE or NONE there is the ordinary case. Under fuse_attn_quant the refusal
    names only ways out that leave no full graphs: turning it off, inductor graph partition, or
    cudagraph_mode NONE; not PIECEWISE, which set_splitting_ops_for_attn_fusion turns into FULL
    as it does the connector's. Without it nothing in vLLM undoes the connector's PIECEWISE (full
    graphs came from elsewhere: a platform hook, a test), and PIECEWISE or NONE is the way out."""
    from tutti._engine import ConfigError

    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    if mode is None or not mode.has_full_cudagraphs():
        return
    pass_config = getattr(compilation, "pass_config", None)
    if getattr(pass_config, "fuse_attn_quant", False):
        cause = (
            "which compilation_config.pass_config.fuse_attn_quant = True undoes without inductor graph partition "
            "(vLLM switches to FULL for it): turn off fuse_attn_quant (-cc.pass_config.fuse_attn_quant=false), "
            "enable compilation_config.use_inductor_graph_partition, or set cudagraph_mode NONE (cudagraph_mode "
            "PIECEWISE does not help: with fuse_attn_quant vLLM switches it to FULL as well)"
        )
    else:
        # Reachable only where something besides set_splitting_ops_for_attn_fusion set full graphs
        # after the connector's PIECEWISE (a platform or model hook, a test): PIECEWISE then holds.
        cause = (
            "and compilation_config.pass_config.fuse_attn_quant, the setting that makes vLLM's config undo that, "
            "is off here: something else set the full graphs; set cudagraph_mode PIECEWISE or NONE"
        )
    raise ConfigError(
        f"TuttiConnector needs PIECEWISE CUDA graphs (or none), but this worker runs with cudagraph_mode "
        f"{mode.name}: a replayed full graph skips the connector's per-layer calls, so attention would read KV "
        f"blocks still being loaded. vLLM sets PIECEWISE for the connector, {cause}"
    )


def _refuse_unsupported_parallelism(parallel: Any) -> None:
    """Raises ConfigError for pipeline or context parallelism: a worker's key space names its
    tensor-parallel rank only (pipeline stages would share keys while holding other layers), and
    context parallelism changes the block size vLLM's scheduler plans with. And for
    micro-batching (dual batch overlap, ubatch_size > 1: vLLM's ParallelConfig.use_ubatching):
    the forward then runs as micro-batches in two threads, each calling save_kv_layer for every
    layer, and the connector would issue a layer's save on the first call, before the other
    micro-batch wrote its KV."""
    from tutti._engine import ConfigError

    if getattr(parallel, "use_ubatching", False):
        setting = "enable_dbo = True" if getattr(parallel, "enable_dbo", False) else f"ubatch_size = {parallel.ubatch_size}"
        raise ConfigError(
            f"TuttiConnector does not support micro-batching ({setting}): each micro-batch's thread saves every "
            "layer, and a layer's save would start before the other micro-batch wrote its KV; run vLLM without "
            "--enable-dbo (and ubatch_size <= 1) or without the connector"
        )

    for name, what in (
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("decode_context_parallel_size", "decode context parallelism"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
    ):
        size = int(getattr(parallel, name, 1) or 1)
        if size > 1:
            raise ConfigError(
                f"TuttiConnector does not support {what} ({name} = {size}): tutti's keys name the tensor-parallel "
                f"rank only; run vLLM with {name} 1 or without the connector"
            )


def _resolved_kv_layout(vllm_config: "VllmConfig", kv_cache_config: Optional["KVCacheConfig"]) -> str:
    """The name of vLLM's resolved KV cache layout (`KVCacheLayout`): the engine core resolves
    it (attention backend, VLLM_KV_CACHE_LAYOUT) before either side's connector is built and
    hands it to the workers; LBHNC (vLLM's identity layout, what allocate_kv_caches views) when
    nothing resolved one (tests, tools)."""
    for source in (kv_cache_config, getattr(vllm_config, "cache_config", None)):
        name = getattr(source, "kv_cache_layout", None)
        if name:
            return str(getattr(name, "name", name))
    return _DEFAULT_KV_LAYOUT


def _model_identity(
    vllm_config: "VllmConfig",
    kv_cache_config: Optional["KVCacheConfig"],
    kv_layout: str,
    with_model: bool = True,
    fingerprint_setting: Optional[str] = None,
) -> list[Any]:
    """What changes a model's KV bytes or their order in a block, for the default fingerprint:
    the model, its checkpoint's RoPE parameters and hf_overrides, a local model directory's weight
    files (`_local_weights_identity`; for weights streamed from object storage, vLLM's
    model_weights URL in place of the directory and its files, with a warning: the objects
    behind it are not named, so replacing them needs a new model_fingerprint), the cache dtype, the KV layout (LBHNC and
    LBNHC blocks are the same size with heads and slots transposed) and the page shape of each
    KV cache group. `with_model` False: the layout parts only (block size, cache dtype, layout,
    groups), hashed with an explicit fingerprint. `fingerprint_setting`: where the caller reads
    model_fingerprint from (the connector's kv_connector_extra_config, a tier's own config),
    named by the streamed-weights warning; None: no warning (a worker's connector, whose
    scheduler logs it once for the deployment)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parts: list[Any] = ["vllm", cache.block_size, str(cache.cache_dtype)]
    if model is not None and with_model:
        streamed = getattr(model, "model_weights", None)
        streamed = streamed if isinstance(streamed, str) and streamed else None
        if streamed is not None:
            # --load-format runai_streamer from object storage: model.model is a local directory
            # vLLM fills with the model's *.json at every start (new times each start, under this
            # node's cache directory); the weights stream from this URL, which names them. The
            # objects are not listed: weights replaced at the URL would keep the key space.
            parts += ["streamed weights", streamed]
            if fingerprint_setting is not None:
                logging.getLogger("tutti.vllm").warning(
                    "tutti: the model's weights stream from %s: the default model fingerprint names that URL (and "
                    "vLLM's revision), not the objects there, so weights replaced at that URL would load the old "
                    'weights\' KV blocks. Set "model_fingerprint" in %s, and change it whenever the weights at that '
                    "URL change",
                    streamed,
                    fingerprint_setting,
                )
        else:
            parts += [model.model]
        parts += [str(_pinned_revision(model.revision)), str(model.dtype), str(model.quantization)]
        parts += ["hf config", _hf_config_identity(model)]
        weights = None if streamed is not None else _local_weights_identity(model.model)
        if weights is not None:
            parts += ["local weights", weights]
    parts += ["kv layout", kv_layout]
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = group.kv_cache_spec
        parts += [
            "group",
            type(spec).__name__,
            len(group.layer_names),
            *(str(getattr(spec, name, None)) for name in ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes")),
        ]
    return parts
