"""`switchboard up` end to end: starts everything, prints and saves credentials, answers a chat,
restarts a child that dies, and stops every child on SIGINT."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from control_plane.dev_credentials import key_id
from control_plane.launcher import UpSettings
from control_plane.up_banner import console_host, console_lines
from data_plane.gateway.auth import key_digest
from tests.support.procs import free_port, start_up, stop_up, switchboard, wait_up
from tests.support.prometheus import PROMETHEUS
from tests.support.waits import eventually


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True,
                         check=False).stdout
    return [int(p) for p in out.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_up_starts_platform_and_stops_cleanly(tmp_path: Path) -> None:
    gw, cp, console = free_port(), free_port(), free_port()
    proc = start_up(tmp_path, "--engine", "synthetic", "--gateway-port", str(gw), "--control-plane-port", str(cp),
                    "--shards", "2", "--console-port", str(console), "--cache-nodes", "2")
    try:
        banner = wait_up(proc, tmp_path)
        creds_path = tmp_path / ".switchboard" / "credentials.json"
        assert stat.S_IMODE(creds_path.stat().st_mode) == 0o600
        creds = json.loads(creds_path.read_text())
        assert set(creds["keys"]) == {"free", "plus", "enterprise"} and creds["admin_token"]
        # where it serves, for `switchboard admin` run from this folder (not on the default ports here)
        assert (creds["control_plane_url"], creds["gateway_url"]) == (f"http://127.0.0.1:{cp}", f"http://127.0.0.1:{gw}")
        keys_yaml = (tmp_path / ".switchboard" / "keys.yaml").read_text()
        for key in creds["keys"].values():
            # the run that made them shows them once, on a terminal only: up.log (mode 644) gets where they are
            assert key not in banner and f"key id {key_id(key)}" in banner
            assert key not in keys_yaml and key_digest(key) in keys_yaml  # the server's store: digests only
        assert creds["admin_token"] not in banner and "admin token: made now, in credentials.json" in banner
        assert f"http://127.0.0.1:{gw}/v1" in banner and "curl" in banner
        assert httpx.get(f"http://127.0.0.1:{console}/_stcore/health").text == "ok"
        # the console's one-time login link: not in up.log (stdout is no terminal) but in a mode-600 file the
        # banner names; in the console's environment; never in any process's argv (ps) nor in any log
        assert "?token=" not in banner
        login_file = tmp_path / ".switchboard" / "console_login"
        assert f"`cat {login_file}` (mode 600" in banner
        assert stat.S_IMODE(login_file.stat().st_mode) == 0o600
        [code] = re.findall(rf"^http://127\.0\.0\.1:{console}/\?token=([A-Za-z0-9_-]+)$", login_file.read_text(),
                            re.MULTILINE)
        console_pids = [p for p in _children(proc.pid) if "streamlit" in _cmdline(p)]
        assert len(console_pids) == 1
        assert f"SWITCHBOARD_CONSOLE_LOGIN_CODE={code}".encode() in Path(f"/proc/{console_pids[0]}/environ").read_bytes()
        for pid in [proc.pid, *_children(proc.pid)]:
            assert code not in _cmdline(pid) and creds["admin_token"] not in _cmdline(pid), _cmdline(pid)
        for log in (tmp_path / ".switchboard" / "logs").glob("*.log"):
            assert code.encode() not in log.read_bytes(), log

        # Members joined with the generated cluster token; without it nobody can join.
        assert creds["cluster_token"].startswith("sb-cluster-")
        members = httpx.get(f"http://127.0.0.1:{cp}/v1/registry/members").json()["members"]
        assert len([m for m in members if m["service"] == "shard"]) == 2
        rogue = {"service": "shard", "url": "http://127.0.0.1:9"}
        assert httpx.put(f"http://127.0.0.1:{cp}/v1/registry/members/rogue", json=rogue).status_code == 401

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw}/v1", api_key=creds["keys"]["plus"], max_retries=0)
        out = client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content

        # Transcripts are sealed with a key made for this platform; the ledger is shared by gateway and CP.
        assert stat.S_IMODE(Path(creds["session_keys_file"]).stat().st_mode) == 0o600
        admin = {"Authorization": f"Bearer {creds['admin_token']}"}
        deadline = time.monotonic() + 10
        while httpx.get(f"http://127.0.0.1:{cp}/admin/v1/usage", headers=admin).json()["totals"]["requests"] < 1:
            assert time.monotonic() < deadline, "the request never reached the usage ledger"
            time.sleep(0.3)

        # A child that dies is reported and restarted.
        shard_pids = [p for p in _children(proc.pid) if " shard " in _cmdline(p)]
        assert len(shard_pids) == 2
        os.kill(shard_pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while b"shard-0 restarted" not in (tmp_path / "up.log").read_bytes() and b"shard-1 restarted" not in \
                (tmp_path / "up.log").read_bytes():
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.3)
        assert "exited" in (tmp_path / "up.log").read_text()

        children = _children(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0 or proc.returncode in (0, -signal.SIGINT)
        time.sleep(0.5)
        alive = [p for p in children if Path(f"/proc/{p}").exists() and "zombie" not in
                 Path(f"/proc/{p}/status").read_text().lower()]
        assert not alive, [(p, _cmdline(p)) for p in alive]
        assert not login_file.exists()  # its link died with its console
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_on_a_terminal_prints_the_secrets_it_made_and_the_login_link(tmp_path: Path) -> None:
    """On a terminal (a pty here) the banner shows, once, the dev keys and admin token it made and the
    console's live login link; no login link file is written (the terminal is where it goes)."""
    import pty

    console = free_port()
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "control_plane.cli", "up", "--engine", "synthetic", "--shards", "1", "--cache-nodes",
         "1", "--gateway-port", str(free_port()), "--control-plane-port", str(free_port()), "--console-port",
         str(console)], cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    os.close(follower)
    shown = b""
    try:
        deadline = time.monotonic() + 90
        while b"Ctrl-C stops everything" not in shown:
            assert proc.poll() is None and time.monotonic() < deadline, shown.decode(errors="replace")
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                shown += os.read(leader, 65536)
        text = shown.decode()
        creds = json.loads((tmp_path / ".switchboard" / "credentials.json").read_text())
        assert all(key in text for key in creds["keys"].values()) and creds["admin_token"] in text
        assert re.search(rf"http://127\.0\.0\.1:{console}/\?token=[A-Za-z0-9_-]+", text), text
        assert not (tmp_path / ".switchboard" / "console_login").exists()
    finally:
        stop_up(proc)
        os.close(leader)


