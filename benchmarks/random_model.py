"""A model directory of a real model's shape with random weights, for timing where the weights cannot travel
(a GPU machine with no network): the shape's config from ``benchmarks/shapes/`` and any tokenizer directory.

    python -m benchmarks.random_model --shape gemma3-270m --tokenizer DIR --out DIR [--device cuda] [--dtype bfloat16]

Every ``--model`` argument of the benchmarks (and of ``python -m backend``) then takes the directory. The
weights are drawn with the model's own initialiser, then every query projection is scaled up (x4, as the
tests' tiny models are) so that attention is peaked rather than uniform and the policies' choices differ.
Token ids from the tokenizer must be below the shape's vocabulary (SmolLM2's 49,152 fit every shape here).
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SHAPES = Path(__file__).with_name("shapes")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def shapes() -> list[str]:
    return sorted(p.stem for p in SHAPES.glob("*.json"))


def random_model_dir(shape: str, tokenizer: str | Path, out: str | Path, device: str = "cpu",
                     dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write a random-weight model of ``shape`` (a name in ``shapes()``) with ``tokenizer``'s files to ``out``."""
    config = AutoConfig.for_model(**json.loads((SHAPES / f"{shape}.json").read_text()))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    out = Path(out)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer) / name).is_file():
            shutil.copy(Path(tokenizer) / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", required=True, choices=shapes())
    parser.add_argument("--tokenizer", required=True, help="a directory holding tokenizer.json")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu", help="where to draw the weights (cuda is much faster for 1B)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    print(random_model_dir(args.shape, args.tokenizer, args.out, args.device, args.dtype))


if __name__ == "__main__":
    main()
