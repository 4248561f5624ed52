"""A quiet page: Gradio's status timers at ten frames a second instead of every frame.

Gradio's status tracker shows a pending event's seconds, in tenths, and counts them on every animation frame
(``requestAnimationFrame``, 60 a second). It stops counting when its event ends, but a tracker removed while its event
is pending never stops: the app's own loading tracker is, on every page as it loads. So an idle page asks the browser
for a frame 60 times a second for as long as it is open: in headless Chromium, a tenth of a core with nothing on the
screen changing (more on a phone's battery or a classroom laptop). This script, in the page's HTML before Gradio's
modules load (``app.FirstPaint``), hands the trackers' frames out ten times a second, all of them in one frame: what a
timer shows is the same, and the forgotten loops cost a sixth. Every other caller's frames are untouched. The tracker
is found by its module's name in the caller's stack; should Gradio rename it, nothing changes, and
``tests/test_first_minute.py`` (which counts an idle page's frames) fails."""
from __future__ import annotations

TIMER_FRAME_MS = 100  # a timer that shows tenths of a second needs no more


def status_timer_script() -> str:
    """The <script> for the page: the trackers' frames, however many loops ask, come as one frame every
    ``TIMER_FRAME_MS``."""
    return f"""<script>
(() => {{
  const frame = window.requestAnimationFrame.bind(window);
  let waiting = [];
  const run = (time) => {{ const due = waiting; waiting = []; due.forEach((callback) => callback(time)); }};
  window.requestAnimationFrame = (callback) => {{
    if (!/statustracker/.test(new Error().stack || "")) return frame(callback);
    if (!waiting.length) setTimeout(() => frame(run), {TIMER_FRAME_MS});
    waiting.push(callback);
    return 0;  // cancelAnimationFrame(0) cancels nothing; the tracker never cancels its frames
  }};
}})();
</script>"""
