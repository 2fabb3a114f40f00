#!/usr/bin/env python3
"""What a GPU run was built from, when .git does not travel (tools/gpu/run-all.sh).

The GPU machine gets the working tree and target/gpu-carry, never .git. So `run-all.sh --prepare`
records, here, into the carry:

  target/gpu-carry/COMMIT        the commit (git rev-parse HEAD), whether the tree was dirty and
                                 whether the carry's inputs were (inputs_dirty), the sha256 of `git
                                 status --porcelain` and of `git diff HEAD --binary` (the whole
                                 tree's, for the record), the sha256 of the inputs' contents
                                 (inputs_sha256), the date; and whether the inputs changed since
                                 `begin` recorded them before the build (changed_during_prepare;
                                 if so the begin_* values)
  target/gpu-carry/INPUTS        the carry's input files (INPUTS below), one `sha256  path` a line,
                                 to recompute inputs_sha256 there and name the files that differ
  target/gpu-carry/ABI           the highest GLIBC_ symbol version each carried ELF binary (and the
                                 wheel's extension module) needs (objdump -T), the maximum, and the
                                 wheel's platform tag

and on the GPU machine `line` prints the commit from git if this is a git checkout, else from
COMMIT, with whether the travelled input files still hash to inputs_sha256, and `abi` compares the
carried binaries' glibc need with this machine's glibc.

Only the carry's inputs (INPUTS, the one list of them: what the carried builds read and what the
GPU steps run from the tree) decide whether a carry is stale: an edit or a commit elsewhere (docs,
Python tests, another tool), or an untracked file outside them, neither marks the carry as changed
during --prepare nor makes `verify` refuse it. An input file added, removed or edited does, tracked
or not (cargo finds tests/, examples/ and src/bin/ files by itself). slack-profile.py's provenance uses
commit_info(). Standard library only.

  python3 tools/gpu/provenance.py begin [CARRY]     # here, by run-all.sh --prepare before it builds
  python3 tools/gpu/provenance.py prepare [CARRY]   # here, by run-all.sh --prepare once the carry is built
  python3 tools/gpu/provenance.py line [CARRY]      # one line: the commit and where it came from
  python3 tools/gpu/provenance.py abi [CARRY]       # one line: glibc needed by the carry vs here
  python3 tools/gpu/provenance.py verify [CARRY]    # exit 0 if the carry was prepared from this
                                                    # tree's inputs (run-all.sh's pre-flight; here
                                                    # also new untracked input files count), else 1
                                                    # and why, naming the input files that differ
  python3 tools/gpu/provenance.py inputs            # the input files here, one a line
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import re
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CARRY = os.path.join(ROOT, "target", "gpu-carry")
# The carried ELF binaries (run-all.sh --prepare and run-gpu-tests.sh --prepare).
BINARIES = ("gpu-test", "tutti-profile", "gpu-layer-load", "tuttid", "tuttid-gpu-check", "green-contexts", "h2d-bandwidth")

# The carry's inputs, the one list of them (docs/gio-uring.md, "Running on a GPU", points here):
# a folder (trailing /) means every file under it. What the carried builds read: the workspace
# (its manifest, lock, every member's manifest: cargo reads them all), the crates the carried
# binaries and the wheel are built from, the kernels, tools/cuda-build.sh and tools/lib/
# (run-gpu-tests.sh --prepare), tuttid and tutti-profile, the wheel's sources, its build script
# and the pins of the venv that builds it (tools/python/wheel.sh reads python/requirements-test.txt);
# and what run-all.sh's steps run from the tree on the GPU machine: tools/gpu/, tools/cuda-build.sh
# (run-gpu-tests.sh builds the kernels there), tools/lib/. Not inputs: docs, README.md (the wheel's
# metadata description alone), python/tests* and python/bench (no step runs them), the other tools.
# A path added to what a step or a build reads belongs here.
INPUTS = (
    "Cargo.toml",
    "Cargo.lock",
    "crates/",
    "kernels/",
    "tools/cuda-build.sh",
    "tools/lib/",
    "tools/gpu/",
    "tools/tuttid/",
    "tools/tutti-profile/",
    "tools/tutti/Cargo.toml",
    "tools/tutti-bench/Cargo.toml",
    "benches/Cargo.toml",
    "tests/Cargo.toml",
    "tools/python/wheel.sh",
    "python/pyproject.toml",
    "python/requirements-test.txt",
    "python/tutti/",
)
INPUTS_FILE = "INPUTS"


def is_input(path: str) -> bool:
    return any(path.startswith(entry) if entry.endswith("/") else path == entry for entry in INPUTS)


def _git(*args: str) -> str | None:
    """git's output in ROOT, or None where ROOT is not the top of a git checkout (no .git there)."""
    try:
        top = subprocess.run(["git", "-C", ROOT, "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=20)
        if top.returncode != 0 or os.path.realpath(top.stdout.strip()) != os.path.realpath(ROOT):
            return None
        done = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.decode("utf-8", "replace") if done.returncode == 0 else None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str) -> str | None:
    """The sha256 of a file under ROOT, or None where it is missing (or a link)."""
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full) or os.path.islink(full):
        return None
    with open(full, "rb") as handle:
        return _sha256(handle.read())


