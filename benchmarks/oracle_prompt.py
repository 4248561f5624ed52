"""Where the oracle's reading breaks an answer: a task sample read with each query's top-k keys on the model's
global (full-attention) layers, during the prompt, while decoding, or both, on transformers' own eager
attention (independent of KV Lens's engine), and how much of each global layer's attention the top k keys hold.

    python -m benchmarks.oracle_prompt [--model gemma3-270m] [--task niah_single_1] [--length 4096] [--sample 4]
        [--budgets 475,950,1900,2850] [--answer-budget 1900]

Prints, per global layer and budget, the attention the top keys hold (the mean row over a KV head's query heads,
ranked as the oracle ranks): at the prompt's last query, and the mean and the least over the queries past the
budget; then the greedy answer with top-k reading in each phase, on every global layer and on each alone.
"""
from __future__ import annotations

import argparse

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import eager_mask

from backend.engine.models import GEMMA_MODEL, load_model
from backend.experiments.task_runs import encode, lm_eval_request
from backend.experiments.tasks import load_task, tokenizer_source

# What the attention function below reads, and the layers whose prompt rows it records (mean over a KV head's
# query heads), to a dict.
READ = {"budget": 0, "layers": frozenset(), "phase": "both", "record": frozenset(), "rows": {}}


def top_k_attention(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
    """Eager attention; on the layers and in the phase ``READ`` names, each query reads its top ``budget`` keys
    by the mean row over the query heads of a KV head (the oracle's ranking)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    logits = (query.double() @ key.double().transpose(2, 3)) * scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits + attention_mask[..., : key.shape[2]]
    batch, heads, n, m = logits.shape
    phase = "prompt" if n > 1 else "decoding"
    if module.layer_idx in READ["record"] and phase == "prompt":
        rows = torch.softmax(logits, -1).view(batch, heads // group, group, n, m).mean(2)
        READ["rows"][module.layer_idx] = rows[0].float()
    if module.layer_idx in READ["layers"] and READ["phase"] in ("both", phase) and m > READ["budget"]:
        ranking = torch.softmax(logits, -1).view(batch, heads // group, group, n, m).mean(2)
        top = ranking.topk(READ["budget"], -1).indices.repeat_interleave(group, 1)
        logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).scatter_(-1, top, False), float("-inf"))
    weights = torch.softmax(logits, -1)
    return (weights @ value.double()).to(query.dtype).transpose(1, 2).contiguous(), weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=GEMMA_MODEL)
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--sample", type=int, default=4)
    parser.add_argument("--budgets", default="475,950,1900,2850")
    parser.add_argument("--answer-budget", type=int, default=1900)
    parser.add_argument("--new-tokens", type=int, default=12)
    args = parser.parse_args()

    lm = load_model(args.model)
    request = lm_eval_request(load_task(args.task, args.length, tokenizer_source(lm)), args.sample, lm, chat=True)
    ids = torch.tensor([encode(lm, request.context)])
    n = ids.shape[1]
    global_layers = [i for i, window in enumerate(lm.features.windows) if window is None]
    print(f"{args.model}, {args.task} at {args.length}, sample {args.sample}: {n} prompt tokens; "
          f"global layers {global_layers}; reference {request.doc['outputs']}")
    AttentionInterface.register("oracle_prompt", top_k_attention)
    AttentionMaskInterface.register("oracle_prompt", eager_mask)
    lm.model.set_attn_implementation("oracle_prompt")

    READ.update(record=frozenset(global_layers))
    with torch.inference_mode():
        lm.model(ids)
    READ.update(record=frozenset())
    print("\nattention the top k keys hold (mean row over a KV head's query heads)")
    print("layer  budget  last query  past the budget: mean  least")
    for layer in global_layers:
        rows = READ["rows"].pop(layer).double()
        for budget in (int(b) for b in args.budgets.split(",")):
            held = rows.topk(min(budget, n), -1).values.sum(-1)  # [H_kv, n]
            past = held[:, budget:] if n > budget else held[:, -1:]
            print(f"{layer:5d}  {budget:6d}  {held[:, -1].mean():10.4f}  {past.mean():21.4f}  {past.min():5.4f}")

    print(f"\ngreedy answers, each query reading its top {args.answer_budget} keys on the layers named")
    runs = [("none", frozenset(), "both")] + [(f"{phase}, layers {global_layers}", frozenset(global_layers), phase)
                                               for phase in ("both", "prompt", "decoding")]
    runs += [(f"prompt, layer {layer}", frozenset([layer]), "prompt") for layer in global_layers]
    for label, layers, phase in runs:
        READ.update(budget=args.answer_budget, layers=layers, phase=phase)
        with torch.inference_mode():
            out = lm.model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        print(f"{label:40s} {lm.tokenizer.decode(out[0, n:])!r}")


if __name__ == "__main__":
    main()
