"""lm-eval's RULER needle module imported with its sorted word list from the cache (backend/experiments/ruler_words.py):
the list is the one ``sorted`` makes, made of the module's own strings, whether the cache was there or not."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from backend.experiments import ruler_words
from backend.experiments.ruler_words import CachedSort


@pytest.fixture
def small_lists(monkeypatch):
    monkeypatch.setattr(ruler_words, "SMALLEST_WORD_LIST", 10)
    rng = random.Random(0)
    # Duplicates, as the module's adjective-noun pairs have: the set keeps each word's first string.
    words = [f"{rng.choice('abc')}-{rng.randrange(40)}" for _ in range(400)]
    return SimpleNamespace(words=words)


def counting_sorts(monkeypatch) -> list:
    calls = []

    def spy(iterable, key=None, reverse=False):
        calls.append(len(iterable))
        return sorted(iterable, key=key, reverse=reverse)

    monkeypatch.setattr(ruler_words, "builtins", SimpleNamespace(sorted=spy))
    return calls


def test_the_word_list_is_sorted_once_and_then_read_back_made_of_the_modules_strings(small_lists, tmp_path,
                                                                                        monkeypatch):
    calls = counting_sorts(monkeypatch)
    path = tmp_path / "order.int32.z"
    words = small_lists.words
    expected = sorted(set(words))
    first = CachedSort(path, small_lists)(set(words))
    assert first == expected and calls == [len(expected)] and path.is_file()
    again = CachedSort(path, small_lists)(set(words))
    assert again == expected and calls == [len(expected)]  # not sorted again
    first_string = {}
    for word in words:
        first_string.setdefault(word, word)
    assert all(word is first_string[word] for word in again)  # the module's strings, none copied


def test_a_damaged_or_foreign_cache_is_sorted_afresh(small_lists, tmp_path, monkeypatch):
    calls = counting_sorts(monkeypatch)
    path = tmp_path / "order.int32.z"
    words = small_lists.words
    expected = sorted(set(words))
    path.write_bytes(b"not zlib")
    assert CachedSort(path, small_lists)(set(words)) == expected and len(calls) == 1
    assert CachedSort(path, SimpleNamespace(words=words + ["z-1", "z-2"]))(set(words + ["z-1", "z-2"])) == \
        sorted(set(words + ["z-1", "z-2"])) and len(calls) == 2  # another list under the same name
    assert CachedSort(path, small_lists)([3, 1, 2]) == [1, 2, 3]  # any other sort is the builtin's
    assert CachedSort(path, small_lists)({"b", "a"}, key=len, reverse=True) == sorted({"b", "a"}, key=len,
                                                                                    reverse=True)


def test_lm_evals_needle_module_holds_the_sorted_word_list_and_the_builtin_sort_afterwards():
    pytest.importorskip("wonderwords")
    from backend.experiments.ruler_speeches import import_generators

    import_generators(essays=False)
    import lm_eval.tasks.ruler.prepare_niah as prepare_niah

    assert "sorted" not in vars(prepare_niah)
    words = prepare_niah.WORDS
    assert len(words) > ruler_words.SMALLEST_WORD_LIST
    # Strictly ascending and the same set: the list sorted() makes of the module's pairs.
    assert all(a < b for a, b in zip(words, words[1:]))
    assert set(words) == set(prepare_niah.words)
