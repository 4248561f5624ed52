"""Reference kept sets from NVIDIA kvpress, written to ``tests/fixtures/kvpress_kept.json``.

kvpress 0.5.5 needs transformers < 5.3, so it cannot live in KV Lens's venv: this script runs in a separate
venv and imports nothing from ``backend``. It is never a dependency of the project; the fixture it writes is
what the tests in our venv compare KV Lens's policies against.

Build the venv (CPU torch from the local wheel; pinning torch in the second command keeps pip from swapping it
for a CUDA build while it resolves kvpress's dependencies)::

    python3 -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install torch==2.13.0
    /tmp/kvpress-venv/bin/pip install kvpress==0.5.5 'transformers==5.2.*' torch==2.13.0

The model is the default one (SmolLM2-135M-Instruct) as KV Lens converts it to safetensors; print its
directory in KV Lens's venv with::

    .venv/bin/python -c "from backend.engine.models import load_model; print(load_model().model.config._name_or_path)"

(``~/.cache/kvlens/models/smollm2-135m-instruct-<gguf sha256[:16]>``). Then, from the repository root::

    /tmp/kvpress-venv/bin/python benchmarks/kvpress_reference.py \\
        --model ~/.cache/kvlens/models/smollm2-135m-instruct-b179c9523d0e6a0f

It takes about two minutes on one CPU thread (``--threads``) and writes about 1 MB; a rerun writes the same
bytes (``--only KEY ...`` runs some presses and keeps the others of an existing fixture, ``--no-answers`` skips the
greedy answers).

The prompt: the token ids KV Lens feeds in generate mode for ``assets/examples/needle.txt``, i.e. the text as a
user turn of the chat template with the generation prompt (``LoadedModel.encode(text, chat=True)``). The script
computes them here with the model directory's tokenizer the same way; ``--ids FILE`` (a JSON list, or an object
with "input_ids") makes it also assert they equal ids written by KV Lens. They are stored in the fixture as
"input_ids", and the test in our venv checks KV Lens still encodes the text to them.

What is recorded, for each press and budget b in BUDGETS: the whole n-token prompt is prefilled once under the
press (``with press(model): model(ids, past_key_values=cache)``), float32, sdpa attention (AdaKV and KVzip
refuse eager), and the positions kvpress keeps are read per layer and KV head:

* ScorerPress-based presses (SnapKV, PyramidKV, Knorm, KeyDiff, CUR, leverage, CriticalKV, Compactor, StreamingLLM, TOVA, ExpectedAttention, Random) gather
  the kept keys out of the cache; each kept key row is matched back to the one prompt position it was copied
  from, so the record is what kvpress kept, ties included. The press's scores are captured too, to count the
  (layer, head) pairs where the b-th and (b+1)-th best scores tie (where torch.topk's tie-breaking chose).
* AdaKV and KVzip leave the cache whole and set ``module.masked_key_indices`` (pruned (batch, head, position)
  triples) on each attention module: kept = the complement.

``compression_ratio`` is chosen per press so that kvpress's own count comes out at exactly b: ``int(n * (1 - r))
== b`` (ScorerPress, AdaKV, StreamingLLM), ``int(L * H * n * r) == L * H * (n - b)`` (KVzip) or ``int(H * n * r)
== H * (n - b)`` (KVzip layerwise); PyramidKV's fallback uses ``round(n * (1 - r))``. The ratio is stored.

The answer: the first new token is the argmax of the prefill's last logits (the prefill itself attends to the
whole prompt; kvpress compresses after each layer's attention), then greedy decoding on the compressed cache at
positions n, n+1, ... as kvpress's pipeline does, up to MAX_NEW tokens or the end-of-turn token.

The fixture (compact JSON): "versions", "model" (dir name, kvlens-source.json, n_layers, n_kv_heads, n_heads),
"dtype", "attn_implementation", "text", "chat", "n", "input_ids", "budgets", "max_new_tokens", "baseline"
({"answer_ids", "answer"} with no press) and "presses": {key: {"press": class name, "params": {...},
["prefix_length", "suffix_ids": KVzip only], "budgets": {"24": {"compression_ratio", "boundary_ties",
["n_kept_per_layer", "tied_heads": [[layer, head], ...]: ScorerPress only], "answer_ids", "answer",
"kept": [layer][kv_head] -> sorted positions}}}}.

What kvpress does here that a reader may not expect (n = 241, 30 layers, 3 KV heads):

* SnapKV/PyramidKV with the default window 64 always keep their whole window, so for b < 64 every head ties
  and the kept set is torch.topk's choice among the window's last 64 positions (deterministic on CPU, but no
  rule): "tied_heads" lists all 90 heads there.
* PyramidKV falls back to SnapKV's uniform budget for every b here (min_num = b / beta < window_size), so its
  kept sets equal SnapKV's with the same window.
* KVzip scores only positions from prefix_length on (the chat template's system + user header is never
  replayed): the n_sink first positions get the top score and positions n_sink..prefix_length-1 keep a score
  of 0, so they are always pruned. Non-layerwise budgets are global: per-layer totals vary widely.
* AdaKV keeps exactly H * b per layer, split unevenly over heads (each keeps its window and int(b * alpha)).
* RandomPress(seed=0) reseeds for every layer, so all layers keep the same positions.
* Knorm ties in layer 0, whose keys depend on the token alone: a repeated token's keys have equal norms.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvpress import (AdaKVPress, ChunkKVPress, CompactorPress, CriticalKVPress, CURPress, ExpectedAttentionPress, KeyDiffPress, KnormPress,
                     KVzipPress, LagKVPress, LeverageScorePress, PyramidKVPress, RandomPress, ScorerPress, SnapKVPress, StreamingLLMPress, TOVAPress)

BUDGETS = (24, 40, 64, 96)
MAX_NEW = 16
ROOT = Path(__file__).resolve().parents[1]
TEXT = "assets/examples/needle.txt"
OUT = "tests/fixtures/kvpress_kept.json"


def presses() -> list[tuple[str, str, dict, Callable[[float], object]]]:
    """(key, class name, parameters recorded, factory ratio -> press). Parameters are kvpress's defaults
    unless the key says otherwise; every one the press has is written out."""
    return [
        ("snapkv", "SnapKVPress", {"window_size": 64, "kernel_size": 5},
         lambda r: SnapKVPress(compression_ratio=r)),
        ("snapkv_w8_k5", "SnapKVPress", {"window_size": 8, "kernel_size": 5},
         lambda r: SnapKVPress(compression_ratio=r, window_size=8, kernel_size=5)),
        ("snapkv_w8_k7", "SnapKVPress", {"window_size": 8, "kernel_size": 7},
         lambda r: SnapKVPress(compression_ratio=r, window_size=8, kernel_size=7)),
        ("kvzip", "KVzipPress", {"layerwise": False, "n_sink": 4, "kvzip_plus_normalization": False,
                                 "chunk_size": 2048},
         lambda r: KVzipPress(compression_ratio=r)),
        ("kvzip_layerwise", "KVzipPress", {"layerwise": True, "n_sink": 4, "kvzip_plus_normalization": False,
                                           "chunk_size": 2048},
         lambda r: KVzipPress(compression_ratio=r, layerwise=True)),
        ("pyramidkv_w8", "PyramidKVPress", {"window_size": 8, "kernel_size": 5, "beta": 20},
         lambda r: PyramidKVPress(compression_ratio=r, window_size=8)),
        ("pyramidkv", "PyramidKVPress", {"window_size": 64, "kernel_size": 5, "beta": 20},
         lambda r: PyramidKVPress(compression_ratio=r)),
        ("adakv_snapkv_w8", "AdaKVPress", {"alpha_safeguard": 0.2, "press": "SnapKVPress", "window_size": 8,
                                           "kernel_size": 5},
         lambda r: AdaKVPress(SnapKVPress(compression_ratio=r, window_size=8), alpha_safeguard=0.2)),
        ("knorm", "KnormPress", {}, lambda r: KnormPress(compression_ratio=r)),
        ("keydiff", "KeyDiffPress", {}, lambda r: KeyDiffPress(compression_ratio=r)),
        ("lagkv_lag32", "LagKVPress", {"n_sink": 4, "lag_size": 32, "cross_scoring": False},
         lambda r: LagKVPress(compression_ratio=r, lag_size=32)),
        ("criticalkv_snapkv_w8", "CriticalKVPress", {"press": "SnapKVPress", "window_size": 8, "kernel_size": 5,
                                                      "epsilon": 1e-4, "first_stage_ratio": 0.5},
         lambda r: CriticalKVPress(SnapKVPress(compression_ratio=r, window_size=8, kernel_size=5))),
        # Its sketch draws from torch's global generator: seeded as it is made, right before the prefill.
        ("compactor_seed0", "CompactorPress", {"sink_size_start": 8, "sink_size_end": 4, "chunk_size": 256,
                                               "sketch_dimension": 48, "blending": None, "seed": 0},
         lambda r: (torch.manual_seed(0), CompactorPress(compression_ratio=r))[1]),
        ("leverage_seed0", "LeverageScorePress", {"sketch_dimension": 48, "seed": 0},
         lambda r: (torch.manual_seed(0), LeverageScorePress(compression_ratio=r))[1]),
        ("cur", "CURPress", {"num_sinks": 4, "leverage_type": "kv_product", "use_random_leverage": False,
                             "use_local_approximation": True, "local_window_size": 16},
         lambda r: CURPress(compression_ratio=r)),
        ("chunkkv_knorm", "ChunkKVPress", {"press": "KnormPress", "chunk_length": 20},
         lambda r: ChunkKVPress(press=KnormPress(compression_ratio=r), chunk_length=20)),
        ("streamingllm", "StreamingLLMPress", {"n_sink": 4}, lambda r: StreamingLLMPress(compression_ratio=r)),
        ("tova", "TOVAPress", {}, lambda r: TOVAPress(compression_ratio=r)),
        ("expected_attention", "ExpectedAttentionPress",
         {"n_future_positions": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.0},
         lambda r: ExpectedAttentionPress(compression_ratio=r)),
        ("random_seed0", "RandomPress", {"seed": 0}, lambda r: RandomPress(compression_ratio=r, seed=0)),
    ]


def ratio_for(cls: str, params: dict, n: int, b: int, n_layers: int, n_kv: int) -> float:
    """A compression_ratio for which kvpress's own arithmetic keeps exactly b of n (see the module doc)."""
    def ok(r: float) -> bool:
        if not 0 <= r < 1:
            return False
        if cls == "KVzipPress":
            if params["layerwise"]:
                return int(n_kv * n * r) == n_kv * (n - b)
            return int(n_layers * n_kv * n * r) == n_layers * n_kv * (n - b)
        if cls == "PyramidKVPress" and round(n * (1 - r)) != b:
            return False
        return int(n * (1 - r)) == b and n - int(n * (1 - r)) == n - b

    r = 1 - b / n
    candidates = [r]
    up = down = r
    for _ in range(64):
        up, down = math.nextafter(up, 2.0), math.nextafter(down, -1.0)
        candidates += [up, down]
    for cand in candidates:
        if ok(cand):
            return cand
    raise SystemExit(f"no compression_ratio near {r!r} makes {cls} keep exactly {b} of {n}")


