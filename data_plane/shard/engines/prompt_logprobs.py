"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's log-probability given the tokens before it.

    rows = split_prompt_logits(plan.rows, logits)   # the executor's _choose: the sampling rows' logits only

A request with params.prompt_logprobs set gets every position of its prefill rows' logits back from the pass
(scheduler.ScheduledRow.num_logits); here each prefill chunk's rows become the entries of the prompt tokens they
predict (row j of a chunk at positions start.. predicts token start + j + 1; the prompt's last row predicts the
first output token and is what is sampled from), appended to the sequence's list, the first token's entry None.
Computed a block of rows at a time (log-softmax, the token's logprob, top-N), so no more than one chunk's
logits are ever held: a 2,000-token prompt over a 49,152-token vocabulary would be 393 MB of floats at once.
The numbers are the model's raw distribution (no temperature, penalties or bias: vLLM's default logprobs mode).

A cached prefix has no logits: such a request bypasses the prefix cache (torch_engine's `_cached_prefix`) and its
whole prompt is computed; its blocks are still stored for the requests after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from data_plane.shard.engines.base import TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from data_plane.shard.engines.scheduler import ScheduledRow

MAX_PROMPT_LOGPROBS = 5
"""Top alternatives per prompt position (OpenAI's legacy `logprobs` bound)."""
BLOCK_ROWS = 128
"""Rows of a chunk's logits taken through log-softmax at once (128 x 49,152 fp32: 25 MB)."""


def wants(row: ScheduledRow) -> bool:
    from data_plane.shard.engines.scheduler import RowKind

    return row.kind is RowKind.PREFILL and row.seq.req.params.prompt_logprobs is not None


def split_prompt_logits(rows: Sequence[ScheduledRow], logits: torch.Tensor) -> torch.Tensor:
    """The logits of the rows that sample (one each, in order), the prompt-logprob rows' entries recorded on
    their sequences. Unchanged when no row asks prompt logprobs."""
    if not any(wants(r) for r in rows):
        return logits
    kept, off = [], 0
    for r in rows:
        n = r.num_logits
        block = logits[off:off + n]
        off += n
        if wants(r):
            record(r, block)
            if r.samples:
                kept.append(block[-1:])
        elif n:
            kept.append(block)
    return torch.cat(kept) if kept else logits[:0]


def record(row: ScheduledRow, block: torch.Tensor) -> None:
    """Append the entries the chunk's logits `block` ([len(row.tokens), vocab]) give its prompt's tokens."""
    seq = row.seq
    prompt = seq.req.prompt_ids
    top_n = min(seq.req.params.prompt_logprobs or 0, MAX_PROMPT_LOGPROBS)
    if row.start == 0 or seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None]
    out = seq.prompt_logprobs
    m = max(0, min(len(row.tokens), len(prompt) - 1 - row.start))  # rows that predict a prompt token
    for b in range(0, m, BLOCK_ROWS):
        e = min(m, b + BLOCK_ROWS)
        lp = torch.log_softmax(block[b:e].float(), dim=-1)
        target = torch.tensor(prompt[row.start + 1 + b:row.start + 1 + e], dtype=torch.long)
        chosen = lp.gather(1, target.unsqueeze(1)).squeeze(1).tolist()
        if top_n:
            vals, ids = torch.topk(lp, top_n, dim=-1)
            tops = [tuple(TopLogprob(int(i), float(v)) for i, v in zip(ir, vr, strict=True))
                    for ir, vr in zip(ids.tolist(), vals.tolist(), strict=True)]
        else:
            tops = [()] * (e - b)
        out.extend(TokenLogprob(int(t), float(c), top)
                   for t, c, top in zip(target.tolist(), chosen, tops, strict=True))
