"""Compression policies (SnapKV, PyramidKV, AdaKV, Knorm) on hand-worked numbers, their schedule, the
engine's prefill behaviour, and plugins."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backend.engine import models
from backend.policies import POLICIES, AdaKV, CacheView, Knorm, PyramidKV, SnapKV, load_plugins, parse_spec
from backend.policies.pyramidkv import pyramid
from backend.policies.registry import PluginError
from backend.policies.snapkv import pool
from backend.engine.runner import compute_traces

ROOT = Path(__file__).resolve().parents[1]


def view(n: int, heads: int = 1, attn_window=None, keys=None, values=None, kept=None, layer=0, n_layers=1):
    return CacheView(t=n - 1, n_prompt=None, layer=layer, n_layers=n_layers,
                     attn_window=np.zeros((heads, 0, n)) if attn_window is None else np.asarray(attn_window, float),
                     keys=np.ones((heads, n, 2)) if keys is None else np.asarray(keys, float),
                     values=np.ones((heads, n, 2)) if values is None else np.asarray(values, float),
                     kept=np.ones((heads, n), bool) if kept is None else np.asarray(kept, bool))


def test_pooling_keeps_the_length_max_pads_with_minus_infinity_avg_with_zeros():
    x = np.array([[1.0, 5, 2, 0, 3]])
    np.testing.assert_array_equal(pool(x, 3, "max"), [[5, 5, 5, 3, 3]])
    np.testing.assert_allclose(pool(x, 3, "avg"), [[2, 8 / 3, 7 / 3, 5 / 3, 1]])
    np.testing.assert_array_equal(pool(x, 1, "max"), x)


def test_snapkv_keeps_the_window_and_the_prefix_tokens_the_window_attends_to():
    # 8 tokens, window 2 (tokens 6, 7), budget 4: two prefix tokens by summed window attention.
    rows = [[0.125, 0.0, 0.5, 0.0, 0.25, 0.0, 0.125, 0.0],
            [0.125, 0.0, 0.125, 0.0, 0.375, 0.125, 0.125, 0.125]]  # sums .25 0 .625 0 .625 .125 | window
    keep = SnapKV(budget=4, window=2, kernel=1).keep(view(8, attn_window=[rows]))
    assert np.flatnonzero(keep[0]).tolist() == [2, 4, 6, 7]
    # Ties keep the earlier position: 2 and 4 tie at 0.625 when only one prefix token fits.
    keep = SnapKV(budget=3, window=2, kernel=1).keep(view(8, attn_window=[rows]))
    assert np.flatnonzero(keep[0]).tolist() == [2, 6, 7]


def test_snapkv_pooling_keeps_the_neighbourhood_of_a_strong_token():
    rows = [[0.0, 0.0, 0.0, 0.9, 0.0, 0.0, 0.05, 0.0, 0.0, 0.05]]  # token 3 is the one the window wants
    keep = SnapKV(budget=4, window=1, kernel=3, pooling="max").keep(view(10, attn_window=[rows]))
    assert np.flatnonzero(keep[0]).tolist() == [2, 3, 4, 9]  # 3 and its neighbours, and the window


def test_snapkv_keeps_a_cache_within_its_budget_whole():
    assert SnapKV(budget=8, window=2).keep(view(8, attn_window=[[[0.1] * 8] * 2])).all()


def test_pyramid_falls_linearly_with_depth_and_adds_up_to_layers_times_budget():
    # mean 10, beta 20: last layer 0.5, first 19.5; largest remainders round to a total of exactly 40.
    assert pyramid(10, 100, 4, 20).tolist() == [20, 13, 7, 0]
    # The first layer cannot keep more than the 12 cached: the pyramid flattens to 12 ... 8.
    assert pyramid(10, 12, 4, 20).tolist() == [12, 11, 9, 8]
    assert pyramid(10, 100, 1, 20).tolist() == [10]


def test_pyramidkv_gives_each_layer_its_share_plus_the_scorers_window():
    policy = PyramidKV(budget=12, beta=20)  # SnapKV's scores; at budget 12 its window is 6
    budgets = [policy.layer_budget(view(100, layer=layer, n_layers=4)) for layer in range(4)]
    assert policy.recent == 6 and budgets == [6 + b for b in pyramid(6, 94, 4, 20)] and sum(budgets) == 4 * 12
    knorm = PyramidKV(budget=12, scorer="knorm")  # any scorer: Knorm has no window
    assert [knorm.layer_budget(view(100, layer=layer, n_layers=4)) for layer in range(4)] == list(pyramid(12, 100, 4, 20))
    assert budgets[0] > budgets[1] > budgets[2] > budgets[3]


def test_adakv_gives_slots_to_the_best_scores_across_heads_with_a_floor():
    # Knorm scores (-|k|): head 0's keys have norms 1..5, head 1's 10, 0.5, 0.6, 20, 30.
    norms = np.array([[1.0, 2, 3, 4, 5], [10, 0.5, 0.6, 20, 30]])
    keys = np.stack([norms, np.zeros_like(norms)], -1)
    # B' = 3 per head, 6 slots: the best six over both heads are 0.5, 0.6 (head 1) and 1, 2, 3, 4 (head 0).
    keep = AdaKV(budget=3, scorer="knorm", alpha_floor=0.0).keep(view(5, heads=2, keys=keys))
    assert np.flatnonzero(keep[0]).tolist() == [0, 1, 2, 3] and np.flatnonzero(keep[1]).tolist() == [1, 2]
    # alpha 0.2: a floor of int(0.6) = 0 per head, then the same six slots: the heads share exactly 2 x 3.
    keep = AdaKV(budget=3, scorer="knorm", alpha_floor=0.2).keep(view(5, heads=2, keys=keys))
    assert keep.sum(-1).tolist() == [4, 2]
    # alpha 0.5: each head first keeps its int(1.5) = 1 best (head 1's 0.5, head 0's 1), then the four best
    # others over both heads (0.6 of head 1, 2, 3, 4 of head 0): still 6 in all.
    keep = AdaKV(budget=3, scorer="knorm", alpha_floor=0.5).keep(view(5, heads=2, keys=keys))
    assert np.flatnonzero(keep[0]).tolist() == [0, 1, 2, 3] and np.flatnonzero(keep[1]).tolist() == [1, 2]
    # B' = 4, floor 2: head 0 keeps 1, 2 and head 1 keeps 0.5, 10 whatever the others; the four other slots
    # go to 3, 4, 5 (head 0) and 20 (head 1): 8 in all.
    norms[1] = [10, 0.5, 20, 30, 40]
    keep = AdaKV(budget=4, scorer="knorm", alpha_floor=0.5).keep(view(5, heads=2, keys=np.stack([norms, 0 * norms], -1)))
    assert keep.sum(-1).tolist() == [5, 3] and np.flatnonzero(keep[1]).tolist() == [0, 1, 2]
    # alpha 1: every head keeps exactly its floor, B' = 3: uniform, as plain Knorm.
    np.testing.assert_array_equal(AdaKV(budget=3, scorer="knorm", alpha_floor=1.0).keep(view(5, heads=2, keys=keys)),
                                  Knorm(budget=3).keep(view(5, heads=2, keys=keys)))


def test_knorm_keeps_the_lowest_norm_keys():
    keys = [[[3.0, 0], [0, 1], [2, 0], [0, 5]]]
    assert np.flatnonzero(Knorm(budget=2).keep(view(4, keys=keys))[0]).tolist() == [1, 2]


def test_schedule_once_after_the_prompt_then_every_n_decoding_steps_or_every_interval_in_prompt_mode():
    once, every = SnapKV(budget=8, window=2), SnapKV(budget=8, window=2, every=3, interval=4)
    assert [t for t in range(20) if once.compresses_after(t, 10)] == [9]
    assert [t for t in range(20) if every.compresses_after(t, 10)] == [9, 12, 15, 18]
    assert [t for t in range(12) if every.compresses_after(t, None)] == [3, 7, 11]


def test_the_compression_steps_counted_are_those_compresses_after_says_step_by_step():
    """The engine asks which steps of a block, or of the queries a window reaches, compress; counted from the schedule,
    they must be the steps ``compresses_after`` names one at a time, in every mode and for every compression policy
    (those that decide otherwise, as CaM and R-KV, are stepped through)."""
    compressing = [cls for cls in POLICIES.values() if cls.kind == "compression"]
    assert len(compressing) > 10
    checked = 0
    for cls in compressing:
        for settings in ({"budget": 8}, {"budget": 8, "interval": 5, "every": 3}, {"budget": 12, "every": 1}):
            try:
                policy = cls(**{k: v for k, v in settings.items() if k in cls.__dataclass_fields__})
            except ValueError:
                continue
            for n_prompt in (None, 1, 9, 30):
                for start in range(0, 40, 3):
                    for stop in (start, start + 1, start + 7, start + 33):
                        stepped = [t for t in range(start, stop) if policy.compresses_after(t, n_prompt)]
                        assert policy.compression_steps(start, stop, n_prompt) == stepped, \
                            (policy.spec(), n_prompt, start, stop)
                        checked += bool(stepped)
    assert checked > 1000


def test_a_prefill_method_reads_the_whole_prompt_then_the_kept_set_and_appends_generated_tokens(tiny, text_ids):
    prompt = text_ids[:24]
    policies = [parse_spec("snapkv:budget=8,window=2"), parse_spec("knorm:budget=8")]
    traces, full = compute_traces(tiny, [p.spec() for p in policies], policies, prompt, mode="generate", max_new_tokens=5,
                       record_layers=())
    for trace in traces:
        evicted = trace.evicted_at
        assert set(np.unique(evicted)) <= {-1, len(prompt)}  # one compression, when the prompt was read
        reads = trace.reads(0)  # [H, T, T]
        assert (reads[:, len(prompt) - 1, : len(prompt)]).all()  # the last prompt query read everything
        after = reads[:, len(prompt):].sum(-1)  # then 8 kept + one more each decoding step
        assert (after == 8 + np.arange(1, after.shape[1] + 1)).all()


# --- Plugins ---------------------------------------------------------------------------------------------

def test_a_plugin_module_adds_its_policy_everywhere(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples"))
    try:
        assert load_plugins("vnorm_plugin") == ["vnorm_plugin"]
        policy = parse_spec("vnorm:budget=6")
        assert policy.spec() == "vnorm:budget=6" and "vnorm" in POLICIES
        from viz.colors import family_colors
        assert "vnorm" in family_colors()
    finally:
        POLICIES.pop("vnorm", None)


@pytest.mark.slow
def test_plugins_are_named_by_the_operator_and_a_bad_one_is_a_one_line_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "docs" / "examples"), "KVLENS_PLUGINS": "vnorm_plugin"}
    listed = subprocess.run([sys.executable, "-m", "backend", "policies"], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=120)
    assert listed.returncode == 0 and "| `vnorm` |" in listed.stdout
    env["KVLENS_PLUGINS"] = "no_such_module_here"
    bad = subprocess.run([sys.executable, "-m", "backend", "policies"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "could not import no_such_module_here" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    with pytest.raises(PluginError, match="not a module name"):
        load_plugins("os; rm -rf /")


def test_every_view_renders_the_compression_policies_and_the_summary_names_their_schedule(tiny, tmp_path,
                                                                                          monkeypatch):
    import app
    from backend import api
    from backend.engine.models import DEFAULT_MODEL
    from backend.traces.store import TraceStore

    monkeypatch.setitem(models.LOADED, DEFAULT_MODEL, tiny)
    monkeypatch.setattr(app, "STORE", TraceStore(tmp_path / "store"))
    specs = ["snapkv:budget=8,window=2", "pyramidkv:budget=8", "adakv:budget=8,scorer=knorm", "knorm:budget=8"]
    run = api.run(api.RunRequest(prompt="the cat sat on the mat and the dog sat on the log", specs=specs,
                                             max_new_tokens=4), app.STORE)
    shown, *others = app.render_run(run.run_id)
    assert all(f'data-policy="{s}"' in shown for s in specs) and all(o is not None for o in others)
    summary = app.panels.summary_table(app.load_run(run.run_id).run)  # the numbers the page shows under the answers
    assert list(summary["Policy"]) == specs and all(f">{d}<" in shown for d in summary["Decides"])
    assert all(d.startswith("once after the prompt") for d in summary["Decides"])
    assert list(summary["Budget shared"]) == ["uniform", "pyramid across layers", "head-adaptive", "uniform"]
    heatmap, reach, reach_distance, kept, curves, steps, row, _forms = app.render_views(run.run_id, "all", "all", 10, 0.3)
    panels = [trace for trace in heatmap.data if trace.type == "heatmap"]
    assert len(panels) == 4 and all(f"{s}" in kept for s in specs)
    assert app.on_tsne(run.run_id, "snapkv", "1", "0").data


def test_the_schedule_is_said_for_the_mode_a_trace_ran_in():
    policy = SnapKV(budget=8, window=2, every=16)
    assert policy.schedule("generate") == "once after the prompt, then every 16 decoding steps"
    assert policy.schedule("prompt") == "every 32 tokens"
    assert parse_spec("tova").schedule("prompt") == "every step"


def test_snapkv_order_pools_the_groups_mean_or_each_query_head_then_the_mean():
    # One KV head, two query heads, one window query (the last token), 6 cached tokens, kernel 3, max.
    # g0 attends 1.0 to token 1, g1 1.0 to token 3. Pool each, then mean: token 2 sees both peaks (1.0),
    # tokens 0, 1, 3, 4 one of them (0.5). Mean first (0.5 at 1 and 3), then pool: 0.5 at 0..4 alike.
    heads = np.zeros((1, 2, 1, 6))
    heads[0, 0, 0, 1] = heads[0, 1, 0, 3] = 1.0
    v = view(6, attn_window=heads.mean(1))
    v.attn_window_heads = heads
    pool_mean = SnapKV(budget=2, window=1, kernel=3, order="pool-mean").score(v)[0, :5]
    mean_pool = SnapKV(budget=2, window=1, kernel=3).score(v)[0, :5]
    np.testing.assert_allclose(pool_mean, [0.5, 0.5, 1.0, 0.5, 0.5])
    np.testing.assert_allclose(mean_pool, [0.5, 0.5, 0.5, 0.5, 0.5])
    assert np.flatnonzero(SnapKV(budget=2, window=1, kernel=3, order="pool-mean").keep(v)[0]).tolist() == [2, 5]
    # Average pooling is linear: the two orders agree.
    np.testing.assert_allclose(SnapKV(budget=2, window=1, kernel=3, pooling="avg", order="pool-mean").score(v),
                               SnapKV(budget=2, window=1, kernel=3, pooling="avg").score(v))
    assert SnapKV(budget=16, order="pool-mean").window_by_query_head and not SnapKV(budget=16).window_by_query_head


def test_snapkv_preset_kvpress_takes_kvpress_settings_and_parameters_beside_it_override():
    policy = parse_spec("snapkv:budget=128,preset=kvpress")
    assert (policy.window, policy.kernel, policy.pooling, policy.order) == (64, 5, "avg", "pool-mean")
    policy = parse_spec("snapkv:budget=40,preset=kvpress,window=8")
    assert (policy.window, policy.kernel, policy.pooling, policy.order) == (8, 5, "avg", "pool-mean")
    assert parse_spec(policy.spec()) == policy  # the spec prints every parameter, so it parses back
    for bad in ("snapkv:preset=nope", "snapkv:preset=kvpress,preset=kvpress", "tova:preset=kvpress"):
        with pytest.raises(ValueError, match="preset") as err:
            parse_spec(bad)
        assert "\n" not in str(err.value)


def test_snapkv_pool_mean_in_the_engine_is_kvpress_scoring_on_each_query_heads_own_attention(tiny, text_ids):
    # Independently, as kvpress's SnapKVPress.score: the eager attention of the last `window` prompt queries,
    # per query head, mean over the queries, max-pooled over the tokens before the window, mean over the
    # group; the best budget - window of them and the window stay.
    import copy

    import torch

    prompt, budget, window, kernel = text_ids[:30], 10, 3, 3
    policy = SnapKV(budget=budget, window=window, kernel=kernel, order="pool-mean")
    (trace,), _ = compute_traces(tiny, ["s"], [policy], prompt, mode="generate", max_new_tokens=1, record_layers=())
    eager = copy.deepcopy(tiny.model)
    eager.config._attn_implementation = "eager"
    with torch.no_grad():
        attentions = eager(torch.tensor([prompt]), output_attentions=True).attentions
    n, group = len(prompt), tiny.n_heads // tiny.n_kv_heads
    for layer, attn in enumerate(attentions):
        votes = attn[0, :, n - window:, : n - window].double().mean(1).numpy()  # [H_q, n - window]
        score = pool(votes, kernel, "max").reshape(tiny.n_kv_heads, group, -1).mean(1)
        for head in range(tiny.n_kv_heads):
            best = np.argsort(-score[head], kind="stable")[: budget - window]
            expected = sorted(best.tolist()) + list(range(n - window, n))
            assert np.flatnonzero(trace.evicted_at[layer, head, :n] == -1).tolist() == expected, (layer, head)


def test_keydiff_keeps_the_keys_least_like_the_mean_unit_key():
    """One head, keys (2, 0), (1, 0.1), (3, 0.2), (0, 1): unit keys (1, 0), (0.995, 0.0995), (0.998, 0.0665),
    (0, 1); their mean (0.7482, 0.2915) points at 21.3 degrees, so the cosines are 0.932, 0.963, 0.954, 0.363:
    the lone (0, 1) scores highest, then (2, 0); the scale of a key does not matter, only its direction."""
    from backend.policies import KeyDiff

    keys = np.array([[[2.0, 0.0], [1.0, 0.1], [3.0, 0.2], [0.0, 1.0]]])
    scores = KeyDiff(budget=2).score(view(4, keys=keys))
    np.testing.assert_allclose(-scores[0], [0.932, 0.963, 0.954, 0.363], atol=1e-3)
    assert KeyDiff(budget=2).keep(view(4, keys=keys))[0].tolist() == [True, False, False, True]
    # A token no longer held does not pull the anchor: without (1, 0.1) and (3, 0.2) the mean is (0.5, 0.5).
    held = np.array([[True, False, False, True]])
    np.testing.assert_allclose(-KeyDiff(budget=2).score(view(4, keys=keys, kept=held))[0, [0, 3]],
                               [2 ** -0.5, 2 ** -0.5])


def test_chunkkv_keeps_whole_chunks_counted_from_the_first_token_the_last_one_short():
    """Knorm's scores (-|k|) of 7 tokens in chunks of 3: [0-2] norms 1, [3-5] norms 5, [6] norm 0.5 (a chunk of
    one). Chunk means -1, -5, -0.5; kvpress's count is the share budget / 7 of the 3 chunks, the paper's
    budget // 3 chunks; at least one either way."""
    from backend.policies import ChunkKV

    norms = np.array([1, 1, 1, 5, 5, 5, 0.5])
    keys = np.stack([norms, 0 * norms], -1)[None]
    share = ChunkKV(budget=3, chunk=3, scorer="knorm", count="share")
    assert share.keep(view(7, keys=keys))[0].tolist() == [False] * 6 + [True]  # int(3 * 3 / 7) = 1 chunk
    assert ChunkKV(budget=5, chunk=3, scorer="knorm", count="share").keep(view(7, keys=keys))[0].tolist() == \
        [True, True, True, False, False, False, True]  # int(3 * 5 / 7) = 2 chunks: [6], then [0-2]
    assert ChunkKV(budget=5, chunk=3, scorer="knorm").keep(view(7, keys=keys))[0].tolist() == \
        [False] * 6 + [True]  # 5 // 3 = 1 chunk: never more tokens than the budget
    assert ChunkKV.for_budget(8).chunk == 4 and ChunkKV.for_budget(64).chunk == 20
    # Two heads: the chunks are the layer's, scored by the sum over the heads, the same for both.
    two = np.stack([keys[0], np.stack([[0.1, 0.1, 0.1, 0.2, 0.2, 0.2, 9.0], np.zeros(7)], -1)])
    kept = ChunkKV(budget=3, chunk=3, scorer="knorm", count="share").keep(view(7, heads=2, keys=two))
    assert kept.tolist() == [[True, True, True, False, False, False, False]] * 2  # sums: -1.1, -5.2, -9.5
    assert ChunkKV(budget=8, chunk=3, scorer="knorm").keep(view(7, keys=keys)).all()  # fits: all kept
    with pytest.raises(ValueError, match="chunk"):
        ChunkKV(budget=8, chunk=0)
    with pytest.raises(ValueError, match="count"):
        ChunkKV(budget=8, count="some")


