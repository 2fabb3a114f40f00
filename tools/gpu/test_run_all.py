"""Tests of tools/gpu/run-all.sh's and run-gpu-tests.sh's time bookkeeping, without a GPU: each
test copies the scripts into a temporary root with a stub carry (shell scripts standing in for the
GPU test, the layer load, the bandwidth program, tuttid, a python) and no nvcc or nvidia-smi on
PATH, runs one call, and reads summary.txt. The Prepare tests run `run-all.sh --prepare` there
with stub builders (cargo, nvcc, strip, wheel.sh) and read the carry. Standard library only; run with
`python3 -m unittest discover -s tools/gpu -p 'test_*.py'` (tools/gpu/check.sh does). Each takes a
few seconds once the scripts are right (the stubs that hang are what a wrong script waits for).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

# Each test sets the RUN_ALL_* variables it needs: none comes from the caller (a developer may
# have some exported).
for _name in [name for name in os.environ if name.startswith("RUN_ALL_")]:
    del os.environ[_name]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
COPIED = ("tools/gpu/run-all.sh", "tools/gpu/run-gpu-tests.sh", "tools/gpu/provenance.py", "tools/gpu/cuda-attrs.py",
          "tools/cuda-build.sh", "tools/lib/cargo-executables.py", "kernels/gio_abi.h")


def path_without(*commands: str) -> str:
    """PATH less every directory holding one of `commands`."""
    kept = [d for d in os.environ.get("PATH", "/usr/bin:/bin").split(":")
            if d and not any(os.path.exists(os.path.join(d, c)) for c in commands)]
    return ":".join(kept)


def kill_group(process: subprocess.Popen) -> None:
    """Kills `process`'s session (started with start_new_session) and reaps it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


