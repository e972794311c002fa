"""Token sampling for the torch engine: greedy argmax or temperature/top_k/top_p/min_p with a seeded generator.

    tokens = sample(logits, [seq.req.params for seq in batch], [seq.generator for seq in batch],
                    [seq.req.processor for seq in batch])     # per-request processing: engines/logits.py
    token = sample_row(logits[0], params, generator)

Called by the engine's step code (data_plane/shard/engines/torch_step.py) on the scheduler thread;
speculation.target_probs applies the same processing batched, for verification.
"""

from __future__ import annotations

from typing import Sequence

import torch

from data_plane.shard.engines.base import SamplingParams
from data_plane.shard.engines.logits import RequestLogits, process_batch


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None],
           processors: Sequence[RequestLogits | None] = ()) -> list[int]:
    """One token per row of `logits` [n, vocab]: argmax for greedy rows, else sampled. Rows with a
    processor are processed first (in place: grammar mask, penalties, bias) and told their token."""
    active = any(p is not None for p in processors)
    if active:
        logits = logits.clone()  # the model's output is an inference tensor: no in-place updates on it
        process_batch(logits, processors)
    greedy = logits.argmax(dim=-1).tolist()
    tokens = [greedy[i] if p.greedy else sample_row(logits[i], p, g)
              for i, (p, g) in enumerate(zip(params, generators))]
    if active:
        for proc, token in zip(processors, tokens):
            if proc is not None:
                proc.accept(token)
    return tokens


def sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    x = logits.float() / max(p.temperature, 1e-5)
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = probs.cumsum(-1)
        drop = cum - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=gen).item())
