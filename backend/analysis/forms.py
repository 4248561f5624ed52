"""What a policy that reforms the tokens it holds did to them, from its trace's ``form_*`` arrays, binned for a view.

A token a reforming policy holds is read in its own form from the step it was reformed: its key with some channels
pruned (ThinK), its value with evicted values merged in (CaM), both rounded to fewer bits (KIVI). It is held, not
evicted: the masks, the reach and the kept tokens show it read. What changed is drawn here: per layer and column of
positions, the relative error of the keys and values the query at a step reads against the model's own (Full's
cache), and for channel pruning which channels each head keeps and what that cost the logits it was chosen for;
what reading the held forms did to each query's attention (how far its softmax moved, and its output, against the
same tokens read as computed), and each key and value channel's error. Work and output are O(layers x heads x
(T + d)) and at most ``MAX_COLUMNS`` columns, whatever the length.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..traces.trace import Trace
from .reach import column_size

MAX_COLUMNS = 400


@dataclasses.dataclass(frozen=True)
class HeldForms:
    """A reforming trace's forms as the query at ``step`` reads them.

    key_error, value_error: float32 [rows, columns], one row per layer (the chosen KV head, or their mean), the
    mean relative error |k' - k| / |k| of the column's held tokens (0 for a token held whole; NaN for a column whose
    tokens are all evicted); ``size`` positions a column. reformed: float32 [rows, columns], the share of the
    column's held tokens read reformed. channels: bool [layers x heads, d], the key channels each (layer, head) kept
    at its latest channel pruning by ``step`` (None: no channel pruning yet, or not a channel policy), pruned at
    ``channel_step`` with ``channel_error`` [layers x heads] the logits' relative error it cost (ThinK's objective).
    merged, merge_distance: float32 [rows, columns] for a merging policy, of the column's tokens evicted by ``step``
    the share whose value went into held tokens, and how many positions later the first of those lay on average
    (NaN where none was evicted, or none merged).
    attention_shift, output_error: float32 [rows, query columns] over the queries ``query_start``..step (not the
    keys; from the first that can read a reformed token, in columns of ``query_size`` queries), the mean total
    variation between each query's softmax over what it read as held and as computed, and the relative error of
    its output (None for a trace without them). key_channels, value_channels: float32 [layers x heads, d] (the
    chosen head's rows only, when one is), sum |k' - k| / sum |k| per channel over the tokens held at the latest
    reform before the end of the run.
    """

    step: int
    size: int
    layers: list[str]
    key_error: np.ndarray
    value_error: np.ndarray
    reformed: np.ndarray
    channel_labels: list[str]
    channels: np.ndarray | None = None
    channel_step: int | None = None
    channel_error: np.ndarray | None = None
    merged: np.ndarray | None = None
    merge_distance: np.ndarray | None = None
    attention_shift: np.ndarray | None = None
    output_error: np.ndarray | None = None
    query_start: int = 0
    query_size: int = 1
    head_labels: list[str] | None = None
    key_channels: np.ndarray | None = None
    value_channels: np.ndarray | None = None


def held_forms(trace: Trace, step: int, head: int | None = None, max_columns: int = MAX_COLUMNS) -> HeldForms:
    """The forms of what the query at ``step`` reads, per layer, for KV head ``head`` (None: the heads' mean)."""
    forms = trace.forms
    n_layers, n_heads = trace.meta["n_layers"], trace.meta["n_kv_heads"]
    count = step + 1
    size = column_size(step, max_columns)
    columns = math.ceil(count / size)
    heads = list(range(n_heads)) if head is None else [head]
    key_rows, value_rows, reformed_rows, merged_rows, distance_rows = [], [], [], [], []
    merging = "merged_into" in forms
    measured = "attention_shift" in forms
    shift_rows, output_rows = [], []
    # The queries from the first that can read a reformed token (the step from which one is read) to the step: a
    # policy that reforms once the prompt is read changes nothing before.
    first_read = forms["reformed_at"][forms["reformed_at"] >= 0]
    query_start = min(int(first_read.min()), step) if measured and first_read.size else step
    queries = step + 1 - query_start
    query_size = column_size(queries - 1, max_columns)
    query_columns = math.ceil(queries / query_size)
    everyone = np.ones((len(heads), queries), bool)
    for layer in range(n_layers):
        if measured:
            for rows, name in ((shift_rows, "attention_shift"), (output_rows, "output_error")):
                values = forms[name][layer][heads, query_start:step + 1].astype(np.float64)
                rows.append(_binned_share(values, everyone, query_columns, query_size))
        read = trace.reads_at(layer, step)[heads, :count]  # [h, count]
        at = forms["reformed_at"][layer][heads, :count]
        reformed = read & (at >= 0) & (at <= step)

        # Over the tokens the query reads: a reformed one's error, a whole one's 0.
        for rows, values in ((key_rows, forms["key_error"]), (value_rows, forms["value_error"])):
            rows.append(_binned_share(np.where(reformed, values[layer][heads, :count], 0.0), read, columns, size))
        reformed_rows.append(_binned_share(reformed, read, columns, size))
        if merging:
            gone = trace.evicted_at[layer][heads, :count]
            evicted = (gone >= 0) & (gone <= step)
            into = forms["merged_into"][layer][heads, :count]
            merged = evicted & (into >= 0)
            merged_rows.append(_binned_share(merged, evicted, columns, size))
            distance = np.where(merged, into - np.arange(count), 0).astype(np.float64)
            distance_rows.append(_binned_share(distance, merged, columns, size))
    channels = channel_step = channel_error = None
    labels = [f"L{layer} H{h}" for layer in range(n_layers) for h in range(n_heads)]
    if "channel_steps" in forms:
        done = np.flatnonzero(forms["channel_steps"] < step)  # a pruning after query s is read from s + 1
        if len(done):
            last = done[-1]
            channels = forms["channels"][last].reshape(n_layers * n_heads, -1).astype(bool)
            channel_error = forms["channel_error"][last].reshape(-1).astype(np.float32)
            channel_step = int(forms["channel_steps"][last]) + 1
    chosen = [f"L{layer} H{h}" for layer in range(n_layers) for h in heads]

    def per_channel(name):
        return forms[name][:, heads].reshape(n_layers * len(heads), -1).astype(np.float32) if name in forms else None

    return HeldForms(step=step, size=size, layers=[f"L{layer}" for layer in range(n_layers)],
                     key_error=np.stack(key_rows), value_error=np.stack(value_rows),
                     reformed=np.stack(reformed_rows), channel_labels=labels, channels=channels,
                     channel_step=channel_step, channel_error=channel_error,
                     merged=np.stack(merged_rows) if merging else None,
                     merge_distance=np.stack(distance_rows) if merging else None,
                     attention_shift=np.stack(shift_rows) if measured else None,
                     output_error=np.stack(output_rows) if measured else None, query_start=query_start,
                     query_size=query_size, head_labels=chosen,
                     key_channels=per_channel("key_channel_error"), value_channels=per_channel("value_channel_error"))


def _binned_share(values: np.ndarray, among: np.ndarray, columns: int, size: int) -> np.ndarray:
    """float32 [columns]: per column of ``size`` positions, the sum of ``values`` where ``among`` over the count of
    ``among`` (all heads given together); NaN where ``among`` holds none."""
    heads, count = among.shape
    top, bottom = np.zeros((heads, columns * size)), np.zeros((heads, columns * size))
    top[:, :count] = np.where(among, values, 0.0)
    bottom[:, :count] = among
    total = bottom.reshape(heads, columns, size).sum(-1).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (top.reshape(heads, columns, size).sum(-1).sum(0) / total).astype(np.float32)
