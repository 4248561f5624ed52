"""On a GPU the engine runs the same policies, with SparQ's and ReAttention's Triton kernels chosen
automatically; the result must match the CPU run (torch references). Skipped without CUDA."""
import numpy as np
import pytest
import torch

from backend.policies import H2O, TOVA, Oracle, ReAttention, SparQ
from backend.engine.runner import compute_traces

from tests.conftest import make_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

POLICIES = [TOVA(budget=8), H2O(budget=8), Oracle(budget=8), SparQ(budget=8, r=4),
            ReAttention(budget=20, global_size=2, span=3, topk=2, chunk=4)]


def test_gpu_run_matches_cpu_run():
    ids = torch.randint(0, 101, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    cpu = make_tiny(dtype=torch.float32)
    gpu = make_tiny(dtype=torch.float32)
    gpu.model.to("cuda")
    specs = [p.name for p in POLICIES]
    cpu_traces, cpu_full = compute_traces(cpu, specs, POLICIES, ids, mode="generate", max_new_tokens=6, record_layers=(1,))
    gpu_traces, gpu_full = compute_traces(gpu, specs, POLICIES, ids, mode="generate", max_new_tokens=6, record_layers=(1,))
    np.testing.assert_array_equal(cpu_full.tokens, gpu_full.tokens)
    for a, b in zip(cpu_traces, gpu_traces):
        np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=a.spec)
        for layer in range(a.meta["n_layers"]):
            agree = (a.reads(layer) == b.reads(layer)).mean()
            assert agree > 0.99, (a.spec, layer, agree)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-3, err_msg=a.spec)
