"""The pipeline's observability against a real 2-stage torch shard (--pipeline-parallel-size 2) and a
real Prometheus: every panel of the Data plane dashboard's pipeline row returns data; a request's
trace holds the shard's span with one child span per stage; kill -9 of stage 1 fires
SwitchboardPipelineStageDown (rules loaded with `for: 0s`, 1 s evaluation) before the shard exits.

Skips when the `prometheus` binary is absent (`apt-get install prometheus`, or `make sysdeps`).
"""

from __future__ import annotations

import math
import os
import signal
import uuid
from pathlib import Path

import httpx
import pytest

from dashboards.catalogue import JOBS
from tests.observability.exprs import NEEDS_PIPELINE, dashboard_exprs, fast_rules, substitute
from tests.support.formats import INVARIANT_ARGS
from tests.support.pipeline import exit_within, stage_pids
from tests.support.procs import CLUSTER_HEADERS, Service
from tests.support.prometheus import PROMETHEUS, Prometheus
from tests.support.waits import eventually

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")


def _chat(shard: Service, content: str, trace_id: str) -> None:
    headers = {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01", **CLUSTER_HEADERS}
    r = httpx.post(shard.url + "/v1/chat/completions", headers=headers, timeout=120.0,
                   json={"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text


def test_pipeline_row_spans_and_stage_down_alert(tmp_path: Path) -> None:
    shard = Service(["shard", *INVARIANT_ARGS, "--threads", "1", "--pipeline-parallel-size", "2",
                     "--max-model-len", "512", "--pipeline-exit-linger-s", "4"], ready_timeout=240)
    shard.start()
    prometheus = Prometheus(tmp_path, {JOBS["shard"]: [shard.url.removeprefix("http://")]}, fast_rules(tmp_path))
    prometheus.start()
    try:
        prometheus.wait_ready()
        trace_id = uuid.uuid4().hex
        _chat(shard, "Name three colors.", trace_id)
        count = "sum(switchboard_shard_pipeline_pass_seconds_count)"
        eventually(lambda: prometheus.value(count) > 0, 20, what="the first passes scraped")
        seen = prometheus.value(count)
        _chat(shard, "What is 2+2?", uuid.uuid4().hex)  # a second wave: every rate() has an increase
        eventually(lambda: prometheus.value(count) > seen, 20, what="the second wave scraped")

        problems = []
        for where, expr in dashboard_exprs({"data-plane.json"}):
            if NEEDS_PIPELINE not in expr:
                continue
            result = prometheus.query(substitute(expr))["data"]["result"]
            values = [float(sample["value"][1]) for sample in result]
            if not values or all(math.isnan(v) for v in values):
                problems.append(f"{where}: no data\n    {expr}")
        assert not problems, "\n".join(problems)
        share = prometheus.query('1 - sum by (stage) (rate(switchboard_shard_pipeline_stage_step_seconds_sum[1m])) '
                                 '/ scalar(sum(rate(switchboard_shard_pipeline_active_seconds_total[1m])))')
        shares = {s["metric"]["stage"]: float(s["value"][1]) for s in share["data"]["result"]}
        assert set(shares) == {"0", "1"} and all(0.0 <= v < 1.0 for v in shares.values()), shares

        spans = httpx.get(shard.url + "/debug/spans", params={"trace_id": trace_id}, headers=CLUSTER_HEADERS).json()
        (generate,) = [s for s in spans if s["name"] == "shard.generate"]
        stages = sorted((s for s in spans if s["name"] == "shard.pipeline_stage"),
                        key=lambda s: s["attributes"]["switchboard.stage"])
        assert [s["attributes"]["switchboard.stage"] for s in stages] == [0, 1]
        assert [s["attributes"]["switchboard.stage.layers"] for s in stages] == ["0-11", "11-30"]
        for s in stages:
            assert s["parent_span_id"] == generate["span_id"]
            assert s["attributes"]["switchboard.stage.passes"] >= 6  # the prompt's pass and a pass per token
            assert s["attributes"]["switchboard.stage.busy_s"] > 0

        (stage,) = stage_pids(shard)
        os.kill(stage, signal.SIGKILL)
        eventually(lambda: any(a["labels"].get("stage") == "1" for a in prometheus.alerts("SwitchboardPipelineStageDown")),
                   15, interval_s=0.2, what="SwitchboardPipelineStageDown firing", detail=prometheus.log_tail)
        assert exit_within(shard, 20) == 1, shard.log_tail()
    finally:
        prometheus.stop()
        shard.stop()
