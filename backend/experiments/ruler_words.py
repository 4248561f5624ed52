"""lm-eval's RULER needle module (``prepare_niah``), imported with its word list's order read from a cache.

As it loads, that module sorts every adjective-noun pair of wonderwords' lists, 6.2 million strings, for the
keys of its needles: about 6 s of every process that makes a needle sample (the ``tasks`` and ``lm-eval``
commands, the Tasks tab's first sample). The sorted list depends on nothing but the module's code and wonderwords'
lists, so the first process to import the module keeps its order in the model cache (12.6 MB), and the next ones
put the list in that order in a fraction of a second. The module's own code runs as it is, its one large sort
answered from the cache; the list is the one ``sorted`` gives, to the string (``tests/test_ruler_words.py``).
"""
from __future__ import annotations

import builtins
import hashlib
import importlib.util
import os
import sys
import tempfile
import zlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

MODULE = "lm_eval.tasks.ruler.prepare_niah"
# The module's other sorts are small and run later; only a set this large is its word list.
SMALLEST_WORD_LIST = 1_000_000


class CachedSort:
    """``sorted`` while the module's code runs: its word list (a set of at least ``SMALLEST_WORD_LIST`` strings made
    from the module's list ``words``) comes from the cache at ``path``, sorted the first time and kept; anything
    else is sorted as ``sorted`` sorts it.

    What is kept is the order, as each sorted word's first place in ``words``: the list is made of the very strings
    ``words`` holds, as the set's, so the module holds each string once, as it would."""

    def __init__(self, path: Path, module):
        self.path, self.module = path, module

    def __call__(self, iterable, /, *, key=None, reverse=False):
        words = vars(self.module).get("words")
        if key is not None or reverse or not isinstance(iterable, set) or len(iterable) < SMALLEST_WORD_LIST \
                or not isinstance(words, list):
            return builtins.sorted(iterable, key=key, reverse=reverse)
        places = self._read()
        if places is not None and len(places) == len(iterable) and 0 <= int(places.min()) \
                and int(places.max()) < len(words):
            return np.array(words, dtype=object)[places].tolist()
        ordered = builtins.sorted(iterable)
        first: dict[str, int] = {}
        for place, word in enumerate(words):
            first.setdefault(word, place)
        if all(word in first for word in ordered):  # the set is made of ``words``, as the module makes it
            self._write(np.array([first[word] for word in ordered], np.int32))
        return ordered

    def _read(self) -> np.ndarray | None:
        try:
            return np.frombuffer(zlib.decompress(self.path.read_bytes()), np.int32)
        except (OSError, zlib.error, ValueError):
            return None

    def _write(self, places: np.ndarray) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent)
        except OSError:  # a read-only cache: the next process sorts again
            return
        try:  # written aside and renamed: a process reading meanwhile finds the whole order or none
            with os.fdopen(handle, "wb") as out:
                out.write(zlib.compress(places.tobytes(), 1))
            os.replace(temporary, self.path)
        except OSError:
            Path(temporary).unlink(missing_ok=True)


def cache_path(origin: str) -> Path:
    """Where the word list of the module at ``origin`` is kept: named by a digest of the module's code and of
    wonderwords' version, so another lm-eval or wonderwords makes and keeps its own."""
    from ..engine.models import cache_dir  # here: the command line starts without torch

    try:
        words_version = version("wonderwords")
    except PackageNotFoundError:
        words_version = "?"
    digest = hashlib.sha256(Path(origin).read_bytes() + f"\0wonderwords {words_version}".encode()).hexdigest()
    return cache_dir() / "ruler" / f"needle-word-order-{digest[:16]}.int32.z"


def import_needle_module():
    """``lm_eval.tasks.ruler.prepare_niah``, imported as ``import`` would, its word list from the cache."""
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None or spec.loader is None:
        raise ImportError(f"no module named {MODULE!r}")
    module = importlib.util.module_from_spec(spec)
    module.sorted = CachedSort(cache_path(spec.origin), module)  # found before the builtin as the module's code runs
    sys.modules[MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(MODULE, None)
        raise
    finally:
        vars(module).pop("sorted", None)  # the module's later sorts are the builtin's
    package, _, name = MODULE.rpartition(".")
    setattr(sys.modules[package], name, module)  # as ``import`` binds a submodule in its package
    return module
