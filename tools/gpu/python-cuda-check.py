#!/usr/bin/env python3
"""python-cuda-check: the tutti Python package's GPU route end to end (tools/gpu/run-all.sh python).

    python-cuda-check.py --socket PATH [--blocks N] [--device cuda|stand-in]

With tuttid already serving PATH (on emu: devices, --format, --device-memory cuda), it runs two
client processes (this script again, --role store / --role retrieve):
- store: allocates its KV cache as ONE torch CUDA int8 tensor and views a paged region per layer
  in it, as vLLM 0.32 does; registers the views (tutti.KvLayout.paged: CUDA tensors through
  DLPack, exported with CUDA IPC), fills N blocks with a pattern made on the GPU, stores the
  prompt layer by layer and commits; prints its GiB/s;
- retrieve: its own allocation, zeroed, registered the same way; looks the prompt up, retrieves
  it into other blocks, compares every byte with the pattern regenerated on the GPU; prints its
  GiB/s and how many bytes differ.
Exit 0 and a last line `PASS ...` when every byte matched; `FAIL ...` (exit 1) naming the step
otherwise, including when torch, CUDA or tutti is missing: this check never skips.

`--device stand-in` runs the same processes with tutti.DeviceMemoryStandIn instead of CUDA memory
and numpy instead of torch (tuttid --device-memory memfd): how tools/gpu/check.sh checks the
script's non-GPU parts on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

# Where the layers start in the allocation: not its first byte (the registered range's offset).
LEAD_BYTES = 64 << 10
PROMPT_SEED = 20261124


def fail(message: str) -> None:
    print(f"FAIL {message}", flush=True)
    sys.exit(1)


def prompt_tokens(blocks: int, block_tokens: int) -> list[int]:
    return [(i * 2654435761 ^ PROMPT_SEED) & 0x7FFFFFFF for i in range(blocks * block_tokens + 3)]


class Memory:
    """One process's KV allocation and per-layer paged views over it, on the GPU or the stand-in."""

    def __init__(self, device: str, layers: int, blocks: int, block_layer_bytes: int):
        self.device = device
        self.layer_bytes = blocks * block_layer_bytes
        self.block_layer_bytes = block_layer_bytes
        total = LEAD_BYTES + layers * self.layer_bytes
        if device == "cuda":
            import torch

            self.torch = torch
            # One allocation, as vLLM 0.32's allocate_kv_cache makes it.
            self.buffer = torch.zeros(total, dtype=torch.int8, device="cuda")
            self.views = [
                self.buffer[LEAD_BYTES + layer * self.layer_bytes : LEAD_BYTES + (layer + 1) * self.layer_bytes].view(blocks, -1)
                for layer in range(layers)
            ]
        else:
            import numpy as np
            import tutti

            self.np = np
            self.stand_in = tutti.DeviceMemoryStandIn(total)
            data = self.stand_in.numpy()
            self.views = [
                data[LEAD_BYTES + layer * self.layer_bytes : LEAD_BYTES + (layer + 1) * self.layer_bytes].reshape(blocks, -1)
                for layer in range(layers)
            ]

    def pattern(self, layer: int, block: int):
        """The bytes of prompt block `block` of `layer`, made where the memory is."""
        seed = PROMPT_SEED + layer * 100_003 + block
        if self.device == "cuda":
            generator = self.torch.Generator(device="cuda").manual_seed(seed)
            return self.torch.randint(-128, 128, (self.block_layer_bytes,), dtype=self.torch.int8, device="cuda", generator=generator)
        return self.np.random.default_rng(seed).integers(-128, 128, self.block_layer_bytes, dtype=self.np.int8).view(self.np.uint8)

    def fill(self, targets: list[int]) -> None:
        for layer, view in enumerate(self.views):
            for block, target in enumerate(targets):
                view[target] = self.pattern(layer, block)
        self.synchronize()

    def wrong_bytes(self, targets: list[int]) -> int:
        wrong = 0
        for layer, view in enumerate(self.views):
            for block, target in enumerate(targets):
                wrong += int((view[target] != self.pattern(layer, block)).sum())
        return wrong

    def synchronize(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


def client(args: argparse.Namespace) -> None:
    try:
        import tutti
    except ImportError as error:
        fail(f"{args.role}: import tutti: {error}")
    if args.device == "cuda":
        try:
            import torch
        except ImportError as error:
            fail(f"{args.role}: import torch: {error}")
        if not torch.cuda.is_available():
            fail(f"{args.role}: torch {torch.__version__} sees no CUDA device")
    fingerprint = tutti.fingerprint("tutti python-cuda-check", 1)
    store = tutti.Store.attach(args.socket, model_fingerprint=fingerprint, client_name=f"python-cuda-check-{args.role}", timeout_s=60.0)
    geometry = store.geometry
    block_layer_bytes = 2 * geometry.kv_heads * geometry.head_dim * geometry.dtype_bytes * geometry.block_tokens
    blocks = args.blocks
    memory = Memory(args.device, geometry.layers, 2 * blocks, block_layer_bytes)
    try:
        store.register_kv(tutti.KvLayout.paged(memory.views))
    except tutti.Error as error:
        fail(f"{args.role}: register_kv: {type(error).__name__}: {error}")
    prompt = prompt_tokens(blocks, geometry.block_tokens)
    moved_bytes = blocks * geometry.layers * block_layer_bytes
    if args.role == "store":
        sources = list(range(blocks))
        memory.fill(sources)
        started = time.perf_counter()
        request = store.prepare_store(prompt, sources)
        for layer in range(geometry.layers):
            request.store_layer(layer)
            request.wait(60.0)
        committed = request.commit()
        took = time.perf_counter() - started
        print(f"store: {moved_bytes} bytes ({blocks} blocks x {geometry.layers} layers), committed {committed} blocks, "
              f"{moved_bytes / took / 2**30:.2f} GiB/s", flush=True)
    else:
        found = store.lookup(prompt)
        if found != blocks:
            fail(f"retrieve: lookup found {found} of {blocks} blocks")
        targets = list(range(blocks, 2 * blocks))
        started = time.perf_counter()
        with store.prepare_retrieve(prompt, targets) as request:
            for layer in range(geometry.layers):
                request.retrieve_layer(layer)
                request.wait(60.0)
        took = time.perf_counter() - started
        memory.synchronize()
        wrong = memory.wrong_bytes(targets)
        print(f"retrieve: {moved_bytes} bytes, {moved_bytes / took / 2**30:.2f} GiB/s, wrong {wrong} of {moved_bytes} bytes compared",
              flush=True)
        if wrong:
            fail(f"retrieve: {wrong} of {moved_bytes} bytes differ")
    store.close()
    if store.leaked_registrations():
        fail(f"{args.role}: {store.leaked_registrations()} registered tensors kept at close (tuttid did not end the session)")
    print(f"{args.role}: ok", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", required=True, help="tuttid's socket (tuttid --device-memory cuda, or memfd for stand-in)")
    parser.add_argument("--blocks", type=int, default=64, help="full blocks in the prompt")
    parser.add_argument("--device", choices=("cuda", "stand-in"), default="cuda")
    parser.add_argument("--role", choices=("store", "retrieve"), help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="the longest each client process may run")
    args = parser.parse_args()
    if args.role:
        client(args)
        return
    print(f"python-cuda-check: {sys.executable}, device {args.device}, {args.blocks} blocks", flush=True)
    for role in ("store", "retrieve"):
        command = [sys.executable, __file__, "--socket", args.socket, "--blocks", str(args.blocks), "--device", args.device, "--role", role]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            fail(f"{role}: the client did not finish within {args.timeout_s} s")
        sys.stdout.write(done.stdout)
        sys.stdout.write(done.stderr)
        if done.returncode != 0:
            line = [text for text in done.stdout.splitlines() if text.startswith("FAIL ")]
            fail(line[-1][5:] if line else f"{role}: exit {done.returncode}")
    print(f"PASS python: {args.blocks} blocks stored from one process's {args.device} KV and retrieved by another's, every byte equal",
          flush=True)


if __name__ == "__main__":
    main()
