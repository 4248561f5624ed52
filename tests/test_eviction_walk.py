"""The compiled eviction walk (kernels/eviction_walk.py) against the numpy walk it replaces for running-score
policies: the same tokens dropped at the same steps, the same running scores and outputs to rounding."""
import dataclasses

import numpy as np
import pytest
import torch

from backend.engine import attention as engine
from backend.engine.attention import RowLayerState, compiled_running_score
from backend.engine.runner import compute_traces
from backend.policies import POLICIES, H2O, TOVA, load_plugins
from backend.policies.keyformer import Keyformer
from backend.policies.base import RunningScore
from kernels import eviction_walk_triton
from tests.conftest import make_tiny

load_plugins()
RUNNING = [name for name, cls in POLICIES.items()
           if cls.kind == "eviction" and cls.for_budget(24).running_score() is not None]


TOKENS = 160


def walk(policy, compiled: bool, monkeypatch, chunk: int, dtype=torch.float32, device_walk: bool = False,
         layer: int = 0):
    """Feed TOKENS random queries in blocks of ``chunk`` to one (layer, row), recording its top-8 attention;
    return the state and the outputs. ``device_walk``: the Triton walk (a GPU's) instead of numba's."""
    monkeypatch.setattr(engine, "COMPILED_WALK", compiled)
    monkeypatch.setattr(engine, "DEVICE_WALK", device_walk)
    g = torch.Generator().manual_seed(chunk)
    heads, group, dim = 3, 3, 16
    k, v = (torch.randn(heads, TOKENS, dim, generator=g, dtype=dtype) for _ in range(2))
    q = torch.randn(heads, group, TOKENS, dim, generator=g, dtype=dtype) * 2
    state = RowLayerState(policy, heads, record_top_k=8, layer=layer)
    assert (state.running is not None) == compiled
    assert state.walks_on_device(q.device) == (compiled and device_walk)
    outs = [state.attend(q[:, :, lo:lo + chunk], k[:, :lo + chunk], v[:, :lo + chunk], lo, dim ** -0.5, None)
            for lo in range(0, TOKENS, chunk)]
    return state, torch.cat(outs, 2)


