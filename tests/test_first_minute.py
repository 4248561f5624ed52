"""What a visitor meets with no click, in a real browser: at 1366x768 and 1440x900 a finished run's answers and
picture and the Run button in view, every view and page reachable (none in an overflow menu), a summary that does
not scroll sideways; on a phone a page that does not scroll sideways; each lesson opening by its link and stepping
through. Its own app process (the fixture of test_browser.py, instantiated for this module)."""
import os
import shutil
from pathlib import Path

import pytest

from backend.experiments.lessons import LESSONS
from viz.first_paint import FIRST_SCREEN
from tests.test_browser import app_url  # noqa: F401  (fixture)

# The browser tests run on one pytest-xdist worker, one module after another: each module starts an app and a
# Chromium of its own, and two such pairs at once would share two cores with the rest of the suite.
pytestmark = [pytest.mark.xdist_group("browser"), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]

IN_VIEW_JS = """sel => { const r = document.querySelector(sel).getBoundingClientRect();
    return r.width > 0 && r.height > 0 && r.top >= 0 && r.left >= 0 && r.bottom <= innerHeight && r.right <= innerWidth; }"""
# Gradio moves the tabs that do not fit into a menu behind a button; every tab must sit in the bar itself.
TABS_FIT_JS = """sel => [...document.querySelectorAll(sel + ' [role=tab]')].every(t => {
    const r = t.getBoundingClientRect(); return r.width > 0 && r.right <= innerWidth; })
    && ![...document.querySelectorAll(sel + ' .overflow-menu, ' + sel + ' .overflow-dropdown')].some(
        m => m.getBoundingClientRect().width > 0)"""
SIDEWAYS_JS = """sel => [document.querySelector(sel), ...document.querySelectorAll(sel + ' *')].some(
    el => el.scrollWidth > el.clientWidth + 1 && ['auto', 'scroll'].includes(getComputedStyle(el).overflowX))"""


@pytest.fixture(scope="module")
def browser():
    executable = shutil.which("chromium")
    if executable is None:
        pytest.skip("Debian's chromium is not installed here: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield browser
        browser.close()


def opened(browser, url, width, height):
    """The plain landing once the page has replaced its first paint (the copy of its first screen)."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.goto(url)
    page.wait_for_selector("#summary svg.kvl-strip", timeout=60_000)
    page.wait_for_selector("html.kvl-ready", state="attached", timeout=30_000)
    return page


@pytest.mark.parametrize("width, height", [(1366, 768), (390, 844)])
def test_the_html_alone_shows_the_answers_and_run_then_the_page_takes_their_place(browser, app_url, width,  # noqa: F811
                                                                                   height):
    # Gradio's script held back: what the HTML itself draws, while the page beneath it stays hidden.
    page = browser.new_page(viewport={"width": width, "height": height})
    page.route("**/assets/index-*.js", lambda route: route.abort())
    page.goto(app_url)
    copy = page.locator("#kvl-first-paint")
    assert copy.is_visible()
    assert "The meeting room number is 317." in copy.inner_text() and "1234" in copy.inner_text()
    assert page.evaluate(IN_VIEW_JS, "#kvl-first-paint .kvl-story tbody tr:last-child svg")  # the picture
    assert page.evaluate("document.documentElement.scrollWidth <= innerWidth")
    if width > 700:  # on a phone the answers come first and the controls under them, as on the page
        assert page.evaluate(IN_VIEW_JS, "#kvl-first-paint .kvl-fp-run")
    page.close()
    # With it: the page takes the copy's place once its first screen is all there, not when the wait runs out.
    page = opened(browser, app_url, width, height)
    assert [part for part in FIRST_SCREEN if page.locator(part).count() == 0] == []  # what the copy waits for
    assert page.evaluate("document.documentElement.dataset.shown") == "parts"
    assert page.locator("#kvl-first-paint").count() == 0 and page.locator("#run").is_visible()
    page.close()


def test_the_plain_page_asks_the_server_nothing_as_it_loads(browser, app_url):  # noqa: F811
    """The first run's summary, view and cost come with the page: no event runs (a tab reporting itself selected
    as it mounts included), so nothing is drawn twice and the page's main thread stays free."""
    page = browser.new_page(viewport={"width": 1366, "height": 768})
    calls = []
    page.on("request", lambda r: calls.append(r.url) if r.method == "POST" and "gradio_api" in r.url else None)
    page.goto(app_url)
    page.wait_for_selector("#kept .kvl-evidence", timeout=60_000)
    page.wait_for_timeout(2_000)
    assert calls == []
    assert page.locator("#cost").inner_text().startswith("Cost: 4 policies x 264 tokens")  # counted, not estimated
    page.get_by_role("tab", name="Masks").click()  # a view opened by hand is drawn
    page.wait_for_selector("#heatmap .js-plotly-plot", timeout=60_000)
    assert calls
    page.close()


