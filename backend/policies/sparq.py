"""SparQ Attention (Ribar et al., 2024, Sec. 3, App. B-D): read a few cached rows, chosen cheaply."""
from dataclasses import dataclass

import numpy as np
import torch

from kernels.sparq import sparq_attention, sparq_attention_reference, sparq_transfer_bytes

from .base import AttendingPolicy, BlockResult


@dataclass(frozen=True)
class SparQ(AttendingPolicy):
    """Approximate scores from the r largest query components pick the k positions each query reads.

    Per step and KV head (kernels/sparq.py holds the algorithm, a torch reference and Triton kernels):
    1. the r components of largest summed |q| over the group; approximate scores
       softmax(q[i1] . K[:, i1] / tau) with tau of Eq. D2;
    2. the ``local`` most recent positions plus the best others by group-summed approximate score,
       ``budget`` in all; exact attention over them;
    3. out = alpha * attention + (1 - alpha) * mean(V), alpha = approximate mass on the chosen
       positions (Eq. D4-D5).
    Recorded per step: alpha per query head, top-k agreement between approximate and exact scores
    (App. G) per KV head, and attention-transfer bytes of SparQ and dense (App. C, Eqs. C1-C2).

    budget: k, positions each query reads, the local window included.
    r: query components used for the approximate scores (16 = d/4 for the default model's d = 64).
    local: l, most recent positions always read; -1 means budget // 4 (the paper's l = k/4).
    """

    name = "sparq"
    budget: int = 32
    r: int = 16
    local: int = -1

    @property
    def window(self) -> int:
        return self.budget // 4 if self.local < 0 else self.local

    def __post_init__(self):
        super().__post_init__()
        if self.r < 1:
            raise ValueError(f"sparq: r must be >= 1, got {self.r}")
        if self.window > self.budget:
            raise ValueError(f"sparq: local must be <= budget, got local={self.local}, budget={self.budget}")

    def attend_block(self, state, block):
        n_q_heads, n, dim = block.q.shape
        n_kv_heads, total, _ = block.k.shape
        group = n_q_heads // n_kv_heads
        reads = np.zeros((n_kv_heads, n, total), bool)
        attn = np.zeros((n_kv_heads, n, total), np.float32)
        outs, alpha, agreement, transfer = [], [], [], []
        for i in range(n):
            t = block.first + i
            keys, values = block.k[None, :, : t + 1], block.v[None, :, : t + 1]
            # Triton kernels on GPU, the torch reference on CPU (kernels/sparq.py tests them against each other).
            attend = sparq_attention if keys.is_cuda else sparq_attention_reference
            res = attend(block.q[None, :, i], keys, values, values.mean(2), self.budget, self.r, self.window)
            outs.append(res.out[0])
            chosen = res.positions[0].cpu().numpy()  # [H_kv, k]
            np.put_along_axis(reads[:, i], chosen, True, axis=-1)
            exact = torch.softmax(block.q[:, i].double().view(n_kv_heads, group, dim)
                                  @ keys[0].double().transpose(-1, -2) * block.scaling, -1)  # [H_kv, G, t+1]
            exact = exact.cpu()
            mass = (exact * torch.from_numpy(reads[:, i, : t + 1])[:, None]).numpy()
            attn[:, i, : t + 1] = (mass / mass.sum(-1, keepdims=True)).mean(1)
            approx = res.scores[0].cpu().view(n_kv_heads, group, t + 1).sum(1)
            agreement.append(_topk_agreement(approx, exact.sum(1), min(self.budget, t + 1)))
            alpha.append(res.alpha[0].float().cpu().numpy())
            cost = sparq_transfer_bytes(t + 1, dim, self.budget, self.r, n_kv_heads=n_kv_heads)
            transfer.append(np.array([cost["sparq"], cost["dense"]], np.float64))
        stats = {"alpha": np.stack(alpha), "topk_agreement": np.stack(agreement),
                 "transfer_bytes": np.stack(transfer)}
        return state, BlockResult(out=torch.stack(outs, 1).transpose(0, 1), reads=reads, attn=attn, stats=stats)


def _topk_agreement(approx: torch.Tensor, exact: torch.Tensor, k: int) -> np.ndarray:
    """Per KV head: share of the k highest exact scores that the k highest approximate scores find."""
    top_approx = torch.topk(approx, k, dim=-1).indices
    top_exact = torch.topk(exact, k, dim=-1).indices
    hits = (top_approx[:, :, None] == top_exact[:, None, :]).any(-1).sum(-1)
    return (hits.double() / k).numpy().astype(np.float32)
