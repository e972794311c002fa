"""Jump-forward in the real torch engine (in-process, float32: greedy output is batch-invariant): the
tokens a grammar forces are verified as one multi-token pass instead of one decode step each, and the
text is exactly what one token a step gives, constrained rows batched with unconstrained ones (greedy and
seeded sampling); with speculation off. And the shard's `--jump-forward/--no-jump-forward` reaching the
scheduler's config (no model).

    .venv/bin/python -m pytest tests/data_plane/test_grammar_jump_forward.py -q      # ~1 min (real model)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from data_plane.bench.schema_corpus import CORPUS
from data_plane.shard.engines.base import GenerationRequest, SamplingParams
from data_plane.shard.engines.grammar import GrammarKind, GrammarSpec
from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine
from tests.support.formats import INVARIANT

SCHEMAS = dict(CORPUS)


class Counted:
    """The engine with its forward passes counted."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = TorchEngine(EngineConfig(**INVARIANT, max_num_seqs=4, max_model_len=1024,
                                               prefix_caching=False))
        self.loop.run_until_complete(self.engine.start())
        self.passes = 0
        runner = self.engine._executor.runner  # type: ignore[union-attr]
        forward = runner.forward

        def counting(*a: Any, **k: Any) -> Any:
            self.passes += 1
            return forward(*a, **k)

        runner.forward = counting

    def jump_forward(self, on: bool) -> None:
        sched = self.engine.scheduler
        sched.config = dataclasses.replace(sched.config, jump_forward=on)

    def run(self, jobs: list[tuple[str, SamplingParams]]) -> list[str]:
        async def one(ask: str, params: SamplingParams) -> str:
            ids = self.engine.encode_chat([{"role": "user", "content": ask}])
            req = GenerationRequest(uuid.uuid4().hex, ids, params)
            await self.engine.prepare(req)
            return "".join([out.text async for out in self.engine.generate(req)])

        async def all_jobs() -> list[str]:
            return list(await asyncio.gather(*(one(a, p) for a, p in jobs)))

        return self.loop.run_until_complete(all_jobs())


@pytest.fixture(scope="module")
def counted() -> Iterator[Counted]:
    c = Counted()
    yield c
    c.loop.run_until_complete(c.engine.aclose())
    c.loop.close()


def constrained(name: str) -> tuple[str, SamplingParams]:
    schema = SCHEMAS[name]
    return (f"Write one example of a {name} as JSON.",
            SamplingParams(temperature=0.0, max_tokens=80,
                           grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))))


def test_forced_tokens_take_fewer_passes_and_give_the_same_text(counted: Counted) -> None:
    jobs = [constrained("person"), constrained("address"), constrained("stripe_charge"),
            ("Tell me a short story about a fox.", SamplingParams(temperature=0.9, seed=7, max_tokens=60))]
    results = {}
    for on in (False, True):
        counted.jump_forward(on)
        counted.passes = 0
        results[on] = (counted.run(jobs), counted.passes)
    (off_texts, off_passes), (on_texts, on_passes) = results[False], results[True]
    assert on_texts == off_texts  # the verify pass keeps exactly one-token-a-step's text (and the seeded row's)
    assert all(t.startswith("{") for t in on_texts[:3]), on_texts
    assert on_passes < off_passes * 0.9, (on_passes, off_passes)


@pytest.mark.parametrize(("argv", "env", "on"), [
    ([], None, True),
    (["--no-jump-forward"], None, False),
    (["--jump-forward"], "false", True),  # the flag wins over the environment
    ([], "false", False),
])
def test_the_shard_flag_reaches_the_scheduler(argv: list[str], env: str | None, on: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`switchboard shard --no-jump-forward` -> ShardSettings -> EngineConfig -> SchedulerConfig, parsed
    and built as the shard's main does (the engine built, no model loaded)."""
    from data_plane.common.settings_cli import parse_settings
    from data_plane.shard.engine_factory import build_engine
    from data_plane.shard.settings import ShardSettings

    monkeypatch.delenv("SWITCHBOARD_SHARD_JUMP_FORWARD", raising=False)
    if env is not None:
        monkeypatch.setenv("SWITCHBOARD_SHARD_JUMP_FORWARD", env)
    settings = parse_settings(ShardSettings, argv, "switchboard shard")
    assert settings.jump_forward is on
    engine = build_engine(settings, None)
    assert isinstance(engine, TorchEngine)
    assert engine.config.jump_forward is on and engine.scheduler.config.jump_forward is on
