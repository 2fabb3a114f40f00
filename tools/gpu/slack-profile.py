#!/usr/bin/env python3
"""Issue 15 item 4: a measured per-kernel timeline of a Llama-3.1-8B-shaped layer stack, in the CSV
format `tutti-profile import` reads (docs/scheduler.md, "Kernel timeline format").

The stack is 32 decoder layers of Llama-3.1-8B's shapes (hidden 4096, 32 query heads, 8 KV heads
of 128, MLP 14336, bf16) with random weights and PyTorch only: no model is downloaded. A layer is
the analytic model's kernel list (crates/scheduler/src/analytic.rs), each group under its own
`record_function` range: input RMSNorm, fused QKV projection, RoPE + KV-cache store, attention
(scaled_dot_product_attention over the cached prefix plus the new tokens, causal aligned to the
bottom right), O projection + residual, post-attention RMSNorm, fused gate/up projection, SiLU·mul,
down projection + residual. Embedding and LM head are left out, as in the analytic model.

For every bucket of the table grid (input lengths input_step × k, prefix lengths every
prefix_step up to the input; a full hit computes the last token over input − 1 cached ones) it
runs --warmup untimed forwards, then --repeats profiled ones, and keeps the repetition whose span
is the median. One decode step (1 token over the input length) is measured per input length.
Timing (--timing): `profiler` exports torch.profiler's trace and attributes every kernel to its
group (tools/gpu/timeline.py; SMs = min(grid blocks, SMs)); `events` records CUDA events around
each group (durations only: every group then counts as holding every SM).

Input lengths run in increasing order; before each, the time it will take is predicted from the
previous one, and the run stops before it would pass --budget-s. The CSV is rewritten after each
completed input length, so what is written is always a complete grid of the lengths done (the
table then ends at the last one; `tutti-profile simulate` needs the preset's prompt length, 32768,
in the grid: measure the rest in a second call with --input-first K and append that CSV's rows
and its '#' provenance lines (another session's machine, driver and date), without its header,
`grep -v '^phase,' second.csv >> first.csv`; import skips '#' lines anywhere).
--out-csv-gz also writes a gzip of the CSV each time: a complete grid's CSV (~135 000 rows of
~150 bytes) is ~20 MiB, over the 16 MiB the device tool brings back, so run-all.sh keeps the CSV
in its scratch directory for the import and puts only the gzip in $OUT (gunzip it here).
Provenance (machine, driver, versions, date, grid, choices) goes into the CSV's '#' lines and into
--out-provenance.

  python3 tools/gpu/slack-profile.py --device cuda --out-csv OUT.csv --out-provenance OUT.json
  python3 tools/gpu/slack-profile.py --device cpu --tiny --out-csv t.csv   # format check, no GPU
  tutti-profile import --timeline OUT.csv --model llama3-8b --gpu h100 --out table.json

STATUS: the CPU mode was checked against `tutti-profile import`; the GPU mode has never run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance as tree_provenance  # noqa: E402  (tools/gpu/provenance.py, standard library only)
import timeline  # noqa: E402  (tools/gpu/timeline.py, standard library only)


@dataclasses.dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5


LLAMA_3_1_8B = Dims(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, layers=32)
# Same layer count (the table must have the model's 32 layers), small tensors: a CPU format check.
TINY = Dims(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, layers=32)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small tensors and grid (the CPU format check)")
    parser.add_argument("--input-step", type=int, help="input length step (default 4096; tiny 64)")
    parser.add_argument("--input-count", type=int, help="number of input lengths (default 8; tiny 2)")
    parser.add_argument("--prefix-step", type=int, help="prefix length step (default 1024; tiny 32)")
    parser.add_argument("--input-first", type=int, default=1,
                        help="measure input lengths k × step for k >= this only (to finish a PARTIAL grid in a second call)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timing", choices=("profiler", "events"), default="profiler")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop before an input length would pass this")
    parser.add_argument("--sm-count", type=int, default=132, help="SMs of the table's GPU in CPU mode (default: H100's)")
    parser.add_argument("--out-csv", required=True)
    parser.add_argument("--out-csv-gz", help="also a gzip of the CSV, rewritten with it (run-all.sh puts this one in $OUT: "
                        "a complete grid's CSV is ~20 MiB, over what the device tool brings back)")
    parser.add_argument("--out-provenance")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    defaults = (64, 2, 32) if args.tiny else (4096, 8, 1024)
    args.input_step = args.input_step or defaults[0]
    args.input_count = args.input_count or defaults[1]
    args.prefix_step = args.prefix_step or defaults[2]
    if min(args.input_step, args.input_count, args.prefix_step, args.repeats) <= 0 or args.warmup < 0:
        parser.error("steps, counts and repeats must be positive, warm-up not negative")
    if not 1 <= args.input_first <= args.input_count:
        parser.error("--input-first must be in 1..input-count")
    if args.device == "cuda" and args.tiny:
        parser.error("--tiny is the CPU format check; the GPU run measures the real shapes")
    return args


class Stack:
    """The layer stack: weights, KV cache and the per-group forward, annotated by `group(layer, name)`."""

    def __init__(self, torch, dims: Dims, device: str, tokens_max: int, seed: int):
        self.torch = torch
        self.F = torch.nn.functional
        self.dims = dims
        dtype = torch.bfloat16
        generator = torch.Generator(device=device).manual_seed(seed)
        q_dim, kv_dim = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim

        def weight(rows: int, columns: int):
            return torch.randn(rows, columns, device=device, dtype=dtype, generator=generator) * (columns**-0.5)

        self.w_qkv = [weight(q_dim + 2 * kv_dim, dims.hidden) for _ in range(dims.layers)]
        self.w_o = [weight(dims.hidden, q_dim) for _ in range(dims.layers)]
        self.w_gate_up = [weight(2 * dims.intermediate, dims.hidden) for _ in range(dims.layers)]
        self.w_down = [weight(dims.hidden, dims.intermediate) for _ in range(dims.layers)]
        self.norm_in = [torch.ones(dims.hidden, device=device, dtype=dtype) for _ in range(dims.layers)]
        self.norm_post = [torch.ones(dims.hidden, device=device, dtype=dtype) for _ in range(dims.layers)]
        cache_shape = (1, dims.kv_heads, tokens_max, dims.head_dim)
        self.k_cache = [torch.randn(cache_shape, device=device, dtype=dtype, generator=generator) for _ in range(dims.layers)]
        self.v_cache = [torch.randn(cache_shape, device=device, dtype=dtype, generator=generator) for _ in range(dims.layers)]
        self.inputs = torch.randn(tokens_max, dims.hidden, device=device, dtype=dtype, generator=generator)
        self.inv_freq = 1.0 / (dims.rope_theta ** (torch.arange(0, dims.head_dim, 2, device=device, dtype=torch.float32) / dims.head_dim))
        self.gqa_native = self._probe_native_gqa(device)

    def _attend(self, q, k, v, prefix: int, new: int, native_gqa: bool):
        from torch.nn.attention.bias import causal_lower_right

        kwargs = {}
        if native_gqa:
            kwargs["enable_gqa"] = True
        else:
            repeat = self.dims.heads // self.dims.kv_heads
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        if prefix == 0:
            return self.F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        return self.F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(new, prefix + new), **kwargs)

    def _probe_native_gqa(self, device: str) -> bool:
        """Whether SDPA takes the KV heads as they are (enable_gqa) with a bottom-right causal mask
        and gives what the explicit repeat gives, for every kind of call the grid makes (no prefix,
        a prefix, a full hit's one token, a decode step; SDPA picks its kernel by shape); else the
        heads are repeated before attention for the whole run."""
        torch, d = self.torch, self.dims
        for prefix, new in ((0, 1024), (1024, 1024), (1023, 1), (1024, 1), (5, 3)):
            q = torch.randn(1, d.heads, new, d.head_dim, device=device, dtype=torch.bfloat16)
            k = torch.randn(1, d.kv_heads, prefix + new, d.head_dim, device=device, dtype=torch.bfloat16)
            v = torch.randn(1, d.kv_heads, prefix + new, d.head_dim, device=device, dtype=torch.bfloat16)
            try:
                native = self._attend(q, k, v, prefix, new, True)
            except (RuntimeError, TypeError, NotImplementedError, ValueError):
                return False
            repeated = self._attend(q, k, v, prefix, new, False)
            if not torch.allclose(native.float(), repeated.float(), atol=2e-2, rtol=2e-2):
                return False
        return True

    def _rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, prefix: int, new: int, group) -> None:
        """One prefill (or decode step) of `new` tokens over `prefix` cached ones."""
        torch, F, d = self.torch, self.F, self.dims
        q_dim, kv_dim = d.heads * d.head_dim, d.kv_heads * d.head_dim
        x = self.inputs[:new]
        # Rotary tables once per forward, as engines do, outside every layer.
        positions = torch.arange(prefix, prefix + new, device=x.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in range(d.layers):
            with group(layer, "input_norm"):
                h = F.rms_norm(x, (d.hidden,), self.norm_in[layer], d.rms_eps)
            with group(layer, "qkv_proj"):
                qkv = F.linear(h, self.w_qkv[layer])
            with group(layer, "rope_kv_store"):
                q, k, v = qkv.split((q_dim, kv_dim, kv_dim), dim=-1)
                q = q.view(new, d.heads, d.head_dim).transpose(0, 1).unsqueeze(0)
                k = k.view(new, d.kv_heads, d.head_dim).transpose(0, 1).unsqueeze(0)
                v = v.view(new, d.kv_heads, d.head_dim).transpose(0, 1).unsqueeze(0)
                q = self._rope(q, cos, sin)
                self.k_cache[layer][:, :, prefix : prefix + new].copy_(self._rope(k, cos, sin))
                self.v_cache[layer][:, :, prefix : prefix + new].copy_(v)
            with group(layer, timeline.ATTENTION_GROUP):
                keys = self.k_cache[layer][:, :, : prefix + new]
                values = self.v_cache[layer][:, :, : prefix + new]
                attended = self._attend(q, keys, values, prefix, new, self.gqa_native)
            with group(layer, "o_proj"):
                x = x + F.linear(attended.squeeze(0).transpose(0, 1).reshape(new, q_dim), self.w_o[layer])
            with group(layer, "post_norm"):
                h = F.rms_norm(x, (d.hidden,), self.norm_post[layer], d.rms_eps)
            with group(layer, "gate_up_proj"):
                gate_up = F.linear(h, self.w_gate_up[layer])
            with group(layer, "silu_mul"):
                gate, up = gate_up.chunk(2, dim=-1)
                activated = F.silu(gate) * up
            with group(layer, "down_proj"):
                x = x + F.linear(activated, self.w_down[layer])


def no_group(_layer: int, _name: str):
    return contextlib.nullcontext()


class EventGroups:
    """CUDA events around each group of one forward (the `events` timing)."""

    def __init__(self, torch):
        self.torch = torch
        self.pending: list[tuple[timeline.Annotation, object, object]] = []
        self.origin = None

    def begin(self):
        self.origin = self.torch.cuda.Event(enable_timing=True)
        self.origin.record()

    def group_for(self, phase: str, input_tokens: int, prefix_tokens: int, run: int):
        @contextlib.contextmanager
        def group(layer: int, name: str):
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((timeline.Annotation(phase, input_tokens, prefix_tokens, run, layer, name), start, end))

        return group

    def spans(self):
        self.torch.cuda.synchronize()
        spans = [(a, self.origin.elapsed_time(s) * 1000.0, self.origin.elapsed_time(e) * 1000.0) for a, s, e in self.pending]
        self.pending.clear()
        return spans


def provenance(torch, args: argparse.Namespace, dims: Dims, sm_count: int, gqa_native: bool) -> dict:
    info = {
        "tool": "tools/gpu/slack-profile.py",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": args.device,
        "sm_count": sm_count,
        "model": {"name": "llama3-8b-shaped (random weights)" if not args.tiny else "tiny (format check)", **dataclasses.asdict(dims)},
        "grid": {"input_step_tokens": args.input_step, "input_step_count": args.input_count, "prefix_step_tokens": args.prefix_step,
                 "input_first": args.input_first},
        "warmup": args.warmup,
        "repeats": args.repeats,
        "timing": args.timing,
        "attention": "scaled_dot_product_attention, causal lower-right; KV heads "
        + ("native (enable_gqa)" if gqa_native else "repeated to the query heads before attention"),
        "sms_used": "min(grid blocks, SMs) per kernel from the profiler; copies 0"
        if args.timing == "profiler" and args.device == "cuda"
        else "every group holds every SM (no per-kernel grid known)",
        "notes": "eager PyTorch, no CUDA graphs, fused QKV and gate/up weights; a bucket with prefix = input computes 1 token "
        "over input - 1 cached; one decode step (1 token over the input length) per input length",
    }
    # From git where this is a checkout, else from target/gpu-carry/COMMIT (.git does not travel to
    # the GPU machine; run-all.sh --prepare writes it).
    commit = tree_provenance.commit_info()
    info["git_commit"] = commit["commit"]
    info["git_commit_detail"] = commit
    if args.device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        info["gpu"] = properties.name
        info["gpu_memory_bytes"] = properties.total_memory
        info["cudnn"] = torch.backends.cudnn.version()
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"]
            info["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as error:
            info["nvidia_smi"] = f"unavailable: {error}"
    return info


def measure_input_length(torch, stack: Stack, args, input_tokens: int, buckets: list[tuple[int, int]], sm_count: int):
    """Rows of every bucket of one input length and its decode step: {(phase, input, prefix): rows}."""
    cuda = args.device == "cuda"
    work = [("prefill", input_tokens, prefix) for (i, prefix) in buckets if i == input_tokens]
    work.append(("decode", input_tokens, input_tokens))
    split = {item: (timeline.computed_split(input_tokens, item[2]) if item[0] == "prefill" else (input_tokens, 1)) for item in work}

    for item in work:
        for _ in range(args.warmup):
            stack.forward(*split[item], no_group)
    if cuda:
        torch.cuda.synchronize()

    if args.timing == "events":
        events = EventGroups(torch)
        events.begin()
        for item in work:
            for run in range(args.repeats):
                stack.forward(*split[item], events.group_for(item[0], input_tokens, item[2], run))
        by_run = timeline.rows_from_group_spans(events.spans(), sm_count)
        unattributed = 0
    else:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            for item in work:
                for run in range(args.repeats):

                    def group(layer, name, item=item, run=run):
                        return torch.profiler.record_function(timeline.annotation_name(item[0], input_tokens, item[2], run, layer, name))

                    stack.forward(*split[item], group)
            if cuda:
                torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "trace.json")
            profile.export_chrome_trace(path)
            with open(path) as trace_file:
                trace_events = json.load(trace_file).get("traceEvents", [])
        if cuda:
            by_run, unattributed = timeline.rows_from_gpu_trace(trace_events, sm_count)
        else:
            by_run, unattributed = timeline.rows_from_cpu_trace(trace_events, sm_count), 0

    result = {}
    for phase, input_length, prefix in work:
        runs = {key[3]: rows for key, rows in by_run.items() if key[:3] == (phase, input_length, prefix)}
        if len(runs) != args.repeats:
            raise timeline.TimelineError(f"{phase} input {input_length} prefix {prefix}: {len(runs)} of {args.repeats} runs in the trace")
        rows = timeline.normalize(timeline.median_run(runs))
        if phase == "prefill":
            timeline.check_bucket(rows, stack.dims.layers)
        result[(phase, input_length, prefix)] = rows
    return result, unattributed


def write_outputs(args, rows_by_bucket: dict, info: dict) -> int:
    ordered = sorted(rows_by_bucket.items(), key=lambda item: (item[0][0] != "prefill", item[0][1], item[0][2]))
    comments = ["tutti kernel timeline (tools/gpu/slack-profile.py); provenance:"]
    comments += [f"{key}: {json.dumps(value, sort_keys=True)}" for key, value in info.items()]
    temporary = args.out_csv + ".partial"
    with open(temporary, "w") as out:
        count = timeline.write_csv(out, (row for _key, rows in ordered for row in rows), comments)
    os.replace(temporary, args.out_csv)
    if args.out_csv_gz:
        # mtime 0: the same rows give the same bytes. About 1 s per 20 MiB at level 6.
        with open(args.out_csv, "rb") as source, open(args.out_csv_gz + ".partial", "wb") as raw:
            with gzip.GzipFile(filename=os.path.basename(args.out_csv), mode="wb", compresslevel=6, fileobj=raw, mtime=0) as out:
                shutil.copyfileobj(source, out, 1 << 20)
        os.replace(args.out_csv_gz + ".partial", args.out_csv_gz)
    if args.out_provenance:
        with open(args.out_provenance + ".partial", "w") as out:
            json.dump(info, out, indent=1, sort_keys=True)
            out.write("\n")
        os.replace(args.out_provenance + ".partial", args.out_provenance)
    return count


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("slack-profile: no CUDA device visible to PyTorch", file=sys.stderr)
            return 1
        sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    else:
        if args.timing == "events":
            print("slack-profile: --timing events needs CUDA", file=sys.stderr)
            return 2
        sm_count = args.sm_count
    dims = TINY if args.tiny else LLAMA_3_1_8B
    buckets = timeline.prefill_grid(args.input_step, args.input_count, args.prefix_step)
    input_lengths = sorted({i for i, _ in buckets})
    stack = Stack(torch, dims, args.device, input_lengths[-1] + 1, args.seed)
    input_lengths = [i for i in input_lengths if i >= args.input_first * args.input_step]
    info = provenance(torch, args, dims, sm_count, stack.gqa_native)
    print(f"slack-profile: {info.get('gpu', 'cpu')}, {sm_count} SMs, torch {torch.__version__}, {len(buckets)} buckets, "
          f"inputs {input_lengths}, attention: {info['attention']}", flush=True)

    rows_by_bucket: dict = {}
    previous_s = None
    completed = []
    for index, input_tokens in enumerate(input_lengths):
        elapsed = time.monotonic() - started
        if previous_s is not None:
            growth = (input_tokens / input_lengths[index - 1]) ** 2  # attention grows quadratically
            if elapsed + previous_s * growth > args.budget_s:
                print(f"slack-profile: stopping before input {input_tokens} (predicted {previous_s * growth:.0f} s, "
                      f"{args.budget_s - elapsed:.0f} s of budget left)", flush=True)
                break
        began = time.monotonic()
        measured, unattributed = measure_input_length(torch, stack, args, input_tokens, buckets, sm_count)
        previous_s = time.monotonic() - began
        rows_by_bucket.update(measured)
        completed.append(input_tokens)
        info["completed_input_tokens"] = completed
        info["input_step_count_completed"] = len(completed)
        info.setdefault("unattributed_device_events", 0)
        info["unattributed_device_events"] += unattributed
        info.setdefault("seconds_per_input_length", {})[str(input_tokens)] = round(previous_s, 2)
        info["bucket_span_us"] = {
            f"{k[0]}:{k[1]}:{k[2]}": round(timeline.span_us(rows), 1) for k, rows in sorted(rows_by_bucket.items())
        }
        count = write_outputs(args, rows_by_bucket, info)
        print(f"slack-profile: input {input_tokens}: {previous_s:.1f} s, {count} rows so far -> {args.out_csv}", flush=True)
    if not completed:
        print("slack-profile: no input length completed within the budget", file=sys.stderr)
        return 1
    if len(completed) < len(input_lengths):
        print(f"slack-profile: PARTIAL grid: inputs up to {completed[-1]} of {input_lengths[-1]}", flush=True)
        return 3
    print(f"slack-profile: done in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
