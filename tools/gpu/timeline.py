"""Kernel timelines in the CSV format `tutti-profile import` reads (crates/scheduler/src/import.rs).

Standard library only, so that it is unit-tested without PyTorch (tools/gpu/test_timeline.py).
tools/gpu/slack-profile.py annotates every kernel group of its layer stack with a
`torch.profiler.record_function` range named by `annotation_name`, exports the profiler's Chrome
trace, and turns it into rows here:

- GPU: every kernel, memcpy and memset of the trace is attributed to the innermost annotation on
  the CPU thread that launched it (the launch is found by the `correlation` id kineto gives both).
  A kernel occupies min(blocks in its grid, SMs) SMs: a block runs on one SM, and a grid of at least
  one block per SM holds them all. Copies and memsets run on copy engines and occupy no SM.
- CPU (the `--device cpu --tiny` check): there are no kernels; every annotated group becomes one
  row spanning its range, occupying every SM.

Kernel names go into a CSV field that `import` splits on commas without quoting, and `import`
takes the first kernel of a layer whose name contains `attn` or `attention` as the point where the
layer needs its cached KV. So a name is `GROUP:SHORT`: SHORT is the kernel's name with every
character outside [A-Za-z0-9_.] replaced, cut to a bounded length, and, outside the `attention`
group, with `attn`/`attention` removed, so that only attention kernels mark the KV point.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from typing import Iterable, Sequence, TextIO

HEADER = "phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used"
ANNOTATION_PREFIX = "tutti"
ATTENTION_GROUP = "attention"
# The kernel groups of one decoder layer, in execution order (the analytic model's kernel list).
LAYER_GROUPS = (
    "input_norm",
    "qkv_proj",
    "rope_kv_store",
    ATTENTION_GROUP,
    "o_proj",
    "post_norm",
    "gate_up_proj",
    "silu_mul",
    "down_proj",
)
KERNEL_NAME_CHARS_MAX = 96

_KERNEL_CATEGORIES = {"kernel"}
_COPY_CATEGORIES = {"gpu_memcpy", "memcpy", "gpu_memset", "memset"}
_LAUNCH_CATEGORIES = {"cuda_runtime", "runtime", "cuda_driver", "driver"}
_ANNOTATION_CATEGORIES = {"user_annotation"}
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_.]+")
_ATTENTION_WORDS = re.compile(r"att(?:ention|n)", re.IGNORECASE)


class TimelineError(Exception):
    """The trace cannot be turned into a timeline `import` would accept."""


@dataclasses.dataclass(frozen=True)
class Row:
    phase: str  # "prefill" or "decode"
    input_tokens: int
    prefix_tokens: int | None  # None for decode rows
    layer: int | None  # None for decode rows
    kernel: str
    start_us: float
    end_us: float
    sms_used: int


@dataclasses.dataclass(frozen=True)
class Annotation:
    phase: str
    input_tokens: int
    prefix_tokens: int
    run: int
    layer: int
    group: str


def annotation_name(phase: str, input_tokens: int, prefix_tokens: int, run: int, layer: int, group: str) -> str:
    """The record_function name of one kernel group; `parse_annotation` reads it back."""
    return f"{ANNOTATION_PREFIX}:{phase}:{input_tokens}:{prefix_tokens}:{run}:{layer}:{group}"


def parse_annotation(name: str) -> Annotation | None:
    parts = name.split(":")
    if len(parts) != 7 or parts[0] != ANNOTATION_PREFIX or parts[1] not in ("prefill", "decode"):
        return None
    try:
        input_tokens, prefix_tokens, run, layer = (int(p) for p in parts[2:6])
    except ValueError:
        return None
    if parts[6] not in LAYER_GROUPS:
        return None
    return Annotation(parts[1], input_tokens, prefix_tokens, run, layer, parts[6])


def kernel_label(group: str, raw_name: str) -> str:
    """`GROUP:SHORT`, safe for the unquoted CSV and for import's attention rule."""
    short = _UNSAFE_CHARS.sub("_", raw_name).strip("_")
    if group != ATTENTION_GROUP:
        short = _ATTENTION_WORDS.sub("", short)
    short = short[:KERNEL_NAME_CHARS_MAX] or "kernel"
    return f"{group}:{short}"


