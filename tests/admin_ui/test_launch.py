"""`switchboard console` runs Streamlit on loopback with our flags; the token stays out of argv."""

from __future__ import annotations

import time
from pathlib import Path

from admin_ui import launch
from admin_ui.settings import ConsoleSettings


def test_command_runs_streamlit_headless_on_loopback(monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", "secret-token")
    cmd = launch.command(["--port", "8502", "--control-plane-url", "http://127.0.0.1:9300"])
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4].endswith("admin_ui/app.py")
    flags = dict(zip(cmd[5::2], cmd[6::2]))
    assert flags["--server.port"] == "8502" and flags["--server.address"] == "127.0.0.1"
    assert flags["--server.headless"] == "true" and flags["--browser.gatherUsageStats"] == "false"
    assert cmd[cmd.index("--") + 1:] == ["--control-plane-url", "http://127.0.0.1:9300"]
    assert "secret-token" not in " ".join(cmd)


def test_settings_read_flags_then_env_then_credentials(monkeypatch, tmp_path):
    creds = tmp_path / "credentials.json"
    creds.write_text('{"admin_token": "from-file", "keys": {"plus": "sk-plus"}}')
    monkeypatch.delenv("SWITCHBOARD_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("SWITCHBOARD_CONTROL_PLANE_URL", "http://env:1")
    s = ConsoleSettings.from_argv(["--credentials-file", str(creds)])
    assert s.control_plane_url == "http://env:1" and s.admin_token_value() == "from-file"
    assert s.dev_keys() == {"plus": "sk-plus"}
    assert ConsoleSettings.from_argv(["--control-plane-url", "http://flag:2"]).control_plane_url == "http://flag:2"
    monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", "from-env")
    assert ConsoleSettings.from_argv(["--credentials-file", str(creds)]).admin_token_value() == "from-env"


def test_the_playground_offers_only_the_dev_keys_the_live_keys_file_still_lists(tmp_path):
    """A dev key revoked from the keys file (`switchboard keys revoke`) was offered until the next `up`
    rewrote credentials.json; the console now reads the keys file on every page run."""
    from data_plane.gateway.auth import key_digest

    creds = tmp_path / "credentials.json"
    creds.write_text('{"keys": {"free": "sk-free", "plus": "sk-plus", "enterprise": "sk-ent"}}')
    keys_file = tmp_path / "keys.yaml"

    def write(entries: list[tuple[str, str]]) -> None:
        keys_file.write_text("keys:\n" + "".join(f"  - {{key_sha256: {key_digest(k)}, tenant: dev, tier: {t}}}\n"
                                                 for k, t in entries))

    write([("sk-free", "free"), ("sk-plus", "plus"), ("sk-ent", "free")])  # sk-ent now names another tier
    s = ConsoleSettings.from_argv(["--credentials-file", str(creds), "--keys-file", str(keys_file)])
    assert s.dev_keys() == {"free": "sk-free", "plus": "sk-plus"}
    write([("sk-plus", "plus")])  # free revoked: the same settings object sees it at once
    assert s.dev_keys() == {"plus": "sk-plus"}
    keys_file.write_text("keys: [")  # half-written or broken: offer nothing rather than a key it may refuse
    assert s.dev_keys() == {}
    cmd = launch.command(["--credentials-file", str(creds), "--keys-file", str(keys_file)])
    assert cmd[cmd.index("--") + 1:] == ["--credentials-file", str(creds), "--keys-file", str(keys_file)]


def test_the_playground_page_lists_a_revoked_dev_key_no_more(monkeypatch, tmp_path):
    """The page itself (AppTest): after a revocation its "Send as" choices lose the key on the next run,
    and each choice shows the key id (the digest prefix logs show), never the start of the key."""
    import pytest

    pytest.importorskip("streamlit")
    from data_plane.gateway.auth import key_digest
    from tests.support.console import ConsoleRunner

    runner = ConsoleRunner(monkeypatch, tmp_path)
    keys = {"free": "sk-sb-free-0123456789", "plus": "sk-sb-plus-0123456789"}
    runner.point_at("http://127.0.0.1:9", keys=keys)
    keys_file = tmp_path / "keys.yaml"
    monkeypatch.setenv("SWITCHBOARD_CONSOLE_KEYS_FILE", str(keys_file))
    keys_file.write_text("keys:\n" + "".join(f"  - {{key_sha256: {key_digest(k)}, tenant: dev, tier: {t}}}\n"
                                             for t, k in keys.items()))
    at = runner.page("playground")
    send_as = at.selectbox(key="pg_tier")
    assert send_as.options == [f"free tier  (key id {key_digest(keys['free'])[:12]})",
                               f"plus tier  (key id {key_digest(keys['plus'])[:12]})", "custom key…"]
    keys_file.write_text(f"keys:\n  - {{key_sha256: {key_digest(keys['plus'])}, tenant: dev, tier: plus}}\n")
    at.run()
    assert at.selectbox(key="pg_tier").options == [f"plus tier  (key id {key_digest(keys['plus'])[:12]})",
                                                   "custom key…"]
    assert not any("sk-sb-" in option for option in at.selectbox(key="pg_tier").options)


def test_only_loopback_or_tls_is_served_unless_told_and_then_warned():
    """`--host 0.0.0.0` served the console (and, with the login, the admin token typed into it) over
    plain HTTP to the whole network, without a word."""
    import pytest

    from data_plane.common.tls import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "192.0.2.7", "no-such-host.invalid"))
    assert launch.exposure(ConsoleSettings(host="127.0.0.1"), tls=False) is None
    assert launch.exposure(ConsoleSettings(host="0.0.0.0"), tls=True) is None
    with pytest.raises(SystemExit, match="not a loopback address.*--allow-insecure-http"):
        launch.exposure(ConsoleSettings(host="0.0.0.0"), tls=False)
    warning = launch.exposure(ConsoleSettings(host="0.0.0.0", allow_insecure_http=True), tls=False)
    assert warning and warning.startswith("WARNING") and "clear text" in warning
    assert launch.login_url(ConsoleSettings(host="0.0.0.0", port=8502), "abc", tls=True) == \
        "https://127.0.0.1:8502/?token=abc"
    assert launch.login_url(ConsoleSettings(host="::1"), "abc", tls=False) == "http://[::1]:8501/?token=abc"


