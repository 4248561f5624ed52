"""The long examples the app lists: their lengths in the default model's tokens, the needle's fact and question,
and their order on the page."""
import pytest

from backend.api import LIMITS
from backend.experiments.needle import NEEDLE, QUESTION
from backend.texts import examples
from benchmarks import long_examples

STEMS = [*long_examples.SPEECHES, *long_examples.NEEDLES]


def shipped(stem: str) -> str:
    return (long_examples.FOLDER / f"{stem}.txt").read_text().strip()


@pytest.fixture(scope="module")
def built(default_lm):
    return long_examples.build(default_lm)


@pytest.mark.parametrize("stem", STEMS)
def test_each_long_example_has_the_length_its_name_gives_and_fits_the_context(default_lm, stem):
    text = shipped(stem)
    tokens = len(default_lm.encode(text, chat=True))
    low, high = long_examples.band(stem)
    assert low <= tokens <= high, f"{stem}: {tokens} tokens"
    assert tokens + LIMITS.new_tokens <= default_lm.context  # generate mode with the most new tokens
    assert len(text) <= LIMITS.text_chars


def test_the_size_in_a_name_sets_the_band():
    assert long_examples.band("needle_8k_tokens") == (7400, 8192 - LIMITS.new_tokens)
    with pytest.raises(ValueError):
        long_examples.band("needle")


@pytest.mark.parametrize("stem", list(long_examples.NEEDLES))
def test_the_long_needle_states_its_fact_early_and_asks_for_it_at_the_end(stem):
    text = shipped(stem)
    fact = NEEDLE.format(number=long_examples.needle_cell(stem).number())
    assert text.count(fact) == 1 and text.index(fact) < len(text) // 4
    assert text.endswith(QUESTION)


def test_the_files_are_what_the_builder_makes(built):
    """Regenerate with ``python -m benchmarks.long_examples`` rather than editing a file by hand."""
    assert set(built) == set(STEMS)
    for stem, text in built.items():
        assert shipped(stem) == text, stem


def test_the_app_lists_the_short_needle_first_and_the_rest_from_short_to_long():
    listed = examples(long_examples.FOLDER)
    labels = list(listed)
    assert labels[0] == "needle"
    lengths = [len(listed[label]) for label in labels[1:]]
    assert lengths == sorted(lengths)
    assert labels[-1] in {stem.replace("_", " ") for stem in STEMS} and "needle 8k tokens" in labels
