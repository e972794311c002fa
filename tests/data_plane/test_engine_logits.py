"""Per-request logits processing in the torch engine (real model, fp32): grammar-constrained output
beside unconstrained sequences in one batch, penalties, logit_bias, min_tokens / ignore_eos, seeds,
logprobs, and the grammar compiler's cache and refusals.

    .venv/bin/python -m pytest tests/data_plane/test_engine_logits.py -q      # ~30 s (real model)
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import uuid
from collections.abc import Iterator

import pytest

from data_plane.shard.engines.base import GenerationOutput, GenerationRequest, SamplingParams
from data_plane.shard.engines.grammar import GrammarError, GrammarKind, GrammarSpec
from data_plane.shard.engines.torch_config import StepListener
from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine
from tests.support.formats import INVARIANT

ASK = [{"role": "user", "content": "Give me a person as JSON with a name and an age."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "role": {"enum": ["admin", "user"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}


class Seen(StepListener):
    def __init__(self) -> None:
        self.compiles: list[str] = []
        self.masks: list[int] = []

    def on_grammar_compile(self, kind: str, seconds: float, outcome: str) -> None:
        self.compiles.append(outcome)

    def on_grammar_mask(self, rows: int, seconds: float) -> None:
        self.masks.append(rows)


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[TorchEngine, asyncio.AbstractEventLoop, Seen]]:
    loop = asyncio.new_event_loop()
    seen = Seen()
    eng = TorchEngine(EngineConfig(**INVARIANT, max_num_seqs=8, max_model_len=1024, threads=1,
                                   speculation="ngram"), seen)
    loop.run_until_complete(eng.start())
    yield eng, loop, seen
    loop.run_until_complete(eng.aclose())
    loop.close()


def _run(eng: TorchEngine, loop: asyncio.AbstractEventLoop, messages: list[dict[str, str]],
         params: SamplingParams) -> tuple[str, GenerationOutput, list]:
    async def go() -> tuple[str, GenerationOutput, list]:
        req = GenerationRequest(uuid.uuid4().hex, eng.encode_chat(messages), params)
        await eng.prepare(req)
        text: list[str] = []
        last = None
        lps: list = []
        async for out in eng.generate(req):
            text.append(out.text)
            lps.extend(out.logprobs)
            last = out
        assert last is not None
        return "".join(text), last, lps
    return loop.run_until_complete(go())


def _many(eng: TorchEngine, loop: asyncio.AbstractEventLoop, jobs: list[tuple[list, SamplingParams]]) -> list[str]:
    async def one(messages: list, params: SamplingParams) -> str:
        req = GenerationRequest(uuid.uuid4().hex, eng.encode_chat(messages), params)
        await eng.prepare(req)
        return "".join([o.text async for o in eng.generate(req)])

    async def go() -> list[str]:
        return list(await asyncio.gather(*(one(m, p) for m, p in jobs)))
    return loop.run_until_complete(go())


def test_json_schema_output_is_valid_beside_unconstrained_rows(engine) -> None:
    eng, loop, seen = engine
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    alone = _run(eng, loop, ASK, plain)[0]
    outs = _many(eng, loop, [(ASK, SamplingParams(max_tokens=80, temperature=0.0, grammar=spec)),
                             (ASK, plain),
                             (ASK, SamplingParams(max_tokens=80, temperature=0.8, seed=3, grammar=spec))])
    for text in (outs[0], outs[2]):
        obj = json.loads(text)
        assert set(obj) == {"name", "age", "role"} and isinstance(obj["age"], int) and obj["role"] in ("admin", "user")
    assert outs[1] == alone  # the unconstrained row in the same batch is untouched
    assert max(seen.masks) >= 2  # two constrained rows masked in one step
    assert "cache_hit" in seen.compiles


def test_regex_choice_and_json_object(engine) -> None:
    eng, loop, _ = engine
    text = _run(eng, loop, ASK, SamplingParams(max_tokens=20, temperature=0.0,
                                               grammar=GrammarSpec(GrammarKind.REGEX, r"[0-9]{3}-[a-z]{2}")))[0]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)
    text = _run(eng, loop, ASK, SamplingParams(max_tokens=10, temperature=1.0, seed=1,
                                               grammar=GrammarSpec(GrammarKind.CHOICE, '["yes", "no"]')))[0]
    assert text in ("yes", "no")
    text, last, _ = _run(eng, loop, ASK, SamplingParams(max_tokens=60, temperature=0.0,
                                                        grammar=GrammarSpec(GrammarKind.JSON_OBJECT, '{"type": "object"}')))
    if last.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_grammar_refusals_name_the_problem(engine) -> None:
    eng, loop, seen = engine

    async def compile_(spec: GrammarSpec) -> None:
        assert eng.grammars is not None
        await eng.grammars.compile(spec)

    bad = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object", "not": {"type": "string"},
                                                           "uniqueItems": True}))
    with pytest.raises(GrammarError, match="not.*uniqueItems|uniqueItems.*not") as info:
        loop.run_until_complete(compile_(bad))
    assert info.value.reason == "unsupported"
    with pytest.raises(GrammarError) as info:
        loop.run_until_complete(compile_(GrammarSpec(GrammarKind.REGEX, "(unclosed")))
    assert info.value.reason == "invalid"
    with pytest.raises(GrammarError) as info:
        loop.run_until_complete(compile_(GrammarSpec(GrammarKind.JSON_SCHEMA, " " * 70_000 + "{}")))
    assert info.value.reason == "too_large"
    assert "unsupported" in seen.compiles


def test_penalties_bias_and_eos_controls(engine) -> None:
    eng, loop, _ = engine
    base = SamplingParams(max_tokens=30, temperature=0.0)
    plain = _run(eng, loop, ASK, base)[0]
    penal = _run(eng, loop, ASK, SamplingParams(max_tokens=30, temperature=0.0, frequency_penalty=2.0,
                                                presence_penalty=1.0, repetition_penalty=1.3))[0]
    assert penal != plain
    first = eng._tokenizer.encode(plain, add_special_tokens=False)[0]
    biased = _run(eng, loop, ASK, SamplingParams(max_tokens=5, temperature=0.0, logit_bias=((first, -100.0),)))[0]
    assert eng._tokenizer.encode(biased, add_special_tokens=False)[0] != first
    forced = _run(eng, loop, ASK, SamplingParams(max_tokens=3, temperature=0.0, logit_bias=((28, 100.0),)))[0]
    assert forced == eng._tokenizer.decode([28, 28, 28])
    short = [{"role": "user", "content": "Say just OK."}]
    _, last, _ = _run(eng, loop, short, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert last.finish_reason == "length" and last.completion_tokens == 40
    _, last, _ = _run(eng, loop, short, SamplingParams(max_tokens=40, temperature=0.0, min_tokens=25))
    assert last.completion_tokens >= 25


def test_seed_same_text_and_logprobs(engine) -> None:
    eng, loop, _ = engine
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, logprobs=True, top_logprobs=3)
    a, last_a, lps = _run(eng, loop, ASK, p)
    b = _run(eng, loop, ASK, p)[0]
    assert a == b
    assert len(lps) == last_a.completion_tokens - (1 if last_a.finish_reason == "stop" else 0) or len(lps) == 16
    for entry in lps:
        assert entry.logprob <= 0 and len(entry.top) == 3
        assert entry.top[0].logprob >= entry.top[1].logprob >= entry.top[2].logprob
        assert entry.logprob <= entry.top[0].logprob + 1e-5
    greedy = _run(eng, loop, ASK, SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=1))[2]
    assert all(e.token_id == e.top[0].token_id and math.isclose(e.logprob, e.top[0].logprob) for e in greedy)
