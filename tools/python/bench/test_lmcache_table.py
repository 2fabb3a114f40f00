"""Unit tests of lmcache_table.py's report checks (stdlib only):

    python3 -m unittest discover -s tools/python/bench -p 'test_*.py'
"""

import json
import os
import tempfile
import unittest

import lmcache_table

KV_BYTES = 1 << 20


def tutti_report(device_description):
    """A tutti-bench kv JSON report of KV_BYTES stored and retrieved (verified) in two layers."""
    layers = [{"layer": 0, "lat_ns": 500_000}, {"layer": 1, "lat_ns": 500_000}]
    phase = {"io_bytes": KV_BYTES, "blocks": 4, "wall_ns": 2_000_000, "layers": layers}
    return {
        "global options": {"device_description": device_description, "layers_in_flight": 2},
        "phases": [
            dict(phase, phase="store (the request's new blocks after prefill)"),
            dict(phase, phase="retrieve (the request's cached prefix)", verified_bytes=KV_BYTES),
        ],
    }


class TuttiFigures(unittest.TestCase):
    def figures(self, device_description):
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "tutti-1.json")
            with open(path, "w", encoding="utf-8") as file:
                json.dump(tutti_report(device_description), file)
            return lmcache_table.tutti_figures(path, KV_BYTES)

    def test_a_run_on_a_disk_is_a_figure(self):
        # Goal: a run whose device reads through to a disk gives its figures.
        figures = self.figures("nvme-emu over /var/tmp/pool.img: SGL data pointers, max transfer 1MiB")
        self.assertAlmostEqual(figures["retrieve"], KV_BYTES / 1_000_000)

    def test_a_retrieve_that_did_not_read_a_disk_is_refused(self):
        # Goal: tutti is held to LMCache's rule (its retrieve must read from the block layer):
        # a pool on tmpfs, or a software controller running buffered through the page cache,
        # measured memory, so the round is a bad report, not a figure.
        for description in (
            "nvme-emu over /tmp/pool.img (tmpfs: memory, not a disk): SGL data pointers",
            "nvme-emu over /mnt/pool.img, buffered pread/pwrite (O_DIRECT refused: the page cache, not the disk, serves I/O)",
        ):
            with self.subTest(description=description):
                with self.assertRaises(lmcache_table.BadReport) as raised:
                    self.figures(description)
                self.assertIn("not a disk", str(raised.exception))


if __name__ == "__main__":
    unittest.main()
