"""The running app in a real browser (Debian's Chromium driven by Playwright)."""
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port

# The browser tests run on one pytest-xdist worker, one module after another: each module starts an app and a
# Chromium of its own, and two such pairs at once would share two cores with the rest of the suite.
pytestmark = [pytest.mark.xdist_group("browser"), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("sinks", "tova", "reattention")


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    port = free_port()
    # Every page of a module comes from one address. A run a closed page left waiting keeps its admission ticket until
    # it expires (15 minutes), so under the default of 4 a module's later runs could be refused; the limit itself is
    # tested in test_hostile_input.py.
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "KVLENS_STORE_DIR": str(tmp_path_factory.mktemp("store")), "GRADIO_ANALYTICS_ENABLED": "False",
           "KVLENS_RUNS_PER_ADDRESS": "64"}
    log = open(tmp_path_factory.mktemp("log") / "app.log", "w")
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"the app did not start: see {log.name}")
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def page(app_url):
    executable = shutil.which("chromium")
    if executable is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("Debian's chromium is not installed here: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1920, "height": 1200})
        page.goto(app_url)
        page.wait_for_selector("#run", timeout=60_000)
        yield page
        browser.close()


def choose_policies(page, wanted, timeout_s: float = 120):
    """Check exactly ``wanted`` among the policies by kind (their fold opened). A click goes to the server and back,
    and on a busy machine an answer to an earlier click can come after a later one: so one box at a time, until every
    box reads as wanted twice, half a second apart."""
    kinds = page.locator("#policies")
    if not kinds.locator("label").first.is_visible():
        page.get_by_text("Policies by kind").click()
    boxes = page.locator("#policies label")
    boxes.first.wait_for()

    def wrong():
        labels = [boxes.nth(i) for i in range(boxes.count())]
        return [label for label in labels
                if label.locator("input").is_checked() != (label.inner_text().strip() in wanted)]

    deadline, settled = time.monotonic() + timeout_s, 0
    while settled < 2:
        off = wrong()
        assert time.monotonic() < deadline, f"the policies did not settle on {sorted(wanted)}: {len(off)} boxes off"
        if off:
            off[0].click()
            settled = 0
        else:
            settled += 1
        page.wait_for_timeout(500)


def open_parameters(page):
    """The fold holding the budget, the mode and the policies' parameters."""
    if not page.locator("#budget").is_visible():
        page.get_by_text("Budget, mode and parameters").click()
    page.locator("#budget").wait_for()


def open_view(page, name):
    page.locator("#views").get_by_role("tab", name=name).click()


def wait_for_masks(page, spec: str, timeout: float = 180_000):
    """Until the masks draw a panel of ``spec`` (a run's end); a timeout says what the status line showed then (a
    refusal, a run still going)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            "spec => [...document.querySelectorAll('#heatmap .js-plotly-plot')].some(el => "
            "(el.layout.annotations || []).some(a => a.text.includes(spec)))", arg=spec, timeout=timeout)
    except PlaywrightTimeout:
        pytest.fail(f"no masks of {spec} after {timeout / 1000:.0f} s; the status line: "
                    f"{page.locator('#status').inner_text()!r}")


def plot_titles(page, elem_id):
    return page.locator(f"#{elem_id} .js-plotly-plot").first.evaluate(
        "el => [el.layout.title && el.layout.title.text, ...(el.layout.annotations || []).map(a => a.text)]")


def test_run_three_policies_and_every_view_renders(page, tmp_path):
    choose_policies(page, POLICIES)
    page.locator("#run").click()
    page.wait_for_function("() => document.querySelector('#status').innerText.includes('3 policies')",
                           timeout=180_000)
    open_view(page, "Masks")
    page.wait_for_selector("#heatmap .js-plotly-plot", timeout=180_000)
    page.wait_for_function(
        "() => [...document.querySelectorAll('#heatmap .js-plotly-plot')].some(el => "
        "(el.layout.annotations || []).some(a => a.text.includes('sinks:budget=40')))", timeout=60_000)

    titles = " ".join(map(str, plot_titles(page, "heatmap")))
    for name in POLICIES:
        assert f"{name}:budget=40" in titles
    summary = page.locator("#summary").inner_text()
    assert all(f"{name}:budget=40" in summary for name in POLICIES)

    open_view(page, "Kept tokens")
    kept = page.locator("#kept")
    # This run's kept tokens, not the landing run's (which holds A2SF too).
    page.wait_for_function("() => document.querySelector('#kept').innerText.includes('sinks:budget=40') && "
                           "!document.querySelector('#kept').innerText.includes('a2sf')", timeout=60_000)
    for name in POLICIES:
        assert f"{name}:budget=40" in kept.inner_text()

    open_view(page, "A2S vs A2SF")
    page.wait_for_selector("#curves .js-plotly-plot", timeout=60_000)
    assert "A2S vs A2SF" in " ".join(map(str, plot_titles(page, "curves")))

    open_view(page, "Divergence")
    page.wait_for_selector("#divergence .js-plotly-plot", timeout=60_000)
    continuations = page.locator("#continuations").inner_text()
    assert all(f"{name}:budget=40" in continuations for name in POLICIES)

    open_view(page, "Retention")
    page.wait_for_selector("#retention .js-plotly-plot", timeout=60_000)

    open_view(page, "K-cache t-SNE")
    page.get_by_role("button", name="Compute t-SNE").click()
    page.wait_for_selector("#tsne .js-plotly-plot", timeout=120_000)
    assert "keys of layer" in " ".join(map(str, plot_titles(page, "tsne")))

    open_view(page, "Masks")
    page.evaluate("window.scrollTo(0, 0)")
    target = tmp_path / "app.png"
    page.screenshot(path=str(target), full_page=False)
    assert target.stat().st_size > 50_000  # a rendered page, not a blank one


def test_deep_link_reopens_the_run_from_the_store(page, app_url):
    page.locator("#pages").get_by_role("tab", name="Share").click()
    share = page.locator("#share").inner_text()
    run_id = share.split("Run id:")[1].strip().split()[0]
    other = page.context.browser.new_page()
    other.goto(f"{app_url}?run={run_id}")
    other.wait_for_function("() => (document.querySelector('#status') || {innerText: ''}).innerText"
                            ".includes('shared run')", timeout=60_000)  # the page is built showing the first run
    other.wait_for_function("() => (document.querySelector('#summary') || {innerText: ''}).innerText"
                            ".includes('reattention:budget=40')", timeout=60_000)
    assert "reattention:budget=40" in other.locator("#summary").inner_text()
    other.close()


def test_switching_layer_and_budget_rerenders(page):
    page.locator("#pages").get_by_role("tab", name="This run").click()
    open_view(page, "Masks")
    layer = page.locator("#layer input")
    layer.click()
    page.get_by_role("option", name="0", exact=True).click()
    page.wait_for_function(
        "() => document.querySelector('#heatmap .js-plotly-plot')?.layout?.title?.text?.includes('layer 0')",
        timeout=60_000)

    open_parameters(page)
    budget = page.locator("#budget input[type=number]")
    budget.fill("16")
    budget.press("Enter")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#heatmap .js-plotly-plot')].some(el => "
        "(el.layout.annotations || []).some(a => a.text.includes('tova:budget=16')))",
        timeout=180_000)


def test_a_bad_policy_typed_as_html_is_refused_as_text(page):
    open_parameters(page)
    custom = page.locator("textarea[placeholder^='tova:budget=32']")
    custom.fill("<img src=x onerror=\"document.title='pwned'\">")
    cost = page.locator("#cost")
    cost.get_by_text("unknown policy", exact=False).wait_for(timeout=30_000)
    page.locator("#run").click()
    # The cost line shows the spec as typed; the validator's message under the prompt, with a look-alike for "<"
    # (Gradio also reads it out from a hidden live region, which holds the same text).
    page.locator("#prompt").get_by_text("unknown policy '‹img src=x onerror=", exact=False).wait_for(timeout=30_000)
    assert """'<img src=x onerror="document.title='pwned'">'""" in cost.inner_text()
    assert page.locator("img[src=x]").count() == 0 and page.title() != "pwned"
    custom.fill("")


def test_long_context_tab_draws_the_shipped_grid_and_refuses_an_oversized_one(page):
    page.locator("#pages").get_by_role("tab", name="Long context").click()
    page.wait_for_selector("#shipped-needle .js-plotly-plot", timeout=30_000)
    kinds = page.locator("#shipped-needle .js-plotly-plot").first.evaluate("el => el.data.map(t => t.type)")
    assert kinds and set(kinds) == {"heatmap"}  # one per policy of assets/long_context/needle_grid.csv
    page.wait_for_selector("#shipped-sweep .js-plotly-plot")
    boxes = page.locator("#needle-policies label")
    for i in range(boxes.count()):  # four policies: one more than a visitor's grid may hold
        label = boxes.nth(i)
        if label.inner_text().strip() in ("window", "sinks", "h2o", "tova") and not label.locator("input").is_checked():
            label.click()
    page.locator("#needle-run").click()
    page.get_by_text("Pick 1 to 3 policies", exact=False).first.wait_for(timeout=30_000)
    assert page.locator("#needle-grid .js-plotly-plot").count() == 0  # refused before it queued


def test_tasks_tab_draws_the_shipped_leaderboard_and_a_clicked_sample_runs_with_its_evidence(page, app_url):
    # A page of its own: the module's page carries the earlier tests' layer, budget and tab choices.
    page = page.context.browser.new_page(viewport={"width": 1920, "height": 1200})
    page.goto(app_url)
    page.wait_for_selector("#run", timeout=60_000)
    page.locator("#pages").get_by_role("tab", name="Tasks leaderboard").click()
    page.wait_for_selector("#leaderboard-plot .js-plotly-plot", timeout=30_000)
    assert "mean over the tasks Full solves" in " ".join(map(str, plot_titles(page, "leaderboard-plot")))
    page.locator("#leaderboard-task input").click()
    page.get_by_role("option", name="niah_single_1", exact=True).click()
    page.wait_for_function(
        "() => document.querySelector('#leaderboard-plot .js-plotly-plot')?.layout?.title?.text?.includes('niah_single_1')",
        timeout=30_000)
    assert "tova" in page.locator("#leaderboard-table").inner_text()
    aware = page.locator("#leaderboard-setting label", has_text="query-aware")
    if aware.count() and aware.first.is_visible():  # the radio shows when the file holds both settings
        aware.first.click()
        page.wait_for_function(
            "() => document.querySelector('#leaderboard-plot .js-plotly-plot')?.layout?.title?.text?"
            ".includes('query-aware')", timeout=30_000)

    # A click on a shipped answer's row (the first: sample 0 under A2SF at ratio 0.25) runs that sample here.
    page.wait_for_function("() => document.querySelector('#leaderboard-samples').innerText.includes('a2sf')",
                           timeout=30_000)
    page.locator("#leaderboard-samples [role=gridcell]").nth(2).click()
    page.wait_for_function("() => document.querySelector('#task-status').innerText.includes('score')",
                           timeout=240_000)
    status = page.locator("#task-status").inner_text()
    assert "niah_single_1, sample 0, query-" in status and "a2sf:ratio=0.25: score" in status
    table = page.locator("#task-table").inner_text()
    assert "a2sf:ratio=0.25" in table
    # Why: the needle's number located in the context and followed through each cache, Full's first.
    assert "Evidence:" in table and "evidence held" in table and "Full held all" in table
    if os.environ.get("KVLENS_UPDATE_SCREENSHOT"):  # docs/evidence.md's picture of the view
        page.locator("#task-table").screenshot(path=str(ROOT / "docs" / "screenshot-why.png"))
    # The sample's run is the page's run: the summary and the masks show it.
    page.locator("#pages").get_by_role("tab", name="This run").click()
    page.wait_for_function("() => (document.querySelector('#summary') || {innerText: ''}).innerText.includes('a2sf:ratio=0.25')",
                           timeout=120_000)
    open_view(page, "Masks")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#heatmap .js-plotly-plot')].some(el => "
        "(el.layout.annotations || []).some(a => a.text.includes('a2sf:ratio=0.25')))",
        timeout=120_000)
    # The evidence is marked: a band over its columns in the masks, underlined in the kept tokens.
    assert page.evaluate("() => [...document.querySelectorAll('#heatmap .js-plotly-plot')].some(el => "
                         "(el.layout.shapes || []).some(s => s.type === 'rect' && s.fillcolor === '#D35400'))")
    open_view(page, "Kept tokens")
    page.wait_for_selector("#kept .kvl-evidence", timeout=60_000)
    assert "evidence" in page.locator("#kept .kvl-legend").first.inner_text()
    page.close()


def test_evidence_typed_with_a_prompt_is_marked_and_play_shows_it_leave(page, app_url):
    """A prompt whose answer sits in "48151", that string typed as its evidence: as Play steps through the text, the
    kept tokens (layer 0, KV head 0) underline it as kept once it has arrived, and evicted by the end (TOVA at
    budget 32)."""
    page = page.context.browser.new_page(viewport={"width": 1920, "height": 1200})
    page.goto(app_url)
    page.wait_for_selector("#run", timeout=60_000)
    prompt = "Remember this: the secret code is 48151 and nothing else. " + "Then we walked home. " * 12 + "Code?"
    page.locator("#prompt textarea").fill(prompt)
    open_parameters(page)
    page.locator("#evidence textarea").fill("48151")
    choose_policies(page, ("tova",))
    open_view(page, "Masks")
    budget = page.locator("#budget input[type=number]")
    budget.fill("32")
    budget.press("Enter")
    wait_for_masks(page, "tova:budget=32")
    assert "1 policies" in page.locator("#status").inner_text() or "1 policy" in page.locator("#status").inner_text()
    page.locator("#layer input").click()
    page.get_by_role("option", name="0", exact=True).last.click()
    page.wait_for_function(
        "() => document.querySelector('#heatmap .js-plotly-plot')?.layout?.title?.text?.includes('layer 0')",
        timeout=60_000)
    page.locator("#head input").click()
    page.get_by_role("option", name="0", exact=True).last.click()  # the list just opened
    page.wait_for_function(
        "() => document.querySelector('#heatmap .js-plotly-plot')?.layout?.title?.text?.includes('KV head 0')",
        timeout=60_000)
    open_view(page, "Kept tokens")
    page.wait_for_selector("#kept .kvl-evidence", timeout=60_000)
    # Play at four steps a tick from the start: the kept tokens follow it; note the evidence's state at every frame.
    # The budget holds every token up to step 32, so the evidence (from about step 8) is kept in several frames.
    page.get_by_text("Play's speed, and what it shows").click()
    page.locator("#play-speed").get_by_text("4 steps", exact=True).click()
    page.locator("#play").click()  # from the last step Play starts over at 0
    seen, deadline = [], time.time() + 150
    while time.time() < deadline:
        states = page.locator("#kept .kvl-evidence").evaluate_all("els => els.map(e => e.classList[1])")
        seen.append(frozenset(states))
        if "Play" in page.locator("#play").inner_text() and len(seen) > 5:
            break
        time.sleep(0.1)
    assert frozenset({"kvl-kept"}) in seen  # kept once it has arrived
    assert seen[-1] == frozenset({"kvl-evicted"})  # gone by the last step
    page.close()


def test_the_held_forms_tab_draws_the_pruned_channels_and_the_rounded_tokens(page, app_url):
    """ThinK and KIVI at the budget slider's 40: the Held forms tab draws ThinK's keys and channels and KIVI's keys
    and values; the masks still show every KIVI token read (held, not evicted)."""
    page = page.context.browser.new_page(viewport={"width": 1920, "height": 1200})
    page.goto(app_url)
    page.wait_for_selector("#run", timeout=60_000)
    choose_policies(page, ("think", "kivi"))
    open_view(page, "Masks")
    page.locator("#run").click()
    wait_for_masks(page, "kivi")
    open_view(page, "Held forms")
    page.wait_for_selector("#forms .js-plotly-plot", timeout=60_000)
    titles = " ".join(map(str, plot_titles(page, "forms")))
    assert "think:budget=40: the keys' relative error" in titles and "key channels kept" in titles
    assert "kivi" in titles and "the values' relative error" in titles
    page.close()
