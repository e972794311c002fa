"""A whole cluster on TLS (real processes): every listener serves HTTPS with a certificate a local CA
signed (data_plane/common/tls.py make_dev_pki, what `switchboard up --tls` uses); members register https
URLs; hops verify peers against the CA bundle; the openai SDK works given that bundle; a plain-HTTP
client and a peer the CA did not sign are refused.

    .venv/bin/python -m pytest tests/reliability/test_tls.py -q
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from data_plane.common.tls import CA_BUNDLE_ENV, make_dev_pki
from data_plane.routing.hop_client import HopConnectError, HopPool
from tests.support.cluster import KEYS, api_keys_env
from tests.support.procs import CLUSTER_HEADERS, Service


class TlsService(Service):
    def __init__(self, args: list[str], env: dict[str, str], **kw: object) -> None:
        super().__init__(args, env=env, **kw)  # type: ignore[arg-type]
        self.url = f"https://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    pki = make_dev_pki(tmp_path_factory.mktemp("pki"))
    env = pki.env()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CA_BUNDLE_ENV, str(pki.ca))  # this process's httpx (health polls) verifies with the CA
        cp = TlsService(["control-plane", "--admin-token", "t"], env)
        cache = TlsService(["cache-node", "--registry-url", cp.url, "--node-id", "cache-0"], env)
        shard = TlsService(["shard", "--engine", "synthetic", "--registry-url", cp.url, "--node-id", "shard-0",
                            "--synthetic-token-delay-ms", "1"], env)
        gateway = TlsService(["gateway", "--registry-url", cp.url, "--tokenizer", "whitespace", "--model-name",
                              "synthetic"], {**env, "SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()})
        procs = [cp, cache, shard, gateway]
        try:
            cp.start()
            cache.start()
            shard.start()
            gateway.start()
            for _ in range(100):
                if httpx.get(gateway.url + "/health").json()["shards"] >= 1:
                    break
                asyncio.run(asyncio.sleep(0.1))
            yield {"pki": pki, "cp": cp, "cache": cache, "shard": shard, "gateway": gateway}
        finally:
            for p in reversed(procs):
                p.stop()


def test_the_openai_sdk_chats_over_tls_with_the_ca_bundle(tls_cluster: dict) -> None:
    pki, gateway = tls_cluster["pki"], tls_cluster["gateway"]
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEYS["plus"], max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=pki.ca)))
    out = client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "hi there"}],
                                         extra_headers={"X-Session-Id": "new"})
    assert out.choices[0].message.content
    raw = client.chat.completions.with_raw_response.create(
        model="synthetic", messages=[{"role": "user", "content": "again"}], extra_headers={"X-Session-Id": "new"})
    session = raw.headers["x-session-id"]
    again = client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "more"}],
                                           extra_headers={"X-Session-Id": session})
    assert again.usage is not None and again.usage.prompt_tokens > 3  # history came back through the cache hop
    stream = client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "s"}],
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    members = httpx.get(tls_cluster["cp"].url + "/v1/registry/members").json()["members"]
    assert members and all(m["url"].startswith("https://") for m in members)


def test_without_the_ca_bundle_the_sdk_refuses_the_server(tls_cluster: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CA_BUNDLE_ENV, raising=False)
    client = openai.OpenAI(base_url=tls_cluster["gateway"].url + "/v1", api_key=KEYS["plus"], max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "hi"}])


def test_plain_http_is_refused_on_every_listener(tls_cluster: dict) -> None:
    for name in ("cp", "cache", "shard", "gateway"):
        svc = tls_cluster[name]
        plain = svc.url.replace("https://", "http://")
        try:
            r = httpx.get(plain + "/health", timeout=3)
        except httpx.HTTPError:
            continue  # the TLS listener dropped the plain-text request
        assert r.status_code != 200, name


def test_bench_serve_without_the_ca_says_to_pass_it(tls_cluster: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found against `switchboard up --tls`: `switchboard bench serve --url https://…` without the CA said
    only "CERTIFICATE_VERIFY_FAILED …; check --url", though the URL was right and the CA was missing."""
    from tests.support.procs import switchboard

    monkeypatch.delenv(CA_BUNDLE_ENV, raising=False)
    args = ("bench", "serve", "--url", tls_cluster["gateway"].url, "--api-key", KEYS["plus"], "--num-prompts", "1",
            "--max-tokens", "2")
    out = switchboard(*args, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "pass --ca-bundle" in out.stderr, out.stderr
    ok = switchboard(*args, "--ca-bundle", str(tls_cluster["pki"].ca), timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_the_hop_client_refuses_a_peer_the_ca_did_not_sign(tls_cluster: dict, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    other = make_dev_pki(tmp_path / "other")  # a different CA
    monkeypatch.setenv(CA_BUNDLE_ENV, str(other.ca))
    cache = tls_cluster["cache"].url

    async def fetch() -> int:
        pool = HopPool()
        try:
            r = await pool.request("GET", cache, "/v1/sessions/sess_x", headers=dict(CLUSTER_HEADERS), timeout=3)
            await r.read(asyncio.get_running_loop().time() + 3)
            return r.status
        finally:
            await pool.aclose()

    with pytest.raises(HopConnectError, match="TLS"):
        asyncio.run(fetch())
    monkeypatch.setenv(CA_BUNDLE_ENV, str(tls_cluster["pki"].ca))
    assert asyncio.run(fetch()) == 404  # the right CA: verified, and the token let it in


def test_switchboard_up_tls_runs_the_platform_on_tls(tmp_path: Path) -> None:
    import json
    import signal

    from tests.support.procs import free_port, start_up, stop_up, switchboard, wait_up

    gw, cp = free_port(), free_port()
    log_path = tmp_path / "up.log"
    proc = start_up(tmp_path, "--tls", "--engine", "synthetic", "--shards", "1", "--cache-nodes", "1", "--no-console",
                    "--gateway-port", str(gw), "--control-plane-port", str(cp))
    try:
        wait_up(proc, tmp_path)
        state = tmp_path / ".switchboard"
        creds = json.loads((state / "credentials.json").read_text())
        ca = ssl.create_default_context(cafile=state / "tls" / "ca.pem")
        assert f"https://127.0.0.1:{gw}/v1" in log_path.read_text()
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{gw}/v1", api_key=creds["keys"]["plus"], max_retries=0,
                               http_client=openai.DefaultHttpxClient(verify=ca))
        raw = client.chat.completions.with_raw_response.create(
            model="synthetic", messages=[{"role": "user", "content": "hello"}], extra_headers={"X-Session-Id": "new"})
        again = client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "more"}],
                                               extra_headers={"X-Session-Id": raw.headers["x-session-id"]})
        assert again.choices[0].message.content
        members = httpx.get(f"https://127.0.0.1:{cp}/v1/registry/members", verify=ca).json()["members"]
        assert {m["service"] for m in members} == {"shard", "cache", "gateway"}
        assert all(m["url"].startswith("https://") for m in members)

        # What the banner says to paste works as pasted: its curls named no CA (curl: exit 60), and
        # `switchboard admin` reached the https control plane it found in credentials.json without up's CA.
        banner = log_path.read_text()
        try_it = banner.split("Try it:", 1)[1].split("Ctrl-C", 1)[0]
        pasted = subprocess.run(["bash", "-c", try_it], check=False, capture_output=True, text=True, timeout=60)
        assert pasted.returncode == 0 and json.loads(pasted.stdout)["choices"], (try_it, pasted)
        metrics = banner.split("/metrics of every process:", 1)[1].splitlines()[0]
        scraped = subprocess.run(["bash", "-c", metrics], check=False, capture_output=True, text=True, timeout=60)
        assert scraped.returncode == 0 and "switchboard_" in scraped.stdout, (metrics, scraped.stderr)
        status = switchboard("admin", "status", cwd=tmp_path, timeout=60)
        assert status.returncode == 0 and "passing" in status.stdout, status.stderr
    finally:
        stop_up(proc, signal.SIGTERM)


