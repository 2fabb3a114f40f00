#!/usr/bin/env bash
# tools/gpu/run-all.sh — issue 15 items 2 to 6, and issue 14's GPU memory through tuttid, on a GPU
# machine, in one device call (a later session's call may finish a PARTIAL slack grid).
#
# usage, in the repository root:
#   tools/gpu/run-all.sh --prepare      on the development machine (cargo, pip, network): what the
#                                       GPU machine cannot build, into target/gpu-carry/
#   tools/gpu/run-all.sh --plan         the device call and its time arithmetic (below), as key=value
#   tools/gpu/run-all.sh --plan --left-s N [STEP...]   that call (or one of those STEPs) sized for
#                                       N s of device time left (status's budget_left_s, read right
#                                       before the call), or call=no below its floor_s
#   tools/gpu/run-all.sh [STEP...]      on the GPU machine; STEPs run in the order given (default: the
#                                       planned call's, tests green bandwidth ipc prefill python slack):
#     tests      item 2: tools/gpu/run-gpu-tests.sh (kernels, rule checks, the gio-uring GPU test)
#     green      item 3: tools/gpu/green-contexts.cu, GEMM slowdown beside a poller
#     bandwidth  item 5: tools/gpu/h2d-bandwidth.cu, pinned/registered/mapped copies per KV layer
#     ipc        issue 14 item 3: tuttid-gpu-check — tuttid on emu:mem with --device-memory cuda, a
#                client process stores from its cuMemAlloc'd KV memory registered through CUDA IPC,
#                another retrieves into its own and compares every byte (docs/tuttid.md, GPU memory)
#     python     issue 12: the tutti wheel (carried) installed beside the machine's PyTorch, tuttid
#                (carried) on emu:mem with --device-memory cuda; tools/gpu/python-cuda-check.py
#                stores from one process's torch CUDA KV tensors and retrieves into another's,
#                comparing every byte, and prints GiB/s (docs/python.md, GPU memory)
#     slack      item 4: tools/gpu/slack-profile.py timeline, then `tutti-profile import` to a table
#     prefill    issue 15 item 6: tools/gpu/prefill-ttft.py — a Llama-3.1-8B-shaped
#                transformers model (random weights) prefills an 8192-token prompt whose prefix KV
#                tutti retrieves layer by layer (the wheel and tuttid carried, emu:mem, --device-memory
#                cuda), against recomputing the prefix, at hit rates 0.25/0.5/0.9: TTFT, exposed I/O,
#                logits checked (its budget, RUN_ALL_PREFILL_BUDGET_S, default 150 s, includes model
#                set-up) → prefill-ttft.json (rewritten after each hit rate)
#
# The device allows 10 minutes per call and 15 minutes (900 s) of device time per session, the
# machine's start (60-150 s), the transfers, idle waits and the close included, and the machine
# goes back 30 s after a call: a second call sent after an agent's turn may find it gone and pay
# a fresh start out of a budget sized for a warm one. So there is ONE call, every step in it,
# slack (whose budget is simply what is left) last: `bash tools/gpu/run-all.sh tests green
# bandwidth ipc prefill python slack` with timeout_s 590 (PLAN_TIMEOUT_S; less, with a deadline to
# match, where status says less than 900 s is left: --plan --left-s); its deadline (below,
# default 570) ends every step 20 s before that, and 150 s of start + 590 leaves 160 s of the 900
# for the transfers and the close (a start of up to ~250 s still fits). `--plan` prints these
# figures; tools/gpu/test_run_all.py (DevicePlan) checks them against the device's limits and
# the runbook. ipc, short, comes before prefill because it proves the CUDA IPC path through
# tuttid that prefill stands on. The slack profile gets --budget-s of what is left less its
# margins and a hard `timeout` of that plus 45 s, also when the deadline bounds it (it rewrites
# its CSV after each input length, so a kill keeps the lengths done); the SM count comes from the
# header's probe (no second torch import), then the import: everything ends by the deadline, before
# the call's limit. The rest of its grid waits for a later session (--input-first K,
# docs/gio-uring.md).
# docs/gio-uring.md ("Running on a GPU") gives the exact call and the carry list. `bash` in front:
# the copy may not keep exec bits (carried binaries are chmod +x'ed at the start for the same
# reason).
#
# Deadline: RUN_ALL_DEADLINE_S (default 570: the call's timeout_s 590 less 20 s) seconds after this
# script starts, every step has ended. Each step's timeouts are capped at what is left of it less
# 15 s (their kill grace included); a step that no longer fits its minimum gets a `NOT RUN <step>:
# deadline` line and is skipped. summary.txt is written as the run goes (a `RUNNING <step>` line
# while a step runs, replaced by its PASS/FAIL line), and run.log gets each step's output live, so
# a call killed at its limit still brings back what ran. RUN_ALL_DRY=1 runs the bookkeeping alone
# (each step a `sleep` of RUN_ALL_DRY_SLEEP_S, default 1, under the same caps; no GPU needed).
#
# run.log is capped: a step's output over RUN_ALL_STEP_LOG_MAX bytes (default 4 MiB) keeps its
# first quarter and last three quarters around a line saying how much was cut, and the whole log
# is cut the same way at RUN_ALL_LOG_MAX (default 15 MiB; the tool brings back no file over 16 MiB).
#
# What the GPU machine has (the lent H100/H200: CUDA with nvcc, a driver, python3 with PyTorch;
# no cargo, no network; only the working tree and carried paths travel, 64 MiB): the .cu programs
# are compiled there with its own nvcc (matching its driver), else the copies --prepare built here
# with the pinned CUDA 13.2 wheels are used. tutti-profile and the GPU test binary come from
# target/gpu-carry (built here; they link glibc dynamically, so the GPU machine's glibc must be no
# older than this machine's), as do tuttid and tuttid-gpu-check (the `cuda` feature; libcuda is
# loaded at run time). .git does not travel: --prepare writes target/gpu-carry/COMMIT (commit,
# dirty or not, hashes of the status, the diff and the carry's input files), INPUTS (each input
# file's sha256: provenance.py's INPUTS list, what the builds and the steps read) and ABI (the highest
# GLIBC_ version each carried binary and the wheel's module need, the wheel's platform tag) with
# tools/gpu/provenance.py; summary.txt's header gives the commit, the carry's glibc need against
# this machine's glibc, and where libcuda is, so an ABI mismatch shows in $OUT.
#
# Results in $OUT (default target/gpu-results), at most 8 files, flat:
#   summary.txt            one PASS/FAIL/NOT RUN line per step, with versions, CUDA attributes, times
#   run.log                every step's output, live (run-gpu-tests.sh's files are streamed here)
#   green-contexts.json    item 3 figures          bandwidth.json       item 5 figures (cudaMemcpy & co.)
#   bandwidth-kernel.json  item 5 through the gio kernel (gpu-layer-load)
#   slack-timeline.csv.gz  item 4 kernel timeline, gzipped (provenance in its '#' lines; the CSV of a
#                          complete grid is ~20 MiB, over the 16 MiB the tool brings back)
#   slack-table.json       the imported table
#   prefill-ttft.json      item 6 figures
# That is 8 with every step: the slack profile's provenance (machine, driver, versions, date, grid)
# travels in slack-timeline.csv.gz's '#' lines; its JSON copy stays in the scratch directory. A
# `.partial` left by a step killed mid-rewrite is removed at the exit (finish).
# Exit status: non-zero if any step failed; 3 if the pre-flight refused a stale carry (below;
# `run-all.sh --verify` runs the pre-flight alone, here or there: run it here right before each
# device call, it costs no device time). Every step runs under `timeout`.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
CARRY="$ROOT/target/gpu-carry"
# The device call (docs/gio-uring.md, "Running on a GPU"; --plan prints it): one call, every step,
# slack last. PLAN_START_MAX_S + PLAN_TIMEOUT_S must leave PLAN_SESSION_S room for the transfers
# and the close; PLAN_DEADLINE_S (the default RUN_ALL_DEADLINE_S) leaves the call 20 s to exit.
PLAN_SESSION_S=900   # device time per session: start, transfers, idle waits and the close included
PLAN_START_MAX_S=150 # the slowest machine start seen
PLAN_TIMEOUT_S=590   # the call's timeout_s (a call may run 600 s)
PLAN_DEADLINE_S=570  # every step has ended by then; 20 s for the exit (tuttid's stop, the log trim)
PLAN_STEPS=(tests green bandwidth ipc prefill python slack)
# A session with less than PLAN_SESSION_S left (a retry after a failed start, which costs 1-2
# minutes per kind tried, or a later session at the same work: the device counts earlier tries
# in, and cuts a call's limit to what is left) sizes its call from status's budget_left_s:
# `--plan --left-s N` gives timeout_s = min(PLAN_TIMEOUT_S, N - PLAN_START_MAX_S -
# PLAN_TRANSFER_MARGIN_S) and the command with RUN_ALL_DEADLINE_S = timeout_s - 20, so the call
# ends by its own deadline, inside the time the tool allows it, and $OUT still comes back. It says
# not to call (call=no, floor_s) where the call could not start its first step: under the start,
# the transfers, 20 s to exit, the loop's 15 s margin, PLAN_HEADER_S and that step's minimum
# (step_minimum; at least PLAN_TIMEOUT_MIN_S for the call). STEPs after N: a call of those steps
# alone (slack to finish a PARTIAL grid: N of at least 370), sized the same way.
PLAN_TRANSFER_MARGIN_S=60 # the upload (~9 MB of tree, ~23 MB of carry), the download and the close
PLAN_TIMEOUT_MIN_S=90     # less, and the steps after the start and transfers are hardly worth it
PLAN_HEADER_S=30          # the header before the first step (cuda-attrs, nvidia-smi, torch's import)
# The least a step needs to be worth starting (its set-up included); below it: NOT RUN, deadline.
# python and prefill import torch (10-20 s on the GPU machine) and install the wheel before their
# own limits are worked out, so their minimums are those limits' needs plus 20 s: python's check
# gets the cap less 40 s (tuttid's stop) and needs 20 s; prefill needs a 30 s budget plus 90 s of
# margin. Lower, a started step spent its imports and then said NOT RUN anyway. slack: a 30 s
# budget, its 45 s hard-limit margin and the 20 s kept for the import.
step_minimum() {
  case "$1" in tests) echo 60 ;; prefill) echo 140 ;; slack) echo 95 ;; python) echo 80 ;; *) echo 30 ;; esac
}
if [[ "${1:-}" == "--plan" ]]; then
  timeout_s=$PLAN_TIMEOUT_S deadline_s=$PLAN_DEADLINE_S plan_steps=("${PLAN_STEPS[@]}") left=""
  if [[ $# -gt 1 ]]; then
    if [[ "$2" != --left-s || $# -lt 3 || ! "$3" =~ ^(0|[1-9][0-9]{0,5})$ ]]; then
      echo "run-all: usage: run-all.sh --plan [--left-s SECONDS [STEP...]] (SECONDS: status's budget_left_s, a whole number)" >&2
      exit 2
    fi
    left=$3
    shift 3
    if [[ $# -gt 0 ]]; then
      plan_steps=("$@")
      for step in "${plan_steps[@]}"; do
        case "$step" in tests | green | bandwidth | ipc | python | slack | prefill) ;; *) echo "run-all: unknown step '$step' (tests green bandwidth ipc python slack prefill)" >&2; exit 2 ;; esac
      done
    fi
    # The call must outlast its 20 s exit, the loop's 15 s margin, the header and the first
    # step's minimum, or that step only writes `NOT RUN ...: deadline`.
    first=${plan_steps[0]}
    least=$((20 + 15 + PLAN_HEADER_S + $(step_minimum "$first")))
    ((least < PLAN_TIMEOUT_MIN_S)) && least=$PLAN_TIMEOUT_MIN_S
    floor=$((PLAN_START_MAX_S + PLAN_TRANSFER_MARGIN_S + least))
    echo "left_s=$left"
    echo "start_max_s=$PLAN_START_MAX_S"
    echo "transfer_margin_s=$PLAN_TRANSFER_MARGIN_S"
    echo "floor_s=$floor"
    if ((left < floor)); then
      echo "call=no"
      echo "reason=do not call: ${left} s left is under ${floor} s (a ${PLAN_START_MAX_S} s start, ${PLAN_TRANSFER_MARGIN_S} s of transfers and the close, and a call of at least ${least} s: 20 s to exit, the 15 s margin, ~${PLAN_HEADER_S} s of header and ${first}'s minimum of $(step_minimum "$first") s); the steps wait for a later session"
      exit 0
    fi
    timeout_s=$((left - PLAN_START_MAX_S - PLAN_TRANSFER_MARGIN_S))
    ((timeout_s > PLAN_TIMEOUT_S)) && timeout_s=$PLAN_TIMEOUT_S
    deadline_s=$((timeout_s - 20))
    echo "call=yes"
  else
    echo "session_s=$PLAN_SESSION_S"
    echo "start_max_s=$PLAN_START_MAX_S"
    echo "transfer_margin_s=$PLAN_TRANSFER_MARGIN_S"
    echo "left_for_transfers_and_close_s=$((PLAN_SESSION_S - PLAN_START_MAX_S - PLAN_TIMEOUT_S))"
  fi
  command="bash tools/gpu/run-all.sh ${plan_steps[*]}"
  [[ -n "$left" ]] && command="RUN_ALL_DEADLINE_S=$deadline_s $command"
  echo "calls=1"
  echo "steps=${plan_steps[*]}"
  echo "command=$command"
  echo "carry=target/gpu-carry"
  echo "timeout_s=$timeout_s"
  echo "deadline_s=$deadline_s"
  exit 0
fi
CU_PROGRAMS=(green-contexts h2d-bandwidth)
# Warnings are errors, as for the I/O kernel (tools/cuda-build.sh).
NVCC_FLAGS=(-std=c++17 -O2 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror)

# nvcc NVCC ARCH OUT_DIR [INCLUDE_DIR]: the .cu programs, for one architecture.
build_programs() {
  local nvcc=$1 arch=$2 out=$3 include=${4:-}
  mkdir -p "$out"
  local extra=()
  [[ -n "$include" ]] && extra=(-I "$include")
  "$nvcc" "${NVCC_FLAGS[@]}" "${extra[@]}" -arch="$arch" -o "$out/green-contexts" tools/gpu/green-contexts.cu -ldl &&
    "$nvcc" "${NVCC_FLAGS[@]}" "${extra[@]}" -arch="$arch" -o "$out/h2d-bandwidth" tools/gpu/h2d-bandwidth.cu
}

# cargo_executables CARGO_ARGS... -- NAME...: runs `cargo CARGO_ARGS
# --message-format=json-render-diagnostics` and prints, one a line in the order named, the
# executable cargo names for each target NAME (tools/lib/cargo-executables.py: never a fixed
# target/release, which under CARGO_TARGET_DIR -- docs/gio-uring.md's GPU test exports
# target-gio -- may hold an older build, of other features). Fails, saying why, if the build
# fails or names no executable for one of them.
cargo_executables() {
  local args=()
  while [[ $# -gt 0 && "$1" != -- ]]; do args+=("$1"); shift; done
  shift
  cargo "${args[@]}" --message-format=json-render-diagnostics |
    python3 "$ROOT/tools/lib/cargo-executables.py" "run-all: cargo ${args[*]}" "$@"
}

# --verify: only the pre-flight below (whether target/gpu-carry was prepared from this tree's inputs).
if [[ "${1:-}" == "--verify" ]]; then
  python3 tools/gpu/provenance.py verify "$CARRY"
  exit $?
fi

if [[ "${1:-}" == "--prepare" ]]; then
  set -e
  rm -f "$CARRY/COMMIT" "$CARRY/INPUTS" "$CARRY/TRACKED" "$CARRY/ABI" # never a stale record of an earlier carry
  # The carry's inputs as the build starts from them: provenance.py prepare compares them with the
  # inputs at the end, so an edit or a commit of an input (provenance.py INPUTS) landing during the
  # build is recorded (COMMIT's changed_during_prepare); changes elsewhere are not.
  python3 tools/gpu/provenance.py begin "$CARRY" ||
    echo "run-all: WARNING: the tree was not recorded before the build; COMMIT will not say whether it changed during it" >&2
  bash tools/gpu/run-gpu-tests.sh --prepare              # kernels + gio-uring GPU test binary
  built=$(cargo_executables build --release --locked -p tutti-profile --bin tutti-profile -- tutti-profile)
  cp "$built" "$CARRY/tutti-profile"
  strip "$CARRY/tutti-profile"
  wheels="$ROOT/.tools/cuda-wheels-13.2.86/nvidia/cu13"  # installed by tools/cuda-build.sh above
  build_programs "$wheels/bin/nvcc" sm_90 "$CARRY" "$wheels/include"
  # Item 5 through the gio kernel: the timed staged layer-load example.
  if [[ -f crates/gio-uring/examples/gpu_layer_load.rs ]]; then
    built=$(cargo_executables build --release --locked -p gio-uring --features cuda --example gpu_layer_load -- gpu_layer_load)
    cp "$built" "$CARRY/gpu-layer-load"
    strip "$CARRY/gpu-layer-load"
  fi
  # Issue 14: GPU memory through tuttid (the ipc step; python and prefill run this tuttid too).
  # An earlier carry's pair goes first: a failed build or check below leaves none to be run.
  rm -f "$CARRY/tuttid" "$CARRY/tuttid-gpu-check"
  built=$(cargo_executables build --release --locked -p tuttid --features cuda --bin tuttid --bin tuttid-gpu-check \
    -- tuttid tuttid-gpu-check)
  mapfile -t binaries <<<"$built"
  # A tuttid without the `cuda` feature refuses --device-memory cuda at start, with this text
  # (crates/daemon/src/gpu_memory.rs): carried, it would fail the ipc, python and prefill steps
  # only on the GPU machine, its device time spent.
  if grep -qaF 'this tuttid was built without the `cuda` feature' "${binaries[0]}"; then
    echo "run-all: ${binaries[0]} was built without the \`cuda\` feature; not carried" >&2
    exit 1
  fi
  cp "${binaries[0]}" "$CARRY/tuttid"
  cp "${binaries[1]}" "$CARRY/tuttid-gpu-check"
  strip "$CARRY/tuttid" "$CARRY/tuttid-gpu-check"
  # Issue 12: the tutti wheel (abi3, the `cuda` feature: libcuda is loaded at run time) for the
  # python step, which installs it beside the GPU machine's PyTorch.
  tools/python/wheel.sh >/dev/null
  rm -f "$CARRY"/tutti-*.whl
  cp target/wheels/tutti-*-abi3-*.whl "$CARRY/"
  python3 -m unittest discover -s tools/gpu -p 'test_*.py'
  # Provenance and ABI for the GPU machine, where .git is not (tools/gpu/provenance.py), last:
  # the carry is complete. It warns, and COMMIT says so, if the inputs changed since `begin`.
  python3 tools/gpu/provenance.py prepare "$CARRY" && sed 's/^/run-all: ABI /' "$CARRY/ABI" ||
    echo "run-all: WARNING: provenance not recorded (target/gpu-carry/COMMIT, ABI); the GPU run will say commit unknown" >&2
  du -sh "$CARRY"
  echo "run-all: carry target/gpu-carry; run bash tools/gpu/run-all.sh STEP... there (see docs/gio-uring.md, Running on a GPU)"
  exit 0
fi

# The steps are checked before $OUT is touched.
STEPS=("$@")
[[ ${#STEPS[@]} -eq 0 ]] && STEPS=("${PLAN_STEPS[@]}")
for step in "${STEPS[@]}"; do
  case "$step" in tests | green | bandwidth | ipc | python | slack | prefill) ;; *) echo "run-all: unknown step '$step' (tests green bandwidth ipc python slack prefill)" >&2; exit 2 ;; esac
done

OUT="${OUT:-$ROOT/target/gpu-results}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
LOG="$OUT/run.log"
: >"$SUMMARY"
: >"$LOG"
failed=0
# The line goes to summary.txt first, then to stdout; the echo runs in a subshell and its errors
# are ignored: were the tool's pipe closed, `tee` (which wrote stdout first) died of SIGPIPE
# before the file got the line, and an echo here would kill the script the same way.
record() {
  printf '%s\n' "$1" >>"$SUMMARY"
  (printf '%s\n' "$1") 2>/dev/null || true
}
section() { echo "===== $1 ($(date -u +%H:%M:%S), +${SECONDS} s)" >>"$LOG"; }
budget() { local name="RUN_ALL_${1}_BUDGET_S"; echo "${!name:-$2}"; }

# Pre-flight, before any step: the carried gpu-test, tuttid, wheel and tutti-profile must come
# from this tree's inputs (tools/gpu/provenance.py verify: every file of its INPUTS list hashes as
# recorded in target/gpu-carry/INPUTS and the inputs did not change while --prepare built; edits
# and commits outside the inputs, docs say, do not count), else the steps would run old binaries
# beside this tree's kernels and scripts (the ABI version would not tell). Steps given builds of their own
# (RUN_ALL_TUTTID and RUN_ALL_WHEEL for python and prefill, RUN_ALL_TUTTI_PROFILE for slack:
# tools/gpu/check.sh's rehearsals) need no carry. RUN_ALL_ALLOW_STALE=1 runs a stale carry on
# purpose: every step's PASS/FAIL line then says STALE.
STALE_MARK=""
carry_steps=()
for step in "${STEPS[@]}"; do
  case "$step" in
    python | prefill) [[ -n "${RUN_ALL_TUTTID:-}" && -n "${RUN_ALL_WHEEL:-}" ]] && continue ;;
    slack) [[ -n "${RUN_ALL_TUTTI_PROFILE:-}" ]] && continue ;;
  esac
  carry_steps+=("$step")
done
if [[ ${#carry_steps[@]} -gt 0 ]]; then
  if ! carry_check=$(python3 tools/gpu/provenance.py verify "$CARRY" 2>&1); then
    if [[ "${RUN_ALL_ALLOW_STALE:-}" != 1 ]]; then
      record "REFUSED: $carry_check. Nothing was run (steps ${carry_steps[*]} use the carry). Run tools/gpu/run-all.sh --prepare on the development machine while nothing under its inputs (tools/gpu/provenance.py INPUTS) is being edited, check it with tools/gpu/run-all.sh --verify there right before the device call, and carry it again; RUN_ALL_ALLOW_STALE=1 runs it anyway, every step marked STALE"
      exit 3
    fi
    STALE_MARK=" STALE (RUN_ALL_ALLOW_STALE=1: $carry_check)"
    record "NOTE every step below is STALE: $carry_check"
  fi
fi
WORK="$(mktemp -d)"

DEADLINE=${RUN_ALL_DEADLINE_S:-$PLAN_DEADLINE_S}
[[ "$DEADLINE" =~ ^[1-9][0-9]*$ ]] || { echo "run-all: RUN_ALL_DEADLINE_S must be a positive number of seconds" >&2; exit 2; }
# cap SECONDS: SECONDS, or less so that a `timeout -k 10` of it ends 5 s before the deadline (at
# least 1: `timeout 0` would mean no limit at all).
cap() {
  local room=$((DEADLINE - SECONDS - 15))
  ((room < 1)) && room=1
  ((${1} < room)) && room=$1
  echo "$room"
}

# run.log's size: the device tool brings back no file over 16 MiB.
STEP_LOG_MAX=${RUN_ALL_STEP_LOG_MAX:-4194304}
LOG_MAX=${RUN_ALL_LOG_MAX:-15728640}
# trim_log OFFSET MAX: if run.log from byte OFFSET on is over MAX bytes, keep its first quarter and
# last three quarters of MAX around a line saying what was cut. Rewritten in place (truncate and
# write), so a process still appending to it (O_APPEND) keeps appending to the same file.
trim_log() {
  local offset=$1 max=$2 size
  size=$(stat -c %s "$LOG" 2>/dev/null) || return 0
  ((size - offset > max)) || return 0
  local head=$((max / 4)) tail=$((max * 3 / 4 - 256))
  {
    head -c "$((offset + head))" "$LOG"
    printf '\n===== run-all: %d bytes cut here (over %d bytes; RUN_ALL_STEP_LOG_MAX / RUN_ALL_LOG_MAX)\n' \
      "$((size - offset - head - tail))" "$max"
    tail -c "$tail" "$LOG"
  } >"$WORK/log.trim" && cat "$WORK/log.trim" >"$LOG"
  rm -f "$WORK/log.trim"
}
CURRENT_STEP=""
# The python step's tuttid while it runs (started in the background): a TERM or INT trap exits
# through finish, past the step's own stop of it, so finish stops it too (TERM, up to 10 s to
# shut down, then KILL), or it would outlive the run.
PYTHON_TUTTID_PID=""
stop_python_tuttid() {
  local wait_s=$1
  [[ -n "$PYTHON_TUTTID_PID" ]] || return 0
  kill -TERM "$PYTHON_TUTTID_PID" 2>/dev/null
  timeout "$wait_s" tail --pid="$PYTHON_TUTTID_PID" -f /dev/null 2>/dev/null || kill -KILL "$PYTHON_TUTTID_PID" 2>/dev/null
  wait "$PYTHON_TUTTID_PID" 2>/dev/null
  PYTHON_TUTTID_PID=""
}
# finish also removes a writer's `.partial` from $OUT (a step killed between writing one and
# renaming it; slack-profile's gzip takes about 1 s per 20 MiB): it would be a ninth file, and the
# tool brings back 8, not of our choosing. Every writer renames atomically, so a `.partial` is
# never a result's only copy.
finish() {
  stop_python_tuttid 10
  rm -f "$OUT"/*.partial
  trim_log 0 "$LOG_MAX"
  rm -rf "$WORK"
}
trap finish EXIT
# A TERM or INT (the device tool's limit, say) leaves a line naming the step it stopped.
trap 'record "STOPPED by SIGTERM at +${SECONDS} s${CURRENT_STEP:+ during $CURRENT_STEP}"; exit 143' TERM
trap 'record "STOPPED by SIGINT at +${SECONDS} s${CURRENT_STEP:+ during $CURRENT_STEP}"; exit 130' INT

# The copy to the GPU machine may drop exec bits: the carried binaries are made executable here
# (ignoring errors), the scripts are run through bash, and carried binaries are checked with -f.
NOT_EXECUTABLE=""
for file in "$CARRY"/*; do
  [[ -f "$file" && ! -x "$file" ]] || continue
  chmod +x "$file" 2>/dev/null
  [[ -x "$file" ]] || NOT_EXECUTABLE+=" $(basename "$file")"
done

# nvcc: on PATH, else the toolkit's usual place.
NVCC=$(command -v nvcc 2>/dev/null) || { [[ -f /usr/local/cuda/bin/nvcc ]] && NVCC=/usr/local/cuda/bin/nvcc; } || NVCC=""

# The CUDA attributes that decide whether the gio kernel's atomics on host-mapped memory are atomic
# with respect to the host, and how host memory is reached (tools/gpu/cuda-attrs.py; ctypes on
# libcuda, no torch), once per call: the header shows them, the tests step notes the risk, the
# slack step takes the SM count from them.
timeout -k 5 30 python3 tools/gpu/cuda-attrs.py >"$WORK/cuda-attrs.txt" 2>&1 || echo "cuda-attrs: probe did not finish (exit $?)" >>"$WORK/cuda-attrs.txt"
cuda_attr() { local value; value=$(sed -n "s/^$1=//p" "$WORK/cuda-attrs.txt" | head -n 1); echo "${value:-unknown}"; }
# nvidia_smi ARGS...: nvidia-smi's answer on stdout, under the deadline's cap (at most 20 s, then
# KILL 2 s later). A hung nvidia-smi (after a hung kernel, say) hangs every query, not only one:
# once a query timed out, later ones are skipped at once (a file flag: callers run this in command
# substitutions; the step loop then puts a shim first on PATH for the steps' own scripts). What
# went wrong goes to stderr, never into the answer: nvidia-smi prints its own failures on stdout
# ("NVIDIA-SMI has failed ...", status 9), so its stdout is passed on only with status 0. Status
# 127, no nvidia-smi; 124, it did not answer in time (now or earlier); else nvidia-smi's.
nvidia_smi() {
  command -v nvidia-smi >/dev/null || { echo "no nvidia-smi" >&2; return 127; }
  if [[ -f "$WORK/nvidia-smi-hung" ]]; then
    echo "nvidia-smi not asked: $(cat "$WORK/nvidia-smi-hung")" >&2
    return 124
  fi
  local limit rc answer
  limit=$(cap 20)
  answer=$(timeout -k 2 "$limit" nvidia-smi "$@")
  rc=$?
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    # A cap under 10 s (near the deadline) can stop a slow but healthy nvidia-smi (no
    # persistence mode): only a longer wait marks it hung.
    if ((limit < 10)); then
      echo "nvidia-smi did not answer within $limit s (status $rc; the deadline's cap)" >&2
      return 124
    fi
    echo "an earlier query did not answer within $limit s (+${SECONDS} s)" >"$WORK/nvidia-smi-hung"
    echo "nvidia-smi did not answer within $limit s (status $rc): it is there but hung" >&2
    return 124
  fi
  if [[ $rc -ne 0 ]]; then
    echo "nvidia-smi failed (status $rc): ${answer:0:300}" >&2
    return $rc
  fi
  printf '%s\n' "$answer"
}

{
  echo "== run-all $(date -u +%Y-%m-%dT%H:%M:%SZ), steps: ${STEPS[*]}, deadline ${DEADLINE} s${RUN_ALL_DRY:+ (DRY RUN: RUN_ALL_DRY=1, every step a sleep)}"
  echo "== commit $(python3 tools/gpu/provenance.py line "$CARRY" 2>&1)"
  echo "== uname $(uname -srm)"
  echo "== gpu $(nvidia_smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm --format=csv,noheader 2>&1)"
  echo "== nvcc ${NVCC:-not found}${NVCC:+ $(timeout 20 "$NVCC" --version 2>&1 | tail -n 1)}"
  echo "== python $(timeout 60 python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -n 1)"
  echo "== glibc $(ldd --version 2>&1 | head -n 1)"
  echo "== carry abi $(python3 tools/gpu/provenance.py abi "$CARRY" 2>&1)"
  [[ -n "$NOT_EXECUTABLE" ]] && echo "== carry NOT executable after chmod +x:$NOT_EXECUTABLE"
  echo "== libcuda $(ldconfig -p 2>/dev/null | grep -E 'libcuda\.so' | sed -E 's/^[[:space:]]+//' | paste -sd ';' - | grep . || echo 'not in the ldconfig cache')"
  # A stub libcuda (a toolkit's lib64/stubs) on LD_LIBRARY_PATH makes cuInit fail.
  echo "== LD_LIBRARY_PATH ${LD_LIBRARY_PATH-<unset>}"
  # CUDA IPC export refuses expandable segments: the python and prefill steps set both names to
  # expandable_segments:False whatever they were (torch 2.11 reads PYTORCH_ALLOC_CONF first; the
  # CUDA name is its deprecated alias, which older torch reads).
  echo "== PYTORCH_ALLOC_CONF ${PYTORCH_ALLOC_CONF-<unset>}, PYTORCH_CUDA_ALLOC_CONF ${PYTORCH_CUDA_ALLOC_CONF-<unset>} (python and prefill steps: both expandable_segments:False)"
  echo "== cuda $(grep -v '^LD_LIBRARY_PATH=' "$WORK/cuda-attrs.txt" | paste -sd ' ' -)"
  # The carried kernels and .cu programs come from nvcc 13.2 (--prepare's pinned wheels): a 12.x
  # driver refuses them; the tests step checks which kernels load (run-gpu-tests.sh).
  echo "== carried CUDA: nvcc 13.2 (needs a 13.x driver); this driver: CUDA $(cuda_attr driverApiVersion)"
} >>"$SUMMARY"
cat "$SUMMARY"

# The programs: built here with this machine's nvcc for its GPU, else the carried sm_90 builds.
# The build is tried once per call: a failed one is not repeated by a later step.
PROGRAMS=""
PROGRAMS_BUILD_TRIED=0
programs() {
  [[ -n "$PROGRAMS" ]] && return 0
  # The architecture: the header's probe (no second query), else nvidia-smi's (bounded: a hung
  # one would hold the green step, and every step after it, past the deadline).
  local arch major minor
  major=$(cuda_attr computeCapabilityMajor) minor=$(cuda_attr computeCapabilityMinor)
  if [[ "$major" =~ ^[0-9]+$ && "$minor" =~ ^[0-9]+$ ]]; then
    arch="sm_$major$minor"
  else
    arch="sm_$(nvidia_smi --query-gpu=compute_cap --format=csv,noheader 2>>"$LOG" | head -n 1 | tr -d '. ')"
  fi
  if [[ $PROGRAMS_BUILD_TRIED -eq 0 && -n "$NVCC" && "$arch" =~ ^sm_[0-9]+$ ]]; then
    PROGRAMS_BUILD_TRIED=1
    section "build ${CU_PROGRAMS[*]} with $NVCC for $arch"
    if timeout -k 5 "$(cap 180)" bash -c "$(declare -p NVCC_FLAGS); $(declare -f build_programs); build_programs $(printf %q "$NVCC") $arch $WORK/bin" >>"$LOG" 2>&1; then
      PROGRAMS="$WORK/bin"
      return 0
    fi
    record "NOTE building ${CU_PROGRAMS[*]} here failed (see run.log); trying the carried builds"
  fi
  if [[ -f "$CARRY/green-contexts" && -f "$CARRY/h2d-bandwidth" ]]; then
    PROGRAMS="$CARRY"
    return 0
  fi
  return 1
}

# libcublas for green-contexts (it dlopens cuBLAS): the dynamic linker's, a toolkit's, PyTorch's.
find_cublas() {
  local found
  found=$(ldconfig -p 2>/dev/null | awk '/libcublas\.so\.[0-9]+ /{print $NF; exit}')
  [[ -z "$found" ]] && found=$(ls /usr/local/cuda*/lib64/libcublas.so.[0-9]* 2>/dev/null | head -n 1)
  [[ -z "$found" ]] && found=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
for root in roots:
    for hit in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcublas.so.*"))):
        print(hit)
        raise SystemExit
PY
)
  echo "$found"
}

# Whether this call's tests step saw `PASS gpu test` (yes/no; empty: no tests step ran). The
# layer load runs the same gio kernel: after a failed GPU test (a hung kernel hangs it the same
# way, for its whole limit) it is skipped, so that ipc, prefill and python, which do not use the
# gio kernel, keep their time.
GPU_TEST_PASSED=""

step_tests() {
  local out="$WORK/tests" rc budget_s
  mkdir -p "$out"
  budget_s=$(cap "$(budget TESTS 240)")
  # The attributes behind the gio kernel's atomics on host-mapped memory (the header's probe).
  section "cuda attributes (tools/gpu/cuda-attrs.py)"
  cat "$WORK/cuda-attrs.txt" >>"$LOG"
  local atomics
  atomics=$(cuda_attr hostNativeAtomicSupported)
  echo "tests: hostNativeAtomicSupported=$atomics pageableMemoryAccess=$(cuda_attr pageableMemoryAccess)" \
    "canUseHostPointerForRegisteredMem=$(cuda_attr canUseHostPointerForRegisteredMem)" >>"$SUMMARY"
  [[ "$atomics" == 0 ]] && record "NOTE tests: hostNativeAtomicSupported=0: the gio kernel's atomicCAS/atomicAdd on host-mapped memory (sink ring header, IOCB status and counters) are not atomic with respect to the host here; a wrong result may be that (docs/gio-uring.md, Known risks)"
  # run-gpu-tests.sh bounds each GPU test run by what is left of GIO_GPU_TESTS_BUDGET_S (at most
  # GIO_GPU_TEST_LIMIT_S, 90 s: it needs under 30), under
  # `timeout --foreground` (in this timeout's process group): it ends before this limit, and this
  # timeout's kill reaches the test binary too, so no persistent kernel outlives the step. Its
  # files are streamed into run.log as they are written (GIO_GPU_TESTS_LIVE_LOG), so a kill keeps
  # them; its PASS/FAIL lines go to summary.txt as they come.
  OUT="$out" GIO_GPU_TESTS_LIVE_LOG="$LOG" GIO_GPU_TESTS_BUDGET_S=$((budget_s > 40 ? budget_s - 15 : budget_s / 2)) \
    timeout -k 10 "$budget_s" bash tools/gpu/run-gpu-tests.sh 2>>"$LOG" | tee -a "$LOG" | sed -u 's/^/tests: /' >>"$SUMMARY"
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 124 || $rc -eq 137 ]] && record "NOTE tests: stopped at its limit of $budget_s s"
  GPU_TEST_PASSED=no
  grep -q '^tests: PASS gpu test' "$SUMMARY" && GPU_TEST_PASSED=yes
  [[ $rc -eq 0 ]]
}

step_green() {
  programs || { echo "no green-contexts program (no nvcc here and nothing carried)" >>"$LOG"; return 1; }
  local cublas
  cublas=$(find_cublas)
  echo "green: cuBLAS ${cublas:-not found}" >>"$SUMMARY"
  # The SM clock, power and temperature before and after: the program brackets every case by
  # baselines because they drift under sustained GEMMs; these lines show by how much. Capped like
  # the program: a hung nvidia-smi after a program stopped at its cap would run past the deadline.
  gpu_clocks() { nvidia_smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader 2>&1 | head -n 1; }
  echo "green: before: sm clock, mem clock, power, temperature: $(gpu_clocks)" >>"$SUMMARY"
  GREEN_CUBLAS_LIBRARY="$cublas" timeout -k 10 "$(cap "$(budget GREEN 150)")" "$PROGRAMS/green-contexts" --json "$OUT/green-contexts.json" >>"$LOG" 2>&1
  local rc=$?
  echo "green: after: sm clock, mem clock, power, temperature: $(gpu_clocks)" >>"$SUMMARY"
  return "$rc"
}

step_bandwidth() {
  local failed=0 rc
  # The two measurements are independent: a failed cudaMemcpy baseline must not cost the
  # gio-kernel layer loads (item 5 proper), nor the other way round.
  if programs; then
    timeout -k 10 "$(cap "$(budget BANDWIDTH 120)")" "$PROGRAMS/h2d-bandwidth" --json "$OUT/bandwidth.json" >>"$LOG" 2>&1 || {
      record "NOTE bandwidth: h2d-bandwidth (the cudaMemcpy baseline) failed; see run.log"
      failed=1
    }
  else
    echo "no h2d-bandwidth program (no nvcc here and nothing carried)" >>"$LOG"
    failed=1
  fi
  # KV layer loads through the gio kernel (staged mode, software controller): the example
  # crates/gio-uring/examples/gpu_layer_load.rs (docs/gio-uring.md, "Running on a GPU"), carried
  # by --prepare; without it this says so rather than measure something else. A half not run
  # fails the step (the NOT RUN line says why), as the deadline's does: item 5 proper is this
  # half, and a passed baseline alone must not read PASS bandwidth.
  if [[ ! -f "$CARRY/gpu-layer-load" ]]; then
    record "NOT RUN bandwidth through the gio kernel: target/gpu-carry/gpu-layer-load was not carried (tools/gpu/run-all.sh --prepare)"
    return 1
  fi
  if [[ "$GPU_TEST_PASSED" == no ]]; then
    record "NOT RUN bandwidth through the gio kernel: the GPU test did not pass (tests step): the layer load runs the same kernel"
    return 1
  fi
  # The kernels run-gpu-tests.sh built here, if that build completed (tools/cuda-build.sh writes
  # kernels-ok.txt last), else the carried ones; either way the ones it found the driver loads.
  local kernels="$ROOT/target/kernels"
  [[ -f "$kernels/kernels-ok.txt" && -f "$kernels/$(bash tools/cuda-build.sh --image-stem).sm_90.cubin" ]] || kernels="$CARRY/kernels"
  # The ones the tests step chose because the driver loads them (run-gpu-tests.sh's load probe).
  [[ -s "$WORK/tests/kernel-dir.txt" ]] && kernels=$(head -n 1 "$WORK/tests/kernel-dir.txt")
  section "gpu-layer-load (kernels from $kernels)"
  # The example stops by itself 30 s before the step's timeout (exit 3: the sizes done are kept).
  local layer_budget
  layer_budget=$(cap "$(budget LAYER_LOAD 180)")
  if ((layer_budget < 30)); then
    record "NOT RUN bandwidth through the gio kernel: deadline (${layer_budget} s left of RUN_ALL_DEADLINE_S)"
    return 1
  fi
  GIO_KERNEL_DIR="$kernels" GIO_DMA_MODE=staged timeout -k 10 "$layer_budget" "$CARRY/gpu-layer-load" \
    --budget-s "$((layer_budget > 60 ? layer_budget - 30 : layer_budget / 2))" --json "$OUT/bandwidth-kernel.json" >>"$LOG" 2>&1
  rc=$?
  [[ $rc -eq 3 ]] && record "NOTE bandwidth: gpu-layer-load PARTIAL (budget reached); bandwidth-kernel.json has the sizes done"
  [[ $rc -eq 0 || $rc -eq 3 ]] || failed=1
  return "$failed"
}

step_ipc() {
  if [[ ! -f "$CARRY/tuttid-gpu-check" || ! -f "$CARRY/tuttid" ]]; then
    record "NOT RUN ipc: target/gpu-carry/tuttid and tuttid-gpu-check were not carried (tools/gpu/run-all.sh --prepare)"
    return 1
  fi
  local rc line
  # Live into run.log (a kill keeps it) and into ipc.log for the summary lines.
  timeout -k 10 "$(cap "$(budget IPC 180)")" "$CARRY/tuttid-gpu-check" --tuttid "$CARRY/tuttid" --timeout-seconds 60 2>&1 |
    tee "$WORK/ipc.log" >>"$LOG"
  rc=${PIPESTATUS[0]}
  # Its last line says PASS or FAIL and why (the CUDA call or the daemon's refusal that failed).
  line=$(grep -E '^(PASS|FAIL) ' "$WORK/ipc.log" | tail -n 1)
  echo "ipc: ${line:-no PASS/FAIL line (exit $rc; see run.log)}" >>"$SUMMARY"
  grep -E '^(gpu |Store: |Retrieve: |store: |retrieve: )' "$WORK/ipc.log" | sed 's/^/ipc: /' >>"$SUMMARY"
  [[ $rc -eq 0 ]]
}

# The wheel goes into a directory of its own on PYTHONPATH ($WORK/python-site, once per call): the
# machine's torch stays the one its python3 has (no network here; the wheel has no dependencies).
install_wheel() {
  local python=$1 wheel=$2
  [[ -f "$WORK/python-site/tutti/__init__.py" ]] && return 0
  timeout -k 10 "$(cap 120)" "$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
    --target "$WORK/python-site" "$wheel" >>"$LOG" 2>&1
}

# RUN_ALL_PYTHON_DEVICE=stand-in (with RUN_ALL_TUTTID, RUN_ALL_WHEEL, RUN_ALL_PYTHON) rehearses this
# step without a GPU: tutti.DeviceMemoryStandIn and tuttid --device-memory memfd (tools/gpu/check.sh).
step_python() {
  local device=${RUN_ALL_PYTHON_DEVICE:-cuda} python=${RUN_ALL_PYTHON:-python3}
  local tuttid=${RUN_ALL_TUTTID:-$CARRY/tuttid} wheel=${RUN_ALL_WHEEL:-}
  [[ -n "$wheel" ]] || wheel=$(ls "$CARRY"/tutti-*-abi3-*.whl 2>/dev/null | head -n 1)
  if [[ ! -f "$tuttid" || ! -f "$wheel" ]]; then
    record "NOT RUN python: no tuttid ($tuttid) or no tutti wheel in target/gpu-carry (tools/gpu/run-all.sh --prepare)"
    return 1
  fi
  local import=numpy memory=memfd
  [[ "$device" == cuda ]] && import=torch memory=cuda
  if ! timeout -k 10 "$(cap 90)" "$python" -c "import $import" >>"$LOG" 2>&1; then
    record "NOT RUN python: $python cannot import $import (or not within $(cap 90) s)"
    return 1
  fi
  local site="$WORK/python-site" dir="$WORK/python-tuttid" rc pid
  install_wheel "$python" "$wheel" || { record "NOT RUN python: installing $wheel failed (see run.log)"; return 1; }
  mkdir -p "$dir"
  section "tuttid --device-memory $memory"
  "$tuttid" --device emu:mem:1g --socket "$dir/tuttid.sock" --lock-dir "$dir/locks" --metrics off --format \
    --layers 8 --kv-heads 8 --head-dim 128 --device-memory "$memory" >>"$LOG" 2>&1 &
  pid=$!
  PYTHON_TUTTID_PID=$pid
  for _ in $(seq 300); do [[ -S "$dir/tuttid.sock" ]] && break; kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if [[ ! -S "$dir/tuttid.sock" ]]; then
    stop_python_tuttid "$(cap 30)"
    record "FAIL python: tuttid did not listen (see run.log)"
    return 1
  fi
  # Live into run.log (a kill keeps it) and into python.log for the summary lines. The last 40 s
  # of the cap are kept for stopping tuttid.
  local limit
  limit=$(($(cap $(($(budget PYTHON 240) + 40))) - 40))
  if ((limit < 20)); then
    stop_python_tuttid "$(cap 30)"
    record "NOT RUN python: deadline (python-cuda-check.py would get ${limit} s)"
    return 1
  fi
  section "python-cuda-check.py (limit $limit s)"
  (cd "$WORK" && PYTHONPATH="$site" PYTHONUNBUFFERED=1 PYTORCH_ALLOC_CONF=expandable_segments:False PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False \
    timeout -k 10 "$limit" "$python" "$ROOT/tools/gpu/python-cuda-check.py" \
    --socket "$dir/tuttid.sock" --device "$device") 2>&1 | tee "$WORK/python.log" >>"$LOG"
  rc=${PIPESTATUS[0]}
  stop_python_tuttid "$(cap 30)"
  local line
  line=$(grep -E '^(PASS|FAIL) ' "$WORK/python.log" | tail -n 1)
  echo "python: ${line:-no PASS/FAIL line (exit $rc; see run.log)}" >>"$SUMMARY"
  grep -E '^(store|retrieve): [0-9]' "$WORK/python.log" | sed 's/^/python: /' >>"$SUMMARY"
  [[ $rc -eq 0 ]]
}

# RUN_ALL_PREFILL_DEVICE_ARGS="--device cpu --tiny" (with RUN_ALL_TUTTID, RUN_ALL_WHEEL,
# RUN_ALL_PYTHON) rehearses this step without a GPU: a tiny model on the CPU, tuttid
# --device-memory memfd (tools/gpu/check.sh).
step_prefill() {
  local python=${RUN_ALL_PYTHON:-python3} tuttid=${RUN_ALL_TUTTID:-$CARRY/tuttid} wheel=${RUN_ALL_WHEEL:-}
  [[ -n "$wheel" ]] || wheel=$(ls "$CARRY"/tutti-*-abi3-*.whl 2>/dev/null | head -n 1)
  if [[ ! -f "$tuttid" || ! -f "$wheel" ]]; then
    record "NOT RUN prefill: no tuttid ($tuttid) or no tutti wheel in target/gpu-carry (tools/gpu/run-all.sh --prepare)"
    return 1
  fi
  if ! timeout -k 10 "$(cap 90)" "$python" -c "import torch, transformers" >>"$LOG" 2>&1; then
    record "NOT RUN prefill: $python cannot import torch and transformers (or not within $(cap 90) s)"
    return 1
  fi
  install_wheel "$python" "$wheel" || { record "NOT RUN prefill: installing $wheel failed (see run.log)"; return 1; }
  local budget_s rc device_args extra_args=() out limit
  budget_s=$(budget PREFILL 150)
  # The script's own budget (model set-up included) plus 90 s for a hit rate it mispredicted, both
  # within the deadline.
  limit=$(cap $((budget_s + 90)))
  ((budget_s > limit - 90)) && budget_s=$((limit - 90))
  if ((budget_s < 30)); then
    record "NOT RUN prefill: deadline (a ${limit} s limit leaves no 30 s budget after 90 s of margin)"
    return 1
  fi
  out=$(cd "$OUT" && pwd)  # the script runs in $WORK
  read -r -a device_args <<<"${RUN_ALL_PREFILL_DEVICE_ARGS:---device cuda}"
  read -r -a extra_args <<<"${RUN_ALL_PREFILL_ARGS:-}"  # e.g. "--prompt-tokens 16384"
  section "prefill-ttft.py (budget $budget_s s, limit $limit s)"
  (cd "$WORK" && PYTHONPATH="$WORK/python-site" PYTHONUNBUFFERED=1 PYTORCH_ALLOC_CONF=expandable_segments:False PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False \
    timeout -k 10 "$limit" "$python" \
    "$ROOT/tools/gpu/prefill-ttft.py" "${device_args[@]}" --tuttid "$tuttid" --budget-s "$budget_s" \
    --out "$out/prefill-ttft.json" "${extra_args[@]}") 2>&1 | tee "$WORK/prefill.log" >>"$LOG"
  rc=${PIPESTATUS[0]}
  local line
  line=$(grep -E '^(PASS|FAIL) ' "$WORK/prefill.log" | tail -n 1)
  echo "prefill: ${line:-no PASS/FAIL line (exit $rc; see run.log)}" >>"$SUMMARY"
  grep -E '^prefill-ttft: (hit|stored)' "$WORK/prefill.log" | sed 's/^prefill-ttft: /prefill: /' >>"$SUMMARY"
  [[ $rc -eq 3 ]] && record "NOTE prefill: PARTIAL (budget reached); prefill-ttft.json has the hit rates that ran"
  [[ $rc -eq 0 || $rc -eq 3 ]]
}

step_slack() {
  local budget_s rc started=$SECONDS limit
  budget_s=$(budget SLACK 420)
  # RUN_ALL_SLACK_DEVICE_ARGS="--device cpu --tiny" and RUN_ALL_GPU_PRESET=h100 rehearse this step
  # without a GPU (the CSV → import → check path), as docs/gio-uring.md describes.
  local device_args
  read -r -a device_args <<<"${RUN_ALL_SLACK_DEVICE_ARGS:---device cuda}"
  # The CSV stays in $WORK for the import: a complete grid's is ~20 MiB, over the 16 MiB the tool
  # brings back; $OUT gets its gzip (~2 MiB), rewritten with it after each input length.
  local csv="$WORK/slack-timeline.csv"
  local args=("${device_args[@]}" --out-csv "$WORK/slack-timeline.csv" --out-csv-gz "$OUT/slack-timeline.csv.gz" --out-provenance "$WORK/slack-provenance.json")
  # RUN_ALL_SLACK_ARGS adds options, e.g. "--input-first 7" to finish a PARTIAL grid (docs/gio-uring.md).
  local extra_args=()
  read -r -a extra_args <<<"${RUN_ALL_SLACK_ARGS:-}"
  args+=("${extra_args[@]}")
  # The profile's hard limit is its budget plus 45 s (an input length it mispredicted: its next
  # length's time is a quadratic guess, low for attention-heavy lengths): it rewrites the CSV after
  # each input length, so a kill keeps the lengths done. 20 s of the deadline are kept for what
  # follows (after a stop, the CSV's re-gzip, capped at 5 s; the SM count, from the header's probe
  # or the profile's provenance: no torch import; the import and check take seconds): where the deadline is nearer (always, last in the planned
  # call), the hard limit is what is left less those 20 s and the budget shrinks to it less 45 s,
  # so the margin stays 45 s.
  limit=$(($(cap $((budget_s + 45 + 20))) - 20))
  ((budget_s > limit - 45)) && budget_s=$((limit - 45))
  if ((budget_s < 30)); then
    record "NOT RUN slack: deadline (a ${limit} s limit leaves no 30 s budget after its 45 s margin)"
    return 1
  fi
  section "slack-profile.py (budget $budget_s s, limit $limit s)"
  PYTHONUNBUFFERED=1 timeout -k 5 "$limit" python3 tools/gpu/slack-profile.py "${args[@]}" --budget-s "$budget_s" >>"$LOG" 2>&1
  rc=$?
  if [[ $rc -ne 0 && $rc -ne 3 && ! -s "$csv" ]]; then
    # The profiler path failed outright: CUDA events give group durations (SMs unknown) instead.
    local left=$((budget_s - (SECONDS - started)))
    local room=$(($(cap $((left + 45 + 20))) - 20))
    ((left > room - 45)) && left=$((room - 45))
    if [[ $left -gt 60 ]]; then
      record "NOTE slack: the profiler run failed (exit $rc); retrying with --timing events, ${left} s left"
      limit=$room
      PYTHONUNBUFFERED=1 timeout -k 5 "$limit" python3 tools/gpu/slack-profile.py "${args[@]}" --timing events --budget-s "$left" >>"$LOG" 2>&1
      rc=$?
    fi
  fi
  [[ $rc -eq 124 || $rc -eq 137 ]] && record "NOTE slack: the profile ran past its limit ($limit s) and was stopped; the CSV (and slack-timeline.csv.gz) keeps the input lengths completed before"
  [[ $rc -eq 3 ]] && record "NOTE slack: PARTIAL grid (budget reached); the table ends at the last complete input length"
  if [[ ($rc -eq 124 || $rc -eq 137) && -s "$csv" ]]; then
    # The profile replaces its CSV first, then rewrites the gzip: stopped in between, the gzip is
    # one input length behind the CSV imported below, and $WORK (the CSV) is removed at the exit.
    # So the gzip that comes back is rewritten from the CSV, atomically (~1 s per 20 MiB; capped,
    # the import keeps its few seconds).
    if timeout -k 1 "$(cap 5)" gzip -6 -n -c "$csv" >"$OUT/slack-timeline.csv.gz.partial" 2>>"$LOG"; then
      mv -f "$OUT/slack-timeline.csv.gz.partial" "$OUT/slack-timeline.csv.gz"
    else
      rm -f "$OUT/slack-timeline.csv.gz.partial"
      record "NOTE slack: re-gzipping the CSV after the stop did not finish: slack-timeline.csv.gz may lack the table's last input length"
    fi
  fi
  [[ -s "$csv" ]] || return 1
  # RUN_ALL_TUTTI_PROFILE: another build (tools/gpu/check.sh's rehearsal, which leaves the carry
  # and its provenance alone).
  local profile=${RUN_ALL_TUTTI_PROFILE:-$CARRY/tutti-profile}
  if [[ ! -f "$profile" ]]; then
    record "NOT RUN tutti-profile import: target/gpu-carry/tutti-profile was not carried (gunzip slack-timeline.csv.gz and import it afterwards)"
    return 1
  fi
  # The table's GPU identity: the presets are h100 and h200 with 132 SMs; another SM count gets
  # a spec of its own so that the table says what it was measured on. The name: the header's
  # probe (cuDeviceGetName), else the one the profile recorded (torch's, in its provenance), else
  # nvidia-smi (last: it may have hung, and the probe and the profile reached the GPU without it).
  # The SM count: the header's probe (cuDeviceGetAttribute), else the profile's provenance, else
  # torch asked here, within what is left.
  local name sms target=()
  name=$(cuda_attr device0)
  [[ "$name" == unknown* ]] && name=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["gpu"])' \
    "$WORK/slack-provenance.json" 2>/dev/null)
  [[ -n "$name" ]] || name=$(nvidia_smi --query-gpu=name --format=csv,noheader 2>>"$LOG" | head -n 1)
  sms=$(cuda_attr multiProcessorCount)
  [[ "$sms" =~ ^[1-9][0-9]*$ ]] || sms=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["sm_count"])' \
    "$WORK/slack-provenance.json" 2>/dev/null)
  [[ "$sms" =~ ^[1-9][0-9]*$ ]] || sms=$(timeout "$(cap 30)" python3 -c 'import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)' 2>/dev/null | tail -n 1)
  case "$name" in *H200*) target=(--gpu h200) ;; *H100*) target=(--gpu h100) ;; esac
  if [[ -n "${RUN_ALL_GPU_PRESET:-}" ]]; then
    target=(--gpu "$RUN_ALL_GPU_PRESET")
  elif [[ ! "$sms" =~ ^[1-9][0-9]*$ ]]; then
    record "FAIL slack: the GPU's SM count is unknown (probe, the profile's provenance and torch gave '${sms}'): not imported; slack-timeline.csv.gz is kept (gunzip it and import it afterwards with --gpu or --gpu-spec)"
    return 1
  elif [[ ${#target[@]} -eq 0 || "$sms" != "132" ]]; then
    [[ -n "$name" ]] || name="gpu"
    python3 - "$name" "$sms" >"$WORK/gpu-spec.json" <<'PY'
import json, re, sys
name, sms = sys.argv[1], int(sys.argv[2])
print(json.dumps({"name": re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + f"-{sms}sm", "sm_count": sms,
                  "dense_flops_per_s": 989e12, "hbm_bytes_per_s": 3.35e12, "gemm_efficiency": 0.7,
                  "attention_efficiency": 0.5, "memory_efficiency": 0.8, "kernel_overhead_us": 4.0}))
PY
    target=(--gpu-spec "$WORK/gpu-spec.json")
    record "NOTE slack: GPU '$name' with $sms SMs is not a 132-SM preset; the table uses a spec named after it"
  fi
  # The I/O partition the table reserves is the one a green context grants for tutti's request
  # (RUN_ALL_IO_SMS, default 4, the analytic model's), not the request: cuDevSmResourceSplitByCount
  # grants at least 8 SMs, in multiples of 8, on compute capability 9.x and up (Hopper: 4 becomes
  # 8, and compute keeps 124 of 132 SMs, not 128), at least 4 in multiples of 2 on 8.x, 2 in
  # multiples of 2 on 7.x. The import is told the granularity and the minimum too and refuses a
  # count it cannot grant. Compute capability: the header's probe, else the h100/h200 presets' 9
  # (check.sh's CPU rehearsal names one); unknown: the request, unchecked (a NOTE says so).
  local request=${RUN_ALL_IO_SMS:-4} major unit=1 minimum=1 io_sms
  [[ "$request" =~ ^[1-9][0-9]*$ ]] || { record "FAIL slack: RUN_ALL_IO_SMS='$request' is not a positive number of SMs"; return 1; }
  major=$(cuda_attr computeCapabilityMajor)
  [[ "$major" =~ ^[0-9]+$ ]] || case "${target[*]}" in "--gpu h100" | "--gpu h200") major=9 ;; esac
  if [[ "$major" =~ ^[0-9]+$ ]]; then
    if ((major >= 9)); then unit=8 minimum=8; elif ((major == 8)); then unit=2 minimum=4; elif ((major == 7)); then unit=2 minimum=2; fi
  fi
  io_sms=$(((request + unit - 1) / unit * unit))
  ((io_sms < minimum)) && io_sms=$minimum
  if [[ "$major" =~ ^[0-9]+$ ]]; then
    echo "slack: io_sms $io_sms reserved for I/O ($request requested; compute capability $major.x grants at least $minimum SMs in multiples of $unit)" >>"$SUMMARY"
  else
    record "NOTE slack: the compute capability is unknown: the table reserves the requested $io_sms I/O SMs, unchecked against what a green context grants"
  fi
  section "tutti-profile import ${target[*]} --io-sms $io_sms --io-sm-granularity $unit --io-sm-minimum $minimum"
  timeout -k 5 "$(cap 60)" "$profile" import --timeline "$csv" --model llama3-8b "${target[@]}" \
    --io-sms "$io_sms" --io-sm-granularity "$unit" --io-sm-minimum "$minimum" --out "$OUT/slack-table.json" >>"$LOG" 2>&1 &&
    timeout -k 5 "$(cap 60)" "$profile" check "$OUT/slack-table.json" >>"$LOG" 2>&1
}

# RUN_ALL_DRY=1: each step a sleep of RUN_ALL_DRY_SLEEP_S under the step's own cap, with a few
# lines of output (RUN_ALL_DRY_BYTES more, to exercise the log cap): the deadline, NOT RUN lines,
# summary.txt and run.log bookkeeping without a GPU. It measures and proves nothing else.
step_dry() {
  local limit
  limit=$(cap "$(budget "${1^^}" 240)")
  echo "dry $1: sleep ${RUN_ALL_DRY_SLEEP_S:-1} under timeout $limit"
  ((${RUN_ALL_DRY_BYTES:-0} > 0)) && head -c "$RUN_ALL_DRY_BYTES" /dev/zero | tr '\0' 'x' | fold -w 100
  timeout -k 10 "$limit" sleep "${RUN_ALL_DRY_SLEEP_S:-1}"
}

for step in "${STEPS[@]}"; do
  room=$((DEADLINE - SECONDS - 15))
  if ((room < $(step_minimum "$step"))); then
    record "NOT RUN $step: deadline (${room} s left of RUN_ALL_DEADLINE_S=${DEADLINE} after the 15 s margin; it needs $(step_minimum "$step"))"
    failed=1
    continue
  fi
  section "step $step"
  started=$SECONDS
  offset=$(stat -c %s "$LOG")
  CURRENT_STEP=$step
  echo "RUNNING $step (from +${started} s; ${room} s left before the deadline)" >>"$SUMMARY"
  # Once nvidia-smi hung (the header's query, or green's clock readings), the steps' own scripts
  # (run-gpu-tests.sh, prefill-ttft.py, slack-profile.py) would wait 20-35 s on each of their
  # queries too, out of their budgets: a shim first on PATH answers for it at once. nvidia_smi
  # checks the flag before it, so it never runs the shim as nvidia-smi.
  if [[ -f "$WORK/nvidia-smi-hung" && ! -x "$WORK/shim/nvidia-smi" ]]; then
    mkdir -p "$WORK/shim"
    printf '#!/usr/bin/env bash\necho "not asked: nvidia-smi hung earlier" >&2\nexit 124\n' >"$WORK/shim/nvidia-smi"
    chmod +x "$WORK/shim/nvidia-smi"
    PATH="$WORK/shim:$PATH"
  fi
  if [[ -n "${RUN_ALL_DRY:-}" ]]; then
    step_dry "$step" >>"$LOG" 2>&1
  else
    "step_$step"
  fi
  rc=$?
  CURRENT_STEP=""
  sed -i "/^RUNNING $step /d" "$SUMMARY"
  if [[ $rc -eq 0 ]]; then
    record "PASS $step ($((SECONDS - started)) s)$STALE_MARK"
  else
    record "FAIL $step ($((SECONDS - started)) s; see run.log)$STALE_MARK"
    failed=1
  fi
  trim_log "$offset" "$STEP_LOG_MAX"
done
ls -l "$OUT" >>"$LOG"
exit $failed
