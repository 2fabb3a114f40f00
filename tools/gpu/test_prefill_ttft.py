"""Tests of tools/gpu/prefill-ttft.py's figures (standard library only; the script imports torch
only in main): run with `python3 -m unittest discover -s tools/gpu -p 'test_*.py'`
(tools/gpu/check.sh does; its prefill rehearsal checks the same figures in a real run's JSON).
"""

import importlib.util
import os
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = importlib.util.spec_from_file_location("prefill_ttft", os.path.join(HERE, "prefill-ttft.py"))
prefill_ttft = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(prefill_ttft)


class TimingFigures(unittest.TestCase):
    def test_the_exposed_io_is_the_ttft_difference_not_the_host_wait(self):
        # Goal: eager PyTorch queues kernels ahead of the host, so a pre-hook's wait overlaps GPU
        # work and the summed waits overstate the GPU's stall. The I/O's cost on the critical path
        # is tutti's TTFT less the resident path's (the same compute, no I/O); the waits are
        # reported as what they are, host_wait_ms, and no figure is called the bubble.
        runs = [{"ttft_s": t, "host_wait_s": w} for t, w in ((0.120, 0.050), (0.100, 0.040), (0.110, 0.045))]
        figures = prefill_ttft.timing_figures([0.300, 0.310, 0.290], runs, [0.095, 0.090, 0.100])
        self.assertEqual(figures["tutti_ttft_ms"], 110.0)
        self.assertEqual(figures["resident_ttft_ms"], 95.0)
        self.assertEqual(figures["exposed_io_ms"], 15.0)
        self.assertEqual(figures["host_wait_ms"], 45.0)
        self.assertEqual(figures["recompute_ttft_ms"], 300.0)
        self.assertNotIn("bubble_ms", figures)


if __name__ == "__main__":
    unittest.main()
