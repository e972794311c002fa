"""A bf16 shard on blockq (auto's format where the CPU has native bf16, so plain `switchboard up`'s): a
decoding sequence's tokens do not depend on a prompt joining its step (data_plane/shard/engines/attention.py,
`Mixed`).

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_bf16_mixed_steps.py -q    # ~20 s (real model)

Before: a step that carried a prompt beside decoding sequences ran them all through torch's SDPA, not the
native attention their decode steps use, so every prompt that arrived moved the others' logits by bf16
rounding (a greedy reply's log-probabilities by up to 0.1, its text past a near-tie; choice 0 of `n` > 1 always,
its siblings' prompts joining its second step). Through `up` on the Xeon: 14 of 22 replies equal to the same
request alone, 22 of 22 after.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from data_plane.shard.engines.base import GenerationRequest, SamplingParams
from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine
from tests.support.formats import BLOCKQ

pytestmark = pytest.mark.skipif(not BLOCKQ, reason="blockq cannot be built here (no C compiler)")

ASK = [{"role": "user", "content": "Write a short poem about the sea."}]
OTHER = [{"role": "user", "content": "Explain in detail, step by step, how a bicycle works, covering the frame "
                                     "and the wheels, and why each part matters."}]


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[TorchEngine, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    eng = TorchEngine(EngineConfig(dtype="bfloat16", quantization="int4", quantization_kernel="blockq",
                                   max_num_seqs=4, max_model_len=512, threads=1, speculation="off"))
    loop.run_until_complete(eng.start())
    yield eng, loop
    loop.run_until_complete(eng.aclose())
    loop.close()


async def _reply(eng: TorchEngine, messages: list[dict[str, str]], params: SamplingParams,
                 first: asyncio.Event | None = None) -> tuple[str, list[float]]:
    req = GenerationRequest(uuid.uuid4().hex, eng.encode_chat(messages), params)
    await eng.prepare(req)
    text, lps = "", []
    async for out in eng.generate(req):
        text += out.text
        lps += [e.logprob for e in out.logprobs]
        if first is not None:
            first.set()
    return text, lps


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=16, temperature=0.0, logprobs=True, ignore_eos=True),
                                    SamplingParams(max_tokens=16, temperature=1.0, seed=7, logprobs=True,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_a_prompt_joining_a_decoding_sequences_step_does_not_change_its_tokens(engine, params) -> None:
    eng, loop = engine
    alone = loop.run_until_complete(_reply(eng, ASK, params))

    async def beside() -> tuple[str, list[float]]:
        first = asyncio.Event()
        mine = asyncio.ensure_future(_reply(eng, ASK, params, first))
        await first.wait()  # decoding now: the other prompt's prefill joins its next steps
        await asyncio.gather(*(_reply(eng, OTHER, SamplingParams(max_tokens=4, temperature=0.0)) for _ in range(2)))
        return await mine

    assert loop.run_until_complete(beside()) == alone
