"""Tests of tools/gpu/timeline.py (standard library only): run with
`python3 -m unittest discover -s tools/gpu -p 'test_*.py'` (tools/gpu/check.sh does).

Each test builds a small kineto-style Chrome trace by hand: annotations (`user_annotation`) on the
CPU thread, launches (`cuda_runtime`) inside them, and device events (`kernel`, `gpu_memcpy`)
on a GPU stream, tied to their launch by `correlation`, as torch.profiler exports them.
"""

import gzip
import importlib.util
import io
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timeline  # noqa: E402

CPU_THREAD = {"pid": 100, "tid": 100}
GPU_STREAM = {"pid": 0, "tid": 7}


class Trace:
    """Builds events: one annotation per group, launches and kernels in it."""

    def __init__(self):
        self.events = []
        self.correlation = 0
        self.clock_us = 0.0

    def annotate(self, name, duration_us=10.0):
        event = {"ph": "X", "cat": "user_annotation", "name": name, "ts": self.clock_us, "dur": duration_us, **CPU_THREAD}
        self.events.append(event)
        return event

    def launch(self, at_us, kernel_name, start_us, end_us, grid=(264, 1, 1), category="kernel"):
        self.correlation += 1
        self.events.append(
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": at_us, "dur": 1.0,
             "args": {"correlation": self.correlation}, **CPU_THREAD}
        )
        args = {"correlation": self.correlation}
        if grid is not None:
            args["grid"] = list(grid)
        self.events.append({"ph": "X", "cat": category, "name": kernel_name, "ts": start_us, "dur": end_us - start_us, "args": args,
                            **GPU_STREAM})

    def layer(self, input_tokens, prefix_tokens, run, layer, groups=timeline.LAYER_GROUPS, kernel_name=None):
        """One annotation per group, each launching one kernel that runs 5 µs on the GPU."""
        for group in groups:
            start = self.clock_us
            self.annotate(timeline.annotation_name("prefill", input_tokens, prefix_tokens, run, layer, group))
            self.launch(start + 2.0, kernel_name or f"{group}_kernel<float, 4>", start + 50.0, start + 55.0)
            self.clock_us += 20.0


class AnnotationNames(unittest.TestCase):
    def test_round_trip(self):
        name = timeline.annotation_name("prefill", 4096, 1024, 2, 31, "gate_up_proj")
        self.assertEqual(timeline.parse_annotation(name), timeline.Annotation("prefill", 4096, 1024, 2, 31, "gate_up_proj"))

    def test_foreign_names_are_ignored(self):
        for name in ("aten::mm", "tutti:prefill:1:2:3:4", "tutti:prefill:a:0:0:0:qkv_proj", "tutti:train:1:0:0:0:qkv_proj",
                     "tutti:prefill:1:0:0:0:unknown_group", "ProfilerStep#3"):
            self.assertIsNone(timeline.parse_annotation(name), name)


class KernelLabels(unittest.TestCase):
    def test_commas_and_templates_become_one_safe_field(self):
        label = timeline.kernel_label("qkv_proj", "void cutlass::Kernel2<cutlass_80_gemm_bf16, 128x128>(Params, int)")
        self.assertNotIn(",", label)
        self.assertRegex(label, r"^qkv_proj:[A-Za-z0-9_.]+$")

    def test_only_the_attention_group_can_mark_the_kv_point(self):
        # import takes the first kernel whose name holds `attn` or `attention` as the KV point.
        for group in ("rope_kv_store", "o_proj"):
            label = timeline.kernel_label(group, "fused_attn_helper_Attention_kernel")
            self.assertNotIn("attn", label.lower())
            self.assertNotIn("attention", label.lower())
        self.assertIn("attn", timeline.kernel_label("attention", "flash_attn_fwd").lower())

    def test_long_and_empty_names_are_bounded(self):
        self.assertLessEqual(len(timeline.kernel_label("silu_mul", "x" * 5000)), len("silu_mul:") + timeline.KERNEL_NAME_CHARS_MAX)
        self.assertEqual(timeline.kernel_label("silu_mul", "<<>>"), "silu_mul:kernel")