def test_lagkv_scores_each_partition_against_the_next_ones_range():
    """Sinks 1, lag 2, 7 cached tokens of one channel pair: partitions [1, 2] and [3, 4] are scored, [5, 6] is
    the last (kept, as the sink). Partition [1, 2] against [3, 4]'s range: keys (0, 0) and (10, 5) against
    min (2, 2) max (4, 6) scale to (-1, -0.5) and (4, 0.75); their spreads (sample std) 0.354 and 2.298, so token 2
    ranks above token 1; [3, 4] against [5, 6]'s min (0, 0) max (5, 3): (0.4, 2) and (0.8, 0.667), spreads 1.131
    and 0.094, token 3 first. Values alike. Rank / lag: 0 or 0.5."""
    from backend.policies import LagKV

    keys = np.array([[[9, 9], [0, 0], [10, 5], [2, 6], [4, 2], [0, 3], [5, 0]]], float)
    scores = LagKV(budget=5, sinks=1, lag=2).score(view(7, keys=keys, values=keys))[0]
    np.testing.assert_allclose(scores, [1, 0, 0.5, 0.5, 0, 1, 1])
    # Too short to partition (fewer than sinks + 2 lags): the sinks, then the latest tokens first.
    short = LagKV(budget=2, sinks=1, lag=4).score(view(7, keys=keys, values=keys))[0]
    np.testing.assert_allclose(short, [1, 0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6])
    assert LagKV(budget=3, sinks=1, lag=4).keep(view(7, keys=keys, values=keys))[0].tolist() == \
        [True, False, False, False, False, True, True]


