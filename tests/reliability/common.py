"""Helpers shared by the reliability suite: metrics, RSS, polling, figures.

    value = metric(gateway.url, "switchboard_router_retries_total")            # summed over labels
    value = metric(shard.url, "vllm:request_success_total", finished_reason="abort")
    eventually(lambda: health(gw)["shards"] == 2, timeout_s=5)                 # -> seconds it took
    report("cp_outage", requests=40, recovered_s=1.2)                          # a figure for the doc

Figures are printed as one ``RELIABILITY name {json}`` line each (run pytest with ``-s`` to see
them) and, when ``SWITCHBOARD_RELIABILITY_REPORT`` names a file, appended to it as JSON lines:
docs/RELIABILITY.md quotes them.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

from tests.cluster import ADMIN_TOKEN, KEYS, Cluster
from tests.procs import Service

ENV_REPORT = "SWITCHBOARD_RELIABILITY_REPORT"
"""File the suite appends its figures to (JSON lines); unset: printed only."""
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
LEAK_MARKERS = ("Traceback", 'File "', "site-packages", "/work/", '.py"', ".py:")
"""What a stack trace or a source path looks like inside an error body."""

_SAMPLE = re.compile(r"^(?P<name>[^\s{]+)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric `name` in Prometheus text: (labels, value)."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group("name") == name:
            out.append((dict(_LABEL.findall(m.group("labels") or "")), float(m.group("value"))))
    return out


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of metric `name` at `url`/metrics over the samples whose labels match `labels`."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    return sum(v for have, v in samples(text, name) if all(have.get(k) == w for k, w in labels.items()))


def eventually(
    predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.05, what: str = ""
) -> float:
    """Poll `predicate` until it is truthy; seconds it took. Connection errors count as 'not yet'."""
    start = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what or 'condition'} not met within {timeout_s} s")
        time.sleep(interval_s)


def rss_kb(pid: int) -> int:
    """Resident set size of a live process, from /proc/PID/status (VmRSS, kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS for pid {pid}")


def chat(
    url: str,
    tier: str = "plus",
    content: str = "hello there",
    *,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
    **body: Any,
) -> httpx.Response:
    """One chat completion through a gateway (non-streaming unless stream=True is passed)."""
    body.setdefault("max_tokens", 4)
    messages = body.pop("messages", None) or [{"role": "user", "content": content}]
    auth = {"Authorization": f"Bearer {key or KEYS[tier]}"}
    return httpx.post(
        url + "/v1/chat/completions",
        json={"messages": messages, **body},
        headers={**auth, **(headers or {})},
        timeout=timeout,
    )


def assert_openai_error(resp: httpx.Response, status: int | Iterable[int], code: str | None = None) -> dict:
    """`resp` is an OpenAI-shaped error with `status` (and `code`); returns the error object."""
    statuses = {status} if isinstance(status, int) else set(status)
    assert resp.status_code in statuses, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    if code is not None:
        assert err["code"] == code, err
    if resp.status_code in (429, 503):
        assert int(resp.headers["retry-after"]) >= 1, dict(resp.headers)
    assert_no_leak(resp.text)
    return err


def assert_no_leak(text: str) -> None:
    """An error body carries no stack trace and no source path."""
    for marker in LEAK_MARKERS:
        assert marker not in text, f"{marker!r} leaked in {text[:500]!r}"


def all_services(c: Cluster) -> list[Service]:
    return [c.control_plane, *c.caches, *c.shards, c.gateway]


def report(name: str, **figures: Any) -> None:
    """Print a figure line for the doc (and append it to $SWITCHBOARD_RELIABILITY_REPORT)."""
    line = json.dumps({"name": name, **figures}, sort_keys=True, default=str)
    print(f"\nRELIABILITY {name} {line}")
    path = os.environ.get(ENV_REPORT)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


class StatefulCluster(Cluster):
    """A :class:`~tests.cluster.Cluster` whose control plane persists to `state_dir`, so it can be
    killed and restarted on the same port with its tier policy and degradation level."""

    def __init__(self, state_dir: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state_dir = state_dir
        self.control_plane = self._control_plane(self.control_plane.port)

    def _control_plane(self, port: int) -> Service:
        return Service(
            ["control-plane", "--admin-token", ADMIN_TOKEN, "--state-dir", str(self.state_dir)], port=port
        )

    def restart_control_plane(self) -> None:
        old = self.control_plane
        old.stop()  # already dead: closes its log
        self.control_plane = self._control_plane(old.port)
        self.control_plane.start()
