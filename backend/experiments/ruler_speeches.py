"""RULER's essay tasks offline: lm-eval's own generator, template and metric, with the shipped public-domain
speeches standing in for Paul Graham's essays.

lm-eval makes five of RULER's needle tasks (``NEEDLES``) over Paul Graham's essays, which it reads from the
hub. Each has a stand-in here, named ``<task>_speeches`` (``STANDINS``), which differs from it in two things:

* **The haystack**: the C-Span inaugural and State of the Union addresses (``texts.py``), in the corpora's
  order, as words, made as lm-eval's ``get_haystack`` makes the essays' (whitespace runs collapsed, split at
  spaces). RULER's essay samples start at the haystack's first word and take as many words as fit, so every
  sample of a length reads the same speeches (Washington's first inaugural on) with other needles at other
  depths.
* **The sentence splitter** lm-eval places the needles between: NLTK's Punkt, whose English model
  (``punkt_tab``) is a download. Here Punkt is trained on the same corpora (``train_splitter``; the
  parameters ship in ``SPLITTER_DATA``) and is used while a stand-in's samples are made, and only then, so a
  real essay task on a machine with NLTK's model still splits with NLTK's.

Everything else is lm-eval's: ``generate_samples`` with the essay task's needle kinds and counts (as
lm-eval's ``niah_utils`` passes them) and the essay task's configuration (template, generation settings,
``process_results``): a stand-in's task file (``task_folder``, which a TaskManager or lm-eval's command line
takes as its ``include_path``) includes lm-eval's own file of the essay task. A stand-in grades policies against
each other on the same samples; its scores are not RULER's essay tasks' (other prose, other sentence lengths),
and the leaderboard names it apart.
"""
from __future__ import annotations

import atexit
import json
import re
import shutil
import sys
import tempfile
import threading
from contextlib import contextmanager
from functools import lru_cache, partial
from pathlib import Path

from ..texts import CORPORA, corpus_files, corpus_text
from .ruler_words import import_needle_module

SUFFIX = "_speeches"
# What each of lm-eval's essay tasks (lm_eval/tasks/ruler/niah_utils.py) passes to generate_samples besides
# the haystack, the length and the tokenizer: the kinds of keys and values, and how many of each.
NEEDLES = {
    "niah_single_2": {"type_needle_k": "words", "type_needle_v": "numbers"},
    "niah_single_3": {"type_needle_k": "words", "type_needle_v": "uuids"},
    "niah_multikey_1": {"type_needle_k": "words", "type_needle_v": "numbers", "num_needle_k": 4},
    "niah_multivalue": {"type_needle_k": "words", "type_needle_v": "numbers", "num_needle_v": 4},
    "niah_multiquery": {"type_needle_k": "words", "type_needle_v": "numbers", "num_needle_q": 4},
}
STANDINS = tuple(task + SUFFIX for task in NEEDLES)
# An NLTK data root holding Punkt trained on the corpora, as tokenizers/punkt_tab/english/.
SPLITTER_DATA = Path(__file__).resolve().parents[2] / "assets" / "ruler_speeches"
SPLITTER_FILES = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")
_NLTK_PATH = threading.Lock()  # nltk's search path is global: one stand-in's samples made at a time


@lru_cache(maxsize=1)
def haystack_text() -> str:
    """The corpora's documents in order, whitespace runs collapsed to single spaces."""
    text = " ".join(corpus_text(corpus, name) for corpus in CORPORA for name in corpus_files(corpus))
    return re.sub(r"\s+", " ", text).strip()


def haystack_words() -> list[str]:
    """The haystack as lm-eval's essay generator takes it: a list of words."""
    return haystack_text().split(" ")


def train_splitter():
    """Punkt's parameters learnt from the haystack's text (deterministic; about 6 s)."""
    from nltk.tokenize.punkt import PunktTrainer

    trainer = PunktTrainer()
    trainer.train(haystack_text(), finalize=True)
    return trainer.get_params()


def write_splitter(params, root: Path = SPLITTER_DATA) -> Path:
    """Write ``params`` as NLTK's ``punkt_tab`` files under ``root`` (sorted lines, so the same parameters
    give the same bytes): ``python -m backend.experiments.ruler_speeches`` made the shipped ones."""
    folder = root / "tokenizers" / "punkt_tab" / "english"
    folder.mkdir(parents=True, exist_ok=True)
    lines = {
        "collocations.tab": ["\t".join(pair) for pair in params.collocations],
        "sent_starters.txt": list(params.sent_starters),
        "abbrev_types.txt": list(params.abbrev_types),
        "ortho_context.tab": [f"{word}\t{flags}" for word, flags in params.ortho_context.items()],
    }
    for name in SPLITTER_FILES:
        (folder / name).write_text("\n".join(sorted(lines[name])), encoding="utf-8")
    return folder


