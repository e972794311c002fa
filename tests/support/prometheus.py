"""A real Prometheus (Debian's `prometheus` binary) on a free loopback port, for tests.

    prometheus = Prometheus(tmp_path, {"switchboard-gateway": ["127.0.0.1:8080"]}, rule_files)
    prometheus.start(); prometheus.wait_ready()
    prometheus.value("sum(up)"); prometheus.alerts("SwitchboardShardDown"); prometheus.stop()

    with watched(Cluster(...), tmp_path, rule_files) as prometheus: ...   # a whole cluster, by job

It scrapes (and evaluates rules) every second, presenting the metrics token the test processes hold
(every /metrics is guarded) from a credentials file beside its config, as `switchboard up --prometheus`
does. Tests skip when :data:`PROMETHEUS` is None. Used by
tests/observability/test_live.py, test_vllm_dashboards.py and tests/control_plane/test_signals.py.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from dashboards.catalogue import JOBS
from tests.support.cluster import Cluster
from tests.support.procs import METRICS_TOKEN, free_port
from tests.support.waits import eventually

PROMETHEUS = shutil.which("prometheus")
"""The binary, or None (`apt-get install prometheus`, or `make sysdeps`)."""


class Prometheus:
    """A Prometheus process on a loopback port; `query` and `alerts` use its HTTP API."""

    def __init__(self, workdir: Path, scrape: dict[str, list[str]], rule_files: list[Path] | None = None, *,
                 scrape_timeout: str = "1s") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        token = workdir / "metrics-token"
        token.write_text(METRICS_TOKEN)
        token.chmod(0o600)
        auth = {"type": "Bearer", "credentials_file": str(token)}
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": scrape_timeout, "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files or []],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}], "authorization": auth}
                               for job, targets in scrape.items()],
        }
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.data = workdir / "tsdb"
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert PROMETHEUS is not None
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={self.config}", f"--storage.tsdb.path={self.data}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                return httpx.get(self.url + "/-/ready", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False
        eventually(ready, timeout, what="prometheus ready")

    def query(self, expr: str) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10.0).json()
        return body

    def value(self, expr: str) -> float:
        result = self.query(expr)["data"]["result"]
        return float(result[0]["value"][1]) if result else math.nan

    def alerts(self, name: str, state: str = "firing") -> list[dict[str, Any]]:
        alerts = httpx.get(self.url + "/api/v1/alerts", timeout=5.0).json()["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == state]

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def cluster_targets(cluster: Cluster) -> dict[str, list[str]]:
    """Job name (the dashboards' and rules') -> host:port of each of `cluster`'s processes."""
    def hostport(url: str) -> str:
        return url.removeprefix("http://")
    return {JOBS["control-plane"]: [hostport(cluster.control_plane.url)],
            JOBS["gateway"]: [hostport(cluster.gateway.url)],
            JOBS["shard"]: [hostport(s.url) for s in cluster.shards],
            JOBS["cache-node"]: [hostport(c.url) for c in cluster.caches]}


@contextmanager
def watched(cluster: Cluster, workdir: Path, rule_files: list[Path] | None = None) -> Iterator[Prometheus]:
    """A Prometheus scraping every process of `cluster` (not started yet) by job: Prometheus starts first,
    so it scrapes while the cluster starts; both run for the block and stop after it. When the block
    fails, the tail of Prometheus' log is printed."""
    prometheus = Prometheus(workdir, cluster_targets(cluster), rule_files)
    prometheus.start()
    try:
        cluster.start()
        prometheus.wait_ready()
        yield prometheus
    except BaseException:
        print("--- prometheus log ---\n" + prometheus.log_tail())
        raise
    finally:
        prometheus.stop()
        cluster.stop()
