"""`switchboard bench memory` proven small: the generator plants one fact per conversation far before
the window, and the gateway's own recall code brings it back (the model-free half of the bench)."""

from __future__ import annotations

import json
from pathlib import Path

from data_plane.bench.memory import FACTS, generate, main


def test_generated_conversations_plant_one_fact_early() -> None:
    p = generate(3, 100)
    assert len(p.messages) == 200 and p.planted_index < 50
    planted = [m for m in p.messages if any(f.split("{")[0] in m["content"] for f, _, _ in FACTS)]
    assert planted == [p.messages[p.planted_index]] and p.answer in planted[0]["content"]
    assert generate(3, 100) == p  # seeded


def test_bench_memory_recall_only(tmp_path: Path, capsys) -> None:
    out = tmp_path / "memory.json"
    main(["--recall-only", "--conversations", "5", "--turns", "100", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["history_tokens_mean"] > 2 * result["budget_tokens"]  # far past the window
    assert result["retrieval_recall"] == {"sliding_window": 0.0, "with_recall": 1.0}
    assert "retrieval recall" in capsys.readouterr().out
