"""The vLLM shard: command construction everywhere; a real vLLM server only on a GPU machine."""

from __future__ import annotations

import importlib.util

import pytest

from data_plane.shard.engines.vllm_engine import vllm_command
from data_plane.shard.settings import ShardSettings
from tests.support.metrics import scrape


def test_vllm_command_carries_shard_settings() -> None:
    s = ShardSettings(engine="vllm", dtype="bfloat16", max_num_seqs=64, max_model_len=4096)
    cmd = vllm_command(s, "/models/m", "m", 9123)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for flag in ("--model /models/m", "--served-model-name m", "--port 9123", "--dtype bfloat16",
                 "--max-num-seqs 64", "--max-model-len 4096", "--scheduling-policy priority"):
        assert flag in joined


def test_vllm_command_passes_parallelism_through() -> None:
    default = " ".join(vllm_command(ShardSettings(engine="vllm"), "/models/m", "m", 9123))
    assert "--tensor-parallel-size 1" in default and "--pipeline-parallel-size 1" in default
    s = ShardSettings(engine="vllm", tensor_parallel_size=4, pipeline_parallel_size=2)
    joined = " ".join(vllm_command(s, "/models/m", "m", 9123))
    assert "--tensor-parallel-size 4" in joined and "--pipeline-parallel-size 2" in joined


def _fake_vllm(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """A sidecar's vLLM stand-in (no GPU here): each start's command and keyword arguments, recorded."""
    import subprocess
    import sys
    import types

    import data_plane.model_store

    started: list[dict] = []

    class FakeVLLM:
        def __init__(self, cmd: list[str], **kwargs: object) -> None:
            started.append({"cmd": cmd, **kwargs})

        def poll(self) -> None:
            return None

        def terminate(self) -> None:
            pass

        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(data_plane.model_store, "resolve_model", lambda model: "/models/m")
    monkeypatch.setattr(subprocess, "Popen", FakeVLLM)
    monkeypatch.setenv("SWITCHBOARD_CLUSTER_TOKEN", "the-cluster-token")
    return started


def test_vllm_is_started_with_the_cluster_token_as_its_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM was started without an API key: with the cluster token set (every shard requires it), anyone
    who reached vLLM's port could generate on the GPU. The sidecar now starts it with VLLM_API_KEY = the
    token, in its environment (not its command line, which `ps` shows)."""
    from fastapi.testclient import TestClient

    from data_plane.shard.engines import vllm_engine

    started = _fake_vllm(monkeypatch)
    with TestClient(vllm_engine.create_sidecar(ShardSettings(engine="vllm"))):
        pass
    assert len(started) == 1
    assert (started[0].get("env") or {}).get("VLLM_API_KEY") == "the-cluster-token"
    assert "the-cluster-token" not in " ".join(started[0]["cmd"])
    assert "VLLM_API_KEY" not in vllm_engine.vllm_env({"PATH": "/bin"})  # no token, no key (a dev machine)


def test_the_sidecars_metrics_relay_needs_the_metrics_or_the_cluster_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecar relays vLLM's /metrics on the shard port: guarded as every process's /metrics is."""
    from fastapi.testclient import TestClient

    from data_plane.shard.engines import vllm_engine

    _fake_vllm(monkeypatch)
    monkeypatch.setenv("SWITCHBOARD_METRICS_TOKEN", "the-metrics-token")
    with TestClient(vllm_engine.create_sidecar(ShardSettings(engine="vllm"))) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = client.get("/metrics", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_metrics_token"
        for token in ("the-metrics-token", "the-cluster-token"):  # past the guard: vLLM (not running) is asked
            assert client.get("/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 503


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 -- any failure to ask means no usable GPU
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda() or importlib.util.find_spec("vllm") is None,
                    reason="needs a CUDA GPU and the vllm extra (pip install 'switchboard[vllm]')")
def test_vllm_shard_serves_chat_on_gpu() -> None:
    import httpx

    from tests.support.procs import Service

    with Service(["shard", "--engine", "vllm", "--dtype", "bfloat16"], ready_timeout=600) as shard:
        upstream = httpx.get(shard.url + "/health").json()["upstream"]
        r = httpx.post(upstream + "/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Capital of France?"}],
            "max_tokens": 16, "temperature": 0, "priority": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
        assert "vllm:num_requests_running" in scrape(shard.url)


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 -- any failure to ask means no usable GPU
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2 or importlib.util.find_spec("vllm") is None,
                    reason="needs 2 CUDA GPUs and the vllm extra (pip install 'switchboard[vllm]')")
def test_vllm_shard_split_over_two_gpus_registers_as_one_shard() -> None:
    """--tensor-parallel-size 2: vLLM runs one worker a GPU behind one server; the control plane
    sees one shard member, carrying both sizes."""
    import httpx

    from tests.support.cluster import ADMIN_TOKEN
    from tests.support.procs import Service

    with Service(["control-plane", "--admin-token", ADMIN_TOKEN]) as cp, \
            Service(["shard", "--engine", "vllm", "--dtype", "bfloat16", "--tensor-parallel-size", "2",
                     "--registry-url", cp.url, "--node-id", "shard-tp2"], ready_timeout=900) as shard:
        upstream = httpx.get(shard.url + "/health").json()["upstream"]
        r = httpx.post(upstream + "/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Capital of France?"}],
            "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200
        members = httpx.get(cp.url + "/admin/v1/members", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        shards = [m for m in members["members"] if m["service"] == "shard"]
        assert [m["id"] for m in shards] == ["shard-tp2"]
        assert shards[0]["meta"]["tensor_parallel_size"] == "2" and shards[0]["meta"]["pipeline_parallel_size"] == "1"
