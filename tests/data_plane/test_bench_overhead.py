"""`switchboard bench overhead` at tiny sizes (no LiteLLM), and its aggregation rule.

    .venv/bin/python -m pytest tests/data_plane/test_bench_overhead.py -q      # ~10 s

These check the shape of what the benchmark reports, not any number.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_plane import bench
from data_plane.bench.overhead import DIRECT, SWITCHBOARD, Batch, aggregate, check_targets


def _rounds(direct: list[float], switchboard: list[float]) -> list[Batch]:
    """Rounds whose requests all took the given time (so p50 == p99 in each)."""
    out = []
    for r, (d, sb) in enumerate(zip(direct, switchboard)):
        out += [Batch(DIRECT, 1, r, latencies_ms=[d] * 3, ttfts_ms=[d] * 3),
                Batch(SWITCHBOARD, 1, r, latencies_ms=[sb] * 3, ttfts_ms=[sb] * 3)]
    return out


def test_added_latency_is_the_median_over_rounds_of_same_round_differences() -> None:
    rows = {r["system"]: r for r in aggregate(_rounds([1.0, 5.0, 1.0], [2.0, 8.0, 11.0]))}  # +1, +3, +10
    assert rows[SWITCHBOARD]["added_p50_ms"] == 3.0  # median of (+1, +3, +10), not 8 - 1
    assert rows[SWITCHBOARD]["added_p99_iqr_ms"] == [2.0, 6.5]
    assert rows[SWITCHBOARD]["p50_ms"] == 8.0
    assert rows[DIRECT]["added_p99_ms"] == 0.0


def test_targets_pass_fail_or_inconclusive_by_the_rounds_quartiles() -> None:
    rows = aggregate(_rounds([1.0, 1.0, 1.0], [2.0, 2.2, 4.0]))  # +1, +1.2, +3: IQR 1.1..2.1
    checks = {c["target"]: c for c in check_targets(rows, [1])}
    assert checks["c=1 added p50 <= 1.5 ms"]["verdict"] == "inconclusive"
    assert checks["c=1 added p99 <= 5 ms"]["ok"] is True
    assert checks["c=16 added p99 <= 25 ms"]["verdict"] == "not measured"
    assert checks["c=1 added p99 <= 1/3 of litellm's"]["ok"] is None  # no litellm row
    rows = aggregate(_rounds([1.0, 1.0, 1.0], [9.0, 10.0, 30.0]))
    assert {c["target"]: c["ok"] for c in check_targets(rows, [1])}["c=1 added p99 <= 5 ms"] is False


def test_ttft_targets_need_a_paced_engine() -> None:
    rows = aggregate(_rounds([40.0, 40.0, 40.0], [42.0, 43.0, 44.0]))  # TTFT +2, +3, +4
    instant = {c["target"]: c for c in check_targets(rows, [1])}
    assert instant["c=1 added TTFT p50 <= 5 ms"]["verdict"] == "not measured"
    paced = {c["target"]: c for c in check_targets(rows, [1], paced=True)}
    assert paced["c=1 added TTFT p50 <= 5 ms"]["ok"] is True and paced["c=1 added TTFT p50 <= 5 ms"]["value_ms"] == 3.0
    rows = aggregate(_rounds([40.0, 40.0, 40.0], [140.0, 150.0, 160.0]))  # a hold-back of ~100 ms
    paced = {c["target"]: c for c in check_targets(rows, [1], paced=True)}
    assert paced["c=1 added TTFT p99 <= 15 ms"]["verdict"] == "fail"


def test_bench_overhead_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "overhead.json"
    bench.main(["overhead", "--no-litellm", "--requests", "4", "--rounds", "2", "--concurrency", "1,2",
                "--token-interval-ms", "5", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "added p99 ms" in printed and "targets (switchboard):" in printed
    assert "litellm skipped (--no-litellm)" in printed
    result = json.loads(out.read_text())
    rows = {(r["system"], r["concurrency"]): r for r in result["rows"]}
    assert rows.keys() == {(s, c) for s in (DIRECT, SWITCHBOARD) for c in (1, 2)}
    for (system, _), row in rows.items():
        assert {"system", "concurrency", "added_p50_ms", "added_p99_ms", "p50_ms", "p99_ms"} <= row.keys()
        assert row["errors"] == 0 and row["requests"] == 2 * 4
        assert row["p99_ms"] >= row["p50_ms"] > 0
        assert row["content_chunks"] >= 1  # every answer streamed text
        if system == SWITCHBOARD:
            assert row["proxy_cpu_ms_per_req"] is not None
            # paced tokens go out as they come, through the default output filter: a 16-word reply
            # (shorter than the old 66-character hold-back) arrives in many chunks, not in one
            assert row["content_chunks"] >= 8, row
            assert row["added_ttft_p50_ms"] is not None
    assert len(result["per_round"]) == 2 * 2 * 2
    assert result["config"]["systems"] == [DIRECT, SWITCHBOARD]
    assert {c["target"] for c in result["targets"]} >= {"c=1 added p50 <= 1.5 ms", "c=16 added p99 <= 25 ms",
                                                        "c=1 added TTFT p50 <= 5 ms"}
    assert result["config"]["token_interval_ms"] == 5
