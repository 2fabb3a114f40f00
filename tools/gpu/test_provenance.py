"""Unit tests of tools/gpu/provenance.py (standard library only): the commit read from the carry
where .git did not travel, the tracked-files check, and the glibc comparison."""

from __future__ import annotations

import io
import os
import sys
import tempfile
import unittest
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402


class CommitFromCarry(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.TemporaryDirectory()
        self.carry = os.path.join(self.root.name, "target", "gpu-carry")
        os.makedirs(self.carry)
        with open(os.path.join(self.root.name, "a.txt"), "w") as handle:
            handle.write("one\n")
        patches = [mock.patch.object(provenance, "ROOT", self.root.name), mock.patch.object(provenance, "_git", lambda *args: None)]
        for patch in patches:
            patch.start()
            self.addCleanup(patch.stop)

    def tearDown(self):
        self.root.cleanup()

    def write_carry(self):
        digests = {"a.txt": provenance.file_sha256("a.txt")}
        self.assertIsNotNone(digests["a.txt"])
        with open(os.path.join(self.carry, "COMMIT"), "w") as handle:
            handle.write(f"commit: abc123\ndirty: yes\nstatus_sha256: {'0' * 64}\n"
                         f"inputs_sha256: {provenance.digests_sha256(digests)}\nprepared_utc: then\n")
        with open(os.path.join(self.carry, "INPUTS"), "w") as handle:
            handle.write(f"{digests['a.txt']}  a.txt\n")

    def test_no_git_no_commit_file_is_unknown(self):
        self.assertEqual(provenance.commit_info(self.carry)["commit"], "unknown")
        self.assertTrue(provenance.commit_line(self.carry).startswith("unknown"))

    def test_commit_file_and_unchanged_tree(self):
        self.write_carry()
        info = provenance.commit_info(self.carry)
        self.assertEqual((info["commit"], info["dirty"], info["inputs_match_prepare"]), ("abc123", True, True))
        self.assertIn("the carry's input files here are the prepared ones", provenance.commit_line(self.carry))

    def test_changed_tree_is_reported(self):
        self.write_carry()
        with open(os.path.join(self.root.name, "a.txt"), "w") as handle:
            handle.write("two\n")
        self.assertFalse(provenance.commit_info(self.carry)["inputs_match_prepare"])
        self.assertIn("DIFFER", provenance.commit_line(self.carry))
        self.assertIn("changed: a.txt", provenance.commit_line(self.carry))


class GlibcComparison(unittest.TestCase):
    def line(self, need: str, here: str) -> str:
        with tempfile.TemporaryDirectory() as carry:
            with open(os.path.join(carry, "ABI"), "w") as handle:
                handle.write(f"glibc_max: {need}\nwheel_tag: cp39-abi3-manylinux_2_34_x86_64\n")
            with mock.patch.object(provenance.platform, "libc_ver", lambda: ("glibc", here)):
                return provenance.abi_line(carry)

    def test_versions_compare_numerically(self):
        self.assertTrue(self.line("2.34", "2.39").endswith(": ok"))
        self.assertIn("TOO OLD", self.line("2.34", "2.9"))
        self.assertTrue(self.line("2.9", "2.34").endswith(": ok"))

    def test_no_abi_file(self):
        with tempfile.TemporaryDirectory() as carry:
            self.assertIn("unknown", provenance.abi_line(carry))


class TreeChangingDuringPrepare(unittest.TestCase):
    """`run-all.sh --prepare` records the tree before it builds (provenance.py begin) and again
    at the end (prepare): a commit or an edit landing while it builds must show in COMMIT and in
    the GPU run's commit line, not be labelled as one tree."""

    def setUp(self):
        self.root = tempfile.TemporaryDirectory()
        self.addCleanup(self.root.cleanup)
        self.carry = os.path.join(self.root.name, "target", "gpu-carry")
        os.makedirs(os.path.join(self.root.name, "crates"))
        with open(os.path.join(self.root.name, "crates", "a.rs"), "w") as handle:
            handle.write("one\n")
        self.head = "a" * 40
        patches = [mock.patch.object(provenance, "ROOT", self.root.name), mock.patch.object(provenance, "_git", self.git),
                   mock.patch.object(provenance, "abi_fields", lambda carry: {"glibc_max": "2.34"}),
                   mock.patch("sys.stdout", io.StringIO()), mock.patch("sys.stderr", io.StringIO())]  # its report lines
        for patch in patches:
            patch.start()
            self.addCleanup(patch.stop)

    def git(self, *args):
        if args[0] == "ls-files":  # the input files (provenance.input_paths_from_git)
            return "crates/a.rs\0"
        answers = {("rev-parse", "HEAD"): self.head + "\n", ("status", "--porcelain"): "", ("diff", "HEAD", "--binary"): ""}
        return answers[args[:3] if args[0] == "diff" else args[:2]]

    def commit_fields(self):
        return provenance.read_fields(os.path.join(self.carry, "COMMIT"))

    def line_on_the_gpu_machine(self):
        with mock.patch.object(provenance, "_git", lambda *args: None):
            return provenance.commit_line(self.carry)

    def test_a_commit_landing_during_the_build_is_recorded_with_both_heads(self):
        self.assertEqual(provenance.main(["begin", self.carry]), 0)
        self.head = "b" * 40  # a commit of an input lands while cargo builds
        with open(os.path.join(self.root.name, "crates", "a.rs"), "w") as handle:
            handle.write("committed\n")
        provenance.main(["prepare", self.carry])
        fields = self.commit_fields()
        self.assertEqual((fields.get("commit"), fields.get("begin_commit")), ("b" * 40, "a" * 40))
        self.assertEqual(fields.get("changed_during_prepare"), "yes")
        self.assertIn("CHANGED while --prepare built", self.line_on_the_gpu_machine())

    def test_a_commit_outside_the_inputs_during_the_build_is_one_tree(self):
        # A docs commit moves HEAD but leaves the carry's inputs, and so the carry, what they were.
        self.assertEqual(provenance.main(["begin", self.carry]), 0)
        self.head = "b" * 40
        self.assertEqual(provenance.main(["prepare", self.carry]), 0)
        fields = self.commit_fields()
        self.assertEqual((fields.get("changed_during_prepare"), fields.get("begin_commit")), ("no", "a" * 40))
        line = self.line_on_the_gpu_machine()
        self.assertNotIn("CHANGED", line)
        self.assertIn("the inputs did not change", line)

    def test_an_edit_during_the_build_is_recorded(self):
        provenance.main(["begin", self.carry])
        with open(os.path.join(self.root.name, "crates", "a.rs"), "w") as handle:
            handle.write("two\n")
        provenance.main(["prepare", self.carry])
        self.assertEqual(self.commit_fields().get("changed_during_prepare"), "yes")
        self.assertIn("inputs", self.commit_fields().get("changed", ""))

    def test_an_unchanged_tree_is_one_tree(self):
        provenance.main(["begin", self.carry])
        self.assertEqual(provenance.main(["prepare", self.carry]), 0)
        self.assertEqual(self.commit_fields().get("changed_during_prepare"), "no")
        self.assertNotIn("CHANGED", self.line_on_the_gpu_machine())
        self.assertFalse(os.path.exists(os.path.join(self.carry, provenance.BEGIN_FILE)))


if __name__ == "__main__":
    unittest.main()
