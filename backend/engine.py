"""The instrumented attention: a transformers ``Cache`` that carries one policy per batch row.

Plugging in uses transformers' own extension points only. ``kvlens_attention`` is registered with
``AttentionInterface`` under the name "kvlens"; models are loaded with that implementation. A forward
call that passes ``kv_lens=<PolicyCache>`` gets policy-masked attention; any other call falls back to
plain SDPA, so one loaded model serves both instrumented and baseline runs.

How a block of ``n`` new queries is processed (``n = 1`` when decoding, the whole text or a chunk
of it on the prompt path; the code is the same):

1. one matmul gives every score of the block against every cached key (per layer, all rows);
2. per batch row, the row's policy walks the block query by query (cheap numpy on one row each),
   deciding what query ``t`` reads; eviction policies drop a token once the cache is full, and
   compression policies, when their schedule says so (e.g. once the prompt has been read), keep their
   budget and drop the rest;
3. one masked softmax and one matmul give the attention output of the whole block.

Keys and values of dropped tokens stay in storage but are masked out for every later query: the
attention is the same as if they had been removed (TOVA App. D computes it the same way), rows with
different budgets share one tensor, and every token keeps its own RoPE position (gaps, no shifts).
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .policies import Policy
from .policies.base import AttendingPolicy, Block, CacheView

ATTN_IMPLEMENTATION = "kvlens"


class RowLayerState:
    """What one policy has done in one layer of one batch row: its state, and what each head reads."""

    def __init__(self, policy: Policy, n_kv_heads: int, record: bool = False, layer: int = 0, n_layers: int = 1):
        self.policy = policy
        self.layer, self.n_layers = layer, n_layers
        self.window_rows: list[np.ndarray] = []  # compression policies: the last queries' attention rows
        self.record = record  # keep each query's attention row (for heatmaps and score curves)
        self.attention_rows: list[np.ndarray] = []
        self.state = policy.init_state(n_kv_heads)
        self.n_kv_heads = n_kv_heads
        self.alive = np.zeros((n_kv_heads, 0), bool)
        self.evicted_at = np.zeros((n_kv_heads, 0), np.int32)
        self.selected_rows: list[np.ndarray] = []  # selection policies: mask read by each query
        self.stat_rows: dict[str, list[np.ndarray]] = {}  # attending policies: per-step numbers

    def _extend(self, total: int) -> None:
        new = total - self.alive.shape[1]
        self.alive = np.concatenate([self.alive, np.ones((self.n_kv_heads, new), bool)], 1)
        self.evicted_at = np.concatenate([self.evicted_at, np.full((self.n_kv_heads, new), -1, np.int32)], 1)

    def run_block(self, scores: torch.Tensor, first: int, keys: torch.Tensor | None = None,
                  values: torch.Tensor | None = None, n_prompt: int | None = None) -> np.ndarray:
        """Walk queries ``first..first+n-1`` in order; return the read mask [H_kv, n, M].

        scores: [H_kv, G, n, M] pre-softmax scores of the block's queries against all M keys; keys, values:
        [H_kv, M, d] (read by compression policies); n_prompt: the prompt's length (generate mode) or None.
        """
        n_heads, _, n, total = scores.shape
        self._extend(total)
        causal = np.tri(n, total, first, dtype=bool)
        kind, policy = self.policy.kind, self.policy
        weights = None
        if kind == "selection" or policy.uses_attention or self.record:
            # exp(score - row max) once for the block; each step then only masks and normalises.
            s = scores.double().cpu().numpy()  # the policy's per-step decisions run in numpy
            s = np.where(causal[None, None], s, -np.inf)
            weights = np.exp(s - s.max(-1, keepdims=True))
        if kind == "full":
            if self.record:
                rows = (weights / weights.sum(-1, keepdims=True)).mean(1)
                self.attention_rows.extend(rows[:, i, : first + i + 1] for i in range(n))
            return np.broadcast_to(causal, (n_heads, n, total))
        reads = np.zeros((n_heads, n, total), bool)
        heads = np.arange(n_heads)
        for i in range(n):
            t = first + i
            if kind == "selection":
                row = weights[:, :, i, : t + 1]
                attn_full = (row / row.sum(-1, keepdims=True)).mean(1)
                self.state, mask = policy.select(self.state, attn_full, t)
                reads[:, i, : t + 1] = mask
                self.selected_rows.append(mask)
                if self.record:
                    row = row * mask[:, None]
                    self.attention_rows.append((row / row.sum(-1, keepdims=True)).mean(1))
                continue
            kept = self.alive[:, : t + 1]
            reads[:, i, : t + 1] = kept
            attn = None
            if weights is not None:
                row = weights[:, :, i, : t + 1] * kept[:, None]
                attn = (row / row.sum(-1, keepdims=True)).mean(1)
                if self.record:
                    self.attention_rows.append(attn)
            if kind == "compression":
                self._compress(attn, t, keys, values, n_prompt)
                continue
            self.state, victims = policy.step(self.state, attn, kept, t)
            if victims is not None:
                self.alive[heads, victims] = False
                self.evicted_at[heads, victims] = t + 1
        return reads

    def _compress(self, attn: np.ndarray | None, t: int, keys, values, n_prompt: int | None) -> None:
        """After query t has read: remember its attention row, and compress if the schedule says so."""
        policy = self.policy
        if policy.window_queries:
            self.window_rows = [*self.window_rows, attn][-policy.window_queries:]
        if not policy.compresses_after(t, n_prompt):
            return
        kept = self.alive[:, : t + 1]
        window = np.zeros((self.n_kv_heads, len(self.window_rows), t + 1))
        for j, row in enumerate(self.window_rows):
            window[:, j, : row.shape[-1]] = row
        view = CacheView(t=t, n_prompt=n_prompt, layer=self.layer, n_layers=self.n_layers, attn_window=window,
                         keys=keys[:, : t + 1].double().cpu().numpy(), values=values[:, : t + 1].double().cpu().numpy(),
                         kept=kept.copy(), state=self.state)
        dropped = kept & ~policy.keep(view)
        self.alive[:, : t + 1] &= ~dropped
        self.evicted_at[:, : t + 1][dropped] = t + 1

    def fork(self) -> "RowLayerState":
        """A copy that goes on from here with its own policy state; it records nothing and keeps no history."""
        twin = copy.copy(self)
        twin.record = False
        twin.state = copy.deepcopy(self.state)
        twin.alive, twin.evicted_at = self.alive.copy(), self.evicted_at.copy()
        twin.window_rows = list(self.window_rows)
        twin.attention_rows, twin.selected_rows, twin.stat_rows = [], [], {}
        return twin

    def run_attending(self, block: Block) -> tuple[torch.Tensor, np.ndarray]:
        """An attending policy computes the block's output itself; record what it read."""
        self.state, result = self.policy.attend_block(self.state, block)
        n = block.q.shape[1]
        for i in range(n):
            t = block.first + i
            self.selected_rows.append(result.reads[:, i, : t + 1])
            if self.record:
                self.attention_rows.append(result.attn[:, i, : t + 1])
        for name, values in result.stats.items():
            self.stat_rows.setdefault(name, []).extend(values)
        return result.out, result.reads

    def stats(self) -> dict[str, np.ndarray]:
        """Per-step numbers recorded by an attending policy: name -> [T, ...]."""
        return {name: np.stack(rows) for name, rows in self.stat_rows.items()}

    def selected(self) -> np.ndarray:
        """Selection policies: bool [H_kv, T, T], row t = the positions query t read."""
        return _lower_square(self.selected_rows, self.n_kv_heads, bool)

    def attention(self) -> np.ndarray:
        """Recorded rows as float32 [H_kv, T, T]: row t = query t's attention (mean over its query heads)."""
        return _lower_square(self.attention_rows, self.n_kv_heads, np.float32)


