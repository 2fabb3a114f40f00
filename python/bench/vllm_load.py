"""The vLLM connector's load and save bandwidth by `layers_in_flight` and `queue_depth`,
interleaved in one run (docs/vllm.md, "Figures").

Starts a tuttid over a file (the software controller, O_DIRECT) formatted for one TP rank of
Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128, bf16, 16 tokens per block: 64 KiB per block
and layer), builds vLLM 0.32's worker-side `TuttiConnector` through vLLM's own connector factory
for each setting, and drives a prompt's save and load the way vLLM's model runner does
(bind_connector_metadata, start_load_kv, wait_for_layer_load / save_kv_layer per layer,
wait_for_save, get_finished), `--compute-us` of busy CPU per layer standing in for attention.
A setting is `N` (layers_in_flight N, the connector's default queue_depth) or `N@D` (queue_depth
D too). Each round runs every setting, in an order that turns one place a round and runs
backwards in every second group of as many rounds as there are settings (`round_order`); the
load's bytes are checked against
the saved ones every time. Prints per setting the median load and save bandwidth (GB/s, the
prompt's KV bytes over the wall time from the first call to the last; a save's time runs to
the committer's report, its flush included), and their ratios to the first setting.

usage: python vllm_load.py --tuttid target/release/tuttid [--rounds 2 x settings] [--prompt-tokens 4096]
       [--settings 1@64,1,2] [--compute-us 0] [--directory /var/tmp]
(the vLLM environment of tools/python/engine-env.sh vllm, with the tutti wheel installed)
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import socket as socket_module
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import tutti
from tutti.vllm import TuttiConnectorMetadata
from tutti.vllm.metadata import LoadSpec, SaveSpec

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16
START_TIMEOUT_S = 30.0
FINISH_TIMEOUT_S = 60.0


def round_order(settings: list[str], round_index: int) -> list[str]:
    """The settings in the order round `round_index` runs them. All settings share one pool file
    and each step saves before it loads, so the disk may still be writing back the previous
    setting's save: a cycle that only turns keeps each setting right after the same neighbour in
    every round (before 2026-12-01 it did). It turns one place a round and runs backwards in
    every second group of len(settings) rounds, so over 2 x len(settings) rounds each setting
    follows two different ones (tools/compare.sh orders its tools the same way)."""
    count = len(settings)
    cycle = list(reversed(settings)) if (round_index // count) % 2 else list(settings)
    shift = round_index % count
    return cycle[shift:] + cycle[:shift]


def default_rounds(settings: list[str]) -> int:
    """Rounds by default: both directions of the cycle, every rotation of each."""
    return 2 * len(settings)


def layer_names() -> list[str]:
    return [f"model.layers.{layer}.self_attn.attn" for layer in range(LAYERS)]


def start_tuttid(binary: str, directory: Path, pool_bytes: int, window_bytes: int) -> tuple[subprocess.Popen, str]:
    socket = str(directory / "tuttid.sock")
    command = [
        binary, "--socket", socket, "--lock-dir", str(directory / "locks"), "--metrics", "off",
        "--device", f"emu:{directory / 'pool.img'}", "--emu-create-bytes", str(pool_bytes), "--format",
        "--layers", str(LAYERS), "--kv-heads", str(KV_HEADS), "--head-dim", str(HEAD_DIM), "--dtype", "bf16",
        "--tokens-per-block", str(BLOCK_TOKENS), "--window-bytes-per-session", str(window_bytes),
    ]  # fmt: skip
    log = open(directory / "tuttid.log", "wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        probe = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
        try:
            probe.connect(socket)
            return process, socket
        except OSError:
            pass
        finally:
            probe.close()
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"tuttid did not start: {(directory / 'tuttid.log').read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)


def worker(socket: str, setting: str, num_blocks: int):
    """vLLM's worker-side connector for one rank, its KV caches in tuttid's window."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    transfer = KVTransferConfig(
        kv_connector="TuttiConnector",
        kv_connector_module_path="tutti.vllm",
        kv_role="kv_both",
        # The connector refuses vLLM's default "fail" (a tutti miss must be recomputed; docs/vllm.md).
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra_config(socket, setting),
    )
    config = VllmConfig(
        kv_transfer_config=transfer,
        cache_config=CacheConfig(block_size=BLOCK_TOKENS),
        parallel_config=ParallelConfig(tensor_parallel_size=1),
        device_config=DeviceConfig(device="cpu"),
    )
    spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    kv_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=page * num_blocks, layers=[name], layer_stride=page * num_blocks, block_stride=page)
            for name in layer_names()
        ],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=layer_names(), kv_cache_spec=spec)],
    )
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_config)
    caches = connector.allocate_kv_caches(kv_config)
    connector.register_kv_caches(caches)
    return connector, caches


def extra_config(socket: str, setting: str) -> dict:
    """The connector's extra config for a setting "N" or "N@D"."""
    layers, _, depth = setting.partition("@")
    extra = {"socket": socket, "timeout_s": 60.0, "layers_in_flight": int(layers)}
    if depth:
        extra["queue_depth"] = int(depth)
    return extra


def compute(microseconds: float) -> None:
    """Busy CPU standing in for a layer's attention (the forward holds the thread)."""
    if microseconds > 0:
        end = time.perf_counter() + microseconds / 1e6
        while time.perf_counter() < end:
            pass