class StubRoot:
    """A temporary repository root: the scripts, and target/gpu-carry made of stubs."""

    def __init__(self):
        self.directory = tempfile.TemporaryDirectory()
        self.root = self.directory.name
        for path in COPIED:
            os.makedirs(os.path.dirname(os.path.join(self.root, path)), exist_ok=True)
            shutil.copy(os.path.join(ROOT, path), os.path.join(self.root, path))
        self.carry = os.path.join(self.root, "target", "gpu-carry")
        stem = subprocess.run(["bash", os.path.join(self.root, "tools/cuda-build.sh"), "--image-stem"], capture_output=True,
                              text=True, check=True).stdout.strip()
        os.makedirs(os.path.join(self.carry, "kernels"))
        open(os.path.join(self.carry, "kernels", f"{stem}.sm_90.cubin"), "w").close()
        self.bin = os.path.join(self.root, "stub-bin")
        os.makedirs(self.bin)
        self.out = os.path.join(self.root, "out")
        self.last_output = ""
        self.write_provenance()

    def write_provenance(self, **fields: str):
        """target/gpu-carry/COMMIT and INPUTS as --prepare writes them for this root's copied
        files (a carry of this very tree: they are all inputs), with `fields` overriding COMMIT's."""
        spec = importlib.util.spec_from_file_location("stub_provenance", os.path.join(self.root, "tools/gpu/provenance.py"))
        provenance = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(provenance)  # its ROOT is this root
        digests = {path: provenance.file_sha256(path) for path in COPIED}
        commit = {"commit": "0" * 40, "dirty": "no", "inputs_sha256": provenance.digests_sha256(digests),
                  "changed_during_prepare": "no", **fields}
        os.makedirs(self.carry, exist_ok=True)
        with open(os.path.join(self.carry, "INPUTS"), "w") as handle:
            handle.write("".join(f"{digests[path]}  {path}\n" for path in COPIED))
        with open(os.path.join(self.carry, "COMMIT"), "w") as handle:
            handle.write("".join(f"{key}: {value}\n" for key, value in commit.items()))

    def stub(self, path: str, body: str) -> str:
        full = os.path.join(self.root, path)
        with open(full, "w") as handle:
            handle.write("#!/usr/bin/env bash\n" + body + "\n")
        os.chmod(full, 0o755)
        return full

    def run(self, script: str, args: list[str], env: dict[str, str], limit_s: float) -> tuple[int, float, str]:
        """Runs a script in its own session; kills the whole session afterwards (a stub a wrong
        script orphaned, too). Returns (exit status, seconds, summary.txt)."""
        environment = {**os.environ, "PATH": self.bin + ":" + path_without("nvcc", "nvidia-smi"), "OUT": self.out, **env}
        started = time.monotonic()
        process = subprocess.Popen(["bash", os.path.join(self.root, script), *args], env=environment, cwd=self.root,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        output = b""
        try:
            output, _ = process.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill_group(process)
        elapsed = time.monotonic() - started
        self.last_output = output.decode("utf-8", "replace")  # stdout and stderr, for a failure's message
        try:
            with open(os.path.join(self.out, "summary.txt")) as handle:
                summary = handle.read()
        except OSError:
            summary = ""
        return process.returncode, elapsed, summary

    def cleanup(self):
        self.directory.cleanup()


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def no_local_toolkit() -> bool:
    # run-gpu-tests.sh and run-all.sh fall back on /usr/local/cuda/bin/nvcc: these tests need none.
    return not os.path.exists("/usr/local/cuda/bin/nvcc")


@unittest.skipUnless(no_local_toolkit(), "a CUDA toolkit at /usr/local/cuda: the scripts would build with it")
class RunAll(unittest.TestCase):
    def setUp(self):
        self.stubs = StubRoot()
        self.addCleanup(self.stubs.cleanup)
        s = self.stubs
        s.stub("target/gpu-carry/h2d-bandwidth", "exit 0")
        s.stub("target/gpu-carry/green-contexts", "exit 0")
        s.stub("target/gpu-carry/tuttid", "exit 0")
        s.stub("target/gpu-carry/tuttid-gpu-check", "echo 'PASS x'")

    def test_a_failed_gpu_test_does_not_cost_the_steps_after_the_layer_load(self):
        # Goal: the layer load runs the gio kernel the GPU test just failed with (a hung kernel
        # hangs it the same way, up to its whole limit); it is skipped, and ipc, which needs no
        # gio kernel, still runs within the deadline.
        s = self.stubs
        s.stub("target/gpu-carry/gpu-test", "echo 'gpu test: assertion failed'; exit 101")
        s.stub("target/gpu-carry/gpu-layer-load", "sleep 1000")
        env = {"RUN_ALL_DEADLINE_S": "90", "RUN_ALL_TESTS_BUDGET_S": "60", "RUN_ALL_LAYER_LOAD_BUDGET_S": "50"}
        _rc, elapsed, summary = s.run("tools/gpu/run-all.sh", ["tests", "bandwidth", "ipc"], env, limit_s=120)
        self.assertIn("tests: FAIL gpu test", summary)
        self.assertIn("NOT RUN bandwidth through the gio kernel: the GPU test did not pass", summary)
        self.assertIn("PASS ipc", summary, summary)
        self.assertLess(elapsed, 30, summary)

    def test_a_passed_gpu_test_keeps_the_layer_load(self):
        s = self.stubs
        s.stub("target/gpu-carry/gpu-test", "echo 'gpu test: passed'")
        marker = os.path.join(s.root, "layer-load-ran")
        s.stub("target/gpu-carry/gpu-layer-load", f"touch {marker}")
        _rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["tests", "bandwidth"], {}, limit_s=60)
        self.assertIn("tests: PASS gpu test", summary)
        self.assertTrue(os.path.exists(marker), summary)
        self.assertNotIn("NOT RUN bandwidth", summary)

    def test_a_bandwidth_step_whose_layer_load_did_not_run_does_not_pass(self):
        # Goal: the bandwidth step is two measurements; when the gio-kernel half (item 5 proper)
        # did not run, a passed cudaMemcpy baseline must not make the summary say PASS bandwidth.
        s = self.stubs
        for case, gpu_test, layer_load in (("gpu test failed", "exit 101", True), ("not carried", "echo 'gpu test: passed'", False)):
            with self.subTest(case=case):
                s.stub("target/gpu-carry/gpu-test", gpu_test)
                layer_load_path = os.path.join(s.carry, "gpu-layer-load")
                if layer_load:
                    s.stub("target/gpu-carry/gpu-layer-load", "exit 0")
                elif os.path.exists(layer_load_path):
                    os.remove(layer_load_path)
                rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["tests", "bandwidth"], {}, limit_s=60)
                self.assertIn("NOT RUN bandwidth through the gio kernel", summary)
                self.assertNotIn("PASS bandwidth", summary)
                self.assertIn("FAIL bandwidth", summary)
                self.assertNotEqual(rc, 0, summary)

    def test_a_stale_carry_is_refused_before_any_step(self):
        # Goal: a carry prepared from another tree (the carried gpu-test, tuttid and wheel would
        # run beside kernels and scripts of this one) is refused before any step runs, saying why.
        s = self.stubs
        s.write_provenance(inputs_sha256="f" * 64)
        rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["tests", "ipc"], {"RUN_ALL_DRY": "1"}, limit_s=60)
        self.assertNotEqual(rc, 0, s.last_output)
        self.assertIn("STALE", summary, s.last_output)
        self.assertIn("STALE", s.last_output)
        self.assertNotIn("RUNNING", summary)
        self.assertNotIn("PASS", summary)
        with open(os.path.join(s.out, "run.log")) as handle:
            self.assertNotIn("dry tests", handle.read())

    def test_a_carry_whose_tree_changed_during_prepare_is_refused(self):
        s = self.stubs
        s.write_provenance(changed_during_prepare="yes", changed="inputs")
        rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["tests"], {"RUN_ALL_DRY": "1"}, limit_s=60)
        self.assertNotEqual(rc, 0, s.last_output)
        self.assertIn("changed while --prepare built", summary)
        self.assertNotIn("PASS", summary)

    def test_a_carry_of_this_tree_runs_and_verify_says_so(self):
        s = self.stubs
        rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["tests"], {"RUN_ALL_DRY": "1"}, limit_s=60)
        self.assertEqual(rc, 0, s.last_output)
        self.assertIn("PASS tests", summary)
        self.assertNotIn("STALE", summary)
        rc, _elapsed, _summary = s.run("tools/gpu/run-all.sh", ["--verify"], {}, limit_s=60)
        self.assertEqual(rc, 0, s.last_output)
        s.write_provenance(inputs_sha256="f" * 64)
        rc, _elapsed, _summary = s.run("tools/gpu/run-all.sh", ["--verify"], {}, limit_s=60)
        self.assertNotEqual(rc, 0, s.last_output)
        self.assertIn("STALE", s.last_output)

    def test_a_deliberate_stale_run_marks_every_step(self):
        s = self.stubs
        s.write_provenance(inputs_sha256="f" * 64)
        env = {"RUN_ALL_DRY": "1", "RUN_ALL_ALLOW_STALE": "1"}
        _rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["tests", "ipc"], env, limit_s=60)
        results = [line for line in summary.splitlines() if line.startswith(("PASS ", "FAIL "))]
        self.assertEqual(len(results), 2, summary)
        for line in results:
            self.assertIn("STALE", line)

    def test_steps_given_their_own_builds_need_no_carry(self):
        # Goal: tools/gpu/check.sh's rehearsals (python, slack, prefill with their own tuttid,
        # wheel and tutti-profile) run beside whatever carry there is.
        s = self.stubs
        s.write_provenance(inputs_sha256="f" * 64)
        env = {"RUN_ALL_DRY": "1", "RUN_ALL_TUTTID": "x", "RUN_ALL_WHEEL": "x", "RUN_ALL_TUTTI_PROFILE": "x"}
        rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["python", "slack"], env, limit_s=60)
        self.assertEqual(rc, 0, s.last_output)
        self.assertNotIn("STALE", summary)

    def test_the_green_step_logs_the_clocks_around_the_program_and_keeps_its_status(self):
        # Goal: the GPU's SM clock, power and temperature before and after the GEMM cases are in
        # summary.txt (the slowdowns are bracketed by baselines because they drift), and the
        # program's failure is still the step's.
        s = self.stubs
        for status, verdict in (("0", "PASS green"), ("1", "FAIL green")):
            s.stub("target/gpu-carry/green-contexts", f"exit {status}")
            _rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["green"], {}, limit_s=60)
            self.assertIn("green: before: sm clock", summary)
            self.assertIn("green: after: sm clock", summary)
            self.assertIn(verdict, summary)

    def test_the_green_steps_clock_readings_end_by_the_deadline(self):
        # Goal: a hung nvidia-smi around the green program (20 s each reading) is capped by the
        # deadline as the program is: the step started near the deadline ends by it. Before, the
        # reading after a program stopped at its cap ran its full 20 s past the deadline.
        s = self.stubs
        s.stub("stub-bin/nvidia-smi", '[[ "$*" == *clocks.sm* ]] && exec sleep 1000; exit 1')  # the header's query is quick
        s.stub("target/gpu-carry/green-contexts", "exec sleep 1000")
        _rc, elapsed, summary = s.run("tools/gpu/run-all.sh", ["green"], {"RUN_ALL_DEADLINE_S": "50"}, limit_s=90)
        self.assertIn("FAIL green", summary)
        self.assertLess(elapsed, 50, summary)

    def test_an_nvidia_smi_that_hangs_on_every_query_costs_no_step_after_green(self):
        # Goal: a hung nvidia-smi hangs every query, not only the clock readings: the header's,
        # programs()'s compute capability and slack's name query are bounded by the deadline too,
        # the header says the query timed out (not "no nvidia-smi"), and the steps after green
        # still run. Before, programs() waited on nvidia-smi with no limit at all, past the
        # deadline, and ipc never ran.
        s = self.stubs
        s.stub("stub-bin/nvidia-smi", "exec sleep 1000")
        _rc, elapsed, summary = s.run("tools/gpu/run-all.sh", ["green", "ipc"], {"RUN_ALL_DEADLINE_S": "90"}, limit_s=150)
        self.assertLess(elapsed, 90, summary)
        self.assertRegex(summary, r"(PASS|FAIL) green", summary)
        self.assertIn("PASS ipc", summary)
        self.assertIn("did not answer", summary)
        self.assertNotIn("no nvidia-smi", summary)

    def test_a_hung_nvidia_smi_is_not_asked_again_by_the_steps_child_scripts(self):
        # Goal: once the header's query timed out, the later steps' own scripts (run-gpu-tests.sh,
        # prefill-ttft.py, slack-profile.py) do not wait on nvidia-smi either: a shim first on
        # PATH answers at once. Before, the tests step spent 2 x 30 s on two doomed queries, and
        # prefill and slack 20 s of their budgets each.
        s = self.stubs
        s.stub("stub-bin/nvidia-smi", "exec sleep 1000")
        s.stub("target/gpu-carry/gpu-test", "echo 'gpu test: passed'")
        s.stub("target/gpu-carry/gpu-layer-load", "exit 0")
        _rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["tests"], {"RUN_ALL_DEADLINE_S": "200"}, limit_s=150)
        found = re.search(r"PASS tests \((\d+) s\)", summary)
        self.assertIsNotNone(found, summary + s.last_output)
        self.assertLess(int(found.group(1)), 15, summary)
        with open(os.path.join(s.out, "run.log")) as handle:
            self.assertIn("not asked: nvidia-smi hung earlier", handle.read())

    def test_the_slack_import_reserves_the_io_partition_the_gpu_grants(self):
        # Goal: on a Hopper GPU (the h100/h200 presets: compute capability 9.x) a green context
        # grants I/O SMs in multiples of 8, so tutti's request of 4 is granted 8: the import is
        # given 8 and the granularity (it refuses what the GPU cannot grant), and the summary
        # says so. Before, the import reserved its default 4 and modelled compute on 128 SMs.
        s = self.stubs
        os.makedirs(os.path.join(s.root, "tools/gpu"), exist_ok=True)
        with open(os.path.join(s.root, "tools/gpu/slack-profile.py"), "w") as handle:
            handle.write("import sys\nargs = sys.argv[1:]\n"
                         "open(args[args.index('--out-csv') + 1], 'w').write('phase,input_tokens\\n')\n")
        arguments = os.path.join(s.root, "import-arguments")
        profile = s.stub("stub-tutti-profile", f'[[ "$1" == import ]] && echo "$@" >{arguments}; exit 0')
        env = {"RUN_ALL_TUTTI_PROFILE": profile, "RUN_ALL_GPU_PRESET": "h100"}
        rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["slack"], env, limit_s=60)
        self.assertEqual(rc, 0, summary + s.last_output)
        with open(arguments) as handle:
            words = handle.read().split()
        self.assertEqual(words[words.index("--io-sms") + 1], "8", words)
        self.assertEqual(words[words.index("--io-sm-granularity") + 1], "8", words)
        self.assertEqual(words[words.index("--io-sm-minimum") + 1], "8", words)
        self.assertIn("slack: io_sms 8 reserved for I/O (4 requested", summary)

    def slack_stub(self, body: str = "") -> str:
        """A slack-profile.py that writes a header-only CSV, then runs `body` (Python); and a
        tutti-profile that does nothing. Returns the RUN_ALL_TUTTI_PROFILE path."""
        s = self.stubs
        os.makedirs(os.path.join(s.root, "tools/gpu"), exist_ok=True)
        with open(os.path.join(s.root, "tools/gpu/slack-profile.py"), "w") as handle:
            handle.write("import os, sys, time\nargs = sys.argv[1:]\n"
                         "open(args[args.index('--out-csv') + 1], 'w').write('phase,input_tokens\\n')\n" + body + "\n")
        return s.stub("stub-tutti-profile", "exit 0")

    def slack_import_arguments(self, provenance: str) -> tuple[list[str], str]:
        """Runs the slack step with a profile that writes `provenance` as its provenance JSON and
        a tutti-profile that records its import's arguments, no RUN_ALL_GPU_PRESET. Returns the
        import's words and summary.txt."""
        s = self.stubs
        self.slack_stub(f"open(args[args.index('--out-provenance') + 1], 'w').write({provenance!r})")
        arguments = os.path.join(s.root, "import-arguments")
        profile = s.stub("stub-tutti-profile", f'[[ "$1" == import ]] && echo "$@" >{arguments}; exit 0')
        _rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["slack"], {"RUN_ALL_TUTTI_PROFILE": profile}, limit_s=90)
        with open(arguments) as handle:
            return handle.read().split(), summary

    def test_the_slack_table_takes_the_gpu_name_from_the_cuda_probe_when_nvidia_smi_hangs(self):
        # Goal: the table's GPU identity comes from the header's probe (cuDeviceGetName), which
        # answered, not from an nvidia-smi that hung: the import gets --gpu h200 and no false
        # "not a 132-SM preset" NOTE. Before, the name was nvidia-smi's alone: empty, so the
        # table was named gpu-132sm, which simulate --preset h200 refuses.
        s = self.stubs
        s.stub("stub-bin/nvidia-smi", "exec sleep 1000")
        with open(os.path.join(s.root, "tools/gpu/cuda-attrs.py"), "w") as handle:
            handle.write("print('device0=NVIDIA H200\\nmultiProcessorCount=132\\n"
                         "computeCapabilityMajor=9\\ncomputeCapabilityMinor=0')\n")
        s.write_provenance()  # a carry of this tree, stub probe included
        words, summary = self.slack_import_arguments("{}")
        self.assertEqual(words[words.index("--gpu") + 1] if "--gpu" in words else words, "h200", summary)
        self.assertNotIn("132-SM preset", summary)

    def test_a_failing_nvidia_smis_stdout_never_becomes_the_gpu_name(self):
        # Goal: nvidia-smi prints its own failure on stdout with a non-zero status ("NVIDIA-SMI
        # has failed ...", 9): that text is no answer. The name comes from the profile's
        # provenance where the probe has none, and with no name anywhere the spec is 'gpu'.
        # Before, the failure text became the name (a spec 'nvidia-smi-has-failed-...-132sm').
        s = self.stubs
        s.stub("stub-bin/nvidia-smi", "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver'; exit 9")
        words, summary = self.slack_import_arguments('{"gpu": "NVIDIA H200", "sm_count": 132}')
        self.assertEqual(words[words.index("--gpu") + 1] if "--gpu" in words else words, "h200", summary)
        self.assertNotIn("132-SM preset", summary)
        words, summary = self.slack_import_arguments('{"sm_count": 132}')
        self.assertIn("GPU 'gpu' with 132 SMs", summary)
        self.assertNotIn("has failed", re.search(r"NOTE slack: GPU .*", summary).group(0))

    def test_a_deadline_bound_slack_profile_keeps_its_45_s_over_its_budget(self):
        # Goal: the profile's hard limit is its --budget-s plus 45 s (an input length it
        # mispredicted finishes instead of being killed with its minutes spent) in the planned
        # call too, where slack, last, is always bound by the deadline: there the budget shrinks,
        # not the margin. Before, the deadline-bound branch left budget + 20 s (budget 95, limit 115
        # at a 150 s deadline).
        s = self.stubs
        profile = self.slack_stub()
        for deadline in (150, 300, 115):
            with self.subTest(deadline=deadline):
                env = {"RUN_ALL_TUTTI_PROFILE": profile, "RUN_ALL_GPU_PRESET": "h100", "RUN_ALL_DEADLINE_S": str(deadline)}
                _rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["slack"], env, limit_s=60)
                with open(os.path.join(s.out, "run.log")) as handle:
                    log = handle.read()
                found = re.search(r"slack-profile\.py \(budget (\d+) s, limit (\d+) s\)", log)
                self.assertIsNotNone(found, summary + log)
                budget, limit = int(found.group(1)), int(found.group(2))
                self.assertGreaterEqual(limit - budget, 45, found.group(0))
                self.assertGreaterEqual(budget, 30, found.group(0))
                self.assertLessEqual(limit + 20, deadline - 15, found.group(0))  # the import's 20 s after it
                self.assertIn("PASS slack", summary)
        # A deadline that leaves no 30 s budget over those margins is NOT RUN at the loop.
        env = {"RUN_ALL_TUTTI_PROFILE": profile, "RUN_ALL_GPU_PRESET": "h100", "RUN_ALL_DEADLINE_S": "100"}
        _rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["slack"], env, limit_s=60)
        self.assertIn("NOT RUN slack: deadline", summary)

    def test_a_step_killed_while_rewriting_leaves_no_partial_file_in_out(self):
        # Goal: $OUT holds the eight files the tool brings back and nothing else: a writer killed
        # between writing its `.partial` and renaming it (slack-profile's gzip takes about 1 s
        # per 20 MiB) would leave a ninth, and which file the tool then leaves out is not ours
        # to choose. Every writer renames atomically, so a `.partial` is never a result's only
        # copy. The stand-in is killed (SIGKILL) right after writing it.
        s = self.stubs
        profile = self.slack_stub("gz = args[args.index('--out-csv-gz') + 1]\n"
                                  "open(gz + '.partial', 'w').write('x')\n"
                                  "os.kill(os.getpid(), 9)")
        env = {"RUN_ALL_TUTTI_PROFILE": profile, "RUN_ALL_GPU_PRESET": "h100"}
        _rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["slack"], env, limit_s=60)
        self.assertIn("slack", summary)
        self.assertIn("summary.txt", os.listdir(s.out))
        self.assertEqual([name for name in os.listdir(s.out) if name.endswith(".partial")], [], summary)

    def test_a_profile_killed_while_gzipping_returns_a_gzip_of_the_imported_csv(self):
        # Goal: the profile replaces its CSV first, then rewrites the gzip; killed in between, the
        # CSV the step imports has one input length more than slack-timeline.csv.gz, the only copy
        # that comes back ($WORK is removed). On status 124/137 the step re-gzips the CSV into $OUT
        # before the import, so the returned gzip holds the table's rows. Before, it stayed one
        # length behind (or was missing after the first length).
        import gzip
        s = self.stubs
        rows = "phase,input_tokens\nprefill,4096\nprefill,8192\n"
        profile = self.slack_stub("import gzip\n"
                                  f"open(args[args.index('--out-csv') + 1], 'w').write({rows!r})\n"
                                  "gz = args[args.index('--out-csv-gz') + 1]\n"
                                  "gzip.open(gz, 'wt').write('phase,input_tokens\\nprefill,4096\\n')\n"
                                  "os.kill(os.getpid(), 9)")
        imported = os.path.join(s.root, "imported.csv")
        s.stub("stub-tutti-profile", f'[[ "$1" == import ]] && cp "$3" {imported}; exit 0')
        env = {"RUN_ALL_TUTTI_PROFILE": profile, "RUN_ALL_GPU_PRESET": "h100"}
        _rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["slack"], env, limit_s=60)
        with open(imported) as handle:
            self.assertEqual(handle.read(), rows, summary)
        with gzip.open(os.path.join(s.out, "slack-timeline.csv.gz"), "rt") as handle:
            self.assertEqual(handle.read(), rows, summary)
        self.assertEqual([name for name in os.listdir(s.out) if name.endswith(".partial")], [], summary)

    def python_stub(self, import_s: int) -> str:
        """A python whose `-c import ...` takes import_s seconds (torch's import on the GPU
        machine) and whose `-m pip install --target DIR` makes DIR/tutti."""
        return self.stubs.stub("stub-python", f"""
case "$1" in
  -c) sleep {import_s} ;;
  -m) while [[ $# -gt 0 && "$1" != --target ]]; do shift; done; mkdir -p "$2/tutti"; touch "$2/tutti/__init__.py" ;;
esac
exit 0""")

    def step_env(self, deadline_s: int) -> dict[str, str]:
        s = self.stubs
        wheel = os.path.join(s.root, "tutti-0-cp39-abi3-linux.whl")
        open(wheel, "w").close()
        # tuttid listens on its --socket as the real one does.
        tuttid = s.stub("stub-tuttid", """
while [[ $# -gt 0 && "$1" != --socket ]]; do shift; done
exec python3 -c 'import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); time.sleep(1000)' "$2"
""")
        return {"RUN_ALL_DEADLINE_S": str(deadline_s), "RUN_ALL_PYTHON": self.python_stub(12), "RUN_ALL_TUTTID": tuttid,
                "RUN_ALL_WHEEL": wheel, "RUN_ALL_PREFILL_DEVICE_ARGS": "--device cpu"}

    def test_a_stop_during_the_python_step_stops_its_tuttid(self):
        # Goal: a SIGTERM to run-all.sh (the device tool's limit) while the python step's tuttid
        # runs leaves no tuttid behind: the TERM trap exits through finish, past the step's own
        # stop. Sent to run-all.sh alone (a signal to its group would reach the stand-in
        # directly), once while the step waits for the socket and once during the check (bash
        # runs the trap when the check's pipeline ends: the check stand-in takes 4 s).
        s = self.stubs
        wheel = os.path.join(s.root, "tutti-0-cp39-abi3-linux.whl")
        open(wheel, "w").close()
        python = s.stub("stub-python-check", """
case "$1" in
  -c) exit 0 ;;
  -m) while [[ $# -gt 0 && "$1" != --target ]]; do shift; done; mkdir -p "$2/tutti"; touch "$2/tutti/__init__.py" ;;
  *) sleep 4 ;;
esac
exit 0""")
        for phase, listens in (("waiting for its socket", False), ("during the check", True)):
            with self.subTest(phase=phase):
                pid_file = os.path.join(s.root, f"tuttid-{listens}.pid")
                serve = ("import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
                         "time.sleep(1000)") if listens else "import time; time.sleep(1000)"
                tuttid = s.stub(f"stub-tuttid-{listens}", f"""
echo $$ > {pid_file}
while [[ $# -gt 0 && "$1" != --socket ]]; do shift; done
exec python3 -c '{serve}' "$2"
""")
                env = {**os.environ, "PATH": s.bin + ":" + path_without("nvcc", "nvidia-smi"), "OUT": s.out,
                       "RUN_ALL_DEADLINE_S": "600", "RUN_ALL_PYTHON": python, "RUN_ALL_TUTTID": tuttid,
                       "RUN_ALL_WHEEL": wheel, "RUN_ALL_PYTHON_DEVICE": "stand-in"}
                process = subprocess.Popen(["bash", os.path.join(s.root, "tools/gpu/run-all.sh"), "python"], env=env,
                                           cwd=s.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True)
                try:
                    deadline = time.monotonic() + 30
                    while not os.path.exists(pid_file) and time.monotonic() < deadline and process.poll() is None:
                        time.sleep(0.1)
                    self.assertTrue(os.path.exists(pid_file), "the python step never started tuttid")
                    time.sleep(1.5)  # the stand-in listening and the check started (or the wait going on)
                    with open(pid_file) as handle:
                        tuttid_pid = int(handle.read())
                    self.assertTrue(alive(tuttid_pid))
                    process.send_signal(signal.SIGTERM)
                    self.assertEqual(process.wait(timeout=40), 143)
                    deadline = time.monotonic() + 5
                    while alive(tuttid_pid) and time.monotonic() < deadline:
                        time.sleep(0.1)
                    self.assertFalse(alive(tuttid_pid), f"tuttid ({tuttid_pid}) still runs after run-all.sh ended")
                finally:
                    kill_group(process)

    def test_the_python_and_prefill_steps_turn_off_expandable_segments_under_both_names(self):
        # Goal: CUDA IPC export refuses expandable segments; torch 2.11 reads PYTORCH_ALLOC_CONF
        # before its deprecated alias PYTORCH_CUDA_ALLOC_CONF, so a machine that sets the new name
        # must not keep them on. Both are set for the scripts, and the header logs both.
        s = self.stubs
        env = self.step_env(600)
        seen = os.path.join(s.root, "seen-alloc-conf")
        env["RUN_ALL_PYTHON"] = s.stub("stub-python-conf", f"""
case "$1" in
  -c) exit 0 ;;
  -m) while [[ $# -gt 0 && "$1" != --target ]]; do shift; done; mkdir -p "$2/tutti"; touch "$2/tutti/__init__.py"; exit 0 ;;
esac
echo "$(basename "$1") PYTORCH_ALLOC_CONF=${{PYTORCH_ALLOC_CONF-unset}} PYTORCH_CUDA_ALLOC_CONF=${{PYTORCH_CUDA_ALLOC_CONF-unset}}" >>{seen}
echo 'PASS stub'""")
        env.update({"RUN_ALL_PYTHON_DEVICE": "stand-in", "PYTORCH_ALLOC_CONF": "expandable_segments:True",
                    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
        _rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["python", "prefill"], env, limit_s=120)
        with open(seen) as handle:
            lines = handle.read().splitlines()
        self.assertEqual(sorted(line.split()[0] for line in lines), ["prefill-ttft.py", "python-cuda-check.py"], summary)
        for line in lines:
            self.assertIn("PYTORCH_ALLOC_CONF=expandable_segments:False", line)
            self.assertIn("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False", line)
        self.assertIn("== PYTORCH_ALLOC_CONF expandable_segments:True", summary)
        self.assertIn("PYTORCH_CUDA_ALLOC_CONF expandable_segments:True", summary)

    def test_a_started_python_step_has_room_for_its_check_after_its_imports(self):
        # Goal: a step the loop starts is not left, after its imports (12 s here; torch's import
        # takes 10-20 s), without the time its own limits need: either it is not started
        # (NOT RUN at the loop) or python-cuda-check.py gets its minimum.
        _rc, _elapsed, summary = self.stubs.run("tools/gpu/run-all.sh", ["python"], self.step_env(78), limit_s=60)
        self.assertNotIn("python-cuda-check.py would get", summary)
        self.assertIn("NOT RUN python: deadline", summary)

    def test_a_started_prefill_step_has_room_for_its_budget_after_its_imports(self):
        _rc, _elapsed, summary = self.stubs.run("tools/gpu/run-all.sh", ["prefill"], self.step_env(145), limit_s=60)
        self.assertNotIn("leaves no 30 s budget after 90 s of margin", summary)
        self.assertIn("NOT RUN prefill: deadline", summary)


class DevicePlan(unittest.TestCase):
    """The device call of docs/gio-uring.md ("Running on a GPU"), as `run-all.sh --plan` states it,
    against the device's limits: 900 s of device time per session, the machine's start (60-150 s
    seen), the transfers and the close included; at most 600 s per call; the machine goes back
    after 30 s idle, so a second call after an agent's turn may find it gone and pay a fresh start
    out of a budget sized for a warm one (issue 15: one call, every step, slack last)."""

    def plan(self, *extra: str) -> dict[str, str]:
        done = subprocess.run(["bash", os.path.join(ROOT, "tools/gpu/run-all.sh"), "--plan", *extra], capture_output=True,
                              text=True, timeout=30)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)

    def test_a_session_with_less_left_gets_a_call_sized_to_it(self):
        # Goal: a retry after a failed start, or a later session's call at the same work, has less
        # than 900 s left (status's budget_left_s). The call is sized from what is left: the
        # slowest start and the transfers come off it first, and run-all's deadline is the
        # call's timeout_s less 20 s, so the tool's own cut of the call (limit_s) never lands
        # inside a step and $OUT comes back. Before, --plan took no input and the call was
        # always timeout_s 590 with deadline 570.
        full = self.plan()
        for left in (900, 1000, 660, 500, 340):
            with self.subTest(left=left):
                plan = self.plan("--left-s", str(left))
                self.assertEqual(plan["call"], "yes", plan)
                timeout, deadline = int(plan["timeout_s"]), int(plan["deadline_s"])
                start, transfers = int(plan["start_max_s"]), int(plan["transfer_margin_s"])
                self.assertLessEqual(timeout, 590)
                self.assertLessEqual(start + transfers + timeout, left, plan)
                self.assertEqual(timeout, min(590, left - start - transfers), plan)
                self.assertEqual(deadline, timeout - 20, plan)
                self.assertEqual(plan["command"], f"RUN_ALL_DEADLINE_S={deadline} {full['command']}", plan)
                self.assertEqual(plan["steps"], full["steps"])
        plan = self.plan("--left-s", "660")
        self.assertLessEqual(int(plan["timeout_s"]), 450, plan)
        self.assertLessEqual(int(plan["deadline_s"]), int(plan["timeout_s"]) - 20, plan)
        # Below the floor no call is made: a start and the transfers would leave the steps too
        # little (and the device starts no machine under 240 s).
        for left in (334, 300, 299, 280, 0):
            with self.subTest(left=left):
                plan = self.plan("--left-s", str(left))
                self.assertEqual(plan["call"], "no", plan)
                self.assertNotIn("command", plan)
                self.assertNotIn("timeout_s", plan)
                self.assertIn("do not call", plan["reason"])
        for bad in ("", "-5", "5m", "12.5"):
            with self.subTest(bad=bad):
                done = subprocess.run(["bash", os.path.join(ROOT, "tools/gpu/run-all.sh"), "--plan", "--left-s", bad],
                                      capture_output=True, text=True, timeout=30)
                self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
                self.assertIn("--left-s", done.stderr)

    def test_a_call_is_planned_only_where_its_first_step_can_start(self):
        # Goal: `--plan --left-s N [STEP...]` says call=yes only where, after the slowest start,
        # the transfers, the call's 20 s exit, the loop's 15 s margin and the header (~30 s: its
        # torch import alone takes 10-20 s there), the first step still has its minimum (run-all's
        # step_minimum): else the call's only step writes `NOT RUN ...: deadline` and the start is
        # spent for nothing. Before, the floor was 300 s for any step: slack alone (minimum 95)
        # needs about 370.
        plan = self.plan("--left-s", "320", "slack")
        self.assertEqual(plan["call"], "no", plan)
        self.assertIn("slack", plan["reason"])
        minimums = {"tests": 60, "prefill": 140, "slack": 95, "python": 80, "green": 30}
        for steps in (["slack"], [], ["prefill", "slack"], ["green", "ipc"]):
            first = steps[0] if steps else "tests"
            for left in range(240, 1001, 5):
                plan = self.plan("--left-s", str(left), *steps)
                if plan["call"] != "yes":
                    continue
                with self.subTest(steps=steps, left=left):
                    self.assertGreaterEqual(int(plan["deadline_s"]) - 30 - 15, minimums[first], plan)
                    self.assertLessEqual(int(plan["start_max_s"]) + int(plan["transfer_margin_s"]) + int(plan["timeout_s"]),
                                         left, plan)
                    if steps:
                        self.assertEqual(plan["steps"], " ".join(steps), plan)
                        self.assertTrue(plan["command"].endswith("run-all.sh " + " ".join(steps)), plan)
        plan = self.plan("--left-s", "370", "slack")
        self.assertEqual(plan["call"], "yes", plan)
        done = subprocess.run(["bash", os.path.join(ROOT, "tools/gpu/run-all.sh"), "--plan", "--left-s", "600", "nope"],
                              capture_output=True, text=True, timeout=30)
        self.assertEqual(done.returncode, 2, done.stdout + done.stderr)

    def test_one_call_runs_every_step_with_slack_last(self):
        plan = self.plan()
        self.assertEqual(plan["calls"], "1")
        steps = plan["steps"].split()
        self.assertEqual(sorted(steps), sorted(["tests", "green", "bandwidth", "ipc", "prefill", "python", "slack"]))
        self.assertEqual(steps[-1], "slack")  # the step whose budget is what is left
        self.assertEqual(plan["command"], "bash tools/gpu/run-all.sh " + plan["steps"])

    def test_the_call_fits_the_session_after_the_slowest_start(self):
        plan = self.plan()
        session, start, timeout = int(plan["session_s"]), int(plan["start_max_s"]), int(plan["timeout_s"])
        self.assertEqual(session, 900)
        self.assertGreaterEqual(start, 150)
        self.assertLessEqual(timeout, 590)  # the per-call limit is 600
        # What the call may run plus the slowest start leaves at least a minute for the upload
        # (~32 MB), the download (at most 8 files) and the close.
        self.assertGreaterEqual(session - start - timeout, 60, plan)
        # Were the start slower still (a 35 s turn and a 120 s start, as for a second call, on
        # top of the slowest), the call ends before the session's time is spent: nothing is lost
        # to a limit that is not the call's own.
        self.assertLessEqual(start + 35 + 120 + timeout, session - 5, plan)

    def test_every_step_ends_before_the_calls_limit(self):
        plan = self.plan()
        deadline, timeout = int(plan["deadline_s"]), int(plan["timeout_s"])
        # 20 s for the exit (tuttid's stop: 10 s; the log trim) after every step's end.
        self.assertLessEqual(deadline + 20, timeout, plan)
        # The call's default deadline is the plan's (the command sets none).
        stubs = StubRoot()
        self.addCleanup(stubs.cleanup)
        _rc, _elapsed, summary = stubs.run("tools/gpu/run-all.sh", ["ipc"], {"RUN_ALL_DRY": "1"}, limit_s=60)
        self.assertIn(f"deadline {deadline} s", summary)

    def test_the_runbook_gives_the_planned_call(self):
        plan = self.plan()
        with open(os.path.join(ROOT, "docs", "gio-uring.md")) as handle:
            runbook = handle.read()
        row = next((line for line in runbook.splitlines() if f"`{plan['command']}`" in line), None)
        self.assertIsNotNone(row, f"docs/gio-uring.md gives no `{plan['command']}`")
        self.assertIn(f"| {plan['timeout_s']} |", row)
        self.assertNotIn("RUN_ALL_SLACK_BUDGET_S=B", runbook)  # no second call's recipe is left
        # A session with less than 900 s left sizes its call from status's budget_left_s.
        self.assertIn("--plan --left-s", runbook)
        self.assertIn("budget_left_s", runbook)
        self.assertNotIn("`timeout_s` 590, the same arithmetic", runbook)
        # The slack profile's margins as run-all.sh applies them (test above).
        self.assertIn("`--budget-s` = that less 45 s", " ".join(runbook.split()))

    def test_the_runbook_sizes_a_partial_finishing_call_from_the_first_calls_times(self):
        # Goal: slack's floor (the least --plan calls for) only starts the step; the profile's
        # first input length is not checked against its budget, so a finishing call is sized
        # from the first call's seconds_per_input_length. The runbook's budget arithmetic is
        # run-all.sh's: the start and transfers, the 20 s exit, the header, the loop's 15 s, the
        # 20 s kept for the import and the 45 s hard-limit margin.
        with open(os.path.join(ROOT, "tools", "gpu", "run-all.sh")) as handle:
            script = handle.read()
        constant = lambda name: int(re.search(rf"^{name}=(\d+)", script, re.M).group(1))
        taken = constant("PLAN_START_MAX_S") + constant("PLAN_TRANSFER_MARGIN_S") + 20 + constant("PLAN_HEADER_S") + 15 + 20 + 45
        with open(os.path.join(ROOT, "docs", "gio-uring.md")) as handle:
            runbook = " ".join(handle.read().split())
        partial = runbook[runbook.index("If `summary.txt` says PARTIAL"):runbook.index("**Afterwards, here:**")]
        self.assertIn("seconds_per_input_length", partial)
        self.assertIn(f"N − {taken}", partial)
        self.assertEqual(self.plan("--left-s", str(taken + 30), "slack")["call"], "yes")  # the floor: a 30 s budget


