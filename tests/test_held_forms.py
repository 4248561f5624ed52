"""Policies that change the form of what they hold (``Policy.reforms``): ThinK's key channels, KIVI's bits, CaM's
merged values, and plugins of each kind. Hand-worked channel choices and quantisation, the engine reading the new forms on every path,
the trace's ``form_*`` arrays, and the Held forms view."""
import dataclasses
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.engine import models
from backend.engine.attention import HeldForms
from backend.engine.runner import compute_traces, score_text
from backend.policies import (GEAR, KIVI, POLICIES, CaM, CacheView, Merging, Reform, ThinK, load_plugins,
                              parse_spec)
from backend.policies.gear import low_rank, outliers
from backend.policies.cam import merge_shares
from backend.policies.kivi import quantise, quantise_keys, quantise_values
from backend.policies.think import channel_scores, logit_error
from backend.traces.trace import Trace

ROOT = Path(__file__).resolve().parents[1]


def toy_view(keys, queries, kept=None):
    keys = np.asarray(keys, float)
    heads, n, _ = keys.shape
    return CacheView(t=n - 1, n_prompt=n, layer=0, n_layers=1, attn_window=np.zeros((heads, 0, n)), keys=keys,
                     values=np.ones_like(keys), kept=np.ones((heads, n), bool) if kept is None else kept,
                     queries=np.asarray(queries, float))


# --- ThinK ------------------------------------------------------------------------------------------------------

def test_think_prunes_the_channels_the_window_reads_least_on_a_two_head_toy():
    # Head 0: scores (the queries' squares' mean x the keys') per channel 4 x 0.5, 1 x 4, 0 x 2, 0.25 x 0.5 ->
    # 2, 4, 0, 0.125: channels 2 and 3 go. Head 1: keys only in channel 3, queries alike everywhere -> scores 0, 0,
    # 0, 5: channel 3 stays, and of the tied others the earlier ones go first (0 and 1).
    keys = [[[1, 2, 0, 1], [0, 2, 2, 0]],
            [[0, 0, 0, 3], [0, 0, 0, 1]]]
    queries = [[[[2, 1, 0, 0.5]]], [[[1, 1, 1, 1]]]]  # [H, G=1, w=1, d]
    np.testing.assert_allclose(channel_scores(np.asarray(queries, float), np.asarray(keys, float))[0],
                               [2, 4, 0, 0.125])
    view = toy_view(keys, queries)
    policy = ThinK(budget=8, window=1, kernel=1, channels=0.5, whole_window=False)
    reform = policy.reform(view, view.kept.copy())
    np.testing.assert_array_equal(reform.channels, [[True, True, False, False], [False, False, True, True]])
    np.testing.assert_array_equal(reform.keys[0], [[1, 2, 0, 0], [0, 2, 0, 0]])
    np.testing.assert_array_equal(reform.keys[1], [[0, 0, 0, 3], [0, 0, 0, 1]])
    assert reform.positions.all()
    # The authors keep the window's keys whole (here the latest token); kvpress prunes them too.
    whole = dataclasses.replace(policy, whole_window=True).reform(view, view.kept.copy())
    np.testing.assert_array_equal(whole.positions, [[True, False], [True, False]])
    # What it cost the window's logits (Eq. 3): head 0's query reads 2 + 2 + 0 + 0.5 = 4.5 of token 0 before, 4
    # after (0.5 lost), and 2 of token 1 before and after -> |(0.5, 0)| / |(4.5, 2)|; head 1 loses nothing.
    assert reform.channel_error[0] == pytest.approx(0.5 / np.hypot(4.5, 2))
    assert reform.channel_error[1] == 0.0
    assert logit_error(np.ones((1, 1, 2)), np.zeros((3, 2)), np.array([True, False])) == 0.0


def test_think_at_no_pruning_or_a_kvpress_ratio_parses_and_says_what_it_is():
    assert ThinK(channels=0.0).reform(toy_view([[[1.0, 2.0]]], [[[[1.0, 1.0]]]]), np.ones((1, 1), bool)) is None
    assert ThinK().whole().channels == 0.0
    assert parse_spec("think:ratio=0.5", 100).budget == 50  # its tokens' ratio; channels at their parameter
    assert parse_spec("think:preset=kvpress,budget=128").whole_window is False
    with pytest.raises(ValueError, match="channels must be at least 0 and below 1"):
        ThinK(channels=1.0)


# --- KIVI -------------------------------------------------------------------------------------------------------