def test_tls_flags_on_any_subcommand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--tls-cert/--tls-key/--ca-bundle` work on every subcommand (taken off argv by the `switchboard`
    entry point, data_plane/common/tls.py take_tls_flags)."""
    from data_plane.common.tls import TLS_CERT_ENV, TLS_FLAGS, take_tls_flags

    pki = make_dev_pki(tmp_path / "pki")
    for env in TLS_FLAGS.values():  # restored after the test, whatever take_tls_flags writes
        monkeypatch.setenv(env, "")
    rest = take_tls_flags(["--port", "1", f"--tls-cert={pki.cert}", "--tls-key", str(pki.key), "--ca-bundle",
                           str(pki.ca)])
    assert rest == ["--port", "1"] and os.environ[TLS_CERT_ENV] == str(pki.cert)
    with pytest.raises(SystemExit):
        take_tls_flags(["--tls-key", str(tmp_path / "missing.pem")])
    monkeypatch.setenv(TLS_CERT_ENV, "")
    node = TlsService(["cache-node", "--tls-cert", str(pki.cert), "--tls-key", str(pki.key)],
                      {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_TLS_")})
    with node:
        assert httpx.get(node.url + "/health").status_code == 200


def test_switchboard_up_tls_autoscale_starts_shards_that_join(tmp_path: Path) -> None:
    """Found running `switchboard up --tls --autoscale`: the autoscaler's shards were started with
    `--registry-url http://…` against the https control plane and never registered ("registering …
    failed (RemoteProtocolError)" in their logs); the platform served no chat at all. Their own URL
    (what a drain polls for idleness) was http:// too."""
    import json
    import signal

    from tests.support.procs import free_port, start_up, stop_up, wait_up
    from tests.support.waits import eventually

    gw, cp = free_port(), free_port()
    proc = start_up(tmp_path, "--tls", "--autoscale", "--min-replicas", "1", "--max-replicas", "1", "--engine",
                    "synthetic", "--cache-nodes", "1", "--no-console", "--gateway-port", str(gw),
                    "--control-plane-port", str(cp))
    try:
        wait_up(proc, tmp_path)
        state = tmp_path / ".switchboard"
        creds = json.loads((state / "credentials.json").read_text())
        ca = ssl.create_default_context(cafile=state / "tls" / "ca.pem")

        def shards() -> list[dict]:
            members = httpx.get(f"https://127.0.0.1:{cp}/v1/registry/members", verify=ca).json()["members"]
            return [m for m in members if m["service"] == "shard" and m["status"] == "passing"]

        eventually(lambda: len(shards()) == 1, timeout_s=60,
                   detail=lambda: "\n".join(p.read_text()[-2000:] for p in (state / "logs").glob("shard-*.log")))
        assert shards()[0]["url"].startswith("https://")
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{gw}/v1", api_key=creds["keys"]["plus"], max_retries=0,
                               http_client=openai.DefaultHttpxClient(verify=ca))
        reply = client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content
    finally:
        stop_up(proc, signal.SIGTERM)