def assert_same_walk(policy, monkeypatch, chunk, dtype=torch.float32, device_walk=False, layer=0):
    reference, out_ref = walk(policy, False, monkeypatch, chunk, dtype=dtype, layer=layer)
    compiled, out = walk(policy, True, monkeypatch, chunk, dtype=dtype, device_walk=device_walk, layer=layer)
    np.testing.assert_array_equal(compiled.evicted_at, reference.evicted_at)
    np.testing.assert_array_equal(compiled.slots, reference.slots)
    assert compiled.state.keys() == reference.state.keys()
    for name in reference.state:
        np.testing.assert_allclose(compiled.state[name], reference.state[name], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    pos, val = compiled.top.rows(TOKENS)
    pos_ref, val_ref = reference.top.rows(TOKENS)
    np.testing.assert_array_equal(pos, pos_ref)
    np.testing.assert_allclose(val, val_ref, rtol=1e-3)


def test_the_running_score_policies_are_the_paper_baselines():
    assert set(RUNNING) >= {"window", "sinks", "h2o", "tova", "a2sf"}


@pytest.mark.parametrize("chunk", [1, 7, 40])
@pytest.mark.parametrize("name", RUNNING)
def test_compiled_walk_equals_the_numpy_walk(name, chunk, monkeypatch):
    """Prompt blocks of 40 and 7 and decode steps (1); the cache fills at 24 and the text is 160 long."""
    assert_same_walk(POLICIES[name].for_budget(24), monkeypatch, chunk)


@pytest.mark.parametrize("policy", [
    H2O(budget=20, recent=3, heads="layer"), H2O(budget=20, recent=0),
    TOVA(budget=20, heads="head", sinks=4), TOVA(budget=20, heads="layer", sinks=2),
    POLICIES["a2sf"](budget=20, alpha=0.5, window=6, heads="layer"), POLICIES["sinks"](budget=20, sinks=0),
], ids=lambda p: p.spec())
def test_compiled_walk_equals_the_numpy_walk_for_other_parameters(policy, monkeypatch):
    assert_same_walk(policy, monkeypatch, 13)
    assert_same_walk(policy, monkeypatch, 13, dtype=torch.float64)


@dataclasses.dataclass(frozen=True)
class LayerKeyformer(Keyformer):
    """Keyformer scored as a layer (the heads' mean score): what a plugin may declare, walked by the layer's code."""

    heads: str = "layer"


@pytest.mark.parametrize("layer", [0, 5])
@pytest.mark.parametrize("policy", [
    Keyformer(budget=20, recent=4, tau_init=0.5, tau_end=3.0, steps=50, seed=7), Keyformer(budget=20, recent=0),
    LayerKeyformer(budget=20, recent=4, seed=3),
], ids=lambda p: p.spec())
def test_keyformers_gumbel_softmax_walks_compiled_as_in_numpy(policy, layer, monkeypatch):
    """The noise is a hash of the seed, the layer, the step, the head and the position; the temperature rises over
    the steps: each must be the numpy walk's."""
    assert_same_walk(policy, monkeypatch, 13, layer=layer)
    assert_same_walk(policy, monkeypatch, 1, dtype=torch.float64, layer=layer)


def test_a_seed_of_2_to_the_32_or_more_walks_in_numpy():
    assert Keyformer(budget=20, seed=2**32 - 1).running_score() is not None
    assert Keyformer(budget=20, seed=2**32).running_score() is None


@dataclasses.dataclass(frozen=True)
class MisdeclaredH2O(H2O):
    """Says it forgets (A2SF's decay) while its update does not: the comparison must catch it."""

    def running_score(self):
        return dataclasses.replace(super().running_score(), decay=0.5)


def test_a_declaration_that_does_not_match_the_policy_is_caught(monkeypatch):
    with pytest.raises(AssertionError):
        assert_same_walk(MisdeclaredH2O(budget=24), monkeypatch, 7)


def test_a_subclass_that_changes_the_score_is_walked_in_numpy():
    @dataclasses.dataclass(frozen=True)
    class Reversed(H2O):
        def score(self, state, attn, t, positions):
            return -state["a2s"]

    assert compiled_running_score(H2O(budget=8)) == RunningScore(decay=1.0, recent=4, state="a2s")
    assert compiled_running_score(Reversed(budget=8)) is None


needs_triton = pytest.mark.skipif(not eviction_walk_triton.usable(torch.device("cpu")),
                                  reason="needs TRITON_INTERPRET=1 (or a GPU)")


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("chunk", [1, 40])
@pytest.mark.parametrize("name", RUNNING)
def test_the_triton_walk_a_gpu_takes_equals_the_numpy_walk(name, chunk, monkeypatch):
    """kernels/eviction_walk_triton.py (decisions kept on the device), run here by the Triton interpreter."""
    assert_same_walk(POLICIES[name].for_budget(24), monkeypatch, chunk, device_walk=True)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("policy", [
    H2O(budget=20, recent=3, heads="layer"), TOVA(budget=20, heads="head", sinks=4),
    POLICIES["a2sf"](budget=20, alpha=0.5, window=6, heads="layer"), POLICIES["sinks"](budget=20, sinks=0),
], ids=lambda p: p.spec())
def test_the_triton_walk_equals_the_numpy_walk_for_other_parameters(policy, monkeypatch):
    assert_same_walk(policy, monkeypatch, 13, dtype=torch.float64, device_walk=True)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("name", ["tova", "h2o"])
def test_the_triton_walk_decides_on_bfloat16_scores_as_the_numpy_walk(name, monkeypatch):
    """A bfloat16 model walks on the device too (decisions in float64 from its scores), not in numpy."""
    policy = POLICIES[name].for_budget(24)
    reference, out_ref = walk(policy, False, monkeypatch, 40, dtype=torch.bfloat16)
    device, out = walk(policy, True, monkeypatch, 40, dtype=torch.bfloat16, device_walk=True)
    assert out.dtype == torch.bfloat16
    np.testing.assert_array_equal(device.evicted_at, reference.evicted_at)
    np.testing.assert_array_equal(device.slots, reference.slots)
    # The device writes softmax rows computed in float64; numpy's path takes bfloat16's own softmax.
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=0.02, atol=0.02)


@pytest.mark.slow
@needs_triton
def test_keyformers_gumbel_softmax_walks_in_triton_as_in_numpy(monkeypatch):
    """The device hashes the seed, the layer, the step, the head and the position as numpy does."""
    policy = Keyformer(budget=20, recent=4, tau_init=0.5, tau_end=3.0, steps=50, seed=7)
    assert_same_walk(policy, monkeypatch, 13, dtype=torch.float64, device_walk=True, layer=5)
    assert_same_walk(LayerKeyformer(budget=20, recent=4, seed=3), monkeypatch, 13, dtype=torch.float64,
                     device_walk=True, layer=5)  # the layer's kernel