def digests_sha256(digests: dict[str, str | None]) -> str:
    """One sha256 over (path, file sha256) pairs, a missing file counting as `missing`."""
    digest = hashlib.sha256()
    for path in sorted(digests):
        digest.update(path.encode() + b"\0" + (digests[path] or "missing").encode() + b"\n")
    return digest.hexdigest()


def input_paths_from_git() -> list[str] | None:
    """The input files of this checkout, tracked (deleted ones included) and untracked but not
    ignored; None without git."""
    listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *INPUTS)
    if listed is None:
        return None
    return sorted({path for path in listed.split("\0") if path and is_input(path)})


def read_inputs(carry: str) -> dict[str, str | None] | None:
    """CARRY/INPUTS as {path: sha256 or None (missing at --prepare)}; None if there is none."""
    try:
        with open(os.path.join(carry, INPUTS_FILE)) as handle:
            lines = [line.rstrip("\n") for line in handle if line.strip()]
    except OSError:
        return None
    recorded: dict[str, str | None] = {}
    for line in lines:
        digest, _sep, path = line.partition("  ")
        recorded[path] = None if digest == "missing" else digest
    return recorded


def compare_inputs(carry: str) -> tuple[bool, str] | None:
    """Whether the input files here are the ones CARRY/INPUTS recorded: (same, a sentence naming
    the files that differ). The files compared are INPUTS's, plus, with git, this checkout's input
    files now (a new untracked one counts). None without CARRY/INPUTS."""
    recorded = read_inputs(carry)
    if recorded is None:
        return None
    here_paths = input_paths_from_git()
    paths = set(recorded) | set(here_paths or ())
    here = {path: file_sha256(path) for path in paths}
    changed = sorted(path for path in paths if path in recorded and recorded[path] is not None
                     and here[path] is not None and recorded[path] != here[path])
    missing = sorted(path for path in paths if recorded.get(path) is not None and here[path] is None)
    new = sorted(path for path in paths if recorded.get(path) is None and here[path] is not None)
    if not (changed or missing or new):
        return True, f"{len(recorded)} input files as prepared"

    def some(paths: list[str]) -> str:
        return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")

    parts = [f"{label}: {some(found)}" for label, found in (("changed", changed), ("missing here", missing),
                                                              ("new here", new)) if found]
    return False, "input files differ from the prepared ones (" + "; ".join(parts) + ")"


