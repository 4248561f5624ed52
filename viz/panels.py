"""The app's views of one run: traces -> metrics (backend.analysis.metrics, pure) -> figures (viz). No Gradio.

Each function takes a ``backend.api.Run``, the view's selectors and, where a view shares a slow result with
another (the non-recent shares, the POS table, a t-SNE embedding), that result; it returns what one component
of the page shows and changes none of its inputs. The app keeps the slow results per run and passes them in;
left out, they are computed. Layer and head selectors are strings: ``"all"`` or an index. Nothing here builds
a [T, T] array: at 8k tokens masks are binned or windowed (``backend/analysis/reads.py``), score curves follow
a few tokens, and the text view shows a window around the step.
"""
from __future__ import annotations

import dataclasses
import html
import math
import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from backend.analysis import forms, metrics, pos, reach, reads
from backend.analysis.evidence import run_evidence
from backend.policies import policy_of
from backend.traces.trace import Trace

from .colors import policy_colors
from .continuation import continuation_cell
from .curves import score_curves_figure, score_over_steps_figure
from .forms import forms_figure
from .divergence import SUMMARY_COLUMNS, divergence_figure, divergence_notes, summary_table as summary_frame
from .heatmap import evidence_cells, mark_columns, mark_row, mark_window, mask_heatmaps
from .highlight import MAX_OUTSIDE, WINDOW, continuations_html, kept_tokens_html, text_window
from .reach import distance_figure, reach_figure
from .retention import first_token_retention_figure, lifetime_by_position_figure, non_recent_share_figure, pos_table
from .step_row import step_row_figure
from .story import StoryRow, story_html
from .sweep import sweep_figure as sweep_plot
from .tsne import tsne_figure

ORACLE_COLUMN = "Similarity to oracle"
# The columns of every run's summary, and the headers the page shows before its first run (an oracle, a second
# pass and generate mode add theirs).
RUN_COLUMNS = ("Token 0 kept", "Non-recent share", "Decides", "Budget shared")
SUMMARY_HEADERS = (*(c for c in SUMMARY_COLUMNS if c != ORACLE_COLUMN), *RUN_COLUMNS)

STOP_TOKEN = re.compile(r"(<\|[a-z_]+\|>|<eos>|<end_of_turn>|</s>)\s*$")  # a chat's end-of-turn, not the answer
TSNE_POINTS = 512  # keys a t-SNE map embeds: both maps take 1-2.6 s at 512 on two cores, 4x that at 1024

ZOOM_SIZES = (64, 128, 256)  # a zoom window's side in tokens: six 256 x 256 panels are ~2.3 MB of JSON
# Play's kept-tokens frames: tokens shown in full around the step, and far kept tokens (~200 kB at 8k, 4 policies).
PLAY_WINDOW, PLAY_FAR = 128, 128
ROW_CELLS = 512  # cells of the masks' row at one step (Play redraws it at every step: a few kB each)
# Play's speeds: steps per tick, or "auto": the whole text in about PLAY_TICKS ticks, whatever its length.
PLAY_SPEEDS = (("the whole text in ~30 s", "auto"), ("1 step per tick", "1"), ("4 steps", "4"),
               ("16 steps", "16"), ("64 steps", "64"))
PLAY_TICKS = 60


def zoom_window(run, zoom: bool, first_step, first_pos, size) -> tuple[int, int, int] | None:
    """The zoom controls as ``(first step, first position, size)``, inside the text; None when zoom is off."""
    if not zoom:
        return None
    n = len(run.traces[0].tokens)
    size = _whole(size) if _whole(size) in ZOOM_SIZES else ZOOM_SIZES[-1]

    def start(value) -> int:  # a blank, malformed or out-of-range box still shows a full window
        return int(min(max(_whole(value), 0), max(0, n - size)))

    return start(first_step), start(first_pos), size


def _whole(value) -> int:
    """A control's value as an int; 0 for blanks and for what the API may send instead (nan, inf, text)."""
    try:
        number = float(value or 0)
    except (TypeError, ValueError):
        return 0
    return int(number) if math.isfinite(number) else 0


def layer_choices(n_layers: int = 30) -> list[str]:
    return ["all", *map(str, range(n_layers))]


def head_choices(n_kv_heads: int = 3) -> list[str]:
    return ["all", *map(str, range(n_kv_heads))]


