"""The field's long-context tasks as lm-evaluation-harness makes and scores them: RULER's samples come from
lm-eval's own generators and are scored by lm-eval's own metric, never written again here.

A RULER task sizes its samples with a tokenizer to a length in tokens (``max_seq_lengths`` in the task's
metadata), so the samples depend on the model that reads them: ``tokenizer_source`` names the loaded model's
tokenizer (its local directory for a packaged model or a model directory). Six of RULER's tasks make their
samples offline (``RULER_OFFLINE``); the others read Paul Graham's essays from the hub (niah_single_2/3,
niah_multikey_1, niah_multivalue, niah_multiquery) or SQuAD and HotpotQA (ruler_qa_squad, ruler_qa_hotpot),
and on a machine without network ``load_task`` says so in one line (``TaskUnavailable``). The essay tasks have
stand-ins made offline over the shipped speeches, named apart (``niah_single_2_speeches``, ...;
``ruler_speeches``); ``OFFLINE`` is the six and the stand-ins. RULER's six make samples from 1024 tokens on;
the needle tasks from 256 (niah_single_1 with the default model's tokenizer), while at 768 and below ruler_cwe's
samples have no references and ruler_vt's generator does not finish.

A sample is a dict with ``input`` (the prompt), ``outputs`` (the reference strings), ``gen_prefix`` (the
start of the answer, which lm-eval appends to the prompt), ``length`` (the prompt's tokens) and
``max_length`` (the length asked for). ``score`` runs the task's own ``process_results`` from its YAML
(``string_match_all`` for the needle, variable-tracking and word-frequency tasks, ``string_match_part`` for
QA): the share of the references found in the answer, ignoring case.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from ..engine.models import LoadedModel
from . import ruler_speeches

RULER_OFFLINE = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_fwe", "ruler_cwe")
OFFLINE = RULER_OFFLINE + ruler_speeches.STANDINS  # what makes its samples without a network
# Below these lengths (in the default model's tokens; 512, 640 and 768 tried) lm-eval's generator for
# ruler_vt runs on without end: its instructions and shortest chain do not fit.
SHORTEST = {"ruler_vt": 1024}
# Samples of one task at one length a leaderboard may ask for: RULER's generators (and the stand-ins) make at most
# 500, numbered from 0 (fewer where some do not fit the length).
MAX_SAMPLES = 500


class TaskUnavailable(RuntimeError):
    """lm-eval cannot make the task's samples here; the message (one line) says why."""


def tokenizer_source(lm: LoadedModel) -> str:
    """What lm-eval's RULER generators load the model's tokenizer from: the directory the model was loaded
    from (a packaged model's converted copy, a model directory) or its hub id."""
    return lm.model.config._name_or_path