def prompt_ids(tokenizer, text: str) -> list[int]:
    """What KV Lens's ``LoadedModel.encode(text, chat=True)`` returns for this tokenizer."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def tied_rows(scores: torch.Tensor, n_kept: int) -> list[int]:
    """Rows of ``scores`` (..., n) that tie at the keep/prune boundary (n_kept-th best == next best): there
    torch.topk's tie-breaking, not the score, chose which positions were kept."""
    flat = scores.reshape(-1, scores.shape[-1]).float()
    if n_kept >= flat.shape[-1] or n_kept <= 0:
        return []
    top = flat.sort(dim=-1, descending=True).values
    return torch.nonzero(top[:, n_kept - 1] == top[:, n_kept]).flatten().tolist()


def boundary_ties(scores: torch.Tensor, n_kept: int) -> int:
    return len(tied_rows(scores, n_kept))


class Capture:
    """Wraps a ScorerPress instance's ``score`` and ``compress`` to read back what it kept, layer by layer."""

    def __init__(self, press: ScorerPress | ChunkKVPress, n_layers: int):
        self.kept: list = [None] * n_layers
        self.n_kept: list = [None] * n_layers
        self.tied_heads: list[list[int]] = []
        scorer = press.press if isinstance(press, ChunkKVPress) else press  # ChunkKV keeps chunks of its scores
        orig_score, orig_compress = scorer.score, press.compress
        last = {}

        def score(module, hidden_states, keys, values, attentions, kwargs):
            last["scores"] = orig_score(module, hidden_states, keys, values, attentions, kwargs)
            return last["scores"]

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            new_keys, new_values = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
            layer = int(module.layer_idx)
            per_head = []
            for h in range(keys.shape[1]):
                # each kept row is a copy (gather) of exactly one prompt position's key
                same = (new_keys[0, h][:, None, :] == keys[0, h][None, :, :]).all(-1)
                hits = same.sum(-1)
                assert bool((hits == 1).all()), f"layer {layer} head {h}: a kept key matches {hits.tolist()}"
                per_head.append(sorted(same.float().argmax(-1).tolist()))
                assert len(set(per_head[-1])) == len(per_head[-1])
            self.kept[layer] = per_head
            self.n_kept[layer] = new_keys.shape[2]
            scores = last.pop("scores")[0]
            if scorer is press:  # a token-level top-k (a chunk's ties are not a token's)
                self.tied_heads += [[layer, h] for h in tied_rows(scores, new_keys.shape[2])]
            return new_keys, new_values

        scorer.score, press.compress = score, compress