def reference_quantise(x, bits):
    """Asymmetric round-to-nearest of one 1-D group, written out."""
    low, high = min(x), max(x)
    if high == low:
        return list(x)
    step = (high - low) / (2 ** bits - 1)
    return [low + step * min(2 ** bits - 1, max(0, round((v - low) / step))) for v in x]


def test_kivi_rounds_keys_per_channel_and_values_per_token_as_a_numpy_reference_does():
    rng = np.random.default_rng(0)
    keys, values = rng.normal(size=(2, 8, 6)), rng.normal(size=(2, 8, 6))
    got_k, got_v = quantise_keys(keys, 2, 4), quantise_values(values, 2, 4)
    for h in range(2):
        for g in range(2):  # key groups: tokens 0-3 and 4-7, each channel on its own
            for c in range(6):
                np.testing.assert_allclose(got_k[h, 4 * g:4 * g + 4, c],
                                           reference_quantise(keys[h, 4 * g:4 * g + 4, c], 2))
        for j in range(8):  # value groups: channels 0-3 and 4-5 of each token
            np.testing.assert_allclose(got_v[h, j, :4], reference_quantise(values[h, j, :4], 2))
            np.testing.assert_allclose(got_v[h, j, 4:], reference_quantise(values[h, j, 4:], 2))
    # By hand, 2 bits over 0..3 (a step of 1): 0.5 rounds to even (0), 0.9 to 1, 2.6 to 3; a constant group stays.
    np.testing.assert_allclose(quantise(np.array([0.0, 0.5, 0.9, 2.6, 3.0]), 2, 0), [0, 0, 1, 3, 3])
    np.testing.assert_array_equal(quantise(np.full(3, 7.0), 2, 0), [7, 7, 7])
    assert np.unique(quantise(rng.normal(size=50), 3, 0)).size <= 8


def test_kivi_holds_every_token_and_rounds_whole_groups_once_past_the_residual(tiny, text_ids):
    policy = KIVI(bits=2, group=4, residual=8, interval=4, every=4)
    (trace,), full = compute_traces(tiny, ["kivi"], [policy], text_ids, record_layers=())
    n = len(text_ids)
    assert (trace.evicted_at == -1).all()  # held, not evicted: every view shows it read
    np.testing.assert_array_equal(trace.reads(1), full.reads(1))
    # After query t (t + 1 a multiple of 4) the groups wholly older than the 8 latest are rounded: tokens 0-3 after
    # query 11 (read so from step 12), 4-7 after 15, ..., 28-31 after 39; 32-39 stay whole.
    expected = np.full(n, -1)
    for start in range(0, n - 8, 4):
        expected[start:start + 4] = start + 12
    np.testing.assert_array_equal(trace.forms["reformed_at"], np.broadcast_to(expected, trace.forms["reformed_at"].shape))
    # A rounded token is off unless it is its group's lowest or highest in every channel; a whole one is exact.
    assert (trace.forms["key_error"][..., :32] > 0).mean() > 0.9 and (trace.forms["key_error"][..., 32:] == 0).all()
    assert (trace.forms["value_error"][..., :32] > 0).mean() > 0.9 and (trace.forms["value_error"][..., 32:] == 0).all()
    assert not np.allclose(trace.logprobs, full.logprobs)
    # What the rounding did to each query's attention: nothing before the first rounding (after query 11); every
    # later query reads rounded tokens, its softmax shifted (a total variation, within 0-1) and its output off.
    shift, error = trace.forms["attention_shift"], trace.forms["output_error"]
    assert shift.shape == error.shape == (tiny.n_layers, tiny.n_kv_heads, n)
    assert (shift[..., :12] == 0).all() and (shift[..., 12:] > 0).all() and (shift <= 1).all()
    assert (error[..., :12] == 0).all() and (error[..., 12:] > 0).all()
    # And to each channel: keys are rounded per channel over 4 tokens, values per token over 4 channels.
    channels = trace.forms["key_channel_error"]
    assert channels.shape == (tiny.n_layers, tiny.n_kv_heads, tiny.model.config.head_dim) and (channels > 0).all()
    assert parse_spec("kivi:ratio=0.875").bits == 2 and parse_spec("kivi:ratio=0.75").bits == 4
    assert parse_spec("kivi:ratio=0.5").bits == 8 and parse_spec("kivi:ratio=0").bits == 16
    assert KIVI.for_budget(8) == KIVI(residual=8, group=2, interval=2, every=2) and parse_spec("kivi").spec() == "kivi"
    with pytest.raises(ValueError, match="takes no budget"):
        KIVI(budget=64)


