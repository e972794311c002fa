"""A pipelined shard as others see it: its stages in the registration metadata, a span per stage.

    meta.update(stage_meta(engine, host))     # {"pipeline_stages": "0@10.0.0.5:0-15,1@10.0.0.5:15-30"}
    record_stage_spans(tracer, span, out.stages, ranges)   # children of the request's shard.generate span

The console's Cluster page (admin_ui/views/cluster.py, which parses it) reads `pipeline_stages` from membership:
stage index, the host it runs on and its layer range [first, end), one entry a stage. Stages 1..N-1
started by stage 0 are its children (data_plane/shard/engines/pipeline.py) and share its host; a
stage that joined from another host (`switchboard stage --join ... --bind ADDR`) is named by ADDR.

Each stage's span (`shard.pipeline_stage`) runs from the first pass of the request that reached the
stage to the last that left it (the stages' wall clocks), with the stage's compute in those passes
(`switchboard.stage.busy_s`) and how many passes there were; a trace of a pipelined request
therefore shows the shard's span with one child per stage.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace

from data_plane.shard.engines.base import StageSpan

log = logging.getLogger(__name__)

META_KEY = "pipeline_stages"


def stage_ranges(engine: Any) -> tuple[tuple[int, int], ...]:
    """The layer range of each stage of the engine's pipeline (empty without one)."""
    group = getattr(engine, "pipeline", None)
    return tuple(group.spec.ranges) if group is not None else ()


def stage_meta(engine: Any, host: str) -> dict[str, str]:
    """Registration metadata naming each stage, its host and its layers (nothing without a pipeline)."""
    ranges = stage_ranges(engine)
    if not ranges:
        return {}
    info = getattr(getattr(engine, "pipeline", None), "stage_info", {})  # a stage that joined from another host
    hosts = [str(info.get(i, {}).get("host") or host) if i else host for i in range(len(ranges))]
    return {META_KEY: ",".join(f"{i}@{h}:{first}-{end}" for i, (h, (first, end)) in enumerate(zip(hosts, ranges)))}


def record_stage_spans(tracer: trace.Tracer, parent: trace.Span, stages: Sequence[StageSpan],
                       ranges: Sequence[tuple[int, int]]) -> None:
    """One child span of `parent` per stage of a finished request."""
    if not stages:
        return
    ctx = trace.set_span_in_context(parent)
    for st in stages:
        first, end = ranges[st.stage] if st.stage < len(ranges) else (0, 0)
        span = tracer.start_span("shard.pipeline_stage", context=ctx, start_time=int(st.start * 1e9), attributes={
            "switchboard.stage": st.stage, "switchboard.stage.layers": f"{first}-{end}",
            "switchboard.stage.busy_s": round(st.busy_s, 6), "switchboard.stage.passes": st.passes})
        span.end(end_time=int(max(st.end, st.start) * 1e9))
    log.debug("%d stage spans: busy %s s", len(stages), [round(st.busy_s, 4) for st in stages])