def masked_kept(model, n: int) -> list:
    """Kept positions from each attention module's ``masked_key_indices`` (AdaKV, KVzip)."""
    kept = []
    for layer in model.model.layers:
        module = layer.self_attn
        n_kv = module.config.num_key_value_heads
        mask = torch.ones(n_kv, n, dtype=torch.bool)
        idx = getattr(module, "masked_key_indices", None)
        if idx is not None:
            batch, head, seq = idx
            assert bool((batch == 0).all())
            mask[head, seq] = False
        kept.append([torch.nonzero(mask[h]).flatten().tolist() for h in range(n_kv)])
    return kept


def clear_masks(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


def decode_greedily(model, cache, first: int, position: int) -> list[int]:
    """``first`` and the greedy tokens after it, each read at the next position from ``position`` on, on ``cache``,
    up to MAX_NEW tokens or the end of the turn."""
    eos = model.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos])
    generated = [first]
    while len(generated) < MAX_NEW and generated[-1] not in stop:
        step = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache,
                     position_ids=torch.tensor([[position]]))
        generated.append(int(step.logits[0, -1].argmax()))
        position += 1
    return generated


@torch.inference_mode()
def run_press(model, tokenizer, ids: torch.Tensor, cls: str, params: dict, press, answer: bool) -> dict:
    n = ids.shape[1]
    n_layers = model.config.num_hidden_layers
    clear_masks(model)
    out: dict = {}
    capture = Capture(press, n_layers) if isinstance(press, (ScorerPress, ChunkKVPress)) else None
    if isinstance(press, AdaKVPress):
        inner, scores_seen = press.press, []
        orig_score = inner.score

        def score(module, hidden_states, keys, values, attentions, kwargs):
            s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
            scores_seen.append(s)  # AdaKV scatters the safeguard into this tensor in place
            return s
        inner.score = score
    if isinstance(press, KVzipPress):
        orig_post, kvzip_scores = press.compress_post, {}

        def compress_post(model_):
            kvzip_scores["score_val"] = press.score_val  # compress_post writes the sinks' score into it
            kvzip_scores["prefix_length"] = press.prefix_length
            kvzip_scores["suffix_ids"] = press._suffix_ids[0].tolist()
            kvzip_scores["context_length"] = press.context_length
            return orig_post(model_)
        press.compress_post = compress_post

    cache = DynamicCache()
    with press(model):
        logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
    first = logits[0, -1].argmax()

    if capture is not None:
        kept = capture.kept
        out["n_kept_per_layer"] = capture.n_kept
        out["boundary_ties"] = len(capture.tied_heads)
        out["tied_heads"] = capture.tied_heads
    else:
        kept = masked_kept(model, n)
        if isinstance(press, AdaKVPress):
            b = int(n * (1 - press.compression_ratio))
            out["boundary_ties"] = sum(boundary_ties(-s.reshape(1, -1), s.numel() - s.shape[1] * b)
                                       for s in scores_seen)
        else:
            sv = kvzip_scores["score_val"]  # (layers, 1, kv_heads, n)
            b = round(n * (1 - press.compression_ratio))
            if params["layerwise"]:
                out["boundary_ties"] = sum(boundary_ties(-sv[i].reshape(1, -1), sv[i].numel() - sv.shape[2] * b)
                                           for i in range(sv.shape[0]))
            else:
                out["boundary_ties"] = boundary_ties(-sv.reshape(1, -1), sv.numel() - sv.shape[0] * sv.shape[2] * b)
            out["prefix_length"] = kvzip_scores["prefix_length"]
            out["context_length"] = kvzip_scores["context_length"]
            out["suffix_ids"] = kvzip_scores["suffix_ids"]
    out["kept"] = kept

    if answer:
        generated = decode_greedily(model, cache, int(first), n)
        out["answer_ids"] = generated
        out["answer"] = tokenizer.decode(generated, skip_special_tokens=True)
    clear_masks(model)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="KV Lens's safetensors directory of SmolLM2-135M-Instruct")
    parser.add_argument("--text", default=str(ROOT / TEXT), help="the prompt's text (default: %(default)s)")
    parser.add_argument("--ids", help="JSON of KV Lens's ids for the text, to assert equal to ours")
    parser.add_argument("--out", default=str(ROOT / OUT), help="fixture to write (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-answers", action="store_true", help="skip the greedy answers")
    parser.add_argument("--only", nargs="*", help="press keys to run (default: all)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzip warns about its cost on every construction
    start = time.time()
    model_dir = Path(args.model).expanduser().resolve()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    # KVzipPress loads the tokenizer from config.name_or_path: it must be this directory
    model.config._name_or_path = str(model_dir)

    text = Path(args.text).read_text()
    input_ids = prompt_ids(tokenizer, text)
    if args.ids:
        theirs = json.loads(Path(args.ids).read_text())
        theirs = theirs["input_ids"] if isinstance(theirs, dict) else theirs
        assert theirs == input_ids, "KV Lens's ids differ from this tokenizer's"
    ids = torch.tensor([input_ids])
    n = len(input_ids)
    n_layers, n_kv = model.config.num_hidden_layers, model.config.num_key_value_heads

    source = model_dir / "kvlens-source.json"
    fixture: dict = {
        "about": "kept positions [layer][kv_head] -> sorted prompt positions after kvpress compresses the "
                 "prefilled prompt; written by benchmarks/kvpress_reference.py",
        "versions": {"kvpress": importlib.metadata.version("kvpress"), "transformers": transformers.__version__,
                     "torch": torch.__version__},
        "model": {"name": "smollm2-135m-instruct", "dir": model_dir.name,
                  "source": json.loads(source.read_text()) if source.is_file() else None,
                  "n_layers": n_layers, "n_kv_heads": n_kv, "n_heads": model.config.num_attention_heads},
        "dtype": "float32", "attn_implementation": "sdpa",
        "text": TEXT, "chat": True, "n": n, "input_ids": input_ids,
        "budgets": list(BUDGETS), "max_new_tokens": MAX_NEW,
        "presses": {},
    }
    if not args.no_answers:
        with torch.inference_mode():
            cache = DynamicCache()
            generated = [int(model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[0, -1].argmax())]
            while len(generated) < MAX_NEW and generated[-1] != model.generation_config.eos_token_id:
                step = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache)
                generated.append(int(step.logits[0, -1].argmax()))
        fixture["baseline"] = {"answer_ids": generated,
                               "answer": tokenizer.decode(generated, skip_special_tokens=True)}

    for key, cls, params, make in presses():
        if args.only and key not in args.only:
            continue
        t0 = time.time()
        entry = {"press": cls, "params": params, "budgets": {}}
        for b in BUDGETS:
            ratio = ratio_for(cls, params, n, b, n_layers, n_kv)
            run = run_press(model, tokenizer, ids, cls, params, make(ratio), not args.no_answers)
            kept = run.pop("kept")
            counts = [[len(h) for h in layer] for layer in kept]
            if cls in ("AdaKVPress",):
                assert all(sum(c) == n_kv * b for c in counts), counts
            elif cls == "KVzipPress":
                if params["layerwise"]:
                    assert all(sum(c) == n_kv * b for c in counts), counts
                else:
                    assert sum(map(sum, counts)) == n_layers * n_kv * b, counts
            elif cls not in ("PyramidKVPress", "ChunkKVPress"):  # ChunkKV keeps whole chunks
                assert all(c == b for layer in counts for c in layer), counts
            if cls == "KVzipPress":
                entry["prefix_length"] = run.pop("prefix_length")
                entry["suffix_ids"] = run.pop("suffix_ids")
                assert run.pop("context_length") == n
            entry["budgets"][str(b)] = {"compression_ratio": ratio, **run, "kept": kept}
        fixture["presses"][key] = entry  # no timings in the fixture: a rerun writes the same bytes
        print(f"{key}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)

    out = Path(args.out)
    if args.only and out.is_file():  # the other presses stay as they were recorded
        kept = json.loads(out.read_text())
        if kept.get("input_ids") != fixture["input_ids"] or kept.get("versions") != fixture["versions"]:
            sys.exit(f"{out} was recorded on other tokens or versions: run every press again")
        fixture = {**kept, "presses": {**kept["presses"], **fixture["presses"]}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes) in {time.time() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
