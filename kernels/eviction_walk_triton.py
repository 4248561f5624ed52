"""The eviction walk in Triton, so that a GPU keeps the decisions on the device.

The same walk as ``kernels/eviction_walk.py`` (numba, on the CPU) for the running-score policies (Window,
sinks, H2O, TOVA, A2SF, Keyformer), step for step: what each query reads, its attention row, the running score,
and the column each head (or the layer) drops once it holds ``budget`` tokens. On a GPU the numpy walk would
copy every step's decision to the host; here a launch walks a whole block of queries of one layer for every
batch row that walks this way, and the engine reads the outcome once per block and layer (``DeviceWalk`` in
backend/engine/attention.py). Its reference is the numba walk, and through it the numpy walk:
tests/test_eviction_walk.py runs these kernels under ``TRITON_INTERPRET=1`` against them.

The walk is sequential in the queries (each query's choice depends on what the previous ones left), so its
speed comes from running the independent walks side by side, in one of three ways per row (``ways``): one
program per (row, KV head) with its [columns] state in registers; for a row scored as a layer, one program that
walks the heads in turn over the one set of columns they all hold, their running scores in memory; and for a row
that can protect every token it holds (so that a head's count of held tokens can differ from another's), one
program with all heads' [heads, columns] tiles. Each row has its own budget, decay, sinks, recent window and
flags; rows whose tokens held differ in number are padded at the front of the columns (``start``: a row's first
real column). Ties drop the earliest column, as ``argmin`` does; a head whose columns are all protected drops
its first real column, as the numba walk drops column 0.
"""
from __future__ import annotations

import os

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine keeps its other walks
    triton = None


# Warps of each program that walks a block; None: by its tile, 8 for a head's 2,048 columns, 16 at most (fewer
# spill the tiles out of registers). benchmarks/walk.py --warps times others.
NUM_WARPS: int | None = None
# Each row's parameters, in this order, as one float64 array [R, 13] (one copy to the device): start is the
# row's first real column, by_position and layer are 0 or 1, decay is the running score's; gumbel is 1 for a
# Gumbel-softmax increment (Keyformer's), with its seed (below 2**32: exact in float64), the layer's index and its
# temperature's schedule.
PARAMS = ("budget", "sinks", "recent", "by_position", "layer", "start", "decay",
          "gumbel", "seed", "layer_index", "tau_init", "tau_end", "steps")