def test_cur_keeps_the_sinks_then_the_largest_local_leverage_of_keys_times_values():
    from backend.policies.cur import CUR, local_leverage

    # Squared norms 1 3 | 2 2 | 4 in windows of 2: shares .25 .75 | .5 .5 | 1 (the last window has one token).
    np.testing.assert_allclose(local_leverage(np.array([1.0, 3, 2, 2, 4]), 2), [0.25, 0.75, 0.5, 0.5, 1.0])
    keys = np.array([[[1.0, 0], [1, 1], [2, 0], [0, 1], [1, 0], [3, 0]]])  # squared norms 1 2 4 1 1 9
    values = np.ones((1, 6, 2))  # equal: the values' leverage is 1/w everywhere, so the keys' decides
    view = CacheView(t=5, n_prompt=6, layer=0, n_layers=1, attn_window=np.zeros((1, 0, 6)), keys=keys, values=values,
                     kept=np.ones((1, 6), bool))
    # One sink (token 0), windows of 3: keys' shares 1/7 2/7 4/7 | 1/11 1/11 9/11 -> budget 3 keeps 0, 5 and 2.
    np.testing.assert_array_equal(CUR(budget=3, sinks=1, local=3).keep(view), [[True, False, True, False, False, True]])
    # The whole cache as one neighbourhood (local=0): squared norms 2 < 4 < 9 -> 0 (the sink), 2 and 5 still.
    score = CUR(budget=3, sinks=1, local=0, leverage="key").score(view)
    assert score[0, 0] == np.inf and np.argsort(-score[0, 1:])[:2].tolist() == [4, 1]
    with pytest.raises(ValueError, match="leverage"):
        CUR(leverage="keys")


