#!/usr/bin/env python3
"""Issue 15 item 6: an engine's prefill with its prefix KV retrieved layer by layer through tutti,
against recomputing the prefix — time to first token (TTFT) and the I/O's exposed cost, at a few
hit rates.

The model is Llama-3.1-8B-shaped, built with `transformers` (LlamaConfig: hidden 4096, 32 layers,
32 query heads, 8 KV heads of 128, MLP 14336, vocabulary 128256, bf16) with random weights
initialised on the GPU: no weights are downloaded. Llama-3.1's RoPE frequency scaling is left out
(it changes no shape and no cost). The script starts tuttid itself (--tuttid, on `emu:mem`, the
software NVMe controller inside the daemon over host memory, `--device-memory cuda`) with the
model's KV geometry, attaches a `tutti.Store` and registers ONE torch allocation as the engine's
KV memory (`KvLayout.separate`: per layer a K and a V region of [blocks, block_tokens, kv_heads,
head_dim]); the daemon's controller reaches it by CUDA copies (docs/tuttid.md, "GPU memory").

Once, untimed: prefill of the longest prefix, its KV copied per layer into "source" blocks of the
registered memory, stored through tutti (prepare_store, store_layer + wait per layer, commit).
Then, for each hit rate h over a prompt of N tokens (prefix P = h·N rounded down to whole blocks):
- recompute: prefill of all N tokens, TTFT = the last token's logits on the host (CUDA
  synchronised), median of --repeats after --warmup;
- tutti: the "target" blocks are zeroed (untimed), then timed: one request per layer
  (prepare_retrieve of the P-token prefix into the target blocks, retrieve_layer(l): a Request
  keeps at most `layers_in_flight` layers in flight, 4 at most, fewer than the model's 32, so every
  layer's read is issued at the start through a request of its own), then prefill of the N − P new tokens over a DynamicCache holding the prefix, where a
  forward pre-hook on decoder layer l waits for layer l's retrieve (LayerIo.wait) and copies its
  prefix KV from the registered memory into the attention cache. Host wait = the time the hooks
  waited, summed (host time: eager PyTorch queues kernels ahead, so the GPU was usually still
  running earlier layers while the host waited — it overstates the GPU's stall and is not the
  paper's bubble); the retrieve's GiB/s = prefix KV bytes over the time from before the first
  prepare_retrieve (one per layer, each a round trip to tuttid) to the last layer's completion;
- resident: the same suffix prefill with the prefix KV copied from the source blocks, no I/O (the
  compute floor); exposed I/O = tutti's TTFT − resident's (medians): the I/O's whole cost on the
  critical path, the figure to set beside the paper's bubble;
- checks: the tutti path's last-token logits against the recompute's (allclose; tolerance per
  dtype) AND every retrieved byte against the stored source bytes; a negative control (the
  resident path with the prefix blocks shifted by one: wrong KV) must fail the same logits
  tolerance, else the check could not tell wrong KV from right and the run FAILs.

--device cpu --tiny rehearses the whole path without a GPU (a few small float32 layers on the CPU,
or bf16 with --dtype bf16, the GPU run's dtype: tools/gpu/check.sh runs both; tuttid
--device-memory memfd and tutti.DeviceMemoryStandIn in place of CUDA memory);
--fault wrong-blocks retrieves into the target blocks shifted by one (a wrong-KV bug: must FAIL).

Output: a JSON document (stdout, and --out) with per hit rate: prompt and prefix tokens,
recompute / tutti / resident TTFT ms, exposed I/O ms, host wait ms, retrieve GiB/s, speed-up; provenance (GPU,
driver, torch / transformers / CUDA versions, date) and what the device is. Last line `PASS ...`
(exit 0), `PASS ... PARTIAL ...` (exit 3: --budget-s reached, the hit rates done are reported),
or `FAIL ...` (exit 1).

  python3 tools/gpu/prefill-ttft.py --tuttid target/gpu-carry/tuttid --out prefill-ttft.json
  python3 tools/gpu/prefill-ttft.py --device cpu --tiny --tuttid target/debug/tuttid   # rehearsal

STATUS: rehearsed on the CPU (--device cpu --tiny, transformers 5.19.0); never run on a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

DEVICE_SENTENCE = (
    "The device is tuttid's software NVMe controller (emu:mem) over host memory, reaching the engine's "
    "KV memory by CUDA copies through its bounce buffer (staged), not an SSD: no flash latency, no "
    "PCIe peer-to-peer, and the retrieve's speed is the emulator's memcpy plus one synchronous "
    "cuMemcpyHtoD per command."
)
STAND_IN_SENTENCE = (
    "CPU rehearsal: tiny float32 model on the CPU, tuttid --device-memory memfd (tutti.DeviceMemoryStandIn "
    "in place of CUDA memory) over emu:mem; the figures say nothing about a GPU or an SSD."
)
PROMPT_SEED = 20261201
WAIT_TIMEOUT_S = 15.0
QK_STD_DEFAULT = 1.5


def write_json(path: str | None, result: dict) -> None:
    """--out, replaced whole (written aside, then renamed): after the store, after each hit rate,
    and at the end, so a run stopped from outside still leaves the hit rates it measured."""
    if path:
        with open(path + ".partial", "w") as out:
            out.write(json.dumps(result, indent=2) + "\n")
        os.replace(path + ".partial", path)


def fail(message: str, code: int = 1) -> None:
    print(f"FAIL prefill: {message}", flush=True)
    sys.exit(code)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small float32 model and prompt (the CPU rehearsal)")
    parser.add_argument("--tuttid", required=True, help="the tuttid binary (the `cuda` feature for --device cuda)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt length N (default 8192; tiny 512)")
    parser.add_argument("--hit-rates", default="0.25,0.5,0.9", help="comma-separated prefix fractions")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block (the engine's block size)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 32; tiny 4)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), help="model and KV dtype (default bf16; tiny fp32)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per path (median)")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="wall-clock budget from start, model set-up included; hit rates that would pass it are skipped")
    parser.add_argument("--qk-std", type=float, default=QK_STD_DEFAULT,
                        help="std of query/key elements the random projections are scaled to (attention sharpness)")
    parser.add_argument("--out", help="write the JSON result here too")
    parser.add_argument("--fault", choices=("none", "wrong-blocks"), default="none",
                        help="wrong-blocks: retrieve into the target blocks shifted by one (the run must FAIL)")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------


def model_config(transformers, tiny: bool, layers):
    dims = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256)
    if tiny:
        dims = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=1024)
    if layers:
        dims["num_hidden_layers"] = layers
    config = transformers.LlamaConfig(**dims, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    if getattr(config, "head_dim", None) != dims["head_dim"]:
        fail(f"transformers {transformers.__version__}: LlamaConfig has no head_dim (needed: 4.45 or later)")
    config._attn_implementation = "sdpa"
    return config


def build_model(torch, transformers, config, device: str, dtype, qk_std: float):
    started = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # Built where it runs: the random initialisation happens on the GPU (seconds, not minutes).
        with torch.device(device):
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    # Cast whole, not only built under the default dtype: a transformers version may keep some
    # parameters in float32 whatever the default (its fp32-kept modules), and a bf16 engine runs
    # its model in bf16; the check below then only catches what the cast could not do.
    model.to(dtype)
    model.eval()
    # Random weights attend almost uniformly (query and key elements of std ~initializer_range x
    # sqrt(hidden)), and uniform attention over a prefix hardly depends on which KV is there: a
    # logits check could not see wrong KV. Scaling the query and key projections so that their
    # elements have std QK_STD makes the scores' std ~QK_STD² and attention peaked, as in a trained
    # model; it changes no shape and no cost.
    factor = qk_std / (config.initializer_range * config.hidden_size ** 0.5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(factor)
            layer.self_attn.k_proj.weight.mul_(factor)
    for name, parameter in model.named_parameters():
        if parameter.dtype != dtype or parameter.device.type != device:
            fail(f"parameter {name} is {parameter.dtype} on {parameter.device}, wanted {dtype} on {device}")
    return model, time.perf_counter() - started


def layer_kv(transformers, cache, layer: int):
    """A DynamicCache's K and V of one layer, [1, kv_heads, tokens, head_dim]."""
    if hasattr(cache, "layers"):  # transformers >= 4.56: a list of cache layers
        return cache.layers[layer].keys, cache.layers[layer].values
    if hasattr(cache, "key_cache"):  # transformers 4.36 .. 4.55
        return cache.key_cache[layer], cache.value_cache[layer]
    fail(f"transformers {transformers.__version__}: DynamicCache has neither .layers nor .key_cache")


