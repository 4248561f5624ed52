"""The policies as a visitor picks them: by kind, each with a line and its paper, and a few named sets.

The kind comes from what a policy declares (``Policy.kind`` and ``Policy.reforms``), never from its name, so a
registered plugin lands in its kind's list with no change here. No Gradio.
"""
from __future__ import annotations

import json
from collections.abc import Mapping

# (id, the heading a visitor reads)
KINDS = (("eviction", "Evict at every step"), ("compression", "Compress once"),
         ("selection", "Select per query"), ("held", "Hold in another form"))
HELD_FORMS = ("channels", "merge", "precision")  # a ``reforms`` that keeps every token in another form

# Named sets a visitor starts from: (label, policies). Each fits the page's limit of policies side by side.
SETS = (
    ("The first run: sinks, TOVA, A2SF, ReAttention", ("sinks", "tova", "a2sf", "reattention")),
    ("The classics: sinks, H2O, TOVA", ("sinks", "h2o", "tova")),
    ("kvpress's baselines: StreamingLLM, SnapKV, Knorm, Expected Attention",
     ("streamingllm", "snapkv", "knorm", "expected_attention")),
    ("Selection: Quest, SparQ, ReAttention", ("quest", "sparq", "reattention")),
    ("Held forms: KIVI, CaM, ThinK", ("kivi", "cam", "think")),
)


def kind_of(policy_class) -> str:
    """Which of ``KINDS`` a policy class belongs to ("" for Full, the reference every run has)."""
    if policy_class.kind == "full":
        return ""
    if getattr(policy_class, "reforms", "") in HELD_FORMS:
        return "held"
    return policy_class.kind if policy_class.kind in dict(KINDS) else "compression"


def by_kind(policies: Mapping[str, type]) -> dict[str, list[str]]:
    """Kind id -> the policies' names in registration order (every kind present, maybe empty)."""
    out: dict[str, list[str]] = {kind: [] for kind, _ in KINDS}
    for name, cls in policies.items():
        kind = kind_of(cls)
        if kind:
            out[kind].append(name)
    return out


def kinds_table(policies: Mapping[str, type]) -> str:
    """The policies by kind as a Markdown table (kind, policy, paper): the README's, which a test keeps in step with
    the registry (``python -m backend policies --by-kind`` prints it). Full comes first, as the reference."""
    lines = ["| kind | policy | paper |", "|---|---|---|"]
    lines += [f"| reference | `{name}` | none: every run's first row, what each policy is measured against |"
              for name, cls in policies.items() if not kind_of(cls)]
    headings = dict(KINDS)
    for kind, names in by_kind(policies).items():
        lines += [f"| {headings[kind] if i == 0 else ''} | `{name}` | {policies[name].paper} |"
                  for i, name in enumerate(names)]
    return "\n".join(lines)


def descriptions(policies: Mapping[str, type]) -> dict[str, str]:
    """Name -> "its line · its paper", shown when the pointer rests on the policy."""
    return {name: " · ".join(part for part in (cls.summary, cls.paper) if part) for name, cls in policies.items()}


def hover_script(policies: Mapping[str, type], selector: str) -> str:
    """A <script> giving each checkbox under ``selector`` its policy's description as a tooltip (Gradio's
    checkbox groups take no per-choice hint), kept as the page re-renders them."""
    table = json.dumps(descriptions(policies)).replace("</", "<\\/")
    return f"""<script>
(() => {{
  const about = {table};
  const label = () => document.querySelectorAll({json.dumps(selector + " label")}).forEach((el) => {{
    const name = el.textContent.trim();
    if (about[name] && el.title !== about[name]) el.title = about[name];
  }});
  new MutationObserver(label).observe(document.documentElement, {{childList: true, subtree: true}});
}})();
</script>"""
