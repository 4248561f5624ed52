"""Which policies answer the shipped needle example: every registered policy at each budget.

    python -m benchmarks.needle_example [--budgets 24,40,64] [--policies all] [--new-tokens 24]

The example (``assets/examples/needle.txt``, 240 prompt tokens as a chat turn) asks for a room number
stated in its first sentence. Each (policy, budget) is a row of one generate-mode run (greedy, the
default model, nothing recorded); the answer is right when it holds 317. Prints a Markdown table:
one row per policy, one column per budget, the answer's first words with a check mark or a cross.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from backend.policies import POLICIES
from backend.engine.runner import compute_traces

from .common import model

EXAMPLE = Path(__file__).resolve().parents[1] / "assets" / "examples" / "needle.txt"
ANSWER = "317"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budgets", default="24,40,64")
    parser.add_argument("--policies", default="all", help="comma-separated names, or all registered but full")
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    names = [n for n in POLICIES if n != "full"] if args.policies == "all" else args.policies.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    lm = model()
    ids = lm.encode(EXAMPLE.read_text(), chat=True)
    specs = [f"{name}:budget={budget}" for name in names for budget in budgets]
    policies = [POLICIES[name].for_budget(budget) for name in names for budget in budgets]
    traces, full = compute_traces(lm, specs, policies, ids, "generate", args.new_tokens, record_layers=())

    def cell(trace) -> str:
        answer = " ".join(lm.tokenizer.decode(trace.generated_ids, skip_special_tokens=True).split())
        right = re.search(rf"(?<!\d){ANSWER}(?!\d)", answer) is not None
        return f"{'✓' if right else '✗'} {answer[:40]}".replace("|", "/")

    print(f"{len(ids)} prompt tokens; Full: {cell(full)}\n")
    print("| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |")
    print("|---|" + "---|" * len(budgets))
    for i, name in enumerate(names):
        row = traces[i * len(budgets):(i + 1) * len(budgets)]
        print(f"| `{name}` | " + " | ".join(cell(t) for t in row) + " |")


if __name__ == "__main__":
    main()
