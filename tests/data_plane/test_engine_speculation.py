"""N-gram speculation in the real torch engine (in-process, float32 so greedy output is
batch-invariant): text identical with speculation on and off (solo, batched, mixed lengths,
stop strings, max_tokens landing inside an accepted draft), an abort mid-draft frees the slot,
and the listener's speculation hooks move on a quote prompt and stay put when off. The verify-row price
is pinned (tests/support/spec.py): whether a draft pays is then the engine's decision, not the load's."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import pytest

from data_plane.shard.engines.base import GenerationOutput, GenerationRequest, SamplingParams
from data_plane.shard.engines.grammar import GrammarKind, GrammarSpec
from data_plane.shard.engines.torch_engine import EngineConfig, StepListener, TorchEngine
from tests.support.formats import INVARIANT
from tests.support.spec import pin_row_cost

PASSAGE = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
           "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n")
QUOTE = [{"role": "user", "content": "Copy the text below exactly, unchanged:\n" + PASSAGE * 2}]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SHORT_QUOTE = [{"role": "user", "content": "Repeat this text exactly:\n" + PASSAGE}]


class Recorder(StepListener):
    def __init__(self) -> None:
        self.drafts: list[tuple[int, int]] = []
        self.iteration_tokens: list[int] = []

    def on_spec_draft(self, drafted: int, accepted: int) -> None:
        self.drafts.append((drafted, accepted))

    def on_iteration_tokens(self, tokens: int) -> None:
        self.iteration_tokens.append(tokens)


class Harness:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.listener = Recorder()
        self.engine = TorchEngine(EngineConfig(**INVARIANT, max_num_seqs=8, max_model_len=1024,
                                               speculation="ngram", spec_max_batch=8), self.listener)
        self.loop.run_until_complete(self.engine.start())
        pin_row_cost(self.engine)  # drafting decided by the engine's logic, not by how loaded the CPU is
        self.speculator = self.engine.spec

    def speculation(self, on: bool) -> None:
        self.engine.spec = self.speculator if on else None

    def run(self, jobs: list[tuple[list[dict[str, str]], SamplingParams]]) -> list[tuple[str, GenerationOutput]]:
        async def one(messages: list[dict[str, str]], params: SamplingParams) -> tuple[str, GenerationOutput]:
            req = GenerationRequest(uuid.uuid4().hex, self.engine.encode_chat(messages), params)
            await self.engine.prepare(req)  # a constrained request's grammar
            text, last = "", None
            async for out in self.engine.generate(req):
                text += out.text
                last = out
            assert last is not None
            return text, last

        async def all_jobs() -> list[tuple[str, GenerationOutput]]:
            return list(await asyncio.gather(*(one(m, p) for m, p in jobs)))

        return self.loop.run_until_complete(all_jobs())


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.loop.run_until_complete(h.engine.aclose())
    h.loop.close()


def greedy(max_tokens: int, stop: tuple[str, ...] = ()) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop)


def both(h: Harness, jobs: list[tuple[list[dict[str, str]], SamplingParams]], batched: bool):
    out = {}
    for on in (True, False):
        h.speculation(on)
        try:
            out[on] = h.run(jobs) if batched else [h.run([j])[0] for j in jobs]
        finally:
            h.speculation(True)
    return out[True], out[False]


def test_greedy_text_identical_on_and_off_solo_and_batched(harness: Harness) -> None:
    jobs = [(QUOTE, greedy(60)), (CHAT, greedy(24)), (SHORT_QUOTE, greedy(40)),
            (QUOTE, greedy(48, stop=("def mul",))), (SHORT_QUOTE, greedy(40, stop=("lazy",)))]
    for batched in (False, True):
        on, off = both(harness, jobs, batched)
        assert [(t, o.finish_reason, o.completion_tokens) for t, o in on] == \
            [(t, o.finish_reason, o.completion_tokens) for t, o in off]
        assert on[0][1].spec_accepted_tokens >= 10  # the quote prompt did speculate
        assert all(o.spec_drafts == 0 for _, o in off)
    assert "def mul" not in on[3][0] and on[3][1].finish_reason == "stop"


ROWS = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 6, "maxItems": 6, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "status": {"enum": ["active", "inactive"]},
                                     "city": {"type": "string", "maxLength": 12}},
    "required": ["id", "status", "city"], "additionalProperties": False}}},
    "required": ["rows"], "additionalProperties": False}
USERS = [{"role": "user", "content": "List six users as JSON rows with an id, a status and a city."}]


def test_constrained_drafts_are_checked_by_the_grammar_and_keep_greedy_text(harness: Harness) -> None:
    """A json_schema request drafts (its drafts cut by the grammar, its matcher rolled back to what was
    accepted): the text is the same with speculation on and off, valid, and drafts were accepted."""
    schema = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(ROWS))
    constrained = SamplingParams(temperature=0.0, max_tokens=200, grammar=schema)
    jobs = [(USERS, constrained), (SHORT_QUOTE, greedy(30))]
    for batched in (False, True):
        on, off = both(harness, jobs, batched)
        assert [(t, o.finish_reason, o.completion_tokens) for t, o in on] == \
            [(t, o.finish_reason, o.completion_tokens) for t, o in off]
        rows = json.loads(on[0][0])["rows"]
        assert len(rows) == 6 and all(r["status"] in ("active", "inactive") for r in rows)
        assert on[0][1].spec_accepted_tokens > 0 and off[0][1].spec_drafts == 0
    with_bias = SamplingParams(temperature=0.0, max_tokens=60, grammar=schema, frequency_penalty=0.5)
    ((_, out),) = harness.run([(USERS, with_bias)])
    assert out.spec_drafts == 0  # a penalty depends on every token before it: one token a step


def test_max_tokens_inside_an_accepted_draft(harness: Harness) -> None:
    # Every cap from 3 to 14 tokens: several land inside a draft the model accepts.
    jobs = [(QUOTE, greedy(n)) for n in range(3, 15)]
    on, off = both(harness, jobs, batched=True)
    for (t_on, o_on), (t_off, o_off), n in zip(on, off, range(3, 15)):
        assert (t_on, o_on.completion_tokens, o_on.finish_reason) == (t_off, o_off.completion_tokens, "length")
        assert o_on.completion_tokens == n


def test_abort_mid_draft_frees_the_slot(harness: Harness) -> None:
    h = harness
    h.speculation(True)

    async def abort_after_first_output() -> int:
        req = GenerationRequest(uuid.uuid4().hex, h.engine.encode_chat(QUOTE), greedy(200))
        outputs = h.engine.generate(req)
        got = 0
        async for out in outputs:
            got += 1
            if got == 3:
                break
        await outputs.aclose()
        deadline = time.monotonic() + 10
        while h.engine.stats().running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return h.engine.stats().running

    before = len(h.listener.drafts)
    assert h.loop.run_until_complete(abort_after_first_output()) == 0
    assert len(h.listener.drafts) > before  # it was drafting when aborted
    text, last = h.run([(CHAT, greedy(8))])[0]
    assert last.finish_reason in ("stop", "length") and text


def test_listener_moves_on_quote_and_stays_put_when_off(harness: Harness) -> None:
    h = harness
    h.speculation(False)
    try:
        before = len(h.listener.drafts)
        h.run([(QUOTE, greedy(32))])
        assert len(h.listener.drafts) == before
        assert all(t == 1 for t in h.listener.iteration_tokens[-20:])  # plain decode: one token a row
    finally:
        h.speculation(True)
    h.run([(QUOTE, greedy(32))])
    new = h.listener.drafts[before:]
    assert new and sum(a for _, a in new) > 10
    assert max(h.listener.iteration_tokens[-10:]) > 1


@pytest.mark.slow
def test_seeded_sampling_same_distribution_on_and_off(harness: Harness) -> None:
    """A top-k 3 slice of the vocabulary, 4 sampled tokens of a quote prompt, 120 seeds each way:
    the distribution of the sampled continuations must agree (chi-square on the common ones)."""
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, seed=s) for s in range(120)]
    jobs = [(SHORT_QUOTE, p) for p in params]
    on, off = both(harness, jobs, batched=True)
    c_on = Counter(t for t, _ in on)
    c_off = Counter(t for t, _ in off)
    assert sum(o.spec_drafts for _, o in on) > 0
    keys = set(c_on) | set(c_off)
    common = [k for k in keys if c_on[k] + c_off[k] >= 10]
    rest_on = sum(c_on[k] for k in keys if k not in common)
    rest_off = sum(c_off[k] for k in keys if k not in common)
    stat = sum((c_on[k] - c_off[k]) ** 2 / (c_on[k] + c_off[k]) for k in common)
    if rest_on + rest_off:
        stat += (rest_on - rest_off) ** 2 / (rest_on + rest_off)
    df = max(1, len(common) + (1 if rest_on + rest_off else 0) - 1)
    assert stat < df + 4 * (2 * df) ** 0.5 + 10, (stat, df, c_on.most_common(5), c_off.most_common(5))


def test_a_seed_gives_the_same_text_on_and_off_and_whatever_the_drafts(harness: Harness) -> None:
    """Draws keyed by output position (torch_sampling.Draws): a seeded sampled request's text does not
    depend on whether, or how much, speculation drafted. Each seed runs off, on with the pinned row price
    and on with rows priced so cheaply that every match drafts its longest run: three different numbers
    of rows verified, one text (before position-keyed draws, a verify row drew from a shared stream and
    the text followed the draft lengths, which follow timing)."""
    jobs = [(SHORT_QUOTE, SamplingParams(temperature=0.9, top_k=20, max_tokens=24, seed=s)) for s in range(8)]
    on, off = both(harness, jobs, batched=False)
    assert sum(o.spec_drafts for _, o in on) > 0
    pin_row_cost(harness.engine, 1e-3)
    try:
        eager = [harness.run([j])[0] for j in jobs]
    finally:
        pin_row_cost(harness.engine)
    assert [t for t, _ in on] == [t for t, _ in off] == [t for t, _ in eager]
    assert len({t for t, _ in off}) > 1  # the seeds do sample different texts


def test_a_resumed_seeded_stream_continues_the_text_an_unbroken_one_gives(harness: Harness) -> None:
    """A stream resumed mid-way (the gateway's mid-stream resume: the text sent so far as a final
    assistant message to continue, `resumed_text`) samples on from the position after that text, so
    the continuation is the rest of the uninterrupted text, not a restart of the seed's draws."""
    eng = harness.engine
    params = SamplingParams(temperature=0.9, top_k=20, max_tokens=20, seed=42, logprobs=True, ignore_eos=True)

    async def go(req: GenerationRequest) -> tuple[str, list[int]]:
        await eng.prepare(req)
        text, ids = "", []
        async for out in eng.generate(req):
            text += out.text
            ids += [lp.token_id for lp in out.logprobs]
        return text, ids

    whole, ids = harness.loop.run_until_complete(go(GenerationRequest(uuid.uuid4().hex, eng.encode_chat(CHAT), params)))
    assert len(ids) == 20, whole
    sent = eng._decode_ids(ids[:8])  # the text the client had when its stream broke
    assert whole.startswith(sent)
    resumed = CHAT + [{"role": "assistant", "content": sent}]
    rest, _ = harness.loop.run_until_complete(go(GenerationRequest(
        uuid.uuid4().hex, eng.encode_chat(resumed, continue_final=True), replace(params, max_tokens=12),
        resumed_text=sent)))
    assert sent + rest == whole