def test_up_with_pipelines_prints_each_shards_stages_and_hosts(tmp_path: Path) -> None:
    """`switchboard up --pipeline-parallel-size 2`: the banner names each shard's stages, their host and
    layers (as the console's Cluster page does), not only stage 0's URL."""
    gw, cp = free_port(), free_port()
    proc = start_up(tmp_path, "--pipeline-parallel-size", "2", "--shards", "2", "--cache-nodes", "1",
                    "--no-console", "--max-model-len", "512", "--max-num-seqs", "2",
                    "--gateway-port", str(gw), "--control-plane-port", str(cp))
    try:
        banner = wait_up(proc, tmp_path, timeout=300)
        for name in ("shard-0", "shard-1"):
            (line,) = [ln for ln in banner.splitlines() if ln.strip().startswith(name)]
            assert "stages 0@127.0.0.1:0-11 1@127.0.0.1:11-30" in line, banner
    finally:
        stop_up(proc)


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")
def test_up_prometheus_sees_a_lost_stage_and_fires_the_stage_down_alert(tmp_path: Path) -> None:
    """`switchboard up --prometheus --pipeline-parallel-size 2`, kill -9 of a shard's stage 1: its own
    Prometheus (5 s scrapes) fires SwitchboardPipelineStageDown. It never did: HTTP SD dropped the shard
    as soon as it left membership, and it lingered 2 s, under one scrape interval."""
    gw, cp, prom = free_port(), free_port(), free_port()
    proc = start_up(tmp_path, "--pipeline-parallel-size", "2", "--shards", "1", "--cache-nodes", "1",
                    "--no-console", "--max-model-len", "512", "--max-num-seqs", "2", "--prometheus",
                    "--prometheus-port", str(prom), "--gateway-port", str(gw), "--control-plane-port", str(cp))
    api = f"http://127.0.0.1:{prom}/api/v1/"
    try:
        wait_up(proc, tmp_path, timeout=300)
        up = 'switchboard_shard_pipeline_stage_up{stage="1"}'
        eventually(lambda: httpx.get(api + "query", params={"query": up}).json()["data"]["result"], 30,
                   what="stage 1 scraped")
        (shard,) = [p for p in _children(proc.pid) if " shard " in _cmdline(p)]
        (stage,) = [p for p in _children(shard) if "pipeline_stage" in _cmdline(p)]
        os.kill(stage, signal.SIGKILL)

        def firing() -> bool:
            alerts = httpx.get(api + "alerts").json()["data"]["alerts"]
            return any(a["labels"]["alertname"] == "SwitchboardPipelineStageDown" and a["state"] == "firing"
                       and a["labels"].get("stage") == "1" for a in alerts)
        eventually(firing, 30, interval_s=0.5, what="SwitchboardPipelineStageDown firing",
                   detail=lambda: (tmp_path / "up.log").read_text())
    finally:
        stop_up(proc)