def usable(device: torch.device) -> bool:
    """Triton can walk on this device: a GPU, or anywhere under TRITON_INTERPRET=1 (the tests)."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _splitmix64(x):
        """``splitmix64`` of backend/policies/base.py on uint64 (which wraps around)."""
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def _step_hash(params_ptr, r, t):
        """Keyformer's noise for step t of row r's layer, before the head and the position (``keyformer.gumbel``)."""
        seed = tl.load(params_ptr + r * 13 + 8).to(tl.uint64)
        layer_hash = _splitmix64(tl.load(params_ptr + r * 13 + 9).to(tl.uint64))
        return _splitmix64(_splitmix64((seed << 32) | t.to(tl.uint64)) ^ layer_hash)

    @triton.jit
    def _tau(params_ptr, r, t):
        tau_init = tl.load(params_ptr + r * 13 + 10)
        tau_end = tl.load(params_ptr + r * 13 + 11)
        steps = tl.load(params_ptr + r * 13 + 12)
        return tau_init + (tau_end - tau_init) * tl.minimum(t.to(tl.float64), steps) / steps

    @triton.jit
    def _gumbel_softmax(a, seen, pos, head_hash, tau):
        """Each head's attention row a -> softmax((log a + g) / tau) over the columns it read (a > 0), along the last
        axis: Keyformer's step (``kernels/eviction_walk._gumbel_softmax``)."""
        x = _splitmix64(pos.to(tl.uint64) ^ head_hash)
        u = (x >> 11).to(tl.float64) * 1.1102230246251565e-16 + 5.551115123125783e-17  # 2**-53, 2**-54: in (0, 1)
        read = seen & (a > 0)
        z = tl.where(read, (tl.log(tl.where(read, a, 1.0)) - tl.log(-tl.log(u))) / tau, float("-inf"))
        top = tl.max(z, axis=-1, keep_dims=True)
        e = tl.where(read, tl.exp(z - tl.where(top > float("-inf"), top, 0.0)), 0.0)
        total = tl.sum(e, axis=-1, keep_dims=True)
        return e / tl.where(total > 0, total, 1.0)

    @triton.jit
    def _walk_kernel(w_ptr, alive_ptr, pos_ptr, state_ptr, probs_ptr, dropped_ptr, attn_ptr, params_ptr,
                     n, C, first, held, r0,
                     H: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                     RECORD: tl.constexpr, GUMBEL: tl.constexpr):
        r = r0 + tl.program_id(0)  # the batch row
        budget = tl.load(params_ptr + r * 13).to(tl.int32)
        sinks = tl.load(params_ptr + r * 13 + 1).to(tl.int32)
        recent = tl.load(params_ptr + r * 13 + 2).to(tl.int32)
        by_position = tl.load(params_ptr + r * 13 + 3) != 0
        start = tl.load(params_ptr + r * 13 + 5).to(tl.int32)
        decay = tl.load(params_ptr + r * 13 + 6)  # float64: a Python float argument would arrive as float32
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # this program's KV heads
        col = tl.arange(0, BLOCK_C)[None, :]
        head = h < H
        real = head & (col < C)
        at = (r * H + h) * C + col
        # 32-bit positions and steps in registers: the tiles stay in registers (64-bit ones spill).
        alive = (tl.load(alive_ptr + at, mask=real, other=0) != 0) & real
        pos = tl.load(pos_ptr + at, mask=real, other=0).to(tl.int32)
        state = tl.load(state_ptr + at, mask=real, other=0.0).to(tl.float64)
        dropped = tl.load(dropped_ptr + at, mask=real, other=-1).to(tl.int32)
        for i in range(n):
            t = first + i
            c = held + i + 1  # columns 0..c-1 exist for query t
            alive = alive | ((col == c - 1) & head)
            seen = alive & (col < c)
            a = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float64)
            for g in tl.static_range(G):
                row = (((r * H + h) * G + g) * n + i) * C + col
                w = tl.load(w_ptr + row, mask=real, other=0.0).to(tl.float64)
                w = tl.where(seen, w, 0.0)
                total = tl.sum(w, axis=1)[:, None]
                total = tl.where(head, total, 1.0)  # padding heads: no division by zero
                tl.store(probs_ptr + row, (w * (1.0 / total)).to(probs_ptr.dtype.element_ty), mask=real)
                a += (1.0 / (G * total)) * w  # the mean over the group of each head's softmax row
            added = a
            if GUMBEL:
                head_hash = _splitmix64(_step_hash(params_ptr, r, t) ^ h.to(tl.uint64))
                added = _gumbel_softmax(a, seen, pos, head_hash, _tau(params_ptr, r, t))
            state = tl.where(col < c, decay * state + added, state)
            if RECORD:
                tl.store(attn_ptr + ((r * H + h) * n + i) * C + col, a, mask=real & (col < c))
            count = tl.max(tl.sum(seen.to(tl.int32), axis=1), axis=0)
            if (c >= budget) & (count >= budget):
                key = tl.where(by_position, pos.to(tl.float64), state)
                protected = (~alive) | (pos < sinks) | (pos >= t + 1 - recent) | (col >= c) | ~head
                score = tl.where(protected, float("inf"), key)
                lowest = tl.min(score, axis=1)[:, None]
                # The earliest lowest (the first real column when every column is protected).
                victim = tl.min(tl.where((score == lowest) & (col >= start), col, BLOCK_C), axis=1)[:, None]
                drop = (col == victim) & head
                alive = alive & ~drop
                dropped = tl.where(drop, i, dropped)
        tl.store(alive_ptr + at, alive.to(tl.int8), mask=real)
        tl.store(state_ptr + at, state, mask=real)
        tl.store(dropped_ptr + at, dropped.to(tl.int64), mask=real)


    @triton.jit
    def _walk_layer_kernel(w_ptr, alive_ptr, pos_ptr, state_ptr, probs_ptr, dropped_ptr, attn_ptr, params_ptr,
                           n, C, first, held, r0,
                           H: tl.constexpr, G: tl.constexpr, BLOCK_C: tl.constexpr, RECORD: tl.constexpr,
                           GUMBEL: tl.constexpr):
        """A row scored as a layer: every head holds the same columns (each step drops the same one from all), so
        one [columns] row of flags, positions and steps serves them all, and the heads go one after the other; each
        head's running score stays in memory (with all heads' [heads, columns] tiles in registers, they spill)."""
        r = r0 + tl.program_id(0)
        budget = tl.load(params_ptr + r * 13).to(tl.int32)
        sinks = tl.load(params_ptr + r * 13 + 1).to(tl.int32)
        recent = tl.load(params_ptr + r * 13 + 2).to(tl.int32)
        by_position = tl.load(params_ptr + r * 13 + 3) != 0
        start = tl.load(params_ptr + r * 13 + 5).to(tl.int32)
        decay = tl.load(params_ptr + r * 13 + 6)
        col = tl.arange(0, BLOCK_C)
        real = col < C
        alive = (tl.load(alive_ptr + r * H * C + col, mask=real, other=0) != 0) & real  # head 0's: every head's
        pos = tl.load(pos_ptr + r * H * C + col, mask=real, other=0).to(tl.int32)
        dropped = tl.load(dropped_ptr + r * H * C + col, mask=real, other=-1).to(tl.int32)
        for i in range(n):
            t = first + i
            c = held + i + 1
            alive = alive | (col == c - 1)
            seen = alive & (col < c)
            combined = tl.zeros([BLOCK_C], dtype=tl.float64)  # the heads' scores summed in order, as numba does
            for h in range(H):
                a = tl.zeros([BLOCK_C], dtype=tl.float64)
                for g in tl.static_range(G):
                    row = (((r * H + h) * G + g) * n + i) * C + col
                    w = tl.load(w_ptr + row, mask=real, other=0.0).to(tl.float64)
                    w = tl.where(seen, w, 0.0)
                    total = tl.sum(w, axis=0)
                    tl.store(probs_ptr + row, (w * (1.0 / total)).to(probs_ptr.dtype.element_ty), mask=real)
                    a += (1.0 / (G * total)) * w
                at = (r * H + h) * C + col
                state = tl.load(state_ptr + at, mask=real, other=0.0).to(tl.float64)
                added = a
                if GUMBEL:  # (h counts the heads: an int, not a tensor)
                    head_hash = _splitmix64(_step_hash(params_ptr, r, t) ^ tl.cast(h, tl.uint64))
                    added = _gumbel_softmax(a, seen, pos, head_hash, _tau(params_ptr, r, t))
                state = tl.where(col < c, decay * state + added, state)
                tl.store(state_ptr + at, state, mask=real)
                if RECORD:
                    tl.store(attn_ptr + ((r * H + h) * n + i) * C + col, a, mask=real & (col < c))
                combined += tl.where(by_position, pos.to(tl.float64), state)
            count = tl.sum(seen.to(tl.int32), axis=0)
            if (c >= budget) & (count >= budget):
                protected = (~alive) | (pos < sinks) | (pos >= t + 1 - recent) | (col >= c)
                score = tl.where(protected, float("inf"), combined / H)
                lowest = tl.min(score, axis=0)
                victim = tl.min(tl.where((score == lowest) & (col >= start), col, BLOCK_C), axis=0)
                drop = col == victim
                alive = alive & ~drop
                dropped = tl.where(drop, i, dropped)
        for h in range(H):
            tl.store(alive_ptr + (r * H + h) * C + col, alive.to(tl.int8), mask=real)
            tl.store(dropped_ptr + (r * H + h) * C + col, dropped.to(tl.int64), mask=real)