def test_leverage_keeps_the_keys_of_largest_statistical_leverage():
    from backend.policies import Leverage

    # Centred keys (3, 0) (-1, 1) (-1, -1) (-1, 0): X^T X = diag(12, 2), so the hat matrix's diagonal is x^2 / 12 +
    # y^2 / 2 = .75, .583, .583, .083, summing to the rank, 2. A sketch of 48 columns keeps X's column space, and
    # the solve's jitter (0.01) moves the scores by well under 2%.
    keys = np.array([[[3.0, 0], [-1, 1], [-1, -1], [-1, 0]]])
    view = CacheView(t=3, n_prompt=4, layer=0, n_layers=1, attn_window=np.zeros((1, 0, 4)), keys=keys,
                     values=np.ones((1, 4, 2)), kept=np.ones((1, 4), bool))
    score = Leverage(budget=1).score(view)
    np.testing.assert_allclose(score, [[0.75, 7 / 12, 7 / 12, 1 / 12]], rtol=2e-2)
    np.testing.assert_array_equal(Leverage(budget=1).keep(view), [[True, False, False, False]])
    np.testing.assert_array_equal(Leverage(budget=3).keep(view), [[True, True, True, False]])
    # Every draw of the sketch gives the same leverages: a sketch wider than the keys loses nothing.
    np.testing.assert_allclose(Leverage(budget=1, seed=7).score(view), score, rtol=2e-2)


