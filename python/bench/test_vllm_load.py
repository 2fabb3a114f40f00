"""Unit tests of vllm_load.py's round order (stdlib only: torch, tutti and vLLM are stood in for,
the order needs none of them):

    python3 -m unittest discover -s python/bench -p 'test_*.py'

tools/bench-scripts-test.sh runs them.
"""

import importlib
import os
import sys
import types
import unittest
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def import_vllm_load():
    stand_ins = {name: types.ModuleType(name) for name in ("torch", "tutti", "tutti.vllm", "tutti.vllm.metadata")}
    stand_ins["tutti.vllm"].TuttiConnectorMetadata = object
    stand_ins["tutti.vllm.metadata"].LoadSpec = stand_ins["tutti.vllm.metadata"].SaveSpec = object
    with mock.patch.dict(sys.modules, stand_ins):
        sys.modules.pop("vllm_load", None)
        module = importlib.import_module("vllm_load")
        sys.modules.pop("vllm_load", None)
        return module


vllm_load = import_vllm_load()


class RoundOrder(unittest.TestCase):
    def test_every_round_runs_every_setting_once(self):
        settings = ["1@64", "1", "2"]
        for round_index in range(12):
            self.assertEqual(sorted(vllm_load.round_order(settings, round_index)), sorted(settings))

    def test_each_setting_follows_two_others_over_the_default_rounds(self):
        # The pool file is shared: the disk may still be writing back the previous setting's
        # save, which must not always penalise the same successor.
        for settings in (["1@64", "1", "2"], ["1", "2", "4", "8"]):
            with self.subTest(settings=settings):
                rounds = vllm_load.default_rounds(settings)
                self.assertEqual(rounds, 2 * len(settings))
                predecessors = {setting: set() for setting in settings}
                for round_index in range(rounds):
                    order = vllm_load.round_order(settings, round_index)
                    for before, after in zip(order, order[1:]):
                        predecessors[after].add(before)
                for setting, seen in predecessors.items():
                    self.assertGreaterEqual(len(seen), 2, f"{setting} follows only {sorted(seen)}")


if __name__ == "__main__":
    unittest.main()
