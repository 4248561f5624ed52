"""An 8k-token text in a real browser, as a class would use it: the long example loaded with one click, sinks, H2O
and TOVA at budget 256 scoring it (a minute or two on two CPU cores), the masks read from the page, and Play.

Its own app process and store (the fixtures of test_browser.py, instantiated for this module)."""
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_browser import app_url, choose_policies, open_parameters, open_view, page  # noqa: F401  (fixtures:
# this module gets its own app and browser)

# The browser tests run on one pytest-xdist worker, one module after another: each module starts an app and a
# Chromium of its own, and two such pairs at once would share two cores with the rest of the suite.
pytestmark = [pytest.mark.xdist_group("browser"), pytest.mark.slow]
EXAMPLE = "needle 8k tokens"
POLICIES = ("sinks", "h2o", "tova")
ROOT = Path(__file__).resolve().parents[1]
BUDGET = 256

# Each heatmap panel's cells as the page holds them (plotly decodes the figure's arrays into _fullData; NaN, the
# triangle above the diagonal, comes back as null), and the figure's title (it gives the tokens per cell).
PANELS_JS = """() => { const el = document.querySelector('#heatmap .js-plotly-plot');
    return {title: el.layout.title.text, panels: el._fullData.filter(t => t.type === 'heatmap').map(t => (
        {name: t.name, z: Array.from(t.z, row => Array.from(row, v => Number.isNaN(v) ? null : v))}))}; }"""


def step_value(page) -> int:  # noqa: F811  (a page, not the fixture)
    return int(float(page.locator("#step input[type=number]").input_value()))


@pytest.fixture(scope="module")
def scored(page):  # noqa: F811
    """The 8k example scored by sinks, H2O and TOVA at budget 256 (moving the budget slider starts the run)."""
    page.locator("#examples").get_by_text(EXAMPLE, exact=True).click()
    page.wait_for_function("() => document.querySelector('#prompt textarea').value.length > 30000", timeout=20_000)
    open_parameters(page)
    page.get_by_text("Score the text (teacher-forced)").click()
    choose_policies(page, POLICIES)
    open_view(page, "Masks")
    budget = page.locator("#budget input[type=number]")
    budget.fill(str(BUDGET))
    budget.press("Enter")
    # A minute or two alone on two cores; under make test the app shares them with the other pytest-xdist worker.
    page.wait_for_function(
        "() => [...document.querySelectorAll('#heatmap .js-plotly-plot')].some(el => "
        f"(el.layout.annotations || []).some(a => a.text.includes('tova:budget={BUDGET}')))", timeout=600_000)
    return page


def test_the_long_example_loads_with_one_click_and_the_budget_reaches_256(scored):
    prompt = scored.locator("#prompt textarea").input_value()
    assert 35_000 < len(prompt) < 45_000 and "The secret number is" in prompt
    assert scored.locator("#budget input[type=number]").input_value() == str(BUDGET)
    assert int(scored.locator("#budget input[type=range]").get_attribute("max")) >= 1024
    status = scored.locator("#status").inner_text()
    assert "3 policies" in status and int(status.split(" tokens")[0].split()[-1]) > 7000


def test_tova_keeps_old_tokens_far_below_the_diagonal_where_sinks_keeps_only_the_first_cell(scored, tmp_path):
    figure = scored.evaluate(PANELS_JS)
    panels = {panel["name"].split(":")[0]: panel["z"] for panel in figure["panels"]}
    assert set(panels) == set(POLICIES)
    cells = len(panels["sinks"])
    size = int(re.search(r"(\d+) tokens per cell", figure["title"]).group(1))
    band = BUDGET // size + 2  # cells that may hold the recent window
    far = [(row, col) for row in range(cells) for col in range(1, cells) if row - col > band]
    assert len(far) > 10_000
    # Whatever the colour scale, sinks' far cells (column 0 aside: the sinks) all have the "nothing read" value.
    background = {panels["sinks"][row][col] for row, col in far}
    assert len(background) == 1, sorted(background, key=str)[:5]
    kept_far = sum(panels["tova"][row][col] not in background for row, col in far)
    assert kept_far > len(far) // 20, (kept_far, len(far))
    assert all(panels["sinks"][row][0] not in background for row in range(band + 1, cells))  # the sinks
    # KVLENS_UPDATE_SCREENSHOT=1 refreshes docs/long-texts.md's picture of an 8k text; otherwise the tree stays untouched.
    target = ROOT / "docs" / "screenshot-8k.png" if os.environ.get("KVLENS_UPDATE_SCREENSHOT") else tmp_path / "8k.png"
    scored.locator("#heatmap").scroll_into_view_if_needed()
    scored.locator("#heatmap").screenshot(path=str(target))
    assert target.stat().st_size > 50_000


