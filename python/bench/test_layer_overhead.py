"""Unit tests of layer_overhead.py's Rust side and vllm_load.py's round order (stdlib only; the
tutti binding and numpy are not needed):

    python3 -m unittest discover -s python/bench -p 'test_*.py'

tools/bench-scripts-test.sh runs them.
"""

import json
import os
import statistics
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import layer_overhead  # noqa: E402

# Eight layers whose upper middle value (sorted[4]) differs from their median.
LAYER_NS = [700_000, 1_200_000, 760_000, 820_000, 740_000, 1_000_000, 900_000, 780_000]


def stand_in(directory, options):
    """A stand-in tutti-bench: records its argv, prints a KV report with LAYER_NS and OPTIONS."""
    argv_file = os.path.join(directory, "argv.json")
    report = {
        "workload": "kv",
        "global options": options,
        "phases": [
            {"phase": "store (the request's new blocks after prefill)", "bw_bytes": 1e9, "layers": []},
            {
                "phase": "retrieve (the request's cached prefix)",
                "bw_bytes": 5.5e9,
                # tutti-bench's own p50: sorted[round(3.5)] = sorted[4], the upper middle value.
                "lat_ns": {"percentile": {"50.000000": sorted(LAYER_NS)[4]}},
                "layers": [{"layer": i, "lat_ns": ns} for i, ns in enumerate(LAYER_NS)],
            },
        ],
    }
    path = os.path.join(directory, "tutti-bench")
    with open(path, "w") as out:
        out.write(f"#!{sys.executable}\nimport json, sys\n"
                  f"json.dump(sys.argv[1:], open({argv_file!r}, 'w'))\n"
                  f"print({json.dumps(report)!r})\n")
    os.chmod(path, 0o755)
    return path, argv_file


class RustRound(unittest.TestCase):
    def setUp(self):
        self.directory = tempfile.TemporaryDirectory()
        self.addCleanup(self.directory.cleanup)

    def run_round(self, options):
        binary, argv_file = stand_in(self.directory.name, options)
        figures = layer_overhead.rust_round(binary, 1)
        with open(argv_file) as argv:
            return figures, json.load(argv)

    def matching_options(self):
        return {"layers_in_flight": layer_overhead.LAYERS_IN_FLIGHT, "blocks_per_slot": layer_overhead.BLOCKS_PER_SLOT}

    def test_the_command_pins_the_python_stores_settings(self):
        _, argv = self.run_round(self.matching_options())
        self.assertIn("--layers-in-flight", argv)
        self.assertEqual(argv[argv.index("--layers-in-flight") + 1], str(layer_overhead.LAYERS_IN_FLIGHT))
        self.assertIn("--blocks-per-slot", argv)
        self.assertEqual(argv[argv.index("--blocks-per-slot") + 1], str(layer_overhead.BLOCKS_PER_SLOT))

    def test_the_median_is_the_python_sides_median(self):
        (latency_us, bandwidth), _ = self.run_round(self.matching_options())
        self.assertAlmostEqual(latency_us, statistics.median(LAYER_NS) / 1e3)
        self.assertAlmostEqual(bandwidth, 5.5)

    def test_a_report_of_other_settings_is_refused(self):
        for options in ({"layers_in_flight": 2, "blocks_per_slot": 16},
                        {"layers_in_flight": layer_overhead.LAYERS_IN_FLIGHT, "blocks_per_slot": 16},
                        {"layers_in_flight": 2, "blocks_per_slot": layer_overhead.BLOCKS_PER_SLOT},
                        {}):
            with self.subTest(options=options), self.assertRaises(layer_overhead.MismatchedRound):
                self.run_round(options)


if __name__ == "__main__":
    unittest.main()
