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
* **CaM** (``CAMPress(KnormPress(), compression_interval=1, target_size=B, merge_budget=32)``, B in BUDGETS): every
  layer's held positions at the end of the greedy answer, each held token's value error against the value the
  model computed (``|v' - v| / |v|`` per KV head: what the merges added), and the answer, with each of its
  Bernoulli draws replaced by its probability (``torch.bernoulli`` is swapped for the identity while it runs, so
  the merges are their expectation and the run repeats), and the answer drawn after ``torch.manual_seed(0)``.
* **Merging** (``MergingPress(KnormPress(r))``, r keeping B in BUDGETS): the positions kept per layer and KV head,
  each kept token's value error against the value the model computed, and the greedy answer.
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
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvpress import CAMPress, FinchPress, KnormPress, MergingPress, SimLayerKVPress, ThinKPress
from kvpress_reference import MAX_NEW, ROOT, TEXT, decode_greedily, prompt_ids

THINK_SHARES = (0.25, 0.5, 0.75)
THINK_WINDOW = 32  # ThinKPress's default window_size
SIMLAYER_THRESHOLDS = (0.5, 0.7, 0.9)
SIMLAYER_RECENT = 64
FINCH_QUESTION = 16
BUDGETS = (40, 96)
CAM_MERGE = 32  # CAMPress's default merge_budget
PARTS = ("think", "simlayerkv", "cam", "merging", "finch")
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
    position = ids.shape[1] if first_position is None else first_position
    return decode_greedily(model, cache, int(logits[0, -1].argmax()), position), prefilled


def row_positions(kept: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The position of ``whole`` [n, d] that each row of ``kept`` [k, d] copies, each exactly once (keys: RoPE makes
    every position's key its own)."""
    same = (kept[:, None, :] == whole[None, :, :]).all(-1)
    assert bool((same.sum(-1) == 1).all()), "a kept row matches no position, or several"
    return same.float().argmax(-1)


def matched_positions(kept: torch.Tensor, whole: torch.Tensor) -> list[int]:
    return sorted(row_positions(kept, whole).tolist())


@contextmanager
def expected_draws():
    """torch.bernoulli(p) returns p while this runs: CaM's merges become their expectation."""
    draw = torch.bernoulli
    torch.bernoulli = lambda p, *args, **kwargs: p.clone()
    try:
        yield
    finally:
        torch.bernoulli = draw


def cam_run(model, ids: torch.Tensor, budget: int) -> dict:
    """CAMPress over Knorm's scores, merging once per decoded token: the greedy answer (prefill and decoding under
    the press, which compresses while decoding only), and per layer the positions held at the end with each held
    token's value error per KV head against the value the model computed for it."""
    press = CAMPress(base_press=KnormPress(), compression_interval=1, target_size=budget, merge_budget=CAM_MERGE)
    n = ids.shape[1]
    held: dict[int, list[int]] = {}  # layer -> the position of each cache row
    seen: dict[int, int] = {}  # layer -> tokens read so far
    computed: dict[int, dict[int, torch.Tensor]] = {}  # layer -> position -> its value [H, d] as the model made it
    latest: dict[int, torch.Tensor] = {}
    compress = press.compress

    def recorded(module, hidden_states, keys, values, attentions, kwargs):
        layer = int(module.layer_idx)
        # what was held, then the new token; the first compression comes with the first decoded token's forward
        rows = held[layer] + [seen[layer]] if layer in held else list(range(keys.shape[2]))
        seen[layer] = rows[-1] + 1
        assert len(rows) == keys.shape[2]
        first = computed.setdefault(layer, {})
        for row, position in enumerate(rows):
            first.setdefault(position, values[0, :, row].clone())  # merges only ever add to held values later
        before = keys[0].clone()
        new_keys, new_values = compress(module, hidden_states, keys, values, attentions, kwargs)
        # each held key is a copy of one row (CaM changes values only)
        same = (new_keys[0][:, :, None, :] == before[:, None, :, :]).all(-1).any(0)
        assert bool((same.sum(-1) == 1).all())
        held[layer] = [rows[i] for i in same.float().argmax(-1).tolist()]
        latest[layer] = new_values[0].clone()
        return new_keys, new_values

    press.compress = recorded
    cache = DynamicCache()
    with press(model):  # it compresses while decoding: the answer is read under it too
        first = int(model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[0, -1].argmax())
        generated = decode_greedily(model, cache, first, n)
    layers = []
    for layer in sorted(held):
        made = torch.stack([computed[layer][p] for p in held[layer]], 1)  # [H, kept, d]
        error = (latest[layer] - made).norm(dim=-1) / made.norm(dim=-1).clamp_min(1e-12)
        layers.append({"held": held[layer], "value_error": [[round(float(e), 6) for e in head] for head in error]})
    return {"answer_ids": generated, "layers": layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="KV Lens's safetensors directory of SmolLM2-135M-Instruct")
    parser.add_argument("--out", default=str(ROOT / OUT))
    parser.add_argument("--only", nargs="*", choices=PARTS, help="run these, keep the others of an existing fixture")
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
    out = Path(args.out)
    if args.only:  # the other parts as an existing fixture has them
        fixture = {**json.loads(out.read_text()), **fixture}
    with torch.inference_mode():
        answer, whole = greedy(model, ids)
        fixture["baseline"] = {"answer_ids": answer, "answer": tokenizer.decode(answer, skip_special_tokens=True)}
        for part in PARTS:  # FINCH last: it adds its delimiter token to the model and the tokenizer
            if not args.only or part in args.only:
                fixture[part] = RUNS[part](model, tokenizer, ids, whole)
    write(fixture, out)


def run_think(model, tokenizer, ids: torch.Tensor, whole) -> dict:
    think = {"window": THINK_WINDOW, "runs": {}}
    for share in THINK_SHARES:
        answer, cache = greedy(model, ids, ThinKPress(key_channel_compression_ratio=share, window_size=THINK_WINDOW))
        pruned = [[torch.nonzero((k == 0).all(0)).flatten().tolist() for k in keys] for keys, _ in cache]
        think["runs"][str(share)] = {"pruned": pruned, "answer_ids": answer}
        print(f"think {share}: {tokenizer.decode(answer, skip_special_tokens=True)!r}", file=sys.stderr)
    return think


def run_simlayerkv(model, tokenizer, ids: torch.Tensor, whole) -> dict:
    n = ids.shape[1]
    simlayer = {"n_last": 1, "n_recent": SIMLAYER_RECENT, "n_initial": 4, "runs": {}}
    for threshold in SIMLAYER_THRESHOLDS:
        press = SimLayerKVPress(lazy_threshold=threshold, n_last=1, n_recent=SIMLAYER_RECENT, n_initial=4)
        answer, cache = greedy(model, ids, press)
        lazy = [keys.shape[1] < n for keys, _ in cache]
        simlayer["runs"][str(threshold)] = {"lazy": lazy, "answer_ids": answer}
        print(f"simlayerkv {threshold}: {sum(lazy)} lazy layers", file=sys.stderr)
    return simlayer


def run_cam(model, tokenizer, ids: torch.Tensor, whole) -> dict:
    cam = {"scorer": "KnormPress", "compression_interval": 1, "merge_budget": CAM_MERGE, "budgets": {}}
    for budget in BUDGETS:
        with expected_draws():
            record = cam_run(model, ids, budget)
        torch.manual_seed(0)
        record["drawn_answer_ids"] = cam_run(model, ids, budget)["answer_ids"]
        cam["budgets"][str(budget)] = record
        print(f"cam {budget}: {tokenizer.decode(record['answer_ids'], skip_special_tokens=True)!r}, drawn: "
              f"{tokenizer.decode(record['drawn_answer_ids'], skip_special_tokens=True)!r}", file=sys.stderr)
    return cam


def ratio_keeping(budget: int, n: int) -> float:
    """A compression_ratio for which kvpress keeps int(n x (1 - ratio)) == budget."""
    ratio = 1 - budget / n
    while int(n * (1 - ratio)) != budget:
        ratio = float(torch.nextafter(torch.tensor(ratio, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)))
    return ratio


def run_merging(model, tokenizer, ids: torch.Tensor, whole) -> dict:
    merging = {"scorer": "KnormPress", "similarity_threshold": 0.0, "merge_fraction": 1.0, "budgets": {}}
    for budget in BUDGETS:
        answer, cache = greedy(model, ids, MergingPress(press=KnormPress(ratio_keeping(budget, ids.shape[1]))))
        kept, errors = [], []
        for (keys, values), (made_keys, made_values) in zip(cache, whole):
            kept.append([]), errors.append([])
            for h in range(keys.shape[0]):
                positions = row_positions(keys[h], made_keys[h])
                order = positions.argsort()
                made = made_values[h, positions[order]]
                error = (values[h, order] - made).norm(dim=-1) / made.norm(dim=-1).clamp_min(1e-12)
                kept[-1].append(positions[order].tolist())
                errors[-1].append([round(float(e), 6) for e in error])
        merging["budgets"][str(budget)] = {"kept": kept, "value_error": errors, "answer_ids": answer}
        print(f"merging {budget}: {tokenizer.decode(answer, skip_special_tokens=True)!r}", file=sys.stderr)
    return merging


def run_finch(model, tokenizer, ids: torch.Tensor, whole) -> dict:
    input_ids, n = ids[0].tolist(), ids.shape[1]
    press = FinchPress()
    tokenizer = press.update_model_and_tokenizer(model, tokenizer)
    delimited = torch.tensor([input_ids[:-FINCH_QUESTION] + [press.delimiter_token_id] +
                              input_ids[-FINCH_QUESTION:]])
    finch = {"question": FINCH_QUESTION, "normalize_scores": True, "budgets": {}}
    for budget in BUDGETS:
        ratio = ratio_keeping(budget, n)
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
    return finch


RUNS = {"think": run_think, "simlayerkv": run_simlayerkv, "cam": run_cam, "merging": run_merging, "finch": run_finch}


def write(fixture: dict, out: Path) -> None:
    out.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