# Counts the animation frames the page asks for, installed before any of the page's scripts.
COUNT_FRAMES_JS = """(() => { window.kvlFrames = 0; const ask = window.requestAnimationFrame.bind(window);
    window.requestAnimationFrame = (callback) => { window.kvlFrames += 1; return ask(callback); }; })()"""


@pytest.mark.parametrize("query", ["", "?lesson=window"])
def test_an_idle_page_asks_for_ten_frames_a_second_not_sixty(browser, app_url, query):  # noqa: F811
    """Gradio's status timers count on every frame, and one whose tracker left the page while pending (the app's
    loading tracker, on every page) never stops: sixty frames a second for nothing (viz/status_timer.py). The page's
    script hands them out ten times a second, the plain landing and a lesson alike."""
    page = browser.new_page(viewport={"width": 1366, "height": 768})
    page.add_init_script(COUNT_FRAMES_JS)
    page.goto(app_url + query)
    page.wait_for_selector("#run", timeout=60_000)
    # Frames a second over two-second windows, until one is quiet (the page's own events, its lesson's run and plots
    # drawn, ask for frames as they come): 60 in every window without the script, 10 with it once the page rests.
    rates = []
    for _ in range(10):
        before = page.evaluate("window.kvlFrames")
        page.wait_for_timeout(2_000)
        rates.append((page.evaluate("window.kvlFrames") - before) / 2)
        if rates[-1] <= 15:
            break
    assert 0 < rates[-1] <= 15, rates
    page.close()


@pytest.mark.parametrize("width, height", [(1366, 768), (1440, 900)])
def test_the_first_screen_shows_a_finished_run_and_run_with_no_click(browser, app_url, width, height):  # noqa: F811
    page = opened(browser, app_url, width, height)
    assert page.evaluate(IN_VIEW_JS, "#summary .kvl-story tbody tr:last-child svg")  # the picture, every row of it
    assert page.evaluate(IN_VIEW_JS, "#run")
    summary = page.locator("#summary").inner_text()
    assert "317" in summary and "1234" in summary and "reattention:budget=40" in summary  # the answers, Full's first
    assert not page.evaluate(SIDEWAYS_JS, "#summary")
    assert page.evaluate(TABS_FIT_JS, "#pages") and page.evaluate(TABS_FIT_JS, "#views")
    page.wait_for_selector("#kept .kvl-evidence", timeout=30_000)  # the view in sight: the needle marked
    if os.environ.get("KVLENS_UPDATE_SCREENSHOT") and width == 1366:  # the README's picture of the first screen
        page.screenshot(path=str(ROOT / "docs" / "screenshot.png"))
    # Keyboard users reach Run and every page.
    page.locator("#prompt textarea").focus()
    for _ in range(40):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement && document.activeElement.id === 'run'"):
            break
    assert page.evaluate("document.activeElement.id") == "run"
    page.close()


def test_on_a_phone_the_answers_show_and_nothing_scrolls_sideways(browser, app_url):  # noqa: F811
    page = opened(browser, app_url, 390, 844)
    assert page.evaluate("document.documentElement.scrollWidth <= innerWidth")
    assert "317" in page.locator("#summary").inner_text()
    box = page.locator("#summary svg.kvl-strip").first.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 390
    page.close()


@pytest.mark.parametrize("name", list(LESSONS))
def test_each_lesson_opens_by_its_link_and_steps_through(browser, app_url, name):  # noqa: F811
    lesson = LESSONS[name]
    page = browser.new_page(viewport={"width": 1366, "height": 768})
    page.goto(f"{app_url}?lesson={name}")
    text = page.locator("#lesson")
    for index, step in enumerate(lesson.steps):
        page.wait_for_function(f"() => (document.querySelector('#lesson') || {{innerText: ''}}).innerText.includes("
                               f"'step {index + 1} of {len(lesson.steps)}')", timeout=30_000)
        assert lesson.title in text.inner_text()
        if step.run:
            page.wait_for_function("() => document.querySelector('#summary svg.kvl-strip') !== null", timeout=30_000)
            assert page.locator("#views [role=tab][aria-selected=true]").inner_text().strip() != ""
        else:
            page.wait_for_selector("#leaderboard-plot .js-plotly-plot", timeout=30_000)
        if index + 1 < len(lesson.steps):
            page.locator("#lesson-next").click()
    page.locator("#lesson-back").click()
    page.wait_for_function(f"() => (document.querySelector('#lesson') || {{innerText: ''}}).innerText.includes("
                           f"'step {len(lesson.steps) - 1} of')", timeout=30_000)
    page.close()


def test_the_leaderboard_opens_from_its_link(browser, app_url):  # noqa: F811
    page = browser.new_page(viewport={"width": 1366, "height": 768})
    page.goto(f"{app_url}?tab=tasks")
    page.wait_for_selector("#leaderboard-plot .js-plotly-plot", timeout=30_000)
    kinds = page.locator("#leaderboard-plot .js-plotly-plot").first.evaluate("el => el.data.map(t => t.type)")
    assert kinds == ["heatmap"]
    page.close()
