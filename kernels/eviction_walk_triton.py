"""The eviction walk as one Triton program per block, so that a GPU keeps the decisions on the device.

The same walk as ``kernels/eviction_walk.py`` (numba, on the CPU) for the running-score policies (Window,
sinks, H2O, TOVA, A2SF), step for step: what each query reads, its attention row, the running score, and
the column each head (or the layer) drops once it holds ``budget`` tokens. On a GPU the numpy walk would
copy every step's decision to the host; here one launch walks a whole block of queries of one (layer,
batch row) with the state in registers, and the engine reads the outcome once per block
(``RowLayerState._walk_device``). Its reference is the numba walk, and through it the numpy walk:
tests/test_eviction_walk.py runs this kernel under ``TRITON_INTERPRET=1`` against them.

One program holds the row's [heads, columns] tiles (columns: the tokens held at the block's start plus
the block's own, ``budget + chunk`` at most), so the layer-wise policies can combine the heads' scores
at each step without a second launch. Ties drop the earliest column, as ``argmin`` does; a head whose
columns are all protected drops column 0, as the numba walk does.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine keeps its other walks
    triton = None


NUM_WARPS = 4  # warps of the one program that walks a block (benchmarks/walk.py --warps times others)


def usable(scores: torch.Tensor) -> bool:
    """Triton can walk these scores: on a GPU, or anywhere under TRITON_INTERPRET=1 (the tests)."""
    return triton is not None and (scores.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _walk_kernel(w_ptr, alive_ptr, pos_ptr, state_ptr, probs_ptr, dropped_ptr, attn_ptr,
                     decay_ptr, n, C, first, held, budget, sinks, recent,
                     H: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                     BY_POSITION: tl.constexpr, LAYER: tl.constexpr, RECORD: tl.constexpr):
        h = tl.arange(0, BLOCK_H)[:, None]
        col = tl.arange(0, BLOCK_C)[None, :]
        real = (h < H) & (col < C)
        at = h * C + col
        alive = (tl.load(alive_ptr + at, mask=real, other=0) != 0) & real
        pos = tl.load(pos_ptr + at, mask=real, other=0)
        state = tl.load(state_ptr + at, mask=real, other=0.0).to(tl.float64)
        dropped = tl.load(dropped_ptr + at, mask=real, other=-1)
        decay = tl.load(decay_ptr)  # float64: a Python float argument would arrive as float32
        for i in range(n):
            t = first + i
            c = held + i + 1  # columns 0..c-1 exist for query t
            alive = alive | ((col == c - 1) & (h < H))
            a = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float64)
            for g in tl.static_range(G):
                row = ((h * G + g) * n + i) * C + col
                w = tl.load(w_ptr + row, mask=real, other=0.0).to(tl.float64)
                w = tl.where(alive & (col < c), w, 0.0)
                total = tl.sum(w, axis=1)[:, None]
                total = tl.where(h < H, total, 1.0)  # padding heads: no division by zero
                tl.store(probs_ptr + row, (w / total).to(probs_ptr.dtype.element_ty), mask=real)
                a += (1.0 / (G * total)) * w  # the mean over the group of each head's softmax row
            state = tl.where(col < c, decay * state + a, state)
            if RECORD:
                tl.store(attn_ptr + (h * n + i) * C + col, a, mask=real & (col < c))
            count = tl.max(tl.sum((alive & (col < c)).to(tl.int32), axis=1), axis=0)
            if (c >= budget) & (count >= budget):
                if BY_POSITION:
                    key = pos.to(tl.float64)
                else:
                    key = state
                if LAYER:
                    key = tl.broadcast_to(tl.sum(tl.where(h < H, key, 0.0), axis=0)[None, :] / H, [BLOCK_H, BLOCK_C])
                protected = (~alive) | (pos < sinks) | (pos >= t + 1 - recent) | (col >= c) | (h >= H)
                score = tl.where(protected, float("inf"), key)
                lowest = tl.min(score, axis=1)[:, None]
                victim = tl.min(tl.where(score == lowest, col, BLOCK_C), axis=1)[:, None]  # the earliest lowest
                if LAYER:  # head 0's choice, for every head
                    victim = tl.broadcast_to(tl.sum(tl.where(h == 0, victim, 0), axis=0)[None, :], [BLOCK_H, 1])
                drop = (col == victim) & (h < H)
                alive = alive & ~drop
                dropped = tl.where(drop, i, dropped)
        tl.store(alive_ptr + at, alive.to(tl.int8), mask=real)
        tl.store(state_ptr + at, state, mask=real)
        tl.store(dropped_ptr + at, dropped, mask=real)


def walk(weights, alive, positions, state, first, held, budget, decay, by_position, sinks, recent, layer,
         probs, dropped_at, attn_rows):
    """The numba walk's signature on torch tensors of one device: weights float64 [H, G, n, C]; alive bool
    [H, C], state float64 [H, C] and dropped_at int64 [H, C] updated in place; positions int64 [H, C]; probs
    [H, G, n, C] out; attn_rows float64 [H, n, C] out when it has n rows (recording), else empty."""
    heads, group, n, width = weights.shape
    flags = alive.to(torch.int8).contiguous()
    _walk_kernel[(1,)](weights.contiguous(), flags, positions.contiguous(), state, probs, dropped_at,
                       attn_rows if attn_rows.shape[1] == n else probs,
                       torch.tensor([float(decay)], dtype=torch.float64, device=weights.device),
                       n, width, first, held, budget, sinks, recent,
                       H=heads, G=group, BLOCK_H=triton.next_power_of_2(heads),
                       BLOCK_C=triton.next_power_of_2(width), BY_POSITION=bool(by_position), LAYER=bool(layer),
                       RECORD=attn_rows.shape[1] == n, num_warps=NUM_WARPS)
    alive.copy_(flags != 0)
