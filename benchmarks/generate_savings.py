"""What a generate-mode row no longer pays: the LM head over its prompt's positions, and the walk of a compression
row's decoding steps, each timed on one model in this process.

    python -m benchmarks.generate_savings [--model gemma3-270m] [--tokens 865] [--pairs 2]

- The LM head: one forward of the model's layers over ``--tokens`` tokens, then its LM head and the log-softmax and
  KL that scored every position (``runner._predictions``' work), each timed once after a warm-up.
- The read path: eight compression rows (SnapKV, Knorm, KeyDiff, Expected Attention at ratios 0.25 and 0.75) answer
  48 tokens after an 800-token prompt (its first 700 tokens the context), with the path that skips a reading block's
  walk (``RowLayerState._only_reads``) on and off, in pairs.
"""
from __future__ import annotations

import argparse
import time

import torch

from backend.engine.attention import RowLayerState
from backend.engine.models import DEFAULT_MODEL, load_model
from backend.engine.runner import compute_traces
from backend.policies import parse_spec
from backend.texts import inaugural


def lm_head_share(lm, tokens: int) -> None:
    ids = torch.tensor([lm.encode(inaugural())[:tokens]])
    with torch.inference_mode():
        lm.model(ids[:, :16])
        start = time.perf_counter()
        hidden = lm.model.model(input_ids=ids).last_hidden_state
        layers = time.perf_counter() - start
        start = time.perf_counter()
        logits = lm.features.logits(lm.model.lm_head(hidden))
        head = time.perf_counter() - start
        start = time.perf_counter()
        logp = torch.log_softmax(logits.float(), -1)
        (logp.exp() * logp).sum(-1)
        scoring = time.perf_counter() - start
    share = (head + scoring) / (layers + head + scoring)
    print(f"{lm.name}, {ids.shape[1]} tokens: layers {layers:.2f} s, LM head {head:.2f} s, log-softmax and KL "
          f"{scoring:.2f} s: {share:.0%} of a row's prefill")


def read_path(lm, pairs: int) -> None:
    ids = lm.encode(inaugural())[:800]
    specs = [f"{name}:ratio={ratio}" for name in ("snapkv", "knorm", "keydiff", "expected_attention")
             for ratio in (0.25, 0.75)]
    policies = [parse_spec(spec, 700) for spec in specs]
    only_reads = RowLayerState._only_reads

    def run(skip: bool) -> float:
        RowLayerState._only_reads = only_reads if skip else (lambda state, *args: False)
        try:
            start = time.perf_counter()
            compute_traces(lm, specs, policies, ids, mode="generate", max_new_tokens=48, context_end=700)
            return time.perf_counter() - start
        finally:
            RowLayerState._only_reads = only_reads

    run(True)
    for _ in range(pairs):
        print(f"8 compression rows, 48 tokens: read path {run(True):.1f} s, walked {run(False):.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=865)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    lm = load_model(args.model)
    lm_head_share(lm, args.tokens)
    read_path(lm, args.pairs)


if __name__ == "__main__":
    main()
