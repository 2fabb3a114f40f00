"""Python's cost per layer call against the Rust figure, on the same device kind, interleaved in
one run (docs/python.md, "Figures").

Each round runs `tutti-bench --workload kv` (Rust: objstore's KvStore, SeparateKv engine memory,
the retrieve phase's per-layer `retrieve_layer` + `wait` latencies and its bandwidth = bytes over
the layers' time) and the same retrieve through `tutti` (an in-process Store on its own
`emu:mem:` controller, allocate_kv("separate"), queue depth 1024 as tutti-bench uses), both with
BLOCKS_PER_SLOT blocks per slot and LAYERS_IN_FLIGHT layer in flight: tutti-bench is told them
(its defaults, 16 and 2 since 2026-11-24, are not the binding's) and a report of other settings
is refused. Then:

- per layer: median of retrieve_layer + wait, Rust vs Python, both `statistics.median` of the
  layers' times (the difference is Python's cost);
- retrieve bandwidth: median over rounds, Rust vs Python, and their ratio;
- the bare call costs: Request.retrieve_layer (the issue, no I/O) and Request.wait with nothing
  in flight (a call into Rust that releases the GIL and takes the store's lock).

usage: python layer_overhead.py --tutti-bench target/release/tutti-bench [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 8, 8, 128, 16
PROMPT_TOKENS = 2048  # 128 blocks; hit rate 0.5: 64 blocks retrieved (32 MiB)
# Both sides: one block per slot (a layer is 64 commands of 64 KiB) and one layer in flight (the
# Python loop issues a layer and waits for it before the next, so a layer's time runs from its
# issue to its wait on both sides). Before 2026-12-01 tutti-bench ran its own defaults, 16 blocks
# per slot and 2 layers in flight, against the binding's 1 and 1.
BLOCKS_PER_SLOT, LAYERS_IN_FLIGHT = 1, 1


class MismatchedRound(Exception):
    """tutti-bench's report names other settings than the Python store's: not comparable."""


def rust_round(binary: str, seed: int) -> tuple[float, float]:
    """(median per-layer retrieve latency in µs, retrieve bandwidth in GB/s) of tutti-bench."""
    command = [binary, "--workload", "kv", "--device", "emu:mem:1g", "--layers", str(LAYERS), "--kv-heads", str(KV_HEADS),
               "--head-dim", str(HEAD_DIM), "--prompt-tokens", str(PROMPT_TOKENS), "--hit-rate", "0.5", "--seed", str(seed),
               "--blocks-per-slot", str(BLOCKS_PER_SLOT), "--layers-in-flight", str(LAYERS_IN_FLIGHT), "--output-format", "json"]
    report = json.loads(subprocess.run(command, check=True, capture_output=True, text=True, timeout=300).stdout)
    options = report.get("global options", {})
    ran = {name: options.get(name) for name in ("blocks_per_slot", "layers_in_flight")}
    if ran != {"blocks_per_slot": BLOCKS_PER_SLOT, "layers_in_flight": LAYERS_IN_FLIGHT}:
        raise MismatchedRound(f"tutti-bench ran {ran}, the Python store {BLOCKS_PER_SLOT} block(s) per slot and "
                              f"{LAYERS_IN_FLIGHT} layer(s) in flight: refusing to compare the round")
    phase = next(phase for phase in report["phases"] if phase["phase"].startswith("retrieve"))
    # The median as the Python side takes it: tutti-bench's own p50 is sorted[round((n-1)/2)],
    # the upper of the two middle values for an even number of layers.
    latency_ns = statistics.median(layer["lat_ns"] for layer in phase["layers"])
    return latency_ns / 1e3, phase["bw_bytes"] / 1e9


def python_round(seed: int, calls: dict[str, list[float]]) -> tuple[float, float]:
    # Imported here, not at the top: the Rust side's checks are tested without the binding
    # (test_layer_overhead.py).
    import numpy as np

    import tutti

    geometry = tutti.ModelGeometry(LAYERS, KV_HEADS, HEAD_DIM, 2, BLOCK_TOKENS)
    blocks = PROMPT_TOKENS // BLOCK_TOKENS
    cached = blocks // 2
    rng = np.random.default_rng(seed)
    tokens = [int(token) for token in rng.integers(0, 2**31, PROMPT_TOKENS)]
    with tutti.Store.open("emu:mem:1g", geometry, format=True, queue_depth=1024, blocks_per_slot=BLOCKS_PER_SLOT,
                          layers_in_flight=LAYERS_IN_FLIGHT) as store:
        if store.layers_in_flight != LAYERS_IN_FLIGHT:
            raise MismatchedRound(f"the Python store has {store.layers_in_flight} layers in flight, not {LAYERS_IN_FLIGHT}")
        layout = store.allocate_kv(blocks, "separate")
        for tensor in layout.tensors:
            np.from_dlpack(tensor)[:] = rng.integers(0, 256, tensor.nbytes, dtype=np.uint8)
        request = store.prepare_store(tokens[: cached * BLOCK_TOKENS], list(range(cached)))
        for layer in range(LAYERS):
            request.store_layer(layer)
            request.wait(60)
        request.commit()
        assert store.lookup(tokens) == cached
        request = store.prepare_retrieve(tokens[: cached * BLOCK_TOKENS], list(range(cached)))
        latencies = []
        for layer in range(LAYERS):
            started = time.perf_counter_ns()
            request.retrieve_layer(layer)
            request.wait(60)
            latencies.append(time.perf_counter_ns() - started)
        request.finish()
        # The bare calls: an issue whose I/O is then waited for outside the timing, and a wait
        # with nothing in flight.
        request = store.prepare_retrieve(tokens[: cached * BLOCK_TOKENS], list(range(cached)))
        for layer in range(LAYERS):
            started = time.perf_counter_ns()
            request.retrieve_layer(layer)
            calls["retrieve_layer (issue)"].append((time.perf_counter_ns() - started) / 1e3)
            request.wait(60)
            started = time.perf_counter_ns()
            request.wait(60)
            calls["wait (nothing in flight)"].append((time.perf_counter_ns() - started) / 1e3)
        request.finish()
    bytes_per_layer = cached * 2 * geometry.object_bytes
    return statistics.median(latencies) / 1e3, bytes_per_layer * LAYERS / (sum(latencies) / 1e9) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tutti-bench", required=True)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rust_latency, rust_bandwidth, python_latency, python_bandwidth = [], [], [], []
    calls: dict[str, list[float]] = {"retrieve_layer (issue)": [], "wait (nothing in flight)": []}
    for round_index in range(args.rounds):
        latency, bandwidth = rust_round(args.tutti_bench, round_index + 1)
        rust_latency.append(latency)
        rust_bandwidth.append(bandwidth)
        latency, bandwidth = python_round(round_index + 1, calls)
        python_latency.append(latency)
        python_bandwidth.append(bandwidth)
    median = statistics.median
    print(f"machine: {platform.node()}, {platform.processor() or platform.machine()}; {args.rounds} interleaved rounds")
    print(f"model: {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} dims, bf16, {BLOCK_TOKENS}-token blocks; "
          f"{PROMPT_TOKENS // BLOCK_TOKENS // 2} blocks retrieved per round ({PROMPT_TOKENS // BLOCK_TOKENS // 2 * 2 * LAYERS * 32} KiB); "
          f"both sides {BLOCKS_PER_SLOT} block(s) per slot, {LAYERS_IN_FLIGHT} layer(s) in flight")
    print(f"per layer (retrieve_layer + wait), median of round medians: Rust {median(rust_latency):.1f} µs, "
          f"Python {median(python_latency):.1f} µs, difference {median(python_latency) - median(rust_latency):+.1f} µs")
    print(f"retrieve bandwidth, median: Rust {median(rust_bandwidth):.2f} GB/s, Python {median(python_bandwidth):.2f} GB/s, "
          f"Python/Rust {median(python_bandwidth) / median(rust_bandwidth):.3f} "
          f"(Rust {min(rust_bandwidth):.2f}-{max(rust_bandwidth):.2f}, Python {min(python_bandwidth):.2f}-{max(python_bandwidth):.2f})")
    for name, values in calls.items():
        print(f"{name}: median {median(values):.2f} µs, p90 {sorted(values)[int(0.9 * (len(values) - 1))]:.2f} µs over {len(values)} calls")


if __name__ == "__main__":
    main()