# --- GEAR ---------------------------------------------------------------------------------------------------------

def test_gear_holds_outliers_exact_and_approximates_the_rounding_error_at_low_rank_by_hand():
    # Filter_s: of 8 entries at a share of 0.5, the 2 largest (9, 5) and the 2 smallest (-7, -3).
    np.testing.assert_array_equal(outliers(np.array([5, -3, 0, 1, 9, -7, 2, 4.0]), 0.5, 0),
                                  [True, True, False, False, True, True, False, False])
    assert not outliers(np.arange(8.0), 0.1, 0).any()  # round(0.05 x 8) = 0: none
    # The low-rank part: a rank-1 matrix comes back whole at rank 1; at rank r the error is the other singular
    # values (Eckart-Young).
    u, v = np.array([1.0, 2, 3]), np.array([2.0, -1])
    np.testing.assert_allclose(low_rank(np.outer(u, v)[None], 1)[0], np.outer(u, v))
    m = np.random.default_rng(1).normal(size=(2, 6, 4))
    tail = np.linalg.svd(m, compute_uv=False)[:, 2:]
    np.testing.assert_allclose(np.linalg.norm(m - low_rank(m, 2), axis=(1, 2)), np.linalg.norm(tail, axis=1))
    assert not low_rank(m, 0).any()
    # A key channel over a group of 8 tokens with one outlier: KIVI's 2 bits step by 1000 / 3, so 0-6 all round
    # to 0; GEAR holds 1000 and 0 exact and rounds 1-6 in steps of 2 (the rest a group of zeros).
    keys = np.zeros((1, 8, 2))
    keys[0, :, 0] = [0, 1, 2, 3, 4, 5, 6, 1000]
    values = np.zeros((1, 8, 2))
    kivi = KIVI(bits=2, group=8)
    gear = GEAR(bits=2, group=8, rank=0, outliers=0.25)
    np.testing.assert_allclose(kivi.rounded(keys, values)[0][0, :, 0], [0, 0, 0, 0, 0, 0, 0, 1000])
    np.testing.assert_allclose(gear.rounded(keys, values)[0][0, :, 0], [0, 0, 2, 4, 4, 4, 6, 1000])
    # With neither part it is KIVI; with the low-rank part each head's and group's error can only shrink.
    rng = np.random.default_rng(2)
    keys, values = rng.normal(size=(2, 16, 8)), rng.normal(size=(2, 16, 8))
    plain = KIVI(bits=2, group=8)
    for got, want in zip(GEAR(bits=2, group=8, rank=0).rounded(keys, values), plain.rounded(keys, values)):
        np.testing.assert_array_equal(got, want)
    for x, gear_x, kivi_x in zip((keys, values), GEAR(bits=2, group=8, rank=2).rounded(keys, values),
                                 plain.rounded(keys, values)):
        grouped = (2, 2, 8, 8)
        gear_error = np.linalg.norm((x - gear_x).reshape(grouped), axis=(2, 3))
        kivi_error = np.linalg.norm((x - kivi_x).reshape(grouped), axis=(2, 3))
        assert (gear_error < kivi_error).all()
    assert parse_spec("gear:ratio=0.75").bits == 4 and parse_spec("gear").rank == 4
    with pytest.raises(ValueError, match="rank"):
        GEAR(rank=-1)


def test_gear_s_held_keys_are_nearer_the_model_s_than_kivi_s(tiny, text_ids):
    specs = ["kivi:bits=2,group=4,residual=8,interval=4,every=4",
             "gear:bits=2,group=4,residual=8,interval=4,every=4,rank=2"]
    (kivi, gear), full = compute_traces(tiny, specs, [parse_spec(s) for s in specs], text_ids, record_layers=())
    np.testing.assert_array_equal(gear.forms["reformed_at"], kivi.forms["reformed_at"])  # the same schedule
    rounded = kivi.forms["reformed_at"] >= 0
    for name in ("key_error", "value_error"):
        assert gear.forms[name][rounded].astype(float).mean() < 0.8 * kivi.forms[name][rounded].astype(float).mean()
    assert gear.forms["attention_shift"].astype(float).mean() < kivi.forms["attention_shift"].astype(float).mean()


# --- the engine -------------------------------------------------------------------------------------------------