class Grid(unittest.TestCase):
    def test_matches_the_table_grid(self):
        self.assertEqual(timeline.prefill_grid(64, 2, 32), [(64, 0), (64, 32), (64, 64), (128, 0), (128, 32), (128, 64), (128, 96), (128, 128)])
        self.assertEqual(len(timeline.prefill_grid(4096, 8, 1024)), sum(4 * k + 1 for k in range(1, 9)))

    def test_a_full_hit_computes_one_token(self):
        self.assertEqual(timeline.computed_split(4096, 4096), (4095, 1))
        self.assertEqual(timeline.computed_split(4096, 1024), (1024, 3072))
        self.assertEqual(timeline.computed_split(4096, 0), (0, 4096))

    def test_rejects_empty_grids(self):
        with self.assertRaises(ValueError):
            timeline.prefill_grid(0, 1, 1)


class GpuTrace(unittest.TestCase):
    def test_kernels_go_to_the_group_that_launched_them(self):
        trace = Trace()
        trace.layer(128, 64, 0, 0)
        trace.layer(128, 64, 0, 1)
        by_run, unattributed = timeline.rows_from_gpu_trace(trace.events, sm_count=132)
        self.assertEqual(unattributed, 0)
        rows = by_run[("prefill", 128, 64, 0)]
        self.assertEqual(len(rows), 2 * len(timeline.LAYER_GROUPS))
        first = [r for r in rows if r.layer == 0]
        self.assertEqual([r.kernel.split(":")[0] for r in first], list(timeline.LAYER_GROUPS))
        # Annotation k starts at 20k µs; its kernel runs from 20k + 50 to 20k + 55 on the GPU.
        attention = first[timeline.LAYER_GROUPS.index("attention")]
        self.assertEqual((attention.start_us, attention.end_us), (110.0, 115.0))
        self.assertEqual(attention.sms_used, 132)  # 264 blocks: every SM

    def test_sms_come_from_the_grid_and_copies_hold_none(self):
        trace = Trace()
        trace.annotate(timeline.annotation_name("prefill", 64, 0, 0, 0, "attention"), duration_us=30.0)
        trace.launch(1.0, "flash_fwd", 40.0, 50.0, grid=(8, 2, 1))
        trace.launch(2.0, "Memcpy DtoD", 50.0, 52.0, grid=None, category="gpu_memcpy")
        trace.launch(3.0, "odd", 52.0, 53.0, grid=None)
        rows = timeline.rows_from_gpu_trace(trace.events, sm_count=132)[0][("prefill", 64, 0, 0)]
        self.assertEqual([r.sms_used for r in rows], [16, 0, 132])  # unknown grid: assume all SMs

    def test_kernels_launched_outside_annotations_are_counted_not_kept(self):
        trace = Trace()
        trace.launch(500.0, "warmup_gemm", 600.0, 610.0)  # no annotation around it
        trace.layer(64, 0, 0, 0)
        by_run, unattributed = timeline.rows_from_gpu_trace(trace.events, sm_count=132)
        self.assertEqual(unattributed, 1)
        self.assertNotIn("warmup_gemm", " ".join(r.kernel for r in by_run[("prefill", 64, 0, 0)]))

    def test_annotations_on_another_thread_do_not_claim_a_launch(self):
        trace = Trace()
        trace.annotate(timeline.annotation_name("prefill", 64, 0, 0, 0, "qkv_proj"), duration_us=50.0)
        trace.events[-1]["tid"] = 999
        trace.launch(5.0, "gemm", 10.0, 20.0)
        by_run, unattributed = timeline.rows_from_gpu_trace(trace.events, sm_count=132)
        self.assertEqual((by_run, unattributed), ({}, 1))

    def test_repetitions_keep_the_median_run(self):
        runs = {}
        for run, span in enumerate((30.0, 10.0, 20.0)):
            runs[run] = [timeline.Row("prefill", 64, 0, 0, "attention:k", 100.0, 100.0 + span, 132)]
        self.assertEqual(timeline.median_run(runs)[0].end_us, 120.0)