def _lower_square(rows: list[np.ndarray], n_heads: int, dtype) -> np.ndarray:
    """Stack per-step rows of growing length (row t has t + 1 entries) into [H, T, T]."""
    out = np.zeros((n_heads, len(rows), len(rows)), dtype)
    for t, row in enumerate(rows):
        out[:, t, : t + 1] = row
    return out


class PolicyCache(DynamicCache):
    """A DynamicCache whose batch row ``b`` is governed by ``policies[b]`` in every layer."""

    def __init__(self, policies: list[Policy], n_layers: int, n_kv_heads: int, record_layers: tuple[int, ...] = (),
                 rope: Callable | None = None):
        super().__init__()
        self.policies = list(policies)
        self.record_layers = tuple(record_layers)
        self.rope = rope  # rope(x, positions): the model's RoPE, for policies that re-rotate keys
        self.needs_prerope = any(getattr(p, "needs_prerope", False) for p in self.policies)
        self.prerope_q: dict[int, torch.Tensor] = {}  # layer -> this block's queries before RoPE
        self.prerope_k: dict[int, torch.Tensor] = {}  # layer -> every key so far, before RoPE
        self.rows = [[RowLayerState(p, n_kv_heads, layer in self.record_layers, layer, n_layers) for p in self.policies]
                     for layer in range(n_layers)]
        self.decoding = False  # True: the next blocks' queries are decoding steps (see Block.decoding)
        self.n_prompt: int | None = None  # generate mode: where the prompt ends (compression policies act there)

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """query [B, H, n, d], key/value [B, H_kv, M, d] (every token so far) -> output [B, n, H, d]."""
        batch, n_q_heads, n, dim = query.shape
        n_kv_heads, total = key.shape[1], key.shape[2]
        group = n_q_heads // n_kv_heads
        # Query head h shares KV head h // group (transformers' repeat_kv order).
        q = query.view(batch, n_kv_heads, group, n, dim)
        scores = torch.matmul(q, key.unsqueeze(2).transpose(-1, -2)) * scaling
        reads, own_outputs = [], {}
        for b, state in enumerate(self.rows[layer]):
            if isinstance(state.policy, AttendingPolicy):
                block = Block(q=query[b], k=key[b], v=value[b], first=total - n, scaling=scaling, rope=self.rope,
                              decoding=self.decoding,
                              q_pre=self.prerope_q[layer][b] if self.needs_prerope else None,
                              k_pre=self.prerope_k[layer][b] if self.needs_prerope else None)
                own_outputs[b], block_reads = state.run_attending(block)
                reads.append(block_reads)
            else:
                reads.append(state.run_block(scores[b], total - n, key[b], value[b], self.n_prompt))
        reads = np.stack(reads)
        bias = torch.zeros(reads.shape, dtype=scores.dtype, device=scores.device).masked_fill_(
            torch.from_numpy(~reads).to(scores.device), float("-inf"))
        probs = torch.softmax(scores + bias[:, :, None], dim=-1)
        out = torch.matmul(probs, value.unsqueeze(2)).reshape(batch, n_q_heads, n, dim).transpose(1, 2).contiguous()
        for b, own in own_outputs.items():
            out[b] = own.to(out.dtype)
        return out

    def fork(self) -> "PolicyCache":
        """A copy that can read other tokens from here on (the runner scores Full's continuation this way).

        Key and value tensors are shared: the cache grows them by concatenation and never writes in place.
        Policy states are copied; the copy records nothing.
        """
        twin = copy.copy(self)
        twin.layers = [copy.copy(layer) for layer in self.layers]
        twin.prerope_q, twin.prerope_k = dict(self.prerope_q), dict(self.prerope_k)
        twin.record_layers = ()
        twin.rows = [[state.fork() for state in layer] for layer in self.rows]
        return twin

    def evicted_at(self, row: int) -> np.ndarray:
        """int32 [L, H_kv, T] for batch row ``row`` (see docs/trace-format.md)."""
        return np.stack([layer[row].evicted_at for layer in self.rows])

    def selected(self, row: int) -> np.ndarray:
        """bool [L, H_kv, T, T] for a selection policy's batch row."""
        return np.stack([layer[row].selected() for layer in self.rows])

    def recorded_attention(self, row: int) -> np.ndarray:
        """float32 [R, H_kv, T, T] for the recorded layers (``record_layers``)."""
        return np.stack([self.rows[layer][row].attention() for layer in self.record_layers])

    def stats(self, row: int) -> dict[str, np.ndarray]:
        """An attending policy's per-step numbers: name -> [L, T, ...]."""
        per_layer = [layer[row].stats() for layer in self.rows]
        return {name: np.stack([layer[name] for layer in per_layer]) for name in per_layer[0]}

    def capture_prerope(self, model) -> "PreRopeCapture":
        """Context manager: while active, keep every layer's queries and keys before RoPE."""
        return PreRopeCapture(model, self)

    def recorded_keys(self, row: int) -> np.ndarray:
        """Keys after RoPE, float32 [R, H_kv, T, d], for the recorded layers."""
        return np.stack([self.layers[layer].keys[row].float().cpu().numpy() for layer in self.record_layers])


