#!/usr/bin/env python3
"""Reads `cargo build|test --message-format=json-render-diagnostics` on stdin and prints, one a
line in the order named, the executable cargo's compiler-artifact message gives for each target
NAME (a bin, example or test target).

    cargo build ... --message-format=json-render-diagnostics | cargo-executables.py LABEL NAME...

cargo builds under CARGO_TARGET_DIR or a configured build.target-dir where one is set, so a fixed
target/release may hold an older build, of other features: the scripts that carry or measure a
binary (tools/gpu/run-all.sh, tools/gpu/run-gpu-tests.sh, tools/compare-lmcache.sh) take its path
from here. rustc's errors are rendered to stderr by cargo, not in this JSON. Exits 1 (saying why,
prefixed with LABEL) when the build did not finish successfully or named no executable for one of
the targets.
"""
import json
import sys


def main() -> int:
    if len(sys.argv) < 3:
        sys.exit("usage: cargo-executables.py LABEL NAME...")
    label, wanted = sys.argv[1], sys.argv[2:]
    found: dict[str, str] = {}
    success = None
    for line in sys.stdin:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if not isinstance(message, dict):
            continue
        target = message.get("target") or {}
        if message.get("reason") == "build-finished":
            success = message.get("success")
        elif (message.get("reason") == "compiler-artifact" and target.get("name") in wanted and message.get("executable")
              and {"bin", "example", "test"} & set(target.get("kind", []))):
            found[target["name"]] = message["executable"]
    if success is not True:
        sys.exit(f"{label}: cargo did not finish successfully (its errors above)")
    missing = [name for name in wanted if name not in found]
    if missing:
        sys.exit(f"{label}: cargo named no executable for " + ", ".join(missing))
    print("\n".join(found[name] for name in wanted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