def test_held_forms_read_the_reformed_tokens_and_the_model_s_own_after_them():
    forms = HeldForms(1)
    key = torch.arange(12.0).reshape(1, 6, 2)
    value = -key
    forms.extend(6)
    new_keys = np.zeros((1, 4, 2))
    forms.apply(Reform(positions=np.array([[True, False, True, False]]), keys=new_keys), t=3, key=key, value=value)
    at = torch.tensor([[0, 1, 2, 5]])
    keys, values = forms.read(key[0][at[0]][None], value[0][at[0]][None], torch.zeros(1, 1, dtype=torch.long), at)
    np.testing.assert_array_equal(keys[0].numpy(), [[0, 0], [2, 3], [0, 0], [10, 11]])  # 0 and 2 reformed
    np.testing.assert_array_equal(values[0].numpy(), -key[0][[0, 1, 2, 5]].numpy())
    np.testing.assert_array_equal(forms.reformed_at[0], [4, -1, 4, -1, -1, -1])
    np.testing.assert_allclose(forms.key_error[0], [1, 0, 1, 0, 0, 0])  # |0 - k| / |k| = 1 where zeroed
    # Per channel over the 4 tokens held at the reform: channel 0 lost |0| + |4| of 0 + 2 + 4 + 6, channel 1
    # |1| + |5| of 1 + 3 + 5 + 7; the values are whole.
    np.testing.assert_allclose(forms.key_channel_error, [[4 / 12, 6 / 16]])
    np.testing.assert_array_equal(forms.value_channel_error, [[0, 0]])


def test_held_forms_measure_what_reading_them_did_to_a_query_s_attention_by_hand():
    forms = HeldForms(1)
    forms.extend(4)
    # Query 2 reads two tokens: as computed, keys e0 and e1 give logits 0 and ln 3 (softmax 1/4, 3/4); as held,
    # the second key zeroed, 0 and 0 (1/2, 1/2). Total variation 0.25; the outputs (values e0, e1) (1/2, 1/2)
    # against (1/4, 3/4): |(1/4, -1/4)| / |(1/4, 3/4)| = 1 / sqrt(5).
    q = torch.tensor([[[[0.0, float(np.log(3))]]]])
    keys, values = torch.eye(2)[None], torch.eye(2)[None]
    held = torch.zeros(1, 1, 1, 2)
    probs = torch.softmax(held, -1)
    forms.measure(2, q, probs, probs @ values[:, None], held, keys, values, 1.0, None)
    assert forms.attention_shift[0, 2] == pytest.approx(0.25)
    assert forms.output_error[0, 2] == pytest.approx(1 / np.sqrt(5))
    assert (forms.attention_shift[0, [0, 1, 3]] == 0).all()
    # A token the query does not read (-inf in its scores) is left out of both rows: nothing changed.
    unread = torch.tensor([[[[0.0, float("-inf")]]]])
    probs = torch.softmax(unread, -1)
    forms.measure(3, q, probs, probs @ values[:, None], unread, keys, values, 1.0, None)
    assert forms.attention_shift[0, 3] == 0 and forms.output_error[0, 3] == 0


@pytest.mark.parametrize("spec", ["think:budget=12,window=2,kernel=1,channels=0.5,interval=8,every=3",
                                  "kivi:group=4,residual=8,interval=4,every=4",
                                  "cam:budget=10,window=0,scorer=knorm,preset=kvpress,sample=expected,interval=4",
                                  "merging:budget=10,scorer=knorm,interval=4"])
def test_the_prompt_path_reads_the_forms_a_token_loop_reads(tiny, text_ids, spec):
    policy = parse_spec(spec)
    for chunk in (len(text_ids), 5):
        whole, s_whole, _ = score_text(tiny, text_ids, [policy], chunk=chunk)
        single, s_single, _ = score_text(tiny, text_ids, [policy], chunk=1)
        np.testing.assert_allclose(s_whole["logprobs"], s_single["logprobs"], atol=1e-9)
        for name, values in whole.forms(1, len(text_ids)).items():
            np.testing.assert_array_equal(values, single.forms(1, len(text_ids))[name], err_msg=name)


