"""Priority inside the torch engine: a short request of a higher tier is not stuck behind the chunked
prefill of a long lower-tier prompt admitted before it (the head-of-line blocking that kept
enterprise TTFT high under a 2x mixed load), and moving the chunked sequence's slot changes no output.

    .venv/bin/python -m pytest tests/data_plane/test_engine_priority.py -q      # ~20 s (real model)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest

from data_plane.shard.engines.base import GenerationRequest, SamplingParams
from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine

LONG = [{"role": "user", "content": "Summarise the following notes. " + "The meeting covered budgets, hiring, "
         "the roadmap for the next two quarters, and the open questions about the data migration. " * 30}]
SHORT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[TorchEngine, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    # float32: batch-invariant greedy output; a small prefill chunk so the long prompt takes many steps
    eng = TorchEngine(EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=1024, prefill_chunk=64,
                                   prefix_caching=False))
    loop.run_until_complete(eng.start())
    yield eng, loop
    loop.run_until_complete(eng.aclose())
    loop.close()


async def _run(eng: TorchEngine, messages: list[dict[str, str]], priority: int,
               delay_s: float = 0.0) -> tuple[str, float]:
    await asyncio.sleep(delay_s)
    req = GenerationRequest(uuid.uuid4().hex, eng.encode_chat(messages), GREEDY, priority=priority)
    t0, first, text = time.perf_counter(), None, ""
    async for out in eng.generate(req):
        if out.text and first is None:
            first = time.perf_counter()
        text += out.text
    return text, (first or time.perf_counter()) - t0


def test_a_higher_priority_request_overtakes_a_chunked_prefill(engine) -> None:  # type: ignore[no-untyped-def]
    eng, loop = engine
    assert len(eng.encode_chat(LONG)) > 10 * 64  # many prefill chunks (~770 tokens)
    solo_long, long_alone_s = loop.run_until_complete(_run(eng, LONG, priority=2))
    solo_short, _ = loop.run_until_complete(_run(eng, SHORT, priority=0))

    async def together() -> list[tuple[str, float]]:
        return list(await asyncio.gather(_run(eng, LONG, priority=2), _run(eng, SHORT, priority=0, delay_s=0.05)))

    (long_text, long_ttft), (short_text, short_ttft) = loop.run_until_complete(together())
    print(f"\nlong prompt alone: first token {long_alone_s * 1000:.0f} ms; together: long {long_ttft * 1000:.0f} ms,"
          f" short (higher priority, sent 50 ms later) {short_ttft * 1000:.0f} ms")
    assert short_ttft + 0.05 < long_ttft, "the short request waited for the whole chunked prefill"
    assert long_text == solo_long and short_text == solo_short  # the slot move changes nothing


def test_the_same_priority_does_not_overtake(engine) -> None:  # type: ignore[no-untyped-def]
    eng, loop = engine

    async def together() -> list[tuple[str, float]]:
        return list(await asyncio.gather(_run(eng, LONG, priority=1), _run(eng, SHORT, priority=1, delay_s=0.05)))

    (_, long_ttft), (_, short_ttft) = loop.run_until_complete(together())
    assert short_ttft + 0.05 >= long_ttft * 0.9  # FIFO within a priority: the short one waits its turn