def read_fields(path: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open(path) as handle:
            for line in handle:
                key, sep, value = line.partition(":")
                if sep:
                    fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def commit_info(carry: str = CARRY) -> dict:
    """The commit of this tree: from git where this is a checkout, else from the carry's COMMIT."""
    head = _git("rev-parse", "HEAD")
    if head is not None:
        status = _git("status", "--porcelain") or ""
        return {"commit": head.strip(), "dirty": bool(status.strip()), "status_sha256": _sha256(status.encode()),
                "source": "git"}
    fields = read_fields(os.path.join(carry, "COMMIT"))
    if not fields.get("commit"):
        return {"commit": "unknown", "source": "no .git and no target/gpu-carry/COMMIT (run-all.sh --prepare writes it)"}
    info: dict = {"source": "target/gpu-carry/COMMIT (run-all.sh --prepare)", **fields}
    info["dirty"] = fields.get("dirty") == "yes"
    compared = compare_inputs(carry)
    info["inputs_match_prepare"] = None if compared is None else compared[0]
    if compared is not None and not compared[0]:
        info["inputs_differ"] = compared[1]
    return info


def commit_line(carry: str = CARRY) -> str:
    info = commit_info(carry)
    if info["commit"] == "unknown":
        return f"unknown ({info['source']})"
    text = info["commit"] + (" (dirty tree" + (f", status sha256 {info['status_sha256'][:12]}" if info.get("status_sha256") else "")
                             + (f", diff sha256 {info['diff_sha256'][:12]}" if info.get("diff_sha256") else "") + ")"
                             if info.get("dirty") else " (clean tree)")
    if info["source"] != "git":
        text += f", from {info['source']} at {info.get('prepared_utc', '?')}"
        if info.get("changed_during_prepare") == "yes":
            text += (f"; the carry's inputs CHANGED while --prepare built ({info.get('changed', '?')}; commit "
                     f"{info.get('begin_commit', '?')[:12]} at its start): the carry may mix both")
        elif info.get("begin_commit"):
            text += f"; HEAD was {info['begin_commit'][:12]} when --prepare began (the inputs did not change)"
        match = info.get("inputs_match_prepare")
        text += {True: "; the carry's input files here are the prepared ones",
                 False: f"; the carry's input files here DIFFER from the prepared ones ({info.get('inputs_differ', '?')}: "
                        "the carry may be stale)",
                 None: "; no target/gpu-carry/INPUTS to compare"}[match]
    return text


def verify(carry: str = CARRY) -> tuple[bool, str]:
    """Whether the carry was built from this tree's inputs (INPUTS): COMMIT exists, the inputs did
    not change while --prepare built, and the input files here are the ones CARRY/INPUTS recorded
    (with git, a new untracked input file counts too). Changes outside the inputs do not count.
    Works without git (the GPU machine). Returns (ok, a sentence saying why)."""
    fields = read_fields(os.path.join(carry, "COMMIT"))
    if not fields.get("commit"):
        return False, "no target/gpu-carry/COMMIT (run-all.sh --prepare writes it last; a failed --prepare leaves none)"
    problems = []
    during = fields.get("changed_during_prepare", "unknown (not recorded)")
    if during != "no":
        problems.append(f"the carry's inputs changed while --prepare built (changed_during_prepare: {during}"
                        + (f"; {fields['changed']}" if fields.get("changed") else "") + "): the carry may mix two trees")
    recorded = read_inputs(carry)
    compared = compare_inputs(carry)
    if recorded is None or compared is None:
        problems.append("no target/gpu-carry/INPUTS to compare this tree with (a carry prepared before INPUTS was "
                        "recorded, or a failed --prepare)")
    elif digests_sha256(recorded) != fields.get("inputs_sha256"):
        problems.append("target/gpu-carry/INPUTS does not hash to COMMIT's inputs_sha256 (the two come from different "
                        "--prepare runs)")
    elif not compared[0]:
        problems.append(compared[1])
    commit = fields["commit"][:12]
    if problems:
        return False, f"carry of commit {commit} prepared {fields.get('prepared_utc', '?')}: " + "; ".join(problems)
    return True, (f"carry of commit {commit} prepared {fields.get('prepared_utc', '?')} from these inputs "
                  f"({compared[1]}; changes outside them do not count)")


def glibc_needed(path: str) -> str | None:
    """The highest GLIBC_x.y version an ELF file's dynamic symbols need (objdump -T), or None."""
    try:
        done = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    versions = {tuple(int(part) for part in m.split(".")) for m in re.findall(r"GLIBC_(\d+(?:\.\d+)+)", done.stdout)}
    return ".".join(map(str, max(versions))) if versions else None


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text))


