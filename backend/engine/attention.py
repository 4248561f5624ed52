"""The instrumented attention: a transformers ``Cache`` that carries one policy per batch row.

Plugging in uses transformers' own extension points only. ``kvlens_attention`` is registered with
``AttentionInterface`` under the name "kvlens"; models are loaded with that implementation. A forward
call that passes ``kv_lens=<PolicyCache>`` gets policy-masked attention; any other call falls back to
plain SDPA, so one loaded model serves both instrumented and baseline runs.

How a block of ``n`` new queries is processed in one layer (``n = 1`` when decoding, a chunk of the
text on the prompt path; the code is the same), for each batch row:

* **Full** attends with SDPA.
* **Eviction and compression** rows score the block's queries against the tokens the row holds at the
  block's start plus the block's own tokens, nothing else: ``budget + n`` keys, however long the text.
  The row's policy then walks the block query by query (numpy over those columns; compiled for the
  running-score policies: numba on the CPU, kernels/eviction_walk.py, and one Triton launch per block on a
  GPU, kernels/eviction_walk_triton.py, so decisions stay on the device), deciding what query ``t``
  reads; an eviction policy drops a token per KV head once the cache is full, a compression policy keeps
  its budget when its schedule says so. One masked softmax gives the block's output.
* **Selection** rows choose what each query reads among every earlier token and record it as spans
  (spans.py), holding one block's masks at a time. Oracle chooses from each query's exact softmax row,
  which the engine computes over every key: that is its cost. The policies that ``attend`` (SparQ, Quest,
  ReAttention, StreamingLLM) compute the block's output themselves (``attend_block``).

Dropped tokens leave the row's columns (their keys stay in the shared tensor for the other rows): the
attention is the same as if they had been removed (TOVA App. D computes it the same way), and every
token keeps its own RoPE position (gaps, no shifts).
"""
from __future__ import annotations

import copy
import functools
from collections import deque
from collections.abc import Callable, Sequence, Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from kernels import eviction_walk, eviction_walk_triton

from .cache_layer import GrowingLayer, GrowingTensor, rows_up_to
from .features import Capture, ModelFeatures, read_features
from ..policies import Policy
from ..policies.base import attention_logits, over_group, visible_keys, Block, CacheView, GumbelSoftmax, RunningScore
from ..traces.recorded import TopAttention
from ..traces.spans import ReadSpans, SpanRecorder

ATTN_IMPLEMENTATION = "kvlens"
COMPILED_WALK = True  # False: every eviction policy walks in numpy (the reference; tests compare the two)
DEVICE_WALK = False  # True: the Triton walk on CPU tensors too (tests, under TRITON_INTERPRET=1); GPUs always take it


class TopRecorder:
    """Keeps the top-k entries of one (layer, row)'s attention rows as the blocks go by (recorded.py)."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.pos: list[np.ndarray] = []  # per block [H, n, k]
        self.val: list[np.ndarray] = []

    def add(self, attn: torch.Tensor, positions: torch.Tensor) -> None:
        """attn: [H, n, C] rows over C columns at ``positions`` [H, C]; zero where not read."""
        k = min(self.top_k, attn.shape[-1])
        val, col = torch.topk(attn.float(), k, dim=-1)
        positions = positions.to(col.device)
        pos = torch.gather(positions[:, None].expand(-1, attn.shape[1], -1), 2, col)
        pos = torch.where(val > 0, pos, torch.full_like(pos, -1)).cpu().numpy().astype(np.int32)
        val = val.cpu().numpy().astype(np.float16)
        pad = self.top_k - k
        if pad:
            pos = np.concatenate([pos, np.full(pos.shape[:2] + (pad,), -1, np.int32)], -1)
            val = np.concatenate([val, np.zeros(val.shape[:2] + (pad,), np.float16)], -1)
        self.pos.append(pos)
        self.val.append(np.where(pos >= 0, val, np.float16(0)))

    def rows(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """([H, T, k] positions, [H, T, k] weights) of the first ``length`` queries."""
        return np.concatenate(self.pos, 1)[:, :length], np.concatenate(self.val, 1)[:, :length]


class _NoSpans:
    """A fork's span recorder: the fork's reads are not part of any trace."""

    def add(self, reads, first) -> None:
        pass


# The Gumbel-softmax parameters the walks are given for a running score that adds its attention itself (unread).
NO_NOISE = GumbelSoftmax(seed=0, tau_init=1.0, tau_end=1.0, steps=1)


def compiled_running_score(policy: Policy) -> RunningScore | None:
    """The policy's running score when a compiled walk can take it (numba's on the CPU, Triton's on a GPU):
    COMPILED_WALK is on and the policy's ``update``, ``score``, ``protected`` and ``step`` are those of the
    class that declared it (a subclass that changes one of them is walked in numpy, so it is never walked as
    its parent)."""
    if not COMPILED_WALK or policy.kind != "eviction":
        return None
    running = policy.running_score()
    if running is None:
        return None
    mro = type(policy).__mro__
    owner = next(i for i, cls in enumerate(mro) if "running_score" in vars(cls))
    changed = any(name in vars(cls) for cls in mro[:owner] for name in ("update", "score", "protected", "step"))
    return None if changed else running


@functools.lru_cache(maxsize=8)
def _block_steps(n: int, device: torch.device) -> torch.Tensor:
    """int64 [n]: 0 .. n - 1, a block's queries. Made once per size and device; never written to."""
    return torch.arange(n, device=device)


@functools.lru_cache(maxsize=8)
def _later(n: int, device: torch.device) -> torch.Tensor:
    """bool [n, n]: query i of a block cannot see the block's column j > i. Made once per size and device (two launches
    a block and layer on a GPU otherwise); never written to."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def _block_weights(scores: torch.Tensor, alive: np.ndarray | torch.Tensor, held: int) -> torch.Tensor:
    """exp(score - row max) once for a block, float64 [..., H, G, n, C] on the scores' device, as policies decide
    in float64; zero where a query cannot see a column (later in the block, or held at the block's start but
    not alive: a -1 pad). ``alive`` [..., H, C]."""
    n = scores.shape[-2]
    s = scores.to(torch.float64, copy=True)  # a copy even when the model runs in float64: s is changed in place
    if n > 1:  # a single query (a decoding step) sees its own column
        s[..., held:].masked_fill_(_later(n, s.device), float("-inf"))
    unseen = ~torch.as_tensor(alive[..., :held]).to(s.device)  # the held columns' state, where the scores are
    if held:
        s[..., :held].masked_fill_(unseen[..., None, None, :], float("-inf"))
    s -= s.amax(-1, keepdim=True)
    return s.exp_()


def _block_start(columns: np.ndarray, n: int) -> tuple[int, np.ndarray, np.ndarray]:
    """What a walk starts a block of n queries from, ``columns`` [..., H, C] (the held columns, -1 pads, then the
    block's): held = C - n; alive: the held columns that hold a token (a block's column comes alive with its query);
    dropped_at: n (not dropped) for those and the block's, -1 for pads."""
    held = columns.shape[-1] - n
    alive = columns >= 0
    alive[..., held:] = False
    dropped_at = np.where(alive, n, -1)
    dropped_at[..., held:] = n
    return held, alive, dropped_at


def walk_rows(rows: list["RowLayerState"], scores: list[torch.Tensor], columns: list[np.ndarray], first: int):
    """The walks of several batch rows of one layer (running-score policies, kernels/eviction_walk_triton.py) on the
    scores' device: ``scores[r]`` [H, G, n, C_r] and ``columns[r]`` [H, C_r] are row r's. Returns each row's softmax
    over what each query head read [H, G, n, C_r] and, when it records, its attention rows [H, n, C_r] (None
    otherwise). ``PolicyCache.attend`` walks its rows through ``DeviceWalk`` directly."""
    walk = DeviceWalk(rows, columns, first, scores[0].device)
    stacked = torch.full((len(rows), *scores[0].shape[:3], walk.width), float("-inf"), dtype=scores[0].dtype,
                         device=walk.device)
    for r, start in enumerate(walk.starts):
        stacked[r, ..., start:] = scores[r]
    probs, attn = walk.run(stacked)
    return [(probs[r, ..., start:], None if attn is None else attn[r, :, :, start:])
            for r, start in enumerate(walk.starts)]