def test_think_s_trace_says_which_channels_each_head_kept_and_what_the_keys_lost(tiny, text_ids):
    policy = ThinK(budget=16, window=4, kernel=1, channels=0.5)
    (trace,), full = compute_traces(tiny, ["think"], [policy], text_ids[:30], mode="generate", max_new_tokens=4)
    forms = trace.forms
    head_dim = forms["channels"].shape[-1]
    np.testing.assert_array_equal(forms["channel_steps"], [29])  # once, after the prompt's last query
    assert (forms["channels"].sum(-1) == head_dim - head_dim // 2).all()
    held = (trace.evicted_at == -1)[..., :30]
    pruned = forms["reformed_at"][..., :30] == 30
    assert (pruned <= held).all() and (held & ~pruned).sum(-1).max() == 4  # the window's 4 latest stay whole
    assert (forms["key_error"][..., :30][pruned] > 0).all() and (forms["value_error"] == 0).all()
    assert Trace.from_bytes(trace.to_bytes()).forms.keys() == forms.keys()


# --- plugins of each kind, the app and the CLI ------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("module, spec", [("channels_plugin", "quiet_channels:budget=12"),
                                          ("precision_plugin", "per_token_int:residual=8"),
                                          ("merge_plugin", "nearest_merge:budget=12")])
