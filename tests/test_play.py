"""Play: the step moves on by itself and the cheap views follow it; the masks mark the step's row."""
import math
from types import SimpleNamespace

import gradio as gr
import numpy as np
import pytest

import app
from backend import api
from backend.analysis import reads
from viz import panels
from viz.heatmap import mask_heatmaps, mark_row
from viz.step_row import step_row_figure

SKIP = {"__type__": "update"}


@pytest.fixture
def run(tiny_session):
    request = api.RunRequest(prompt="one two three four five six seven eight nine ten eleven twelve",
                             specs=["tova:budget=6", "sinks:budget=6"], mode="prompt")
    run = api.run(request, tiny_session)
    app.RECENT_RUNS.clear()
    return run


def last_step(run) -> int:
    return len(run.traces[0].tokens) - 1


def test_a_tick_moves_the_step_on_by_the_stride_and_redraws_only_the_cheap_views(run):
    step, kept, snapshot, row, heatmap, over_steps, timer, button, playing = app.on_tick(
        run.run_id, 3, "4", "all", "all", 0.3)
    assert step == 7
    assert kept.count("at step 7") == 2 and "at step 7" in snapshot.layout.title.text
    assert "step 7" in row.layout.title.text and row.layout.shapes[0].x0 == 7  # the red line at the step
    assert [heatmap, over_steps, timer, button, playing] == [SKIP] * 5  # still playing: nothing else moves
    assert app.on_tick(run.run_id, 3, "auto", "all", "all", 0.3)[0] == 3 + math.ceil((last_step(run) + 1) / 60)


def test_the_last_tick_stops_the_timer_and_the_heavy_views_catch_up(run):
    last = last_step(run)
    step, kept, snapshot, row, heatmap, over_steps, timer, button, playing = app.on_tick(
        run.run_id, last - 2, "16", "all", "all", 0.3)
    assert step == last and f"at step {last}" in kept
    assert isinstance(timer, gr.Timer) and timer.active is False
    assert button.value == app.PLAY and playing is False
    panels = [trace for trace in heatmap.data if trace.type == "heatmap"]
    assert len(panels) == 2 and len(heatmap.layout.shapes) == 2  # the masks, the last row marked
    assert f"at step {last}" in over_steps.layout.title.text


def test_without_a_run_a_tick_changes_nothing_and_stops_the_timer():
    *views, timer, button, playing = app.on_tick(None, 5, "auto", "all", "all", 0.3)
    assert views == [SKIP] * 6 and timer.active is False and playing is False


def test_play_starts_over_from_the_last_step_and_pause_redraws_the_masks(run):
    step, heatmap, over_steps, timer, button, playing = app.on_play(run.run_id, last_step(run), False,
                                                                     "all", "all", 0.3)
    assert step == 0 and timer.active is True and button.value == app.PAUSE and playing is True
    assert app.on_play(run.run_id, 4, False, "all", "all", 0.3)[0] == SKIP  # mid-text: from where it is
    step, heatmap, over_steps, timer, button, playing = app.on_play(run.run_id, 4, True, "all", "all", 0.3)
    assert step == SKIP and timer.active is False and button.value == app.PLAY and playing is False
    assert heatmap.layout.shapes[0].y0 == 4 and "at step 4" in over_steps.layout.title.text
    with pytest.raises(gr.Error, match="Run something first"):
        app.on_play(None, 4, False, "all", "all", 0.3)


def test_the_speed_sets_the_stride_and_anything_else_plays_the_text_in_60_ticks():
    run = SimpleNamespace(traces=[SimpleNamespace(tokens=np.arange(8192))])
    assert [panels.play_stride(run, speed) for _, speed in panels.PLAY_SPEEDS] == [137, 1, 4, 16, 64]
    for junk in ("0", "-3", "1e9x", None, 2.5, "auto"):  # what a raw API call may send
        assert panels.play_stride(run, junk) == 137
    assert panels.play_stride(run, "99999") == 8192


def test_a_row_in_cells_is_the_mean_of_what_arrived_and_blank_after_the_step():
    values = np.array([1, 0, 1, 1, 0, 0, 1, 1, 1, 1], np.float32)
    cells = reads.binned_row(values, step=6, size=4)
    np.testing.assert_allclose(cells[:2], [0.75, 1 / 3])  # the second cell: positions 4..6 only
    assert np.isnan(cells[2]) and len(cells) == 3
    np.testing.assert_array_equal(reads.binned_row(values, 9, 1), values)


def test_the_row_figure_is_small_at_8k_and_refuses_a_row_of_the_wrong_length():
    rows = {f"policy {i}": reads.binned_row(np.ones(8192), 5000, 16) for i in range(6)}
    fig = step_row_figure(rows, 5000, 8192, 16)
    assert len(fig.to_json()) < 40_000 and np.asarray(fig.data[0].z).shape == (6, 512)
    with pytest.raises(ValueError, match="at most 512 cells"):
        step_row_figure({"x": np.ones(600)}, 50, 8192, 16)
    ended = step_row_figure({"long": np.ones(10), "ended early": np.ones(7)}, 8, 10)  # generate mode
    assert np.isnan(np.asarray(ended.data[0].z)[1, 7:]).all()


def test_a_marked_row_is_a_line_across_every_panel():
    panel = dict(reads=np.tri(8, dtype=bool), token_texts=[str(i) for i in range(8)])
    fig = mark_row(mask_heatmaps({"a": panel, "b": panel}), 5)
    assert [(s.yref, s.y0, s.xref) for s in fig.layout.shapes] == [("y", 5, "x domain"), ("y2", 5, "x2 domain")]
