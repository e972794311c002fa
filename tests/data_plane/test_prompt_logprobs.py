"""Prompt logprobs in the torch engine (SamplingParams.prompt_logprobs, vLLM's): each prompt token's logprob and
top-N, the first None, equal to a teacher-forced computation from the runner's logits, across prefill chunks,
and the same on a prompt whose prefix the prefix cache holds (bypassed: a cached prefix has no logits).

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_prompt_logprobs.py -q   # real model
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import torch

from data_plane.shard.engines.base import GenerationOutput, GenerationRequest, SamplingParams
from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine
from tests.support.formats import INVARIANT

TEXT = ("The quick brown fox jumps over the lazy dog. Then the dog wakes up, looks around the quiet farm, "
        "and goes back to sleep under the old oak tree while the fox runs into the forest.")


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[TorchEngine, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    # chunks of 16 tokens: a prompt's logprobs come from several chunks' rows; blocks of 16: its prefix is cached
    eng = TorchEngine(EngineConfig(**INVARIANT, max_num_seqs=4, max_model_len=512, threads=1, prefill_chunk=16,
                                   kv_block_size=16))
    loop.run_until_complete(eng.start())
    yield eng, loop
    loop.run_until_complete(eng.aclose())
    loop.close()


def _run(eng: TorchEngine, loop: asyncio.AbstractEventLoop, ids: list[int],
         params: SamplingParams) -> list[GenerationOutput]:
    async def go() -> list[GenerationOutput]:
        req = GenerationRequest(uuid.uuid4().hex, list(ids), params)
        await eng.prepare(req)
        return [out async for out in eng.generate(req)]
    return loop.run_until_complete(go())


def _reference(eng: TorchEngine, ids: list[int], top_n: int) -> tuple[list[float], list[list[int]]]:
    """Teacher-forced: the runner's logits at every prompt position in one pass (the idle engine's last slot),
    each token's logprob under the position before it, and the top-N ids there."""
    runner = eng._runner
    logits = runner.forward([(runner.max_num_seqs - 1, ids, 0)], [len(ids)])
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    return chosen, torch.topk(lp[:-1], top_n, dim=-1).indices.tolist()


def test_prompt_logprobs_equal_the_teacher_forced_ones_across_chunks_and_a_prefix_hit(
        engine: tuple[TorchEngine, asyncio.AbstractEventLoop]) -> None:
    eng, loop = engine
    ids = eng.encode_text(TEXT)
    assert len(ids) >= 40  # three chunks
    chosen, tops = _reference(eng, ids, 3)

    plain = _run(eng, loop, ids, SamplingParams(temperature=0, max_tokens=2))
    assert all(o.prompt_logprobs is None for o in plain)  # not asked: none, and this prompt's blocks are cached

    for _ in range(2):  # the second: its prefix is in the prefix cache, bypassed
        outs = _run(eng, loop, ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
        first = outs[0].prompt_logprobs
        assert first is not None and all(o.prompt_logprobs is None for o in outs[1:])  # on the first output only
        assert len(first) == len(ids) and first[0] is None
        assert [e.token_id for e in first[1:]] == ids[1:]
        assert [e.logprob for e in first[1:]] == pytest.approx(chosen, abs=1e-4)
        for e, want in zip(first[1:], tops, strict=True):
            assert len(e.top) == 3 and [t.logprob for t in e.top] == sorted((t.logprob for t in e.top), reverse=True)
            assert {t.token_id for t in e.top[:2]} <= set(want)  # ties at the edge of the top 3 aside
        assert outs[-1].cached_tokens == 0  # computed, not loaded
        # the output is the prompt's greedy continuation as without prompt logprobs
        assert "".join(o.text for o in outs) == "".join(o.text for o in plain)

    again = _run(eng, loop, ids, SamplingParams(temperature=0, max_tokens=2))
    assert again[-1].cached_tokens > 0  # the prefix cache still serves the requests that do not ask


def test_a_one_token_prompt_and_no_alternatives(engine: tuple[TorchEngine, asyncio.AbstractEventLoop]) -> None:
    eng, loop = engine
    ids = eng.encode_text("Hello")[:1]
    (first, *_) = _run(eng, loop, ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    assert first.prompt_logprobs == (None,)
    ids = eng.encode_text(TEXT)[:20]
    (first, *_) = _run(eng, loop, ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    assert first.prompt_logprobs is not None and all(e.top == () for e in first.prompt_logprobs[1:])
