"""Does a key's norm say what attention it will get? Knorm's premise (low-norm keys draw attention), per model.

    python -m benchmarks.key_norms [--models smollm2-135m-instruct,gemma3-270m] [--tokens 1024]

One plain forward of the long text (``benchmarks.scaling.long_text``) with eager attention. Per layer and KV head:
how much the keys' norms vary over the positions (coefficient of variation), and Spearman's correlation between a
key's norm and the mean attention it receives from the queries that can see it (its group's query heads averaged).
The first 4 positions (sinks) and the last 128 (few queries see them) are left out. Knorm keeps the lowest norms, so
it keeps what attention reads where the correlation is negative. Layers are told apart by their window
(``LayerFeatures.window``).
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from scipy.stats import spearmanr

from backend.engine.models import load_model

from .scaling import long_text


def key_norm_figures(name: str, tokens: int) -> dict[str, list[tuple[int, float, float]]]:
    """Per kind of layer (global, or sliding over its window): (layer, coefficient of variation, Spearman) per KV
    head."""
    lm = load_model(name)
    config = lm.model.config
    ids = lm.tokenizer(long_text()).input_ids[:tokens]
    n, kv_heads = len(ids), config.num_key_value_heads
    layers = lm.features.layers
    keys = {}

    def keep(at: int):
        def hook(_module, _args, output) -> None:  # returns None: the output goes on unchanged
            keys[at] = layers[at].capture.heads("k", output, kv_heads)  # [1, H_kv, T, d]
        return hook

    # The keys where the engine reads them, before RoPE (which keeps norms): after QK-norm where the model has one.
    hooks = [layer.capture.k_module.register_forward_hook(keep(at)) for at, layer in enumerate(layers)]
    lm.model.set_attn_implementation("eager")  # the attention weights themselves
    try:
        with torch.inference_mode():
            out = lm.model(torch.tensor([ids]), output_attentions=True)
    finally:
        for hook in hooks:
            hook.remove()
    seen = torch.arange(n, 0, -1, dtype=torch.float32)  # key j is seen by n - j queries
    middle = slice(4, n - 128)
    figures: dict[str, list] = {}
    for at, weights in enumerate(out.attentions):
        norms = keys[at][0].float().norm(dim=-1)  # [H_kv, T]
        received = weights[0].float().reshape(kv_heads, -1, n, n).mean(1).sum(1) / seen  # [H_kv, T]
        kind = "global" if layers[at].window is None else f"sliding ({layers[at].window})"
        for head in range(kv_heads):
            x = norms[head, middle]
            rho = spearmanr(x.numpy(), received[head, middle].numpy()).correlation
            figures.setdefault(kind, []).append((at, float(x.std() / x.mean()), float(rho)))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    print("| model | layers | (layer, KV head) pairs | key-norm variation (median) | Spearman, norm vs attention "
          "received (median) | pairs where it is negative |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        for kind, rows in key_norm_figures(name, args.tokens).items():
            cv, rho = np.median([r[1] for r in rows]), np.median([r[2] for r in rows])
            negative = sum(r[2] < 0 for r in rows)
            each = ", ".join(f"layer {r[0]}: {r[2]:+.2f}" for r in rows) if len(rows) <= 4 else ""
            print(f"| {name} | {kind}{f' ({each})' if each else ''} | {len(rows)} | {cv:.3f} | {rho:+.2f} | "
                  f"{negative} of {len(rows)} |")


if __name__ == "__main__":
    main()
