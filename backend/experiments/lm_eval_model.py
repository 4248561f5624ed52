"""KV Lens as an lm-evaluation-harness model, ``kvlens``: lm-eval's tasks, prompts and scoring, with every
answer generated under a KV Lens policy inside the engine.

Importing this module registers ``kvlens`` with lm-eval's own registry. lm-eval 0.4.13 finds models only
in that registry and imports no third-party module from its command line, so ``python -m backend lm-eval``
is lm-eval's command line with this module imported; in Python, ``import kvlens`` puts the name there before
lm-eval is even imported (``lm_eval_registration``), so ``lm_eval.simple_evaluate(model="kvlens")`` finds this
class (or call ``evaluate``). Its model arguments:

* ``model``: a KV Lens model (``smollm2-135m-instruct``, the default, ``gemma3-270m``), a local model
  directory, a ``.gguf`` file or a hub id; ``dtype`` as KV Lens's command line takes it, and lm-eval's
  ``--device`` (``cpu``, ``cuda``, ``auto``; its default ``cuda:0`` means a GPU where there is one);
* ``policy``: a KV Lens spec, e.g. ``tova:budget=256`` (default ``full``). lm-eval splits ``key=value,...``
  arguments at commas outside quotes, so a spec with several parameters is quoted
  (``--model_args 'policy="a2sf:budget=64,alpha=0.3"'``) or given in JSON;
* ``max_gen_toks``: new tokens when a request does not say (a task's ``generation_kwargs`` do);
* ``no_cache``: compute every run instead of replaying it from the trace store;
* ``setting``: ``aware`` (the default: the question is part of the prompt the policies decide over, so any
  lm-eval task runs) or ``agnostic`` (kvpress's leaderboard: they decide over the context before the question
  is read, and a ratio counts the context's tokens; the sample must say where its question starts, as
  RULER's do); see ``task_runs``.

RULER's generators size their samples with the model's tokenizer, which lm-eval looks up in the task
metadata (``tokenizer``, else ``pretrained``, else ``model``): a model directory named by ``model`` serves as
it is, but a packaged model's name is nothing lm-eval can load, so ``evaluate`` and ``python -m backend
lm-eval`` put the model's own (``ruler_tokenizer``) in the metadata unless it names one.

Each request is one generate-mode run through the store (``task_runs.answer``, nothing recorded, as the
needle grid runs): Full is the reference row and the policy a row beside it, so the same sample under the
same policy replays, and its trace holds what every query read; a share link to it (``?run=`` in the app) is
logged at INFO and kept in ``KVLensLM.links``. The context is read as lm-eval wrote it,
``gen_prefix`` included (and the chat template, when lm-eval is asked to apply it through
``apply_chat_template``); decoding is greedy to EOS or the token limit, and the answer is cut at the first
stop string by lm-eval's own ``postprocess_generated_text``. The cut answer equals what a decoder stopping
at the string would give, since greedy tokens never depend on what follows them.
"""
from __future__ import annotations

import logging

import lm_eval.models  # noqa: F401  lm-eval's own models: get_model imports them only while the registry is empty
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs
from tqdm import tqdm

from ..engine.models import DEFAULT_MODEL, check_fits, shared_model
from ..limits import Limits
from ..policies import parse_spec
from ..traces.store import TraceStore
from .task_runs import SETTINGS, TaskRequest, answer, chat_template, link
from .tasks import splits_essays, task_manager, tokenizer_source

eval_logger = logging.getLogger("lm_eval")  # lm-eval's own logger, which its command line shows at INFO
DEFAULT_GEN_TOKS = 256  # lm-eval's default for its own models
LM_EVAL_DEVICE = "cuda:0"  # what lm-eval's command line passes as the device when --device is not given


def kvlens_device(device: str | None) -> str:
    """KV Lens's device for lm-eval's: its command line passes ``cuda:0`` when not told, which lm-eval's own hf
    model takes as the GPU where there is one, else the CPU; so does kvlens (``auto``)."""
    return "auto" if device in (None, LM_EVAL_DEVICE) else str(device)