def clamp_step(run, step) -> int:
    n = len(run.traces[0].tokens)
    return n - 1 if step is None else int(min(max(int(step), 0), n - 1))


def play_stride(run, speed) -> int:
    """Steps Play moves on per tick at ``speed`` (one of ``PLAY_SPEEDS``' values; anything else is "auto")."""
    n = len(run.traces[0].tokens)
    chosen = _whole(speed) if str(speed).isdigit() else 0
    return min(chosen, n) if chosen >= 1 else max(1, math.ceil(n / PLAY_TICKS))


def _budget(trace: Trace) -> int | None:
    return trace.meta["params"].get("budget")


def _chosen(trace: Trace, layer: str, head: str) -> tuple[list[int], list[int]]:
    """The layers and KV heads a selector pair names."""
    layers = list(range(trace.meta["n_layers"])) if layer == "all" else [int(layer)]
    heads = list(range(trace.meta["n_kv_heads"])) if head == "all" else [int(head)]
    return layers, heads


def _recorded(trace: Trace, layers: list[int], heads: list[int]) -> int | None:
    """The recorded-layer index when one layer and head are chosen and that layer's attention was kept."""
    if trace.attention is None or len(layers) * len(heads) != 1 or layers[0] not in trace.meta["recorded_layers"]:
        return None
    return trace.meta["recorded_layers"].index(layers[0])


def _mask_panel(trace: Trace, layer: str, head: str, zoom: tuple[int, int, int] | None) -> dict:
    """One heatmap panel: the whole text (binned when longer than ``reads.MAX_BINS``) or a zoom window."""
    layers, heads = _chosen(trace, layer, head)
    r, n = _recorded(trace, layers, heads), len(trace.tokens)
    size = reads.bin_size(n)
    if zoom is None and size > 1:
        attention = None if r is None else reads.binned_attention(trace, layers[0], heads[0], size)
        return dict(reads=reads.binned_reads(trace, layers, heads, size), attention=attention, size=size)
    first_step, first_pos, cells = (0, 0, n) if zoom is None else zoom
    steps = slice(min(first_step, n - 1), min(first_step + cells, n))
    positions = slice(min(first_pos, n - 1), min(first_pos + cells, n))
    attention = None if r is None else trace.attention.rows(r, heads[0], steps, positions)
    return dict(reads=reads.window_reads(trace, layers, heads, steps, positions), attention=attention,
                first_step=steps.start, first_pos=positions.start)


def _nearest_recorded(trace: Trace, layer: str) -> int:
    recorded = trace.meta["recorded_layers"]
    if not recorded:
        raise ValueError("this run recorded no layer's attention")
    if layer == "all":
        return recorded[-1]
    return min(recorded, key=lambda r: abs(r - int(layer)))


def summary_table(run, shares: dict[str, np.ndarray] | None = None) -> pd.DataFrame:
    """Per policy: perplexity, KL and top-1 agreement vs Full, similarity to the oracle's masks (when an
    oracle ran on the same tokens), how long token 0 stayed (TOVA Fig. 8), the non-recent share of
    what was read (TOVA Sec. 6.1; ``shares`` from ``non_recent_shares``), when a policy makes one, the
    tokens of its second pass (KVzip) and, in generate mode, its continuation (Full's on Full's row)."""
    shares = non_recent_shares(run) if shares is None else shares
    oracle = next((t for t in run.traces if t.meta["policy"] == "oracle"), None)
    rows, first_token, non_recent = [], [], []
    for trace in run.traces:
        row = {"policy": trace.spec, **metrics.summary_row(trace, run.full)}
        budget = _budget(trace)
        if oracle is not None and np.array_equal(trace.tokens, oracle.tokens) and budget:
            row["oracle_similarity"] = metrics.mask_similarity(trace, oracle, from_step=min(
                budget, len(trace.tokens) - 1))["overall"]
        rows.append(row)
        first_token.append(f"{metrics.first_token_retention(trace)[:, 0].mean():.0%}")
        share = shares.get(trace.spec)  # per layer; overall = mean over layers
        non_recent.append("—" if share is None else f"{share.mean():.0%}")
    frame = summary_frame(rows)
    if oracle is None:  # a column of dashes only pushes the others out of view
        frame = frame.drop(columns=ORACLE_COLUMN)
    policies = [policy_of(t.meta) for t in run.traces]
    decides = [p.schedule(t.meta["mode"]) if p else "—" for p, t in zip(policies, run.traces)]
    shared = [p.allocation if p and p.kind != "full" else "—" for p in policies]
    for column, values in zip(RUN_COLUMNS, (first_token, non_recent, decides, shared)):
        frame[column] = values
    if any("extra_pass_tokens" in t.meta for t in run.traces):  # a policy's own second pass (KVzip's)
        frame["Extra pass"] = [_extra_pass(t) for t in run.traces]
    if run.full.meta["mode"] == "generate":  # the answers beside the numbers that score them
        frame["Continuation"] = [continuation_cell(_continuation_texts(t)) for t in run.traces]
    return frame