def check_cache_api(torch, transformers) -> str:
    """The prefix is put into a DynamicCache by one update() per layer with a placeholder, and the
    retrieved KV is later copied into the tensors update() returned: that needs update() to keep
    and return the very tensors later updates extend. Checked here, not assumed."""
    DynamicCache = getattr(transformers, "DynamicCache", None)
    if DynamicCache is None:
        fail(f"transformers {transformers.__version__} has no DynamicCache (needed: 4.36 or later)")
    cache = DynamicCache()
    keys, values = cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 0)
    stored_keys, _ = layer_kv(transformers, cache, 0)
    if stored_keys.data_ptr() != keys.data_ptr():
        fail(f"transformers {transformers.__version__}: DynamicCache.update does not return the tensor it keeps; "
             "this script handles 4.56..5.19 (.layers) and 4.36..4.55 (.key_cache)")
    keys.fill_(7.0)
    values.fill_(3.0)
    grown, _ = cache.update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), 0)
    if grown.shape[-2] != 3 or float(grown[0, 0, 0, 0]) != 7.0 or float(grown[0, 0, 2, 0]) != 1.0:
        fail(f"transformers {transformers.__version__}: DynamicCache.update does not extend the kept tensor "
             "along the sequence; this script cannot put a retrieved prefix into its cache")
    return "DynamicCache.layers" if hasattr(cache, "layers") else "DynamicCache.key_cache"


