#!/usr/bin/env bash
# Regenerate the Rust bindings of kernels/gio_abi.h with bindgen and fail if the checked-in
# crates/gio-uring/src/abi/bindings.rs differs (drift between the C header and Rust).
#
# usage: tools/check-bindings.sh                       check (exit 1 on drift, with the diff)
#        tools/check-bindings.sh --update              rewrite the checked-in file
#        tools/check-bindings.sh --find-libclang [ROOT]
#                                                      print the libclang bindgen would load (under
#                                                      ROOT, default /; for tests), exit 1 if none
#
# bindgen needs libclang, which a fresh machine lacks and the normal build must not require, so the
# generator is a separate crate (crates/gio-uring/regen, outside the workspace) and libclang-dev is
# installed here with apt-get (idempotent; needs root) when no libclang bindgen can load is found.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HEADER="$ROOT/kernels/gio_abi.h"
CHECKED_IN="$ROOT/crates/gio-uring/src/abi/bindings.rs"
MODE="${1:-check}"
# dpkg_configure_pending (an interrupted dpkg run finished with service starts forbidden), and
# through it tools/lib/process.sh's interruptible_timeout.
# shellcheck source=tools/lib/dpkg.sh
. "$ROOT/tools/lib/dpkg.sh"

# Prints the first libclang shared library that bindgen's loader (clang-sys 1.x with the `runtime`
# feature, build/common.rs and build/dynamic.rs) would find under $1 (a prefix, / on a real
# machine) and returns 0; returns 1 when there is none. Like clang-sys it searches only
# LIBCLANG_PATH when that is set (a directory, or the library itself), otherwise the directories
# of `llvm-config --prefix`, LD_LIBRARY_PATH and LIBRARY_PATH, then its standard globs; it takes
# libclang.so, libclang-*.so, libclang.so.* and libclang-*.so.*, and never a name containing
# "-cpp." -- libclang-cpp (the C++ API library, installed by other packages such as clang or
# mesa's dependencies) is another library that bindgen cannot load: its presence is what made the
# earlier `ls libclang*.so*` check skip the install and bindgen fail.
find_libclang() {
  local prefix=${1%/} directories=() directory file name pattern
  if [[ -n "${LIBCLANG_PATH:-}" ]]; then
    if [[ -f "$prefix$LIBCLANG_PATH" ]]; then
      echo "$prefix$LIBCLANG_PATH"
      return 0
    fi
    directories=("$prefix$LIBCLANG_PATH")
  else
    if [[ -z "$prefix" ]] && command -v llvm-config >/dev/null 2>&1; then
      local llvm_prefix
      llvm_prefix=$(llvm-config --prefix 2>/dev/null | head -n1) || true
      [[ -n "$llvm_prefix" ]] && directories+=("$llvm_prefix/bin" "$llvm_prefix/lib" "$llvm_prefix/lib64")
    fi
    local listed
    for listed in "${LD_LIBRARY_PATH:-}" "${LIBRARY_PATH:-}"; do
      local entries=()
      IFS=: read -r -a entries <<<"$listed"
      for directory in "${entries[@]}"; do
        [[ -n "$directory" ]] && directories+=("$prefix$directory")
      done
    done
    for pattern in /usr/local/llvm*/lib* /usr/local/lib*/*/* /usr/local/lib*/* /usr/local/lib* /usr/lib*/*/* /usr/lib*/* /usr/lib*; do
      for directory in $prefix$pattern; do
        [[ -d "$directory" ]] && directories+=("$directory")
      done
    done
  fi
  for directory in "${directories[@]}"; do
    for file in "$directory"/libclang.so "$directory"/libclang-*.so "$directory"/libclang.so.* "$directory"/libclang-*.so.*; do
      [[ -e "$file" ]] || continue
      name=${file##*/}
      [[ "$name" == *-cpp.* ]] && continue
      echo "$file"
      return 0
    done
  done
  return 1
}

if [[ "$MODE" == "--find-libclang" ]]; then
  find_libclang "${2:-/}"
  exit
fi

if ! LIBCLANG=$(find_libclang /); then
  if [[ "$(id -u)" != "0" ]]; then
    echo "check-bindings: no libclang that bindgen can load (libclang.so, libclang-N.so, libclang.so.N; libclang-cpp does not count) and not root: install libclang-dev" >&2
    exit 1
  fi
  echo "check-bindings: installing libclang-dev (no libclang that bindgen can load was found)"
  # Each apt call is bounded, through interruptible_timeout: Ctrl-C stops it and the script (130),
  # which a bare `timeout` (a process group of its own) would not let it reach. A dpkg run that
  # was interrupted earlier is finished first (until it
  # is, every apt-get install fails), with service starts forbidden (dpkg_configure_pending: an
  # etcd-server left half-installed would otherwise be configured with its service enabled and
  # started). `|| true` also keeps set -e out of it.
  export DEBIAN_FRONTEND=noninteractive
  dpkg_configure_pending || true
  # libclang-dev installed and no library found: files are gone, which a plain install would not
  # bring back. The library is libclang1-N's (libclang.so.1), its libclang.so link libclang-N-dev's
  # (libclang-dev only depends on them): every such package dpkg lists is reinstalled.
  packages=(libclang-dev)
  reinstall=()
  if [[ -n "$(dpkg_installed libclang-dev)" ]]; then
    mapfile -t packages < <(dpkg-query -W -f='${db:Status-Abbrev} ${binary:Package}\n' 'libclang-dev' 'libclang-[0-9]*-dev' 'libclang1-[0-9]*' 2>/dev/null \
      | awk '$1 == "ii" { print $2 }' || true)
    [[ ${#packages[@]} -gt 0 ]] || packages=(libclang-dev)
    echo "check-bindings: reinstalling ${packages[*]} (dpkg lists them installed)"
    reinstall=(--reinstall)
  fi
  # DPkg::Lock::Timeout: a concurrent apt-get is waited for (up to 10 minutes), not a failure.
  interruptible_timeout 1200 apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${reinstall[@]}" "${packages[@]}" >/dev/null \
    || { interruptible_timeout 900 apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null \
      && interruptible_timeout 1200 apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${reinstall[@]}" "${packages[@]}" >/dev/null; } \
    || { echo "check-bindings: apt-get install ${reinstall[*]} ${packages[*]} failed" >&2; exit 1; }
  if ! LIBCLANG=$(find_libclang /); then
    echo "check-bindings: libclang-dev is installed but no libclang that bindgen can load was found; set LIBCLANG_PATH" >&2
    exit 1
  fi
fi
# bindgen loads exactly the library found here.
export LIBCLANG_PATH="$LIBCLANG"
echo "check-bindings: libclang: $LIBCLANG"

export CARGO_TARGET_DIR="${GIO_REGEN_TARGET_DIR:-$ROOT/target-gio/regen}"
cargo build --locked --release -q --manifest-path "$ROOT/crates/gio-uring/regen/Cargo.toml"
REGEN="$CARGO_TARGET_DIR/release/gio-uring-regen"

TMP="$(mktemp --suffix=.rs)"
trap 'rm -f "$TMP"' EXIT
"$REGEN" "$HEADER" "$TMP"
# Format with the workspace's rustfmt.toml so the file is also what `cargo fmt --check` expects,
# whatever formatting bindgen applied itself.
rustfmt --edition 2021 --config-path "$ROOT/rustfmt.toml" "$TMP"

if [[ "$MODE" == "--update" ]]; then
  cp "$TMP" "$CHECKED_IN"
  echo "check-bindings: updated $CHECKED_IN"
  exit 0
fi
if ! diff -u "$CHECKED_IN" "$TMP"; then
  echo "check-bindings: FAILED: $CHECKED_IN drifted from $HEADER (run tools/check-bindings.sh --update)" >&2
  exit 1
fi
echo "check-bindings: OK ($CHECKED_IN matches $HEADER)"
