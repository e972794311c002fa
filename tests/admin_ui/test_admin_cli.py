"""`switchboard admin` (admin_ui/cli.py) against the package's real cluster: the runbook's actions
from a shell, and one clear line with exit code 1 for each way they can fail."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from admin_ui.cli import format_decisions, main
from tests.support.cluster import ADMIN_TOKEN
from tests.support.procs import ROOT, free_port, switchboard


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)  # what the interpreter prints for it
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, cluster, tmp_path):
    monkeypatch.setenv("SWITCHBOARD_CONTROL_PLANE_URL", cluster.control_plane.url)
    monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("SWITCHBOARD_CREDENTIALS_FILE", str(tmp_path / "credentials.json"))
    return cluster


def test_status_drain_undrain_and_a_pin(env, admin, capsys) -> None:
    code, out, _ = run(capsys, "status")
    assert code == 0 and "shards    2/2 passing" in out and "level     L" in out and "shard-0" in out
    shard = env.shards[0]
    member = next(m["id"] for m in admin.get("/admin/v1/members").json()["members"] if m["url"] == shard.url)
    try:
        code, out, err = run(capsys, "drain", member)
        assert (code, out.strip()) == (0, f"{member}: draining")
        assert "comes back undrained" in err and "kill -9 keeps the drain" in err  # when it ends by itself
        assert next(m for m in admin.get("/admin/v1/members").json()["members"] if m["id"] == member)["draining"]
        code, out, _ = run(capsys, "status")
        assert "shards    1/2 passing (1 draining)" in out
    finally:
        code, out, _ = run(capsys, "undrain", member)
    assert (code, out.strip()) == (0, f"{member}: passing")
    try:
        code, out, _ = run(capsys, "degrade", "2", "--reason", "cli drill", "--json")
        assert code == 0 and json.loads(out)["pinned"] and admin.get("/admin/v1/degradation").json()["level"] == 2
    finally:
        code, out, _ = run(capsys, "degrade", "--release")
    assert code == 0 and "automatic" in out and not admin.get("/admin/v1/degradation").json()["pinned"]


def test_failures_are_one_line_and_exit_1(env, monkeypatch, capsys) -> None:
    code, _, err = run(capsys, "drain", "no-such-member")
    assert code == 1 and "answered 404: no member 'no-such-member'" in err
    monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", "not-the-token")
    code, _, err = run(capsys, "members")
    assert code == 1 and "refused the admin token" in err and "from SWITCHBOARD_ADMIN_TOKEN" in err
    code, _, err = run(capsys, "status", "--control-plane-url", f"http://127.0.0.1:{free_port()}")
    assert code == 1 and "cannot reach the control plane" in err and "--control-plane-url" in err
    code, _, err = run(capsys, "degrade", "3")  # a pin without a reason is a usage error
    assert code == 2 and "needs --reason" in err
    assert "usage: switchboard admin degrade" in err  # the subcommand's usage, not `admin COMMAND ...`
    code, _, err = run(capsys, "degrade")
    assert code == 2 and "takes a LEVEL" in err and "usage: switchboard admin degrade" in err


def test_it_is_a_switchboard_subcommand() -> None:
    shown = switchboard("admin", "--help", timeout=60)
    assert shown.returncode == 0 and "usage: switchboard admin" in shown.stdout
    assert "admin" in switchboard("--help", timeout=60).stdout


def test_a_bad_timeout_and_a_missing_credentials_file_are_one_line(env, monkeypatch, tmp_path) -> None:
    bad = switchboard("admin", "status", "--timeout-s", "-1", timeout=60)  # reached httpx's socket: a traceback
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--timeout-s: must be more than 0 seconds, got -1" in bad.stderr
    monkeypatch.delenv("SWITCHBOARD_ADMIN_TOKEN")
    monkeypatch.delenv("SWITCHBOARD_CREDENTIALS_FILE")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # run from elsewhere, this tree's code still
    elsewhere = switchboard("admin", "status", timeout=60, cwd=tmp_path)  # not where `switchboard up` ran
    assert elsewhere.returncode == 1 and "Traceback" not in elsewhere.stderr
    assert f"there is no {tmp_path / '.switchboard' / 'credentials.json'}" in elsewhere.stderr


def test_the_token_is_found_in_ups_state_dir_as_switchboard_keys_finds_its_keys(env, monkeypatch, tmp_path) -> None:
    """After `switchboard up --state-dir D`, `SWITCHBOARD_UP_STATE_DIR=D switchboard keys ...` edited D's keys
    file while `switchboard admin` still looked for ./.switchboard/credentials.json and was refused."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "credentials.json").write_text(json.dumps({"keys": {}, "admin_token": ADMIN_TOKEN}))
    monkeypatch.delenv("SWITCHBOARD_ADMIN_TOKEN")
    monkeypatch.delenv("SWITCHBOARD_CREDENTIALS_FILE")
    monkeypatch.setenv("SWITCHBOARD_UP_STATE_DIR", str(state))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    ran = switchboard("admin", "status", timeout=60, cwd=tmp_path)  # not where `switchboard up` ran
    assert ran.returncode == 0 and "shards    2/2 passing" in ran.stdout, ran.stderr


