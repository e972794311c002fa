"""`switchboard up --prometheus` scrapes processes whose /metrics are guarded: its Prometheus presents the
metrics token from a credentials file (mode 600, in the state dir), never the token written into
prometheus.yml; every job's targets are up, and the gateway's tenant series reach it."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from control_plane.dev_credentials import prepare
from control_plane.launcher import SCRAPE_JOBS, UpSettings, prometheus_child
from control_plane.supervisor import Child
from tests.support.chat import assert_openai_error
from tests.support.metrics import metric_in, scrape, up_headers
from tests.support.procs import Service, free_port, start_up, stop_up, wait_up
from tests.support.prometheus import PROMETHEUS
from tests.support.waits import eventually

needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")


@needs_prometheus
def test_the_prometheus_config_names_a_credentials_file_never_the_token(tmp_path: Path) -> None:
    creds = prepare(tmp_path)
    cp = Child("control-plane", [], "http://127.0.0.1:8300", tmp_path / "cp.log")
    child = prometheus_child(UpSettings(), tmp_path, cp)
    assert child is not None
    text = (tmp_path / "prometheus" / "prometheus.yml").read_text()
    config = yaml.safe_load(text)
    jobs = config["scrape_configs"]
    assert {j["job_name"] for j in jobs} == {"switchboard-control-plane", *SCRAPE_JOBS.values()}
    for job in jobs:
        assert job["authorization"] == {"type": "Bearer", "credentials_file": str(tmp_path / "metrics_token")}, job
    token_file = tmp_path / "metrics_token"
    assert token_file.read_text().strip() == creds["metrics_token"]
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    for secret in ("metrics_token", "cluster_token", "admin_token"):
        assert creds[secret] not in text


@needs_prometheus
def test_the_members_up_started_stay_targets_when_they_leave_membership(tmp_path: Path) -> None:
    """HTTP SD lists live members only: a cache node or gateway that died or hung left the targets at the next
    refresh, its `up` series with it, so SwitchboardCacheNodeDown / SwitchboardGatewayDown (`up == 0` for
    minutes) could never fire under `up --prometheus` (a SIGSTOPped cache node: no target 5 s later). What `up`
    started is a static target of its job as well; SD still adds the rest (autoscaled, added by hand)."""
    prepare(tmp_path)
    cp = Child("control-plane", [], "http://127.0.0.1:8300", tmp_path / "cp.log")
    started = {"shard": [Child("shard-0", [], "http://127.0.0.1:8101", tmp_path / "s.log")],
               "cache": [Child(f"cache-{i}", [], f"http://127.0.0.1:820{i}", tmp_path / "c.log") for i in range(2)],
               "gateway": [Child("gateway", [], "http://127.0.0.1:8000", tmp_path / "g.log")]}
    assert prometheus_child(UpSettings(), tmp_path, cp, started["shard"], started["cache"], started["gateway"])
    jobs = {j["job_name"]: j for j in yaml.safe_load((tmp_path / "prometheus" / "prometheus.yml").read_text())[
        "scrape_configs"]}
    for service, job in SCRAPE_JOBS.items():
        (static,) = jobs[job]["static_configs"]
        assert static == {"targets": [c.url.removeprefix("http://") for c in started[service]],
                          "labels": {"switchboard_service": service}}, job
        assert jobs[job]["http_sd_configs"][0]["url"] == f"{cp.url}/v1/sd/prometheus?service={service}"


@needs_prometheus
def test_up_prometheus_scrapes_every_guarded_process(tmp_path: Path) -> None:
    gw, cp, prom = free_port(), free_port(), free_port()
    proc = start_up(tmp_path, "--engine", "synthetic", "--shards", "1", "--cache-nodes", "1", "--no-console",
                    "--prometheus", "--prometheus-port", str(prom), "--gateway-port", str(gw),
                    "--control-plane-port", str(cp))
    api = f"http://127.0.0.1:{prom}/api/v1/query"

    def query(expr: str) -> list[dict]:
        result: list[dict] = httpx.get(api, params={"query": expr}, timeout=5).json()["data"]["result"]
        return result

    try:
        banner = wait_up(proc, tmp_path, timeout=120)
        state = tmp_path / ".switchboard"
        assert f"Authorization: Bearer $(cat {state.resolve() / 'metrics_token'})" in banner, banner
        creds = json.loads((state / "credentials.json").read_text())
        gateway = f"http://127.0.0.1:{gw}"
        assert_openai_error(httpx.get(gateway + "/metrics"), 401, "invalid_metrics_token")
        client = openai.OpenAI(base_url=gateway + "/v1", api_key=creds["keys"]["plus"], max_retries=0)
        client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert metric_in(scrape(gateway, up_headers(state)), "switchboard_admission_tenant_service_tokens") > 0

        jobs = {"switchboard-control-plane", *SCRAPE_JOBS.values()}

        def all_up() -> bool:
            up = {r["metric"]["job"]: float(r["value"][1]) for r in query("up")}
            return set(up) >= jobs and all(up[j] == 1 for j in jobs)
        eventually(all_up, 60, 0.5, what="every job's targets up (scraped with the metrics token)",
                   detail=lambda: json.dumps(query("up")))
        eventually(lambda: query("switchboard_admission_tenant_service_tokens > 0"), 30, 0.5,
                   what="the gateway's tenant series in Prometheus")

        # A shard added by hand as the README shows (both tokens from credentials.json) is scraped too: the
        # shard job listed only the shards `up` started, so Prometheus (and the control plane's signals,
        # read from it) never saw this one.
        env = {"SWITCHBOARD_CLUSTER_TOKEN": creds["cluster_token"], "SWITCHBOARD_METRICS_TOKEN": creds["metrics_token"]}
        with Service(["shard", "--engine", "synthetic", "--registry-url", f"http://127.0.0.1:{cp}"],
                     env=env, isolated=True).start() as extra:
            instance = extra.url.split("://", 1)[1]
            eventually(lambda: query(f'up{{job="switchboard-shard",instance="{instance}"}} == 1'), 60, 0.5,
                       what="the hand-added shard scraped by up's Prometheus", detail=lambda: json.dumps(query("up")))
    finally:
        stop_up(proc)


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in list(f)[1:]:
                local, state = row.split()[1], row.split()[3]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found


@needs_prometheus
def test_up_on_a_network_address_keeps_prometheus_on_loopback(tmp_path: Path) -> None:
    """`up --host 0.0.0.0 --prometheus` put Prometheus on every interface, without auth or TLS: its query API
    served every series the guarded /metrics keep to token holders (the gateway's tenants and their token
    volumes) to anyone on the network. It listens on loopback, where the control plane reads it."""
    gw, cp, prom = free_port(), free_port(), free_port()
    proc = start_up(tmp_path, "--host", "0.0.0.0", "--engine", "synthetic", "--shards", "1", "--cache-nodes", "1",
                    "--no-console", "--prometheus", "--prometheus-port", str(prom), "--gateway-port", str(gw),
                    "--control-plane-port", str(cp))
    try:
        banner = wait_up(proc, tmp_path, timeout=120)
        assert f"prometheus                    127.0.0.1:{prom}" in banner, banner
        assert _listening(prom) == {"0100007F"}, _listening(prom)  # 127.0.0.1, nothing else
        assert _listening(gw) == {"00000000"}  # the chat API still where --host says
        creds = json.loads((tmp_path / ".switchboard" / "credentials.json").read_text())
        admin = {"Authorization": f"Bearer {creds['admin_token']}"}

        def read() -> dict:
            latest: dict = httpx.get(f"http://127.0.0.1:{cp}/admin/v1/signals", headers=admin,
                                     timeout=5).json()["latest"] or {}
            return latest
        eventually(lambda: read().get("source") == "prometheus" and read().get("shards"), 60, 0.5,
                   what="the control plane reads its signals from Prometheus", detail=lambda: json.dumps(read()))
    finally:
        stop_up(proc)
