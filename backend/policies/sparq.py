"""SparQ Attention (Ribar et al., 2024, Sec. 3, App. B-D): read a few cached rows, chosen cheaply."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kernels.sparq import sparq_attention_block, sparq_transfer_bytes
from kernels.sparq_triton import sparq_attention

from .base import AttendingPolicy, Block, BlockResult, check_prefill, dense_attention
from .registry import register


@register
@dataclass(frozen=True)
class SparQ(AttendingPolicy):
    """Approximate scores from the r largest query components pick the k positions each query reads.

    Per step and KV head (kernels/sparq.py holds the algorithm and a torch reference, kernels/sparq_triton.py the Triton kernels):
    1. the r components of largest summed |q| over the group; approximate scores
       softmax(q[i1] . K[:, i1] / tau) with tau of Eq. D2;
    2. the ``local`` most recent positions plus the best others by group-summed approximate score,
       ``budget`` in all; exact attention over them;
    3. out = alpha * attention + (1 - alpha) * mean(V), alpha = approximate mass on the chosen
       positions (Eq. D4-D5).
    Recorded per step: alpha per query head, top-k agreement between approximate and exact scores
    (App. G) per KV head, and attention-transfer bytes of SparQ and dense (App. C, Eqs. C1-C2).

    budget: k, positions each query reads, the local window included.
    r: query components used for the approximate scores; -1 means the head size // 4, the paper's share (r = 32 of
        d_h = 128 in its benchmarks, Sec. 4; its sweeps span d_h/8 to d_h/2, App. J): 16 on the default model (d = 64)
        and 64 on Gemma 3 270M (d = 256), where 16 (d/16) ranks the logits too coarsely to find a needle.
    local: l, most recent positions always read; -1 means budget // 4 (the paper's l = k/4).
    prefill: how a generate-mode run reads its prompt. "select" (default): every prompt query is a step
        that selects, as in the paper's token-by-token cost model (Sec. 2) and its WikiText runs. "dense":
        the prompt is read with exact attention and only the answer's tokens select, as the paper's
        question-answering runs serve a prompt (SparQ speeds up generation, not the prefill); the first
        answer token is then Full's. Prompt mode has no prompt, so there every token selects.
    """

    honours_layer_limits: ClassVar[bool] = True  # Block.window and Block.softcap

    name = "sparq"
    summary = 'each query reads `budget` positions picked by approximate scores from `r` query components, mixed with the mean value'
    paper = 'Ribar et al., 2024, *SparQ Attention*, Sec. 3, App. B-D'
    color = "#999933"
    version = 2
    budget: int = 32
    r: int = -1
    local: int = -1
    prefill: str = "select"

    @property
    def window(self) -> int:
        return self.budget // 4 if self.local < 0 else self.local

    def __post_init__(self):
        super().__post_init__()
        if self.r < 1 and self.r != -1:
            raise ValueError(f"sparq: r must be >= 1, or -1 for the head size // 4, got {self.r}")
        if self.local < -1:
            raise ValueError(f"sparq: local must be >= 0, or -1 for budget // 4, got {self.local}")
        if self.window > self.budget:
            raise ValueError(f"sparq: local must be <= budget, got local={self.local}, budget={self.budget}")
        check_prefill(self.name, self.prefill)

    def components(self, head_dim: int) -> int:
        """r for a model whose heads have ``head_dim`` components."""
        return max(1, head_dim // 4) if self.r == -1 else self.r

    def check_model(self, head_dim: int, n_layers: int) -> None:
        # The kernels would quietly use min(r, d) components; a trace must record what ran.
        if self.r > head_dim:
            raise ValueError(f"sparq: r must be <= the model's head size {head_dim}, got r={self.r}")

    def attend_block(self, state, block):
        """On a GPU the Triton kernels, one decode-shaped call for the block's queries past the budget
        (kernels/sparq_triton.py; those within it read their whole cache exactly); elsewhere, and on a GPU for a
        layer the kernels cannot take (a scale other than the paper's, a sliding window, soft-capping), the whole
        block in one torch call (kernels/sparq.py): the same algorithm, tests/test_sparq_policy.py holds them
        equal."""
        n_q_heads, n, dim = block.q.shape
        n_kv_heads, total, _ = block.k.shape
        # The paper's 1/sqrt(d), unless the model scales its attention otherwise (the kernels take the paper's).
        scale = None if block.scaling == dim ** -0.5 else block.scaling
        plain = scale is None and block.window is None and block.softcap is None
        if block.k.is_cuda and plain:
            return state, self.attend_rows(block, sparq_attention)
        steps = torch.arange(block.first, block.first + n)
        res = sparq_attention_block(block.q, block.k, block.v, block.first, self.budget, self.components(dim),
                                    self.window, scale, block.window, block.softcap)
        width = res.reads.shape[-1]
        reads = np.zeros((n_kv_heads, n, total), bool)
        reads[..., :width] = res.reads.cpu().numpy()
        attn = np.zeros((n_kv_heads, n, total), np.float32)
        attn[..., :width] = res.weights.mean(1).float().cpu().numpy()
        agreement = _topk_agreement_masks(res.scores.sum(1).cpu(), res.exact.sum(1).cpu(), self.budget, steps)
        stats = {"alpha": res.alpha.float().cpu().numpy(), "topk_agreement": agreement,
                 "transfer_bytes": self._transfer(steps, dim, n_kv_heads)}
        return state, BlockResult(out=res.out, reads=reads, attn=attn, stats=stats)

    def reads_prompt_densely(self) -> bool:
        return self.prefill == "dense"

    def reads_all_before(self) -> int:
        return self.budget  # query t reads min(k, t + 1) positions: all of them, with alpha 1, while t < k

    def read_as_full(self, state, first, n, heads, in_prompt):
        """Queries that read every position: alpha 1, agreement 1, and SparQ's transfer beside the dense one, or
        in a prompt read exactly (``prefill="dense"``) the dense transfer for both (no approximate scores were
        fetched)."""
        n_q_heads, n_kv_heads, dim = heads
        transfer = self._transfer(torch.arange(first, first + n), dim, n_kv_heads)
        if self.prefill == "dense" and in_prompt:
            transfer = np.concatenate([transfer[:, 1:], transfer[:, 1:]], axis=1)
        return state, {"alpha": np.ones((n, n_q_heads), np.float32),
                       "topk_agreement": np.ones((n, n_kv_heads), np.float32), "transfer_bytes": transfer}

    def _transfer(self, steps: torch.Tensor, dim: int, n_kv_heads: int) -> np.ndarray:
        return np.array([[cost["sparq"], cost["dense"]] for cost in
                         (sparq_transfer_bytes(int(t) + 1, dim, self.budget, self.components(dim),
                                               n_kv_heads=n_kv_heads)
                          for t in steps)], np.float64)

    def attend_rows(self, block, attend) -> BlockResult:
        """The block as decode steps through ``attend`` (the kernels' signature). The queries that fit their whole
        cache in the budget read everything (alpha = 1): exact attention, all of them at once. The later ones share
        one call, each row reading its own prefix of the cache (``lengths``). The figures recorded beside (exact
        attention, agreement) are computed where the block is, and copied once."""
        n_q_heads, n, dim = block.q.shape
        n_kv_heads, total, _ = block.k.shape
        group, device = n_q_heads // n_kv_heads, block.q.device
        steps = torch.arange(block.first, block.first + n)
        short = int((steps < self.budget).sum())  # the block's first queries: each reads its whole cache
        out = torch.empty(n, n_q_heads, dim, dtype=block.q.dtype, device=device)
        reads = np.zeros((n_kv_heads, n, total), bool)
        attn = np.zeros((n_kv_heads, n, total), np.float32)
        alpha = np.ones((n, n_q_heads), np.float32)
        agreement = np.ones((n, n_kv_heads), np.float32)
        if short:
            length = block.first + short
            head = Block(q=block.q[:, :short], k=block.k[:, :length], v=block.v[:, :length], first=block.first,
                         scaling=block.scaling)
            out[:short], reads[:, :short, :length], attn[:, :short, :length] = dense_attention(head)
        if short < n:
            rows = slice(short, n)
            t = steps[rows].to(device)
            counts = torch.arange(1, total + 1, device=device)[None, :, None]
            means = (block.v.cumsum(1) / counts)[:, t].transpose(0, 1)  # mean of V over positions 0..t
            query = block.q[:, rows].transpose(0, 1)  # [m, H_q, d]
            keys = block.k[None].expand(n - short, -1, -1, -1)
            values = block.v[None].expand(n - short, -1, -1, -1)
            res = attend(query, keys, values, means, self.budget, self.components(dim), self.window, lengths=t + 1)
            out[rows] = res.out
            chosen = torch.zeros(n - short, n_kv_heads, total, dtype=torch.bool, device=device)
            chosen.scatter_(-1, res.positions, True)
            exists = torch.arange(total, device=device)[None, :] <= t[:, None]  # [m, total]
            logits = query.view(-1, n_kv_heads, group, dim) @ block.k.transpose(-1, -2) * block.scaling
            exact = torch.softmax(logits.double().masked_fill(~exists[:, None, None], float("-inf")), -1)
            mass = exact * chosen[:, :, None]
            share = (mass / mass.sum(-1, keepdim=True)).mean(2)  # [m, H_kv, total]
            approx = res.scores.view(-1, n_kv_heads, group, total).sum(2)
            agreement[rows] = _topk_agreement(approx, exact.sum(2), self.budget)
            alpha[rows] = res.alpha.float().cpu().numpy()
            reads[:, rows] = chosen.cpu().numpy().transpose(1, 0, 2)
            attn[:, rows] = share.float().cpu().numpy().transpose(1, 0, 2)
        stats = {"alpha": alpha, "topk_agreement": agreement, "transfer_bytes": self._transfer(steps, dim, n_kv_heads)}
        return BlockResult(out=out, reads=reads, attn=attn, stats=stats)


def _topk_agreement_masks(approx: torch.Tensor, exact: torch.Tensor, k: int, steps: torch.Tensor) -> np.ndarray:
    """Per query and KV head ([H_kv, n, S] scores, 0 past each query): share of the k highest exact scores
    that the k highest approximate scores find (App. G); 1 for a query whose whole cache fits in k."""
    kk = min(k, approx.shape[-1])
    hits = torch.zeros(approx.shape, dtype=torch.bool)
    # Unsorted: the same k positions as sorted (the order is only sorted after they are picked), sooner.
    hits.scatter_(-1, torch.topk(approx, kk, dim=-1, sorted=False).indices, True)
    found = torch.zeros(approx.shape, dtype=torch.bool)
    found.scatter_(-1, torch.topk(exact, kk, dim=-1, sorted=False).indices, True)
    share = (hits & found).sum(-1).double() / kk  # [H_kv, n]
    share = torch.where((steps + 1 <= k)[None, :], torch.ones_like(share), share)
    return share.T.numpy().astype(np.float32)


def _topk_agreement(approx: torch.Tensor, exact: torch.Tensor, k: int) -> np.ndarray:
    """Per query and KV head ([m, H_kv, S] scores): share of the k highest exact scores that the k
    highest approximate scores find (App. G)."""
    top_approx = torch.topk(approx, k, dim=-1).indices
    top_exact = torch.topk(exact, k, dim=-1).indices
    hits = (top_approx[..., :, None] == top_exact[..., None, :]).any(-1).sum(-1)
    return (hits.double() / k).cpu().numpy().astype(np.float32)
