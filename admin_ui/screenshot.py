"""Screenshots of the running console, taken by headless Chromium over the DevTools protocol.

Run by hand against a running console to refresh the README's images in docs/img/;
tests/admin_ui/test_browser.py reuses its Chromium launcher.

    python -m admin_ui.screenshot --url http://127.0.0.1:8501 --out docs/img
    python -m admin_ui.screenshot --url http://127.0.0.1:8501 --pages overview,cluster --width 1600

    with Chromium(token=admin_token) as browser:      # headless, on a free loopback debugging port
        browser.capture("http://127.0.0.1:8501/cluster", Path("cluster.png"), expect=["Cluster"])

The console asks every new browser session to log in (admin_ui/login.py), and each navigation is a
new session: given the admin token, `capture` types it into the login form whenever that form comes
up (the deep link, /cluster or /traces?trace=..., is kept through the login). The command line reads
the token as the console does (SWITCHBOARD_ADMIN_TOKEN, else the credentials file of `switchboard up`).

Chromium's own ``--screenshot`` often captures a Streamlit page before it has rendered (it exits
after ~2 s), so this drives the browser over the DevTools protocol instead: navigate, wait until
the page's title is there, nothing is stale or still running, and every chart and table has
drawn, then size the viewport to the content and ``Page.captureScreenshot``.
Needs the ``chromium`` binary (Debian: ``apt-get install chromium``) and ``websocket-client``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Self

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--force-device-scale-factor=1")
PAGES = {  # page name -> the page's title, which must be on screen before the capture
    "overview": "Overview",
    "cluster": "Cluster",
    "tiers": "Traffic & tiers",
    "autoscaler": "Autoscaler",
    "degradation": "Degradation",
    "traces": "Traces",
    "alerts": "Alerts",
    "usage": "Usage",
    "abuse": "Abuse",
    "playground": "Playground",
}
DEFAULT_PAGE = "overview"
LIVE_PAGES = frozenset(PAGES) - {"playground"}
LIVE_MARK = ["Updated "]
"""The live region of a page ends with "Updated HH:MM:SS": its presence means the region finished."""

# True once Streamlit has finished the run and every chart and grid has drawn.
_READY_JS = """
(() => {
  const want = %s;
  const main = document.querySelector('[data-testid="stMain"]');
  const text = main ? main.innerText : "";
  if (/page not found/i.test(document.body.innerText)) return "page not found";
  if (!want.every(w => text.includes(w))) return "waiting for text";
  if (document.querySelector('[data-testid="stSkeleton"]')) return "skeleton";
  if (document.querySelector('[data-stale="true"]')) return "stale";
  const status = document.querySelector('[data-testid="stStatusWidget"]');
  if (status && /running/i.test(status.innerText)) return "running";
  for (const c of document.querySelectorAll('[data-testid="stVegaLiteChart"], .vega-embed')) {
    if (!c.querySelector('canvas, svg')) return "chart";
  }
  for (const g of document.querySelectorAll('[data-testid="stDataFrame"]')) {
    if (!g.querySelector('canvas')) return "grid";
  }
  return "ready";
})()
"""
_LOGIN_FORM_JS = "document.querySelector('input[type=password][aria-label=\"Admin token\"]')"
"""The console's login form's token field (admin_ui/login.py)."""
_HEIGHT_JS = """
(() => {
  const main = document.querySelector('[data-testid="stMain"]') || document.querySelector('section.main');
  const inner = document.querySelector('[data-testid="stMainBlockContainer"]');
  const h = Math.max(inner ? inner.scrollHeight + 120 : 0, main ? main.scrollHeight : 0,
                     document.documentElement.scrollHeight);
  return h;
})()
"""


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Chromium:
    """A headless Chromium and one page, driven over the DevTools protocol (sync, one socket)."""

    def __init__(self, binary: str | None = None, *, width: int = 1440, height: int = 900,
                 token: str | None = None) -> None:
        found = binary or find_chromium()
        if found is None:
            raise FileNotFoundError("no chromium binary found (apt-get install chromium)")
        self.binary: str = found
        self.token = token
        """The admin token typed into the console's login form when it comes up (None: left there)."""
        self.width, self.height = width, height
        self._ids = itertools.count(1)
        self._proc: subprocess.Popen[bytes] | None = None
        self._profile: tempfile.TemporaryDirectory[str] | None = None
        self._ws: Any = None

    def __enter__(self) -> Self:
        import websocket  # websocket-client

        self._profile = tempfile.TemporaryDirectory(prefix="sb-chromium-", ignore_cleanup_errors=True)
        port = _free_port()
        self._proc = subprocess.Popen(
            [self.binary, *CHROMIUM_FLAGS, f"--user-data-dir={self._profile.name}",
             "--remote-debugging-address=127.0.0.1", f"--remote-debugging-port={port}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        targets: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self._proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=1) as r:
                    targets = [t for t in json.load(r) if t.get("type") == "page"]
                if targets:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        if not targets:
            self.__exit__()
            raise RuntimeError("chromium's DevTools endpoint did not come up")
        self._ws = websocket.create_connection(targets[0]["webSocketDebuggerUrl"], timeout=30,
                                               suppress_origin=True)
        self.call("Page.enable")
        self.call("Runtime.enable")
        self._viewport(self.height)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ws is not None:
            import websocket

            with contextlib.suppress(OSError, websocket.WebSocketException):
                self._ws.close()
            self._ws = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        if self._profile is not None:
            self._profile.cleanup()
            self._profile = None

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events in between are skipped)."""
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self._ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def _viewport(self, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=height, deviceScaleFactor=1,
                  mobile=False)

    def wait_ready(self, expect: list[str], timeout: float = 45.0, settle: float = 1.5) -> None:
        """Wait until `expect` is on the page and Streamlit has drawn everything; then `settle` s more."""
        deadline = time.monotonic() + timeout
        state = "not started"
        while time.monotonic() < deadline:
            state = self.evaluate(_READY_JS % json.dumps(expect))
            if state == "ready":
                time.sleep(settle)
                if self.evaluate(_READY_JS % json.dumps(expect)) == "ready":
                    return
            time.sleep(0.3)
        raise TimeoutError(f"page not ready after {timeout:.0f} s ({state}); expected {expect}")

    def capture(self, url: str, path: Path, *, expect: list[str], timeout: float = 45.0,
                full_page: bool = True, max_height: int = 4000) -> Path:
        """Load `url`, wait for it, and save a PNG of the whole content to `path`."""
        self._viewport(self.height)
        self.call("Page.navigate", url=url)
        if self.token is not None:
            self.log_in(self.token, expect, timeout)
        self.wait_ready(expect, timeout)
        return self.snapshot(path, expect=expect, timeout=timeout, full_page=full_page, max_height=max_height)

    def log_in(self, token: str, expect: list[str], timeout: float = 45.0) -> None:
        """Type `token` into the console's login form once it shows (done at once if the page shows
        `expect` instead), submit it, and wait until the form is gone."""
        deadline = time.monotonic() + timeout
        while not self.evaluate(f"!!{_LOGIN_FORM_JS}"):
            if self.evaluate(_READY_JS % json.dumps(expect)) == "ready" or time.monotonic() > deadline:
                return
            time.sleep(0.2)
        self.evaluate(f"{_LOGIN_FORM_JS}.focus()")
        self.call("Input.insertText", text=token)
        self.evaluate("[...document.querySelectorAll('button')].find(b => b.innerText.trim().endsWith('Log in')).click()")
        while self.evaluate(f"!!{_LOGIN_FORM_JS}"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"still on the login page after {timeout:.0f} s: "
                                   f"{str(self.evaluate('document.body.innerText'))[:300]}")
            time.sleep(0.2)

    def snapshot(self, path: Path, *, expect: list[str], timeout: float = 45.0, full_page: bool = True,
                 max_height: int = 4000) -> Path:
        """Save a PNG of the page as it is now (after `expect` is on it), grown to its full height."""
        self.wait_ready(expect, timeout, settle=0.5)
        if full_page:
            height = int(self.evaluate(_HEIGHT_JS) or self.height)
            self._viewport(min(max(height, self.height), max_height))
            self.wait_ready(expect, timeout, settle=1.0)
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path


def send_chat(browser: Chromium, text: str, timeout: float = 60.0) -> str:
    """On the Playground page: type `text`, press Send, wait for the answer; returns its trace id."""
    browser.evaluate("(b => { b.focus(); b.select(); })(document.querySelector('[data-testid=\"stMain\"] "
                     "textarea[aria-label=\"Message\"]') || document.querySelector('[data-testid=\"stMain\"] "
                     "textarea'))")  # selected: the text typed replaces any there
    browser.call("Input.insertText", text=text)
    browser.evaluate("document.activeElement.blur()")
    time.sleep(0.8)  # Streamlit commits a text area on blur, with a rerun
    browser.evaluate("[...document.querySelectorAll('button')].find(b => b.innerText.trim().endsWith('Send')).click()")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = browser.evaluate("(document.body.innerText.match(/Open trace ([0-9a-f]{32})/) || [])[1] || ''")
        if found:
            return str(found)
        time.sleep(0.3)
    raise TimeoutError("the Playground showed no trace link")


def click_label(browser: Chromium, text: str, timeout: float = 30.0) -> None:
    """Click the label whose text is `text` (a radio option, a checkbox) once it is on the page, and let
    Streamlit rerun."""
    js = (f"(() => {{ const l = [...document.querySelectorAll('label')]"
          f".find(l => l.innerText.trim() === {json.dumps(text)}); if (l) l.click(); return !!l; }})()")
    deadline = time.monotonic() + timeout
    while not browser.evaluate(js):
        if time.monotonic() > deadline:
            raise LookupError(f"no label {text!r} on the page after {timeout:.0f} s")
        time.sleep(0.3)
    time.sleep(1.0)


def capture_pages(base_url: str, out: Path, pages: list[str], *, width: int = 1440,
                  query: dict[str, dict[str, str]] | None = None, expect: dict[str, list[str]] | None = None,
                  token: str | None = None) -> list[Path]:
    """Screenshot each page (url path) of the console at `base_url` to ``out/console-<page>.png``,
    logging in with `token` (the admin token) where the console asks."""
    written = []
    with Chromium(width=width, token=token) as browser:
        for page in pages:
            suffix = ("?" + "&".join(f"{k}={v}" for k, v in (query or {}).get(page, {}).items())
                      if query and page in query else "")
            wanted = [PAGES.get(page, page), *(LIVE_MARK if page in LIVE_PAGES else []),
                      *((expect or {}).get(page, []))]
            path = "" if page == DEFAULT_PAGE else page  # the default page lives at the root
            written.append(browser.capture(f"{base_url.rstrip('/')}/{path}{suffix}", out / f"console-{page}.png",
                                           expect=wanted))
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m admin_ui.screenshot", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8501", help="the running console")
    parser.add_argument("--out", default="docs/img", help="folder for console-<page>.png")
    parser.add_argument("--pages", default=",".join(PAGES), help="comma-separated url paths")
    parser.add_argument("--width", type=int, default=1440)
    parser.add_argument("--credentials-file", default=None,
                        help="where the admin token is when SWITCHBOARD_ADMIN_TOKEN is unset (default: as the console)")
    args = parser.parse_args(argv)
    from admin_ui.settings import ConsoleSettings

    settings = ConsoleSettings(**({"credentials_file": args.credentials_file} if args.credentials_file else {}))
    token = settings.admin_token_value()
    if token is None:
        raise SystemExit("python -m admin_ui.screenshot: no admin token to log in with: set SWITCHBOARD_ADMIN_TOKEN "
                         "or pass --credentials-file")
    for path in capture_pages(args.url, Path(args.out), [p for p in args.pages.split(",") if p], width=args.width,
                              token=token):
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