def test_a_plugin_of_each_new_kind_runs_through_the_app_and_the_cli(module, spec, tiny, tmp_path, monkeypatch):
    import app
    from backend import api
    from backend.engine.models import DEFAULT_MODEL
    from backend.traces.store import TraceStore

    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples"))
    name = spec.split(":")[0]
    try:
        load_plugins(module)
        monkeypatch.setitem(models.LOADED, DEFAULT_MODEL, tiny)
        monkeypatch.setattr(app, "STORE", TraceStore(tmp_path / "store"))
        run = api.run(api.RunRequest(prompt="the cat sat on the mat and the dog sat on the log " * 3, specs=[spec],
                                     max_new_tokens=4), app.STORE)
        trace = next(t for t in run.traces if t.spec == spec)
        assert trace.forms and ((trace.forms["key_error"] > 0).any() or (trace.forms["value_error"] > 0).any())
        if "merged_into" in trace.forms:  # only an evicted token gives its value, to a token still held
            into = trace.forms["merged_into"]
            assert (into >= 0).any() and ((into >= 0) <= (trace.evicted_at >= 0)).all()
            assert (np.take_along_axis(trace.evicted_at, np.maximum(into, 0), -1)[into >= 0] == -1).all()
        forms_figure = app.render_views(run.run_id, "all", "all", 30, 0.3)[-1]
        assert any(spec in (panel.name or "") for panel in forms_figure.data)
    finally:
        POLICIES.pop(name, None)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "docs" / "examples"), "KVLENS_PLUGINS": module,
           "KVLENS_STORE_DIR": str(tmp_path / "cli-store")}
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log " * 3)
    result = subprocess.run([sys.executable, "-m", "backend", "run", "--text", str(text), "--policy", spec,
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    saved = [Trace.load(path) for path in (tmp_path / "out").glob("*.npz")]
    assert any(t.forms for t in saved if t.meta["policy"] == name)


# --- the view ---------------------------------------------------------------------------------------------------

def test_the_held_forms_view_draws_each_reforming_policy_and_says_when_none_reforms(tiny, text_ids):
    from viz import panels
    from viz.forms import NOTHING

    specs = ["think:budget=16,window=4,kernel=1", "kivi:group=4,residual=8,interval=4,every=4", "tova:budget=8"]
    traces, full = compute_traces(tiny, specs, [parse_spec(s) for s in specs], text_ids)
    run = types.SimpleNamespace(traces=[full, *traces])
    figure = panels.held_forms(run, len(text_ids) - 1, "all")
    names = [panel.name for panel in figure.data]
    # ThinK: keys, channels kept, what that did to the attention; KIVI: keys, values, the attention, and each key
    # and value channel's error; TOVA and Full hold tokens as computed.
    assert names == [specs[0]] * 3 + [specs[1]] * 5
    kivi_keys, kivi_attention, kivi_key_channels = figure.data[3], figure.data[5], figure.data[6]
    # 40 tokens, one column each: query 39 reads tokens 0-27 rounded; 28-31 are rounded after it, 32-39 never.
    z = np.asarray(kivi_keys.z, float)
    assert z.shape == (tiny.n_layers, len(text_ids)) and (z[:, :28] > 0).mean() > 0.9 and (z[:, 28:] == 0).all()
    # Queries 0-11 read every token whole (left out of the picture), each later one some rounded tokens.
    moved = np.asarray(kivi_attention.z, float)
    assert moved.shape == (tiny.n_layers, len(text_ids) - 12) and (moved > 0).all()
    assert str(kivi_attention.x[0]).startswith("12 ") and str(kivi_attention.x[-1]).startswith("39 ")
    per_channel = np.asarray(kivi_key_channels.z, float)
    assert per_channel.shape == (tiny.n_layers * tiny.n_kv_heads, tiny.model.config.head_dim)
    assert list(kivi_key_channels.y)[:2] == ["L0 H0", "L0 H1"] and (per_channel > 0).all()
    nothing = panels.held_forms(types.SimpleNamespace(traces=[full, traces[2]]), 10, "all")
    assert NOTHING in nothing.layout.annotations[0].text.replace("&#x27;", "'")


# --- CaM ----------------------------------------------------------------------------------------------------------

def test_cam_merges_each_evicted_value_into_the_held_tokens_after_it_by_its_attention():
    # One head, 6 tokens; SnapKV's window 1 keeps token 5, the budget 4 keeps the best three others by the window's
    # attention (kernel 1) .3 .2 .05 .4 .25: 0, 3 and 4; 1 and 2 go. Each merges into 3 and 4 (m = 2), by its
    # attention over theirs, .2 / .325 and .05 / .325 (sample=expected), 1/m of it per target.
    attention = np.array([[[0.3, 0.2, 0.05, 0.4, 0.25, 0.2]]])
    values = np.arange(12.0).reshape(1, 6, 2)
    view = CacheView(t=5, n_prompt=6, layer=0, n_layers=1, attn_window=attention, keys=np.ones((1, 6, 2)),
                     values=values, kept=np.ones((1, 6), bool), queries=np.ones((1, 1, 1, 2)))
    policy = CaM(budget=4, window=1, kernel=1, merge=2, sample="expected")
    keep = policy.keep(view)
    np.testing.assert_array_equal(keep, [[True, False, False, True, True, True]])
    reform = policy.reform(view, keep)
    first, second = 0.2 / 0.325, 0.05 / 0.325
    merged = first * values[0, 1] / 2 + second * values[0, 2] / 2
    np.testing.assert_allclose(reform.values[0, 3], values[0, 3] + merged)
    np.testing.assert_allclose(reform.values[0, 4], values[0, 4] + merged)
    np.testing.assert_allclose(reform.values[0, [0, 5]], values[0, [0, 5]])  # tokens before, and past m, untouched
    np.testing.assert_array_equal(reform.merged_into, [[-1, 3, 3, -1, -1, -1]])
    np.testing.assert_allclose(reform.merge_weight, [[0, first / 2, second / 2, 0, 0, 0]])
    np.testing.assert_array_equal(reform.positions, [[False, False, False, True, True, False]])
    assert reform.keys is None
    # Drawn (the paper, kvpress): each merge is all or nothing, and the same seed draws the same.
    drawn = dataclasses.replace(policy, sample="bernoulli").reform(view, keep)
    assert set(drawn.merge_weight[0, [1, 2]]) <= {0.0, 0.5}
    np.testing.assert_array_equal(drawn.values, dataclasses.replace(policy, sample="bernoulli").reform(view, keep).values)
    np.testing.assert_array_equal(merge_shares(np.array([0.0, 0.1, 0.2]), np.array([0.0, 0.0, 0.4])), [0.0, 1.0, 0.5])
    assert policy.whole().reform(view, keep) is None


def test_cam_with_kvpress_settings_merges_the_best_scored_of_what_arrived_by_the_decoded_queries_attention():
    # Two heads, 6 tokens, the prompt 4 (queries 4 and 5 were decoded), Knorm's scores, budget 3, no window. The heads'
    # mean key norm, 1 4 4 3 2.75 1, keeps 0, 4 and 5 in both heads (head 0 alone would keep 2). Two tokens were read
    # since the prompt, so two of the evicted 1, 2, 3 merge, the best-scored: 3, then 2 (of equal scores the later).
    # Their targets are 4 and 5 (m = 2); the attention is the decoded queries' sum (query 3 is the prompt's).
    norms = np.array([[1, 5, 2, 4, 3, 1], [1, 3, 6, 2, 2.5, 1]], float)
    keys = norms[..., None] * np.array([1.0, 0.0])
    rows = np.array([[[0.5, 0.5, 0, 0, 0, 0], [0.1, 0.2, 0.3, 0.1, 0.3, 0], [0.1, 0.1, 0.2, 0.2, 0.2, 0.2]],
                     [[0.5, 0.5, 0, 0, 0, 0], [0.2, 0.2, 0.2, 0.2, 0.2, 0], [0.1, 0.1, 0.1, 0.1, 0.1, 0.5]]])
    values = np.arange(24.0).reshape(2, 6, 2)
    view = CacheView(t=5, n_prompt=4, layer=0, n_layers=1, attn_window=rows, keys=keys, values=values,
                     kept=np.ones((2, 6), bool), query_positions=np.array([3, 4, 5]))
    policy = parse_spec("cam:budget=3,window=0,scorer=knorm,merge=2,preset=kvpress,sample=expected")
    assert (policy.heads, policy.merged, policy.votes, policy.prefill, policy.every) == ("layer", "arrived", "running",
                                                                                        False, 1)
    keep = policy.keep(view)
    np.testing.assert_array_equal(keep, [[True, False, False, False, True, True]] * 2)
    np.testing.assert_array_equal(dataclasses.replace(policy, heads="head").keep(view)[0],
                                  [True, False, True, False, False, True])
    reform = policy.reform(view, keep)
    # Running attention: head 0 .2 .3 .5 .3 .5 .2, head 1 .3 .3 .3 .3 .3 .5. Shares: head 0 token 2 .5 / .35 -> 1,
    # token 3 .3 / .35; head 1 .3 / .4 each.
    shares = np.array([[1.0, 0.3 / 0.35], [0.75, 0.75]])
    for h in range(2):
        merged = (shares[h, 0] * values[h, 2] + shares[h, 1] * values[h, 3]) / 2
        np.testing.assert_allclose(reform.values[h, [4, 5]], values[h, [4, 5]] + merged)
        np.testing.assert_allclose(reform.values[h, :4], values[h, :4])  # token 1 was evicted, not merged
    np.testing.assert_array_equal(reform.merged_into, [[-1, -1, 4, 4, -1, -1]] * 2)
    np.testing.assert_allclose(reform.merge_weight[:, 2:4], shares / 2)
    # It decodes before it compresses: not after the prompt's last query, after each decoded one.
    assert not policy.compresses_after(3, 4) and policy.compresses_after(4, 4) and policy.compresses_after(5, 4)
    with pytest.raises(ValueError, match="every >= 1"):
        dataclasses.replace(policy, every=0)
    for unfit in ("simlayerkv", "kvzip", "kivi"):  # no token scores; an extra pass; a reforming policy
        with pytest.raises(ValueError, match="scorer must be one of"):
            dataclasses.replace(policy, scorer=unfit)


def test_merging_folds_each_evicted_value_into_the_held_token_of_the_nearest_key():
    # One head; Knorm keeps tokens 0 and 1 (the smallest keys) of 4. Token 2's key points as token 0's (cosine 1),
    # token 3's nearest is token 1's (cosine 3 / sqrt(10)). Each weighs its likeness times its value's norm over
    # both norms: w2 = 1 x 3 / (3 + 1), w3 = 0.949 x 4 / (4 + 2); a target holds (v + w v_e) / (1 + w).
    keys = np.array([[[1.0, 0.0], [0.0, 1.0], [3.0, 0.0], [1.0, 3.0]]])
    values = np.array([[[1.0, 0.0], [0.0, 2.0], [0.0, 3.0], [4.0, 0.0]]])
    view = CacheView(t=3, n_prompt=4, layer=0, n_layers=1, attn_window=np.zeros((1, 0, 4)), keys=keys,
                     values=values, kept=np.ones((1, 4), bool))
    policy = Merging(budget=2, scorer="knorm")
    keep = policy.keep(view)
    np.testing.assert_array_equal(keep, [[True, True, False, False]])
    reform = policy.reform(view, keep)
    cos3 = 3 / np.sqrt(10)
    w2, w3 = 0.75, cos3 * 4 / 6
    np.testing.assert_allclose(reform.values[0, 0], (values[0, 0] + w2 * values[0, 2]) / (1 + w2), rtol=1e-5)
    np.testing.assert_allclose(reform.values[0, 1], (values[0, 1] + w3 * values[0, 3]) / (1 + w3), rtol=1e-5)
    np.testing.assert_array_equal(reform.merged_into, [[-1, -1, 0, 1]])
    np.testing.assert_allclose(reform.merge_weight, [[0, 0, w2 / (1 + w2), w3 / (1 + w3)]], rtol=1e-5)
    assert reform.keys is None
    # A threshold above token 3's likeness, or the most similar half, merges token 2 alone.
    for stricter in (dataclasses.replace(policy, similarity=0.95), dataclasses.replace(policy, fraction=0.5)):
        np.testing.assert_array_equal(stricter.reform(view, keep).merged_into, [[-1, -1, 0, -1]])


def test_cam_s_trace_and_view_say_where_evicted_values_went(tiny, text_ids):
    from viz import panels

    spec = "cam:budget=12,window=2,kernel=1,merge=3"
    (trace,), full = compute_traces(tiny, [spec], [parse_spec(spec)], text_ids[:30], mode="generate",
                                    max_new_tokens=4)
    into = trace.forms["merged_into"][..., :30]
    evicted = trace.evicted_at[..., :30] == 30
    assert ((into >= 0) <= evicted).all() and (into >= 0).any()  # only evicted tokens give their value
    positions = np.broadcast_to(np.arange(30), into.shape)
    assert (into[into >= 0] > positions[into >= 0]).all()  # always into a later held token
    held_to = np.take_along_axis(trace.evicted_at, np.maximum(into, 0), -1)
    assert (held_to[into >= 0] == -1).all()
    assert (trace.forms["key_error"] == 0).all() and (trace.forms["value_error"] > 0).any()
    figure = panels.held_forms(types.SimpleNamespace(traces=[full, trace]), 31, "all")
    # The values' error, what was merged, what that did to the outputs (the keys and so the softmax unchanged),
    # and each value channel's error.
    assert [panel.name for panel in figure.data] == [spec] * 4
    merged = np.asarray(figure.data[1].z, float)
    assert np.nanmax(merged) > 0 and np.isnan(merged[:, 28:]).all()  # the window's latest were never evicted
    assert (trace.forms["attention_shift"] == 0).all()
    outputs = np.asarray(figure.data[2].z, float)
    assert outputs.shape == (tiny.n_layers, 2) and (outputs > 0).any()  # queries 30 and 31 read merged values


# --- FINCH --------------------------------------------------------------------------------------------------------

def test_finch_weighs_each_question_query_by_the_keys_it_sees_and_keeps_chunk_shares():
    from backend.policies.finch import FINCH

    # Two question queries at positions 4 and 5 (window 2), rows over 6 tokens: weighed by 4 and 5, then averaged:
    # token 0: (.5 x 4 + .1 x 5) / 2 = 1.25, token 1: (.1 x 4 + .5 x 5) / 2 = 1.45, 2: .2, 3: .5.
    rows = np.array([[[0.5, 0.1, 0.1, 0.0, 0.3, 0.0], [0.1, 0.5, 0.0, 0.2, 0.1, 0.1]]])
    view = CacheView(t=5, n_prompt=6, layer=0, n_layers=1, attn_window=rows, keys=np.ones((1, 6, 2)),
                     values=np.ones((1, 6, 2)), kept=np.ones((1, 6), bool), query_positions=np.array([4, 5]))
    policy = FINCH(budget=4, window=2, rerotate=False)
    np.testing.assert_allclose(policy.score(view)[0, :4], [1.25, 1.45, 0.2, 0.5])
    np.testing.assert_array_equal(policy.keep(view), [[True, True, False, False, True, True]])
    # In chunks of 2: 4 held before the window, 2 slots -> half of each chunk: 1 of (0, 1), 3 of (2, 3).
    np.testing.assert_array_equal(FINCH(budget=4, window=2, chunk=2, rerotate=False).keep(view),
                                  [[False, True, False, True, True, True]])


def test_finch_rerotates_the_kept_keys_to_consecutive_positions(tiny, text_ids):
    from backend.policies.finch import FINCH

    prompt = text_ids[:24]
    policy = FINCH(budget=8, window=4)
    (trace,), full = compute_traces(tiny, ["finch"], [policy], prompt, mode="generate", max_new_tokens=3,
                                    record_layers=())
    kept = trace.evicted_at[..., :24] == -1
    moved = trace.forms["reformed_at"][..., :24] == 24
    # Every kept key but those already at their rank (the first ones, if kept) turned; none evicted turned.
    ranks = np.cumsum(kept, -1) - 1
    np.testing.assert_array_equal(moved, kept & (ranks != np.arange(24)))
    # A rotation keeps a key's norm and changes its direction: the relative error is |R(s) k - k| / |k| > 0.
    assert (trace.forms["key_error"][..., :24][moved] > 0).all() and (trace.forms["value_error"] == 0).all()
    plain = dataclasses.replace(policy, rerotate=False)
    (unturned,), _ = compute_traces(tiny, ["finch"], [plain], prompt, mode="generate", max_new_tokens=3,
                                    record_layers=())
    np.testing.assert_array_equal(unturned.evicted_at, trace.evicted_at)  # the same tokens, read at other positions
    assert not np.allclose(unturned.logprobs[23:], trace.logprobs[23:])