def sms_from_grid(grid: object, sm_count: int) -> int:
    """SMs a kernel's grid occupies: one per block, at most all of them; unknown → all."""
    if isinstance(grid, (list, tuple)) and grid and all(isinstance(g, int) and g > 0 for g in grid):
        blocks = 1
        for g in grid:
            blocks *= g
        return min(blocks, sm_count)
    return sm_count


def prefill_grid(input_step_tokens: int, input_step_count: int, prefix_step_tokens: int) -> list[tuple[int, int]]:
    """Every (input, prefix) bucket of the table grid (crates/scheduler/src/table.rs), in order."""
    if min(input_step_tokens, input_step_count, prefix_step_tokens) <= 0:
        raise ValueError("grid steps and count must be positive")
    buckets = []
    for k in range(1, input_step_count + 1):
        input_tokens = k * input_step_tokens
        for j in range(0, input_tokens // prefix_step_tokens + 1):
            buckets.append((input_tokens, j * prefix_step_tokens))
    return buckets


def computed_split(input_tokens: int, prefix_tokens: int) -> tuple[int, int]:
    """(cached tokens, new tokens) the run computes for a bucket. A full hit still computes the
    prompt's last token, as engines do, so the bucket prefix = input runs 1 new token over input − 1."""
    new_tokens = max(input_tokens - prefix_tokens, 1)
    return input_tokens - new_tokens, new_tokens


def _category(event: dict) -> str:
    return str(event.get("cat", "")).lower()


def _span(event: dict) -> tuple[float, float]:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def _annotations(events: Sequence[dict]) -> list[tuple[Annotation, float, float, object]]:
    found = []
    for event in events:
        if event.get("ph") != "X" or _category(event) not in _ANNOTATION_CATEGORIES:
            continue
        annotation = parse_annotation(str(event.get("name", "")))
        if annotation is not None:
            start, end = _span(event)
            found.append((annotation, start, end, (event.get("pid"), event.get("tid"))))
    return found


def rows_from_gpu_trace(events: Sequence[dict], sm_count: int) -> tuple[dict[tuple, list[Row]], int]:
    """Device activity attributed to annotations: {(phase, input, prefix, run): rows} and the
    number of device events launched outside every annotation (warm-up, setup), which are left out.

    The groups' annotations never nest, so on each thread the annotation holding a launch is the
    last one that started at or before it, if it has not ended yet (a binary search)."""
    by_thread: dict[object, tuple[list[float], list[tuple[Annotation, float, float]]]] = {}
    for annotation, start, end, thread in sorted(_annotations(events), key=lambda a: a[1]):
        starts, spans = by_thread.setdefault(thread, ([], []))
        starts.append(start)
        spans.append((annotation, start, end))
    launches = {}
    for event in events:
        if event.get("ph") == "X" and _category(event) in _LAUNCH_CATEGORIES:
            correlation = (event.get("args") or {}).get("correlation")
            if correlation is not None:
                launches[correlation] = (float(event["ts"]), (event.get("pid"), event.get("tid")))
    by_run: dict[tuple, list[Row]] = {}
    unattributed = 0
    for event in events:
        category = _category(event)
        if event.get("ph") != "X" or (category not in _KERNEL_CATEGORIES and category not in _COPY_CATEGORIES):
            continue
        args = event.get("args") or {}
        owner = None
        launch = launches.get(args.get("correlation"))
        if launch is not None and launch[1] in by_thread:
            starts, spans = by_thread[launch[1]]
            index = bisect.bisect_right(starts, launch[0]) - 1
            if index >= 0 and launch[0] <= spans[index][2]:
                owner = spans[index][0]
        if owner is None:
            unattributed += 1
            continue
        start, end = _span(event)
        sms = sms_from_grid(args.get("grid"), sm_count) if category in _KERNEL_CATEGORIES else 0
        key = (owner.phase, owner.input_tokens, owner.prefix_tokens, owner.run)
        by_run.setdefault(key, []).append(_row(owner, kernel_label(owner.group, str(event.get("name", ""))), start, end, sms))
    return by_run, unattributed


def rows_from_cpu_trace(events: Sequence[dict], sm_count: int) -> dict[tuple, list[Row]]:
    """CPU mode: each annotated group is one row over its range, occupying every SM."""
    by_run: dict[tuple, list[Row]] = {}
    for annotation, start, end, _thread in _annotations(events):
        key = (annotation.phase, annotation.input_tokens, annotation.prefix_tokens, annotation.run)
        by_run.setdefault(key, []).append(_row(annotation, annotation.group, start, end, sm_count))
    return by_run


def rows_from_group_spans(spans: Iterable[tuple[Annotation, float, float]], sm_count: int) -> dict[tuple, list[Row]]:
    """CUDA-event mode: (annotation, start_us, end_us) per group, occupying every SM (the events
    say when a group ran, not how many SMs it held)."""
    by_run: dict[tuple, list[Row]] = {}
    for annotation, start, end in spans:
        key = (annotation.phase, annotation.input_tokens, annotation.prefix_tokens, annotation.run)
        by_run.setdefault(key, []).append(_row(annotation, annotation.group, start, end, sm_count))
    return by_run


def _row(annotation: Annotation, kernel: str, start: float, end: float, sms: int) -> Row:
    prefill = annotation.phase == "prefill"
    return Row(
        phase=annotation.phase,
        input_tokens=annotation.input_tokens,
        prefix_tokens=annotation.prefix_tokens if prefill else None,
        layer=annotation.layer if prefill else None,
        kernel=kernel,
        start_us=start,
        end_us=max(end, start),
        sms_used=sms,
    )


def span_us(rows: Sequence[Row]) -> float:
    return max(r.end_us for r in rows) - min(r.start_us for r in rows)


def median_run(runs: dict[int, list[Row]]) -> list[Row]:
    """Of several repetitions of one bucket, the one whose span is the median (lower middle)."""
    ordered = sorted(runs.items(), key=lambda item: (span_us(item[1]), item[0]))
    return ordered[(len(ordered) - 1) // 2][1]


def normalize(rows: Sequence[Row]) -> list[Row]:
    """Times relative to the bucket's first start (import only uses differences), in order."""
    origin = min(r.start_us for r in rows)
    shifted = [dataclasses.replace(r, start_us=r.start_us - origin, end_us=r.end_us - origin) for r in rows]
    return sorted(shifted, key=lambda r: (r.layer if r.layer is not None else -1, r.start_us, r.end_us, r.kernel))


def check_bucket(rows: Sequence[Row], layer_count: int) -> None:
    """What import requires of a prefill bucket: every layer present, each with an attention kernel."""
    if not rows:
        raise TimelineError("empty bucket")
    label = f"bucket(input_tokens={rows[0].input_tokens}, prefix_tokens={rows[0].prefix_tokens})"
    for layer in range(layer_count):
        names = [r.kernel for r in rows if r.layer == layer]
        if not names:
            raise TimelineError(f"{label} layer {layer}: no kernels attributed")
        if not any(ATTENTION_GROUP in n.lower() or "attn" in n.lower() for n in names):
            raise TimelineError(f"{label} layer {layer}: no attention kernel")


def format_row(row: Row) -> str:
    def optional(value: int | None) -> str:
        return "" if value is None else str(value)

    return ",".join(
        [
            row.phase,
            str(row.input_tokens),
            optional(row.prefix_tokens),
            optional(row.layer),
            row.kernel,
            f"{row.start_us:.3f}",
            f"{row.end_us:.3f}",
            str(row.sms_used),
        ]
    )


def write_csv(out: TextIO, rows: Iterable[Row], comments: Iterable[str] = ()) -> int:
    """Comment lines (`# …`), the header, then one line per row; returns the row count."""
    for comment in comments:
        for line in str(comment).splitlines() or [""]:
            out.write(f"# {line}\n")
    out.write(HEADER + "\n")
    count = 0
    for row in rows:
        if "," in row.kernel or "\n" in row.kernel:
            raise TimelineError(f"kernel name {row.kernel!r} would break the CSV")
        out.write(format_row(row) + "\n")
        count += 1
    return count