class DeviceWalk:
    """One block's walk for the running-score rows of one layer on a device, in one Triton launch for each way
    its rows walk their heads (``eviction_walk_triton.ways``): no copy to the host between steps. What it needs
    goes to the device in one copy (the rows' columns, padded at the front to the widest, their running scores and
    parameters, and the batch rows they are gathered from) and its outcome (who was dropped when, the running
    scores) comes back in one, for the rows' bookkeeping."""

    def __init__(self, rows: list["RowLayerState"], columns: list[np.ndarray], first: int, device: torch.device,
                 indices: np.ndarray | None = None, window: int | None = None):
        """``indices`` [k, R]: integers the caller indexes the rows' tensors with (their batch rows), sent with the
        rest (``self.indices``, int64 on the device). ``window``: the layer's sliding window where it hides some of
        the block's keys from some of its queries (``hidden``)."""
        self.rows, self.columns, self.first, self.device = rows, columns, first, device
        self.width = max(c.shape[1] for c in columns)
        self.starts = [self.width - c.shape[1] for c in columns]
        n_heads = columns[0].shape[0]
        shape = (len(rows), n_heads, self.width)
        padded = np.full(shape, -1.0)
        held_score = np.zeros(shape)
        self.params = np.array([row.walk_params(start) for row, start in zip(rows, self.starts)], np.float64)
        self.n = n = columns[0].shape[1] - rows[0].slots.shape[1]  # the block's queries
        for r, (row, start) in enumerate(zip(rows, self.starts)):
            padded[r, :, start:] = columns[r]
            if row.running.state is not None:
                held_score[r, :, start:self.width - n] = row.state[row.running.state]
        # What the walk starts from (``_block_start``), and the last of the block's queries that may read each column:
        # none for a front pad; on a sliding-window layer, the last before the window passes its key (held key p is
        # visible to query first + i while p > first + i - window).
        self.held, alive, dropped_at = _block_start(padded, n)
        last = np.where(padded < 0, -1, n if window is None else padded - first + window - 1)
        indices = np.zeros((0, len(rows))) if indices is None else np.asarray(indices, np.float64)
        # One host-to-device copy of everything the walk starts from (positions and indices are exact in float64).
        integers = [padded, alive, dropped_at, last, indices]
        sent = torch.from_numpy(np.concatenate([a.ravel() for a in integers] + [held_score.ravel(),
                                                                                self.params.ravel()])).to(device)
        whole = sum(a.size for a in integers)
        exact = sent[:whole].long()
        ends = np.cumsum([a.size for a in integers])
        self.where, alive, self.dropped_at, self.last, self.indices = (
            exact[end - x.size:end].view(x.shape) for end, x in zip(ends, integers))
        self.alive = alive > 0
        self.score = sent[whole:whole + padded.size].view(shape)
        self.params_on_device = sent[whole + padded.size:].view(self.params.shape)

    def hidden(self) -> torch.Tensor:
        """bool [R, H, 1, n, C]: the columns each query of the block cannot read (a pad, a key the window passed)."""
        return (_block_steps(self.n, self.device)[:, None] > self.last[:, :, None, :])[:, :, None]

    def run(self, scores: torch.Tensor) -> tuple[torch.Tensor, np.ndarray | None]:
        """Walk ``scores`` [R, H, G, n, C] (-inf in a row's front pads; the model's dtype); each row's bookkeeping
        done. Returns the softmax over what each query head read [R, H, G, n, C] in the scores' dtype and, when a
        row records, the attention rows [R, H, n, C] on the host (None otherwise). Once: it walks from the block's
        start, whose state the walk then changes in place."""
        n, first, held, alive, dropped_at = scores.shape[3], self.first, self.held, self.alive, self.dropped_at
        # float32 for a half-precision model: the softmax is cast once after the walk (Triton's interpreter, which
        # the CPU tests run, cannot store bfloat16).
        wide = scores.dtype if scores.dtype in (torch.float32, torch.float64) else torch.float32
        probs = torch.empty(scores.shape, dtype=wide, device=self.device)
        record = any(row.top is not None for row in self.rows)
        rows, heads, _, _, width = scores.shape
        attn_rows = torch.zeros((rows, heads, n if record else 0, width if record else 0), dtype=torch.float64,
                                device=self.device)
        eviction_walk_triton.walk_rows(_block_weights(scores, alive, held), alive, self.where, self.score, first,
                                       held, self.params, self.params_on_device, probs, dropped_at, attn_rows)
        # One device-to-host copy of the outcome.
        outcome = torch.stack([alive.to(torch.float64), dropped_at.to(torch.float64), self.score]).cpu().numpy()
        alive, dropped_at, score = outcome[0] > 0, outcome[1].astype(np.int64), outcome[2]
        attn = attn_rows.cpu().numpy() if record else None
        for r, (row, start) in enumerate(zip(self.rows, self.starts)):
            if row.running.state is not None:
                row.state = {**row.state, row.running.state: score[r, :, start:]}
            row._end_block(self.columns[r], alive[r, :, start:], dropped_at[r, :, start:], first, n)
        return probs.to(scores.dtype), attn


