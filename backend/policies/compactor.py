"""Compactor (Chari & Van Durme, 2025, *Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate
Leverage Scores*)."""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .base import CacheView, CompressionPolicy, keep_top, latest
from .registry import register

MAX_QUERIES = 1 << 16  # the queries a compression may read: a prompt's (it scores from all of them)


def sketch(seed: int, layer: int, heads: int, dim: int, size: int) -> torch.Tensor:
    """Layer ``layer``'s Gaussian sketch [1, heads, dim, size] / sqrt(size): the (layer + 1)-th draw of a generator
    seeded with ``seed``, so that the layers draw in turn as one seeded run of kvpress's prefill does."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(layer + 1):
        phi = torch.randn((1, heads, dim, size), generator=generator)
    return phi / size ** 0.5


def leverage(keys: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """Approximate statistical leverage of each row of ``keys`` [1, H, n, d] (before RoPE), float32: the centred keys
    sketched to ``phi``'s columns, then the diagonal of X (X^T X + 0.01 I)^-1 X^T through a Cholesky solve (more
    jitter if it fails), clamped at 0."""
    x = ((keys - keys.mean(-2, keepdim=True)) @ phi).float()
    gram = x.transpose(-2, -1) @ x
    gram = 0.5 * (gram + gram.transpose(-2, -1))
    eye = torch.eye(gram.shape[-1])
    jitter = 1e-2
    for _ in range(5):
        factor, info = torch.linalg.cholesky_ex(gram + jitter * eye)
        if bool((info == 0).all()):
            break
        jitter *= 10.0
    solved = torch.cholesky_solve(x.transpose(-2, -1), factor)
    return (x * solved.transpose(-2, -1)).sum(-1).clamp_min(0)


PADS = ("masked", "kvpress")


def chunked_attention(queries: torch.Tensor, keys: torch.Tensor, chunk: int, pad: str = "masked") -> torch.Tensor:
    """[1, H, n]: per key, the attention it draws from the queries of its own chunk of ``chunk`` tokens, every query
    reading every key of the chunk (non-causal, unscaled dot products as kvpress's), summed over the queries
    (float32). The last chunk is padded: ``masked`` leaves the pads out; ``kvpress`` reads them as kvpress 0.5.5 does
    (a pad key's logit is -1e-9, so it shares every softmax, and a pad query reads every key of its chunk alike)."""
    _, heads, n, dim = keys.shape
    padded = -(-n // chunk) * chunk
    q = F.pad(queries, (0, 0, 0, padded - n)).view(1, heads, -1, chunk, dim)
    k = F.pad(keys, (0, 0, 0, padded - n)).view(1, heads, -1, chunk, dim)
    dots = (q @ k.transpose(-2, -1)).float()
    valid = torch.arange(padded).view(-1, chunk) < n  # [chunks, chunk]
    if pad == "kvpress":
        dots = dots.masked_fill(~valid[None, None, :, None, :], -1e-9)
        return torch.softmax(dots, -1).sum(-2).reshape(1, heads, padded)[..., :n]
    dots = dots.masked_fill(~valid[None, None, :, None, :], float("-inf"))
    attn = torch.softmax(dots, -1).masked_fill(~valid[None, None, :, :, None], 0.0)
    return attn.sum(-2).reshape(1, heads, padded)[..., :n]


def z_scores(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean()) / x.std().clamp_min(1e-6)


@register
@dataclass(frozen=True)
class Compactor(CompressionPolicy):
    """Keep the tokens that are outliers of the keys' geometry or draw attention, blended: each held token's
    approximate leverage among the keys before RoPE (a Gaussian sketch of ``sketch`` columns), plus the attention
    it draws from the queries of its chunk (``chunk`` tokens, non-causal) times its value's norm, smoothed over 3
    neighbours; both z-scored, the leverage weighed by ``blending``. The first ``sinks`` and the latest
    ``recent_tokens`` always stay. Query-agnostic by design: the prompt's own queries score it.

    As kvpress's ``CompactorPress`` (8 and 4 kept, chunks of 256, sketch 48, blending = the compression ratio, a
    Cholesky solve with jitter): its sketch draws from torch's global generator, KV Lens's from one seeded with
    ``seed``, the layers in turn, so ``torch.manual_seed(seed)`` before kvpress's prefill draws the same. kvpress
    scores a prefill only; here a later compression scores what is held with the queries of the held tokens. kvpress
    reads the last chunk's padding into its softmax; ``pad=masked`` (the default) leaves it out, ``preset=kvpress``
    reads it as kvpress does.

    budget: tokens kept per KV head at each compression. sinks, recent_tokens: first and latest tokens kept.
    chunk: tokens per non-causal attention chunk. sketch: the sketch's columns. blending: the leverage's weight
    (negative: the share of the held tokens removed, kvpress's default). seed: the sketch's seed. pad: masked or
    kvpress (the last chunk's padding).
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "compactor"
    summary = "once the prompt is read, keep the keys' geometric outliers and the tokens their chunk attends to"
    paper = ("Chari & Van Durme, 2025, *Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate "
             "Leverage Scores*")
    color = "#8C510A"
    uses_attention = False
    reads_every_key = True  # each compression reads every held token's query and key (limits.row_cost)
    presets = {"kvpress": {"pad": "kvpress"}}
    sinks: int = 8
    recent_tokens: int = 4
    chunk: int = 256
    sketch: int = 48
    blending: float = -1.0
    seed: int = 0
    pad: str = "masked"

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0 or self.recent_tokens < 0 or self.chunk < 1 or self.sketch < 1 or self.pad not in PADS:
            raise ValueError(f"{self.name}: need sinks, recent_tokens >= 0, chunk, sketch >= 1 and pad in "
                             f"{', '.join(PADS)}")

    @classmethod
    def for_budget(cls, budget: int) -> "Compactor":
        return cls(budget=budget, sinks=min(8, budget // 4), recent_tokens=min(4, budget // 4))

    @property
    def recent(self) -> int:
        return self.recent_tokens

    @property
    def window_queries(self) -> int:
        return MAX_QUERIES

    def score(self, view: CacheView) -> np.ndarray:
        keys, values, queries = np.asarray(view.keys), np.asarray(view.values), np.asarray(view.queries)
        heads, dim = keys.shape[0], keys.shape[-1]
        out = np.zeros(view.kept.shape)
        # The tokens scored: held, past the sinks, before the recent ones, with their own query in the view.
        asked = np.zeros(view.kept.shape[1], bool)
        asked[view.query_positions] = True
        edges = (np.cumsum(view.kept, 1) <= self.sinks) | latest(view.kept, self.recent_tokens)
        inner = view.kept & ~edges & asked
        if not inner.any():
            return np.where(view.kept, np.inf, 0.0)
        removed = 1.0 - self.budget / max(1, int(view.kept.sum(1).max()))
        blending = removed if self.blending < 0 else self.blending
        phi = sketch(self.seed, view.layer, heads, dim, self.sketch)
        columns = {p: i for i, p in enumerate(view.query_positions)}
        lev, attn = [], []
        for h in range(heads):  # heads may hold different tokens; each scores its own (kvpress: all hold the same)
            at = np.flatnonzero(inner[h])
            k = torch.from_numpy(keys[h:h + 1, at]).float()
            pre = view.rope(k.double(), -torch.from_numpy(at)).float() if view.rope is not None else k
            lev.append(leverage(pre[None], phi[:, h:h + 1])[0, 0])
            q = torch.from_numpy(queries[h][:, [columns[p] for p in at]]).float()  # [G, n, d]
            drawn = chunked_attention(q[None], k[None].expand(1, q.shape[0], -1, -1), self.chunk, self.pad)[0].mean(0)
            norms = torch.from_numpy(np.linalg.norm(values[h, at], axis=-1)).float()
            attn.append(F.avg_pool1d((drawn * norms)[None], 3, stride=1, padding=1)[0])
        lev_z, attn_z = z_scores(torch.cat(lev)), z_scores(torch.cat(attn))
        start = 0
        for h in range(heads):
            at = np.flatnonzero(inner[h])
            out[h, at] = (blending * lev_z[start:start + len(at)] + attn_z[start:start + len(at)]).double().numpy()
            start += len(at)
        return np.where(view.kept & ~inner, np.inf, out)  # the sinks and the recent tokens stay

    def keep(self, view: CacheView) -> np.ndarray:
        return keep_top(self.score(view), view.kept, self.budget, 0)
