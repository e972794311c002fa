"""`switchboard bench engine --workload quote --speculation on,off`: both engines in one run,
the acceptance report and the on/off ratio (tiny: 2 requests of 16 tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_plane.bench.engine import round_orders
from data_plane.bench.engine_report import pool_rounds
from data_plane.bench.engine_spec import QUOTE_PROMPTS, AcceptanceCounter
from tests.support.bench import ENGINE_ROW_KEYS, needs_model
from tests.support.procs import switchboard


def test_acceptance_counter_report() -> None:
    c = AcceptanceCounter()
    c.on_spec_draft(4, 2)
    c.on_spec_draft(2, 0)
    r = c.report()
    assert (r["spec_drafts"], r["acceptance_rate"], r["mean_accepted_length"]) == (2, 2 / 6, 2.0)
    assert r["accepted_per_pos"] == [0.5, 0.5]
    c.reset()
    assert c.report()["acceptance_rate"] is None and QUOTE_PROMPTS


def test_rounds_alternate_the_order() -> None:
    assert round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    assert round_orders(["a"], 1) == [["a"]]


def _row(system: str, tokens: int, seconds: float, ttft: float, drafts: int = 0, accepted: int = 0,
         per_pos: list[float] | None = None) -> dict[str, object]:
    return {"system": system, "concurrency": 1, "requests": 2, "failed": 0, "output_tokens": tokens,
            "duration_s": seconds, "output_tok_s": tokens / seconds, "ttft_p50_ms": ttft, "tpot_p50_ms": None,
            "mean_output_tokens": tokens / 2, "peak_rss_mb": 100.0 + tokens, "spec_drafts": drafts,
            "spec_draft_tokens": 2 * drafts, "spec_accepted_tokens": accepted,
            "acceptance_rate": accepted / (2 * drafts) if drafts else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None, "accepted_per_pos": per_pos or []}


def test_pool_rounds_sums_tokens_and_time_and_weights_acceptance_by_drafts() -> None:
    rows = [_row("on", 100, 2.0, 50.0, drafts=10, accepted=10, per_pos=[0.6, 0.4]),
            _row("off", 100, 4.0, 40.0), _row("off", 60, 2.0, 60.0),
            _row("on", 60, 1.0, 70.0, drafts=30, accepted=30, per_pos=[0.8, 0.2])]
    pooled = {r["system"]: r for r in pool_rounds(rows)}
    on, off = pooled["on"], pooled["off"]
    assert off["output_tok_s"] == pytest.approx(160 / 6.0) and off["round_tok_s"] == [25.0, 30.0]
    assert (off["requests"], off["rounds"], off["ttft_p50_ms"], off["peak_rss_mb"]) == (4, 2, 50.0, 200.0)
    assert off["tpot_p50_ms"] is None and off["mean_output_tokens"] == 40.0
    assert on["output_tok_s"] == pytest.approx(160 / 3.0)
    assert (on["spec_drafts"], on["acceptance_rate"], on["mean_accepted_length"]) == (40, 0.5, 2.0)
    assert on["accepted_per_pos"] == pytest.approx([(10 * 0.6 + 30 * 0.8) / 40, (10 * 0.4 + 30 * 0.2) / 40])
    assert pool_rounds(rows[1:2]) == rows[1:2]  # one round: the row as it was


@pytest.mark.slow
@needs_model
def test_bench_engine_quote_speculation_on_off(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    run = switchboard("bench", "engine", "--systems", "switchboard", "--workload", "quote", "--speculation",
                      "on,off", "--concurrency", "1", "--max-tokens", "16", "--num-prompts", "2",
                      "--rounds", "2", "--json", str(out), timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "switchboard-spec/switchboard" in run.stdout and "mean acc. len" in run.stdout
    result = json.loads(out.read_text())
    rows = {r["system"]: r for r in result["rows"]}
    assert rows.keys() == {"switchboard", "switchboard-spec"}
    for row in rows.values():
        assert ENGINE_ROW_KEYS <= row.keys() and row["workload"] == "quote"
    assert rows["switchboard"]["spec_drafts"] == 0
    assert rows["switchboard-spec"]["spec_drafts"] > 0 and rows["switchboard-spec"]["acceptance_rate"] > 0
    assert result["ratios"]["switchboard-spec/switchboard"]["1"] > 0
    assert "2 rounds pooled" in run.stdout
    assert [(r["system"], r["round"]) for r in result["round_rows"]] == [
        ("switchboard-spec", 0), ("switchboard", 0), ("switchboard", 1), ("switchboard-spec", 1)]
    for row in rows.values():
        assert row["rounds"] == 2 and len(row["round_tok_s"]) == 2
        assert row["requests"] == 4


@needs_model
def test_bench_verify_prices_a_draft_row(tmp_path: Path) -> None:
    out = tmp_path / "verify.json"
    run = switchboard("bench", "verify", "--batch", "1,2", "--rows", "1,4", "--repeats", "3", "--context", "16",
                      "--json", str(out), timeout=200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "row cost" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["rows_per_slot"]) for r in rows] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    for r in rows:
        assert r["decode_ms"] > 0 and r["verify_ms"] > 0
        assert (r["row_cost"] is None) == (r["rows_per_slot"] == 1)
