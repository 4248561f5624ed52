"""POS-tag lifetime table (TOVA Tables 1 and 4): word-to-token mapping, the table, a missing tagger."""
import pytest

from backend.analysis import pos
from tests.test_metrics import make_trace


@pytest.fixture(autouse=True)
def fresh_tagger_state(monkeypatch):
    """Each test starts with no tagger loaded and no failed download remembered, whatever ran before."""
    monkeypatch.setattr(pos, "_tagger", None)
    monkeypatch.setattr(pos, "_download_failed", "")


class FakeTagger:
    """Tags words from a fixed table, so the mapping is tested apart from the real tagger's choices."""

    TAGS = {"The": "DT", "cat": "NN", "'s": "POS", "toy": "NN", ".": ".", "It": "PRP", "ran": "VBD"}

    def tag(self, words):
        return [(w, self.TAGS.get(w, "XX")) for w in words]


TOKENS = ["The", " cat", "'s", " toy", ".", "\n", "It", " ran", " "]


def test_each_token_takes_the_tag_of_its_word_line_breaks_get_their_own_tag():
    assert pos.tag_tokens(TOKENS, FakeTagger()) == ["DT", "NN", "POS", "NN", ".", "\n", "PRP", "VBD", None]


def test_a_token_spanning_two_words_takes_the_one_it_overlaps_most():
    tagger = FakeTagger()
    tagger.TAGS = {"ab": "A", "cd": "C"}
    assert pos.tag_tokens(["ab c", "d"], tagger) == ["A", "C"]  # 2 chars of "ab" beat 1 of "cd"
    assert pos.tag_tokens(["a", "b cd"], tagger) == ["A", "C"]  # a sub-word piece takes its word's tag


def test_pos_lifetimes_averages_each_tags_tokens_longest_first():
    # Lifetimes 9 2 6 2 4 1 3 2 1 (evicted_at = j + lifetime; -1 when it reaches the end, T = 9).
    trace = make_trace(9, evicted_at=[[[-1, 3, 8, 5, 8, 6, 9, 9, -1]]])
    trace.meta["token_texts"] = TOKENS
    table = pos.pos_lifetimes(trace, FakeTagger())
    assert list(table.columns) == ["tag", "mean_lifetime", "count"]
    assert table["tag"].tolist() == ["DT", "POS", ".", "PRP", "NN", "VBD", "\n"]  # NN/VBD tie: by name
    assert table["mean_lifetime"].tolist() == [9, 6, 4, 3, 2, 2, 1]
    assert table["count"].tolist() == [1, 1, 1, 1, 2, 1, 1]
    assert table.attrs["mean_lifetime_all"] == pytest.approx(29 / 8)  # the bare " " token is left out


def test_the_real_tagger_loads_offline_from_the_zip_shipped_in_the_repo(monkeypatch):
    import nltk
    assert (pos.SHIPPED_NLTK_DATA / "taggers" / f"{pos.TAGGER}.zip").is_file()
    monkeypatch.setattr(nltk.data, "path", [])  # nothing but the shipped data can find it
    monkeypatch.delenv("NLTK_DATA", raising=False)
    monkeypatch.setattr(nltk, "download", lambda *a, **k: pytest.fail("must not download"))
    tags = pos.tag_tokens(["The", " President", "'s", " speech", "."], pos.load_tagger())
    assert tags == ["DT", "NNP", "POS", "NN", "."]


def test_nltk_data_env_is_searched_after_the_shipped_data(tmp_path, monkeypatch):
    import nltk
    monkeypatch.setattr(nltk.data, "path", ["/elsewhere"])
    monkeypatch.setenv("NLTK_DATA", str(tmp_path))
    pos._use_nltk_data_env()
    assert nltk.data.path == [str(pos.SHIPPED_NLTK_DATA), str(tmp_path), "/elsewhere"]


def test_missing_tagger_raises_a_clear_error_when_download_fails(tmp_path, monkeypatch):
    import nltk
    monkeypatch.setattr(pos, "SHIPPED_NLTK_DATA", tmp_path / "not-shipped")
    monkeypatch.setenv("NLTK_DATA", str(tmp_path))
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    calls = []

    def offline(*args, **kwargs):
        calls.append(args)
        raise ValueError("Error loading averaged_perceptron_tagger_eng: <urlopen error offline>")

    monkeypatch.setattr(nltk, "download", offline)
    trace = make_trace(9, evicted_at=[[[-1, 3, 8, 5, 8, 6, 9, 9, -1]]])
    trace.meta["token_texts"] = TOKENS
    with pytest.raises(pos.TaggerUnavailable) as err:
        pos.pos_lifetimes(trace)
    message = str(err.value)
    assert calls == [(pos.TAGGER,)]
    assert "averaged_perceptron_tagger_eng" in message and "NLTK_DATA" in message and "download failed" in message
    assert len(message.splitlines()) == 1
    with pytest.raises(pos.TaggerUnavailable, match="downloads disabled"):
        pos.load_tagger(download=False)
    assert len(calls) == 1
    assert pos._tagger is None  # a failure is not cached: a later call may succeed
