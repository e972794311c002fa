"""`switchboard bench engine --workload quote --speculation on,off`: both engines in one run,
the acceptance report and the on/off ratio (tiny: 2 requests of 16 tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


@pytest.mark.slow
@needs_model
def test_bench_engine_quote_speculation_on_off(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    run = switchboard("bench", "engine", "--systems", "switchboard", "--workload", "quote", "--speculation",
                      "on,off", "--concurrency", "1", "--max-tokens", "16", "--num-prompts", "2",
                      "--json", str(out), timeout=200)
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
