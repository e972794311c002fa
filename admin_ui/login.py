"""The console's login: no page renders, and no admin call is made, for a browser session that has
not shown the admin token.

    if not login.gate(c):          # app.py, before any page: spends a ?token= link, ends stale logins
        login.form(c)              # the password field: wrong token -> error, and a growing wait
        return
    login.logout_button()          # in the sidebar

Why: the console holds the admin token itself (SWITCHBOARD_ADMIN_TOKEN, or ``admin_token`` in the
credentials file of ``switchboard up``) and steers the cluster with it. Before this gate, whoever
opened its port steered the cluster: any local user of a shared machine (loopback is open to
them all), anyone on the network of a console started with ``--host 0.0.0.0``.

Two ways in:

- **The admin token**, pasted in a password field, compared (``hmac.compare_digest``) with the one
  the console reads (re-read on every run: a rotated token is heard at once).
- **A one-time login link** ``http://host:port/?token=CODE``, as Jupyter prints one: ``switchboard
  console`` and ``switchboard up`` (in its banner) print it, on a terminal only (``up`` otherwise writes
  it to ``STATE/console_login``, mode 600: control_plane/up_banner.py). CODE is not the admin
  token but a random code minted per start and handed to Streamlit in the environment (never in
  argv, so never in ``ps``); it logs one browser session in *once*, and the console takes it out of
  the address bar at once. A link left in scrollback or in the browser's history is worth nothing
  after its first use, and a second use is refused and logged (somebody else used it first: the
  operator's own click fails, and the log says from where). It lasts until used or until the
  console process restarts.

A session stays logged in for its lifetime (``st.session_state``: a reload or a new tab is a new
session and asks again), at most ``--session-ttl-s``, and is logged out when the admin token the
console reads changes. Failed attempts are refused with a wait that doubles per failure in the
session (1 s, 2 s, 4 s ... 60 s), and at most MAX_FAILURES failures per WINDOW_S are compared in the
whole process (a fresh session resets nothing). Each failure is logged with its count, session and
client address; a token or code never is.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import streamlit as st
from streamlit.logger import get_logger
from streamlit.runtime.scriptrunner import get_script_run_ctx

from admin_ui.settings import ENV_ADMIN_TOKEN, ConsoleSettings

log = get_logger("switchboard.console.login")

TOKEN_PARAM = "token"
"""The query parameter of the login link."""
SESSION_KEY = "_login"
FAILURES_KEY = "_login_failures"
NOTICE_KEY = "_login_notice"
FIRST_WAIT_S = 1.0
"""The wait after a session's first failure; each further failure doubles it..."""
MAX_WAIT_S = 60.0
"""...up to this."""
WINDOW_S = 60.0
MAX_FAILURES = 10
"""Failures compared per WINDOW_S across all sessions; beyond, every attempt waits for the window."""


class HasSettings(Protocol):
    @property
    def settings(self) -> ConsoleSettings: ...