def test_switchboard_console_on_a_network_address_without_tls_refuses_to_start():
    from tests.support.procs import free_port, switchboard

    out = switchboard("console", "--host", "0.0.0.0", "--port", str(free_port()), timeout=60)
    assert out.returncode != 0 and "not a loopback address" in out.stderr, out
    assert "streamlit" not in out.stdout.lower()


def test_off_a_terminal_no_login_link_is_printed_and_the_code_is_not_in_argv(tmp_path):
    """The link is a live login until used: printed to a terminal only (never to a log), and the code
    reaches Streamlit in the environment."""
    import os
    import subprocess
    import sys

    from tests.support.procs import ROOT, free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    proc = subprocess.Popen([sys.executable, "-m", "admin_ui.launch", "--port", str(free_port()), "--host", "0.0.0.0",
                             "--allow-insecure-http", "--credentials-file", str(tmp_path / "none.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stderr.readline().startswith("WARNING: switchboard console: serving on 0.0.0.0 over plain HTTP")
        first = proc.stdout.readline()
        assert "log in with the admin token" in first and "token=" not in first
        for _ in range(200):  # once it is Streamlit, its environment holds a code and its argv does not
            if b"streamlit" in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
                break
            time.sleep(0.05)
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        code = dict(v.split(b"=", 1) for v in environ.split(b"\0") if b"=" in v)[b"SWITCHBOARD_CONSOLE_LOGIN_CODE"]
        assert len(code) >= 40 and code not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    finally:
        proc.terminate()
        proc.wait(15)