# A cargo for --prepare: each executable it is asked for (--bin, --example, --test) is written
# under $CARGO_TARGET_DIR/release (as cargo puts them), holding "fresh NAME", and named in a
# compiler-artifact message as --message-format=json-render-diagnostics does (after a library's
# and a build script's messages, which are not the executables asked for). STUB_CARGO_NO_CUDA=1:
# tuttid holds the string a build without the `cuda` feature holds (crates/daemon/src/gpu_memory.rs).
STUB_CARGO = r'''#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
release = os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "release")
def artifact(name, kinds, executable):
    print(json.dumps({"reason": "compiler-artifact", "target": {"name": name, "kind": kinds}, "executable": executable}))
artifact("tutti_daemon", ["lib"], None)
artifact("build-script-build", ["custom-build"], os.path.join(release, "build", "x", "build-script-build"))
for flag, kind, folder in (("--bin", "bin", ""), ("--example", "example", "examples"), ("--test", "test", "deps")):
    for index, arg in enumerate(args):
        if arg != flag:
            continue
        name = args[index + 1]
        path = os.path.abspath(os.path.join(release, folder, name + ("-0123abcd" if kind == "test" else "")))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            handle.write("fresh " + name + "\n")
            if name == "tuttid" and os.environ.get("STUB_CARGO_NO_CUDA"):
                handle.write("--device-memory cuda: this tuttid was built without the `cuda` feature\n")
        artifact(name, [kind], path)
print(json.dumps({"reason": "build-finished", "success": True}))
'''


