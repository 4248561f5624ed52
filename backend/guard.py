"""What keeps one visitor from taking a public Space down for the others (no UI code here).

* ``Admission``: how many model-slot jobs (runs, sweeps) one browser session and one client address may
  have waiting or running at once. The app asks before a job enters the queue and says when it ends.
* ``RequestGuard``: an ASGI middleware in front of the web app. The app has no upload, so Gradio's
  upload route is closed (nothing a stranger sends stays on disk), a request body over
  ``max_body`` bytes is refused with HTTP 413 before anything reads it into a prompt, and the app may
  refuse a body it knows the web framework would choke on (``refuse``).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

UPLOAD_PATHS = ("/upload", "/gradio_api/upload")


class Admission:
    """Counts model-slot jobs per session, per client address and in all; ``enter`` refuses past the limits.

    A job is known by its ticket from ``enter`` to ``leave``: the caller carries the ticket from the check to
    the run, so the slot it frees is the one it took, whatever session the run is given later. A request
    without a session (a raw API call) counts against its address and the queue only.

    ``queue`` bounds the jobs admitted at once: the queue's own cap is checked before the validator runs, so a
    burst of requests would all pass it; this count is taken under a lock. A job that was admitted but never
    ran (its visitor left while it waited) stops counting after ``expire_s`` seconds.
    """

    def __init__(self, per_session: int = 1, per_address: int = 4, queue: int = 64, expire_s: float = 900.0):
        self.per_session, self.per_address, self.queue, self.expire_s = per_session, per_address, queue, expire_s
        self._jobs: dict[int, tuple[str | None, str, float]] = {}  # ticket -> (session, address, admitted at)
        self._next = 0
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        for ticket in [t for t, (_, _, at) in self._jobs.items() if now - at > self.expire_s]:
            del self._jobs[ticket]

    def enter(self, session: str | None, address: str) -> tuple[int | None, str]:
        """(ticket, "") when admitted, else (None, the reason to show)."""
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            if len(self._jobs) >= self.queue:
                return None, f"The queue is full ({self.queue} runs waiting or running); try again in a few minutes."
            sessions = Counter(s for s, _, _ in self._jobs.values())
            addresses = Counter(a for _, a, _ in self._jobs.values())
            if session is not None and sessions[session] >= self.per_session:
                return None, "Your previous run is still waiting or running; it comes first."
            if addresses[address] >= self.per_address:
                return None, "Too many runs from your address are waiting or running; try again when one ends."
            self._next += 1
            self._jobs[self._next] = (session, address, now)
            return self._next, ""

    def leave(self, ticket: int | None) -> None:
        """The job of ``ticket`` ended (ran, failed or was refused); None or an expired ticket: nothing to do."""
        with self._lock:
            self._jobs.pop(ticket, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)


Verdict = tuple[int, str] | None  # (HTTP status, one line of text) to refuse with, or None to let it through


class RequestGuard:
    """ASGI middleware: 403 for the upload route, 413 for a body over ``max_body`` bytes, and what ``refuse``
    says of a body once it is read."""

    def __init__(self, app, max_body: int, refuse: Callable[[bytes], Verdict] = lambda body: None):
        self.app, self.max_body, self.refuse = app, max_body, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"].rstrip("/").endswith(UPLOAD_PATHS):
            return await _plain(send, 403, "This app takes no uploads.")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _plain(send, 413, f"Request too large: the limit is {self.max_body:,} bytes.")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # No length given (chunked): read at most max_body bytes, then replay them to the app.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return await _plain(send, 413, f"Request too large: the limit is {self.max_body:,} bytes.")
            if not message.get("more_body"):
                break
        body, sent = b"".join(chunks), False
        verdict = self.refuse(body)
        if verdict is not None:
            return await _plain(send, *verdict)

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


async def _plain(send, status: int, text: str) -> None:
    body = text.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
