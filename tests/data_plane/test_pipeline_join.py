"""Joining a pipeline group takes the cluster token (data_plane/shard/engines/pipeline_store.py), with
real processes on loopback: stage 0 is a shard waiting for a remote stage 1 (`--pipeline-remote-stages 1`);
`switchboard stage --join` with a wrong and with no SWITCHBOARD_CLUSTER_TOKEN each exits at once with one
line, before loading a layer and having written nothing; a plain TCPStore client reads no argument; then
the real stage joins and the shard answers a chat through both stages.

    .venv/bin/python -m pytest tests/data_plane/test_pipeline_join.py -q       # ~1-2 min (the real model, twice)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import httpx
import torch.distributed as dist

from tests.support.formats import INVARIANT_ARGS
from tests.support.procs import CLUSTER_HEADERS, CLUSTER_TOKEN, ROOT, Service, free_port


def _stage(port: int, token: str | None, log: str | None = None, timeout: float = 120) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "SWITCHBOARD_CLUSTER_TOKEN"}
    env["PYTHONPATH"] = str(ROOT)
    if token is not None:
        env["SWITCHBOARD_CLUSTER_TOKEN"] = token
    cmd = [sys.executable, "-m", "control_plane.cli", "stage", "--join", f"127.0.0.1:{port}", "--rank", "1",
           "--threads", "1"]
    out = open(log, "wb") if log else subprocess.PIPE  # noqa: SIM115 - the process writes to it until it ends
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _refused(port: int, token: str | None) -> tuple[str, float]:
    t0 = time.monotonic()
    proc = _stage(port, token)
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode not in (0, None), out.decode()
    return out.decode(errors="replace").strip(), took


def test_a_stage_started_before_stage_0_says_what_it_waits_for() -> None:
    """No group at the address yet: the stage says so at once (not a silent wait) and keeps waiting."""
    port = free_port()
    proc = _stage(port, CLUSTER_TOKEN)
    try:
        deadline, seen = time.monotonic() + 60, b""
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        while b"waiting for stage 0's pipeline group" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen.decode(errors="replace")
            seen += proc.stdout.read() or b""
            time.sleep(0.2)
        assert f"127.0.0.1:{port}".encode() in seen and b"stage 1" in seen and b"Traceback" not in seen
    finally:
        proc.kill()
        proc.wait(10)


def test_a_stage_without_the_cluster_token_is_refused_at_once_and_the_real_one_joins(tmp_path) -> None:
    port = free_port()
    shard = Service(["shard", *INVARIANT_ARGS, "--threads", "1", "--max-model-len", "512",
                     "--pipeline-parallel-size", "2", "--pipeline-host", "127.0.0.1", "--pipeline-port", str(port),
                     "--pipeline-remote-stages", "1", "--pipeline-exit-linger-s", "0"], ready_timeout=300)
    stage: subprocess.Popen[bytes] | None = None
    try:
        shard.start(wait=False)
        deadline = time.monotonic() + 300
        while "waiting for stage 1 to join" not in shard.log_tail(20000):
            assert time.monotonic() < deadline and shard.proc is not None and shard.proc.poll() is None, \
                shard.log_tail()
            time.sleep(0.3)

        wrong, took_wrong = _refused(port, "not-the-cluster-token")
        assert wrong.splitlines() == [wrong] and "Traceback" not in wrong, wrong  # one line
        assert "refused by the group" in wrong and "SWITCHBOARD_CLUSTER_TOKEN differs from stage 0's" in wrong
        missing, took_missing = _refused(port, None)
        assert missing.splitlines() == [missing] and "SWITCHBOARD_CLUSTER_TOKEN is not set" in missing, missing
        # at once: an interpreter and torch's import, no layer loaded (loading takes longer than this here)
        assert took_wrong < 30 and took_missing < 30, (took_wrong, took_missing)

        raw = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=5))
        keys = set(raw.list_keys())
        assert "spec/1" in keys and not any(k.startswith(("info/", "links/1", "hb/")) for k in keys), keys
        assert b"--layers" not in raw.get("spec/1")  # stage 0's arguments are not readable without the token

        stage = _stage(port, CLUSTER_TOKEN, str(tmp_path / "stage1.log"))
        try:
            shard.wait_healthy(300)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}\nstage 1:\n{(tmp_path / 'stage1.log').read_text()[-3000:]}") from None
        answer = httpx.post(shard.url + "/v1/chat/completions", headers=CLUSTER_HEADERS, timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8,
            "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
        log = shard.log_tail(200_000)
        assert "failed the cluster-token check" not in log and "refused" not in log, log[-3000:]
    finally:
        if stage is not None and stage.poll() is None:
            stage.kill()
        shard.stop()
