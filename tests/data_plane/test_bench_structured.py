"""The structured-output benchmark's corpus and scoring (the run itself: `switchboard bench engine --workload json`).

    .venv/bin/python -m pytest tests/data_plane/test_bench_structured.py -q      # ~5 s (tokenizer only)
"""

from __future__ import annotations

import json

import pytest

from data_plane.bench.engine_structured import _payload, _request, _valid
from data_plane.bench.schema_corpus import CORPUS


@pytest.fixture(scope="module")
def compiler():
    import llguidance.hf
    from transformers import AutoTokenizer

    from data_plane.model_store import resolve_model
    from data_plane.shard.engines.grammar import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    return GrammarCompiler(llguidance.hf.from_tokenizer(tok))


def test_corpus_is_fifty_distinct_schemas_that_all_compile(compiler) -> None:
    from data_plane.shard.engines.grammar import GrammarKind, GrammarSpec

    assert len(CORPUS) >= 50 and len({n for n, _ in CORPUS}) == len(CORPUS)
    for workload in ("json", "tools"):
        for name, schema in CORPUS:
            plan = _request(workload, name, schema, True).output_plan()
            assert plan.constraint is not None
            compiler._build(GrammarSpec(GrammarKind(plan.constraint.kind), plan.constraint.text))  # raises if refused


def test_scoring_reads_json_and_tool_envelopes() -> None:
    name, schema = next((n, s) for n, s in CORPUS if n == "sentiment")
    good = {"sentiment": "positive", "confidence": 0.9}
    assert _valid(_payload("json", json.dumps(good)), schema)
    assert not _valid(_payload("json", '{"sentiment": "happy", "confidence": 1}'), schema)
    assert not _valid(_payload("json", '{"sentiment": "pos'), schema)  # cut by the token limit
    envelope = json.dumps({"tool_calls": [{"name": name, "arguments": good}]})
    assert _valid(_payload("tools", envelope), schema)
    assert not _valid(_payload("tools", '{"response": "no"}'), schema)