def test_up_on_a_port_another_process_holds_says_so_and_starts_nothing(tmp_path: Path) -> None:
    """A second `switchboard up` on the first one's ports printed "Switchboard is up" with the first
    platform's URLs (they answered its health checks) beside its own keys, and restarted its gateway
    forever; now it names each taken port and the flag that moves it, before starting anything."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = switchboard("up", "--engine", "synthetic", "--gateway-port", str(port), "--control-plane-port",
                          str(free_port()), "--no-console", "--shards", "1", "--cache-nodes", "1",
                          "--state-dir", str(tmp_path / "state"), timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"gateway port {port} (--gateway-port)" in out.stderr and "Traceback" not in out.stderr
    assert "Switchboard is up" not in out.stdout and "starting control plane" not in out.stdout
    assert not list((tmp_path / "state" / "logs").glob("*.log"))  # no child was started


def test_up_giving_two_of_its_processes_one_port_says_so_and_starts_nothing(tmp_path: Path) -> None:
    """`--gateway-port` equal to `--control-plane-port` started: the gateway's health check reached the
    control plane, up printed "Switchboard is up" with the control plane's URL as the chat API, and the
    gateway (which could not bind) was restarted forever. A zone's gateway (--gateway-port +1) on the
    console's port did the same."""
    port = free_port()
    common = ("up", "--engine", "synthetic", "--shards", "1", "--cache-nodes", "1")
    same = switchboard(*common, "--no-console", "--gateway-port", str(port), "--control-plane-port", str(port),
                       "--state-dir", str(tmp_path / "a"), timeout=60)
    zoned = switchboard(*common, "--shards", "2", "--cache-nodes", "2", "--zones", "a,b", "--gateway-port", str(port),
                        "--console-port", str(port + 1), "--control-plane-port", str(free_port()),
                        "--state-dir", str(tmp_path / "b"), timeout=60)
    for out, state in ((same, "a"), (zoned, "b")):
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stdout + out.stderr
        assert "Switchboard is up" not in out.stdout and "starting control plane" not in out.stdout
        assert not list((tmp_path / state / "logs").glob("*.log"))  # no child was started
    assert same.stderr.strip() == (f"switchboard up: control-plane and gateway on port {port} (--control-plane-port, "
                                   "--gateway-port): give each its own port")
    assert f"gateway-b and console on port {port + 1} (--gateway-port, --console-port)" in zoned.stderr


def test_up_on_a_network_address_without_tls_keeps_the_console_on_loopback() -> None:
    """`--host 0.0.0.0` put the console, and the admin token typed into its login, on the network over
    plain HTTP. The chat API still goes where --host says; the console stays on loopback unless TLS is on."""
    network = UpSettings(host="0.0.0.0")
    assert console_host(network, tls=False) == "127.0.0.1"
    assert console_host(network, tls=True) == "0.0.0.0"
    assert console_host(UpSettings(host="127.0.0.1"), tls=False) == "127.0.0.1"
    lines = "\n".join(console_lines(network, "http://127.0.0.1:8501/?token=x"))
    assert "loopback only" in lines and "--tls" in lines
    assert "loopback only" not in "\n".join(console_lines(UpSettings(), "http://127.0.0.1:8501/?token=x"))