APART, LAYER, JOINT = 0, 1, 2  # how a row's heads walk: a program each, one after the other, or all in one tile


def ways(params: np.ndarray) -> np.ndarray:
    """How each row (params [R, 13]) walks its heads: LAYER, one program walking the heads in turn, for a row
    scored as a layer (its heads hold the same columns); JOINT, all heads in one program's tiles, for a row that
    can protect every token it holds (sinks + recent >= budget: a head may then drop a column that is already gone,
    and its count of held tokens differ from another head's); APART, a program per head, for the others."""
    budget, sinks, recent, layer = (params[:, PARAMS.index(name)] for name in ("budget", "sinks", "recent", "layer"))
    return np.where(layer != 0, LAYER, np.where(sinks + recent >= budget, JOINT, APART))


def launches(params: np.ndarray) -> np.ndarray:
    """Each row's launch: rows with the same number walk in one (2 x ``ways`` + 1 for a Gumbel-softmax increment)."""
    return 2 * ways(params) + (params[:, PARAMS.index("gumbel")] != 0)


def walk_rows(weights, alive, positions, state, first, held, params, params_on_device, probs, dropped_at, attn_rows):
    """Walk a block of n queries for R batch rows of one layer, on torch tensors of one device: weights float64
    [R, H, G, n, C]; alive bool [R, H, C], state float64 [R, H, C] and dropped_at int64 [R, H, C] updated in
    place; positions int64 [R, H, C]; params a float64 numpy array [R, 13] (``PARAMS``), and the same on the
    device; probs [R, H, G, n, C] out; attn_rows float64 [R, H, n, C] out when it has n rows (recording), else
    empty.

    One launch per run of rows that walk their heads alike (``ways``) and add the same kind of increment (the
    attention, or its Gumbel-softmax); the engine orders them so."""
    rows, heads, group, n, width = weights.shape
    flags = alive.to(torch.int8).contiguous()
    record = attn_rows.shape[2] == n
    args = (weights.contiguous(), flags, positions.contiguous(), state, probs, dropped_at,
            attn_rows if record else probs, params_on_device.contiguous(), n, width, first, held)
    block_c = triton.next_power_of_2(width)
    way = launches(params)
    for r0 in range(rows):
        if r0 and way[r0] == way[r0 - 1]:
            continue
        r1 = r0 + 1
        while r1 < rows and way[r1] == way[r0]:
            r1 += 1
        heads_way, gumbel = divmod(int(way[r0]), 2)
        if heads_way == LAYER:
            warps = NUM_WARPS or max(4, min(16, block_c // 256))
            _walk_layer_kernel[(r1 - r0,)](*args, r0, H=heads, G=group, BLOCK_C=block_c, RECORD=record,
                                           GUMBEL=bool(gumbel), num_warps=warps)
            continue
        block_h = triton.next_power_of_2(heads) if heads_way == JOINT else 1
        warps = NUM_WARPS or max(4, min(16, block_h * block_c // 256))
        _walk_kernel[(r1 - r0, triton.cdiv(heads, block_h))](*args, r0, H=heads, G=group, BLOCK_H=block_h,
                                                             BLOCK_C=block_c, RECORD=record, GUMBEL=bool(gumbel),
                                                             num_warps=warps)
    alive.copy_(flags != 0)
