"""Reading Prometheus text exposition in tests: one parser, summed or per sample.

    total = metric(gateway.url, "switchboard_router_retries_total")              # summed over labels
    aborts = metric(shard.url, "vllm:request_success_total", finished_reason="abort")
    text = scrape(node.url); metric_in(text, "switchboard_cache_requests_total", op="get")
    series(text, "switchboard_cache_sessions")                                   # [] when absent

`scrape` (and so `metric`) presents the metrics token spawned processes hold (tests/support/procs.py):
every /metrics is guarded; pass `headers` for a process with other tokens (`switchboard up`'s own:
``scrape(url, up_headers(tmp_path / ".switchboard"))``).

Labels given select the samples whose labels include them (other labels are summed over). Names
are matched exactly (``x_total`` is not ``x``), so histograms are read as ``x_bucket``/``x_count``/
``x_sum``. Used by every test that checks a metric of a live process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from tests.support.procs import METRICS_HEADERS

_SAMPLE = re.compile(r"^(?P<name>[^\s{#]+)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric `name` in Prometheus text: (labels, value)."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group("name") == name:
            out.append((dict(_LABEL.findall(m.group("labels") or "")), float(m.group("value"))))
    return out


def series(text: str, name: str, **labels: str) -> list[float]:
    """The values of the samples of `name` whose labels include `labels` (empty: no such series)."""
    return [v for have, v in samples(text, name) if all(have.get(k) == w for k, w in labels.items())]


def metric_in(text: str, name: str, **labels: str) -> float:
    """Sum of :func:`series` (0.0 when there is none)."""
    return sum(series(text, name, **labels))


def scrape(url: str, headers: dict[str, str] | None = None, timeout: float = 5.0) -> str:
    """`url`/metrics as text, read with the metrics token unless `headers` say otherwise (raises on a non-200)."""
    r = httpx.get(url + "/metrics", timeout=timeout, headers=METRICS_HEADERS if headers is None else headers)
    r.raise_for_status()
    return r.text


def up_headers(state_dir: Path) -> dict[str, str]:
    """What scrapes the processes of a `switchboard up` whose state dir is `state_dir`: its metrics token
    (credentials.json)."""
    token = json.loads((state_dir / "credentials.json").read_text())["metrics_token"]
    return {"Authorization": f"Bearer {token}"}


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of metric `name` at `url`/metrics over the samples whose labels include `labels`."""
    return metric_in(scrape(url), name, **labels)