def test_simlayerkv_keeps_the_first_and_latest_tokens_of_a_lazy_layer_and_everything_of_a_busy_one():
    from backend.policies.simlayerkv import SimLayerKV

    def view(row):
        return CacheView(t=7, n_prompt=8, layer=0, n_layers=1, attn_window=np.array([[row]]), keys=np.ones((1, 8, 2)),
                         values=np.ones((1, 8, 2)), kept=np.ones((1, 8), bool))

    # Budget 4, one sink: the last query (7) decides by its attention on token 0 and the 3 before it (4-6), its own
    # left out (kvpress); a lazy layer keeps token 0 and the latest 3 (5-7).
    policy = SimLayerKV(budget=4, sinks=1, threshold=0.9)
    lazy = view([0.5, 0.01, 0.01, 0.01, 0.15, 0.15, 0.15, 0.02])  # .5 + .45 = .95: lazy
    np.testing.assert_array_equal(policy.keep(lazy), [[True, False, False, False, False, True, True, True]])
    busy = view([0.4, 0.1, 0.05, 0.05, 0.15, 0.15, 0.05, 0.05])  # .4 + .35 = .75: it reads the middle, keeps it all
    assert policy.keep(busy).all() and not policy.lazy(busy) and policy.lazy(lazy)
    selfish = view([0.5, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.44])  # its own token is not the recent tokens'
    assert not policy.lazy(selfish)
    assert not SimLayerKV(budget=4, sinks=1, threshold=1.0).lazy(lazy)  # kvpress's default: never lazy