def _extra_pass(trace: Trace) -> str:
    """The tokens a policy fed through the model besides the text, and how many times the prompt that is."""
    extra = trace.meta.get("extra_pass_tokens")
    if extra is None:
        return "—"
    read = "prompt" if trace.meta["mode"] == "generate" else "text"
    return f"{extra:,} tokens ({extra / trace.meta['n_prompt']:.1f}x the {read})"


def heatmaps(run, layer: str, head: str, zoom: tuple[int, int, int] | None = None,
             step: int | None = None) -> go.Figure:
    """One panel per policy: the whole text, or with ``zoom = (first step, first position, size)`` that window
    of steps x positions at one token per cell; a line marks the row of ``step`` when it is shown."""
    panels = {t.spec: dict(_mask_panel(t, layer, head, zoom), token_texts=t.meta["token_texts"]) for t in run.traces}
    where = f"layer {layer}" if layer != "all" else "all layers"
    who = f"KV head {head}" if head != "all" else "all KV heads"
    window = ""
    if zoom is not None:
        first = next(iter(panels.values()))
        rows, cols = first["reads"].shape
        window = (f", steps {first['first_step']}–{first['first_step'] + rows - 1} x positions "
                  f"{first['first_pos']}–{first['first_pos'] + cols - 1}")
    model_window, note = _model_window(run.full, layer)
    fig = mask_heatmaps(panels, title=f"What each query read ({where}, {who}{window}){note}",
                        colors=policy_colors([t.spec for t in run.traces]))
    first = next(iter(panels.values()))
    if model_window is not None:
        size, n = first.get("size", 1), max(len(t.tokens) for t in run.traces)
        rows, cols = first["reads"].shape
        first_step, first_pos = first.get("first_step", 0), first.get("first_pos", 0)
        mark_window(fig, model_window, (first_step, min(first_step + rows * size, n) - 1),
                    (first_pos, min(first_pos + cols * size, n) - 1), size)
    row = None if step is None else (int(step) - first.get("first_step", 0)) // first.get("size", 1)
    if row is not None and 0 <= row < first["reads"].shape[0]:
        mark_row(fig, row)
    evidence = evidence_positions(run)
    if evidence is not None:
        mark_columns(fig, evidence_cells(evidence, first.get("first_pos", 0), first.get("size", 1),
                                         first["reads"].shape[1]))
    return fig


def _model_window(trace: Trace, layer: str) -> tuple[int | None, str]:
    """The model's own sliding window on the chosen layer(s), and the line the masks' title says of it."""
    windows = trace.meta.get("layer_windows") or []
    chosen = windows if layer == "all" else windows[int(layer):int(layer) + 1]
    sliding = [w for w in chosen if w is not None]
    if not sliding:
        return None, ""
    where = "" if layer != "all" else f" in {len(sliding)} of {len(windows)} layers"
    return max(sliding), f" · dashed: the model's own window, {max(sliding):,} keys{where}"


def evidence_positions(run) -> np.ndarray | None:
    """Token positions of the evidence the run names (``RunRequest.evidence``: a task sample's references, a
    user's strings), None when it names none."""
    request = getattr(run, "request", None)
    found = run_evidence(run.full, getattr(request, "evidence", None) or [], getattr(request, "evidence_end", None))
    return None if found is None else found.positions


