"""`LlamaRunner.forward`, the one pass for prefill, decode, mixed and verify steps, and the executor on
it, with a tiny randomly initialised Llama (no weights loaded, a second or two): a mixed pass gives
each row what its own pass gives, a verify pass what decoding token by token gives, and the
scheduler + executor loop generates the same greedy tokens batched as solo.

    .venv/bin/python -m pytest tests/data_plane/test_forward_pass.py -q
"""

from __future__ import annotations

import pytest
import torch

from data_plane.shard.engines.base import GenerationRequest, SamplingParams, TextStream
from data_plane.shard.engines.llama_runner import LlamaRunner
from data_plane.shard.engines.scheduler import RowKind, Scheduler, SchedulerConfig
from data_plane.shard.engines.sequence import SeqState, SeqStatus
from data_plane.shard.engines.torch_executor import Executor


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def runner(model: torch.nn.Module) -> LlamaRunner:
    return LlamaRunner(model, dtype=torch.float32, max_num_seqs=4, max_len=128)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_every_positions_logits_are_the_reference_models(model: torch.nn.Module, runner: LlamaRunner) -> None:
    """The hand-written pass against transformers' own forward of the same weights: a prompt's every
    position, then a decode step on its KV (float32)."""
    ids = list(range(3, 40))
    with torch.no_grad():
        reference = model(torch.tensor([[*ids, 11]])).logits[0]
    assert close(runner.forward([(2, ids, 0)], [len(ids)]), reference[:-1])
    assert close(runner.forward([(2, [11], len(ids))])[0], reference[-1])


def test_a_mixed_pass_gives_each_row_its_own_pass(runner: LlamaRunner) -> None:
    a, b = list(range(3, 20)), list(range(30, 41))
    solo_a = runner.prefill(0, a, 0)
    solo_b = runner.prefill(1, b, 0)
    dec = runner.decode([5, 6], [len(a), len(b)])
    runner.prefill(0, a, 0)
    runner.prefill(1, b, 0)
    mixed = runner.forward([(0, [5], len(a)), (1, [6], len(b)), (2, a, 0)])  # two decodes and a prompt
    assert close(mixed[0], dec[0]) and close(mixed[1], dec[1]) and close(mixed[2], solo_a)
    assert runner.forward([(3, b[:6], 0)], [0]).shape[0] == 0  # a chunk that samples nothing: no logits
    assert close(runner.forward([(3, b[6:], 6)])[0], solo_b)  # ... and its KV is there for the rest


def test_a_verify_pass_gives_what_decoding_token_by_token_gives(runner: LlamaRunner) -> None:
    prompt = list(range(7, 22))
    runner.prefill(0, prompt, 0)
    steps = [runner.decode([t], [len(prompt) + i])[0] for i, t in enumerate([40, 41, 42])]
    runner.prefill(0, prompt, 0)
    verified = runner.verify([[40, 41, 42]], [len(prompt)])
    assert verified.shape[0] == 3 and all(close(v, s) for v, s in zip(verified, steps))
    last_only = runner.forward([(0, [40, 41, 42], len(prompt))], [1], batched=True)
    assert close(last_only[0], steps[-1])


def _seq(rid: str, prompt: list[int], n: int) -> SeqState:
    req = GenerationRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n))
    return SeqState(req=req, max_tokens=n, sink=lambda out: None, stream=TextStream(lambda ids: "", ()),
                    draws=None)


def _generate(runner: LlamaRunner, prompts: list[list[int]], n: int, chunk: int) -> list[list[int]]:
    """The engine loop without the engine: schedule -> execute -> update (greedy, no EOS)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, prefill_chunk=chunk, max_model_len=128))
    executor = Executor(runner)
    seqs = [_seq(f"r{i}", p, n) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(200):
        plan = sched.schedule(now=0.0)
        if not plan.rows:
            break
        result = executor.execute(plan)
        for row, tokens in zip(plan.rows, result.tokens):
            seq = row.seq
            if row.kind is RowKind.PREFILL:
                seq.num_computed_tokens = row.start + len(row.tokens)
            for token in tokens:
                if row.kind is not RowKind.PREFILL:
                    seq.num_computed_tokens += 1
                seq.last_token = token
                seq.output_ids.append(token)
                if len(seq.output_ids) >= n:
                    sched.finish(seq, SeqStatus.FINISHED_LENGTH)
    return [s.output_ids for s in seqs]


def test_the_loop_generates_the_same_tokens_batched_and_solo(runner: LlamaRunner) -> None:
    prompts = [list(range(3, 40)), list(range(50, 58)), list(range(10, 30))]
    solo = [_generate(runner, [p], 8, chunk=256)[0] for p in prompts]
    assert _generate(runner, prompts, 8, chunk=16) == solo  # chunked, mixed passes, slot moves
