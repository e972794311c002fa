"""Reading Prometheus text exposition in tests: one parser, summed or per sample.

    total = metric(gateway.url, "switchboard_router_retries_total")              # summed over labels
    aborts = metric(shard.url, "vllm:request_success_total", finished_reason="abort")
    text = scrape(node.url); metric_in(text, "switchboard_cache_requests_total", op="get")
    series(text, "switchboard_cache_sessions")                                   # [] when absent

Labels given select the samples whose labels include them (other labels are summed over). Names
are matched exactly (``x_total`` is not ``x``), so histograms are read as ``x_bucket``/``x_count``/
``x_sum``. Used by every test that checks a metric of a live process.
"""

from __future__ import annotations

import re

import httpx

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


def scrape(url: str, headers: dict[str, str] | None = None) -> str:
    """`url`/metrics as text (raises on a non-200)."""
    r = httpx.get(url + "/metrics", timeout=5.0, headers=headers)
    r.raise_for_status()
    return r.text


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of metric `name` at `url`/metrics over the samples whose labels include `labels`."""
    return metric_in(scrape(url), name, **labels)