def kept_tokens(run, step: int, layer: str, head: str, window: int = WINDOW, far: int = MAX_OUTSIDE) -> str:
    """Each policy's text at ``step``: ``window`` tokens around it in full and, further away, the ``far`` tokens
    kept most (the others counted in the gaps)."""
    parts = []
    evidence = evidence_positions(run)
    for trace in run.traces:
        at = min(step, len(trace.tokens) - 1)
        layers, heads = _chosen(trace, layer, head)
        kept = reads.read_share_at(trace, layers, heads, at)
        r = _recorded(trace, layers, heads)
        weights = None if r is None else trace.attention.rows(r, heads[0], slice(at, at + 1))[0]
        parts.append(kept_tokens_html(trace.meta["token_texts"], kept, at, weights=weights,
                                      title=f"{trace.spec} at step {at}",
                                      window=text_window(len(trace.tokens), at, window), max_outside=far,
                                      evidence=evidence))
    return "\n".join(parts)


def _scores(run, layer: str, head: str, alpha: float, step: int, follow: bool) -> tuple[metrics.ScoreCurves, str]:
    """Full's A2S and A2SF at ``step`` (and over the steps when ``follow``), and where they were read."""
    full = run.full
    budgets = [b for b in map(_budget, run.traces) if b]
    budget = budgets[0] if budgets else 16
    at_layer = _nearest_recorded(full, layer)
    at_head = 0 if head == "all" else int(head)
    at = min(step, len(full.tokens) - 1)
    curves = metrics.score_curves(full, at_layer, at_head, float(alpha), budget, step=at,
                                  tokens=None if follow else ())
    where = f"Full attention, layer {at_layer}, KV head {at_head}"
    if not full.attention.exact:  # long texts: the scores sum each row's largest weights only
        where += f" (top {full.attention.top_k} weights per query)"
    return curves, where


def _snapshot(run, curves: metrics.ScoreCurves, where: str) -> go.Figure:
    return score_curves_figure(curves.a2s, curves.a2sf, run.full.meta["token_texts"], curves.step, curves.keep_a2s,
                               curves.keep_a2sf, curves.alpha,
                               title=f"{where}: A2S vs A2SF (alpha={curves.alpha:g}) at step {curves.step}, "
                                     f"budget {curves.budget}")


def score_snapshot(run, layer: str, head: str, alpha: float, step: int) -> go.Figure:
    """Every token's A2S and A2SF at ``step`` alone (A2SF Fig. 1): what Play redraws at each step."""
    return _snapshot(run, *_scores(run, layer, head, alpha, step, follow=False))


def score_curves(run, layer: str, head: str, alpha: float, step: int) -> tuple[go.Figure, go.Figure]:
    """Under Full attention: every token's A2S and A2SF at ``step`` (A2SF Fig. 1), and over the steps
    for the tokens A2SF ranks highest there (Fig. 6)."""
    curves, where = _scores(run, layer, head, alpha, step, follow=True)
    at, texts = curves.step, run.full.meta["token_texts"]
    snapshot = _snapshot(run, curves, where)
    over_steps = score_over_steps_figure(curves.a2s_over_steps, curves.a2sf_over_steps, curves.tokens, texts,
                                         alpha=float(alpha), keep_a2s=curves.kept_a2s_over_steps,
                                         keep_a2sf=curves.kept_a2sf_over_steps,
                                         title=f"{where}: scores over the steps of the {len(curves.tokens)} tokens "
                                               f"A2SF ranks highest at step {at}")
    return snapshot, over_steps


def cache_reach(run, step: int) -> tuple[go.Figure, go.Figure]:
    """What the query at ``step`` reads in every layer and KV head of each policy (the model's own window
    apart), and over the whole text the share of (query, token) pairs read by distance back from the query."""
    at = min(clamp_step(run, step), min(len(t.tokens) for t in run.traces) - 1)
    reaches = {t.spec: reach.reach_at(t, at) for t in run.traces}
    first = next(iter(reaches.values()))
    colors = policy_colors(list(reaches))
    shown = {t.spec: dict(shares=reaches[t.spec].shares, beyond_window=reaches[t.spec].beyond_window,
                          token_texts=t.meta["token_texts"]) for t in run.traces}
    picture = reach_figure(shown, first.labels, at, first.size, colors=colors)
    evidence = evidence_positions(run)
    if evidence is not None:
        mark_columns(picture, evidence_cells(evidence, 0, first.size, first.shares.shape[1]))
    by_distance = distance_figure({t.spec: reach.share_by_distance(t) for t in run.traces}, colors=colors)
    return picture, by_distance


