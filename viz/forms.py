"""Held forms: what a policy that reforms its held tokens (ThinK, KIVI, CaM) did to the keys and values a query reads.

``forms_figure`` draws, per reforming policy, the query's keys' and values' relative error against the model's own
(rows = layers, columns = bins of positions 0..step; white = held whole, grey = nothing held there); for a
channel-pruning policy, which key channels each (layer, KV head) keeps (rows = 'L12 H1', columns = channels) with
what the pruning cost the logits in the hover; for a merging policy, the share of each column's evicted tokens whose
value went into held ones (the values' error shows where); how far each query's attention moved, reading the held
forms instead of the same tokens as computed (rows = layers, columns = bins of queries; the output's error in the
hover); and, where no channel is pruned, each key and value channel's error (rows = 'L12 H1', columns = channels:
KIVI rounds keys per channel, values per token). Inputs are ``backend.analysis.forms.HeldForms``: a few hundred
columns, whatever the length.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .colors import EVICTED_COLOR, KEPT_COLOR
from .style import finish, plotly_text, token_labels

ERROR_AXIS = "coloraxis"
ERROR_SCALE = ((0.0, "#FFFFFF"), (0.1, "#FDE0C5"), (0.4, "#F59E72"), (1.0, "#7F1D1D"))
MERGED_COLOR = "#997700"
PANEL_HEIGHT = 230
NOTHING = ("None of these policies changes the form of what it holds: each token is read as the model computed it, "
           "or not at all. ThinK prunes key channels, KIVI rounds keys and values to fewer bits, CaM merges evicted values "
           "into held ones, FINCH re-rotates the keys it keeps.")


def empty_forms_figure(message: str = NOTHING) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=plotly_text(message), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return finish(fig, "Held forms", height=200)


def forms_figure(panels: Mapping[str, object], token_texts: Sequence[str], head_label: str = "the KV heads' mean"
                 ) -> go.Figure:
    """One group of panels per reforming policy (``panels``: spec -> HeldForms): the keys' error, the values'
    error where any value changed, and the channels kept where the policy prunes channels."""
    if not panels:
        return empty_forms_figure()
    rows: list[tuple[str, str, object]] = []
    for spec, forms in panels.items():
        # The keys' and values' errors where any changed (CaM's keys never do), the keys' when nothing has yet.
        own = [(spec, what, forms) for what, error in (("key", forms.key_error), ("value", forms.value_error))
               if np.nan_to_num(error).any()]
        if forms.channels is not None:
            own.append((spec, "channels", forms))
        if forms.merged is not None:
            own.append((spec, "merged", forms))
        if forms.attention_shift is not None and np.nan_to_num(forms.attention_shift).any():
            own.append((spec, "attention", forms))
        elif forms.output_error is not None and np.nan_to_num(forms.output_error).any():  # values alone changed
            own.append((spec, "output", forms))
        if forms.channels is None:  # a pruned channel's error is its whole key: the kept channels say it
            own += [(spec, what, forms) for what, error in (("key channels", forms.key_channels),
                                                            ("value channels", forms.value_channels))
                    if error is not None and error.any()]
        rows += own or [(spec, "key", forms)]
    titles = []
    for spec, what, forms in rows:
        if what == "channels":
            titles.append(f"{spec}: key channels kept per layer and KV head (pruned at step {forms.channel_step})")
        elif what == "merged":
            titles.append(f"{spec}: of the tokens evicted by step {forms.step}, the share whose value was merged "
                          "into held ones (the values' error above shows where it went)")
        elif what == "attention":
            titles.append(f"{spec}: each query's attention moved by the held forms (total variation; {head_label})")
        elif what == "output":
            titles.append(f"{spec}: each query's output moved by the held values (|o' - o| / |o|; {head_label})")
        elif what.endswith("channels"):
            letter = what[0]
            titles.append(f"{spec}: each {what[:-1]}'s relative error over the held tokens "
                          f"(sum |{letter}' - {letter}| / sum |{letter}|)")
        else:
            titles.append(f"{spec}: the {what}s' relative error |{what[0]}' - {what[0]}| / |{what[0]}| "
                          f"as query {forms.step} reads them ({head_label})")
    fig = make_subplots(rows=len(rows), cols=1, subplot_titles=[plotly_text(t) for t in titles],
                        vertical_spacing=min(0.12, 0.5 / len(rows)))
    for i, (spec, what, forms) in enumerate(rows, start=1):
        if what == "channels":
            kept = forms.channels.astype(np.float32)
            hover = np.broadcast_to(np.asarray(forms.channel_error, np.float32)[:, None], kept.shape)
            fig.add_trace(go.Heatmap(
                z=kept, y=forms.channel_labels, x=list(range(kept.shape[1])), customdata=hover, showscale=False,
                colorscale=[[0.0, EVICTED_COLOR], [1.0, KEPT_COLOR]], zmin=0, zmax=1, xgap=1, name=spec,
                hovertemplate=("%{y}, channel %{x}: %{z:.0f} (1 kept, 0 pruned)<br>the pruning cost the window's "
                               "logits %{customdata:.1%} (|QK' - QK| / |QK|)<extra>%{fullData.name}</extra>")),
                row=i, col=1)
            fig.update_xaxes(title_text="key channel", row=i, col=1)
            fig.update_yaxes(autorange="reversed", row=i, col=1)
            continue
        if what == "merged":
            columns = token_labels(token_texts, forms.step + 1, forms.size, count=forms.merged.shape[1])
            fig.add_trace(go.Heatmap(
                z=forms.merged, x=columns, y=forms.layers, customdata=forms.merge_distance, hoverongaps=False,
                colorscale=[[0.0, "#FFFFFF"], [1.0, MERGED_COLOR]], zmin=0, zmax=1, showscale=False, name=spec,
                hovertemplate=("%{y}, tokens %{x}<br>evicted and merged: %{z:.0%}<br>into the held tokens from "
                               "%{customdata:.1f} positions on<extra>%{fullData.name}</extra>")), row=i, col=1)
            fig.update_xaxes(showticklabels=False, title_text="position (binned)" if forms.size > 1 else "position",
                             row=i, col=1)
            fig.update_yaxes(autorange="reversed", row=i, col=1)
            continue
        if what in ("attention", "output"):
            columns = token_labels(token_texts, forms.step + 1, forms.query_size, start=forms.query_start,
                                   count=forms.attention_shift.shape[1])
            z, other = ((forms.attention_shift, forms.output_error) if what == "attention"
                        else (forms.output_error, forms.attention_shift))
            fig.add_trace(go.Heatmap(
                z=z, x=columns, y=forms.layers, customdata=other, coloraxis=ERROR_AXIS, hoverongaps=False, name=spec,
                hovertemplate=("%{y}, queries %{x}<br>" + ("attention moved: %{z:.1%} (total variation)<br>output's "
                                                            "relative error: %{customdata:.1%}" if what == "attention"
                                                            else "output's relative error: %{z:.1%}<br>attention "
                                                            "moved: %{customdata:.1%}")
                               + "<extra>%{fullData.name}</extra>")), row=i, col=1)
            fig.update_xaxes(showticklabels=False, row=i, col=1, title_text=(
                f"query {forms.query_start}-{forms.step}" + (" (binned)" if forms.query_size > 1 else "")
                + ": from the first that reads a reformed token"))
            fig.update_yaxes(autorange="reversed", row=i, col=1)
            continue
        if what.endswith("channels"):
            error = forms.key_channels if what == "key channels" else forms.value_channels
            fig.add_trace(go.Heatmap(
                z=error, y=forms.head_labels, x=list(range(error.shape[1])), coloraxis=ERROR_AXIS, name=spec,
                hovertemplate=(f"%{{y}}, {what[:-1]} %{{x}}: %{{z:.1%}} relative error"
                               "<extra>%{fullData.name}</extra>")), row=i, col=1)
            fig.update_xaxes(title_text=what[:-1], row=i, col=1)
            fig.update_yaxes(autorange="reversed", row=i, col=1)
            continue
        error = forms.key_error if what == "key" else forms.value_error
        columns = token_labels(token_texts, forms.step + 1, forms.size, count=error.shape[1])
        share = np.round(forms.reformed * 100).astype(np.float32)
        fig.add_trace(go.Heatmap(
            z=error, x=columns, y=forms.layers, customdata=share, coloraxis=ERROR_AXIS, hoverongaps=False, name=spec,
            hovertemplate=(f"%{{y}}, tokens %{{x}}<br>{what}s' relative error: %{{z:.1%}}<br>held reformed: "
                           "%{customdata:.0f}%<extra>%{fullData.name}</extra>")), row=i, col=1)
        fig.update_xaxes(showticklabels=False, title_text="position (binned)" if forms.size > 1 else "position",
                         row=i, col=1)
        fig.update_yaxes(autorange="reversed", row=i, col=1)
    fig.update_layout(coloraxis=dict(colorscale=[list(stop) for stop in ERROR_SCALE], cmin=0, cmax=1,
                                     colorbar=dict(title="relative error", tickformat=".0%", len=0.5, y=1,
                                                   yanchor="top")),
                      plot_bgcolor="#D9D9D9")
    return finish(fig, "Held forms: how the tokens each policy holds differ from the model's own",
                  height=90 + PANEL_HEIGHT * len(rows))
