"""`switchboard bench response-cache`'s bookkeeping (the run itself is a benchmark, not a test): the
replayed workload's repeat share, and the summary's hit latency and shard work saved."""

from __future__ import annotations

from data_plane.bench.response_cache import report, workload


def test_workload_repeats_earlier_prompts_at_the_share_asked() -> None:
    seq = workload(1000, 0.3, seed=1)
    assert seq == workload(1000, 0.3, seed=1) and len(seq) == 1000
    repeats = len(seq) - len(set(seq))
    assert 0.26 < repeats / len(seq) < 0.34
    first = {}
    for i, k in enumerate(seq):
        first.setdefault(k, i)
    assert sorted(first) == list(range(len(first)))  # fresh prompts are numbered in order
    assert workload(50, 0.0) == list(range(50))


def test_report_hit_latency_and_work_saved() -> None:
    seq = [0, 1, 0, 2, 1]
    off = [{"i": i, "ms": 100.0, "status": 200, "hit": False} for i in range(5)]
    on = [{"i": 0, "ms": 100.0, "status": 200, "hit": False}, {"i": 1, "ms": 100.0, "status": 200, "hit": False},
          {"i": 2, "ms": 3.0, "status": 200, "hit": True}, {"i": 3, "ms": 100.0, "status": 200, "hit": False},
          {"i": 4, "ms": 5.0, "status": 200, "hit": True}]
    phases = {"off": {"rows": off, "shard": {"requests": 5, "generation_tokens": 80, "prompt_tokens": 300},
                      "lookups": {}},
              "on": {"rows": on, "shard": {"requests": 3, "generation_tokens": 48, "prompt_tokens": 180},
                     "lookups": {"hit": 2.0, "miss": 3.0, "hit_seconds_sum:local": 0.0001,
                                 "hit_seconds_count:local": 2.0}}}
    s = report(seq, phases)
    assert s["repeats"] == 2 and s["hit_share"] == 0.4 and s["gateway_hits"] == 2.0
    assert s["on_hits"]["p50_ms"] == 4.0 and s["hit_p50_within_target"] is True
    assert s["shard_work_saved"]["requests"] == 0.4 and s["shard_work_saved"]["generation_tokens"] == 0.4
    assert s["off"]["p50_ms"] == 100.0 and s["errors"] == {"off": 0, "on": 0}
    assert s["gateway_hit_lookup"] == {"local": {"hits": 2.0, "mean_ms": 0.05},
                                       "nodes": {"hits": 0.0, "mean_ms": None}}