def held_forms(run, step: int, head: str) -> go.Figure:
    """How the keys and values the query at ``step`` reads differ from the model's own, for each policy that
    reforms what it holds (ThinK's pruned channels, KIVI's bits), per layer; the channels each head keeps."""
    panels = {}
    for trace in run.traces:
        if trace.forms:  # only a policy that reforms what it holds records them
            at = min(step, len(trace.tokens) - 1)
            panels[trace.spec] = forms.held_forms(trace, at, None if head == "all" else int(head))
    texts = max((t.meta["token_texts"] for t in run.traces), key=len)
    return forms_figure(panels, texts, "the KV heads' mean" if head == "all" else f"KV head {head}")


def step_row(run, step: int, layer: str, head: str) -> go.Figure:
    """The masks' row at ``step``: what its query reads under each policy, positions in at most ``ROW_CELLS``
    cells (the same reads as ``kept_tokens``)."""
    n = max(len(t.tokens) for t in run.traces)  # generated continuations may differ in length
    size = reads.bin_size(n, ROW_CELLS)
    rows = {}
    for trace in run.traces:
        at = min(step, len(trace.tokens) - 1)
        rows[trace.spec] = reads.binned_row(reads.read_share_at(trace, *_chosen(trace, layer, head), at), at, size)
    where = f"layer {layer}" if layer != "all" else "all layers"
    who = f"KV head {head}" if head != "all" else "all KV heads"
    return step_row_figure(rows, step, n, size, colors=policy_colors(list(rows)),
                           title=f"The masks' row at step {step}: what its query reads ({where}, {who})")


@dataclasses.dataclass(frozen=True, eq=False)
class TsneKeys:
    """The keys one t-SNE map embeds: one KV head of one recorded layer of one trace, evenly sampled."""

    trace: Trace
    layer: int
    head: int
    samples: metrics.KeySamples

    @property
    def memo_key(self) -> tuple[str, int, int]:
        """What decides the embedding: the same policy, layer and head embed the same keys."""
        return self.trace.spec, self.layer, self.head


def tsne_keys(run, policy: str, layer: str, head: str) -> TsneKeys:
    """The keys of ``policy``'s trace at the recorded layer nearest ``layer``; ValueError when it did not run."""
    trace = next((t for t in [*run.traces, run.full] if t.meta["policy"] == policy), None)
    if trace is None:
        raise ValueError(f"{policy} is not in this run")
    at_layer = _nearest_recorded(trace, layer)
    at_head = 0 if head == "all" else int(head)
    samples = metrics.key_samples(trace, at_layer, at_head)
    if len(samples.positions) > TSNE_POINTS:  # evenly spread, the first and the last included
        pick = np.unique(np.linspace(0, len(samples.positions) - 1, TSNE_POINTS).round().astype(int))
        samples = dataclasses.replace(samples, before_rope=samples.before_rope[pick],
                                      after_rope=samples.after_rope[pick], kept=samples.kept[pick],
                                      positions=samples.positions[pick])
    return TsneKeys(trace, at_layer, at_head, samples)


def tsne_embedding(keys: TsneKeys) -> tuple[np.ndarray, np.ndarray]:
    """The keys before and after RoPE in 2-D: the slow part of the view (~2 s at 512 keys)."""
    from backend.analysis.tsne import embed_keys  # scikit-learn is imported only when someone asks

    return embed_keys(keys.samples.before_rope, keys.samples.after_rope)


def tsne_map(keys: TsneKeys, embedding: tuple[np.ndarray, np.ndarray]) -> go.Figure:
    """The two maps of ``keys`` from their ``tsne_embedding``."""
    before, after = embedding
    trace, samples = keys.trace, keys.samples
    texts = trace.meta["token_texts"]
    n = len(trace.tokens)
    sampled = "" if len(samples.positions) == n else f" ({len(samples.positions)} of {n} positions, evenly spread)"
    return tsne_figure(before, after, samples.kept, [texts[p] for p in samples.positions], samples.positions,
                       title=f"{trace.spec}: keys of layer {keys.layer}, KV head {keys.head}{sampled}, "
                             f"kept at the last step")


