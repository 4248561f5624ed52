"""Reference key-channel masks from NVIDIA kvpress's ThinKPress, written to ``tests/fixtures/kvpress_think.json``.

Runs in kvpress's own venv, as ``benchmarks/kvpress_reference.py`` does (its docstring builds the venv and names the
model directory), on the same prompt (``assets/examples/needle.txt`` as a chat turn)::

    /tmp/kvpress-venv/bin/python benchmarks/kvpress_channels.py \\
        --model ~/.cache/kvlens/models/smollm2-135m-instruct-b179c9523d0e6a0f

For each share of key channels pruned, the prompt is prefilled once under ``ThinKPress(share, window_size=32)``
(float32, sdpa), and the channels it zeroed are read off the cache per layer and KV head (a pruned channel is zero
in every key); then greedy decoding on that cache gives the answer. The fixture: "input_ids", "window", "shares",
"baseline" (the answer with no press) and per share {"pruned": [layer][kv_head] -> sorted channels, "answer_ids",
"answer"}. ``tests/test_kvpress_reference.py`` compares KV Lens's ThinK with kvpress's settings against it.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvpress import ThinKPress
from kvpress_reference import MAX_NEW, ROOT, TEXT, prompt_ids

SHARES = (0.25, 0.5, 0.75)
WINDOW = 32  # ThinKPress's default window_size
OUT = "tests/fixtures/kvpress_think.json"


def greedy(model, ids: torch.Tensor, press=None) -> tuple[list[int], DynamicCache]:
    cache = DynamicCache()
    if press is None:
        logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
    else:
        with press(model):
            logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
    prefilled = [[layer.keys[0].clone() for layer in cache.layers]]
    generated, position = [int(logits[0, -1].argmax())], ids.shape[1]
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    while len(generated) < MAX_NEW and generated[-1] not in stop:
        step = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache,
                     position_ids=torch.tensor([[position]]))
        generated.append(int(step.logits[0, -1].argmax()))
        position += 1
    return generated, prefilled[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="KV Lens's safetensors directory of SmolLM2-135M-Instruct")
    parser.add_argument("--out", default=str(ROOT / OUT))
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model_dir = Path(args.model).expanduser().resolve()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    input_ids = prompt_ids(tokenizer, (ROOT / TEXT).read_text())
    ids = torch.tensor([input_ids])
    fixture = {"about": "key channels ThinKPress zeroed [layer][kv_head] after prefilling the prompt; written by "
                        "benchmarks/kvpress_channels.py",
               "versions": {"kvpress": importlib.metadata.version("kvpress"), "transformers": transformers.__version__,
                            "torch": torch.__version__},
               "text": TEXT, "chat": True, "input_ids": input_ids, "window": WINDOW, "shares": list(SHARES),
               "max_new_tokens": MAX_NEW, "runs": {}}
    with torch.inference_mode():
        answer, _ = greedy(model, ids)
        fixture["baseline"] = {"answer_ids": answer, "answer": tokenizer.decode(answer, skip_special_tokens=True)}
        for share in SHARES:
            answer, keys = greedy(model, ids, ThinKPress(key_channel_compression_ratio=share, window_size=WINDOW))
            pruned = [[torch.nonzero((k == 0).all(0)).flatten().tolist() for k in layer] for layer in keys]
            fixture["runs"][str(share)] = {"pruned": pruned, "answer_ids": answer,
                                           "answer": tokenizer.decode(answer, skip_special_tokens=True)}
            print(f"share {share}: {fixture['runs'][str(share)]['answer']!r}", file=sys.stderr)
    out = Path(args.out)
    out.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
