"""The lessons: each step shows a shipped run (or a shipped leaderboard) and every number its text quotes is true
of what it shows."""
import dataclasses

import pandas as pd
import pytest

from backend import api
from backend.experiments import shipped_runs
from backend.experiments.lessons import LESSONS, SHOWCASE, Claim, holds
from backend.experiments.shipped import LEADERBOARDS

VIEWS = ("kept", "masks", "reach", "forms", "curves", "tsne", "divergence", "retention")


@pytest.fixture(scope="module")
def board():
    return pd.read_csv(LEADERBOARDS / f"{api.DEFAULT_MODEL}.csv")


@pytest.fixture(scope="module")
def runs():
    return {name: shipped_runs.load(name, request_type=api.RunRequest) for name in SHOWCASE}


def test_five_or_more_lessons_of_three_to_six_steps():
    assert len(LESSONS) >= 5
    for lesson in LESSONS.values():
        assert 3 <= len(lesson.steps) <= 6, lesson.name
        for step in lesson.steps:
            assert (step.run in SHOWCASE and step.view in VIEWS) or (not step.run and step.view == "tasks"), step


def test_a_step_on_the_tasks_tab_opens_a_view_the_default_model_ships():
    import app

    views = app.leaderboard_view(api.DEFAULT_MODEL)[0]
    steps = [step for lesson in LESSONS.values() for step in lesson.steps if step.view == "tasks"]
    assert steps and all(step.task in views for step in steps), views


def test_every_claim_holds_and_the_text_quotes_it(runs, board):
    checked = 0
    for lesson in LESSONS.values():
        for step in lesson.steps:
            for claim in step.claims:
                assert holds(claim, runs.get(step.run), board), (lesson.name, claim)
                if claim.value not in ("yes", "no", "none"):
                    assert claim.value in step.text, (lesson.name, claim.value)
                checked += 1
    assert checked >= 30


def test_a_false_claim_fails(runs, board):
    first = LESSONS["window"].steps[1]
    answer = next(c for c in first.claims if c.what == "answer")
    assert not holds(dataclasses.replace(answer, value="317"), runs["window"], board)
    assert not holds(Claim("reads", "sinks", "yes"), runs["window"], board)
    assert not holds(Claim("token0", "window", "100"), runs["window"], board)
    assert not holds(Claim("diverges", "tova", "none"), runs["needle"], board)
    assert not holds(Claim("grade", "kvzip", "0.50", "average", 0.5, 1024), None, board)