def test_the_pixels_below_the_band_show_tovas_old_tokens_and_sinks_nothing(scored, tmp_path):
    """What a person sees: in the drawn panels, far below the diagonal, TOVA's kept old tokens are pixels of
    another colour than the background, and sinks' (its first column aside) are all background."""
    from PIL import Image

    plot = scored.locator("#heatmap .js-plotly-plot").first
    plot.scroll_into_view_if_needed()
    shot = tmp_path / "masks.png"
    plot.screenshot(path=str(shot))
    pixels = np.asarray(Image.open(shot).convert("RGB"), float)
    areas = plot.evaluate("""el => el._fullData.filter(t => t.type === 'heatmap').map(t => {
        const x = el._fullLayout[t.xaxis.replace('x', 'xaxis')], y = el._fullLayout[t.yaxis.replace('y', 'yaxis')];
        return {name: t.name, left: x._offset, width: x._length, top: y._offset, height: y._length}; })""")
    background = np.array([0xF2, 0xC9, 0xC2], float)  # the rose of nothing read
    differing = {}
    for area in areas:
        left, top = round(area["left"]), round(area["top"])
        panel = pixels[top + 2: top + round(area["height"]) - 2, left + 2: left + round(area["width"]) - 2]
        rows, cols = np.indices(panel.shape[:2])
        below = rows / panel.shape[0] - cols / panel.shape[1] > 0.15  # well below the band of recent tokens
        below &= cols > panel.shape[1] * 0.03  # the first column: sinks' own
        distance = np.linalg.norm(panel - background, axis=-1)[below]
        differing[area["name"].split(":")[0]] = float((distance > 40).mean())
    assert differing["sinks"] < 0.01, differing
    assert differing["tova"] > 0.2 and differing["h2o"] > 0.2, differing  # here: 0.61 and 1.0


def test_every_long_example_loads_with_one_click(page):  # noqa: F811
    for path in sorted((ROOT / "assets" / "examples").glob("*tokens.txt")):
        label = path.stem.replace("_", " ")
        page.locator("#examples").get_by_text(label, exact=True).click()
        expected = path.read_text().strip()
        page.wait_for_function(f"() => document.querySelector('#prompt textarea').value.length === {len(expected)}",
                               timeout=20_000)
        assert page.locator("#prompt textarea").input_value() == expected


def test_play_moves_the_step_on_and_pause_stops_it(scored):
    last = step_value(scored)
    assert last > 7000  # a new run shows its last step
    scored.locator("#play").click()  # from the last step Play starts over at 0
    scored.wait_for_function(f"() => +document.querySelector('#step input[type=number]').value < {last}",
                             timeout=20_000)
    time.sleep(2)
    first = step_value(scored)
    time.sleep(2)
    later = step_value(scored)
    assert 0 < first < later < last, (first, later, last)
    assert "Pause" in scored.locator("#play").inner_text()
    scored.locator("#play").click()
    scored.wait_for_function("() => document.querySelector('#play').innerText.includes('Play')", timeout=30_000)
    time.sleep(1)  # a tick already on its way lands
    paused = step_value(scored)
    time.sleep(1.5)
    assert step_value(scored) == paused
    row_title = scored.locator("#step-row .js-plotly-plot").first.evaluate("el => el.layout.title.text")
    assert f"step {paused}:" in row_title  # the masks' row followed the step
