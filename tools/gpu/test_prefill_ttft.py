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



def importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@unittest.skipUnless(importable("torch") and importable("transformers"),
                     "needs torch and transformers (check.sh's prefill python has them)")
class BuildModel(unittest.TestCase):
    def test_a_parameter_transformers_keeps_in_float32_is_cast_to_the_runs_dtype(self):
        # Goal: the model runs in the dtype asked (bf16 on the GPU) even where a transformers
        # version builds a parameter in float32 whatever the default dtype (its fp32-kept modules):
        # build_model casts the model rather than failing the one GPU run on it.
        import torch
        import transformers

        class KeepsANormInFloat32(transformers.LlamaForCausalLM):
            def __init__(self, config):
                super().__init__(config)
                self.model.norm.float()

        class Transformers:
            __version__ = transformers.__version__
            LlamaConfig = transformers.LlamaConfig
            LlamaForCausalLM = KeepsANormInFloat32

        config = prefill_ttft.model_config(transformers, True, 1)
        model, _seconds = prefill_ttft.build_model(torch, Transformers, config, "cpu", torch.bfloat16, 1.0)
        self.assertEqual({parameter.dtype for parameter in model.parameters()}, {torch.bfloat16})


if __name__ == "__main__":
    unittest.main()
