#!/usr/bin/env python3
"""What a GPU run was built from, when .git does not travel (tools/gpu/run-all.sh).

The GPU machine gets the working tree and target/gpu-carry, never .git. So `run-all.sh --prepare`
records, here, into the carry:

  target/gpu-carry/COMMIT        the commit (git rev-parse HEAD), whether the tree was dirty, the
                                 sha256 of `git status --porcelain` and of `git diff HEAD --binary`,
                                 the sha256 of the tracked files' contents (tree_sha256), the date;
                                 and whether any of those changed since `begin` recorded them
                                 before the build (changed_during_prepare; if so the begin_* ones)
  target/gpu-carry/TRACKED       the tracked paths, one a line (to recompute tree_sha256 there)
  target/gpu-carry/ABI           the highest GLIBC_ symbol version each carried ELF binary (and the
                                 wheel's extension module) needs (objdump -T), the maximum, and the
                                 wheel's platform tag

and on the GPU machine `line` prints the commit from git if this is a git checkout, else from
COMMIT, with whether the travelled tracked files still hash to tree_sha256, and `abi` compares the
carried binaries' glibc need with this machine's glibc. slack-profile.py's provenance uses
commit_info(). Standard library only.

  python3 tools/gpu/provenance.py begin [CARRY]     # here, by run-all.sh --prepare before it builds
  python3 tools/gpu/provenance.py prepare [CARRY]   # here, by run-all.sh --prepare once the carry is built
  python3 tools/gpu/provenance.py line [CARRY]      # one line: the commit and where it came from
  python3 tools/gpu/provenance.py abi [CARRY]       # one line: glibc needed by the carry vs here
  python3 tools/gpu/provenance.py verify [CARRY]    # exit 0 if the carry was prepared from this very
                                                    # tree (run-all.sh's pre-flight), else 1 and why
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


def tree_sha256(paths: list[str]) -> tuple[str, int]:
    """sha256 over (path, contents) of the listed files that exist under ROOT; and how many were missing."""
    digest = hashlib.sha256()
    missing = 0
    for path in sorted(paths):
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full) or os.path.islink(full):
            missing += 1
            continue
        with open(full, "rb") as handle:
            data = handle.read()
        digest.update(path.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return digest.hexdigest(), missing


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
    try:
        with open(os.path.join(carry, "TRACKED")) as handle:
            paths = [line.rstrip("\n") for line in handle if line.strip()]
        here, missing = tree_sha256(paths)
        info["tree_matches_prepare"] = here == fields.get("tree_sha256")
        if missing:
            info["tracked_files_missing_here"] = missing
    except OSError:
        info["tree_matches_prepare"] = None
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
            text += (f"; the tree CHANGED while --prepare built ({info.get('changed', '?')}; commit "
                     f"{info.get('begin_commit', '?')[:12]} at its start): the carry may mix both")
        match = info.get("tree_matches_prepare")
        text += {True: "; the tracked files here are the prepared ones",
                 False: "; the tracked files here DIFFER from the prepared ones (the carry may be stale)",
                 None: "; no TRACKED list to compare"}[match]
    return text


def verify(carry: str = CARRY) -> tuple[bool, str]:
    """Whether the carry was built from this very tree: COMMIT exists, the tree did not change
    while --prepare built, and the tracked files here (TRACKED) hash to COMMIT's tree_sha256.
    Works without git (the GPU machine). Returns (ok, a sentence saying why)."""
    fields = read_fields(os.path.join(carry, "COMMIT"))
    if not fields.get("commit"):
        return False, "no target/gpu-carry/COMMIT (run-all.sh --prepare writes it last; a failed --prepare leaves none)"
    problems = []
    during = fields.get("changed_during_prepare", "unknown (not recorded)")
    if during != "no":
        problems.append(f"the tree changed while --prepare built (changed_during_prepare: {during}"
                        + (f"; {fields['changed']}" if fields.get("changed") else "") + "): the carry may mix two trees")
    try:
        with open(os.path.join(carry, "TRACKED")) as handle:
            paths = [line.rstrip("\n") for line in handle if line.strip()]
    except OSError:
        problems.append("no target/gpu-carry/TRACKED to compare this tree with")
    else:
        here, missing = tree_sha256(paths)
        if here != fields.get("tree_sha256"):
            problems.append(f"the tracked files here differ from the prepared ones (tree sha256 {here[:12]} here, "
                            f"{fields.get('tree_sha256', '?')[:12]} prepared"
                            + (f"; {missing} tracked files missing here" if missing else "") + ")")
    commit = fields["commit"][:12]
    if problems:
        return False, f"carry of commit {commit} prepared {fields.get('prepared_utc', '?')}: " + "; ".join(problems)
    return True, f"carry of commit {commit} prepared {fields.get('prepared_utc', '?')} from this very tree"


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
# The fields of a tree state compared between begin and prepare: (name in `changed`, field).
_STATE_FIELDS = (("HEAD", "commit"), ("status", "status_sha256"), ("diff", "diff_sha256"), ("tree", "tree_sha256"))


def tree_state() -> tuple[dict[str, str], list[str]] | None:
    """The commit, dirty flag and hashes of this checkout now, and its tracked paths; None
    without git."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return None
    status = _git("status", "--porcelain") or ""
    diff = (_git("diff", "HEAD", "--binary") or "").encode()
    tracked = [path for path in (_git("ls-files") or "").splitlines() if path]
    tree, _missing = tree_sha256(tracked)
    state = {"commit": head.strip(), "dirty": "yes" if status.strip() else "no", "status_sha256": _sha256(status.encode()),
             "diff_sha256": _sha256(diff), "untracked_files": str(sum(1 for line in status.splitlines() if line.startswith("??"))),
             "tree_sha256": tree}
    return state, tracked


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
    state, tracked = found
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
        if changed:
            commit["changed"] = ", ".join(changed)
            commit.update({f"begin_{field}": before.get(field, "") for _name, field in _STATE_FIELDS})
            print(f"provenance: WARNING: the tree changed while --prepare built ({commit['changed']}; commit "
                  f"{before.get('commit', '?')[:12]} at the start, {state['commit'][:12]} at the end): the carry may mix "
                  "both; run --prepare again on a quiet tree", file=sys.stderr)
    if os.path.exists(begin_path):
        os.remove(begin_path)
    with open(os.path.join(carry, "TRACKED"), "w") as handle:
        handle.write("".join(path + "\n" for path in tracked))
    with open(os.path.join(carry, "COMMIT"), "w") as handle:
        handle.write("".join(f"{key}: {value}\n" for key, value in commit.items()))
    abi = abi_fields(carry)
    with open(os.path.join(carry, "ABI"), "w") as handle:
        handle.write("".join(f"{key}: {value}\n" for key, value in abi.items()))
    print(f"provenance: commit {commit['commit']} dirty {commit['dirty']}; "
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
    if not argv or argv[0] not in ("begin", "prepare", "line", "abi", "verify"):
        print(__doc__, file=sys.stderr)
        return 2
    carry = argv[1] if len(argv) > 1 else CARRY
    if argv[0] == "begin":
        return begin(carry)
    if argv[0] == "prepare":
        return prepare(carry)
    if argv[0] == "verify":
        ok, why = verify(carry)
        print(("carry OK: " if ok else "STALE carry: ") + why)
        return 0 if ok else 1
    print(commit_line(carry) if argv[0] == "line" else abi_line(carry))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
