#!/usr/bin/env bash
# Checks that the workspace's `rust-version` is true: every package of the workspace declares it
# (so clippy's `incompatible_msrv` lint checks the standard-library APIs the code calls against
# it), and no dependency in Cargo.lock needs a newer compiler than it says.
#
# usage: tools/check-msrv.sh        (exit 1 with the offenders named)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."

cargo metadata --format-version 1 --locked | python3 -c '
import json, sys

def version(text):
    return tuple(int(part) for part in text.split("."))[:3] + (0,) * (3 - len(text.split(".")))

metadata = json.load(sys.stdin)
members = set(metadata["workspace_members"])
resolved = {node["id"] for node in metadata["resolve"]["nodes"]}
packages = {package["id"]: package for package in metadata["packages"]}
declared = {packages[member]["rust_version"] for member in members}
problems = []
undeclared = sorted(packages[member]["name"] for member in members if not packages[member]["rust_version"])
if undeclared:
    problems.append("packages without rust-version.workspace = true: " + ", ".join(undeclared))
declared.discard(None)
if len(declared) != 1:
    problems.append(f"workspace packages disagree on rust-version: {sorted(declared)}")
else:
    msrv = declared.pop()
    for package_id in sorted(resolved - members):
        package = packages[package_id]
        needed = package.get("rust_version")
        if needed and version(needed) > version(msrv):
            problems.append("%s %s needs rust %s, the workspace says %s" % (package["name"], package["version"], needed, msrv))
if problems:
    print("check-msrv: FAILED", *problems, sep="\n  ", file=sys.stderr)
    sys.exit(1)
print(f"check-msrv: OK (rust-version {msrv}; {len(resolved - members)} dependencies at or below it)")
'