def test_criticalkv_fills_half_its_budget_from_the_scorer_then_weighs_scores_by_projected_values():
    from backend.policies.criticalkv import CriticalKV, projected_norms

    # One KV head, two query heads of size 1, hidden 2: W_o's columns (1, 0) and (0, 2) -> a value v projects to
    # (v, 0) and (0, 2v): L1 norms |v| and 2|v|, mean 1.5|v|.
    output = np.array([[1.0, 0.0], [0.0, 2.0]])
    np.testing.assert_allclose(projected_norms(np.array([[[1.0], [-2.0]]]), output, group=2), [[1.5, 3.0]])
    # Knorm as the scorer (scores -|k|), budget 4, first 0.5: its best two (the smallest keys, 0 and 1) stay; of the
    # rest, (score + epsilon) x 1.5|v| decides: token 5 (-5 x 0.15 = -0.75) and 2 (-2 x 1.5) beat 3 (-9) and 4 (-12),
    # where Knorm alone keeps the four smallest keys.
    keys = np.array([[[0.5], [1.0], [2.0], [3.0], [4.0], [5.0]]])
    values = np.array([[[1.0], [1.0], [1.0], [2.0], [2.0], [0.1]]])
    view = CacheView(t=5, n_prompt=6, layer=0, n_layers=1, attn_window=np.zeros((1, 0, 6)), keys=keys, values=values,
                     kept=np.ones((1, 6), bool), output=output)
    policy = CriticalKV(budget=4, scorer="knorm", epsilon=0.0)
    np.testing.assert_array_equal(policy.keep(view), [[True, True, True, False, False, True]])
    np.testing.assert_array_equal(Knorm(budget=4).keep(view), [[True, True, True, True, False, False]])
    with pytest.raises(ValueError, match="output projection"):
        policy.keep(CacheView(t=5, n_prompt=6, layer=0, n_layers=1, attn_window=np.zeros((1, 0, 6)), keys=keys,
                              values=values, kept=np.ones((1, 6), bool)))


