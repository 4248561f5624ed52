"""Merging task leaderboards into the shipped files (benchmarks.leaderboard_assets)."""
import pandas as pd
import pytest

from backend.experiments.leaderboard import COLUMNS
from backend.experiments.shipped import read_leaderboard_samples
from benchmarks.leaderboard_assets import merge, read_leaderboard


def _rows(answers: dict[str, str], run: str) -> list[dict]:
    return [{"model": "m", "task": "niah_single_1", "length": 1024, "policy": spec.split(":")[0],
             "ratio": 0.0 if spec == "full" else 0.5, "setting": "agnostic", "sample": 0,
             "score": float(answer.strip(" .") == "8284194"), "answer": answer, "references": '["8284194"]',
             "run_id": run, "spec": spec, "budget": 0 if spec == "full" else 300, "tokens": 640,
             "context_tokens": 600} for spec, answer in answers.items()]


def test_answers_that_look_like_numbers_stay_text_through_a_merge(tmp_path):
    # A re-run whose every answer is a number, beside a file where some are prose: read as floats, Full's
    # " 8284194." would be 8284194.0 in one and the merge would refuse the two as different answers.
    numbers, shipped = tmp_path / "rerun.csv", tmp_path / "shipped.csv"
    pd.DataFrame(_rows({"full": " 8284194.", "reattention:ratio=0.5": " 8284194."}, "new"), columns=COLUMNS).to_csv(
        numbers, index=False)
    pd.DataFrame(_rows({"full": " 8284194.", "reattention:ratio=0.5": " 82.", "tova:ratio=0.5": " the number"},
                       "old"), columns=COLUMNS).to_csv(shipped, index=False)
    merged = merge([read_leaderboard(numbers), read_leaderboard(shipped)])
    assert list(merged["answer"]) == [" 8284194.", " the number", " 8284194."]
    # the first input's row of a (sample, spec) is kept: the re-run replaces Full's and ReAttention's
    assert list(merged["run_id"]) == ["new", "old", "new"]
    # the app reads a shipped file whose answers are all numbers as text too
    merged[merged["policy"] != "tova"].to_csv(tmp_path / "samples.csv", index=False)
    assert list(read_leaderboard_samples(tmp_path / "samples.csv")["answer"]) == [" 8284194.", " 8284194."]


def test_full_answering_differently_in_two_runs_is_refused(tmp_path):
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    pd.DataFrame(_rows({"full": " 8284194."}, "a"), columns=COLUMNS).to_csv(first, index=False)
    pd.DataFrame(_rows({"full": " 828."}, "b"), columns=COLUMNS).to_csv(second, index=False)
    with pytest.raises(ValueError, match="Full answers differently"):
        merge([read_leaderboard(first), read_leaderboard(second)])


def test_a_rerun_that_changes_no_answer_leaves_the_merged_rows_as_they_were(tmp_path):
    shipped, rerun = tmp_path / "shipped.csv", tmp_path / "rerun.csv"
    answers = {"full": " 8284194.", "tova:ratio=0.5": " the number", "h2o:ratio=0.5": " 8284194.",
               "reattention:ratio=0.5": " 82."}
    pd.DataFrame(_rows(answers, "run"), columns=COLUMNS).to_csv(shipped, index=False)
    # the re-run holds two of the rows, in another order than the shipped file's
    pd.DataFrame(_rows({"reattention:ratio=0.5": " 82.", "full": " 8284194."}, "run"), columns=COLUMNS).to_csv(
        rerun, index=False)
    once = merge([read_leaderboard(shipped)])
    again = merge([read_leaderboard(rerun), read_leaderboard(shipped)])
    assert list(once["policy"]) == ["full", "h2o", "tova", "reattention"]  # the shipped leaderboard's order
    pd.testing.assert_frame_equal(again, once)