@contextmanager
def _speech_splitter():
    """NLTK's ``sent_tokenize`` splits with the shipped Punkt inside, with whatever it found before outside."""
    import nltk
    from nltk.tokenize import _get_punkt_tokenizer  # sent_tokenize's per-language cache of loaded models

    with _NLTK_PATH:
        nltk.data.path.insert(0, str(SPLITTER_DATA))
        _get_punkt_tokenizer.cache_clear()
        try:
            yield
        finally:
            nltk.data.path.remove(str(SPLITTER_DATA))
            _get_punkt_tokenizer.cache_clear()


def import_generators(essays: bool) -> None:
    """Import lm-eval's RULER generators (``prepare_niah``), quietly unless ``essays``: a task to run may be one of
    lm-eval's essay tasks, the only ones that split sentences with NLTK's English Punkt model.

    As it loads, that module looks for the model and, where it is missing, tries to download it, then prints
    "Downloaded punkt_tab on rank 0" whether it came or not: offline, an NLTK error about a host and a false line
    on every run. Without ``essays`` the look finds the shipped Punkt (on NLTK's path only meanwhile), so nothing
    is fetched or printed, and nothing is split with it. With ``essays`` the look and the download are lm-eval's
    own, also where the module came in quietly before."""
    try:
        if not essays:
            with _speech_splitter():
                import_needle_module()
            return
        imported = "lm_eval.tasks.ruler.prepare_niah" in sys.modules
        prepare_niah = import_needle_module()

        if imported:  # imported before, perhaps with the shipped model standing in: lm-eval's look again
            prepare_niah.download_nltk_resources()
    except ImportError:  # lm-eval without its RULER extras: its tasks say so when they load
        pass


def make_samples(task: str, **metadata) -> dict:
    """The stand-in for essay ``task``'s dataset: what lm-eval's own dataset function for it returns, made by
    lm-eval's generator over the speeches (``metadata`` as lm-eval passes a task's: the tokenizer and
    ``max_seq_lengths``)."""
    from lm_eval.tasks.ruler.common_utils import DEFAULT_SEQ_LENGTHS, get_tokenizer, resolve_tokenizer_name
    from lm_eval.tasks.ruler.niah_utils import TEMPLATE, download_dataset
    from lm_eval.tasks.ruler.prepare_niah import generate_samples

    lengths = metadata.pop("max_seq_lengths", DEFAULT_SEQ_LENGTHS)
    tokenizer = get_tokenizer(resolve_tokenizer_name(metadata))
    words = haystack_words()
    with _speech_splitter():
        return download_dataset(
            generate_samples(words, max_seq_length=length, template=TEMPLATE, type_haystack="essay",
                             num_samples=500, TOKENIZER=tokenizer, **NEEDLES[task])
            for length in lengths)


# lm-eval's task files name a dataset function by module and name (``!function``): one per essay task.
niah_single_2 = partial(make_samples, "niah_single_2")
niah_single_3 = partial(make_samples, "niah_single_3")
niah_multikey_1 = partial(make_samples, "niah_multikey_1")
niah_multivalue = partial(make_samples, "niah_multivalue")
niah_multiquery = partial(make_samples, "niah_multiquery")


@lru_cache(maxsize=1)
def task_folder() -> Path:
    """A folder of lm-eval task files, one per stand-in, for a TaskManager's ``include_path`` (lm-eval's
    ``--include_path``): each includes lm-eval's own file of its essay task (where this lm-eval is installed, so
    the folder is made once per process and removed at exit) and replaces its name, its tags (lm-eval's groups
    hold lm-eval's tasks) and its dataset function."""
    import lm_eval.tasks

    ruler = Path(lm_eval.tasks.__file__).resolve().parent / "ruler"
    folder = Path(tempfile.mkdtemp(prefix="kvlens-ruler-speeches-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    for task in NEEDLES:
        (folder / f"{task}{SUFFIX}.yaml").write_text(
            f"include: {json.dumps(str(ruler / f'{task}.yaml'))}\n"
            f"task: {task}{SUFFIX}\n"
            "tag: []\n"
            f"custom_dataset: !function {__name__}.{task}\n", encoding="utf-8")
    return folder


if __name__ == "__main__":
    print(write_splitter(train_splitter()))