def _index(metadata: dict | None, whole: bool):
    """An lm-eval TaskManager over RULER's tasks and the stand-ins (a hundredth of a second), or with ``whole`` over
    lm-eval's whole index of its 14,000 tasks too (15 s on a slow core)."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    if whole:
        return TaskManager(include_path=str(ruler_speeches.task_folder()), metadata=metadata)
    ruler = Path(lm_eval.tasks.__file__).resolve().parent / "ruler"
    return TaskManager(include_path=[str(ruler), str(ruler_speeches.task_folder())], include_defaults=False,
                       metadata=metadata)


def task_manager(names: Sequence[str], metadata: dict | None = None):
    """An lm-eval TaskManager that knows ``names`` where lm-eval has them: lm-eval's whole index only where a name
    is none of RULER's or the stand-ins'."""
    manager = _index(metadata, whole=False)
    return manager if len(manager.match_tasks(list(names))) == len(set(names)) else _index(metadata, whole=True)


@lru_cache(maxsize=4)  # one manager per (tokenizer, length) and index
def _manager(tokenizer: str, length: int, whole: bool):
    return _index({"tokenizer": tokenizer, "max_seq_lengths": [length]}, whole)


def splits_essays(names) -> bool:
    """Whether lm-eval's tasks (or groups) ``names`` may split an essay into sentences with NLTK's Punkt model:
    all but the offline ones, which never do (``ruler_speeches.import_generators``)."""
    return not all(name in OFFLINE for name in names)


@contextmanager
def lm_eval_seeds(essays: bool = False):
    """Python's and numpy's global generators seeded as ``lm_eval.simple_evaluate`` seeds them by default before it
    loads its tasks (RULER's generators draw from them), then put back: the same samples in any process, whatever
    ran before. They are lm-eval's for a task it loads after its first (its first draws after NLTK's import; the
    needle tasks' samples are the same either way). ``essays``: a task to load may split essays with NLTK's
    Punkt model (``splits_essays``)."""
    import numpy as np
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

    # Loading a RULER task the first time imports NLTK (through RULER's needle module, which also looks for
    # NLTK's data), and that import draws from Python's generator: after the seeding, it would give the first task a
    # process loads other samples than the same task loaded later. Imported before the seeding, it leaves every
    # load's draws to the seed alone, in any order, online or not.
    ruler_speeches.import_generators(essays)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _too_short(name: str, length: int) -> str:
    return f"{name} needs {SHORTEST[name]} tokens or more; lm-eval's generator does not finish at {length}"


def _no_task(name: str) -> str:
    return f"lm-eval has no task {name!r}; the offline tasks are {', '.join(OFFLINE)}"


def check_tasks(names: Sequence[str], lengths: Sequence[int]) -> None:
    """TaskUnavailable for a task lm-eval does not have or a length its generator does not finish at, before any
    model loads or sample is made. The offline tasks are known by name; any other is looked up in lm-eval's index
    of its tasks (``task_manager``)."""
    for name in names:
        if min(lengths) < SHORTEST.get(name, 0):
            raise TaskUnavailable(_too_short(name, min(lengths)))
    others = [name for name in dict.fromkeys(names) if name not in OFFLINE]
    if others:
        known = set(task_manager(others).match_tasks(others))
        for name in others:
            if name not in known:
                raise TaskUnavailable(_no_task(name))


class _MetadataHint(logging.Filter):
    """lm-eval's hint, as it makes the samples of any task whose dataset is a function (every RULER task), that
    "custom kwargs can be passed to `--metadata`": it says so whether they were or not. ``load_task`` always passes
    the tokenizer and the lengths there, so the hint is a false alarm; only that record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


@contextmanager
def _metadata_hint_muted():
    logger, hint = logging.getLogger("lm_eval.api.task"), _MetadataHint()
    logger.addFilter(hint)
    try:
        yield
    finally:
        logger.removeFilter(hint)


@lru_cache(maxsize=8)  # making samples takes seconds at 1k tokens and longer at 32k: once per process
def load_task(name: str, length: int, tokenizer: str):
    """lm-eval's task ``name`` with its samples made at ``length`` tokens by ``tokenizer`` (a local directory or
    a hub id), or TaskUnavailable."""
    from datasets.exceptions import DatasetsError

    if int(length) < SHORTEST.get(name, 0):
        raise TaskUnavailable(_too_short(name, length))
    manager = _manager(tokenizer, int(length), False)
    if not manager.match_tasks([name]):
        manager = _manager(tokenizer, int(length), True)
    if not manager.match_tasks([name]):
        raise TaskUnavailable(_no_task(name))
    try:
        with lm_eval_seeds(splits_essays([name])), _metadata_hint_muted():
            task = manager.load([name])["tasks"][name]
    except (OSError, DatasetsError) as err:  # no network, or the hub offline
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        offline = (f"offline, {name}{ruler_speeches.SUFFIX} stands in for it (the shipped speeches for a haystack)"
                   if name in ruler_speeches.NEEDLES else f"the offline tasks are {', '.join(OFFLINE)}")
        raise TaskUnavailable(f"{name} needs data from the network that cannot be fetched here ({first}); "
                              f"{offline}") from None
    if not all(task.test_docs()["outputs"]):  # ruler_cwe below 1024 tokens: its metric would divide by zero
        raise TaskUnavailable(f"{name} at {length} tokens makes samples without reference answers; ask for "
                              f"a longer length")
    return task


def samples(name: str, length: int, tokenizer: str, limit: int | None = None) -> list[dict]:
    """The first ``limit`` samples (all when None) of ``load_task(name, length, tokenizer)``."""
    docs = load_task(name, length, tokenizer).test_docs()
    return [dict(docs[i]) for i in range(len(docs) if limit is None else min(limit, len(docs)))]


def score(task, sample: dict, answer: str) -> float:
    """The task's own metric (its ``process_results``) of ``answer`` for ``sample``, from 0 to 1."""
    return task.process_results(sample, [answer])[str(sample["max_length"])]
