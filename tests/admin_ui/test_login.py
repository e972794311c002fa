"""The console's login gate (admin_ui/login.py), run by Streamlit's AppTest against a real cluster.

Before it, every page rendered, with the cluster's data and its controls (drain, degrade, tiers,
keys), for whoever opened the console's port: no login at all.
"""

from __future__ import annotations

import logging
import time

import pytest
from streamlit.testing.v1 import AppTest

from admin_ui import login
from tests.support.clock import FakeClock
from tests.support.cluster import ADMIN_TOKEN
from tests.support.console import APP, PAGES, login_with, texts

CODE = "sb-login-code-for-tests-0123456789"


@pytest.fixture
def login_log():
    """The login's log records (its logger does not propagate to the root, so caplog misses it)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("switchboard.console.login")
    handler = Keep()
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def fresh(query: dict[str, str] | None = None) -> AppTest:
    """A new browser session on the console (AppTest: one session per instance), first run done."""
    at = AppTest.from_file(APP, default_timeout=30)
    for k, v in (query or {}).items():
        at.query_params[k] = v
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def on_login_page(at: AppTest) -> bool:
    return [w.key for w in at.text_input] == ["login-token"] and [b.key for b in at.button] == ["login-submit"]


def shows_nothing_of_the_cluster(at: AppTest) -> None:
    """Only the login form: no sidebar (navigation, control plane URL, toggles), no figures, no tables,
    no control but the login's, not a member's name."""
    shown = texts(at)
    assert on_login_page(at), shown
    assert not at.sidebar.children and not at.metric and not at.dataframe and not at.toggle and not at.selectbox
    assert not at.number_input and not at.text_area and not at.radio
    for word in ("shard-0", "Members", "Control plane", "passing", "127.0.0.1"):
        assert word not in shown, (word, shown)
    assert at.title[0].value == ":material/hub: Switchboard console"


@pytest.mark.parametrize("page", PAGES)
def test_without_a_login_every_page_is_the_login_form_only(console, page):
    at = console.page("overview", log_in=False)
    shows_nothing_of_the_cluster(at)
    if page != "overview":
        at.switch_page(f"screens/{page}.py").run()  # a deep link: /cluster, /degradation ...
        shows_nothing_of_the_cluster(at)


def test_a_wrong_token_is_refused_with_a_growing_wait_and_logged_without_the_token(console, login_log):
    """The waits run on a fake clock that only the test moves: on the real one, each check raced the time
    an AppTest run takes (a loaded machine's run after the first failure took over half its 1 s wait, and
    read "try again in 0 s"; one more and the right token was let in "too soon")."""
    clock = login.GATE.clock = FakeClock(1000.0)  # login.GATE is this test's own (tests/support/console.py)
    at = console.page("overview", log_in=False)
    login_with(at, "sb-admin-wrong-guess")
    shows_nothing_of_the_cluster(at)
    assert [e.value for e in at.error] == ["Wrong admin token. The next try is taken in 1 s."]
    login_with(at, ADMIN_TOKEN)  # the right one, too soon: not even compared
    shows_nothing_of_the_cluster(at)
    assert "try again in 1 s" in at.error[0].value
    clock.advance(1.1)
    login_with(at, "sb-admin-second-guess")
    assert "taken in 2 s" in at.error[0].value  # doubled
    clock.advance(1.1)
    login_with(at, ADMIN_TOKEN)
    assert "try again in 1 s" in at.error[0].value  # the second wait is not over yet
    clock.advance(1.0)
    login_with(at, ADMIN_TOKEN)
    assert not on_login_page(at) and at.title[0].value == "Overview"
    assert "Control plane" in texts(at)

    logged = [r.getMessage() for r in login_log]
    refused = [m for m in logged if "login refused" in m]
    assert len(refused) == 2 and "failure 1 of this session" in refused[0] and "failure 2 of this session" in refused[1]
    assert any("console login:" in m and "with the admin token" in m for m in logged)
    for secret in ("sb-admin-wrong-guess", "sb-admin-second-guess", ADMIN_TOKEN):
        assert not any(secret in m for m in logged)


def test_failures_in_fresh_sessions_still_count(console):
    """A new session (a reload, a script) starts its own wait at zero, but the whole console compares
    at most MAX_FAILURES failures a minute: then even the right token waits."""
    for _ in range(login.MAX_FAILURES):
        login_with(console.page("overview", log_in=False), "sb-admin-guess")
    at = login_with(console.page("overview", log_in=False), ADMIN_TOKEN)
    shows_nothing_of_the_cluster(at)
    assert "Too many failed logins" in at.error[0].value


def test_the_login_link_logs_in_once_and_leaves_the_address_bar(console, monkeypatch, login_log):
    monkeypatch.setenv("SWITCHBOARD_CONSOLE_LOGIN_CODE", CODE)
    at = fresh({"token": CODE})
    assert not on_login_page(at) and at.title[0].value == "Overview"
    assert "token" not in at.query_params  # taken out of the address bar
    at.switch_page("screens/cluster.py").run()
    assert "shard-0" in texts(at)

    again = fresh({"token": CODE})  # the same link, another browser: spent
    shows_nothing_of_the_cluster(again)
    assert "already used" in again.error[0].value and "token" not in again.query_params
    wrong = fresh({"token": "sb-admin-" + CODE})
    shows_nothing_of_the_cluster(wrong)
    assert "not this console's" in wrong.error[0].value

    logged = [r.getMessage() for r in login_log]
    assert any("with the login link" in m for m in logged)
    assert any("a login link used before" in m for m in logged) and any("a wrong login link" in m for m in logged)
    assert not any(CODE in m for m in logged)


def test_the_admin_token_is_no_login_link(console, monkeypatch):
    """?token= takes the one-time code only: the admin token itself does not belong in a URL."""
    monkeypatch.setenv("SWITCHBOARD_CONSOLE_LOGIN_CODE", CODE)
    at = fresh({"token": ADMIN_TOKEN})
    shows_nothing_of_the_cluster(at)
    assert "token" not in at.query_params


def test_logout_rotation_and_expiry_end_the_session(console, monkeypatch):
    at = console.page("cluster")
    assert "shard-0" in texts(at)
    at.button(key="logout").click().run()
    shows_nothing_of_the_cluster(at)
    assert "You logged out." in texts(at)

    login_with(at, ADMIN_TOKEN)
    assert "shard-0" in texts(at)
    monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", "sb-admin-rotated")  # the console now reads another token
    at.run()
    shows_nothing_of_the_cluster(at)
    assert "the admin token changed" in texts(at)

    monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", ADMIN_TOKEN)
    login_with(at, ADMIN_TOKEN)
    assert not on_login_page(at)
    at.session_state[login.SESSION_KEY] = {**at.session_state[login.SESSION_KEY], "at": time.time() - 13 * 3600}
    at.run()  # past the default 12 h
    shows_nothing_of_the_cluster(at)
    assert "the session expired" in texts(at)


def test_a_control_clicked_after_the_session_ended_does_nothing(console, admin):
    """A button's on_click callback (Drain, Pin level, Lift, ...) runs before the script, so before
    app.py's gate: a page left open past its login (expired, or the admin token rotated, with
    auto-refresh off) still drained a shard on the next click, and only then showed the login form."""
    at = console.page("cluster")
    assert at.button(key="drain-shard-0")
    at.session_state[login.SESSION_KEY] = {**at.session_state[login.SESSION_KEY], "at": time.time() - 13 * 3600}
    try:
        at.button(key="drain-shard-0").click().run()
        shows_nothing_of_the_cluster(at)
        member = next(m for m in admin.get("/admin/v1/members").json()["members"] if m["id"] == "shard-0")
        assert not member["draining"], member
    finally:
        admin.post("/admin/v1/members/shard-0/undrain")
