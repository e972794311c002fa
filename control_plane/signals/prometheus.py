"""The Prometheus reader of :mod:`control_plane.signals.model` (``--prometheus URL``), built by signals/source.py.

source = PrometheusSignals("http://127.0.0.1:9090", http, window_s=60)
signals = await source.read()          # the same Signals as ScrapeSignals yields
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import httpx

from control_plane.signals.model import (
    M_GW_QUEUE,
    M_GW_REQUESTS,
    M_GW_TOKENS,
    M_GW_TTFT,
    M_GW_WAIT,
    M_KV,
    M_MAX_SEQS,
    M_PREFIX_BYTES,
    M_PREFIX_HITS,
    M_PREFIX_QUERIES,
    M_RUNNING,
    M_SHARD_E2E,
    M_SHARD_ITL,
    M_SHARD_PREFILL,
    M_SHARD_QUEUE,
    M_SHARD_TOKENS,
    M_SHARD_TTFT,
    M_WAITING,
    NOT_OVERLOAD_CODES,
    OVERLOAD_HISTOGRAMS,
    QUANTILE,
    SHED_CODES,
    ShardSignal,
    Signals,
    aggregate,
    overload_histograms_missing,
)


class PrometheusError(Exception):
    """A PromQL query failed (transport, HTTP status or an ``"error"`` answer)."""


class PrometheusSignals:
    """The same signals from Prometheus' HTTP API (``GET /api/v1/query``).

        source = PrometheusSignals("http://127.0.0.1:9090", http, window_s=60)

    Prometheus must scrape the shards and gateways under the job names of
    ``alerts/prometheus.example.yml`` (``switchboard-shard``, ``switchboard-gateway``); a shard
    is identified by `member_label` (``instance`` by default). A target whose ``up`` is 0, or
    whose gauges are older than `stale_after_s`, is stale. Use a window of at least two scrape
    intervals, as for any ``rate()``.
    """

    def __init__(
        self,
        url: str,
        http: httpx.AsyncClient,
        *,
        window_s: float = 60.0,
        shard_job: str = "switchboard-shard",
        gateway_job: str = "switchboard-gateway",
        member_label: str = "instance",
        stale_after_s: float = 60.0,
        timeout_s: float = 3.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._url = url.rstrip("/") + "/api/v1/query"
        self._http = http
        self.window_s = window_s
        self._shard = f'job="{shard_job}"'
        self._gw = f'job="{gateway_job}"'
        self._by = member_label
        self._stale_after_s = stale_after_s
        self._timeout_s = timeout_s
        self._wall = wall

    async def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """An instant vector (or scalar) as ``[(labels, value)]``; raises :class:`PrometheusError`."""
        try:
            resp = await self._http.get(self._url, params={"query": promql}, timeout=self._timeout_s)
            body = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise PrometheusError(f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"HTTP {resp.status_code}: {body.get('errorType')}: {body.get('error')}")
        data = body.get("data") or {}
        if data.get("resultType") == "scalar":
            return [({}, float(data["result"][1]))]
        return [(dict(r.get("metric") or {}), float(r["value"][1])) for r in data.get("result") or []]

    async def read(self) -> Signals:
        w = f"{max(1, round(self.window_s))}s"
        by, sh, gw = self._by, self._shard, self._gw
        queries = {
            "up": f"up{{{sh}}}",
            "running": f"sum by ({by}) ({M_RUNNING}{{{sh}}})",
            "waiting": f"sum by ({by}) ({M_WAITING}{{{sh}}})",
            "kv": f"sum by ({by}) ({M_KV}{{{sh}}})",
            "max_seqs": f"sum by ({by}) ({M_MAX_SEQS}{{{sh}}})",
            "age": f"time() - max by ({by}) (timestamp({M_WAITING}{{{sh}}}))",
            "shard_ttft": f"histogram_quantile({QUANTILE}, "
            f"sum by ({by}, le) (rate({M_SHARD_TTFT}{{{sh}}}[{w}])))",
            "gw_up": f"up{{{gw}}}",
            "gw_ttft": f"histogram_quantile({QUANTILE}, sum by (le) (rate({M_GW_TTFT}{{{gw}}}[{w}])))",
            "all_shard_ttft": f"histogram_quantile({QUANTILE}, "
            f"sum by (le) (rate({M_SHARD_TTFT}{{{sh}}}[{w}])))",
            # the medians the Overview shows beside the p95 (the scrape reader's ttft_p50_s / tpot_s)
            "gw_ttft_p50": f"histogram_quantile(0.5, sum by (le) (rate({M_GW_TTFT}{{{gw}}}[{w}])))",
            "all_shard_ttft_p50": f"histogram_quantile(0.5, sum by (le) (rate({M_SHARD_TTFT}{{{sh}}}[{w}])))",
            "tpot": f"histogram_quantile(0.5, sum by (le) (rate({M_SHARD_ITL}{{{sh}}}[{w}])))",
            # per shard: prompt tokens found in the prefix cache / looked up (NaN, so None, without lookups)
            "prefix_hit_rate": f"sum by ({by}) (increase({M_PREFIX_HITS}{{{sh}}}[{w}])) / "
            f"sum by ({by}) (increase({M_PREFIX_QUERIES}{{{sh}}}[{w}]))",
            "prefix_bytes": f"sum by ({by}) ({M_PREFIX_BYTES}{{{sh}}})",
            "demand": f"sum by (tier) (rate({M_GW_REQUESTS}{{{gw}}}[{w}]))",
            "rejected": f'sum by (tier) (rate({M_GW_REQUESTS}{{{gw},status=~"429|503"}}[{w}]))',
            "errors": f'sum(rate({M_GW_REQUESTS}{{{gw},status=~"5..",code!~"{"|".join(NOT_OVERLOAD_CODES)}"}}[{w}]))',
            "shed": f'sum(rate({M_GW_REQUESTS}{{{gw},status="503",code=~"{"|".join(SHED_CODES)}"}}[{w}]))',
            "gw_queue": f"sum({M_GW_QUEUE}{{{gw}}})",
            "gw_tokens": f'sum(rate({M_GW_TOKENS}{{{gw},kind="completion"}}[{w}]))',
            "shard_tokens": f"sum(rate({M_SHARD_TOKENS}{{{sh}}}[{w}]))",
            "admission_wait": f"histogram_quantile({QUANTILE}, sum by (le) (rate({M_GW_WAIT}{{{gw}}}[{w}])))",
            "shard_queue": f"histogram_quantile({QUANTILE}, sum by (le) (rate({M_SHARD_QUEUE}{{{sh}}}[{w}])))",
            "prefill": f"histogram_quantile({QUANTILE}, sum by (le) (rate({M_SHARD_PREFILL}{{{sh}}}[{w}])))",
            **{f"blind:{m}": f"count by ({by}) ({M_SHARD_E2E}{{{sh}}}) unless on ({by}) "
                             f"count by ({by}) ({m}{{{sh}}})" for m in OVERLOAD_HISTOGRAMS},
        }
        names = list(queries)
        answers = await asyncio.gather(*(self.query(queries[n]) for n in names), return_exceptions=True)
        results: dict[str, list[tuple[dict[str, str], float]]] = {}
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, BaseException):
                return self._unreachable(f"prometheus: {answer}")
            results[name] = answer

        def per_member(name: str) -> dict[str, float]:
            return {labels.get(by, ""): value for labels, value in results[name]}

        values = {k: per_member(k) for k in ("running", "waiting", "kv", "max_seqs", "age", "shard_ttft",
                                             "prefix_hit_rate", "prefix_bytes")}
        blind = {m: set(per_member(f"blind:{m}")) for m in OVERLOAD_HISTOGRAMS}
        shards = []
        for labels, up in sorted(results["up"], key=lambda r: r[0].get(by, "")):
            member = labels.get(by, "")
            error = None
            if up < 1:
                error = "scrape failing (up == 0)"
            elif member not in values["waiting"] or member not in values["running"]:
                error = "no engine gauges (still loading?)"
            elif values["age"].get(member, math.inf) > self._stale_after_s:
                error = f"gauges older than {self._stale_after_s:.0f}s"
            elif any(member in lacking for lacking in blind.values()):
                error = overload_histograms_missing(
                    {M_SHARD_E2E} | {m for m, lacking in blind.items() if member not in lacking})
            shards.append(
                ShardSignal(
                    member_id=member,
                    running=values["running"].get(member, math.nan),
                    waiting=values["waiting"].get(member, math.nan),
                    kv_usage=values["kv"].get(member, math.nan),
                    max_num_seqs=values["max_seqs"].get(member, math.nan),
                    ttft_p95_s=_finite(values["shard_ttft"].get(member)),
                    error=error,
                    stale=error is not None,
                    url=member,
                    prefix_hit_rate=_finite(values["prefix_hit_rate"].get(member)),
                    prefix_cache_bytes=values["prefix_bytes"].get(member),
                )
            )
        missing = [
            f"gateway {labels.get(by, '?')}: scrape failing (up == 0)"
            for labels, up in results["gw_up"]
            if up < 1
        ]
        has_gateways = any(up >= 1 for _, up in results["gw_up"])
        demand = {labels.get("tier", ""): v for labels, v in results["demand"]} if has_gateways else {}
        rejected = {labels.get("tier", ""): v for labels, v in results["rejected"]} if has_gateways else {}
        total = sum(demand.values())
        errors = results["errors"][0][1] if results["errors"] else 0.0
        ttft_key, tokens_key = (
            ("gw_ttft", "gw_tokens") if has_gateways else ("all_shard_ttft", "shard_tokens")
        )
        p50_key = "gw_ttft_p50" if has_gateways else "all_shard_ttft_p50"
        return aggregate(
            at=self._wall(),
            shards=shards,
            missing=missing,
            ttft_p95_s=_finite(results[ttft_key][0][1]) if results[ttft_key] else None,
            error_rate=errors / total if has_gateways and total > 0 else None,
            tokens_per_s=_finite(results[tokens_key][0][1]) if results[tokens_key] else None,
            demand=demand,
            rejections=rejected,
            window_s=self.window_s,
            source="prometheus",
            gateway_queue=results["gw_queue"][0][1] if results["gw_queue"] else 0.0,
            shed_per_s=(_finite(results["shed"][0][1]) or 0.0) if has_gateways and results["shed"] else 0.0,
            admission_wait_p95_s=_first(results["admission_wait"]) if has_gateways else None,
            shard_queue_p95_s=_first(results["shard_queue"]),
            prefill_p95_s=_first(results["prefill"]),
            shard_ttft_p95_s=_first(results["all_shard_ttft"]),
            ttft_p50_s=_first(results[p50_key]),
            tpot_s=_first(results["tpot"]),
        )

    def _unreachable(self, why: str) -> Signals:
        return Signals(
            at=self._wall(),
            shards=(),
            healthy_shards=0,
            waiting_per_shard=None,
            ttft_p95_s=None,
            error_rate=None,
            tokens_per_s=None,
            kv_usage=None,
            demand_by_tier={},
            rejections_by_tier={},
            complete=False,
            missing=(why,),
            source="prometheus",
        )


def _first(result: list[tuple[dict[str, str], float]]) -> float | None:
    """The finite value of a one-element answer (a histogram_quantile over no observations is NaN)."""
    return _finite(result[0][1]) if result else None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