def ruler_tokenizer(model: str = DEFAULT_MODEL, device: str | None = None, dtype: str = "float32") -> str:
    """What RULER's generators should load the tokenizer of ``model`` from (loading the model, once per process,
    as kvlens does): a packaged model's name is no tokenizer lm-eval could load itself."""
    return tokenizer_source(shared_model(str(model), kvlens_device(device), str(dtype)))


@register_model("kvlens")
class KVLensLM(LM):
    """One KV Lens model under one policy. ``batch_size`` and ``max_batch_size`` (lm-eval passes them to every
    model) are accepted and unused: each request is one batched run of Full and the policy."""

    def __init__(self, model: str = DEFAULT_MODEL, policy: str = "full", max_gen_toks: int = DEFAULT_GEN_TOKS,
                 device: str = "cpu", dtype: str = "float32", no_cache: bool = False, setting: str = "aware",
                 batch_size=None, max_batch_size=None) -> None:
        super().__init__()
        if setting not in SETTINGS:
            raise ValueError(f"kvlens: setting must be one of {', '.join(SETTINGS)}, got {setting!r}")
        self.setting = setting
        self.spec = str(policy).strip()
        self.policy = parse_spec(self.spec)  # SpecError (a ValueError) in one line, before the model loads
        self.max_gen_toks = int(max_gen_toks)
        self.lm = shared_model(str(model), kvlens_device(device), str(dtype))  # ModelError in one line
        self.policy.check_model(head_dim=self.lm.head_dim, n_layers=self.lm.n_layers)
        check_fits(self.lm, self.policy)
        self.store = None
        if not no_cache:
            store = TraceStore()
            self.store = store if store.available else None
        self.keys: list[str] = []  # the store key of each answered request's trace, in order
        self.links: list[str] = []  # and its share link, where the store holds it (the app's ?run=)
        self.limits = Limits.for_machine()  # the command line's: what the machine's memory holds

    @property
    def tokenizer_name(self) -> str:
        return tokenizer_source(self.lm).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.lm.tokenizer.chat_template if self.lm.chats else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.lm.chats:
            raise ValueError(f"{self.lm.name} has no chat template; run it without --apply_chat_template")
        return chat_template(self.lm)(chat_history, add_generation_prompt)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [self._answer(request) for request in tqdm(requests, disable=disable_tqdm, desc=f"kvlens {self.spec}")]

    def _answer(self, instance) -> str:
        context, gen_kwargs = instance.args
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        if kwargs.get("do_sample"):
            raise ValueError("kvlens decodes greedily; the request asks for sampling (do_sample)")
        request = TaskRequest(context=context, until=tuple(kwargs["until"]), max_new_tokens=kwargs["max_gen_toks"],
                              doc=dict(getattr(instance, "doc", None) or {}))
        (item,) = answer(self.lm, request, [self.spec], self.setting, self.store, self.limits)
        self.keys.append(item.key)
        run_id = link(self.store, self.lm, request, item, item.full_key)
        if run_id:
            self.links.append(run_id)
            eval_logger.info("kvlens: %s on sample %s: open with ?run=%s", self.spec, getattr(instance, "doc_id", "?"),
                             run_id)
        return item.text

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("kvlens only generates (generate_until tasks such as RULER's); it scores no "
                                  "loglikelihood requests")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("kvlens only generates (generate_until tasks such as RULER's); it scores no "
                                  "loglikelihood requests")


def evaluate(tasks: list[str], length: int, model: str = DEFAULT_MODEL, policy: str = "full",
             limit: int | None = None, chat: bool = False, **model_args) -> dict:
    """``lm_eval.simple_evaluate`` of ``tasks`` with ``kvlens`` under ``policy``, the RULER samples made at
    ``length`` tokens by the model's own tokenizer (``chat``: in the model's chat template, lm-eval's
    ``apply_chat_template``); lm-eval's results dict."""
    import lm_eval

    from .ruler_speeches import import_generators

    if not splits_essays(tasks):  # RULER's needle module without its look for NLTK's download
        import_generators(essays=False)
    lm = KVLensLM(model=model, policy=policy, **model_args)
    metadata = {"tokenizer": tokenizer_source(lm.lm), "max_seq_lengths": [int(length)]}
    manager = task_manager(tasks, metadata)  # the essay tasks' stand-ins too
    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                   apply_chat_template=chat, metadata=metadata)