class Export(unittest.TestCase):
    def rows_for_bucket(self, layer_count, groups=timeline.LAYER_GROUPS):
        trace = Trace()
        for layer in range(layer_count):
            trace.layer(64, 32, 0, layer, groups=groups)
        return timeline.normalize(timeline.rows_from_gpu_trace(trace.events, sm_count=132)[0][("prefill", 64, 32, 0)])

    def test_csv_has_the_import_header_and_eight_fields(self):
        rows = self.rows_for_bucket(2)
        decode = timeline.Row("decode", 64, None, None, "down_proj:gemm", 0.0, 12.5, 132)
        out = io.StringIO()
        count = timeline.write_csv(out, rows + [decode], comments=["provenance: x", "two\nlines"])
        lines = out.getvalue().splitlines()
        self.assertEqual(lines[:3], ["# provenance: x", "# two", "# lines"])
        self.assertEqual(lines[3], "phase,input_tokens,prefix_tokens,layer,kernel,start_us,end_us,sms_used")
        self.assertEqual(count, len(rows) + 1)
        self.assertTrue(all(len(line.split(",")) == 8 for line in lines[3:]))
        self.assertEqual(lines[4], "prefill,64,32,0,input_norm:input_norm_kernel_float_4,0.000,5.000,132")  # normalized
        self.assertEqual(lines[-1], "decode,64,,,down_proj:gemm,0.000,12.500,132")

    def test_bucket_without_attention_is_refused_before_import_would(self):
        rows = self.rows_for_bucket(1, groups=("input_norm", "qkv_proj"))
        with self.assertRaisesRegex(timeline.TimelineError, "no attention kernel"):
            timeline.check_bucket(rows, layer_count=1)

    def test_bucket_missing_a_layer_is_refused(self):
        with self.assertRaisesRegex(timeline.TimelineError, "layer 2: no kernels"):
            timeline.check_bucket(self.rows_for_bucket(2), layer_count=3)

    def test_a_name_with_a_comma_never_reaches_the_file(self):
        bad = timeline.Row("prefill", 64, 0, 0, "attention:a,b", 0.0, 1.0, 1)
        with self.assertRaises(timeline.TimelineError):
            timeline.write_csv(io.StringIO(), [bad])


class CpuTrace(unittest.TestCase):
    def test_each_group_is_one_row_holding_every_sm(self):
        trace = Trace()
        trace.layer(64, 0, 0, 0)
        rows = timeline.rows_from_cpu_trace(trace.events, sm_count=132)[("prefill", 64, 0, 0)]
        self.assertEqual([r.kernel for r in rows], list(timeline.LAYER_GROUPS))
        self.assertEqual({r.sms_used for r in rows}, {132})
        self.assertEqual(rows[0].end_us - rows[0].start_us, 10.0)


# Kernel names as torch.profiler reports them for one eager layer of slack-profile.py's stack on an
# H100/H200 (cuBLAS GEMMs, flash attention, ATen elementwise, reduction, cat and copy kernels): 27
# per layer, most longer than KERNEL_NAME_CHARS_MAX once made safe.
_ELEMENTWISE = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
                "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, at::detail::Array<char*, 3> >(int, "
                "at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, "
                "at::detail::Array<char*, 3>)")
_REDUCE = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, "
           "unsigned int, c10::BFloat16, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, "
           "unsigned int, c10::BFloat16, 4>)")
_GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas"
_FLASH = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
          "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>"
          "(pytorch_flash::Flash_fwd_params)")
_CAT = ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
        "unsigned int, 4, 64, 64>(at::native::(anonymous namespace)::OpaqueType<2u>*, "
        "at::native::(anonymous namespace)::CatArrInputTensorMetadata<at::native::(anonymous namespace)::OpaqueType<2u>, "
        "unsigned int, 64, 64>, at::native::(anonymous namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned int)")
