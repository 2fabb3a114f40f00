#!/usr/bin/env bash
# Regenerate the Rust bindings of kernels/gio_abi.h with bindgen and fail if the checked-in
# crates/gio-uring/src/abi/bindings.rs differs (drift between the C header and Rust).
#
# usage: tools/check-bindings.sh            check (exit 1 on drift, with the diff)
#        tools/check-bindings.sh --update   rewrite the checked-in file
#
# bindgen needs libclang, which a fresh machine lacks and the normal build must not require, so the
# generator is a separate crate (crates/gio-uring/regen, outside the workspace) and libclang-dev is
# installed here with apt-get (idempotent; needs root).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HEADER="$ROOT/kernels/gio_abi.h"
CHECKED_IN="$ROOT/crates/gio-uring/src/abi/bindings.rs"
MODE="${1:-check}"

if ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 \
   && ! ls /usr/lib/*/libclang*.so* >/dev/null 2>&1; then
  if [[ "$(id -u)" != "0" ]]; then
    echo "check-bindings: libclang missing and not root: install libclang-dev" >&2
    exit 1
  fi
  echo "check-bindings: installing libclang-dev"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libclang-dev >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libclang-dev >/dev/null; }
fi

export CARGO_TARGET_DIR="${GIO_REGEN_TARGET_DIR:-$ROOT/target-gio/regen}"
cargo build --release -q --manifest-path "$ROOT/crates/gio-uring/regen/Cargo.toml"
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
