"""Figures and HTML views of traces: pure functions, plain arrays in, plotly figures or HTML strings out.

No Gradio here; the app wires these to its components. Modules:

* ``heatmap``: step x position read masks and attention weights (TOVA Fig. 7 / App. E, A2SF Fig. 4)
* ``reach``: what one step reads in every layer and head, and the share read by distance back
* ``share_scale``: the log colour scale of a share read, shared by binned masks and the reach
* ``highlight``: the text with cached tokens highlighted; continuations side by side (HTML)
* ``curves``: A2S vs A2SF accumulated scores (A2SF Fig. 1 and Fig. 6)
* ``tsne``: keys before/after RoPE (ReAttention Fig. 8-9); the embedding itself is ``backend.analysis.tsne``
* ``divergence``: per-step KL and top-1 agreement with Full, the summary table
* ``retention``: first-token retention, lifetime by position (TOVA Fig. 8), non-recent share, POS table
* ``colors``: ``policy_colors`` (one colour per policy everywhere); ``style``: shared layout
"""
from .colors import policy_colors
from .curves import score_curves_figure, score_over_steps_figure
from .divergence import divergence_figure, running_agreement, summary_table
from .heatmap import heatmap_values, mask_heatmap, mask_heatmaps
from .highlight import continuations_html, kept_tokens_html
from .retention import (first_token_retention_figure, lifetime_by_position_figure, non_recent_share_figure,
                        pos_table, pos_table_html)
from .tsne import tsne_figure

__all__ = (
    "continuations_html", "divergence_figure", "first_token_retention_figure", "heatmap_values",
    "kept_tokens_html", "lifetime_by_position_figure", "mask_heatmap", "mask_heatmaps", "non_recent_share_figure",
    "policy_colors", "pos_table", "pos_table_html", "running_agreement", "score_curves_figure",
    "score_over_steps_figure", "summary_table", "tsne_figure",
)
