"""One task sample under many policies: lm-evaluation-harness builds the request (the prompt as it writes it,
``gen_prefix`` and the generation settings), KV Lens answers it with every policy as a row of one batched
generate-mode run (Full the reference row), and lm-eval's own metric scores each answer.

Two settings (``SETTINGS``) say what the policies decide over:

* ``agnostic`` (query-agnostic, kvpress's leaderboard): the policies take the prompt to end where the question
  starts (``context_end``), so a compression policy compresses the context alone and the question is read
  under the compressed cache;
* ``aware`` (query-aware): the question is part of the prompt they decide over.

A ratio counts the context's tokens (those before the question) in both settings, so a policy has the same
budget either way (kvpress's query-aware runs count the question too: a few dozen tokens more).

A per-step policy (TOVA, H2O, A2SF, ...) walks every token either way, the question's too, evicting as it
goes: it never sees a token before it is read, so both settings give it the same trace (the store replays it)
and only its ratio's budget differs. A selection policy with a dense prefill (Quest, SparQ ``prefill=dense``)
reads the context densely and selects from the question on in the agnostic setting.

RULER's prompts end with the question on a line of its own after the context (every template in lm-eval's
``ruler`` tasks); the question starts at that line's last occurrence in the prompt, in tokens where the
prompt's tokens stop agreeing with those of the text before it.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine.models import LoadedModel, default_record_layers
from ..limits import Limits, RowPrice, row_cost
from ..policies import Policy, parse_spec
from ..runs import Run, put_link, replay_or_compute
from ..traces.store import TraceStore
from ..traces.trace import Trace
from .tasks import load_task, score

SETTINGS = ("agnostic", "aware")
# Rows per batched run. 77 rows (19 policies x 4 ratios and Full) at 1k tokens held 21 GB at their peak, past
# what the row-token price foresaw (the OOM killer stopped the first shipped grid): as the sweep does, a sample's
# rows go in runs of at most this many (each with Full's reference row; the store keys do not change).
MAX_ROWS = 32


@dataclass(frozen=True)
class TaskRequest:
    """What lm-eval asks of a model for one sample: the prompt (``context``, chat template and ``gen_prefix``
    applied), the stop strings and the new tokens, and the sample (``doc``: its input and references)."""

    context: str
    until: tuple[str, ...]
    max_new_tokens: int
    doc: dict


@dataclass(frozen=True)
class Answer:
    """One policy's answer to a request: its spec, the policy (a ratio resolved to its budget), the answer cut
    at the first stop string, its store key and Full's, whether its run's traces are stored, and its trace (None
    where the caller keeps answers only: a sample's selection traces at 8k take 1-2 GB each)."""

    spec: str
    policy: Policy
    text: str
    trace: Trace | None
    key: str
    full_key: str
    stored: bool


def chat_template(lm: LoadedModel):
    """lm-eval's ``chat_template`` callable for ``lm``: the chat as the model's template writes it; without a
    generation prompt lm-eval ends the chat with an assistant turn holding ``gen_prefix``, which the model
    then continues."""
    def render(chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return lm.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                add_generation_prompt=add_generation_prompt,
                                                continue_final_message=not add_generation_prompt)
    return render


def lm_eval_request(task, index: int, lm: LoadedModel, chat: bool) -> TaskRequest:
    """Sample ``index`` of lm-eval's ``task`` as lm-eval's own request builder makes it for ``lm`` (with the
    model's chat template when ``chat`` and the model has one)."""
    from lm_eval.models.utils import normalize_gen_kwargs

    chat = chat and lm.chats
    task.build_all_requests(samples=[int(index)], apply_chat_template=chat,
                            chat_template=chat_template(lm) if chat else None)
    instance = task.instances[0]
    context, gen_kwargs = instance.args
    kwargs = normalize_gen_kwargs(dict(gen_kwargs), 256)
    return TaskRequest(context=context, until=tuple(kwargs["until"]), max_new_tokens=int(kwargs["max_gen_toks"]),
                       doc=dict(instance.doc))


def question(doc: dict) -> str:
    """The sample's question: the last line of its input (RULER writes the context, then the question); ValueError
    for a sample with no ``input``."""
    if not isinstance(doc.get("input"), str):
        raise ValueError("the sample does not say where its question starts (RULER's have an input whose last line "
                         "it is); run the task query-aware")
    return doc["input"].rstrip().rsplit("\n", 1)[-1]


def encode(lm: LoadedModel, context: str) -> list[int]:
    """The prompt's tokens; a chat template that writes the BOS itself does not get a second one."""
    ids = lm.encode(context)
    bos = getattr(lm.tokenizer, "bos_token_id", None)
    return ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids


def context_end(lm: LoadedModel, context: str, ids: Sequence[int], asked: str) -> int:
    """How many of the prompt's tokens ``ids`` come before the question ``asked``: the tokens of the text up
    to the question's last occurrence that the prompt's tokens agree with; ValueError when the prompt does not
    hold the question."""
    at = context.rfind(asked) if asked.strip() else -1
    if at <= 0:
        raise ValueError("the prompt does not hold its question, so the context cannot be told from it; run the "
                         "task query-aware")
    before = encode(lm, context[:at])
    same = next((i for i, (x, y) in enumerate(zip(before, ids)) if x != y), min(len(before), len(ids)))
    if same < 1:
        raise ValueError("the prompt has no context before its question; run the task query-aware")
    return same


def counted_tokens(lm: LoadedModel, request: TaskRequest, ids: Sequence[int], setting: str) -> int:
    """The tokens a ratio counts: the context's, before the question, in both settings (so a policy has the same
    budget either way, and a per-step policy the same trace); the whole prompt's for a query-aware request whose
    sample does not say where its question starts (any lm-eval task, through ``kvlens``)."""
    try:
        return context_end(lm, request.context, ids, question(request.doc))
    except ValueError:
        if setting == "agnostic":
            raise
        return len(ids)


def _batches(lm: LoadedModel, policies: Sequence[Policy], length: int, limits: Limits) -> list[list[int]]:
    """The rows' indices in runs of at most ``MAX_ROWS`` rows that each fit the machine's memory."""
    limit = limits.row_token_limit(RowPrice.of(lm.model.config), length)
    batches, cost = [[]], 0
    for i, policy in enumerate(policies):
        own = row_cost(policy, length) if policy.kind != "full" else 0
        if own > limit:
            raise ValueError(f"{policy.spec()} on {length} tokens costs {own:,} row-tokens, more than the "
                             f"{limit:,} this machine's memory holds")
        if batches[-1] and (cost + own > limit or len(batches[-1]) == MAX_ROWS):
            batches.append([])
            cost = 0
        batches[-1].append(i)
        cost += own
    return batches


def answer(lm: LoadedModel, request: TaskRequest, specs: Sequence[str], setting: str = "agnostic",
           store: TraceStore | None = None, limits: Limits | None = None, record_layers: Sequence[int] = (),
           keep_traces: bool = True) -> list[Answer]:
    """Every spec's answer to ``request`` (``full`` among them answers as the reference row): as few batched
    runs as ``MAX_ROWS`` and the machine's memory allow (one for up to 32 rows), through the store. A ratio counts
    the context's tokens (``counted_tokens``). Without ``keep_traces`` each run's traces are let go once answered,
    so a sample holds one run's traces at a time. ValueError in one line when the request cannot run."""
    if setting not in SETTINGS:
        raise ValueError(f"setting must be one of {', '.join(SETTINGS)}, got {setting!r}")
    ids = encode(lm, request.context)
    if len(ids) < 2:
        raise ValueError("the prompt needs at least 2 tokens")
    length = len(ids) + request.max_new_tokens
    if length > lm.context:
        raise ValueError(f"the prompt ({len(ids)} tokens) and {request.max_new_tokens} new tokens come to more than "
                         f"the {lm.context} tokens {lm.name} reads")
    end = counted_tokens(lm, request, ids, setting)
    decide_at = end if setting == "agnostic" else None  # query-agnostic: the policies decide before the question
    policies = [parse_spec(spec, end) for spec in specs]
    asked = [i for i, p in enumerate(policies) if p.name != "full"]
    answers: dict[int, Answer] = {}
    run = None
    for batch in _batches(lm, [policies[i] for i in asked], length, limits or Limits.for_machine()):
        rows = [asked[j] for j in batch]
        run = replay_or_compute(lm, [specs[i] for i in rows], [policies[i] for i in rows], ids, "generate",
                                request.max_new_tokens, store, record_layers=record_layers, context_end=decide_at)
        for k, i in enumerate(rows):
            answers[i] = _answer(lm, specs[i], policies[i], run.traces[k], run.keys[k], run, request.until,
                                 keep_traces)
    if run is None:  # only Full asked: a run of its reference row alone
        run = replay_or_compute(lm, [], [], ids, "generate", request.max_new_tokens, store,
                                record_layers=record_layers, context_end=decide_at)
    for i, policy in enumerate(policies):
        if i not in answers:  # Full: the reference row every run has
            answers[i] = _answer(lm, specs[i], policy, run.full, run.full_key, run, request.until, keep_traces)
    return [answers[i] for i in range(len(specs))]


def _answer(lm: LoadedModel, spec: str, policy: Policy, trace: Trace, key: str, run: Run,
            until: Sequence[str], keep_trace: bool = True) -> Answer:
    from lm_eval.models.utils import postprocess_generated_text

    text = postprocess_generated_text(lm.tokenizer.decode(trace.generated_ids, skip_special_tokens=True),
                                      list(until), None)
    return Answer(spec=spec, policy=policy, text=text, trace=trace if keep_trace else None, key=key,
                  full_key=run.full_key, stored=run.stored)


def link(store: TraceStore | None, lm: LoadedModel, request: TaskRequest, item: Answer, full_key: str,
         evidence_end: int | None = None) -> str:
    """A share link (the app's ``?run=``) to ``item``'s trace beside Full's: its id, from the traces' keys (the
    same sample under the same policy has the same link), or "" when the store cannot hold it. It opens with the
    sample's references marked as its evidence (``api.RunRequest.evidence``), before ``evidence_end`` tokens."""
    if store is None or not item.stored:
        return ""
    run_id = hashlib.sha256(json.dumps([item.key, full_key]).encode()).hexdigest()[:32]
    specs = [] if item.policy.name == "full" else [item.spec]
    keys = [] if item.policy.name == "full" else [item.key]
    references = request.doc.get("outputs")  # RULER's; another lm-eval task's sample may name none
    prompt = {"prompt": request.context, "specs": specs, "mode": "generate", "max_new_tokens": request.max_new_tokens,
              "model": lm.name, "chat": False, "evidence_end": evidence_end,
              "evidence": [str(r) for r in references] if isinstance(references, (list, tuple)) else []}
    return run_id if put_link(store, run_id, prompt, keys, full_key) else ""


def run_sample(lm: LoadedModel, name: str, length: int, index: int, specs: Sequence[str], setting: str = "agnostic",
               chat: bool = True, store: TraceStore | None = None, tokenizer: str | None = None) -> list[dict]:
    """Sample ``index`` of task ``name`` at ``length`` tokens under every spec (Full among them or not: its row
    is always given), scored by lm-eval: one result row per spec, Full's first."""
    from .tasks import tokenizer_source

    task = load_task(name, int(length), tokenizer or tokenizer_source(lm))
    made = len(task.test_docs())
    if not 0 <= int(index) < made:  # RULER drops the samples that do not fit; another task may make fewer
        raise ValueError(f"{name} has {made} samples at {length} tokens (0 to {made - 1}), not sample {index}")
    request = lm_eval_request(task, index, lm, chat)
    specs = ["full", *[s for s in specs if parse_spec(s).name != "full"]]
    # The app's layers are recorded (attention rows, keys): a sample's link opens in every view, and the evidence
    # views (analysis/evidence.py) read what the answer's first token attended to.
    answers = answer(lm, request, specs, setting, store, record_layers=default_record_layers(lm), keep_traces=False)
    full_key = answers[0].key
    ids = encode(lm, request.context)
    end = counted_tokens(lm, request, ids, setting)
    rows = []
    for item in answers:
        policy = item.policy
        rows.append({"task": name, "length": int(length), "policy": policy.name, "ratio": ratio_of(item.spec),
                     "budget": getattr(policy, "budget", None), "setting": setting, "sample": int(index),
                     "score": float(score(task, request.doc, item.text)), "answer": item.text,
                     "references": json.dumps(list(request.doc["outputs"])),
                     "run_id": link(store, lm, request, item, full_key, end), "spec": item.spec, "tokens": len(ids),
                     "context_tokens": end})
    return rows


def ratio_of(spec: str) -> float | None:
    """The compression ratio a spec asks for: 0 for Full, None for one with a budget in tokens."""
    name, _, params = spec.partition(":")
    if name.strip().lower() == "full":
        return 0.0
    for item in params.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "ratio":
            return float(value)
    return None