def test_the_control_plane_url_is_found_in_ups_credentials_file(env, monkeypatch, tmp_path) -> None:
    """`up --control-plane-port P` records where it serves beside the admin token; `switchboard admin` run
    with nothing else set found the token there but still called port 8300 (the soak's operator)."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "credentials.json").write_text(json.dumps({"keys": {}, "admin_token": ADMIN_TOKEN}))
    from control_plane.dev_credentials import record_urls

    record_urls(state, control_plane_url=env.control_plane.url, gateway_url="http://127.0.0.1:1")
    assert json.loads((state / "credentials.json").read_text())["admin_token"] == ADMIN_TOKEN  # kept
    for name in ("SWITCHBOARD_ADMIN_TOKEN", "SWITCHBOARD_CREDENTIALS_FILE", "SWITCHBOARD_CONTROL_PLANE_URL"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("SWITCHBOARD_UP_STATE_DIR", str(state))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    ran = switchboard("admin", "status", timeout=60, cwd=tmp_path)
    assert ran.returncode == 0 and "shards    2/2 passing" in ran.stdout, ran.stderr
    # a URL given still wins over the file's
    ran = switchboard("admin", "status", "--control-plane-url", f"http://127.0.0.1:{free_port()}", timeout=60,
                      cwd=tmp_path)
    assert ran.returncode == 1 and "check --control-plane-url" in ran.stderr, ran.stderr


def test_an_admin_token_from_the_environment_never_goes_to_a_url_a_file_named(tmp_path, monkeypatch) -> None:
    """A credentials.json in the working folder named a control_plane_url, and the operator's own
    SWITCHBOARD_ADMIN_TOKEN went there (a folder someone else wrote points the token at their host).
    The file's URL is used with the file's token only."""
    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / ".switchboard").mkdir()
        (tmp_path / ".switchboard" / "credentials.json").write_text(
            json.dumps({"control_plane_url": f"http://127.0.0.1:{server.server_port}"}))
        monkeypatch.chdir(tmp_path)
        for name in ("SWITCHBOARD_UP_STATE_DIR", "SWITCHBOARD_CONTROL_PLANE_URL", "SWITCHBOARD_CREDENTIALS_FILE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", "sb-admin-OPERATORS-OWN")
        with pytest.raises(SystemExit) as exited:
            main(["status", "--timeout-s", "2"])
    finally:
        server.shutdown()
    assert seen == [], seen
    # and it says why it did not go there: the operator ran `up --control-plane-port P` and sees "cannot reach
    # 127.0.0.1:8300" with the token they exported
    assert f"SWITCHBOARD_ADMIN_TOKEN is set, so the control plane http://127.0.0.1:{server.server_port} that " in str(
        exited.value.code)


def test_output_into_a_closed_pipe_is_no_traceback(env) -> None:
    """`switchboard admin members | head -1`: the reader leaves before the writer ends."""
    read, write = os.pipe()
    os.close(read)
    try:
        ran = subprocess.run([sys.executable, "-m", "control_plane.cli", "admin", "members"], cwd=ROOT, stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    finally:
        os.close(write)
    assert ran.returncode == 1 and ran.stderr == ""


def test_decisions_show_the_autoscalers_reasons_from_a_shell(env, capsys) -> None:
    """Found running `switchboard up --autoscale`: the decision log was only on the console's Autoscaler
    page and raw GET /admin/v1/decisions; `switchboard admin` had no way to ask why it scaled."""
    code, out, _ = run(capsys, "decisions")
    assert code == 0 and "no autoscaler" in out  # the package's cluster runs without one
    body = {"autoscaler": True, "decisions": [
        {"at": 100.0, "last_at": 100.0, "repeats": 1, "action": "scale_up", "code": "bounds", "from": 0, "to": 1,
         "reason": "below min_replicas (0 < 1)", "outcome": "started 1"},
        {"at": 105.0, "last_at": 160.0, "repeats": 12, "action": "steady", "code": "steady", "from": 1, "to": 1,
         "reason": "within band: waiting/shard 0.0", "outcome": "-"},
        {"at": 161.0, "last_at": 161.0, "repeats": 1, "action": "scale_up", "code": "queue_time", "from": 1, "to": 3,
         "reason": "queue time p95 above target: queue p95 4.77s (target 1s)", "outcome": "started 2"},
        {"at": 166.0, "last_at": 181.0, "repeats": 4, "action": "hold", "code": "at_max", "from": 3, "to": 3,
         "reason": "queue time p95 above target; at max_replicas (3)", "outcome": "-"},
    ]}
    lines = format_decisions(body).splitlines()
    assert lines[0].split() == ["TIME", "ACTION", "REPLICAS", "CODE", "OUTCOME", "REASON"]
    assert len(lines) == 4 and "within band" not in format_decisions(body)  # scalings and the latest tick
    assert "1 -> 3" in lines[2] and "queue p95 4.77s" in lines[2] and lines[3].rstrip().endswith("(3)")
    assert "x4" in lines[3] and "x12" in format_decisions(body, every_tick=True)
    assert format_decisions({"autoscaler": True, "decisions": []}) == "no decisions yet"
    code, _, err = run(capsys, "decisions", "--limit", "0")
    assert code == 2 and "1 to 1000" in err


def test_an_operator_reads_and_changes_a_tiers_limits_from_a_shell(env, admin, capsys) -> None:
    """Changing a tier's limits took a hand-written curl of the whole policy (or the console): the runbook's
    "raise the tier's limits" had no command. `tiers` shows the policy; `tiers TIER FIELD=VALUE` changes it."""
    before = admin.get("/admin/v1/tiers").json()
    code, out, _ = run(capsys, "tiers")
    assert code == 0 and out.splitlines()[0].split()[:4] == ["TIER", "PRIORITY", "RPM", "TPM"]
    free = before["tiers"]["free"]
    assert any(line.split()[:4] == ["free", str(free["priority"]), str(free["rpm"]), str(free["tpm"])]
               for line in out.splitlines())
    try:
        code, out, _ = run(capsys, "tiers", "free", "rpm=7", "tpm=7000", "--json")
        assert code == 0 and json.loads(out)["tiers"]["free"]["rpm"] == 7
        now = admin.get("/admin/v1/tiers").json()["tiers"]
        assert now["free"] == {**free, "rpm": 7, "tpm": 7000} and now["plus"] == before["tiers"]["plus"]
        code, _, err = run(capsys, "tiers", "gold", "rpm=1")
        assert code == 1 and "no tier 'gold'" in err
        code, _, err = run(capsys, "tiers", "free", "rpm=0")  # the control plane's own validation, one line
        assert code == 1 and "answered 400" in err and admin.get("/admin/v1/tiers").json()["tiers"]["free"]["rpm"] == 7
        with pytest.raises(SystemExit) as info:
            main(["tiers", "free", "rpm=many"])
        assert info.value.code == 2
    finally:
        assert admin.put("/admin/v1/tiers", json={"tiers": before["tiers"]}).status_code == 200
