"""The torch engine's step loop (schedule -> execute -> update): the real scheduler, executor, output
processor, prefix cache and runner (on a tiny randomly initialised Llama: no weights), steps driven by
hand so the order of events inside one step is the test's to choose (a stand-in tokenizer decodes). What it holds:

- a prefix hit the scheduler counted is referenced before anything can evict it: neither the
  blocks a sequence reaped in the same step stores, nor the KV tier's offered blocks inserted for
  another waiting request (before, the load raised KeyError on the engine thread: the whole shard
  failed every stream);
- an engine whose step raises fails its open streams, refuses new requests and calls `on_dead`
  (the shard leaves membership and exits to be restarted: group_exit.py), instead of staying a
  member that answers 503 forever.

    .venv/bin/python -m pytest tests/data_plane/test_engine_step.py -q      # < 1 s
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from data_plane.common.errors import Overloaded
from data_plane.shard.engines.base import GenerationOutput, GenerationRequest, SamplingParams, TextStream
from data_plane.shard.engines.kv_cache import BlockHasher, PrefixCache
from data_plane.shard.engines.llama_runner import LlamaRunner
from data_plane.shard.engines.sequence import SeqState
from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine
from data_plane.shard.engines.torch_prefix import SlotPrefix

BS, SLOTS, MAX_LEN, VOCAB = 4, 4, 64, 32


def tiny_runner() -> LlamaRunner:
    """The real runner on a tiny randomly initialised Llama (no weights loaded, well under a second)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=MAX_LEN)
    return LlamaRunner(LlamaForCausalLM(cfg).eval(), dtype=torch.float32, max_num_seqs=SLOTS, max_len=MAX_LEN)


class FakeTokenizer:
    @staticmethod
    def decode(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


class Stepped:
    """A TorchEngine assembled around a tiny real runner and a prefix cache of `blocks` blocks, no thread."""

    def __init__(self, blocks: int = 4) -> None:
        self.engine = eng = TorchEngine(EngineConfig(max_num_seqs=SLOTS, max_model_len=MAX_LEN, prefill_chunk=64,
                                                     adaptive_threads=False, speculation="off"))
        self.runner = r = tiny_runner()
        self.cache = PrefixCache(num_layers=r.num_layers, kv_heads=r.num_kv_heads, head_dim=r.head_dim,
                                 block_size=BS, dtype=torch.float32, budget_bytes=0, num_blocks=blocks)
        eng._runner, eng._tokenizer = r, FakeTokenizer()
        eng.prefix = self.prefix = SlotPrefix(r, self.cache, BlockHasher(b"test-seed-bytes!", BS))
        eng._assemble()
        self.outputs: dict[str, list[GenerationOutput | BaseException]] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> SeqState:
        """Enqueue a request as `generate` does (its outputs collected in `outputs[rid]`)."""
        req = GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        seq = SeqState(req=req, max_tokens=max_tokens, sink=self.outputs.setdefault(rid, []).append,
                       stream=TextStream(FakeTokenizer.decode, ()), draws=None)
        seq.block_hashes = self.prefix.hashes(prompt, None, 0)
        with self.engine._lock:
            self.engine._by_id[rid] = seq
            self.engine.scheduler.add(seq)
        return seq

    def run(self) -> None:
        while self.engine._step():
            pass

    def finish_reason(self, rid: str) -> str | None:
        last = self.outputs[rid][-1]
        return last.finish_reason if isinstance(last, GenerationOutput) else None


CONVERSATION = list(range(1, 10))  # 9 tokens: 2 full blocks of 4


def test_a_counted_hit_survives_the_blocks_a_reaped_sequence_stores_in_the_same_step() -> None:
    s = Stepped(blocks=4)
    s.add("turn1", CONVERSATION, 1)
    s.run()  # its 2 blocks (+ the reply's) are cached, unreferenced: the oldest in the LRU
    long = s.add("long", [7, 7, 7, 7, 8], 100)
    for _ in range(9):  # 13 tokens in its slot: 3 blocks to store when it ends
        s.engine._step()
    turn2 = s.add("turn2", [*CONVERSATION, 5, 5, 5], 5)  # the conversation's next turn arrives...
    s.engine.scheduler.abort("long")  # ...in the step where a client disconnects
    s.engine._step()  # the abort's store evicts the LRU's oldest blocks: the hit is held by then
    assert turn2.cached == 8 and long.finished
    s.run()
    assert s.finish_reason("turn2") == "length" and s.engine.dead is None


def test_blocks_offered_while_the_scheduler_looks_up_do_not_evict_a_hit_it_counted() -> None:
    s = Stepped(blocks=4)
    s.add("turn1", CONVERSATION, 1)
    s.add("other", [9, 9, 9, 9, 9, 9, 9, 9, 1], 1)
    s.run()  # 4 blocks cached, unreferenced; turn1's are the oldest
    turn2 = s.add("turn2", [*CONVERSATION, 5], 2)
    fetched = s.add("fetched", [4, 4, 4, 4, 6, 6, 6, 6, 1], 2)
    lookup, calls = s.engine.scheduler.prefix, []
    assert lookup is not None

    def offer_during_the_first_lookup(seq: SeqState) -> int:
        """The cache nodes' blocks for `fetched` arrive (another thread) while schedule() runs."""
        calls.append(seq.request_id)
        hit = lookup(seq)
        if len(calls) == 1:
            s.prefix.offer(fetched.block_hashes[:2], torch.ones(2, *s.prefix.block_shape))
        return hit

    s.engine.scheduler.prefix = offer_during_the_first_lookup
    s.engine._step()  # before: fetched's lookup inserted the offer over turn2's counted hit: KeyError
    assert calls[:2] == ["turn2", "fetched"] and turn2.cached == 8 and s.engine.dead is None
    s.run()
    assert s.finish_reason("turn2") == "length" and s.finish_reason("fetched") == "length"


def test_an_engine_whose_step_raises_fails_its_streams_refuses_new_ones_and_leaves() -> None:
    s = Stepped()
    seq = s.add("open", [1, 2, 3], 50)
    left: list[bool] = []
    s.engine.on_dead = lambda: left.append(True)  # the shard's GroupExit.trigger

    def broken(plan: Any) -> Any:
        raise RuntimeError("a kernel failed")

    s.engine._executor.execute = broken  # type: ignore[union-attr,method-assign]
    s.engine._run()  # returns once its step raised
    assert isinstance(s.engine.dead, RuntimeError) and left == [True]
    assert isinstance(s.outputs["open"][-1], Overloaded) and not seq.finished
    with pytest.raises(Overloaded):
        s.engine.generate(GenerationRequest("late", [1, 2], SamplingParams(max_tokens=2)))
