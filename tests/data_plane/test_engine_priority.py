"""Priority inside the torch engine: a request of a higher tier is not stuck behind the chunked
prefill of a long lower-tier prompt admitted before it (the head-of-line blocking that kept
enterprise TTFT high under a 2x mixed load): a short one is prefilled ahead of it, a long one
preempts it (the chunked one is parked with its KV and resumed); lower tiers' decode passes yield
to a higher tier's prefill; a short prompt of the *same* tier shares the chunk's step (torch_beside),
a long one waits its turn. None of it changes any output (fp32 greedy, against solo runs).

    .venv/bin/python -m pytest tests/data_plane/test_engine_priority.py -q      # ~20 s (real model)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest

from data_plane.shard.engines.base import GenerationRequest, SamplingParams
from data_plane.shard.engines.torch_config import StepListener
from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine
from tests.support.formats import INVARIANT

LONG = [{"role": "user", "content": "Summarise the following notes. " + "The meeting covered budgets, hiring, "
         "the roadmap for the next two quarters, and the open questions about the data migration. " * 30}]
LONG_B = [{"role": "user", "content": "Rewrite this report in plain words. " + "The harbour town kept its "
           "lighthouse lit through every storm of the winter, and the keeper wrote down each ship. " * 20}]
SHORT = [{"role": "user", "content": "What is the capital of France?"}]


class Preemptions(StepListener):
    """Counts the engine's priority preemptions by kind, the prompts prefilled beside a chunked one, and
    (once `engine` is set) the chunked prompt's progress at each prefill pass (engine thread)."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.beside = 0
        self.engine: TorchEngine | None = None
        self.passes: list[tuple[str, int, int]] = []  # (chunked request id, its tokens prefilled, pass size)

    def on_preempt(self, kind: str) -> None:
        self.kinds.append(kind)

    def on_prefill_beside(self, prompts: int) -> None:
        self.beside += prompts

    def on_step(self, batch_size: int, step_s: float, kind: str) -> None:
        p = self.engine._prefilling if self.engine is not None else None
        if kind == "prefill" and p is not None:
            self.passes.append((p.req.request_id, p.prefilled, batch_size))


GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[TorchEngine, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    # float32: batch-invariant greedy output; a small prefill chunk so the long prompt takes many steps
    # beside_prefill_share 0.75: a 37-token SHORT fits beside a chunk of 64 (the chunk keeps >= 16)
    listener = Preemptions()
    eng = TorchEngine(EngineConfig(**INVARIANT, max_num_seqs=4, max_model_len=1024, prefill_chunk=64,
                                   beside_prefill_share=0.75, prefix_caching=False), listener=listener)
    listener.engine = eng
    loop.run_until_complete(eng.start())
    yield eng, loop
    loop.run_until_complete(eng.aclose())
    loop.close()


async def _run(eng: TorchEngine, messages: list[dict[str, str]], priority: int, delay_s: float = 0.0,
               params: SamplingParams = GREEDY, request_id: str | None = None) -> tuple[str, float]:
    await asyncio.sleep(delay_s)
    req = GenerationRequest(request_id or uuid.uuid4().hex, eng.encode_chat(messages), params, priority=priority)
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


def test_a_short_prompt_of_the_same_priority_is_prefilled_beside_a_chunked_one(engine) -> None:  # type: ignore[no-untyped-def]
    """It used to be FIFO within a priority (the short one waited for the long one's last chunk, which
    kept enterprise TTFT p95 at 2x above its bound). Now a short prompt of the same priority shares the
    chunk's step and pass, the long one still progresses every step, and neither output changes."""
    eng, loop = engine
    listener = eng.listener
    assert isinstance(listener, Preemptions)
    solo_long, long_alone_s = loop.run_until_complete(_run(eng, LONG, priority=1))
    solo_short, _ = loop.run_until_complete(_run(eng, SHORT, priority=1))
    beside0, listener.passes = listener.beside, []

    (long_text, long_ttft), (short_text, short_ttft) = _second_during_prefill(eng, loop, (LONG, 1), (SHORT, 1),
                                                                                first_id="long-1")
    print(f"\nlong prompt alone: first token {long_alone_s * 1000:.0f} ms; together: long {long_ttft * 1000:.0f} ms,"
          f" short (same priority, sent during its chunked prefill) {short_ttft * 1000:.0f} ms")
    assert listener.beside - beside0 == 1  # prefilled beside the chunk, not after its last one
    assert short_ttft < long_ttft / 2
    mine = [(done, size) for rid, done, size in listener.passes if rid == "long-1"]
    assert any(size == 2 for _, size in mine)  # one pass held the short prompt and the chunk
    progress = [done for done, _ in mine]
    assert progress == sorted(set(progress)), progress  # the long one advanced at every pass, shared or not
    assert long_text == solo_long and short_text == solo_short  # fp32: the shared pass changes nothing


def test_a_long_prompt_of_the_same_priority_still_waits_its_turn(engine) -> None:  # type: ignore[no-untyped-def]
    """Only prompts that fit the beside share join a chunked prefill; a second long one is FIFO."""
    eng, loop = engine
    listener = eng.listener
    assert isinstance(listener, Preemptions)
    beside0 = listener.beside

    (_, first_ttft), (_, second_ttft) = _second_during_prefill(eng, loop, (LONG, 1), (LONG_B, 1))
    assert listener.beside == beside0  # too long for the share: never prefilled beside the first one
    assert second_ttft >= first_ttft * 0.5  # it waited for the first one's prefill


def _kinds(eng: TorchEngine) -> list[str]:
    listener = eng.listener
    assert isinstance(listener, Preemptions)
    kinds, listener.kinds = listener.kinds, []
    return kinds


async def _when_prefilling(eng: TorchEngine, priority: int) -> None:
    """Wait until a prompt of `priority` is being prefilled chunk by chunk (not a fixed sleep)."""
    for _ in range(2000):
        p = eng._prefilling
        if p is not None and p.req.priority == priority and p.prefilled > 0:
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the long prompt was never seen in chunked prefill")


def _second_during_prefill(eng: TorchEngine, loop: asyncio.AbstractEventLoop, first: tuple[list[dict[str, str]], int],
                           second: tuple[list[dict[str, str]], int], first_id: str | None = None,
                           ) -> list[tuple[str, float]]:
    """Send `first` (messages, priority); once it is being chunk-prefilled send `second`; both results."""
    async def together() -> list[tuple[str, float]]:
        one = asyncio.ensure_future(_run(eng, first[0], priority=first[1], request_id=first_id))
        await _when_prefilling(eng, first[1])
        two = await _run(eng, second[0], priority=second[1])
        return [await one, two]

    return loop.run_until_complete(together())


def test_a_long_higher_priority_prompt_preempts_a_chunked_prefill(engine) -> None:  # type: ignore[no-untyped-def]
    eng, loop = engine
    assert len(eng.encode_chat(LONG_B)) > 64 * 4  # too long for one step's budget: it cannot go ahead
    solo_free, _ = loop.run_until_complete(_run(eng, LONG, priority=2))
    solo_ent, ent_alone_s = loop.run_until_complete(_run(eng, LONG_B, priority=0))
    _kinds(eng)

    (free_text, free_ttft), (ent_text, ent_ttft) = _second_during_prefill(eng, loop, (LONG, 2), (LONG_B, 0))
    print(f"\nenterprise long prompt alone {ent_alone_s * 1000:.0f} ms, behind a chunked free prefill "
          f"{ent_ttft * 1000:.0f} ms; free {free_ttft * 1000:.0f} ms")
    assert "prefill" in _kinds(eng)  # the free prompt was parked, not finished first
    assert ent_ttft < free_ttft
    assert free_text == solo_free and ent_text == solo_ent  # parked KV resumed exactly where it stopped


def test_nested_preemption_and_an_aborted_parked_prompt(engine) -> None:  # type: ignore[no-untyped-def]
    eng, loop = engine
    solo = {p: loop.run_until_complete(_run(eng, m, priority=p))[0] for p, m in ((2, LONG), (0, LONG_B))}
    _kinds(eng)

    async def scenario() -> tuple[str, str, str]:
        free = asyncio.ensure_future(_run(eng, LONG, priority=2))
        await _when_prefilling(eng, 2)
        plus = asyncio.ensure_future(_run(eng, LONG, priority=1, request_id="plus-1"))
        await _when_prefilling(eng, 1)           # free parked by plus
        ent = asyncio.ensure_future(_run(eng, LONG_B, priority=0))
        await _when_prefilling(eng, 0)           # plus parked by enterprise, above free
        await eng.abort("plus-1")                # a parked prompt goes away: the slots close up
        plus_text, _ = await plus
        return (await free)[0], plus_text, (await ent)[0]

    free_text, plus_text, ent_text = loop.run_until_complete(scenario())
    assert _kinds(eng).count("prefill") == 2
    assert plus_text == ""  # aborted while parked, before its first token
    assert ent_text == solo[0] and free_text == solo[2]
    # and the engine is whole afterwards: slots compact, nothing left pending
    assert eng._prefilling is None and not eng._parked and not eng._running
    assert loop.run_until_complete(_run(eng, SHORT, priority=1))[0] == loop.run_until_complete(
        _run(eng, SHORT, priority=2))[0]


def test_lower_tier_decode_yields_to_a_higher_tier_prefill(engine) -> None:  # type: ignore[no-untyped-def]
    eng, loop = engine
    long_reply = SamplingParams(max_tokens=48, temperature=0.0)
    solo_free, _ = loop.run_until_complete(_run(eng, SHORT, priority=2, params=long_reply))
    solo_ent, _ = loop.run_until_complete(_run(eng, LONG_B, priority=0))
    _kinds(eng)

    async def together() -> list[tuple[str, float]]:
        free = asyncio.ensure_future(_run(eng, SHORT, priority=2, params=long_reply))
        for _ in range(2000):  # the free request is decoding
            if eng._running:
                break
            await asyncio.sleep(0.002)
        ent = await _run(eng, LONG_B, priority=0)
        return [await free, ent]

    (free_text, _), (ent_text, _) = loop.run_until_complete(together())
    kinds = _kinds(eng)
    assert kinds.count("decode") >= 3  # one per prefill chunk of the enterprise prompt, about
    assert free_text == solo_free and ent_text == solo_ent
