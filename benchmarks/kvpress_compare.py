"""KV Lens's prefill policies against NVIDIA kvpress 0.5.5: the kept sets on the same model, tokens and budgets.

kvpress's kept sets come from ``tests/fixtures/kvpress_kept.json``, written in a separate venv by
``benchmarks/kvpress_reference.py`` (kvpress needs transformers < 5.3; its docstring has the commands). This
script runs KV Lens on the fixture's tokens (the needle example in the chat template, generate mode) twice per
press: with the settings that match kvpress's (``MATCHED``) and with KV Lens's defaults at that budget, and
prints per press and budget the mean Jaccard index of the kept prompt positions over layers and KV heads, and
each side's greedy answer.

    .venv/bin/python -m benchmarks.kvpress_compare [--budgets 24 40 64 96] [--merges]

``--merges`` compares the merging policies instead, against ``tests/fixtures/kvpress_special.json``
(``benchmarks/kvpress_special.py``): kvpress's ``CAMPress`` and ``MergingPress`` over Knorm's scores, what each layer
holds, how far each held value moved, and the answers.

``tests/test_kvpress_reference.py`` asserts the matched sets are equal.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kvpress_kept.json"

# kvpress press (a key of the fixture) -> KV Lens spec with kvpress's settings, at budget {b}. kvpress's own
# defaults where they fit; its SnapKV window of 64 holds the whole budget at 64 or less, so the window-8 entries
# are the ones compared there. An eviction or attending policy's budget counts the query's own token, so it
# keeps b prompt tokens at budget {b1} = b + 1; TOVA evicts one token a step as the paper, kvpress once.
MATCHED = {
    "snapkv_w8_k5": "snapkv:budget={b},preset=kvpress,window=8",
    "snapkv_w8_k7": "snapkv:budget={b},preset=kvpress,window=8,kernel=7",
    "snapkv": "snapkv:budget={b},preset=kvpress",
    "pyramidkv_w8": "pyramidkv:budget={b},preset=kvpress",
    "adakv_snapkv_w8": "adakv:budget={b},preset=kvpress",
    "kvzip": "kvzip:budget={b},preset=kvpress",
    "kvzip_layerwise": "kvzip:budget={b},preset=kvpress,scope=layer",
    "knorm": "knorm:budget={b}",
    "keydiff": "keydiff:budget={b}",
    "chunkkv_knorm": "chunkkv:budget={b},scorer=knorm,preset=kvpress",
    "cur": "cur:budget={b}",
    "leverage_seed0": "leverage:budget={b}",
    "compactor_seed0": "compactor:budget={b},preset=kvpress",
    "criticalkv_snapkv_w8": "criticalkv:budget={b},preset=kvpress",
    "lagkv_lag32": "lagkv:budget={b},lag=32",
    "streamingllm": "streamingllm:budget={b1}",
    "tova": "tova:budget={b1},heads=layer",
    "expected_attention": "expected_attention:budget={b},window=241,epsilon=0",
    "random_seed0": "random:budget={b}",
}
def fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def fits(press: str, budget: int) -> bool:
    """kvpress's window-64 SnapKV keeps only its window, tied, at budgets of 64 or less: nothing to compare."""
    return press != "snapkv" or budget > 64


def kept_sets(trace, n: int) -> list[list[list[int]]]:
    """[layer][kv head] -> the prompt positions the first decoding query (position n) reads: what the cache
    held once the prompt was read."""
    return [[np.flatnonzero(head[:n]).tolist() for head in trace.reads_at(layer, n)]
            for layer in range(trace.meta["n_layers"])]


def jaccard(a: list[list[list[int]]], b: list[list[list[int]]]) -> float:
    """Mean over layers and heads of |A and B| / |A or B|."""
    scores = [len(set(x) & set(y)) / max(1, len(set(x) | set(y))) for la, lb in zip(a, b) for x, y in zip(la, lb)]
    return float(np.mean(scores))


def run(lm, specs: list[str], ids: list[int], max_new_tokens: int = 16):
    """KV Lens's traces of ``specs`` on ``ids`` in generate mode (kvpress compresses the prompt, then decodes)."""
    from backend.engine.runner import compute_traces
    from backend.policies import parse_spec

    traces, _ = compute_traces(lm, specs, [parse_spec(s) for s in specs], ids, mode="generate",
                               max_new_tokens=max_new_tokens, record_layers=())
    return traces


SPECIAL = FIXTURE.with_name("kvpress_special.json")