_COPY = ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda("
         "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#12}::operator()() const::{lambda(c10::BFloat16)#1}> "
         ">(at::TensorIteratorBase&, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() "
         "const::{lambda()#12}::operator()() const::{lambda(c10::BFloat16)#1} const&)::{lambda(int)#1}>(int, "
         "at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>)")
REALISTIC_LAYER = (
    [("input_norm", name) for name in (_ELEMENTWISE, _REDUCE, _ELEMENTWISE, _ELEMENTWISE, _ELEMENTWISE)]
    + [("qkv_proj", _GEMM)]
    + [("rope_kv_store", name) for name in (_ELEMENTWISE, _ELEMENTWISE, _ELEMENTWISE, _CAT, _ELEMENTWISE, _ELEMENTWISE,
                                            _ELEMENTWISE, _CAT, _COPY, _COPY)]
    + [("attention", _FLASH)]
    + [("o_proj", _GEMM), ("o_proj", _ELEMENTWISE)]
    + [("post_norm", name) for name in (_ELEMENTWISE, _REDUCE, _ELEMENTWISE, _ELEMENTWISE)]
    + [("gate_up_proj", _GEMM), ("silu_mul", _ELEMENTWISE), ("down_proj", _GEMM)]
)
HERE = os.path.dirname(os.path.abspath(__file__))
RESULT_FILE_BYTES_MAX = 16 << 20  # the device tool brings back no file over 16 MiB