def test_compactor_blends_key_leverage_and_chunked_attention_as_written_out():
    import torch

    from backend.policies.compactor import chunked_attention, leverage, sketch

    # Chunked, non-causal attention: 3 tokens in chunks of 2, one head, queries = keys = e1, e1, e2 (unscaled dots).
    # Chunk 1 (tokens 0, 1): each query reads both alike -> 1 each. Chunk 2 (token 2 and a pad): masked, it reads
    # itself only -> 1; as kvpress, the pad key (logit ~0) takes e^0 of each softmax and the pad query reads both.
    x = torch.tensor([[[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]]])
    np.testing.assert_allclose(chunked_attention(x, x, 2)[0, 0], [1.0, 1.0, 1.0], atol=1e-6)
    e = np.e
    padded = e / (e + 1) + 0.5  # token 2's own query (e^1 against the pad's e^0), and the pad query's half
    np.testing.assert_allclose(chunked_attention(x, x, 2, "kvpress")[0, 0], [1.0, 1.0, padded], atol=1e-6)
    # Leverage: the diagonal of X (X^T X + 0.01 I)^-1 X^T of the centred, sketched keys, written out.
    keys = torch.randn(1, 1, 6, 4, generator=torch.Generator().manual_seed(1))
    phi = sketch(0, 0, 1, 4, 3)
    centred = ((keys - keys.mean(-2, keepdim=True)) @ phi)[0, 0].double().numpy()
    hat = centred @ np.linalg.inv(centred.T @ centred + 0.01 * np.eye(3)) @ centred.T
    np.testing.assert_allclose(leverage(keys, phi)[0, 0].numpy(), np.clip(np.diag(hat), 0, None), rtol=1e-4)
    # The layers draw in turn from one generator seeded once, as one seeded prefill of kvpress's does.
    draws = torch.Generator().manual_seed(7)
    first, second = (torch.randn((1, 2, 4, 3), generator=draws) / 3 ** 0.5 for _ in range(2))
    assert torch.equal(sketch(7, 0, 2, 4, 3), first) and torch.equal(sketch(7, 1, 2, 4, 3), second)