def run_step(connector, caches, meta: TuttiConnectorMetadata, compute_us: float, sync_loads: bool) -> float:
    """One step in vLLM's model runner order; returns its wall time in seconds."""
    started = time.perf_counter()
    connector.handle_preemptions(meta)
    connector.bind_connector_metadata(meta)
    if sync_loads:
        connector.start_load_kv(None)
    for name in layer_names():
        connector.wait_for_layer_load(name)
        compute(compute_us)
        connector.save_kv_layer(name, caches[name], None)
    if not sync_loads:
        connector.start_load_kv(None)
    connector.wait_for_save()
    errors = connector.get_block_ids_with_load_errors()
    connector.clear_connector_metadata()
    if errors:
        raise SystemExit(f"the load reported failed blocks {sorted(errors)}")
    return time.perf_counter() - started


def save_time(connector, caches, req_id: str, tokens: list[int], blocks: list[int], compute_us: float) -> float:
    """A save's wall time, to the committer's report (the commit's flush included)."""
    started = time.perf_counter()
    run_step(connector, caches, TuttiConnectorMetadata(saves=[SaveSpec(req_id, tokens, blocks)]), compute_us, False)
    deadline = time.monotonic() + FINISH_TIMEOUT_S
    while req_id not in (connector.get_finished({req_id})[0] or set()):
        if time.monotonic() > deadline:
            raise SystemExit(f"the save of {req_id} was never reported")
        time.sleep(0.0005)
    return time.perf_counter() - started


def block_bytes(caches, blocks: list[int]) -> list[torch.Tensor]:
    return [caches[name][block] for name in layer_names() for block in blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tuttid", required=True)
    parser.add_argument("--rounds", type=int, default=None, help="default 2 x the settings (see round_order)")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--settings", default="1@64,1,2", help="layers_in_flight[@queue_depth], comma-separated")
    parser.add_argument("--compute-us", type=float, default=0.0, help="busy CPU per layer standing in for attention")
    parser.add_argument("--directory", default="/var/tmp", help="where the pool file goes (a disk, not tmpfs)")
    args = parser.parse_args()
    settings = args.settings.split(",")
    for setting in settings:  # a malformed one fails before tuttid starts
        try:
            extra_config("", setting)
        except ValueError:
            raise SystemExit(f"--settings: {setting!r} is not N or N@D (layers_in_flight[@queue_depth], whole numbers)") from None
    if args.rounds is None:
        args.rounds = default_rounds(settings)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if not Path(args.tuttid).is_file():
        raise SystemExit(f"--tuttid {args.tuttid}: no such file (cargo build --release -p tuttid: target/release/tuttid)")
    blocks = args.prompt_tokens // BLOCK_TOKENS
    if blocks < 1:
        raise SystemExit("--prompt-tokens must hold at least one block")
    block_bytes_per_layer = 2 * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2
    prompt_bytes = blocks * LAYERS * block_bytes_per_layer
    # Blocks 0..B-1 hold the prompt, B..2B-1 receive the loads; one spare.
    num_blocks = 2 * blocks + 1
    window_bytes = num_blocks * LAYERS * block_bytes_per_layer + (64 << 20)
    directory = Path(tempfile.mkdtemp(prefix="tutti-vllm-load-", dir=args.directory))
    process, socket = start_tuttid(args.tuttid, directory, pool_bytes=8 * prompt_bytes + (256 << 20), window_bytes=window_bytes)
    loads: dict[str, list[float]] = {setting: [] for setting in settings}
    saves: dict[str, list[float]] = {setting: [] for setting in settings}
    try:
        for round_index in range(args.rounds):
            for setting in round_order(settings, round_index):
                connector, caches = worker(socket, setting, num_blocks)
                try:
                    source = list(range(blocks))
                    target = list(range(blocks, 2 * blocks))
                    generator = torch.Generator().manual_seed(round_index * 100 + settings.index(setting))
                    for part in block_bytes(caches, source):
                        part.copy_(torch.randn(part.shape, generator=generator).to(part.dtype))
                    # A prompt of its own per round and setting: every save writes, every load reads.
                    seed = round_index * 7919 + settings.index(setting) * 104729
                    tokens = [(seed + index * 31) % 50_000 + 1 for index in range(blocks * BLOCK_TOKENS)]
                    saves[setting].append(prompt_bytes / save_time(connector, caches, f"S{round_index}-{setting}", tokens, source, args.compute_us) / 1e9)
                    for part in block_bytes(caches, target):
                        part.zero_()
                    meta = TuttiConnectorMetadata(loads=[LoadSpec(f"L{round_index}-{setting}", tokens, target)])
                    seconds = run_step(connector, caches, meta, args.compute_us, True)
                    loads[setting].append(prompt_bytes / seconds / 1e9)
                    if not all(torch.equal(a, b) for a, b in zip(block_bytes(caches, target), block_bytes(caches, source))):
                        raise SystemExit(f"setting {setting}: the loaded bytes differ from the saved ones")
                finally:
                    connector.shutdown()
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        shutil.rmtree(directory, ignore_errors=True)
    base_load, base_save = statistics.median(loads[settings[0]]), statistics.median(saves[settings[0]])
    report = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "prompt_tokens": blocks * BLOCK_TOKENS,
        "prompt_bytes": prompt_bytes,
        "rounds": args.rounds,
        "compute_us_per_layer": args.compute_us,
        "settings": {
            setting: {
                "load_gb_s_median": round(statistics.median(loads[setting]), 3),
                "save_gb_s_median": round(statistics.median(saves[setting]), 3),
                "load_ratio_to_first": round(statistics.median(loads[setting]) / base_load, 3),
                "save_ratio_to_first": round(statistics.median(saves[setting]) / base_save, 3),
                "load_gb_s": [round(value, 3) for value in loads[setting]],
                "save_gb_s": [round(value, 3) for value in saves[setting]],
            }
            for setting in settings
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