class DecidedBlock:
    """The decisions of a row's latest walked block, for a policy that decides alike in every layer
    (``Policy.decides_alike_in_every_layer``): the first layer to walk a block keeps what it decided, and the row's
    other layers replay it instead of walking. A block is the same when it starts at the same query, has as many,
    and starts from the same held columns, which is all such a walk depends on (so a fork of the row, which shares
    it, replays only what it would have decided itself)."""

    def __init__(self):
        self.block: tuple | None = None  # (first, n, columns [H, C])
        self.alive = self.dropped_at = None

    def replay(self, columns: np.ndarray, first: int, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(alive, dropped_at) as ``_walk_numpy`` ends the block with, if this block was walked; else None."""
        if self.block is None or self.block[:2] != (first, n) or not np.array_equal(self.block[2], columns):
            return None
        return self.alive.copy(), self.dropped_at.copy()

    def keep(self, columns: np.ndarray, first: int, n: int, alive: np.ndarray, dropped_at: np.ndarray) -> None:
        self.block, self.alive, self.dropped_at = (first, n, columns.copy()), alive.copy(), dropped_at.copy()


def _widened(a: np.ndarray, room: np.ndarray | None, total: int, fill) -> tuple[np.ndarray, np.ndarray]:
    """a [H, m] as [H, total], the new columns ``fill``, and the buffer it is a view of. While ``a`` is a view of
    ``room`` (the buffer the last call returned) with space left, nothing is copied: a decoding step adds one
    column, where concatenating would copy every column (O(T^2) over an answer). A buffer's columns past its view are
    never written, so they still hold ``fill``."""
    if room is None or a.base is not room or room.shape[1] < total:
        room = np.full((a.shape[0], max(total, 2 * a.shape[1], 64)), fill, a.dtype)
        room[:, : a.shape[1]] = a
    return room[:, :total], room


@functools.lru_cache(maxsize=16)
def _head_offsets(n_heads: int, per_head: int, device: torch.device) -> torch.Tensor:
    """int64 [H, 1]: where each head's rows start among a cache buffer's rows (``held_rows``). Made once per layout
    and device; never written to."""
    return torch.arange(n_heads, device=device)[:, None] * per_head


def held_rows(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """x [H, M, d], at [H, C] -> x[h, at[h]] [H, C, d]. The heads' rows are taken in one ``index_select`` over the
    rows of x's storage (a view: the cache's buffer holds each head's rows with room to spare), a few times
    faster than advanced indexing at a decoding step's sizes; the same numbers, copied."""
    n_heads, length, dim = x.shape
    per_head = x.stride(0) // dim if dim else 0
    if x.stride(2) != 1 or x.stride(1) != dim or x.stride(0) % dim or per_head < length:
        return x[torch.arange(n_heads, device=x.device)[:, None], at]
    rows = x.as_strided(((n_heads - 1) * per_head + length, dim), (dim, 1))
    flat = (at + _head_offsets(n_heads, per_head, x.device)).reshape(-1)
    return rows.index_select(0, flat).view(n_heads, -1, dim)


def _causal(first: int, n: int, total: int, device) -> torch.Tensor:
    """bool [n, total]: query first + i sees keys 0..first + i."""
    return torch.arange(total, device=device)[None] <= torch.arange(first, first + n, device=device)[:, None]


class RowLayerState:
    """What one policy has done in one layer of one batch row: its state, what it holds, what it read."""

    def __init__(self, policy: Policy, n_kv_heads: int, record_top_k: int = 0, layer: int = 0, n_layers: int = 1,
                 rope: Callable | None = None, output: torch.Tensor | None = None,
                 decided: DecidedBlock | None = None):
        """``decided``: shared by the row's layers when its policy decides alike in every layer (``DecidedBlock``)."""
        self.policy = policy
        self.decided = decided
        self.layer, self.n_layers = layer, n_layers
        self.rope = rope  # the model's RoPE, for compression policies that rotate queries (CacheView.rope)
        self.output = output  # the layer's output projection weight (CacheView.output)
        self.n_kv_heads = n_kv_heads
        self.state = policy.layer_state(n_kv_heads, layer)
        # Eviction and compression: the positions the row holds, per KV head in position order (-1 pads
        # heads that hold fewer, as AdaKV's do); every policy array of shape [H, columns] follows them.
        self.slots = np.zeros((n_kv_heads, 0), np.int64)
        self.alive = np.zeros((n_kv_heads, 0), bool)  # compression: by position, for its CacheView
        self.evicted_at = np.zeros((n_kv_heads, 0), np.int32)
        self._evicted_room = self._alive_room = None  # the buffers the two above are views of (``_widened``)
        # Compression: the latest ``window_queries`` (positions, attention row, query [H, G, d], t, rows [H, G, c]).
        self.window_rows: deque[tuple] = deque(maxlen=max(1, policy.window_queries) if policy.kind == "compression"
                                               else 1)
        self.spans = SpanRecorder(n_kv_heads) if policy.kind == "selection" else None
        self.top = TopRecorder(record_top_k) if record_top_k else None
        self.stat_rows: dict[str, list[np.ndarray]] = {}  # attending policies: per-step numbers
        self.running = compiled_running_score(policy)  # not None: the walk runs compiled
        # A policy that ``reforms``: its held tokens' own keys and values [H, P, d] (positions 0..P-1 at its last
        # compression; a later token is read as computed), and what changed when (HeldForms).
        self.forms = HeldForms(n_kv_heads) if policy.reforms else None
        self.softcap: float | None = None  # the layer's, as the last block was attended
        self.window: int | None = None

    def _extend(self, total: int) -> None:
        if total > self.evicted_at.shape[1]:
            self.evicted_at, self._evicted_room = _widened(self.evicted_at, self._evicted_room, total, -1)
            if self.policy.kind == "compression":
                self.alive, self._alive_room = _widened(self.alive, self._alive_room, total, True)
            if self.forms is not None:
                self.forms.extend(total)

    # --- one block of queries -------------------------------------------------------------------------

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first: int, scaling: float,
               n_prompt: int | None, softcap: float | None = None, window: int | None = None) -> torch.Tensor:
        """q [H_kv, G, n, d] (query head h*G + g uses KV head h), key/value [H_kv, M, d] -> out [H_kv, G, n, d].

        ``softcap`` and ``window`` are the layer's (Gemma's): logits are soft-capped, and on a sliding-window
        layer a query reads only the latest ``window`` keys, whatever its policy holds (the model's own
        eviction; docs/policies.md)."""
        self.begin(key.shape[1], softcap, window)
        kind = self.policy.kind
        if kind == "full":
            return self._attend_full(q, key, value, first, scaling)
        if self.reads_as_full(first + q.shape[2], n_prompt):
            out = self._attend_full(q, key, value, first, scaling)
            self.follow(q, key, value, first, scaling, n_prompt)
            return out
        if kind == "selection":
            return self._attend_selection(q, key, value, first, scaling, n_prompt)
        if self.forms is not None:
            return self._attend_in_segments(q, key, value, first, scaling, n_prompt)
        return self._attend_cached(q, key, value, first, scaling, n_prompt)

    def reads_as_full(self, end: int, n_prompt: int | None) -> bool:
        """Does every query of a block ending before position ``end`` read as Full's (``Policy.first_departure``)?"""
        return self.policy.kind != "full" and end <= self.policy.first_departure(n_prompt)

    def follow(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first: int, scaling: float,
               n_prompt: int | None) -> None:
        """A block before the row's first departure: its queries read as Full's, and the policy sees what it asks
        of them: an eviction policy walks the block as ever (its running scores grow; it drops nothing yet), a
        compression policy reads its window's attention rows and queries, and compresses after the last of them, a
        selection policy is told its queries read everything (``SelectionPolicy.read_as_full``).
        q [H_kv, G, n, d], key/value [H_kv, M, d]: the row's own, or Full's when the row takes Full's prefill
        (``PolicyCache.share``): the same to the bit."""
        policy = self.policy
        departure = policy.first_departure(n_prompt)
        if policy.kind == "eviction":  # its own walk, which updates its state; what it read is Full's arithmetic
            top, self.top = self.top, None
            try:
                self._attend_cached(q, key, value, first, scaling, n_prompt)
            finally:
                self.top = top
            if ((self.evicted_at >= 0) & (self.evicted_at < departure)).any():
                raise RuntimeError(f"{policy.name} drops a token before its first departure ({departure})")
            return
        if policy.kind == "selection":  # every query read every earlier token: record that, and tell the policy
            n, total = q.shape[2], key.shape[1]
            reads = visible_keys(first, n, total, self.window).numpy()
            self.spans.add(np.broadcast_to(reads, (self.n_kv_heads, n, total)).copy(), first)
            heads = (q.shape[0] * q.shape[1], q.shape[0], q.shape[3])
            in_prompt = n_prompt is not None and first + n <= n_prompt
            self.state, stats = policy.read_as_full(self.state, first, n, heads, in_prompt)
            for name, values in stats.items():
                self.stat_rows.setdefault(name, []).extend(values)
            return
        if policy.kind != "compression":
            raise NotImplementedError(f"{policy.name}: the engine follows only eviction, compression and selection "
                                      "policies until they depart")
        n, total = q.shape[2], first + q.shape[2]
        acts = policy.compression_steps(first, total, n_prompt)
        if any(t != departure - 1 for t in acts):
            raise RuntimeError(f"{policy.name} compresses before its first departure ({departure})")
        reach = policy.window_queries
        seen = sorted(set(range(max(first, departure - reach), total) if reach else ()) | set(acts))
        if seen:
            rows, by_head = self._attention_rows(q, key, first, [t - first for t in seen], scaling) \
                if policy.uses_attention else (None, None)
            positions = np.broadcast_to(np.arange(total), (self.n_kv_heads, total))  # every token is held
            kept = np.ones((self.n_kv_heads, total), bool)
            for j, t in enumerate(seen):
                self._compress(None if rows is None else rows[:, j, : t + 1], t, positions[:, : t + 1],
                               kept[:, : t + 1], key, value, n_prompt, q[:, :, t - first],
                               None if by_head is None else by_head[:, :, j, : t + 1])
        columns = self.block_columns(first, n)
        self._keep_columns(columns, np.take_along_axis(self.alive, np.maximum(columns, 0), axis=1) & (columns >= 0))

    def _attention_rows(self, q: torch.Tensor, key: torch.Tensor, first: int, picks: list[int], scaling: float
                        ) -> tuple[np.ndarray, np.ndarray | None]:
        """The picked queries' softmax rows over the keys each sees, in float64: their group's mean [H, k, M] and,
        for a policy that reads them, each query head's [H, G, k, M] (else None)."""
        visible = visible_keys(first, q.shape[2], key.shape[1], self.window, q.device)[picks]
        scores = attention_logits(q[:, :, picks], key[:, None], scaling, self.softcap).double()
        probs = torch.softmax(scores.masked_fill_(~visible, float("-inf")), -1)
        by_head = probs.cpu().numpy() if self.policy.window_by_query_head else None
        return probs.mean(1).cpu().numpy(), by_head

    def begin(self, total: int, softcap: float | None, window: int | None) -> None:
        """A block over ``total`` keys begins, under the layer's soft-cap and window."""
        self._extend(total)
        self.softcap, self.window = softcap, window

    def _attend_in_segments(self, q, key, value, first, scaling, n_prompt):
        """A policy that reforms what it holds: the block's queries after a compression read the new forms, so
        the block is attended in segments that end where the policy compresses (as a token loop would)."""
        n = q.shape[2]
        ends = [t - first + 1 for t in self.policy.compression_steps(first, first + n - 1, n_prompt)]
        outs = [self._attend_cached(q[:, :, a:b], key[:, : first + b], value[:, : first + b], first + a, scaling,
                                    n_prompt)
                for a, b in zip([0, *ends], [*ends, n])]
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

    def _limited(self, total: int) -> bool:
        """Does this layer cap its logits or hide keys beyond its window from a block over ``total`` keys?"""
        return self.softcap is not None or (self.window is not None and self.window < total)

    def _attend_full(self, q, key, value, first, scaling):
        n, total = q.shape[2], key.shape[1]
        if self._limited(total):
            visible = visible_keys(first, n, total, self.window, q.device)
            scores = attention_logits(q, key[:, None], scaling, self.softcap)
            weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
            if self.top is not None:
                self.top.add(weights.mean(1), torch.arange(total).expand(self.n_kv_heads, -1))
            return over_group(weights, value[:, None])
        mask = None if first == 0 and n == total else _causal(first, n, total, q.device)
        # One batch of H_kv * G query heads over H_kv KV heads (enable_gqa): SDPA's fused kernels take this
        # layout; broadcasting the keys over the group instead falls back to a kernel 3x slower at 8k.
        heads, group, _, dim = q.shape
        out = F.scaled_dot_product_attention(q.reshape(1, heads * group, n, dim), key[None], value[None],
                                             attn_mask=mask, is_causal=mask is None, scale=scaling,
                                             enable_gqa=True).view(heads, group, n, dim)
        if self.top is not None:
            scores = (q @ key[:, None].transpose(-1, -2)) * scaling
            weights = torch.softmax(scores.masked_fill(~_causal(first, n, total, q.device), float("-inf")), -1)
            self.top.add(weights.mean(1), torch.arange(total).expand(self.n_kv_heads, -1))
        return out

    def _attend_selection(self, q, key, value, first, scaling, n_prompt):
        n, total = q.shape[2], key.shape[1]
        scores = attention_logits(q, key[:, None], scaling, self.softcap)  # [H, G, n, M]
        causal = visible_keys(first, n, total, self.window, q.device)
        # The policy sees each query's exact softmax row (float64, mean over the group's query heads). A prompt it
        # reads exactly reads as Full's (``SelectionPolicy.first_departure``) and never comes here.
        s = scores.double().cpu().masked_fill(~causal.cpu(), float("-inf"))
        attn_full = torch.softmax(s, -1).mean(1).numpy()
        self.state, reads = self.policy.select_block(self.state, attn_full, first)
        if self._limited(total):  # nothing beyond the layer's window is read, whatever the policy picked
            reads = reads & causal.cpu().numpy()
        self.spans.add(reads, first)
        unread = torch.from_numpy(~reads).to(scores.device)[:, None]
        probs = torch.softmax(scores.masked_fill_(unread, float("-inf")), dim=-1)
        if self.top is not None:
            self.top.add(probs.mean(1), torch.arange(total).expand(self.n_kv_heads, -1))
        return over_group(probs, value[:, None])

    def _attend_cached(self, q, key, value, first, scaling, n_prompt):
        columns, values, scores = self.gather(q, key, value, first, scaling)
        if self._only_reads(first, q.shape[2], n_prompt):
            # Each query reads every held column and the block's up to its own, as the walk would find: the same
            # mask and softmax, without the walk, which would decide nothing.
            steps = np.arange(q.shape[2])[None, :, None]
            reads = (np.arange(columns.shape[1])[None, None, :] < columns.shape[1] - q.shape[2] + 1 + steps) \
                & (columns[:, None, :] >= 0)
            unread = torch.from_numpy(np.where(reads, np.float32(0), np.float32(-np.inf))).to(scores.device,
                                                                                             scores.dtype)
            self._keep_columns(columns, columns >= 0)
            return over_group(torch.softmax(scores.add_(unread[:, None]), dim=-1), values[:, None])
        probs, attn_rows = self._walk(scores, columns, first, key, value, n_prompt, q)
        out = self.read(probs, attn_rows, columns, values)
        if self.forms is not None and self.forms.keys is not None:  # it reads held forms: what did they change?
            at = torch.from_numpy(np.maximum(columns, 0)).to(key.device)
            heads = torch.arange(len(columns), device=key.device)[:, None]
            self.forms.measure(first, q, probs, out, scores, key[heads, at], value[heads, at], scaling, self.softcap)
        return out

    def _only_reads(self, first: int, n: int, n_prompt: int | None) -> bool:
        """Does a compression row's block of n queries from ``first`` only read what the row holds: no query in it
        compresses, none is in the window of a compression to come (whose rows and queries it would keep), it
        records nothing and reads no held forms? Then its walk decides nothing (``_attend_cached``)."""
        policy = self.policy
        if policy.kind != "compression" or self.top is not None or self.forms is not None:
            return False
        reach = policy.window_queries
        return not policy.compression_steps(first, first + n + max(reach, 1) - 1, n_prompt)

    def gather(self, q, key, value, first, scaling):
        """The block's columns [H, C] (held at its start, then the block's own), their values [H, C, d] and the
        queries' logits over them [H, G, n, C]: -inf where the layer's window has passed a held key."""
        n_heads, _, n, _ = q.shape
        columns = self.block_columns(first, n)
        at = torch.from_numpy(np.maximum(columns, 0)).to(key.device)
        keys, values = held_rows(key, at), held_rows(value, at)  # [H, C, d]
        if self.forms is not None:
            keys, values = self.forms.read(keys, values, torch.arange(n_heads, device=key.device)[:, None], at)
        scores = attention_logits(q, keys[:, None], scaling, self.softcap)  # [H, G, n, C]
        if self.window is not None and self.window < key.shape[1]:  # held keys the layer's window has passed
            steps = torch.arange(first, first + n, device=scores.device)
            passed = torch.from_numpy(columns).to(scores.device)[:, None, :] <= steps[None, :, None] - self.window
            scores.masked_fill_(passed[:, None], float("-inf"))
        return columns, values, scores

    def block_columns(self, first: int, n: int) -> np.ndarray:
        """The columns [H, C] a block of n queries from ``first`` reads over: those held at its start, then its own."""
        block = np.broadcast_to(np.arange(first, first + n), (self.n_kv_heads, n))
        return np.concatenate([self.slots, block], 1)

    def read(self, probs, attn_rows, columns, values):
        """The block's output from each query head's softmax over the columns it read; recorded when asked."""
        if self.top is not None:
            self.top.add(torch.from_numpy(attn_rows), torch.from_numpy(columns))
        return over_group(probs, values[:, None])

    def walk_params(self, start: int = 0) -> tuple:
        """This row's parameters of the device walk (``eviction_walk_triton.PARAMS``), its columns from ``start``."""
        running = self.running
        gumbel = running.gumbel or NO_NOISE
        return (self.policy.budget, running.sinks, running.recent, running.by_position, running.layer, start,
                running.decay, running.gumbel is not None, gumbel.seed, self.layer, gumbel.tau_init, gumbel.tau_end,
                gumbel.steps)

    def walks_on_device(self, device: torch.device) -> bool:
        """Does this row walk in Triton (kernels/eviction_walk_triton.py), batched with the layer's other such
        rows (``DeviceWalk``)?"""
        return (self.running is not None and self.forms is None
                and (device.type == "cuda" or DEVICE_WALK) and eviction_walk_triton.usable(device))

    def _walk(self, scores: torch.Tensor, columns: np.ndarray, first: int, key, value, n_prompt, q):
        """Decide query by query what the block's queries read; return each query head's softmax over what it
        read [H, G, n, C] and, when recording, the policy's attention rows [H, n, C] (None otherwise).

        Running-score policies (Window, sinks, H2O, TOVA, A2SF) walk compiled: with numba on the CPU, in Triton
        on a GPU (where ``PolicyCache.attend`` walks every such row of the layer at once, ``DeviceWalk``; this is
        the walk of a row alone); the numpy walk is their reference and every other policy's walk."""
        if self.running is not None:
            # The walk decides in float64 from the block's scores in any precision: on the device for every
            # dtype (bfloat16 too), with numba for float32 and float64.
            if self.walks_on_device(scores.device):
                return walk_rows([self], [scores], [columns], first)[0]
            if (scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64)
                    and eviction_walk.walk is not None):
                return self._walk_compiled(scores, columns, first)
        reads, attn_rows = self._walk_numpy(scores, columns, first, key, value, n_prompt, q)
        # -inf where a query does not read (adding a bias is several times faster than a broadcast masked_fill); the
        # scores keep it, so that they say what was read (HeldForms.measure).
        unread = torch.from_numpy(np.where(reads, np.float32(0), np.float32(-np.inf))).to(scores.device, scores.dtype)
        return torch.softmax(scores.add_(unread[:, None]), dim=-1), attn_rows

    def _walk_compiled(self, scores: torch.Tensor, columns: np.ndarray, first: int):
        """The walk of a running-score policy in one compiled call (kernels/eviction_walk.py)."""
        n_heads, _, n, width = scores.shape
        running = self.running
        held, alive, dropped_at = _block_start(columns, n)
        score = np.zeros((n_heads, width))
        if running.state is not None:
            score[:, :held] = self.state[running.state]
        weights = _block_weights(scores, alive, held).cpu().numpy()
        probs = np.empty(scores.shape, np.float32 if scores.dtype == torch.float32 else np.float64)
        attn_rows = np.zeros((n_heads, n, width)) if self.top is not None else np.zeros((0, 0, 0))
        gumbel = running.gumbel or NO_NOISE
        eviction_walk.walk(weights, alive, columns, score, first, held, self.policy.budget, float(running.decay),
                           running.by_position, running.sinks, running.recent, running.layer, probs, dropped_at,
                           attn_rows, running.gumbel is not None, gumbel.seed, self.layer, float(gumbel.tau_init),
                           float(gumbel.tau_end), gumbel.steps)
        if running.state is not None:
            self.state = {**self.state, running.state: score}
        self._end_block(columns, alive, dropped_at, first, n)
        return torch.from_numpy(probs), attn_rows if self.top is not None else None

    def _walk_numpy(self, scores: torch.Tensor, columns: np.ndarray, first: int, key, value, n_prompt, q):
        """Decide query by query what the block's queries read; return reads bool [H, n, C] and, when
        recording, their attention rows [H, n, C].

        The loop body is the cost of the whole engine at long texts (one pass per token, layer and row), so
        it does as little as it can: the block's exp(score) rows are computed once, the masked sums are
        matrix products with the 0/1 alive row, and what each query read is rebuilt after the loop from
        the step each column was dropped at.
        """
        n_heads, group, n, width = scores.shape
        policy, compression = self.policy, self.policy.kind == "compression"
        held, alive, dropped_at = _block_start(columns, n)  # dropped_at: the step after which a column left
        weights = None
        if policy.uses_attention or self.top is not None:
            weights = _block_weights(scores, alive, held).cpu().numpy()
            alive_f = alive.astype(np.float64)
        attn_rows = np.zeros((n_heads, n, width)) if self.top is not None else None
        needed = self._rows_read(first, n, n_prompt) if compression and policy.uses_attention and self.top is None \
            else None
        heads = np.arange(n_heads)
        # Another layer of the row walked this block and decided what this one would: take its decisions (a layer
        # that needs the attention rows, to record them, walks).
        replayed = self.decided.replay(columns, first, n) if self.decided is not None and weights is None else None
        if replayed is not None:
            alive, dropped_at = replayed
        for i in range(n if replayed is None else 0):
            t, c = first + i, held + i + 1  # query t; columns 0..c-1 exist for it
            alive[:, c - 1] = True
            kept = alive[:, :c]
            attn = None
            if weights is not None:
                alive_f[:, c - 1] = 1.0
            if weights is not None and (needed is None or needed[i]):
                # Mean over the group's query heads of each head's softmax over the kept columns.
                w = weights[:, :, i, :c]  # [H, G, c]
                share = 1.0 / (group * (w @ alive_f[:, :c, None]))  # [H, G, 1]
                attn = (share.transpose(0, 2, 1) @ w)[:, 0] * alive_f[:, :c]
                if attn_rows is not None:
                    attn_rows[:, i, :c] = attn
            if compression:
                acts = policy.compresses_after(t, n_prompt)  # only then can kept change
                before = kept.copy() if acts else None
                # Each query head's own softmax row [H, G, c], for a scorer that pools before the group's mean.
                by_head = (w * (group * share) * alive_f[:, None, :c]
                           if attn is not None and policy.window_by_query_head else None)
                self._compress(attn, t, columns[:, :c], kept, key, value, n_prompt, q[:, :, i], by_head)
                gone = before & ~kept if acts else None
                if acts and gone.any():
                    dropped_at[:, :c][gone] = i
                    if weights is not None:
                        alive_f[:, :c] = kept
                continue
            self.state, victims = policy.step(self.state, attn, kept, t, columns[:, :c])
            if victims is not None:  # one column per head [H], or the same number of columns per head [H, k]
                rows = heads if np.ndim(victims) == 1 else heads[:, None]
                alive[rows, victims] = False
                dropped_at[rows, victims] = i
                if weights is not None:
                    alive_f[rows, victims] = 0.0
        if self.decided is not None and replayed is None:
            self.decided.keep(columns, first, n, alive, dropped_at)
        steps = np.arange(n)[None, :, None]
        reads = (np.arange(width)[None, None, :] < held + 1 + steps) & (steps <= dropped_at[:, None, :])
        self._end_block(columns, alive, dropped_at, first, n)
        return reads, attn_rows

    def _rows_read(self, first: int, n: int, n_prompt: int | None) -> np.ndarray:
        """bool [n]: which of a block's queries a compression policy reads the attention row of: those among the
        ``window_queries`` latest at a compression (its window). The others' rows are never read, so a prefill
        compression over a long context costs the window's rows, not one per context token."""
        reach = max(1, self.policy.window_queries)
        acts = np.zeros(n + reach - 1, bool)
        acts[np.array(self.policy.compression_steps(first, first + n + reach - 1, n_prompt), int) - first] = True
        before = np.concatenate([[0], np.cumsum(acts)])
        return before[reach:reach + n] > before[:n]

    def _end_block(self, columns: np.ndarray, alive: np.ndarray, dropped_at: np.ndarray, first: int, n: int) -> None:
        """After a block of n queries: note when each column dropped in it left (dropped_at: the step after
        which it did; n: not dropped) and hold only the alive columns."""
        if self.policy.kind != "compression":  # compression sets evicted_at itself, by position
            h, j = np.nonzero((dropped_at >= 0) & (dropped_at < n))
            self.evicted_at[h, columns[h, j]] = first + dropped_at[h, j] + 1
        self._keep_columns(columns, alive)

    def _keep_columns(self, columns: np.ndarray, alive: np.ndarray) -> None:
        """After a block: hold the alive columns only, and drop the others from the policy's arrays."""
        counts = alive.sum(1)
        width = int(counts.max())
        if (counts == width).all():  # always so for eviction: each head drops as many tokens as the others
            self.slots = columns[alive].reshape(len(alive), width)
            if self.policy.kind == "eviction":  # its per-token state is per column (compression's is by position)
                self.state = {name: a[alive].reshape(a.shape[0], width)
                              if isinstance(a, np.ndarray) and a.shape == alive.shape else a
                              for name, a in self.state.items()}
            return
        # Heads hold different counts (compression with per-head budgets): pad with -1.
        self.slots = np.full((len(alive), width), -1, np.int64)
        for h in range(len(alive)):
            self.slots[h, : counts[h]] = columns[h, alive[h]]

    def _compress(self, attn, t: int, columns: np.ndarray, kept: np.ndarray, key, value, n_prompt, query,
                  by_head: np.ndarray | None = None) -> None:
        """After query t has read: remember its attention row (and each query head's, ``by_head``, when the
        policy asks), and compress if the schedule says so.

        The policy sees a CacheView by position (0..t), as it would in a model that removes tokens; building
        it costs O(t) but happens once per ``interval`` tokens (prompt mode) or once per prompt.
        """
        policy = self.policy
        if policy.window_queries:
            self.window_rows.append((columns, attn, query, t, by_head))
        if not policy.compresses_after(t, n_prompt):
            return
        # The window's attention rows; none for a policy that reads its queries but no attention (Compactor).
        rows_read = self.window_rows if policy.uses_attention else ()
        window = np.zeros((self.n_kv_heads, len(rows_read), t + 1))
        window_heads = None
        if policy.window_by_query_head:
            window_heads = np.zeros((self.n_kv_heads, query.shape[1], len(rows_read), t + 1))
        for j, (where, row, _, _, rows) in enumerate(rows_read):
            heads, cols = np.nonzero(where >= 0)  # -1 pads a head that holds fewer tokens: it has no position
            window[heads, j, where[heads, cols]] = row[heads, cols]
            if window_heads is not None and rows is not None:
                window_heads[heads, :, j, where[heads, cols]] = rows[heads, :, cols]
        held = self.alive[:, : t + 1]
        queries = (torch.stack([row[2] for row in self.window_rows], 2) if self.window_rows
                   else key.new_zeros(self.n_kv_heads, 0, 0, key.shape[-1]))
        keys, values = (key[:, : t + 1], value[:, : t + 1]) if self.forms is None else \
            self.forms.held(key, value, t + 1)
        view = CacheView(t=t, n_prompt=n_prompt, layer=self.layer, n_layers=self.n_layers, attn_window=window,
                         keys=keys, values=values, kept=held.copy(), state=self.state,
                         queries=queries, query_positions=np.array([row[3] for row in self.window_rows], np.int64),
                         rope=self.rope, attn_window_heads=window_heads, output=self.output)
        keep = policy.keep(view)
        dropped = held & ~keep
        if self.forms is not None:
            self.forms.apply(policy.reform(view, keep & held), t, key, value)
        self.alive[:, : t + 1] &= ~dropped
        self.evicted_at[:, : t + 1][dropped] = t + 1
        kept &= np.take_along_axis(self.alive, np.maximum(columns, 0), axis=1)

    # --- attending policies (SparQ, ReAttention) ------------------------------------------------------

    def run_attending(self, block: Block) -> torch.Tensor:
        """An attending policy computes the block's output itself; record what it read."""
        self._extend(block.k.shape[1])
        self.state, result = self.policy.attend_block(self.state, block)
        self.spans.add(result.reads, block.first)
        if self.top is not None:
            self.top.add(torch.from_numpy(result.attn), torch.arange(block.k.shape[1]).expand(self.n_kv_heads, -1))
        for name, values in result.stats.items():
            self.stat_rows.setdefault(name, []).extend(values)
        return result.out

    def fork(self) -> "RowLayerState":
        """A copy that goes on from here with its own policy state; it records nothing."""
        twin = copy.copy(self)
        twin.state = copy.deepcopy(self.state)
        twin.slots, twin.alive, twin.evicted_at = self.slots.copy(), self.alive.copy(), self.evicted_at.copy()
        twin.forms = None if self.forms is None else self.forms.fork()
        twin.window_rows = copy.copy(self.window_rows)
        twin.spans = _NoSpans() if self.spans is not None else None
        twin.top, twin.stat_rows = None, {}
        return twin

    def stats(self) -> dict[str, np.ndarray]:
        """Per-step numbers recorded by an attending policy: name -> [T, ...]."""
        return {name: np.stack(rows) for name, rows in self.stat_rows.items()}

    def compress_now(self, t: int, key: torch.Tensor, value: torch.Tensor, n_prompt: int | None) -> None:
        """Compress after query t, between forward calls: a compression policy whose scores come from a side
        pass (KVzip's reconstruction, backend/engine/reconstruction.py) keeps ``policy.keep`` of what is cached, by
        position, as ``_compress`` does. key/value [H, >= t+1, d]: this row's keys and values."""
        held = self.alive[:, : t + 1]
        view = CacheView(t=t, n_prompt=n_prompt, layer=self.layer, n_layers=self.n_layers,
                         attn_window=np.zeros((self.n_kv_heads, 0, t + 1)), keys=key[:, : t + 1],
                         values=value[:, : t + 1], kept=held.copy(), state=self.state, rope=self.rope)
        dropped = held & ~self.policy.keep(view)
        if not dropped.any():
            return
        self.alive[:, : t + 1] &= ~dropped
        self.evicted_at[:, : t + 1][dropped] = t + 1
        columns = self.slots
        self._keep_columns(columns, (columns >= 0) & np.take_along_axis(self.alive, np.maximum(columns, 0), 1))


