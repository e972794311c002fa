"""The console's login in a real browser: `switchboard console` run as an operator runs it (on a
terminal, so it prints its one-time login link), headless Chromium over the DevTools protocol.

Screenshots of the login page and of a page after the link logged in go to a temporary folder, or
to ``docs/img/`` with ``SWITCHBOARD_UPDATE_SCREENSHOTS=1``.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from admin_ui.screenshot import Chromium, find_chromium

pytestmark = pytest.mark.skipif(find_chromium() is None, reason="no chromium binary (apt-get install chromium)")
pytest.importorskip("websocket", reason="needs websocket-client")
pytest.importorskip("streamlit")

from tests.support.cluster import ADMIN_TOKEN
from tests.support.procs import ROOT, free_port

DOCS_IMG = ROOT / "docs" / "img"
LINK = re.compile(r"(http://127\.0\.0\.1:\d+/\?token=([A-Za-z0-9_-]+))")
CLICK_LOGIN = "[...document.querySelectorAll('button')].find(b => b.innerText.trim().endsWith('Log in')).click()"


class TerminalConsole:
    """`python -m admin_ui.launch` (what `switchboard console` runs) with its output on a pseudo-terminal."""

    def __init__(self, cluster, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.credentials = tmp / "credentials.json"  # the token as `switchboard up` leaves it: rotatable
        self.credentials.write_text(json.dumps({"keys": {}, "admin_token": ADMIN_TOKEN}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
        self.args = [sys.executable, "-m", "admin_ui.launch", "--port", str(self.port), "--control-plane-url",
                     cluster.control_plane.url, "--gateway-url", cluster.gateway.url, "--credentials-file",
                     str(self.credentials), "--refresh", "1"]
        master, replica = pty.openpty()
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=replica, stderr=replica, cwd=ROOT,
                                     env=env)
        os.close(replica)
        self.output = b""
        self._reader = threading.Thread(target=self._read, args=(master,), daemon=True)
        self._reader.start()

    def _read(self, fd: int) -> None:
        while True:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            self.output += chunk
        os.close(fd)

    def text(self) -> str:
        return self.output.decode(errors="replace")

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.text()
            try:
                if httpx.get(self.url + "/_stcore/health", timeout=1).text == "ok":
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.text())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def terminal_console(cluster, tmp_path_factory) -> Iterator[TerminalConsole]:
    console = TerminalConsole(cluster, tmp_path_factory.mktemp("console"))
    try:
        console.wait_ready()
        yield console
    finally:
        console.stop()


def shots(tmp_path: Path) -> Path:
    return DOCS_IMG if os.environ.get("SWITCHBOARD_UPDATE_SCREENSHOTS") == "1" else tmp_path / "img"


def main_text(browser: Chromium) -> str:
    return str(browser.evaluate("document.body.innerText"))


def test_the_console_shows_only_its_login_form_and_refuses_a_wrong_token(terminal_console, tmp_path):
    with Chromium() as browser:
        path = browser.capture(terminal_console.url + "/cluster", shots(tmp_path) / "console-login.png",
                               expect=["Switchboard console", "Admin token"])
        shown = main_text(browser)
        for word in ("shard-0", "Members", "Drain", "Control plane", "Auto-refresh", "Overview", "Degradation"):
            assert word not in shown, (word, shown)
        assert browser.evaluate("document.querySelectorAll('input[type=password]').length") == 1
        assert browser.evaluate("document.querySelectorAll('[data-testid=stSidebar]').length") == 0

        browser.evaluate("document.querySelector('input[type=password]').focus()")
        browser.call("Input.insertText", text="sb-admin-not-it")
        browser.evaluate(CLICK_LOGIN)
        browser.wait_ready(["Wrong admin token"], timeout=20, settle=0.3)
        assert "shard-0" not in main_text(browser)

        time.sleep(1.2)  # the first failure's wait
        browser.log_in(ADMIN_TOKEN, ["Cluster", "shard-0"], timeout=30)  # as the screenshot tool logs in
        browser.wait_ready(["Cluster", "shard-0", "Updated "], timeout=30)  # the deep link's page, after the login
        assert "Log out" in main_text(browser)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_printed_login_link_logs_in_once_and_leaves_no_trace(terminal_console, tmp_path):
    found = LINK.search(terminal_console.text())
    assert found, terminal_console.text()
    link, code = found.groups()
    assert link.startswith(terminal_console.url + "/?token=")
    with Chromium() as browser:
        path = browser.capture(link.replace("/?", "/cluster?"), shots(tmp_path) / "console-after-login.png",
                               expect=["Cluster", "shard-0", "Updated "])
        href = browser.evaluate("location.href")
        assert "token" not in href and href.rstrip("/").endswith("/cluster"), href
        assert "Log out" in main_text(browser)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Chromium() as other:  # the same link again, in another browser: spent
        other.capture(link, tmp_path / "again.png", expect=["already used"])
        assert "shard-0" not in main_text(other)

    # the code and the admin token: never in argv (ps), never in what the console logged
    cmdline = Path(f"/proc/{terminal_console.proc.pid}/cmdline").read_bytes().decode()
    assert "streamlit" in cmdline and code not in cmdline and ADMIN_TOKEN not in cmdline
    logged = terminal_console.text().replace(link, "")  # the link itself: printed once, on the terminal
    assert code not in logged and ADMIN_TOKEN not in logged
    assert "a login link used before" in logged and "with the login link" in logged


def test_a_rotated_admin_token_logs_an_open_page_out_on_its_next_refresh(terminal_console, tmp_path):
    """No click, no reload: the page's live region re-runs every refresh and finds the token changed."""
    with Chromium(token=ADMIN_TOKEN) as browser:
        browser.capture(terminal_console.url + "/degradation", tmp_path / "before.png",
                        expect=["Degradation", "Updated "])
        try:
            terminal_console.credentials.write_text(json.dumps({"keys": {}, "admin_token": "sb-admin-rotated"}))
            browser.wait_ready(["Admin token", "the admin token changed"], timeout=30, settle=0.3)
            shown = main_text(browser)
            assert "Degradation" not in shown and "Log out" not in shown, shown
        finally:
            terminal_console.credentials.write_text(json.dumps({"keys": {}, "admin_token": ADMIN_TOKEN}))
    assert "console logout" in terminal_console.text() and "the admin token changed" in terminal_console.text()