def merges(lm) -> None:
    """CaM and Merging with kvpress's settings against kvpress, and KV Lens's defaults beside them."""
    data = json.loads(SPECIAL.read_text())
    ids, n = data["input_ids"], len(data["input_ids"])
    decode = lambda tokens: lm.tokenizer.decode(tokens).strip()  # noqa: E731
    print("| press | budget | KV Lens | layers holding kvpress's tokens | held values' error, largest gap | kvpress "
          "answer | KV Lens answer |")
    print("|---|---|---|---|---|---|---|")
    for budget, cam in data["cam"]["budgets"].items():
        read = len(cam["answer_ids"]) - 1  # kvpress's last token is never read
        expected = f"cam:budget={budget},window=0,scorer=knorm,preset=kvpress,sample=expected"
        drawn = expected.replace(",sample=expected", "")
        default = default_spec("cam", int(budget))
        traces = dict(zip([expected, drawn, default], run(lm, [expected, drawn, default], ids, max_new_tokens=read)))
        trace = traces[expected]
        same = [all(np.flatnonzero(head).tolist() == layer["held"] for head in trace.evicted_at[i][:, : n + read] == -1)
                for i, layer in enumerate(cam["layers"])]
        gap = max(float(np.abs(trace.forms["value_error"][i][:, layer["held"]].astype(float) -
                               np.array(layer["value_error"])).max()) for i, layer in enumerate(cam["layers"]))
        print(f"| CAMPress (Knorm, interval 1, expected draws) | {budget} | `{expected}` | {sum(same)} of {len(same)} | "
              f"{gap:.4f} | {decode(cam['answer_ids'][:read])!r} | {decode(trace.generated_ids)!r} |")
        print(f"| CAMPress, drawn (kvpress: torch.manual_seed(0)) | {budget} | `{drawn}` | - | - | "
              f"{decode(cam['drawn_answer_ids'][:read])!r} | {decode(traces[drawn].generated_ids)!r} |")
        print(f"| (KV Lens's default) | {budget} | `{default}` | - | - | - | {decode(traces[default].generated_ids)!r} |")
    for budget, merging in data["merging"]["budgets"].items():
        matched, default = f"merging:budget={budget},scorer=knorm", default_spec("merging", int(budget))
        traces = dict(zip([matched, default], run(lm, [matched, default], ids, max_new_tokens=data["max_new_tokens"])))
        trace = traces[matched]
        ours = kept_sets(trace, n)
        same = sum(a == b for a, b in zip(ours, merging["kept"]))
        gap = max(float(np.abs(np.stack([trace.forms["value_error"][i][h, p] for h, p in enumerate(kept)]).astype(float)
                               - np.array(errors)).max()) for i, (kept, errors) in
                  enumerate(zip(merging["kept"], merging["value_error"])))
        print(f"| MergingPress (Knorm) | {budget} | `{matched}` | {same} of {len(ours)} | {gap:.4f} | "
              f"{decode(merging['answer_ids'])!r} | {decode(trace.generated_ids)!r} |")
        print(f"| (KV Lens's default) | {budget} | `{default}` | - | - | - | {decode(traces[default].generated_ids)!r} |")


def default_spec(name: str, budget: int) -> str:
    from backend.policies import POLICIES

    return POLICIES[name].for_budget(budget).spec()


def main() -> None:
    from backend.engine.models import load_model
    from backend.policies import POLICIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="*", default=None)
    parser.add_argument("--merges", action="store_true", help="compare CaM and Merging (kvpress_special.json)")
    args = parser.parse_args()
    data = fixture()
    lm = load_model()
    if args.merges:
        merges(lm)
        return
    ids, n = data["input_ids"], data["n"]
    assert lm.encode(Path(data["text"]).read_text(), chat=True) == ids, "the fixture's tokens are not KV Lens's"
    budgets = args.budgets or data["budgets"]
    print(f"kvpress {data['versions']['kvpress']} on {data['model']['name']}, {n} tokens; baseline answer: "
          f"{data['baseline']['answer']!r}")
    print("| press | budget | KV Lens matched | Jaccard matched | Jaccard defaults | kvpress answer | "
          "KV Lens matched answer | KV Lens defaults answer |")
    print("|---|---|---|---|---|---|---|---|")
    for budget in budgets:
        # The same press at KV Lens's defaults for the budget (what the app's budget slider gives).
        rows = [(press, MATCHED[press].format(b=budget, b1=budget + 1),
                 POLICIES[MATCHED[press].partition(":")[0]].for_budget(budget).spec())
                for press in MATCHED if fits(press, budget)]
        specs = [m for _, m, _ in rows] + [d for _, _, d in rows]
        traces = dict(zip(specs, run(lm, specs, ids)))
        for press, matched, default in rows:
            theirs = data["presses"][press]["budgets"][str(budget)]
            answer = {s: lm.tokenizer.decode(traces[s].generated_ids).strip() for s in (matched, default)}
            print(f"| {press} | {budget} | `{matched}` | {jaccard(kept_sets(traces[matched], n), theirs['kept']):.3f} | "
                  f"{jaccard(kept_sets(traces[default], n), theirs['kept']):.3f} | {theirs['answer'].strip()!r} | "
                  f"{answer[matched]!r} | {answer[default]!r} |")


if __name__ == "__main__":
    main()