def test_up_with_replica_bounds_but_no_autoscale_says_so_and_starts_nothing(tmp_path: Path) -> None:
    """`--min-replicas 3` without `--autoscale` was accepted and did nothing (one shard started)."""
    out = switchboard("up", "--engine", "synthetic", "--no-console", "--min-replicas", "3",
                      "--state-dir", str(tmp_path / "s"), timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert "add --autoscale" in out.stderr and "Switchboard is up" not in out.stdout
    assert not list((tmp_path / "s" / "logs").glob("*.log"))  # no child was started


def test_up_autoscale_lets_the_control_plane_start_and_stop_the_shards(tmp_path: Path) -> None:
    """`switchboard up --autoscale`: no shard of its own; the autoscaler starts --min-replicas shards
    (local actuator, same engine flags), chat works, and Ctrl-C stops the autoscaler's shards too."""
    gw, cp = free_port(), free_port()
    proc = start_up(tmp_path, "--engine", "synthetic", "--gateway-port", str(gw), "--control-plane-port", str(cp),
                    "--no-console", "--cache-nodes", "1", "--autoscale", "--min-replicas", "1", "--max-replicas", "2")
    try:
        assert "autoscaled, 1..2" in wait_up(proc, tmp_path, 120)
        creds = json.loads((tmp_path / ".switchboard" / "credentials.json").read_text())
        members = httpx.get(f"http://127.0.0.1:{cp}/v1/registry/members").json()["members"]
        shards = [m for m in members if m["service"] == "shard"]
        assert len(shards) == 1 and shards[0]["id"].startswith("shard-local-"), shards
        admin = {"Authorization": f"Bearer {creds['admin_token']}"}
        decisions = httpx.get(f"http://127.0.0.1:{cp}/admin/v1/decisions", headers=admin).json()
        entries = decisions["decisions"] if isinstance(decisions, dict) else decisions
        assert any(d["action"] == "scale_up" and d["code"] == "bounds" for d in entries), entries
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw}/v1", api_key=creds["keys"]["plus"], max_retries=0)
        out = client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content
        shard_url = shards[0]["url"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0 or proc.returncode in (0, -signal.SIGINT)
        time.sleep(0.5)
        try:
            httpx.get(shard_url + "/health", timeout=1)
            alive = True
        except httpx.HTTPError:
            alive = False
        assert not alive, f"the autoscaler's shard {shard_url} outlived `switchboard up`"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_port_check_counts_only_a_port_in_use() -> None:
    """Review: `--host` that does not resolve was a traceback, and an address this machine lacks
    (localhost's ::1 without IPv6) read as "port in use". Those are the children's own errors to give."""
    from control_plane.ports import _port_taken

    with socket.create_server(("127.0.0.1", 0)) as held:
        assert _port_taken("127.0.0.1", held.getsockname()[1])
    assert not _port_taken("no-such-host.invalid", 8000)
    assert not _port_taken("192.0.2.1", 8000)  # TEST-NET-1: never an address of this machine


def test_the_banner_says_when_this_host_holds_fewer_shards_than_max_replicas(tmp_path: Path, capsys) -> None:
    """Found with `switchboard up --autoscale --max-replicas 3` (torch, 2 cores): the banner said
    "autoscaled, 1..3" and the first anyone heard of the host's cap of 2 was a scale-out recorded as
    `capped: this host holds 2 shards`."""
    from control_plane.supervisor import Child
    from control_plane.up_banner import banner

    settings = UpSettings.model_validate({"console": False, "autoscale": True, "max_replicas": 3})
    gw = Child("gw", [], "http://127.0.0.1:2", tmp_path / "gw.log")
    for cap, said in ((["--local-max-shards", "2"], True), (["--local-max-shards", "3"], False), ([], False)):
        cp = Child("cp", ["--autoscale", *cap], "http://127.0.0.1:1", tmp_path / "cp.log")
        banner(settings, {"keys": {}, "admin_token": "t"}, cp, [], [], [gw], tmp_path, tty=False)
        line = next(x for x in capsys.readouterr().out.splitlines() if "autoscaled, 1..3" in x)
        assert ("this host holds 2 (--local-max-shards" in line) is said, line


def test_up_passes_the_quantization_kernel_to_every_shard(tmp_path: Path) -> None:
    """`up` had no --quantization-kernel: blockq_x2 (float32's greedy tokens, README) or blockq_exact needed a
    shard run by hand. Now up's flag reaches its shards and the autoscaler's, as --dtype does."""
    from control_plane.launcher import plan
    from data_plane.common.settings_cli import parse_settings

    s = parse_settings(UpSettings, ["--shards", "2", "--quantization-kernel", "blockq_x2"], prog="switchboard up")
    _, _, shards, _ = plan(s, tmp_path, "admin", "cluster")
    assert len(shards) == 2
    for shard in shards:
        i = shard.args.index("--quantization-kernel")
        assert shard.args[i + 1] == "blockq_x2", shard.args
    auto = parse_settings(UpSettings, ["--autoscale", "--quantization-kernel", "blockq_exact"], prog="switchboard up")
    cp, _, none, _ = plan(auto, tmp_path, "admin", "cluster")
    assert not none and "--quantization-kernel blockq_exact" in cp.args[cp.args.index("--shard-args") + 1]
    assert UpSettings().quantization_kernel == "auto"  # the default stays the shard's own
