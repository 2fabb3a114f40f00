#!/usr/bin/env bash
# Tests tools/check-bindings.sh's libclang detection (--find-libclang ROOT) on fake directory
# layouts: what clang-sys, bindgen's loader, would load counts; libclang-cpp (installed by other
# packages) does not. Run by the bindings stage of tools/test.sh; needs no libclang itself.
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

if [[ $failed -ne 0 ]]; then
  exit 1
fi
echo "check-bindings-test: OK (libclang detection on 11 layouts)"