def slack_profile_module():
    spec = importlib.util.spec_from_file_location("slack_profile", os.path.join(HERE, "slack-profile.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # no torch at import time: main() imports it
    return module


def run_all_slack_args(out: str, work: str) -> list[str]:
    """The output options run-all.sh's slack step gives slack-profile.py, with $OUT and $WORK."""
    with open(os.path.join(HERE, "run-all.sh")) as handle:
        match = re.search(r'^\s*local args=\("\$\{device_args\[@\]\}" (.*)\)\s*$', handle.read(), re.MULTILINE)
    assert match, "run-all.sh's step_slack no longer has its `local args=(\"${device_args[@]}\" ...)` line"
    return [word.replace("$OUT", out).replace("$WORK", work) for word in shlex.split(match.group(1))]


class SlackOutputSize(unittest.TestCase):
    def test_the_full_grid_with_real_kernel_names_comes_back_from_out(self):
        # Goal: a complete slack grid (inputs 4096 x 1..8, prefixes every 1024: 152 buckets, 32
        # layers of 27 kernels, plus the decode steps) written as run-all.sh's slack step has
        # slack-profile.py write it leaves no file in $OUT over the tool's 16 MiB, and the
        # CSV the import reads still has every row.
        profile = slack_profile_module()
        generator = random.Random(1)
        rows = {}
        layers = 32
        for input_tokens, prefix_tokens in timeline.prefill_grid(4096, 8, 1024):
            clock, bucket = 0.0, []
            for layer in range(layers):
                for group, name in REALISTIC_LAYER:
                    duration = generator.uniform(2.0, 900.0)
                    bucket.append(timeline.Row("prefill", input_tokens, prefix_tokens, layer, timeline.kernel_label(group, name),
                                               clock, clock + duration, generator.choice((132, 128, 66, 8))))
                    clock += duration + generator.uniform(1.0, 12.0)
            rows[("prefill", input_tokens, prefix_tokens)] = bucket
        for input_tokens in range(4096, 8 * 4096 + 1, 4096):
            rows[("decode", input_tokens, input_tokens)] = [
                timeline.Row("decode", input_tokens, None, None, timeline.kernel_label(group, name), 10.0 * i, 10.0 * i + 8.0, 132)
                for i, (group, name) in enumerate(REALISTIC_LAYER * layers)]
        with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as work:
            args = profile.parse_args(["--device", "cuda"] + run_all_slack_args(out, work))
            count = profile.write_outputs(args, rows, {"tool": "test", "grid": {"input_step_tokens": 4096}})
            self.assertEqual(count, sum(len(bucket) for bucket in rows.values()))
            self.assertGreater(count, 130_000)
            sizes = {name: os.path.getsize(os.path.join(out, name)) for name in os.listdir(out)}
            self.assertTrue(sizes, "nothing written to $OUT")
            for name, size in sizes.items():
                self.assertLess(size, RESULT_FILE_BYTES_MAX, f"$OUT/{name} is {size / 2**20:.1f} MiB: it would not come back")
            # The import's CSV has every row, and what comes back from $OUT is that CSV.
            with open(args.out_csv, "rb") as handle:
                csv = handle.read()
            self.assertEqual(sum(1 for line in csv.splitlines() if not line.startswith((b"#", b"phase,"))), count)
            self.assertIn("slack-timeline.csv.gz", sizes)
            with gzip.open(os.path.join(out, "slack-timeline.csv.gz")) as handle:
                self.assertEqual(handle.read(), csv)


def tutti_profile() -> str | None:
    """A tutti-profile build: GPU_CHECK_TUTTI_PROFILE (check.sh builds one), else the workspace's
    debug or release build, else None."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
    for path in (os.environ.get("GPU_CHECK_TUTTI_PROFILE", ""), os.path.join(target, "debug", "tutti-profile"),
                 os.path.join(target, "release", "tutti-profile")):
        if path and os.access(path, os.X_OK):
            return os.path.abspath(path)  # the recipe runs in a temporary directory
    return None


class AfterwardsRecipe(unittest.TestCase):
    """The runbook's "Afterwards, here" recipe (docs/gio-uring.md, Running on a GPU), run as
    written on a table imported as the slack step imports it on the lent H200 (--gpu h200, 8 I/O
    SMs in multiples of 8), from a synthetic all-SM timeline of the slack grid (4096 x 1..8,
    prefixes every 1024)."""

    def recipe(self) -> list[str]:
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "..", "..", "docs", "gio-uring.md")) as handle:
            text = handle.read()
        match = re.search(r"\*\*Afterwards, here:\*\*.*?```sh\n(.*?)```", text, re.S)
        self.assertIsNotNone(match, "the runbook's Afterwards paragraph gives no ```sh block")
        return [line for line in match.group(1).splitlines() if line.strip() and not line.startswith("#")]

    def test_the_recipe_compares_the_measured_table_with_an_analytic_one_of_the_same_reservation(self):
        # Goal: the recipe runs on the table the one call imports (an H200's: `simulate` refuses
        # a table of another GPU than its preset's), and its analytic side reserves the same 8
        # I/O SMs (the preset's own analytic table reserves 4: compute on 128 SMs where the
        # measured table has 124, a difference the model would be blamed for). Before, the
        # recipe was `simulate --preset llama3-8b-h100-32k --table TABLE` beside the preset alone.
        lines = self.recipe()
        analytic = [line for line in lines if " analytic " in line]
        self.assertTrue(analytic and all("--io-sms 8" in line and "--gpu h200" in line for line in analytic), lines)
        simulate = [line for line in lines if " simulate " in line]
        self.assertEqual(len(simulate), 2, lines)
        self.assertTrue(all("--preset llama3-8b-h200-32k" in line and "--table " in line for line in simulate), lines)
        profile = tutti_profile()
        if profile is None:
            self.skipTest("no tutti-profile build (GPU_CHECK_TUTTI_PROFILE, target/debug or target/release)")
        with tempfile.TemporaryDirectory() as directory:
            rows = [timeline.HEADER]
            for k in range(1, 9):
                tokens = 4096 * k
                for prefix in range(0, tokens + 1, 1024):
                    new = max(tokens - prefix, 1)
                    for layer in range(32):
                        start = layer * 1000.0
                        rows.append(f"prefill,{tokens},{prefix},{layer},qkv,{start},{start + 100 + new * 0.01},132")
                        rows.append(f"prefill,{tokens},{prefix},{layer},attn,{start + 100 + new * 0.01},{start + 900},132")
                rows.append(f"decode,{tokens},,,step,0,{3000 + 100 * k},132")
            with open(os.path.join(directory, "timeline.csv"), "w") as handle:
                handle.write("\n".join(rows) + "\n")
            subprocess.run([profile, "import", "--timeline", "timeline.csv", "--model", "llama3-8b", "--gpu", "h200",
                            "--io-sms", "8", "--io-sm-granularity", "8", "--io-sm-minimum", "8", "--out", "slack-table.json"],
                           cwd=directory, check=True, timeout=120, capture_output=True)
            for line in lines:
                command = line.replace("tutti-profile ", shlex.quote(profile) + " ", 1).replace(" TABLE ", " slack-table.json ")
                done = subprocess.run(["bash", "-c", command], cwd=directory, capture_output=True, text=True, timeout=300)
                self.assertEqual(done.returncode, 0, f"{line}: {done.stderr}")
            outputs = [line.rsplit(">", 1)[1].strip() for line in simulate if ">" in line]
            self.assertEqual(len(outputs), 2, simulate)
            for name in outputs:
                with open(os.path.join(directory, name)) as handle:
                    summary = json.load(handle)
                self.assertEqual(summary["preset"]["gpu"]["name"], "h200")


class RunAsAScript(unittest.TestCase):
    def test_every_test_class_comes_before_the_main_guard(self):
        # Goal: `python3 test_timeline.py` runs every test discover runs; a class defined after
        # `unittest.main()` is never defined when the file runs as a script (MergeRecipe was).
        import ast

        with open(os.path.abspath(__file__)) as handle:
            body = ast.parse(handle.read()).body
        guards = [index for index, node in enumerate(body) if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
        self.assertEqual(guards, [len(body) - 1], "the __main__ guard is not the file's last statement")


class MergeRecipe(unittest.TestCase):
    """The recipe that appends a later session's `--input-first K` CSV to a PARTIAL grid's
    (docs/gio-uring.md, Running on a GPU; slack-profile.py's docstring), run as written."""

    @staticmethod
    def recipes() -> dict[str, str]:
        here = os.path.dirname(os.path.abspath(__file__))
        found = {}
        for name, path in (("runbook", os.path.join(here, "..", "..", "docs", "gio-uring.md")),
                           ("slack-profile.py", os.path.join(here, "slack-profile.py"))):
            with open(path) as handle:
                text = " ".join(handle.read().split())  # the recipe may be wrapped over lines
            match = re.search(r"`(grep -v [^`]*second\.csv >> [^`]*)`", text)
            found[name] = match.group(1) if match else None
        return found

    def test_both_sessions_provenance_survives_the_merge(self):
        # Goal: the merged CSV keeps the later session's '#' provenance block (another machine,
        # date and driver measured its rows; import ignores '#' lines anywhere) and one header.
        # Before, the recipe dropped every '#' line of the second CSV.
        for name, recipe in self.recipes().items():
            with self.subTest(name), tempfile.TemporaryDirectory() as directory:
                self.assertIsNotNone(recipe, f"{name} gives no `grep -v … second.csv >> …` recipe")
                target = recipe.rsplit(">>", 1)[1].strip()
                row = lambda tokens: timeline.Row("prefill", tokens, 0, 0, "qkv", 0.0, 1.0, 8)  # noqa: E731
                for path, tokens, first in ((target, 4096, 1), ("second.csv", 8192, 2)):
                    with open(os.path.join(directory, path), "w") as out:
                        timeline.write_csv(out, [row(tokens)], [f'grid: {{"input_first": {first}}}', f"host: machine-{first}"])
                subprocess.run(["bash", "-c", recipe], cwd=directory, check=True, timeout=30)
                with open(os.path.join(directory, target)) as handle:
                    merged = handle.read().splitlines()
                self.assertIn("# host: machine-1", merged)
                self.assertIn("# host: machine-2", merged)
                self.assertIn('# grid: {"input_first": 2}', merged)
                self.assertEqual(merged.count(timeline.HEADER), 1, merged)
                self.assertEqual([line.split(",")[1] for line in merged if line.startswith("prefill,")], ["4096", "8192"])


if __name__ == "__main__":
    unittest.main()