class PreRopeCapture:
    """Forward hooks (PyTorch's own extension point) on each attention layer's query and key
    projections: they see the vectors before RoPE, which ReAttention selects with."""

    def __init__(self, model, cache: PolicyCache):
        self.model, self.cache, self.handles = model, cache, []

    def _hook(self, layer: int, which: str, module):
        n_heads_attr = "num_attention_heads" if which == "q" else "num_key_value_heads"
        n_heads = getattr(self.model.config, n_heads_attr)

        def store(_module, _inputs, output):
            batch, n = output.shape[:2]
            x = output.reshape(batch, n, n_heads, -1).transpose(1, 2)  # [B, H, n, d]
            if which == "q":
                self.cache.prerope_q[layer] = x
            else:
                past = self.cache.prerope_k.get(layer)
                self.cache.prerope_k[layer] = x if past is None else torch.cat([past, x], dim=2)

        return module.register_forward_hook(store)

    def __enter__(self):
        if self.cache.needs_prerope:
            for layer, block in enumerate(self.model.model.layers):
                attn = block.self_attn
                # Qwen3-style models normalise q and k after the projection: RoPE comes after that.
                q_mod = getattr(attn, "q_norm", None) or attn.q_proj
                k_mod = getattr(attn, "k_norm", None) or attn.k_proj
                self.handles += [self._hook(layer, "q", q_mod), self._hook(layer, "k", k_mod)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def kvlens_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cache = kwargs.pop("kv_lens", None)
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    return cache.attend(module.layer_idx, query, key, value, scaling), None


AttentionInterface.register(ATTN_IMPLEMENTATION, kvlens_attention)
# Baseline calls (no kv_lens) need the ordinary causal mask for SDPA.
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
