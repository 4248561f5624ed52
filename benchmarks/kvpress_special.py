"""Reference decisions of kvpress presses that the kept-set fixture cannot record, written to
``tests/fixtures/kvpress_special.json``: ThinK's pruned key channels, SimLayerKV's lazy layers, FINCH's kept tokens.

Runs in kvpress's own venv, as ``benchmarks/kvpress_reference.py`` does (its docstring builds the venv and names the
model directory), on the same prompt (``assets/examples/needle.txt`` as a chat turn), float32, sdpa::

    /tmp/kvpress-venv/bin/python benchmarks/kvpress_special.py \\
        --model ~/.cache/kvlens/models/smollm2-135m-instruct-b179c9523d0e6a0f

* **ThinK** (``ThinKPress(S, window_size=32)``, S in THINK_SHARES): the channels it zeroed, read off the prefilled
  cache per layer and KV head (a pruned channel is zero in every key), and the greedy answer.
* **SimLayerKV** (``SimLayerKVPress(lazy_threshold, n_last=1, n_recent=R, n_initial=4)``): which layers kept fewer
  than all the prompt's tokens (lazy), for each threshold in SIMLAYER_THRESHOLDS.
* **FINCH** (``FinchPress``): the prompt cut before its question (the last FINCH_QUESTION tokens, the user turn's
  "Question: ..." line and the template's end) by the delimiter token FINCH adds to the tokenizer; the positions it
  keeps at each budget in BUDGETS, matched by their keys in a run without re-rotation (a re-rotated key no longer
  matches its position), and the greedy answer with re-rotated keys (kvpress's default).

Each record holds the answer ids; ``tests/test_kvpress_reference.py`` compares KV Lens's settings against them.
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

from kvpress import FinchPress, SimLayerKVPress, ThinKPress
from kvpress_reference import MAX_NEW, ROOT, TEXT, prompt_ids

THINK_SHARES = (0.25, 0.5, 0.75)
THINK_WINDOW = 32  # ThinKPress's default window_size
SIMLAYER_THRESHOLDS = (0.5, 0.7, 0.9)
SIMLAYER_RECENT = 64
FINCH_QUESTION = 16
BUDGETS = (40, 96)
OUT = "tests/fixtures/kvpress_special.json"


def greedy(model, ids: torch.Tensor, press=None, first_position: int | None = None) -> tuple[list[int], DynamicCache]:
    """The greedy answer after prefilling ``ids`` under ``press``, and the cache as the prefill left it (cloned)."""
    cache = DynamicCache()
    if press is None:
        logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
    else:
        with press(model):
            logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
    prefilled = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]
    generated = [int(logits[0, -1].argmax())]
    position = ids.shape[1] if first_position is None else first_position
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    while len(generated) < MAX_NEW and generated[-1] not in stop:
        step = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache,
                     position_ids=torch.tensor([[position]]))
        generated.append(int(step.logits[0, -1].argmax()))
        position += 1
    return generated, prefilled


def matched_positions(kept: torch.Tensor, whole: torch.Tensor) -> list[int]:
    """The positions of ``whole`` [n, d] whose rows ``kept`` [k, d] copy, each exactly once (keys: RoPE makes every
    position's key its own)."""
    same = (kept[:, None, :] == whole[None, :, :]).all(-1)
    assert bool((same.sum(-1) == 1).all()), "a kept row matches no position, or several"
    return sorted(same.float().argmax(-1).tolist())


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
    ids, n = torch.tensor([input_ids]), len(input_ids)
    fixture = {"about": "kvpress decisions the kept-set fixture cannot record; written by benchmarks/kvpress_special.py",
               "versions": {"kvpress": importlib.metadata.version("kvpress"), "transformers": transformers.__version__,
                            "torch": torch.__version__},
               "text": TEXT, "chat": True, "input_ids": input_ids, "max_new_tokens": MAX_NEW}
    with torch.inference_mode():
        answer, whole = greedy(model, ids)
        fixture["baseline"] = {"answer_ids": answer, "answer": tokenizer.decode(answer, skip_special_tokens=True)}

        think = {"window": THINK_WINDOW, "runs": {}}
        for share in THINK_SHARES:
            answer, cache = greedy(model, ids, ThinKPress(key_channel_compression_ratio=share, window_size=THINK_WINDOW))
            pruned = [[torch.nonzero((k == 0).all(0)).flatten().tolist() for k in keys] for keys, _ in cache]
            think["runs"][str(share)] = {"pruned": pruned, "answer_ids": answer}
            print(f"think {share}: {tokenizer.decode(answer, skip_special_tokens=True)!r}", file=sys.stderr)
        fixture["think"] = think

        simlayer = {"n_last": 1, "n_recent": SIMLAYER_RECENT, "n_initial": 4, "runs": {}}
        for threshold in SIMLAYER_THRESHOLDS:
            press = SimLayerKVPress(lazy_threshold=threshold, n_last=1, n_recent=SIMLAYER_RECENT, n_initial=4)
            answer, cache = greedy(model, ids, press)
            lazy = [keys.shape[1] < n for keys, _ in cache]
            simlayer["runs"][str(threshold)] = {"lazy": lazy, "answer_ids": answer}
            print(f"simlayerkv {threshold}: {sum(lazy)} lazy layers", file=sys.stderr)
        fixture["simlayerkv"] = simlayer

        press = FinchPress()
        tokenizer = press.update_model_and_tokenizer(model, tokenizer)
        delimited = torch.tensor([input_ids[:-FINCH_QUESTION] + [press.delimiter_token_id] +
                                  input_ids[-FINCH_QUESTION:]])
        finch = {"question": FINCH_QUESTION, "normalize_scores": True, "budgets": {}}
        for budget in BUDGETS:
            ratio = 1 - budget / n
            while int(n * (1 - ratio)) != budget:  # kvpress keeps int(n x (1 - ratio))
                ratio = float(torch.nextafter(torch.tensor(ratio, dtype=torch.float64),
                                              torch.tensor(0.0, dtype=torch.float64)))
            runs = {}
            for rerotate in (False, True):  # kept keys match their positions only where they were not re-rotated
                finch_press = FinchPress(compression_ratio=ratio, rerotate_keys=rerotate)
                finch_press.delimiter_token, finch_press.delimiter_token_id = press.delimiter_token, press.delimiter_token_id
                runs[rerotate] = greedy(model, delimited, finch_press, first_position=n)
            answer, cache = runs[True]
            press_kept = [[matched_positions(keys[h], whole[layer][0][h]) for h in range(keys.shape[0])]
                          for layer, (keys, _) in enumerate(runs[False][1])]
            finch["budgets"][str(budget)] = {"compression_ratio": ratio, "kept": press_kept, "answer_ids": answer}
            print(f"finch {budget}: {tokenizer.decode(answer, skip_special_tokens=True)!r}", file=sys.stderr)
        fixture["finch"] = finch
    out = Path(args.out)
    out.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
