"""A real headless Chromium driven over the DevTools protocol through a pipe (``--remote-debugging-pipe``):
one page that stays loaded, so a test sees it change without a reload, reads its DOM and takes screenshots.

No websocket and no third-party client: Chromium reads protocol messages from its fd 3 and writes to its fd 4,
each a JSON object ended by a NUL byte. Waiting for the page is event-driven: a condition is awaited inside the
page with a MutationObserver (``wait_for``), and every read from the pipe has a deadline.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(Exception):
    """Chromium answered a protocol call with an error, or did not answer in time."""


class Chromium:
    """One headless Chromium with one page (use as a context manager: the browser is always ended)."""

    def __init__(self, profile: Path, *, width: int = 1280, height: int = 1100) -> None:
        assert CHROMIUM is not None
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        args = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", f"--window-size={width},{height}", "--remote-debugging-pipe",
            "about:blank",
        ]  # fmt: skip
        # bash puts the pipe ends on fds 3 and 4, where Chromium expects them
        shim = f'exec "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-'
        self.proc = subprocess.Popen(
            ["bash", "-c", shim, "chromium", *args],
            pass_fds=(to_chrome_r, from_chrome_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next_id = 0
        self._events: list[dict[str, object]] = []
        self._session: str | None = None
        try:
            targets = self.call("Target.getTargets", timeout=60)["targetInfos"]
            page = next(t for t in targets if t["type"] == "page")  # type: ignore[index]
            attached = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)
            self._session = str(attached["sessionId"])
            self.call("Page.enable")
        except BaseException:
            self.close()
            raise

    # ----- the protocol ---------------------------------------------------------------------------

    def call(self, method: str, *, timeout: float = 30.0, **params: object) -> dict[str, object]:
        """One protocol call on the page's session (the browser's before it is attached); its result."""
        self._next_id += 1
        msg: dict[str, object] = {"id": self._next_id, "method": method, "params": params}
        if self._session is not None:
            msg["sessionId"] = self._session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                result = reply.get("result")
                return result if isinstance(result, dict) else {}
            if "method" in reply:
                self._events.append(reply)

    def _read(self, deadline: float, waiting_for: str) -> dict[str, object]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._r], [], [], max(left, 0))
            if not ready:
                raise BrowserError(f"no answer to {waiting_for} in time")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise BrowserError(f"chromium closed its pipe while we waited for {waiting_for}")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        doc = json.loads(raw)
        assert isinstance(doc, dict)
        return doc

    def _wait_event(self, method: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for event in self._events:
                if event.get("method") == method:
                    self._events.remove(event)
                    return
            msg = self._read(deadline, method)
            if "method" in msg:
                self._events.append(msg)

    # ----- what tests do --------------------------------------------------------------------------

    def navigate(self, url: str, *, timeout: float = 30.0) -> None:
        """Load ``url`` and return once its load event fired."""
        self._events.clear()
        self.call("Page.navigate", url=url)
        self._wait_event("Page.loadEventFired", timeout)

    def evaluate(self, expression: str, *, timeout: float = 30.0) -> object:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.call(
            "Runtime.evaluate",
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
            timeout=timeout,
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}: {result['exceptionDetails']}")
        inner = result.get("result")
        return inner.get("value") if isinstance(inner, dict) else None

    def wait_for(self, condition: str, *, timeout: float = 30.0) -> None:
        """Until the JavaScript ``condition`` holds in the page, re-checked at every DOM change."""
        script = (
            "new Promise(resolve => {"
            f" const ok = () => {{ try {{ return !!({condition}); }} catch (e) {{ return false; }} }};"
            " if (ok()) { resolve(true); return; }"
            " const seen = new MutationObserver(() => { if (ok()) { seen.disconnect(); resolve(true); } });"
            " seen.observe(document, {subtree: true, childList: true, characterData: true, attributes: true});"
            "})"
        )
        self.evaluate(script, timeout=timeout)

    def text(self, element_id: str) -> str:
        """The text of the element with this id ('' when none)."""
        value = self.evaluate(
            f"(document.getElementById({json.dumps(element_id)}) || {{}}).textContent || ''"
        )
        return str(value)

    def dom(self) -> str:
        """The page's DOM as HTML."""
        return str(self.evaluate("document.documentElement.outerHTML"))

    def screenshot(self, path: Path) -> bytes:
        """A PNG of the page as it is now, written to ``path``."""
        data = base64.b64decode(str(self.call("Page.captureScreenshot", format="png")["data"]))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return data

    def close(self) -> None:
        """End the browser (and its helpers: its process group is its own)."""
        for fd in (self._w, self._r):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def artifact_dir() -> Path:
    """Where tests keep what a person should look at after the run (``FLODL_TEST_ARTIFACTS``, or
    ``test-artifacts/`` in the repository, which git ignores)."""
    return Path(
        os.environ.get("FLODL_TEST_ARTIFACTS")
        or Path(__file__).resolve().parent.parent / "test-artifacts"
    )