def abi_fields(carry: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    needs: list[str] = []
    for name in BINARIES:
        path = os.path.join(carry, name)
        if os.path.isfile(path):
            version = glibc_needed(path)
            fields[f"glibc_{name}"] = version or "none found (objdump -T)"
            if version:
                needs.append(version)
    wheels = sorted(entry for entry in os.listdir(carry) if entry.endswith(".whl")) if os.path.isdir(carry) else []
    for wheel in wheels:
        # name-version(-build)?-python-abi-platform.whl
        parts = wheel[: -len(".whl")].split("-")
        fields["wheel"] = wheel
        fields["wheel_tag"] = "-".join(parts[-3:]) if len(parts) >= 5 else "unparsed"
        with zipfile.ZipFile(os.path.join(carry, wheel)) as archive, tempfile.TemporaryDirectory() as directory:
            for member in archive.namelist():
                if member.endswith(".so") or ".so." in member:
                    version = glibc_needed(archive.extract(member, directory))
                    fields[f"glibc_wheel:{member}"] = version or "none found (objdump -T)"
                    if version:
                        needs.append(version)
    fields["glibc_max"] = max(needs, key=_version_key) if needs else "unknown"
    return fields


# What `begin` records before --prepare builds; `prepare` compares it with the tree at the end.
BEGIN_FILE = "PREPARE_BEGIN"
# The fields of a tree state compared between begin and prepare: (name in `changed`, field). Only
# the inputs: HEAD, `git status` and the diff of the whole tree move with every docs commit or
# untracked file elsewhere, which leaves the carried builds what they were (a HEAD that moved is
# recorded as begin_commit all the same).
_STATE_FIELDS = (("inputs", "inputs_sha256"),)


def tree_state() -> tuple[dict[str, str], dict[str, str | None]] | None:
    """The commit, dirty flags and hashes of this checkout now, and its input files' sha256s;
    None without git."""
    head = _git("rev-parse", "HEAD")
    paths = input_paths_from_git()
    if head is None or paths is None:
        return None
    status = _git("status", "--porcelain") or ""
    inputs_status = _git("status", "--porcelain", "--", *INPUTS) or ""
    diff = (_git("diff", "HEAD", "--binary") or "").encode()
    digests = {path: file_sha256(path) for path in paths}
    state = {"commit": head.strip(), "dirty": "yes" if status.strip() else "no",
             "inputs_dirty": "yes" if inputs_status.strip() else "no", "status_sha256": _sha256(status.encode()),
             "diff_sha256": _sha256(diff), "untracked_files": str(sum(1 for line in status.splitlines() if line.startswith("??"))),
             "input_files": str(len(digests)), "inputs_sha256": digests_sha256(digests)}
    return state, digests


def begin(carry: str) -> int:
    """Before --prepare builds: the tree's state into CARRY/PREPARE_BEGIN, for `prepare` to compare."""
    found = tree_state()
    os.makedirs(carry, exist_ok=True)
    path = os.path.join(carry, BEGIN_FILE)
    if found is None:
        if os.path.exists(path):
            os.remove(path)
        print("provenance: no git checkout here; nothing recorded before the build", file=sys.stderr)
        return 1
    with open(path, "w") as handle:
        handle.write("".join(f"{key}: {value}\n" for key, value in found[0].items()))
    return 0


def prepare(carry: str) -> int:
    found = tree_state()
    if found is None:
        print("provenance: no git checkout here; COMMIT not written", file=sys.stderr)
        return 1
    state, digests = found
    os.makedirs(carry, exist_ok=True)
    commit = {**state, "prepared_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "prepared_on": f"{platform.node()} {platform.platform()}"}
    # A commit or an edit landing while --prepare built makes a carry of two trees: both are
    # recorded, and the GPU run's commit line says so, rather than naming the end's tree alone.
    begin_path = os.path.join(carry, BEGIN_FILE)
    before = read_fields(begin_path)
    if not before.get("commit"):
        commit["changed_during_prepare"] = "unknown (no record from before the build: provenance.py begin)"
    else:
        changed = [name for name, field in _STATE_FIELDS if before.get(field) != state[field]]
        commit["changed_during_prepare"] = "yes" if changed else "no"
        if before["commit"] != state["commit"]:
            commit["begin_commit"] = before["commit"]
        if changed:
            commit["changed"] = ", ".join(changed)
            commit.update({f"begin_{field}": before.get(field, "") for _name, field in _STATE_FIELDS})
            print(f"provenance: WARNING: the carry's inputs changed while --prepare built (commit "
                  f"{before.get('commit', '?')[:12]} at the start, {state['commit'][:12]} at the end): the carry may mix "
                  "both; run --prepare again once nothing under the inputs (provenance.py INPUTS) is being edited",
                  file=sys.stderr)
    if os.path.exists(begin_path):
        os.remove(begin_path)
    with open(os.path.join(carry, INPUTS_FILE), "w") as handle:
        handle.write("".join(f"{digests[path] or 'missing'}  {path}\n" for path in sorted(digests)))
    with open(os.path.join(carry, "COMMIT"), "w") as handle:
        handle.write("".join(f"{key}: {value}\n" for key, value in commit.items()))
    abi = abi_fields(carry)
    with open(os.path.join(carry, "ABI"), "w") as handle:
        handle.write("".join(f"{key}: {value}\n" for key, value in abi.items()))
    print(f"provenance: commit {commit['commit']} dirty {commit['dirty']} (inputs dirty {commit['inputs_dirty']}; "
          f"{commit['input_files']} input files); "
          f"carried binaries need glibc {abi['glibc_max']}; wheel {abi.get('wheel_tag', 'none')}")
    return 0


def abi_line(carry: str) -> str:
    fields = read_fields(os.path.join(carry, "ABI"))
    here = platform.libc_ver()
    here_text = f"{here[0]} {here[1]}" if here[1] else "unknown"
    need = fields.get("glibc_max")
    if not need:
        return f"carry's glibc need unknown (no target/gpu-carry/ABI); here {here_text}"
    text = f"carried binaries need GLIBC_{need}, here {here_text}; wheel {fields.get('wheel_tag', 'none')}"
    if need != "unknown" and here[1]:
        text += ": ok" if _version_key(here[1]) >= _version_key(need) else ": TOO OLD here, the carried binaries will not load"
    return text


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("begin", "prepare", "line", "abi", "verify", "inputs"):
        print(__doc__, file=sys.stderr)
        return 2
    carry = argv[1] if len(argv) > 1 else CARRY
    if argv[0] == "begin":
        return begin(carry)
    if argv[0] == "prepare":
        return prepare(carry)
    if argv[0] == "inputs":
        paths = input_paths_from_git()
        if paths is None:
            print("provenance: no git checkout here (the carry's list: target/gpu-carry/INPUTS)", file=sys.stderr)
            return 1
        print("".join(path + "\n" for path in paths), end="")
        return 0
    if argv[0] == "verify":
        ok, why = verify(carry)
        print(("carry OK: " if ok else "STALE carry: ") + why)
        return 0 if ok else 1
    print(commit_line(carry) if argv[0] == "line" else abi_line(carry))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