def tsne(run, policy: str, layer: str, head: str) -> go.Figure:
    """Keys before/after RoPE of one policy, embedded afresh (the app reuses embeddings: ``tsne_map``)."""
    keys = tsne_keys(run, policy, layer, head)
    return tsne_map(keys, tsne_embedding(keys))


def divergence(run) -> tuple[go.Figure, str]:
    series = {t.spec: {"kl": metrics.kl_per_step(t), "top1": metrics.top1_match_per_step(t, run.full)}
              for t in run.traces}
    figure = divergence_figure(series, colors=policy_colors(list(series)))
    notes = divergence_notes(list(series))  # e.g. what StreamingLLM's re-rotation changes from sinks
    if run.full.generated_ids is None:
        return figure, notes + ("<p>Teacher-forced scoring: every policy reads the same text, so there are no "
                                "continuations.</p>")
    rows = [{"policy": "full", "tokens": _continuation_texts(run.full), "diverge": None}]
    rows += [{"policy": t.spec, "tokens": _continuation_texts(t), "diverge": metrics.first_divergence(t, run.full)}
             for t in run.traces]
    return figure, notes + continuations_html(rows)


def non_recent_shares(run) -> dict[str, np.ndarray]:
    """Per compressing policy whose budget is shorter than the text: the non-recent share per layer (the
    summary table and the retention view both show it)."""
    return {t.spec: metrics.non_recent_share(t)["per_layer"] for t in run.traces
            if t.meta["kind"] != "full" and _budget(t) and len(t.tokens) > _budget(t)}


def _continuation_texts(trace: Trace) -> list[str]:
    return trace.meta["token_texts"][trace.meta["n_prompt"]:]


def retention_figures(run, shares: dict[str, np.ndarray] | None = None) -> tuple[go.Figure, go.Figure, go.Figure]:
    """Token 0's retention and the non-recent share per layer (``shares`` from ``non_recent_shares``), and
    lifetime by position (TOVA Fig. 8 and Sec. 6.1)."""
    shares = non_recent_shares(run) if shares is None else shares
    compressed = [t for t in run.traces if t.meta["kind"] != "full"]
    colors = policy_colors([t.spec for t in compressed])
    first = first_token_retention_figure({t.spec: metrics.first_token_retention(t)[:, 0] for t in compressed},
                                         colors=colors, title="Share of steps token 0 stays cached, per layer")
    non_recent = non_recent_share_figure(shares, colors=colors, x_title="layer",
                                         title="Share of what each query reads that lies outside its last budget tokens")
    lifetimes = {t.spec: metrics.mean_lifetime_by_position(t) for t in compressed}
    by_position = lifetime_by_position_figure(lifetimes, colors=colors) if lifetimes else go.Figure()
    return first, non_recent, by_position


def retention(run, shares: dict[str, np.ndarray] | None = None,
              pos_lifetimes: pd.DataFrame | None = None) -> tuple[go.Figure, go.Figure, go.Figure, pd.DataFrame]:
    """The retention figures and the mean lifetime per part of speech (TOVA Tables 1 and 4;
    ``pos_lifetimes`` from ``pos_lifetime_table``)."""
    table = pos_lifetime_table(run) if pos_lifetimes is None else pos_lifetimes
    return (*retention_figures(run, shares), table)


class _SharedTagger:
    """NLTK's tagger remembering each sentence's tags: a run's policies read one text (or share its prompt)."""

    def __init__(self, tagger):
        self.tagger, self.seen = tagger, {}

    def tag(self, words: list[str]):
        key = tuple(words)
        if key not in self.seen:
            self.seen[key] = self.tagger.tag(words)
        return self.seen[key]


def pos_placeholder() -> pd.DataFrame:
    """What the part-of-speech table says before any run (rather than a grid headed 1, 2, 3)."""
    return pd.DataFrame({"note": ["Run an eviction policy to see which parts of speech it keeps."]})