class HeldForms:
    """The form of the tokens one row holds in one layer, for a policy that ``reforms`` them (ThinK's pruned key
    channels, CaM's merged values, KIVI's quantised keys and values): its own keys and values of positions
    0..P-1, read in place of the model's, and the record of what changed (the trace's ``form_*`` arrays)."""

    def __init__(self, n_kv_heads: int):
        self.keys: torch.Tensor | None = None  # [H, P, d], the model's dtype
        self.values: torch.Tensor | None = None
        self.reformed_at = np.zeros((n_kv_heads, 0), np.int32)  # the step from which a token is read reformed, -1
        self.key_error = np.zeros((n_kv_heads, 0), np.float32)  # |k' - k| / |k| of its latest form, 0 when whole
        self.value_error = np.zeros((n_kv_heads, 0), np.float32)
        self.merged_into = np.zeros((n_kv_heads, 0), np.int32)  # where a dropped token's value went, -1 nowhere
        self.merge_weight = np.zeros((n_kv_heads, 0), np.float32)
        self.channels: list[tuple] = []  # (step, kept bool [H, d], logit error [H]) at each channel pruning
        # Per channel [H, d]: sum |k' - k| / sum |k| over the held tokens at the latest reform (and for values).
        self.key_channel_error: np.ndarray | None = None
        self.value_channel_error: np.ndarray | None = None
        # Per query [H, T]: what reading the held forms did to its attention, against the same tokens read whole:
        # the total variation between the two softmax rows, and |o' - o| / |o| of the outputs (query heads' mean).
        self.attention_shift = np.zeros((n_kv_heads, 0), np.float32)
        self.output_error = np.zeros((n_kv_heads, 0), np.float32)

    def extend(self, total: int) -> None:
        new = total - self.reformed_at.shape[1]
        if new <= 0:
            return
        heads = len(self.reformed_at)

        def grown(a, fill):
            return np.concatenate([a, np.full((heads, new), fill, a.dtype)], 1)

        self.reformed_at, self.merged_into = grown(self.reformed_at, -1), grown(self.merged_into, -1)
        self.key_error, self.value_error = grown(self.key_error, 0), grown(self.value_error, 0)
        self.merge_weight = grown(self.merge_weight, 0)
        self.attention_shift, self.output_error = grown(self.attention_shift, 0), grown(self.output_error, 0)

    def read(self, keys: torch.Tensor, values: torch.Tensor, heads: torch.Tensor, at: torch.Tensor):
        """The keys and values [H, C, d] gathered at positions ``at`` [H, C], in the form this row holds them."""
        if self.keys is None:
            return keys, values
        covered = self.keys.shape[1]
        inside = (at < covered)[..., None]
        at = at.clamp(max=covered - 1)
        return torch.where(inside, self.keys[heads, at], keys), torch.where(inside, self.values[heads, at], values)

    def measure(self, first: int, q: torch.Tensor, probs: torch.Tensor, out: torch.Tensor, scores: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor, scaling: float, softcap: float | None) -> None:
        """What the held forms did to the block's queries: the same query [H, G, n, d] over the same columns, read
        as the model computed them (``keys``, ``values`` [H, C, d]), against ``probs`` and ``out`` as read; the
        block's ``scores`` carry -inf where a query did not read."""
        whole = attention_logits(q, keys[:, None], scaling, softcap).masked_fill_(torch.isneginf(scores),
                                                                                  float("-inf"))
        exact = torch.softmax(whole, -1)
        shift = 0.5 * (probs.float() - exact.float()).abs().sum(-1)  # [H, G, n]
        exact_out = (exact @ values[:, None]).float()
        error = torch.linalg.vector_norm(out.float() - exact_out, dim=-1) / \
            torch.linalg.vector_norm(exact_out, dim=-1).clamp_min(1e-12)
        n = q.shape[2]
        self.attention_shift[:, first:first + n] = shift.mean(1).cpu().numpy()
        self.output_error[:, first:first + n] = error.mean(1).cpu().numpy()

    def held(self, key: torch.Tensor, value: torch.Tensor, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..upto-1 [H, upto, d] as held: the row's own forms, then the model's keys and values."""
        if self.keys is None:
            return key[:, :upto], value[:, :upto]
        covered = min(self.keys.shape[1], upto)
        return (torch.cat([self.keys[:, :covered], key[:, covered:upto]], 1),
                torch.cat([self.values[:, :covered], value[:, covered:upto]], 1))

    def apply(self, reform, t: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Hold the reformed tokens of a compression after query t in their new form (``Reform``)."""
        if reform is None:
            return
        keys, values = self.held(key, value, t + 1)
        changed = torch.from_numpy(np.asarray(reform.positions, bool)).to(keys.device)[..., None]
        if reform.keys is not None:
            keys = torch.where(changed, torch.as_tensor(reform.keys).to(keys), keys)
        if reform.values is not None:
            values = torch.where(changed, torch.as_tensor(reform.values).to(values), values)
        self.keys, self.values = keys, values
        first = np.asarray(reform.positions, bool) & (self.reformed_at[:, : t + 1] < 0)
        self.reformed_at[:, : t + 1][first] = t + 1
        self.key_error[:, : t + 1] = _relative_error(keys, key[:, : t + 1])
        self.value_error[:, : t + 1] = _relative_error(values, value[:, : t + 1])
        self.key_channel_error = _channel_error(keys, key[:, : t + 1])
        self.value_channel_error = _channel_error(values, value[:, : t + 1])
        if reform.channels is not None:
            error = np.full(len(reform.channels), np.nan) if reform.channel_error is None else reform.channel_error
            self.channels.append((t, np.asarray(reform.channels, bool), np.asarray(error, np.float32)))
        if reform.merged_into is not None:
            into = np.asarray(reform.merged_into)
            self.merged_into[:, : t + 1] = np.where(into >= 0, into, self.merged_into[:, : t + 1])
            self.merge_weight[:, : t + 1] = np.where(into >= 0, reform.merge_weight, self.merge_weight[:, : t + 1])

    def fork(self) -> "HeldForms":
        twin = copy.copy(self)  # the tensors are replaced, never changed in place
        for name in ("reformed_at", "key_error", "value_error", "merged_into", "merge_weight", "attention_shift",
                     "output_error"):
            setattr(twin, name, getattr(self, name).copy())
        twin.channels = list(self.channels)
        return twin

    def arrays(self, length: int, reforms: str) -> dict[str, np.ndarray]:
        """This (layer, row)'s part of the trace's ``form_*`` arrays over ``length`` tokens (docs/trace-format.md)."""
        out = {"reformed_at": np.where(self.reformed_at[:, :length] > length, -1, self.reformed_at[:, :length]),
               "key_error": self.key_error[:, :length].astype(np.float16),
               "value_error": self.value_error[:, :length].astype(np.float16),
               "attention_shift": self.attention_shift[:, :length].astype(np.float16),
               "output_error": self.output_error[:, :length].astype(np.float16)}
        dim = 0 if self.keys is None else self.keys.shape[-1]
        for name in ("key_channel_error", "value_channel_error"):
            error = getattr(self, name)
            out[name] = (np.zeros((len(self.reformed_at), dim)) if error is None else error).astype(np.float16)
        if reforms == "merge":
            out.update(merged_into=self.merged_into[:, :length], merge_weight=self.merge_weight[:, :length])
        if reforms == "channels":
            done = [c for c in self.channels if c[0] < length]
            heads, dim = len(self.reformed_at), 0 if self.keys is None else self.keys.shape[-1]
            out.update(channel_steps=np.array([t for t, _, _ in done], np.int32),
                       channels=np.stack([m for _, m, _ in done]) if done else np.zeros((0, heads, dim), bool),
                       channel_error=np.stack([e for _, _, e in done]) if done else np.zeros((0, heads), np.float32))
        return out


def _channel_error(held: torch.Tensor, computed: torch.Tensor) -> np.ndarray:
    """sum_t |held - computed| / sum_t |computed| per channel [H, d] (float32)."""
    computed = computed.float()
    error = (held.float() - computed).abs().sum(1)
    return (error / computed.abs().sum(1).clamp_min(1e-12)).cpu().numpy()


def _relative_error(held: torch.Tensor, computed: torch.Tensor) -> np.ndarray:
    """|held - computed| / |computed| per token [H, T] (float32)."""
    computed = computed.float()
    error = torch.linalg.vector_norm(held.float() - computed, dim=-1)
    return (error / torch.linalg.vector_norm(computed, dim=-1).clamp_min(1e-12)).cpu().numpy()


# MKL multiplies a matrix of fewer than this many rows with another kernel on AMD processors, whose rounding differs
# (its strict reproducible mode holds on Intel's only): a block of a few tokens carries at least this many rows
# through the model where it has them (``PolicyCache.batch_for``), so a row's numbers are the same in any batch.
FEWEST_PRODUCT_ROWS = 4


class PolicyCache(DynamicCache):
    """A DynamicCache whose batch row ``b`` is governed by ``policies[b]`` in every layer.

    A forward call may carry fewer rows than there are policies: the last rows, those that still read as Full
    (``batch_for``), then follow Full's row instead of computing their own, until they join (``grow_batch``)."""

    # Rows that read as Full take Full's prefill (False: every row computes its own, the same to the bit; tests).
    share: bool = True
    # A row whose policy decides alike in every layer walks each block in one layer and replays it in the others
    # (False: every layer walks, the same to the bit; tests).
    replay: bool = True

    def __init__(self, policies: list[Policy], n_layers: int, n_kv_heads: int, record_layers: tuple[int, ...] = (),
                 rope: Callable | Sequence[Callable] | None = None, record_top_k: int = 0,
                 features: ModelFeatures | None = None):
        """``rope``: the model's RoPE, one for every layer or one per layer (Gemma 3 rotates its local and global
        layers apart; a NoPE layer not at all); ``features``: the model's (features.py), where the queries and
        keys before RoPE are captured."""
        super().__init__()
        self.features = features
        ropes = list(rope) if isinstance(rope, (list, tuple)) else [rope] * n_layers
        self.layer_class_to_replicate = GrowingLayer  # each layer appends in place (cache_layer.py)
        self.policies = list(policies)
        self.record_layers = tuple(record_layers)
        self.ropes = ropes  # per layer rope(x, positions): the model's RoPE, for policies that re-rotate keys
        self.needs_prerope = any(p.needs_prerope for p in self.policies)
        self.capturing = True  # False during a side pass (``side_pass``)
        self.prerope_q: dict[int, torch.Tensor] = {}  # layer -> this block's queries before RoPE
        self.prerope_k: dict[int, GrowingTensor] = {}  # layer -> every key so far, before RoPE
        self.recorded_k: dict[int, list[torch.Tensor]] = {}  # recorded layer -> blocks of keys before RoPE
        self.record_top_k = record_top_k  # entries kept of each recorded attention row
        outputs = ([None if layer.output is None else layer.output.weight.detach() for layer in features.layers]
                   if features is not None else [None] * n_layers)
        decided = [DecidedBlock() if self.replay and p.decides_alike_in_every_layer() else None
                   for p in self.policies]
        self.rows = [[RowLayerState(p, n_kv_heads, record_top_k if layer in self.record_layers else 0, layer,
                                    n_layers, ropes[layer], outputs[layer], decided[b])
                      for b, p in enumerate(self.policies)]
                     for layer in range(n_layers)]
        self.decoding = False  # True: the next blocks' queries are decoding steps (see Block.decoding)
        self.n_prompt: int | None = None  # generate mode: where the prompt ends (compression policies act there)
        # The rows a forward call carries, in batch order, while some are idle: a row whose answer has ended (its
        # EOS read) goes through the model no more, so a row that rambles on costs the others nothing. None: the
        # leading rows (``batch_for``).
        self.members: tuple[int, ...] | None = None
        self.batch_rows = 0  # the rows in the batch so far (``grow_batch``)

    @property
    def idle(self) -> frozenset[int]:
        """The rows left out of the forward calls while their answers have ended (``members``)."""
        return frozenset() if self.members is None else frozenset(range(len(self.policies))) - set(self.members)

    def entries(self, batch: int) -> list[int]:
        """The rows of a forward call's ``batch`` batch entries, in order."""
        return list(range(batch)) if self.members is None else list(self.members)

    def in_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [len(members), ...], a forward call's entries, as [rows, ...]: an idle row's entry is zeros, which no
        query reads (its trace ends where it went idle). x itself when the call carries the leading rows."""
        if self.members is None:
            return x
        every = x.new_zeros((len(self.policies), *x.shape[1:]))
        every[list(self.members)] = x
        return every

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return super().update(self.in_rows(key_states), self.in_rows(value_states), layer_idx, *args, **kwargs)

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float, softcap: float | None = None, window: int | None = None) -> torch.Tensor:
        """query [B, H, n, d], key/value [B, H_kv, M, d] (every token so far) -> output [B, n, H, d]."""
        batch, n_q_heads, n, dim = query.shape
        n_kv_heads, total = key.shape[1], key.shape[2]
        group = n_q_heads // n_kv_heads
        first = total - n
        entry = {b: i for i, b in enumerate(self.entries(batch))}  # row -> its entry in the batch (key, value: row)
        # The rows that walk on the device walk together, in one launch for the layer (``DeviceWalk``).
        together = self._walk_on_device(layer, query, key, value, scaling, softcap, window, entry) if any(
            self.rows[layer][b].walks_on_device(query.device)
            and not self.rows[layer][b].reads_as_full(total, self.n_prompt) for b in entry) else {}
        outputs, idle = [], self.idle
        for b, state in enumerate(self.rows[layer]):
            if b in idle:  # out of the batch: no policy decides for it and nothing is recorded
                continue
            if b not in entry:  # not in the batch: it reads as Full and takes Full's queries, keys and values (``share``)
                full_q = query[0].view(n_kv_heads, group, n, dim)
                state.begin(total, softcap, window)
                if state.top is not None:
                    state._attend_full(full_q, key[0], value[0], first, scaling)  # what it read, recorded
                state.follow(full_q, key[0], value[0], first, scaling, self.n_prompt)
                continue
            if b in together:
                outputs.append(together[b])
                continue
            if state.policy.attends and not state.reads_as_full(total, self.n_prompt):
                block = Block(q=query[entry[b]], k=key[b], v=value[b], first=first, scaling=scaling, rope=self.ropes[layer],
                              softcap=softcap, window=window,
                              decoding=self.decoding, layer=layer, n_layers=len(self.rows), n_prompt=self.n_prompt,
                              q_pre=self.prerope_q[layer][b] if self.needs_prerope else None,
                              k_pre=self.prerope_k[layer].filled[b] if self.needs_prerope else None)
                outputs.append(state.run_attending(block).to(query.dtype))
                continue
            # Query head h shares KV head h // group (transformers' repeat_kv order).
            q = query[entry[b]].view(n_kv_heads, group, n, dim)
            out = state.attend(q, key[b], value[b], first, scaling, self.n_prompt, softcap, window)
            outputs.append(out.reshape(n_q_heads, n, dim).transpose(0, 1))
        return torch.stack(outputs).contiguous()

    def _walk_on_device(self, layer, query, key, value, scaling, softcap, window, entry) -> dict[int, torch.Tensor]:
        """The block's output [n, H, d] of each row of ``layer`` that walks on the device, all at once: their
        held keys gathered, scored and walked together (``DeviceWalk``), with one copy to the device and one back.
        ``entry``: each row in the batch -> its entry."""
        batch, n_q_heads, n, dim = query.shape
        n_kv_heads, total = key.shape[1], key.shape[2]
        first = total - n
        walking = [b for b in entry if self.rows[layer][b].walks_on_device(query.device)
                   and not self.rows[layer][b].reads_as_full(total, self.n_prompt)]
        # The rows that walk alike side by side: one launch for each (``eviction_walk_triton.launches``).
        way = eviction_walk_triton.launches(np.array([self.rows[layer][b].walk_params() for b in walking]))
        walking = [walking[i] for i in np.argsort(way, kind="stable")]
        rows = [self.rows[layer][b] for b in walking]
        for row in rows:
            row.begin(total, softcap, window)
        columns = [row.block_columns(first, n) for row in rows]
        # The rows' batch rows (keys and values are by row, queries by entry) go to the device with the walk's data.
        walk = DeviceWalk(rows, columns, first, query.device, indices=[walking, [entry[b] for b in walking]],
                          window=window if window is not None and window < total else None)
        at = walk.where.clamp(min=0)  # [R, H, C]; a front pad reads position 0, at no weight
        heads = torch.arange(n_kv_heads, device=query.device)[:, None]
        # Every row's held keys and values in one gather each: a launch for the layer, however many rows walk.
        batch = walk.indices[0][:, None, None]
        keys, values = key[batch, heads, at], value[batch, heads, at]  # [R, H, C, d]
        q = query[walk.indices[1]].view(len(walking), n_kv_heads, n_q_heads // n_kv_heads, n, dim)
        scores = attention_logits(q, keys[:, :, None], scaling, softcap)  # [R, H, G, n, C]
        # -inf for the pads and, on a sliding-window layer, the held keys its window has passed.
        probs, attn = walk.run(scores.masked_fill_(walk.hidden(), float("-inf")))
        out = probs @ values[:, :, None]  # [R, H, G, n, d]
        for r, (row, start) in enumerate(zip(rows, walk.starts)):
            if row.top is not None:
                row.top.add(torch.from_numpy(attn[r, :, :, start:]), torch.from_numpy(columns[r]))
        return {b: out[r].reshape(n_q_heads, n, dim).transpose(0, 1) for r, b in enumerate(walking)}

    def batch_for(self, end: int, tokens: int | None = None) -> int:
        """How many of the leading rows go through the model in a block of ``tokens`` tokens that ends before
        position ``end``. With ``share``, a row whose every query so far reads as Full's (``Policy.first_departure``
        >= ``end``) is left out: it takes Full's prefill instead (``PolicyCache.attend``, ``grow_batch``). The runner
        orders the rows by departure, so those left out are the last. Rows that joined stay in; a block of fewer than
        ``FEWEST_PRODUCT_ROWS`` tokens carries enough rows for products of that many rows, where there are."""
        if not self.share or self.policies[0].kind != "full":  # Full's row is the one they follow
            return len(self.policies)
        inside = [b for b, policy in enumerate(self.policies) if policy.first_departure(self.n_prompt) < end or b == 0]
        if inside != list(range(len(inside))):
            raise ValueError("the rows that share Full's prefill must come last (ordered by first departure)")
        fewest = 0 if tokens is None else min(len(self.policies), -(-FEWEST_PRODUCT_ROWS // tokens))
        return max(len(inside), fewest, self.batch_rows)

    def grow_batch(self, size: int) -> None:
        """Bring the rows up to ``size`` into the batch before a forward call. Each joins with Full's cache (row
        0's keys and values, and what else is kept per batch row), which is its own to the bit: until now it has
        read as Full."""
        self.batch_rows = max(self.batch_rows, size)
        for layer in self.layers:
            if isinstance(layer, GrowingLayer):
                layer.grow_rows(size)
        for keys in self.prerope_k.values():
            keys.grow_rows(size)
        self.recorded_k = {layer: [rows_up_to(part, size) for part in parts]
                           for layer, parts in self.recorded_k.items()}
        if self.fed is not None:
            self.fed = rows_up_to(self.fed, size)

    def fork(self) -> "PolicyCache":
        """A copy that can read other tokens from here on (the runner scores Full's continuation this way).

        Key and value buffers are shared until either side appends (GrowingLayer copies on append). Policy
        states are copied; the copy records nothing.
        """
        twin = copy.copy(self)
        twin.layers = [copy.copy(layer) for layer in self.layers]
        twin.prerope_q = dict(self.prerope_q)
        twin.prerope_k = {layer: copy.copy(keys) for layer, keys in self.prerope_k.items()}
        twin.record_layers, twin.recorded_k = (), {}
        twin.rows = [[state.fork() for state in layer] for layer in self.rows]
        return twin

    def evicted_at(self, row: int) -> np.ndarray:
        """int32 [L, H_kv, T] for batch row ``row`` (see docs/trace-format.md)."""
        return np.stack([layer[row].evicted_at for layer in self.rows])

    def spans(self, row: int, length: int) -> ReadSpans:
        """What a selection row's queries read, over its first ``length`` steps."""
        per_layer = []
        for layer in self.rows:
            recorder = layer[row].spans  # finishing leaves it as it was
            per_layer.append([(p[s < length], s[s < length], np.minimum(e[s < length], length))
                              for p, s, e in recorder.finish(length)])
        return ReadSpans.join(per_layer, length)

    def selected(self, row: int) -> np.ndarray:
        """bool [L, H_kv, T, T] for a selection row (small texts and tests)."""
        return self.spans(row, self.rows[0][row].evicted_at.shape[1]).dense()

    def recorded_attention(self, row: int, length: int) -> TopAttention:
        """The recorded layers' attention rows (top-k entries each) over the first ``length`` steps."""
        parts = [self.rows[layer][row].top.rows(length) for layer in self.record_layers]
        return TopAttention(pos=np.stack([p for p, _ in parts]), val=np.stack([v for _, v in parts]))

    def recorded_keys(self, row: int, positions: np.ndarray) -> np.ndarray:
        """Keys before RoPE, float16 [R, H_kv, S, d], of the recorded layers at ``positions``."""
        index = torch.from_numpy(positions.astype(np.int64))
        # A block that left the row out of the batch (it took Full's prefill, ``share``) holds Full's keys for it.
        return np.stack([torch.cat([part[row if row < len(part) else 0] for part in self.recorded_k[layer]], 1)
                         [:, index].float().cpu().numpy()
                         for layer in self.record_layers]).astype(np.float16)

    def forms(self, row: int, length: int) -> dict[str, np.ndarray]:
        """A reforming row's held forms over its first ``length`` tokens, as the trace's ``form_*`` arrays: per
        layer stacked [L, ...], but ``channels`` [C, L, H, d] at the C steps ``channel_steps`` (the same in every
        layer: compressions follow the schedule, not the layer)."""
        layers = [layer[row].forms.arrays(length, layer[row].policy.reforms) for layer in self.rows]
        out = {f"form_{name}": np.stack([part[name] for part in layers]) for name in layers[0]}
        if "form_channels" in out:
            out["form_channels"] = out["form_channels"].swapaxes(0, 1)
            out["form_channel_error"] = out["form_channel_error"].swapaxes(0, 1)
            out["form_channel_steps"] = layers[0]["channel_steps"]
        return out

    def stats(self, row: int) -> dict[str, np.ndarray]:
        """An attending policy's per-step numbers: name -> [L, T, ...]."""
        per_layer = [layer[row].stats() for layer in self.rows]
        return {name: np.stack([layer[name] for layer in per_layer]) for name in per_layer[0]}

    def capture_prerope(self, model) -> "PreRopeCapture":
        """Context manager: while active, keep queries and keys before RoPE (every layer's for policies
        that select with them, the recorded layers' keys for the trace)."""
        return PreRopeCapture(model, self)

    # --- side passes (KVzip's reconstruction, backend/engine/reconstruction.py) ---------------------------------
    # Replaced, never changed in place, so a fork keeps its own: the tokens fed so far [B, T] (kept when a row
    # re-reads its context), and per row the tokens it fed through the model outside the text.
    fed: "torch.Tensor | None" = None
    extra_pass_tokens: tuple[int, ...] = ()

    def feed(self, ids: torch.Tensor, start: int) -> None:
        """Remember ids [B, n] fed at positions start.. when a row's policy re-reads its context."""
        if any(p.rereads for p in self.policies):
            ids = self.in_rows(ids)
            past = ids[:, :0].cpu() if self.fed is None else self.fed[:, :start]
            self.fed = torch.cat([past, ids.cpu()], 1)

    @contextmanager
    def side_pass(self) -> Iterator[None]:
        """While active, forward calls through the model are not part of the text: PreRopeCapture's hooks,
        which fire on every forward, leave this cache's captured queries and keys alone."""
        self.capturing = False
        try:
            yield
        finally:
            self.capturing = True

    def add_extra_pass(self, row: int, tokens: int) -> None:
        counts = list(self.extra_pass_tokens) or [0] * len(self.policies)
        counts[row] += tokens
        self.extra_pass_tokens = tuple(counts)


class PreRopeCapture:
    """Forward hooks (PyTorch's own extension point) on each attention layer's query and key
    projections: they see the vectors before RoPE, which ReAttention selects with and traces record."""

    def __init__(self, model, cache: PolicyCache):
        self.model, self.cache, self.handles = model, cache, []

    def _hook(self, layer: int, which: str, capture: Capture):
        n_heads_attr = "num_attention_heads" if which == "q" else "num_key_value_heads"
        n_heads = getattr(self.model.config, n_heads_attr)
        cache = self.cache

        def store(_module, _inputs, output):
            if not cache.capturing:
                return
            x = cache.in_rows(capture.heads(which, output, n_heads))  # [B, H, n, d]
            if which == "q":
                cache.prerope_q[layer] = x
                return
            if cache.needs_prerope:
                cache.prerope_k.setdefault(layer, GrowingTensor()).append(x)
            if layer in cache.record_layers:
                cache.recorded_k.setdefault(layer, []).append(x.to(torch.float16))

        return (capture.q_module if which == "q" else capture.k_module).register_forward_hook(store)

    def __enter__(self):
        features = self.cache.features or read_features(self.model)
        for layer, feature in enumerate(features.layers):
            if self.cache.needs_prerope:
                self.handles.append(self._hook(layer, "q", feature.capture))
            if self.cache.needs_prerope or layer in self.cache.record_layers:
                self.handles.append(self._hook(layer, "k", feature.capture))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def kvlens_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers calls this for every attention layer; ``kv_lens`` (a PolicyCache) makes the call
    instrumented, anything else is the plain model. The module hands over its features with the call: its
    ``scaling``, and ``softcap`` and ``sliding_window`` where it has them (Gemma)."""
    cache = kwargs.pop("kv_lens", None)
    softcap = kwargs.get("softcap")
    if cache is None:
        if softcap is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          scaling=scaling, dropout=dropout, **kwargs)
        return _capped_attention(query, key, value, attention_mask, scaling, softcap,
                                 kwargs.get("sliding_window")), None
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")
    return cache.attend(module.layer_idx, query, key, value, scaling, softcap, window), None


def _capped_attention(query, key, value, attention_mask, scaling, softcap, window) -> torch.Tensor:
    """The plain model's attention with soft-capped logits (SDPA has no soft-capping): [B, n, H, d]. The mask is
    the one transformers builds for this implementation, or causal (and the layer's window) where it built none."""
    batch, n_q_heads, n, dim = query.shape
    total = key.shape[2]
    group = n_q_heads // key.shape[1]
    q = query.view(batch, key.shape[1], group, n, dim)
    scores = attention_logits(q, key[:, :, None], scaling if scaling is not None else dim ** -0.5, softcap)
    if attention_mask is None:
        mask = visible_keys(total - n, n, total, window, query.device)[None, None, None]
    elif attention_mask.dtype == torch.bool:
        mask = attention_mask[:, :, None, :, -total:]
    else:
        mask = attention_mask[:, :, None, :, -total:] == 0
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, -1) @ value[:, :, None]
    return out.reshape(batch, n_q_heads, n, dim).transpose(1, 2).contiguous()


AttentionInterface.register(ATTN_IMPLEMENTATION, kvlens_attention)
# Baseline calls (no kv_lens) need the ordinary causal mask for SDPA.
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