def test_a_used_login_link_stays_spent_when_up_restarts_the_console(tmp_path):
    """`switchboard up` handed the console its code in the environment once, and its supervisor restarts a
    console that dies with that same environment: the restarted console had forgotten which codes were
    spent, and the link in the banner (the scrollback, the browser's history) logged anyone in again."""
    from tests.support.procs import start_up, stop_up, wait_up

    console = free_port()
    proc = start_up(tmp_path, "--engine", "synthetic", "--shards", "1", "--gateway-port", str(free_port()),
                    "--control-plane-port", str(free_port()), "--console-port", str(console))
    try:
        wait_up(proc, tmp_path)  # its stdout is a file: the link is in a mode-600 file, not in up.log
        found = LINK.search((tmp_path / ".switchboard" / "console_login").read_text())
        assert found, (tmp_path / "up.log").read_text()
        link = found.group(1)
        with Chromium() as browser:
            browser.capture(link, tmp_path / "first.png", expect=["Overview", "Updated "])
        table = tmp_path / ".switchboard" / "processes.json"

        def console_pid() -> int | None:
            rows = json.loads(table.read_text())["processes"]
            return next((r.get("pid") for r in rows if r["name"] == "console" and r.get("running")), None)

        first = console_pid()
        assert first
        os.kill(first, 9)
        deadline = time.monotonic() + 60
        while not ((pid := console_pid()) and pid != first and _healthy(f"http://127.0.0.1:{console}")):
            assert time.monotonic() < deadline, table.read_text()
            time.sleep(0.3)
        with Chromium() as browser:
            browser.call("Page.navigate", url=link)
            deadline = time.monotonic() + 45
            while not any(w in (shown := main_text(browser)) for w in ("Admin token", "Log out")):
                assert time.monotonic() < deadline, shown
                time.sleep(0.3)
            assert "Admin token" in shown and "Log out" not in shown, shown  # the login form, not the console
        # and the restarted console's own link reached the operator where the first one did (it was told none)
        fresh = LINK.search((tmp_path / ".switchboard" / "console_login").read_text())
        assert fresh and fresh.group(1) != link, (tmp_path / "up.log").read_text()
        assert fresh.group(2) not in (tmp_path / "up.log").read_text()
        with Chromium() as browser:
            browser.capture(fresh.group(1), tmp_path / "relinked.png", expect=["Overview", "Updated "])
    finally:
        stop_up(proc)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/_stcore/health", timeout=1).text == "ok"
    except httpx.HTTPError:
        return False