@dataclass
class Gate:
    """What every session of this console process shares: recent failures, spent login codes."""

    key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    """Keys the fingerprints kept in session state (so no session holds a token, or a hash of one
    that could be tried offline)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    recent: deque[float] = field(default_factory=deque)
    failures: int = 0
    spent: set[str] = field(default_factory=set)
    clock: Callable[[], float] = time.monotonic
    """What the waits are measured on (a test moves a fake one: on a loaded machine a page run took longer
    than the 1 s wait it checked, and read "try again in 0 s")."""

    def fingerprint(self, secret: str) -> str:
        return hmac.new(self.key, secret.encode(), hashlib.sha256).hexdigest()

    def blocked_for(self, now: float) -> float:
        """Seconds until the process-wide window admits another attempt (0: now)."""
        with self.lock:
            while self.recent and now - self.recent[0] >= WINDOW_S:
                self.recent.popleft()
            return WINDOW_S - (now - self.recent[0]) if len(self.recent) >= MAX_FAILURES else 0.0

    def fail(self, now: float) -> int:
        with self.lock:
            self.recent.append(now)
            self.failures += 1
            return self.failures

    def spend(self, code: str) -> bool:
        """True the first time `code` is spent, False ever after."""
        with self.lock:
            mark = self.fingerprint(code)
            if mark in self.spent:
                return False
            self.spent.add(mark)
            return True


GATE = Gate()


def _session_id() -> str:
    ctx = get_script_run_ctx()
    return ctx.session_id[:8] if ctx is not None else "-"


def _client() -> str:
    try:
        ip = st.context.ip_address
    except Exception:  # noqa: BLE001 (no request context, e.g. a bare script run)
        return "-"
    return ip if isinstance(ip, str) and ip else "-"


def logged_in(c: HasSettings) -> bool:
    """Whether this session has logged in, with the admin token the console reads now, within the TTL."""
    login = st.session_state.get(SESSION_KEY)
    if not login:
        return False
    token = c.settings.admin_token_value()
    if token is None or not hmac.compare_digest(login["fp"], GATE.fingerprint(token)):
        _end("the admin token changed: log in with the new one", "the admin token changed")
        return False
    if time.time() - login["at"] > c.settings.session_ttl_s:
        _end("the session expired: log in again", "the session expired")
        return False
    return True


def gate(c: HasSettings) -> bool:
    """Spend a login link in the URL (and take it out of the address bar), then say whether this
    session may see the console."""
    code = st.query_params.get(TOKEN_PARAM)
    if code is not None:
        del st.query_params[TOKEN_PARAM]  # out of the address bar at once, spent or not
        if not logged_in(c):
            _use_link(c, code)
    return logged_in(c)


def _use_link(c: HasSettings, code: str) -> None:
    wait = _wait_left()
    if wait > 0:
        _notice(f"Too many failed logins: try again in {wait:.0f} s.")
        return
    expected = c.settings.login_code.get_secret_value() if c.settings.login_code is not None else ""
    token = c.settings.admin_token_value()
    if not (expected and hmac.compare_digest(code.encode(), expected.encode())):
        _failure("a wrong login link")
        _notice("This login link is not this console's (it restarted since, or the link is mistyped). "
                "Log in with the admin token.")
    elif not GATE.spend(code):
        _failure("a login link used before")
        _notice("This login link was already used (a link logs in once). Log in with the admin token.")
    elif token is not None:
        _start(token, "the login link")


def form(c: HasSettings) -> None:
    """The login page: the only thing a session that has not logged in sees."""
    notice = st.session_state.pop(NOTICE_KEY, None)
    token = c.settings.admin_token_value()
    _, middle, _ = st.columns([1, 1.4, 1])
    with middle:
        st.title(":material/hub: Switchboard console")
        if token is None:
            st.error(f"**This console has no admin token**, so nobody can log in: {ENV_ADMIN_TOKEN} is unset and "
                     f"`{c.settings.credentials_file}` holds none. Set {ENV_ADMIN_TOKEN}, or point "
                     f"`--credentials-file` at the file `switchboard up` wrote, and restart the console.",
                     icon=":material/lock:")
            return
        with st.form("login", clear_on_submit=True, enter_to_submit=True):
            given = st.text_input("Admin token", type="password", key="login-token", placeholder="sb-admin-…",
                                  help="The control plane's admin token: `switchboard up` prints it on the run "
                                       "that makes it, and keeps it as `admin_token` in its credentials.json.")
            submitted = st.form_submit_button("Log in", key="login-submit", type="primary", icon=":material/login:")
        if submitted:
            notice = _try_token(given, token) or notice
        if notice:
            st.error(notice, icon=":material/lock:")
        st.caption("Or open the one-time login link that `switchboard up` or `switchboard console` printed.")


def _try_token(given: str, token: str) -> str | None:
    """Log in with `given` (and rerun into the console), or say why not."""
    wait = _wait_left()
    if wait > 0:
        return f"Too many failed logins: try again in {wait:.0f} s."
    if given.strip() and hmac.compare_digest(given.strip().encode(), token.encode()):
        _start(token, "the admin token")
        st.rerun()
    n = _failure("a wrong admin token" if given.strip() else "an empty admin token")
    return f"Wrong admin token. The next try is taken in {_delay(n):.0f} s."


def _delay(n: int) -> float:
    return min(FIRST_WAIT_S * 2 ** (n - 1), MAX_WAIT_S)


def _wait_left() -> float:
    now = GATE.clock()
    _, until = st.session_state.get(FAILURES_KEY, (0, 0.0))
    return max(until - now, GATE.blocked_for(now))


def _failure(what: str) -> int:
    now = GATE.clock()
    n = st.session_state.get(FAILURES_KEY, (0, 0.0))[0] + 1
    st.session_state[FAILURES_KEY] = (n, now + _delay(n))
    total = GATE.fail(now)
    log.warning("console login refused: %s (session %s, client %s; failure %d of this session, %d of this "
                "console)", what, _session_id(), _client(), n, total)
    return n


def _start(token: str, how: str) -> None:
    st.session_state[SESSION_KEY] = {"fp": GATE.fingerprint(token), "at": time.time()}
    st.session_state.pop(FAILURES_KEY, None)
    log.info("console login: session %s, client %s, with %s", _session_id(), _client(), how)


def _end(notice: str | None, why: str) -> None:
    st.session_state.pop(SESSION_KEY, None)
    if notice:
        _notice(notice)
    log.info("console logout: session %s, client %s (%s)", _session_id(), _client(), why)


def _notice(text: str) -> None:
    st.session_state[NOTICE_KEY] = text


def logout_button() -> None:
    """The sidebar's "Log out": this session only."""
    if st.button("Log out", icon=":material/logout:", key="logout", width="stretch"):
        _end("You logged out.", "logged out")
        st.rerun()