@pytest.mark.slow
@needs_triton
def test_the_triton_walk_catches_a_misdeclared_policy(monkeypatch):
    with pytest.raises(AssertionError):
        assert_same_walk(MisdeclaredH2O(budget=24), monkeypatch, 7, device_walk=True)


def traces_of(policies, monkeypatch, device_walk: bool, chunk: int):
    monkeypatch.setattr(engine, "DEVICE_WALK", device_walk)
    ids = torch.randint(3, 101, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    traces, _ = compute_traces(make_tiny(dtype=torch.float32), [p.spec() for p in policies], policies, ids,
                               mode="generate", max_new_tokens=3, chunk=chunk, record_layers=(1,))
    return traces


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("heads_apart", [True, False], ids=["heads-apart", "a-layer-row"])
def test_every_row_of_a_layer_walks_in_one_launch_as_each_walks_alone(heads_apart, monkeypatch):
    """One launch walks every running-score row of a layer, each with its own budget (the rows that hold fewer
    tokens padded at the front), decay, sinks and recent window; one program per KV head, or the heads of every
    row together once a row scores the layer. Each row's walk is numba's: the same drops at the same steps, the
    same tokens and log-probs, the same recorded attention; Full's and Quest's rows, beside them, are untouched."""
    policies = [TOVA(budget=14), H2O(budget=9, recent=3), POLICIES["full"](), POLICIES["sinks"](budget=11, sinks=2),
                POLICIES["a2sf"](budget=12, alpha=0.5, window=4, heads="head" if heads_apart else "layer"),
                POLICIES["quest"].for_budget(16), TOVA(budget=64)]
    if heads_apart:  # a Gumbel-softmax row launches apart from the others (it walks its heads apart, as Keyformer's do)
        policies.append(Keyformer(budget=13, recent=3, seed=5))
    for chunk in (16, 1):
        reference = traces_of(policies, monkeypatch, False, chunk)
        together = traces_of(policies, monkeypatch, True, chunk)
        for a, b in zip(reference, together):
            if a.evicted_at is not None:
                np.testing.assert_array_equal(b.evicted_at, a.evicted_at, err_msg=a.meta["spec"])
            np.testing.assert_array_equal(b.tokens, a.tokens, err_msg=a.meta["spec"])
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, err_msg=a.meta["spec"])
            np.testing.assert_array_equal(b.attention.pos, a.attention.pos, err_msg=a.meta["spec"])
            np.testing.assert_allclose(b.attention.val.astype(float), a.attention.val.astype(float), rtol=1e-3,
                                       err_msg=a.meta["spec"])
    evicting = (0, 1, 3, 4, 7) if heads_apart else (0, 1, 3, 4)
    assert all((reference[r].evicted_at >= 0).any() for r in evicting)  # the budgets were reached


def test_a_layers_device_walk_sends_as_many_launches_for_four_rows_as_for_one(monkeypatch):
    """The rows that walk on the device are gathered, scored and walked together, so what a layer's walk sends a GPU
    (its launches, syncs and copies, counted on the CPU as benchmarks/launches.py counts them) does not grow with
    its rows: four rows cost what one does."""
    from benchmarks.launches import counting

    monkeypatch.setattr(engine, "DEVICE_WALK", True)
    monkeypatch.setattr(eviction_walk_triton, "usable", lambda device: True)  # the kernel: numba's walk stands in
    ids = torch.randint(3, 101, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    lm = make_tiny(dtype=torch.float32)
    walk_on_device = engine.PolicyCache._walk_on_device

    def per_call(budgets):
        calls = []

        def counted(self, *args, **kwargs):
            with counting() as counter:
                out = walk_on_device(self, *args, **kwargs)
            calls.append((len(out), counter.launches, counter.syncs, counter.copies))
            return out

        monkeypatch.setattr(engine.PolicyCache, "_walk_on_device", counted)
        policies = [TOVA(budget=b) for b in budgets]
        compute_traces(lm, [p.spec() for p in policies], policies, ids, mode="prompt", chunk=16, record_layers=())
        return calls

    per_call([8])  # what a process makes once (the block's causal mask) is made
    one, four = per_call([8]), per_call([8, 9, 10, 11])
    assert len(one) == len(four) > 0 and all(rows == 1 for rows, *_ in one) and all(rows == 4 for rows, *_ in four)
    assert [counts for _, *counts in four] == [counts for _, *counts in one]
    assert all(launches > 0 and syncs == copies == 1 for _, launches, syncs, copies in one)
