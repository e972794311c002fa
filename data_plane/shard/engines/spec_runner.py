"""The verification pass of speculative decoding: every decoding slot's last token plus its draft.

Called by the speculative decode step (data_plane/shard/engines/torch_spec.py), on the scheduler
thread, with the engine's loaded LlamaRunner.

    logits = verify(runner, rows=[[t0, d0, d1], [t1]], starts=[p0, p1])   # [4, vocab]

Slot i (decoding slots are 0..n-1, as in `LlamaRunner.decode`) runs `rows[i]` at positions
`starts[i]..`: its last sampled token and 0..k draft tokens, different k per slot. The
projections and MLP run once over the packed rows (no padding); attention is one batched
matmul per layer over the slots' cache views with each slot's queries stacked (query rows
past a slot's own count are masked filler, never read). KV of every row is written; the
engine rolls back rejected drafts by not counting them in the sequence's length (a slot cache
is just positions, so the next step overwrites them). Returns logits for every row, in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from data_plane.shard.engines.llama_runner import LlamaRunner


@torch.inference_mode()
def verify(r: LlamaRunner, rows: list[list[int]], starts: list[int]) -> torch.Tensor:
    n = len(rows)
    lens = torch.tensor([len(x) for x in rows], dtype=torch.long)
    t_max = int(lens.max())
    total = int(lens.sum())
    ids = torch.tensor([t for x in rows for t in x], dtype=torch.long)
    slot = torch.repeat_interleave(torch.arange(n), lens)
    first = torch.tensor(starts, dtype=torch.long)
    within = torch.arange(total) - (lens.cumsum(0) - lens)[slot]  # row's index inside its slot
    pos = first[slot] + within
    span = int(pos.max()) + 1
    kvh, g, d, heads = r.num_kv_heads, r.group, r.head_dim, r.num_heads
    kv_rows = (((slot * kvh).unsqueeze(1) + torch.arange(kvh)) * r.max_len + pos.unsqueeze(1)).reshape(-1)
    x = r.embed[ids]
    cos, sin = r.rope_tables(pos)
    # [n, T, span] mask: query row j of slot i sees positions <= its own; filler rows see position 0.
    mask = torch.zeros(n, t_max, span, dtype=torch.bool)
    mask[:, :, 0] = True
    mask[slot, within] = torch.arange(span).unsqueeze(0) <= pos.unsqueeze(1)
    mask = mask.view(n, 1, t_max, 1, span)
    fused = r.dtype != torch.float32  # bf16/fp16: SDPA, as in LlamaRunner.decode; fp32 unchanged
    uniform = total == n * t_max  # one slot (batch 1), or every draft as long: no per-layer scatter/gather
    mask_g = mask.expand(n, 1, t_max, g, span).reshape(n, 1, t_max * g, span) if fused else mask
    for i, layer in enumerate(r.layers):
        q, k, v = r._qkv(layer, x, cos, sin)
        kc, vc = r.k_cache[i], r.v_cache[i]
        kc.view(-1, d).index_copy_(0, kv_rows, k.reshape(-1, d))
        vc.view(-1, d).index_copy_(0, kv_rows, v.reshape(-1, d))
        keys = kc[:n, :, :span]
        vals = vc[:n, :, :span]
        if uniform:  # every slot has t_max rows: the packed rows already are [n, t_max] (no scatter)
            qp = q.view(n, t_max, heads, d)
        else:
            qp = q.new_zeros(n, t_max, heads, d)
            qp[slot, within] = q
        qg = qp.view(n, t_max, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(n, kvh, t_max * g, d)
        if fused:
            out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask_g, scale=r.scale)
        else:
            scores = (qg @ keys.transpose(2, 3)) * r.scale  # [n, KVH, T*G, span]
            scores = scores.view(n, kvh, t_max, g, span).masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(r.dtype).view(n, kvh, t_max * g, span)
            out = probs @ vals
        out = out.view(n, kvh, t_max, g, d).permute(0, 2, 1, 3, 4)  # [n, T, KVH, G, D]
        attn = (out if uniform else out[slot, within]).reshape(total, r.q_size)
        x = layer.o.add(attn, x)
        x = r._mlp(layer, x)
    x = r._rms(x, r.norm)
    return r.lm_head(x).float()