@unittest.skipUnless(no_local_toolkit(), "a CUDA toolkit at /usr/local/cuda: the scripts would build with it")
class Prepare(unittest.TestCase):
    """run-all.sh --prepare with every builder a stub: what it copies into the carry."""

    def setUp(self):
        self.stubs = StubRoot()
        self.addCleanup(self.stubs.cleanup)
        s = self.stubs
        s.stub("tools/cuda-build.sh", 'if [[ "${1:-}" == --image-stem ]]; then echo gio_kernels; else mkdir -p "$1"; fi')
        os.makedirs(os.path.join(s.root, ".tools/cuda-wheels-13.2.86/nvidia/cu13/bin"))
        s.stub(".tools/cuda-wheels-13.2.86/nvidia/cu13/bin/nvcc",
               'while [[ $# -gt 0 && "$1" != -o ]]; do shift; done; echo program >"$2"')
        os.makedirs(os.path.join(s.root, "tools/python"))
        s.stub("tools/python/wheel.sh", "mkdir -p target/wheels; touch target/wheels/tutti-0.1.0-cp39-abi3-linux.whl")
        os.makedirs(os.path.join(s.root, "crates/gio-uring/examples"))
        open(os.path.join(s.root, "crates/gio-uring/examples/gpu_layer_load.rs"), "w").close()
        with open(os.path.join(s.root, "tools/gpu/test_stub.py"), "w") as handle:
            handle.write("import unittest\n\nclass Stub(unittest.TestCase):\n    def test_nothing(self):\n        pass\n")
        s.stub("stub-bin/strip", "exit 0")
        cargo = os.path.join(s.bin, "cargo")
        with open(cargo, "w") as handle:
            handle.write(STUB_CARGO)
        os.chmod(cargo, 0o755)
        # What an earlier build without CARGO_TARGET_DIR left in target/release: stale, and this
        # tuttid without the `cuda` feature.
        for name in ("tutti-profile", "tuttid", "tuttid-gpu-check", "examples/gpu_layer_load"):
            path = os.path.join(s.root, "target/release", name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as handle:
                handle.write("stale " + name + ": this tuttid was built without the `cuda` feature\n")
        self.target_dir = os.path.join(s.root, "elsewhere")

    def carried(self, name: str) -> str:
        with open(os.path.join(self.stubs.carry, name)) as handle:
            return handle.read()

    def test_the_carry_holds_what_cargo_built_under_its_target_dir(self):
        # Goal: with CARGO_TARGET_DIR set (docs/gio-uring.md's GPU test exports one), --prepare
        # carries the executables cargo built and named, not whatever target/release holds.
        rc, _elapsed, _summary = self.stubs.run("tools/gpu/run-all.sh", ["--prepare"], {"CARGO_TARGET_DIR": self.target_dir},
                                                limit_s=120)
        output = self.stubs.last_output
        self.assertEqual(rc, 0, output)
        for carried, built in (("tutti-profile", "tutti-profile"), ("gpu-layer-load", "gpu_layer_load"), ("tuttid", "tuttid"),
                               ("tuttid-gpu-check", "tuttid-gpu-check"), ("gpu-test", "gpu")):
            self.assertEqual(self.carried(carried), f"fresh {built}\n", output)

    def test_a_tuttid_built_without_cuda_fails_the_prepare(self):
        # Goal: a tuttid without the `cuda` feature is never carried: the ipc, python and prefill
        # steps would fail on the GPU machine, after its device time was spent.
        rc, _elapsed, _summary = self.stubs.run("tools/gpu/run-all.sh", ["--prepare"],
                                                {"CARGO_TARGET_DIR": self.target_dir, "STUB_CARGO_NO_CUDA": "1"}, limit_s=120)
        output = self.stubs.last_output
        self.assertNotEqual(rc, 0, output)
        self.assertIn("without the `cuda` feature", output)
        self.assertFalse(os.path.exists(os.path.join(self.stubs.carry, "tuttid")), output)


def git(root: str, *args: str) -> str:
    return subprocess.run(["git", "-C", root, "-c", "user.name=stub", "-c", "user.email=stub@example.invalid", *args],
                          capture_output=True, text=True, check=True, timeout=60).stdout


@unittest.skipUnless(no_local_toolkit(), "a CUDA toolkit at /usr/local/cuda: the scripts would build with it")
class CarryInputs(unittest.TestCase):
    """The stale-carry refusal looks at the carry's inputs alone (provenance.py's INPUTS): the
    stub root is a git checkout with a crate, docs and the scripts; `provenance.py begin` and
    `prepare` record it as --prepare does (the builds in between left out), and run-all.sh --verify
    and a dry run read the carry as the GPU machine does."""

    def setUp(self):
        self.stubs = StubRoot()
        self.addCleanup(self.stubs.cleanup)
        s = self.stubs
        for path, text in (("crates/a/src/lib.rs", "pub fn a() {}\n"), ("crates/a/Cargo.toml", "[package]\nname = \"a\"\n"),
                           ("Cargo.toml", "[workspace]\nmembers = [\"crates/a\"]\n"), ("docs/a.md", "# a\n"),
                           ("README.md", "# stub\n"), (".gitignore", "target/\nout/\nstub-bin/\n__pycache__/\n")):
            self.write(path, text)
        git(s.root, "init", "-q")
        git(s.root, "add", "-A")
        git(s.root, "commit", "-q", "-m", "stub")

    def write(self, path: str, text: str):
        full = os.path.join(self.stubs.root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as handle:
            handle.write(text)

    def provenance(self, command: str):
        done = subprocess.run(["python3", os.path.join(self.stubs.root, "tools/gpu/provenance.py"), command, self.stubs.carry],
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)

    def commit_field(self, key: str) -> str:
        with open(os.path.join(self.stubs.carry, "COMMIT")) as handle:
            fields = dict(line.rstrip("\n").split(": ", 1) for line in handle if ": " in line)
        return fields.get(key, "")

    def verify(self) -> int:
        rc, _elapsed, _summary = self.stubs.run("tools/gpu/run-all.sh", ["--verify"], {}, limit_s=60)
        return rc

    def test_a_change_outside_the_inputs_after_prepare_is_accepted(self):
        # Goal: a docs edit (or a commit of one) between --prepare and the device call leaves the
        # carried builds what they were: the run goes ahead.
        s = self.stubs
        self.provenance("begin")
        self.provenance("prepare")
        self.write("docs/a.md", "# a, edited\n")
        git(s.root, "commit", "-q", "-am", "docs")
        self.write("docs/new.md", "untracked\n")
        self.assertEqual(self.verify(), 0, s.last_output)
        rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["tests"], {"RUN_ALL_DRY": "1"}, limit_s=60)
        self.assertEqual(rc, 0, s.last_output)
        self.assertIn("PASS tests", summary)
        self.assertNotIn("STALE", summary)

    def test_a_change_under_crates_after_prepare_is_refused(self):
        s = self.stubs
        self.provenance("begin")
        self.provenance("prepare")
        self.write("crates/a/src/lib.rs", "pub fn a() { /* edited */ }\n")
        self.assertNotEqual(self.verify(), 0, s.last_output)
        self.assertIn("STALE", s.last_output)
        rc, _elapsed, summary = s.run("tools/gpu/run-all.sh", ["tests"], {"RUN_ALL_DRY": "1"}, limit_s=60)
        self.assertEqual(rc, 3, s.last_output)
        self.assertIn("REFUSED", summary)
        self.assertIn("crates/a/src/lib.rs", summary)

    def test_a_new_untracked_input_after_prepare_is_refused(self):
        # A new file under crates/ (cargo finds tests/, examples/, src/bin/ by themselves).
        s = self.stubs
        self.provenance("begin")
        self.provenance("prepare")
        self.write("crates/a/examples/new.rs", "fn main() {}\n")
        self.assertNotEqual(self.verify(), 0, s.last_output)

    def test_changes_outside_the_inputs_during_prepare_are_not_a_change(self):
        # Goal: an untracked file, a docs edit and a docs commit landing while --prepare builds do
        # not mark the carry as made of two trees; the same untracked file under crates/ does.
        s = self.stubs
        self.provenance("begin")
        self.write("notes.txt", "untracked, outside the inputs\n")
        self.write("docs/a.md", "# a, edited\n")
        git(s.root, "commit", "-q", "-am", "docs")
        self.write("docs/b.md", "# b\n")
        self.provenance("prepare")
        self.assertEqual(self.commit_field("changed_during_prepare"), "no")
        self.assertEqual(self.verify(), 0, s.last_output)
        self.provenance("begin")
        self.write("crates/a/src/new.rs", "// untracked, an input\n")
        self.provenance("prepare")
        self.assertEqual(self.commit_field("changed_during_prepare"), "yes")
        self.assertNotEqual(self.verify(), 0, s.last_output)


@unittest.skipUnless(no_local_toolkit(), "a CUDA toolkit at /usr/local/cuda: the scripts would build with it")
class RunGpuTests(unittest.TestCase):
    def test_the_kernel_build_limit_reaches_nvcc(self):
        # Goal: run-gpu-tests.sh's limit on the kernel build (half its budget: 5 s here) ends
        # the build, nvcc included; an nvcc left running keeps the log pipe open until it ends.
        s = StubRoot()
        self.addCleanup(s.cleanup)
        s.stub("stub-bin/nvcc", 'if [[ "${1:-}" == --version ]]; then echo "Cuda compilation tools, stub"; exit 0; fi\nsleep 30')
        s.stub("target/gpu-carry/gpu-test", "echo 'gpu test: passed'")
        _rc, elapsed, summary = s.run("tools/gpu/run-gpu-tests.sh", [], {"GIO_GPU_TESTS_BUDGET_S": "10"}, limit_s=60)
        self.assertIn("NOTE kernels: building here with", summary)
        self.assertLess(elapsed, 15, summary)

    def test_the_kernel_build_ends_within_the_scripts_budget_after_slow_version_probes(self):
        # Goal: the build runs in a process group of its own (out of reach of run-all's timeout
        # on the step), so its limit is what the script's budget has left, not half the budget
        # from wherever it starts: two nvidia-smi probes of 9 s each, budget 20 s, an nvcc that
        # never ends. Before, the build had 10 s after 18 s of probes (28 s in all).
        s = StubRoot()
        self.addCleanup(s.cleanup)
        s.stub("stub-bin/nvidia-smi", "sleep 9")
        s.stub("stub-bin/nvcc", 'if [[ "${1:-}" == --version ]]; then echo "Cuda compilation tools, stub"; exit 0; fi\nsleep 30')
        s.stub("target/gpu-carry/gpu-test", "echo 'gpu test: passed'")
        _rc, elapsed, summary = s.run("tools/gpu/run-gpu-tests.sh", [], {"GIO_GPU_TESTS_BUDGET_S": "20"}, limit_s=60)
        self.assertIn("NOTE kernels: building here with", summary)
        self.assertLess(elapsed, 25.5, summary)

    def python_calls(self, live: bool) -> str:
        """What run-gpu-tests.sh asked python3 for (a python3 on PATH that logs its arguments,
        then runs the real one), with a carried GPU test that passes and no nvcc; live: with
        GIO_GPU_TESTS_LIVE_LOG set, as run-all.sh sets it."""
        s = StubRoot()
        self.addCleanup(s.cleanup)
        calls = os.path.join(s.root, "python-calls")
        s.stub("stub-bin/python3", f'echo "$*" >>{calls}\nexec {shutil.which("python3")} "$@"')
        s.stub("target/gpu-carry/gpu-test", "echo 'gpu test: passed'")
        env = {"GIO_GPU_TESTS_LIVE_LOG": os.path.join(s.root, "run.log")} if live else {}
        _rc, _elapsed, summary = s.run("tools/gpu/run-gpu-tests.sh", [], env, limit_s=60)
        self.assertIn("PASS gpu test", summary)
        try:
            with open(calls) as handle:
                return handle.read()
        except FileNotFoundError:
            return ""

    def test_run_all_as_the_caller_skips_the_probes_its_header_made(self):
        # Goal: under run-all.sh (GIO_GPU_TESTS_LIVE_LOG set) torch is not imported again (10-20 s
        # of the tests step on the GPU machine) nor cuda-attrs.py run again: run-all's header
        # recorded both. Alone, the script still records them in versions.txt.
        # (The kernel load probe, `cuda-attrs.py --load-probe`, is another question, asked either way.)
        def attribute_probes(calls: str) -> list[str]:
            return [line for line in calls.splitlines() if "cuda-attrs.py" in line and "--load-probe" not in line]

        under_run_all = self.python_calls(live=True)
        self.assertNotIn("import torch", under_run_all)
        self.assertEqual(attribute_probes(under_run_all), [])
        alone = self.python_calls(live=False)
        self.assertIn("import torch", alone)
        self.assertNotEqual(attribute_probes(alone), [])


# A libcuda for cuda-attrs.py's load probe: one sm_90 device on a CUDA 12.4 driver, whose
# cuModuleLoadData loads an image starting with "LOADS" and refuses any other with
# CUDA_ERROR_UNSUPPORTED_PTX_VERSION (222), as a 12.x driver refuses CUDA 13 cubins.
STUB_LIBCUDA = r"""
#include <string.h>
int cuInit(unsigned flags) { (void)flags; return 0; }
int cuDriverGetVersion(int *version) { *version = 12040; return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return ordinal == 0 ? 0 : 101; }
int cuDeviceGetName(char *name, int len, int device) { (void)device; strncpy(name, "Stub GPU", (size_t)len); return 0; }
int cuDeviceGetAttribute(int *value, int attribute, int device) {
    (void)device; *value = attribute == 75 ? 9 : attribute == 76 ? 0 : 1; return 0; }
int cuDevicePrimaryCtxRetain(void **context, int device) { (void)device; *context = (void *)1; return 0; }
int cuDevicePrimaryCtxRelease_v2(int device) { (void)device; return 0; }
int cuCtxSetCurrent(void *context) { (void)context; return 0; }
int cuModuleLoadData(void **module, const void *image) {
    if (memcmp(image, "LOADS", 5) != 0) return 222;
    *module = (void *)1; return 0; }
int cuModuleUnload(void *module) { (void)module; return 0; }
"""


@unittest.skipUnless(no_local_toolkit(), "a CUDA toolkit at /usr/local/cuda: the scripts would build with it")
class KernelLoadProbe(unittest.TestCase):
    """run-gpu-tests.sh's choice of kernels, with a stub libcuda (built here with cc) that loads
    only some images: the kernels used are ones the driver loads."""

    def setUp(self):
        if not shutil.which("cc"):
            self.skipTest("no C compiler for the stub libcuda")
        self.stubs = StubRoot()
        self.addCleanup(self.stubs.cleanup)
        s = self.stubs
        self.lib = os.path.join(s.root, "stub-lib")
        os.makedirs(self.lib)
        source = os.path.join(self.lib, "libcuda.c")
        with open(source, "w") as handle:
            handle.write(STUB_LIBCUDA)
        subprocess.run(["cc", "-shared", "-fPIC", "-o", os.path.join(self.lib, "libcuda.so.1"), source], check=True)
        self.stem = subprocess.run(["bash", os.path.join(s.root, "tools/cuda-build.sh"), "--image-stem"], capture_output=True,
                                   text=True, check=True).stdout.strip()
        # The GPU test stub says which kernel directory it was given.
        s.stub("target/gpu-carry/gpu-test", 'echo "kernel dir $GIO_KERNEL_DIR"; echo "gpu test: passed"')
        # An nvcc whose build (cuda-build.sh, stubbed) succeeds, writing an image per STUB_BUILT.
        s.stub("stub-bin/nvcc", 'echo "Cuda compilation tools, stub"')
        s.stub("tools/cuda-build.sh", f"""
if [[ "${{1:-}}" == --image-stem ]]; then echo {self.stem}; exit 0; fi
mkdir -p "$1"; printf '%s' "$STUB_BUILT" >"$1/{self.stem}.sm_90.cubin"; touch "$1/kernels-ok.txt" """)

    def carried(self, content: str):
        with open(os.path.join(self.stubs.carry, "kernels", f"{self.stem}.sm_90.cubin"), "w") as handle:
            handle.write(content)

    def run_tests(self, built: str) -> tuple[str, str]:
        s = self.stubs
        env = {"LD_LIBRARY_PATH": self.lib, "STUB_BUILT": built, "GIO_GPU_TESTS_BUDGET_S": "60"}
        _rc, _elapsed, summary = s.run("tools/gpu/run-gpu-tests.sh", [], env, limit_s=60)
        try:
            with open(os.path.join(s.out, "gpu-staged.log")) as handle:
                return summary, handle.read()
        except FileNotFoundError:  # the GPU test did not run
            return summary, ""

    def test_built_kernels_the_driver_refuses_give_way_to_carried_ones_it_loads(self):
        # Goal: kernels built on the GPU machine (its nvcc newer than its driver, say) are used
        # only if the driver loads them; else the carried ones, if those load.
        self.carried("LOADS carried")
        summary, log = self.run_tests(built="REFUSED built")
        self.assertIn(f"kernel dir {self.stubs.carry}/kernels", log, summary)
        self.assertIn("does not load", summary)

    def test_built_kernels_the_driver_loads_are_used(self):
        self.carried("REFUSED carried")
        summary, log = self.run_tests(built="LOADS built")
        self.assertIn(f"kernel dir {self.stubs.root}/target/kernels", log, summary)
        self.assertIn("PASS kernels built here", summary)

    def test_no_kernels_the_driver_loads_fail_before_the_gpu_test(self):
        # Goal: carried CUDA 13 cubins on a 12.x driver (and no build here that loads) say so,
        # naming the driver, instead of the GPU test failing at cuModuleLoadData.
        self.carried("REFUSED carried")
        summary, log = self.run_tests(built="REFUSED built")
        self.assertIn("FAIL kernels", summary)
        self.assertIn("12.4", summary)
        self.assertEqual(log, "", "the GPU test ran without a kernel the driver loads")


class WheelVenv(unittest.TestCase):
    """tools/python/wheel.sh (run-all.sh --prepare builds the carried wheel with it) in a temporary
    root and HOME, with stub interpreters: which venv it makes or reuses."""

    def setUp(self):
        self.directory = tempfile.TemporaryDirectory()
        self.addCleanup(self.directory.cleanup)
        self.root = self.directory.name
        for path in ("tools/python/wheel.sh", "python/requirements-test.txt"):
            os.makedirs(os.path.dirname(os.path.join(self.root, path)), exist_ok=True)
            shutil.copy(os.path.join(ROOT, path), os.path.join(self.root, path))
        self.made = os.path.join(self.root, "venvs-made")

    def interpreter(self, tag: str) -> str:
        """A python whose `-c` prints `tag` (what sys.implementation.cache_tag prints) and whose
        `-m venv DIR` makes a venv of stubs (a python that succeeds at everything, a maturin that
        writes a wheel into its -o) and notes it in venvs-made."""
        stubs = {"venv-python": "exit 0",
                 "venv-maturin": 'while [[ $# -gt 0 && "$1" != -o ]]; do shift; done\n'
                                 '[[ $# -eq 0 ]] || { mkdir -p "$2"; touch "$2/tutti-0.1.0-cp39-abi3-linux.whl"; }',
                 f"python-{tag}": f"""case "$1" in
  -c) echo {tag} ;;
  -m) [[ "$2" == venv ]] || exit 1
      mkdir -p "$3/bin"
      cp {self.root}/venv-python "$3/bin/python"
      cp {self.root}/venv-maturin "$3/bin/maturin"
      echo "$3" >>{self.made} ;;
esac"""}
        for name, body in stubs.items():
            with open(os.path.join(self.root, name), "w") as handle:
                handle.write("#!/usr/bin/env bash\n" + body + "\n")
            os.chmod(os.path.join(self.root, name), 0o755)
        return os.path.join(self.root, f"python-{tag}")

    def wheel(self, python: str) -> str:
        """The venv wheel.sh printed on its last line."""
        done = subprocess.run(["bash", os.path.join(self.root, "tools/python/wheel.sh")], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "HOME": self.root, "TUTTI_PYTHON": python})
        self.assertEqual(done.returncode, 0, done.stderr)
        return done.stdout.strip().splitlines()[-1]

    def test_another_interpreter_gets_a_venv_of_its_own(self):
        # Goal: the venv is keyed by the interpreter's version as well as the pins: TUTTI_PYTHON
        # naming another python makes a venv of that python (one reused before, made by another),
        # and the same python reuses its own.
        first = self.wheel(self.interpreter("cpython-310"))
        self.assertEqual(self.wheel(self.interpreter("cpython-310")), first)
        other = self.wheel(self.interpreter("cpython-312"))
        self.assertNotEqual(other, first)
        with open(self.made) as handle:
            self.assertEqual(handle.read().split(), [first, other])


if __name__ == "__main__":
    unittest.main()