def pos_lifetime_table(run) -> pd.DataFrame:
    """Mean lifetime per part of speech and eviction policy (tagging 8k tokens takes seconds), or a note
    saying why there is none."""
    evicting = [t for t in run.traces if t.evicted_at is not None]
    if not evicting:
        return pos_placeholder()
    try:
        tagger, tags = _SharedTagger(pos.load_tagger()), {}
        columns = {}
        for trace in evicting:  # the policies of a run read one text (or share its prompt): tag each text once
            texts = tuple(trace.meta["token_texts"])
            if texts not in tags:
                tags[texts] = pos.tag_tokens(list(texts), tagger)
            columns[trace.spec] = pos.pos_lifetimes(trace, tags=tags[texts]).set_index("tag")["mean_lifetime"]
        columns = {spec: col.rename(index={"\n": "\\n (line break)"}) for spec, col in columns.items()}
    except pos.TaggerUnavailable as err:
        return pd.DataFrame({"note": [str(err)]})
    return pos_table(pd.DataFrame(columns)).rename(
        columns=lambda c: c if c in ("tag", "pos") else f"{c} (mean steps kept)")


def figures_html(run, layer: str, head: str, step: int, alpha: float,
                 shares: dict[str, np.ndarray] | None = None) -> str:
    """Every figure of the run for the given selectors, in one offline HTML page (plotly.js inlined once);
    ``shares`` from ``non_recent_shares``. The POS table is no figure: an export never tags."""
    figures = [heatmaps(run, layer, head), *cache_reach(run, step), *score_curves(run, layer, head, alpha, step),
               divergence(run)[0], *retention_figures(run, shares)]
    if any(t.forms for t in run.traces):
        figures.append(held_forms(run, step, head))
    parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)]
    title = html.escape(f"KV Lens run {run.run_id[:12]}: {', '.join(t.spec for t in run.traces)}")
    return f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body><h2>{title}</h2>" + \
        "".join(parts) + "</body></html>"


def share_markdown(run) -> str:
    if not getattr(run, "stored", True):  # no link the store cannot keep
        return ("**This run is not stored here** (the trace store cannot keep it), so it has no share link; "
                "the zip below holds its traces.")
    link = f"?run={run.run_id}"
    return (f"**Share this run:** [{html.escape(link)}]({link}) reopens it from the store (add it to this page's "
            f"address).\n\nRun id: `{run.run_id}`")


def sweep_figure(table: pd.DataFrame) -> go.Figure:
    """Perplexity against budget from a sweep's table (backend.experiments.sweep): a line per policy, Full as the topline."""
    return sweep_plot(table)


def answer_step(run) -> int:
    """The query the story's strips show: in generate mode the first one after the prompt (it reads what the
    policy kept of the prompt, a compressing policy's cache included), else the text's last."""
    n = len(run.full.tokens)
    return min(int(run.full.meta["n_prompt"]), n - 1) if run.full.meta["mode"] == "generate" else n - 1


def summary_html(run, shares: dict[str, np.ndarray] | None = None) -> str:
    """The page's first picture: each policy's answer beside Full's and a strip of what its query read at
    ``answer_step`` (all layers and KV heads, the evidence outlined), then the summary's numbers."""
    frame = summary_table(run, shares).drop(columns=["Continuation"], errors="ignore")
    step = answer_step(run)
    n = max(len(t.tokens) for t in [run.full, *run.traces])
    size = reads.bin_size(n, ROW_CELLS)
    colors = policy_colors([t.spec for t in run.traces])
    generate = run.full.meta["mode"] == "generate"
    rows = []
    for trace in [run.full, *run.traces]:
        at = min(step, len(trace.tokens) - 1)
        share = reads.read_share_at(trace, *_chosen(trace, "all", "all"), at)
        answer = STOP_TOKEN.sub("", "".join(_continuation_texts(trace))).strip() if generate else ""
        if trace is run.full:
            note, color = "the reference", "#333333"
        else:
            diverge = metrics.first_divergence(trace, run.full) if generate else None
            note = "" if not generate else "same as Full" if diverge is None else f"leaves Full at token {diverge}"
            color = colors.get(trace.spec, "#444444")
        rows.append(StoryRow(trace.spec, color, answer, note, reads.binned_row(share, at, size)))
    evidence = evidence_positions(run)
    cells = [] if evidence is None else evidence_cells(evidence, 0, size, -(-n // size))
    caption = (f"What its query read at step {step}" + (" (the answer's first)" if generate else "")
               + (f", {size} tokens a cell" if size > 1 else ""))
    return story_html(rows, caption, cells, frame)