class Prefill:
    """Prefill of new tokens over a cache, the last token's logits out; a pre-hook per decoder
    layer calls `self.loader(layer)` when a loader is set (the layer-by-layer prefix)."""

    def __init__(self, torch, transformers, model, device: str):
        self.torch, self.transformers, self.model, self.device = torch, transformers, model, device
        self.loader = None
        for index, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(self._hook(index))

    def _hook(self, index: int):
        def hook(_module, _args):
            if self.loader is not None:
                self.loader(index)
        return hook

    def run(self, token_ids, start: int, cache):
        torch = self.torch
        positions = torch.arange(start, start + token_ids.shape[1], device=token_ids.device).unsqueeze(0)
        output = self.model.model(input_ids=token_ids, position_ids=positions, past_key_values=cache, use_cache=True)
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        # The LM head over the last token only: TTFT needs one token's logits, not N x 128256.
        return self.model.lm_head(hidden[:, -1:, :]).float()

    def synchronize(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------
# tuttid and the registered KV memory
# ------------------------------------------------------------------------------------------------


class Daemon:
    def __init__(self, binary: str, workdir: str, memory: str, geometry: dict, pool_bytes: int, requests: int):
        self.socket = os.path.join(workdir, "tuttid.sock")
        self.log_path = os.path.join(workdir, "tuttid.log")
        command = [binary, "--device", f"emu:mem:{(pool_bytes + (1 << 20) - 1) >> 20}m", "--socket", self.socket,
                   "--lock-dir", os.path.join(workdir, "locks"), "--metrics", "off", "--format",
                   "--layers", str(geometry["layers"]), "--kv-heads", str(geometry["kv_heads"]),
                   "--head-dim", str(geometry["head_dim"]), "--dtype", geometry["dtype"],
                   "--tokens-per-block", str(geometry["block_tokens"]), "--requests-per-session", str(requests),
                   "--lease", "60s", "--device-memory", memory]
        self.command = command
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                fail(f"tuttid did not listen ({' '.join(command)}): {self.tail()}")
            time.sleep(0.05)

    def tail(self) -> str:
        try:
            with open(self.log_path) as log:
                return " | ".join(log.read().splitlines()[-8:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class KvMemory:
    """ONE allocation (one cudaMalloc, as tutti's CUDA route requires; or one DeviceMemoryStandIn)
    holding, per layer, a K and a V region of `blocks` blocks: [blocks, block_tokens, kv_heads,
    head_dim] in the model's dtype. Blocks [0, prefix_blocks) are the stored prefix's sources,
    the rest the retrieves' targets."""

    def __init__(self, torch, tutti, device: str, layers: int, blocks: int, block_tokens: int, kv_heads: int,
                 head_dim: int, dtype):
        self.torch = torch
        element_bytes = torch.empty((), dtype=dtype).element_size()
        self.object_bytes = block_tokens * kv_heads * head_dim * element_bytes
        region_bytes = blocks * self.object_bytes
        total = 2 * layers * region_bytes
        if device == "cuda":
            self.raw = torch.zeros(total, dtype=torch.uint8, device="cuda")
            self.owner = None
        else:
            self.owner = tutti.DeviceMemoryStandIn(total)
            self.raw = torch.from_numpy(self.owner.numpy())
        regions = [self.raw[i * region_bytes:(i + 1) * region_bytes].view(blocks, self.object_bytes) for i in range(2 * layers)]
        self.keys_bytes, self.values_bytes = regions[0::2], regions[1::2]
        shape = (blocks, block_tokens, kv_heads, head_dim)
        self.keys = [region.view(dtype).view(shape) for region in self.keys_bytes]
        self.values = [region.view(dtype).view(shape) for region in self.values_bytes]
        self.total_bytes = total

    def layout(self, tutti):
        return tutti.KvLayout.separate(self.keys_bytes, self.values_bytes)

    def put(self, layer: int, first_block: int, keys, values) -> None:
        """Cache tensors [1, kv_heads, tokens, head_dim] (whole blocks) into blocks from first_block."""
        blocks = keys.shape[2] // self.keys[layer].shape[1]
        shape = self.keys[layer].shape[1:]
        self.keys[layer][first_block:first_block + blocks].copy_(keys[0].transpose(0, 1).reshape(blocks, *shape))
        self.values[layer][first_block:first_block + blocks].copy_(values[0].transpose(0, 1).reshape(blocks, *shape))

    def get_into(self, layer: int, key_blocks, keys, values, value_blocks=None) -> None:
        """Blocks `key_blocks` (a range or a list) of K, and `value_blocks` (default the same) of V,
        into cache tensors [1, kv_heads, tokens, head_dim]."""
        self._gather(self.keys[layer], key_blocks, keys)
        self._gather(self.values[layer], key_blocks if value_blocks is None else value_blocks, values)

    def _gather(self, region, block_ids, into) -> None:
        if isinstance(block_ids, range):
            source = region[block_ids.start:block_ids.stop]
        else:
            source = region.index_select(0, self.torch.tensor(block_ids, device=self.raw.device))
        tokens = source.shape[0] * source.shape[1]
        into[0].copy_(source.reshape(tokens, *source.shape[2:]).transpose(0, 1))

    def zero(self, first_block: int) -> None:
        for region in self.keys_bytes + self.values_bytes:
            region[first_block:].zero_()

    def differing_blocks(self, layers: int, sources: range, targets: range) -> int:
        """How many (layer, K/V, block) objects of `targets` differ from `sources` byte for byte."""
        wrong = 0
        for layer in range(layers):
            for regions in (self.keys_bytes, self.values_bytes):
                source = regions[layer][sources.start:sources.stop]
                target = regions[layer][targets.start:targets.stop]
                wrong += int((source != target).any(dim=1).sum())
        return wrong


# ------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def timing_figures(recompute_s: list[float], tutti_runs: list[dict], resident_s: list[float]) -> dict:
    """TTFT medians in ms and what the I/O costs: exposed_io_ms, tutti's TTFT less the resident
    path's (the same kernels with the prefix already in memory), is the I/O's cost on the critical
    path; host_wait_ms, the pre-hooks' waits summed, is host time that overlaps queued GPU work
    (eager PyTorch runs ahead of the GPU), larger than the GPU's stall: not the bubble."""
    tutti_ms = median_ms([run["ttft_s"] for run in tutti_runs])
    resident_ms = median_ms(resident_s)
    recompute_ms = median_ms(recompute_s)
    return {
        "recompute_ttft_ms": recompute_ms, "tutti_ttft_ms": tutti_ms, "resident_ttft_ms": resident_ms,
        "exposed_io_ms": round(tutti_ms - resident_ms, 3),
        "host_wait_ms": median_ms([run["host_wait_s"] for run in tutti_runs]),
        "speedup": round(recompute_ms / tutti_ms, 3),
    }


def logits_error(torch, reference, candidate) -> float:
    """max |candidate − reference| over max |reference|."""
    return float((candidate - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


def logits_l2(torch, reference, candidate) -> float:
    """||candidate − reference|| over ||reference||."""
    return float((candidate - reference).norm() / reference.norm().clamp_min(1e-30))


def provenance(torch, transformers, tutti, args, config, dtype, cache_api: str) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "transformers_cache_api": cache_api,
        "tutti": getattr(tutti, "__version__", "unknown"),
        "device": args.device,
        "fault": args.fault,
        "model": {"shape": "tiny (rehearsal)" if args.tiny else "Llama-3.1-8B (random weights, no RoPE scaling)",
                  "layers": config.num_hidden_layers, "hidden": config.hidden_size, "heads": config.num_attention_heads,
                  "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
                  "intermediate": config.intermediate_size, "vocab": config.vocab_size, "dtype": str(dtype).replace("torch.", ""),
                  "attention": "sdpa"},
        "kv_device": DEVICE_SENTENCE if args.device == "cuda" else STAND_IN_SENTENCE,
        "not_the_paper": ("The closest this project comes to the paper's end-to-end TTFT figure: eager PyTorch "
                          "through transformers (no CUDA graphs, no paged attention: the prefix is copied from "
                          "the registered blocks into a contiguous DynamicCache), one prompt at a time, the CPU "
                          "software controller as the device, no GPU-initiated I/O."),
    }
    try:  # the commit, from git or (on the GPU machine, where .git does not travel) target/gpu-carry/COMMIT
        import provenance as tree_provenance  # tools/gpu/provenance.py, beside this script

        info["commit"] = tree_provenance.commit_info()
    except Exception as error:  # noqa: BLE001 — provenance must not cost the measurement
        info["commit"] = {"commit": "unknown", "source": f"{type(error).__name__}: {error}"}
    if args.device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": properties.name, "sms": properties.multi_processor_count,
                       "memory_gib": round(properties.total_memory / 2**30, 1)}
        try:
            info["gpu"]["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                                   capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            info["gpu"]["driver"] = f"unknown ({error})"
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def main() -> None:
    started = time.monotonic()
    args = parse_args(sys.argv[1:])
    try:
        import torch
        import transformers
    except ImportError as error:
        fail(f"import: {error} ({sys.executable})")
    try:
        import tutti
    except ImportError as error:
        fail(f"import tutti: {error} (install the wheel, e.g. pip install --target DIR; PYTHONPATH=DIR)")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail(f"torch {torch.__version__} sees no CUDA device")
    if args.device == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.tiny and args.device == "cuda":
        print("prefill-ttft: --tiny on cuda: the small float32 model on the GPU", flush=True)

    device = args.device
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("fp32" if args.tiny else "bf16")]
    # Logits tolerance against the recompute, relative to the largest |logit|: bf16 carries 8
    # significant bits through 32 layers and the two paths run different attention kernels (causal
    # over N tokens; masked suffix over a cached prefix), float32 differs in summation order only.
    # Rehearsed (tiny dims, 32 bf16 layers, --qk-std 1.5): 0 to 1.1e-2, wrong KV 0.27 to 0.32.
    tolerance = 1e-3 if dtype == torch.float32 else 1e-1
    prompt_tokens = args.prompt_tokens or (512 if args.tiny else 8192)
    block_tokens = args.block_tokens
    hit_rates = [float(value) for value in args.hit_rates.split(",") if value.strip()]
    if not hit_rates or any(not 0.0 < rate < 1.0 for rate in hit_rates):
        fail(f"--hit-rates {args.hit_rates}: each must lie strictly between 0 and 1")
    prefixes = [int(rate * prompt_tokens) // block_tokens * block_tokens for rate in hit_rates]
    if min(prefixes) < block_tokens:
        fail(f"a hit rate of {min(hit_rates)} over {prompt_tokens} tokens is under one {block_tokens}-token block")

    cache_api = check_cache_api(torch, transformers)
    config = model_config(transformers, args.tiny, args.layers)
    model, build_s = build_model(torch, transformers, config, device, dtype, args.qk_std)
    layers, kv_heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    prefill = Prefill(torch, transformers, model, device)
    info = provenance(torch, transformers, tutti, args, config, dtype, cache_api)
    print(f"prefill-ttft: {info['model']['shape']}, {device}, torch {torch.__version__}, transformers "
          f"{transformers.__version__} ({cache_api}); model built in {build_s:.1f} s", flush=True)

    generator = torch.Generator().manual_seed(PROMPT_SEED)
    prompt = torch.randint(0, config.vocab_size, (1, prompt_tokens), generator=generator)
    prompt_list = [int(token) for token in prompt[0]]
    prompt = prompt.to(device)

    prefix_blocks_max = max(prefixes) // block_tokens
    # Sources, then targets; one spare block for --fault wrong-blocks' shifted targets.
    blocks = 2 * prefix_blocks_max + 1
    target_first = prefix_blocks_max
    element_bytes = torch.empty((), dtype=dtype).element_size()
    block_bytes = 2 * layers * block_tokens * kv_heads * head_dim * element_bytes
    geometry = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "block_tokens": block_tokens,
                "dtype": "fp32" if dtype == torch.float32 else "bf16"}
    workdir = tempfile.mkdtemp(prefix="prefill-ttft-")
    daemon = Daemon(args.tuttid, workdir, "cuda" if device == "cuda" else "memfd", geometry,
                    pool_bytes=2 * prefix_blocks_max * block_bytes + (256 << 20), requests=layers + 8)
    result = {"provenance": info, "geometry": dict(geometry, block_bytes=block_bytes),
              "prompt_tokens": prompt_tokens, "model_build_s": round(build_s, 1), "tolerance": tolerance,
              "results": [], "tuttid": " ".join(daemon.command)}
    store = None
    failures: list[str] = []
    partial = False
    try:
        store = tutti.Store.attach(daemon.socket, model_fingerprint=tutti.fingerprint("tutti prefill-ttft", config.hidden_size, layers),
                                   client_name="prefill-ttft", timeout_s=60.0, requests_max=layers + 4,
                                   queue_depth=1024, iocbs=1024)
        if store.geometry.layers != layers or store.geometry.block_tokens != block_tokens:
            fail(f"tuttid's geometry {store.geometry!r} is not the model's {geometry}")
        memory = KvMemory(torch, tutti, device, layers, blocks, block_tokens, kv_heads, head_dim, dtype)
        store.register_kv(memory.layout(tutti))

        with torch.inference_mode():
            # Once, untimed: the longest prefix's KV, computed, copied into the source blocks, stored.
            prefix_max = prefix_blocks_max * block_tokens
            cache = transformers.DynamicCache()
            prefill.run(prompt[:, :prefix_max], 0, cache)
            for layer in range(layers):
                memory.put(layer, 0, *layer_kv(transformers, cache, layer))
            del cache
            prefill.synchronize()  # tuttid copies what is in memory: the writes must be done
            store_started = time.perf_counter()
            request = store.prepare_store(prompt_list, list(range(prefix_blocks_max)))
            for layer in range(layers):
                request.store_layer(layer)
                request.wait(WAIT_TIMEOUT_S)
            committed = request.commit()
            store_s = time.perf_counter() - store_started
            found = store.lookup(prompt_list)
            if found != prefix_blocks_max:
                fail(f"after storing {committed} blocks, lookup finds {found} of {prefix_blocks_max}")
            result["store"] = {"blocks": prefix_blocks_max, "bytes": prefix_blocks_max * block_bytes,
                               "seconds": round(store_s, 3),
                               "gib_per_s": round(prefix_blocks_max * block_bytes / store_s / 2**30, 3)}
            # Until the end overwrites it: what a run stopped from outside (the call's limit) leaves.
            result["status"] = "INCOMPLETE (stopped before the end; the hit rates in results were measured)"
            result["failures"] = failures
            write_json(args.out, result)
            print(f"prefill-ttft: stored {prefix_blocks_max} blocks ({prefix_blocks_max * block_bytes / 2**20:.1f} MiB) "
                  f"in {store_s:.2f} s", flush=True)

            previous_rate_s = None
            for rate, prefix in zip(hit_rates, prefixes):
                elapsed = time.monotonic() - started
                if previous_rate_s is not None and elapsed + previous_rate_s * 1.3 > args.budget_s:
                    partial = True
                    print(f"prefill-ttft: budget: {elapsed:.0f} s used, the next hit rate would take about "
                          f"{previous_rate_s:.0f} s of {args.budget_s:.0f} s; stopping", flush=True)
                    break
                rate_started = time.monotonic()
                row = measure_rate(torch, transformers, args, prefill, store, memory, prompt, prompt_list, layers,
                                   block_tokens, block_bytes, prefix, target_first, tolerance)
                row["hit_rate"] = rate
                result["results"].append(row)
                failures.extend(row.pop("failures"))
                previous_rate_s = time.monotonic() - rate_started
                result["elapsed_s"] = round(time.monotonic() - started, 1)
                write_json(args.out, result)
                print(f"prefill-ttft: hit {rate:.2f}: prefix {prefix} of {prompt_tokens} tokens: recompute "
                      f"{row['recompute_ttft_ms']:.1f} ms, tutti {row['tutti_ttft_ms']:.1f} ms (exposed I/O "
                      f"{row['exposed_io_ms']:.1f} ms, host waited {row['host_wait_ms']:.1f} ms, retrieve {row['retrieve_gib_per_s']:.2f} GiB/s), resident "
                      f"{row['resident_ttft_ms']:.1f} ms, speed-up {row['speedup']:.2f}x; logits error "
                      f"{row['logits_error']:.2e} (wrong-KV control {row['negative_control_error']:.2e}, tolerance "
                      f"{tolerance:.0e}; vs resident {row['logits_error_vs_resident']:.1e}), {row['wrong_objects']} retrieved objects differ", flush=True)
    except Exception as error:  # noqa: BLE001 — any failure ends in a FAIL line, with its traceback
        import traceback

        traceback.print_exc()
        failures.append(f"{type(error).__module__}.{type(error).__name__}: {error}")
    finally:
        if store is not None:
            try:
                store.close()
                if store.leaked_registrations():
                    failures.append(f"{store.leaked_registrations()} registrations kept at close")
            except tutti.Error as error:
                failures.append(f"close: {type(error).__name__}: {error}")
        daemon.stop()
        if failures:
            print(f"prefill-ttft: tuttid log: {daemon.tail()}", flush=True)
        shutil.rmtree(workdir, ignore_errors=True)

    result["elapsed_s"] = round(time.monotonic() - started, 1)
    result["status"] = "FAIL" if failures else ("PARTIAL" if partial else "PASS")
    result["failures"] = failures
    print(json.dumps(result, indent=2), flush=True)
    write_json(args.out, result)
    done = len(result["results"])
    if failures:
        fail("; ".join(failures))
    speedups = ", ".join(f"{row['hit_rate']:.2f}: {row['speedup']:.2f}x" for row in result["results"])
    what = (f"CPU rehearsal ({'tiny, ' if args.tiny else ''}stand-in memory)" if device == "cpu"
            else info.get("gpu", {}).get("name", "GPU"))
    if partial:
        print(f"PASS prefill: PARTIAL {done} of {len(hit_rates)} hit rates within {args.budget_s:.0f} s on {what}; "
              f"logits match recompute; speed-up {speedups}", flush=True)
        sys.exit(3)
    print(f"PASS prefill: {done} hit rates on {what}; logits match recompute, every retrieved byte equal; "
          f"speed-up {speedups}", flush=True)


def measure_rate(torch, transformers, args, prefill, store, memory, prompt, prompt_list, layers, block_tokens, block_bytes,
                 prefix, target_first, tolerance) -> dict:
    prompt_tokens = prompt.shape[1]
    prefix_blocks = prefix // block_tokens
    sources = range(0, prefix_blocks)
    targets = range(target_first, target_first + prefix_blocks)
    # The bug --fault wrong-blocks stands for: the reads land one block off from where the
    # attention cache is filled from.
    shift = 1 if args.fault == "wrong-blocks" else 0
    retrieve_ids = list(range(targets.start + shift, targets.stop + shift))
    suffix = prompt[:, prefix:]
    dtype = memory.keys[0].dtype
    kv_shape = (1, memory.keys[0].shape[2], prefix, memory.keys[0].shape[3])
    failures: list[str] = []

    def recompute():
        prefill.synchronize()
        begun = time.perf_counter()
        logits = prefill.run(prompt, 0, transformers.DynamicCache())
        prefill.synchronize()
        return time.perf_counter() - begun, logits

    def cache_with_prefix():
        """A DynamicCache that already counts `prefix` tokens per layer, and per layer the tensors it
        keeps for them (filled later, layer by layer)."""
        cache = transformers.DynamicCache()
        slots = []
        for layer in range(layers):
            # Two tensors: transformers before 4.56 keeps the first update's tensors themselves.
            keys = torch.empty(kv_shape, dtype=dtype, device=prompt.device)
            values = torch.empty(kv_shape, dtype=dtype, device=prompt.device)
            slots.append(cache.update(keys, values, layer))
        return cache, slots

    def resident(key_blocks, value_blocks=None):
        """Suffix prefill with the prefix copied from memory as each layer starts; no I/O."""
        prefill.synchronize()
        begun = time.perf_counter()
        cache, slots = cache_with_prefix()
        prefill.loader = lambda layer: memory.get_into(layer, key_blocks, *slots[layer], value_blocks)
        try:
            logits = prefill.run(suffix, prefix, cache)
        finally:
            prefill.loader = None
        prefill.synchronize()
        return time.perf_counter() - begun, logits

    def issue_every_layer(requests, handles) -> None:
        """One request per layer (a Request keeps at most 4 layers in flight), each issuing its layer's
        reads now. Taking a request's eventfd starts the store's completion thread, which drives the
        I/O while this thread computes: without it a layer's reads progress only inside a wait or
        poll of this process (the package's CPU executor runs on the calling thread)."""
        for layer in range(layers):
            request = store.prepare_retrieve(prompt_list, retrieve_ids)
            requests.append(request)
            handles.append(request.retrieve_layer(layer))
            request.fileno()

    def through_tutti():
        memory.zero(target_first)  # what a retrieve did not write stays zero
        prefill.synchronize()
        begun = time.perf_counter()
        requests, handles = [], []
        try:
            issue_every_layer(requests, handles)
            issued = time.perf_counter()
            cache, slots = cache_with_prefix()
            waited = [0.0] * layers
            done_at = [0.0] * layers

            def load(layer: int) -> None:
                before = time.perf_counter()
                handles[layer].wait(WAIT_TIMEOUT_S)
                done_at[layer] = time.perf_counter()
                waited[layer] = done_at[layer] - before
                memory.get_into(layer, targets, *slots[layer])

            prefill.loader = load
            try:
                logits = prefill.run(suffix, prefix, cache)
            finally:
                prefill.loader = None
            prefill.synchronize()
            ended = time.perf_counter()
        finally:
            for request in requests:
                if request.layer_in_flight is not None:
                    request.wait(WAIT_TIMEOUT_S)
                request.finish()
        return {"ttft_s": ended - begun, "prepare_issue_s": issued - begun, "host_wait_s": sum(waited),
                "last_layer_s": done_at[-1] - begun, "logits": logits}

    def retrieve_only() -> float:
        """Every layer issued as in through_tutti, then waited in order with nothing else running:
        the retrieve's own time, for its GiB/s."""
        prefill.synchronize()
        begun = time.perf_counter()
        requests = []
        try:
            handles = []
            issue_every_layer(requests, handles)
            for handle in handles:
                handle.wait(WAIT_TIMEOUT_S)
            took = time.perf_counter() - begun
        finally:
            for request in requests:
                if request.layer_in_flight is not None:
                    request.wait(WAIT_TIMEOUT_S)
                request.finish()
        return took

    recompute_s, tutti_runs, resident_s, retrieve_s = [], [], [], []
    for repetition in range(args.warmup + args.repeats):
        seconds, reference = recompute()
        seconds_retrieve = retrieve_only()
        run = through_tutti()
        seconds_resident, resident_logits = resident(sources)
        if repetition >= args.warmup:
            recompute_s.append(seconds)
            tutti_runs.append(run)
            resident_s.append(seconds_resident)
            retrieve_s.append(seconds_retrieve)

    wrong_objects = memory.differing_blocks(layers, sources, targets)
    if wrong_objects:
        failures.append(f"prefix {prefix}: {wrong_objects} retrieved K/V objects differ from the stored ones")
    # The tutti path and the resident one run the same kernels on what should be the same bytes:
    # their logits agree to the last bit unless the retrieved KV (or its way into the cache) differs.
    same_error = logits_error(torch, resident_logits, tutti_runs[-1]["logits"])
    if not same_error <= tolerance / 100:
        failures.append(f"prefix {prefix}: the tutti path's logits differ from the same computation over the stored KV "
                        f"by {same_error:.3e} of the largest logit (tolerance {tolerance / 100:.0e})")
    error = logits_error(torch, reference, tutti_runs[-1]["logits"])
    if not error <= tolerance:
        failures.append(f"prefix {prefix}: the tutti path's logits differ from the recompute's by {error:.3e} "
                        f"of the largest logit (tolerance {tolerance:.0e})")
    # Negative control: wrong KV must fail the same tolerance, or the logits check could not catch
    # a wrong-KV bug on this model. Each prefix block's K is paired with the next block's V
    # (a permutation of whole K/V pairs would not do: attention over a fully visible prefix does
    # not depend on the pairs' order).
    if prefix_blocks > 1:
        _, wrong_logits = resident(sources, [(block + 1) % prefix_blocks for block in sources])
        control = logits_error(torch, reference, wrong_logits)
        control_l2 = logits_l2(torch, reference, wrong_logits)
        if not control > tolerance:
            failures.append(f"prefix {prefix}: wrong KV gives logits within the tolerance ({control:.3e}); "
                            "the check cannot tell wrong KV from right on this model")
    else:
        control = control_l2 = float("nan")
    moved = prefix_blocks * block_bytes
    return {
        "prompt_tokens": prompt_tokens, "prefix_tokens": prefix, "new_tokens": prompt_tokens - prefix,
        **timing_figures(recompute_s, tutti_runs, resident_s),
        "prepare_issue_ms": round(statistics.median(run["prepare_issue_s"] for run in tutti_runs) * 1e3, 3),
        "last_layer_ready_ms": round(statistics.median(run["last_layer_s"] for run in tutti_runs) * 1e3, 3),
        "retrieve_only_ms": median_ms(retrieve_s),
        "retrieve_bytes": moved,
        "retrieve_gib_per_s": round(moved / statistics.median(retrieve_s) / 2**30, 3),
        "logits_error": error, "negative_control_error": control, "logits_error_vs_resident": same_error,
        "logits_l2": logits_l2(torch, reference, tutti_runs[-1]["logits"]), "control_l2": control_l2, "wrong_objects": wrong_objects,
        "repeats": args.repeats, "warmup": args.warmup,
        "samples_ms": {"recompute": [round(s * 1e3, 3) for s in recompute_s],
                       "tutti": [round(run["ttft_s"] * 1e3, 3) for run in tutti_runs],
                       "resident": [round(s * 1e3, 3) for s in resident_s],
                       "host_wait": [round(run["host_wait_s"] * 1e3, 3) for run in tutti_runs]},
        "failures": failures,
    }


if __name__ == "__main__":
    main()
