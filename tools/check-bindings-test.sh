#!/usr/bin/env bash
# Tests tools/check-bindings.sh's libclang detection (--find-libclang ROOT) on fake directory
# layouts: what clang-sys, bindgen's loader, would load counts; libclang-cpp (installed by other
# packages) does not. Then Ctrl-C (SIGINT to its process group, under setsid as at a terminal)
# while its apt-get install of libclang-dev hangs (a stand-in, under `timeout`: a process group
# of its own that the terminal's SIGINT misses): exit 130 within seconds, nothing left running.
# Run by the bindings stage of tools/test.sh; needs no libclang itself.
set -euo pipefail

SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/check-bindings.sh"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
failed=0

# layout NAME FILE...: a fake root holding FILEs (paths under it), printed.
layout() {
  local root="$WORK/$1"
  shift
  mkdir -p "$root"
  local file
  for file in "$@"; do
    mkdir -p "$root/$(dirname "$file")"
    printf '\177ELF' >"$root/$file"
  done
  echo "$root"
}

# expect found|missing ROOT [ENV=VALUE...]: runs the detection under a clean environment.
expect() {
  local want=$1 root=$2
  shift 2
  local found status=0
  found=$(env -u LIBCLANG_PATH -u LD_LIBRARY_PATH -u LIBRARY_PATH "$@" "$SCRIPT" --find-libclang "$root") || status=$?
  if [[ "$want" == found && $status -ne 0 ]] || [[ "$want" == missing && $status -eq 0 ]]; then
    echo "check-bindings-test: FAILED: $root ($*): expected $want, got status $status ${found:+($found)}" >&2
    failed=1
  fi
}

# The machine of the bug: only libclang-cpp (from libclang-cpp14, pulled in by other packages).
expect missing "$(layout cpp-only usr/lib/x86_64-linux-gnu/libclang-cpp.so.14 usr/lib/llvm-14/lib/libclang-cpp.so.14 usr/lib/llvm-14/lib/libclang-cpp.so)"
# What Debian's libclang1-14 / libclang-14-dev install.
expect found "$(layout debian-runtime usr/lib/x86_64-linux-gnu/libclang-14.so.1 usr/lib/x86_64-linux-gnu/libclang-cpp.so.14)"
expect found "$(layout debian-dev usr/lib/llvm-14/lib/libclang.so.1 usr/lib/llvm-14/lib/libclang.so)"
expect found "$(layout local usr/local/lib/libclang.so)"
expect found "$(layout versioned usr/lib64/libclang-17.so)"
# Nothing at all.
expect missing "$(layout empty usr/lib/x86_64-linux-gnu/libc.so.6)"
# LIBCLANG_PATH is the only place searched when set, like clang-sys.
both="$(layout explicit opt/llvm/lib/libclang.so usr/lib/x86_64-linux-gnu/libclang-cpp.so.14)"
expect found "$both" LIBCLANG_PATH=/opt/llvm/lib
expect found "$both" LIBCLANG_PATH=/opt/llvm/lib/libclang.so
expect missing "$(layout explicit-empty usr/lib/llvm-14/lib/libclang.so.1 opt/none/README)" LIBCLANG_PATH=/opt/none
# LD_LIBRARY_PATH directories are searched too.
expect found "$(layout ld-path opt/custom/libclang.so.18)" LD_LIBRARY_PATH=/opt/custom

# Ctrl-C in the install. Stand-ins: apt-get runs sleep 60; dpkg-query knows nothing; `id` says
# root on its first call (check-bindings.sh's own check, so it goes on to install) and not on
# the later ones (dpkg_configure_pending's: it then leaves the machine's dpkg and policy-rc.d
# alone). LIBCLANG_PATH names nothing, so no libclang is found.
# shellcheck source=tools/lib/process.sh
. "$(dirname "$SCRIPT")/lib/process.sh"
# shellcheck source=tools/lib/sitting.sh
. "$(dirname "$SCRIPT")/lib/sitting.sh"
mkdir -p "$WORK/bin"
printf '#!/bin/sh\nexec sleep 60\n' >"$WORK/bin/apt-get"
printf '#!/bin/sh\nexit 1\n' >"$WORK/bin/dpkg-query"
printf '#!/bin/sh\n[ -e %q ] && echo 1000 && exit 0\ntouch %q && echo 0\n' "$WORK/id-asked" "$WORK/id-asked" >"$WORK/bin/id"
chmod +x "$WORK/bin"/*
setsid env --default-signal=INT PATH="$WORK/bin:$PATH" LIBCLANG_PATH=/nonexistent/libclang.so "$SCRIPT" \
  </dev/null >/dev/null 2>"$WORK/interrupt.err" &
sitting=$!
# A stand-in apt-get that never ran would let the script end at once: not a pass.
if ! sitting_sleeps; then
  echo "check-bindings-test: FAILED: the stand-in apt-get's sleep never ran in the script's session (within 10 s): $(cat "$WORK/interrupt.err")" >&2
  failed=1
fi
sleep 1
kill -INT -- "-$sitting"
set +e # (sitting_ends's `wait` returns the script's status)
sitting_ends 10
set -e
if [[ "$ended" != 130 || -n "$left" ]]; then
  echo "check-bindings-test: FAILED: SIGINT while apt-get hangs: expected exit 130 within 10 s and nothing left, got exit '$ended', left running '$left': $(cat "$WORK/interrupt.err")" >&2
  failed=1
fi

if [[ $failed -ne 0 ]]; then
  exit 1
fi
echo "check-bindings-test: OK (libclang detection on 11 layouts; Ctrl-C in the install)"
