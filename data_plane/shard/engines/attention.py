"""Attention over the slot KV cache for one forward pass: batched over slots 0..n-1, or per sequence.

    attend = SlotBatched(runner, lens=[1, 4], starts=[p0, p1])   # decode / verify steps (slots 0, 1)
    attend = SlotBatched(runner, lens=[1, 1], starts=[p2, p3], first_slot=2)   # a micro-batch: slots 2, 3
    attend = PerSequence(runner, slots=[0, 3], lens=[1, 120], starts=[p0, 0])   # prefill and mixed steps
    native = Native(runner, blockq.load(), slot_of, pos)   # decode / verify with blockq weights:
    out = native(qkv, k_cache[layer], v_cache[layer])      #   rope + KV write + attention in one C call
    out = attend(q, k_cache[layer], v_cache[layer])   # [tokens, heads * head_dim], after the KV was written

Built once per pass by `LlamaRunner.forward` (llama_runner.py), called once per layer after that
layer's keys and values were written (the runner's `_write_kv`, the one place KV is written).

`SlotBatched`: row i is slot i (decoding sequences always hold slots 0..n-1, scheduler.py keeps it
so), each with 1..T query tokens (its last token plus a draft). Attention is one batched matmul per
layer over *views* of the cache with each slot's queries stacked (query rows past a slot's own
count are masked filler, never read). A step where every slot has one token is the plain decode
step, kept exactly as it always was (the fp32 kernels are the batch-invariant ones tests hold).
`PerSequence`: each sequence attends against its own slot, causally; for prompts (long rows) and
mixed steps. bf16/fp16 use the fused SDPA kernel; fp32 the explicit matmul-softmax-matmul.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from data_plane.shard.engines.blockq import Kernel


class Heads(Protocol):
    """What attention reads of the model (LlamaRunner has it)."""

    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    q_size: int
    scale: float


class SlotBatched:
    def __init__(self, r: Heads, lens: Sequence[int], starts: Sequence[int], first_slot: int = 0) -> None:
        self.r = r
        self.first_slot = first_slot  # a pipeline micro-batch: slots first_slot..first_slot+n-1
        n = self.n = len(lens)
        self.t_max = t_max = max(lens)
        self.total = total = sum(lens)
        self.fused = r.dtype != torch.float32
        self.uniform = total == n * t_max  # one slot, or every row as long: no per-layer scatter/gather
        first = torch.tensor(list(starts), dtype=torch.long)
        if t_max == 1:  # a plain decode step
            self.span = span = max(starts) + 1
            # Every slot at the same position (one stream, or streams in step) sees all `span` keys:
            # no mask, the same result (an all-true mask adds 0 / fills nothing) in fewer ops.
            self.mask: torch.Tensor | None = None
            if min(starts) != span - 1:
                self.mask = (torch.arange(span).unsqueeze(0) <= first.unsqueeze(1)).view(n, 1, 1, span)
            return
        lens_t = torch.tensor(list(lens), dtype=torch.long)
        self.slot = slot = torch.repeat_interleave(torch.arange(n), lens_t)
        self.within = within = torch.arange(total) - (lens_t.cumsum(0) - lens_t)[slot]  # row's index inside its slot
        pos = first[slot] + within
        self.span = span = int(pos.max()) + 1
        g = r.group
        # [n, T, span] mask: query row j of slot i sees positions <= its own; filler rows see position 0.
        mask = torch.zeros(n, t_max, span, dtype=torch.bool)
        mask[:, :, 0] = True
        mask[slot, within] = torch.arange(span).unsqueeze(0) <= pos.unsqueeze(1)
        self.causal = mask.view(n, 1, t_max, 1, span)
        self.mask_g = self.causal.expand(n, 1, t_max, g, span).reshape(n, 1, t_max * g, span) if self.fused else self.causal

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        r, n, span = self.r, self.n, self.span
        kvh, g, d = r.num_kv_heads, r.group, r.head_dim
        # kc[a : a + n, :, :span] as one view (slicing took two dispatches): decoding slots are 0..n-1
        # (a micro-batch: a contiguous part); every layer's cache has the same shape and strides.
        a, size, stride = self.first_slot, (n, kvh, span, d), kc.stride()
        keys = kc.as_strided(size, stride, kc.storage_offset() + a * stride[0])
        vals = vc.as_strided(size, stride, vc.storage_offset() + a * stride[0])
        if self.t_max == 1:
            qg = q.view(n, kvh, g, d)  # query heads grouped per KV head
            if self.fused:
                # bf16/fp16: the fused kernel reads the strided cache views as they are; the
                # unfused path below copied them and round-tripped the scores through fp32
                # (attention 616 -> 193 us per layer at batch 16, 150 tokens of context).
                out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=self.mask, scale=r.scale)
            else:
                # fp32 is the batch-invariant mode: the same kernels as ever (tests hold it to that).
                scores = (qg @ keys.transpose(2, 3)) * r.scale  # [n, KVH, G, span]
                if self.mask is not None:
                    scores = scores.masked_fill(~self.mask, float("-inf"))
                probs = torch.softmax(scores.float(), dim=-1).to(r.dtype)
                out = probs @ vals  # [n, KVH, G, D]
            return out.reshape(n, r.q_size)
        t_max = self.t_max
        if self.uniform:  # every slot has t_max rows: the packed rows already are [n, t_max]
            qp = q.view(n, t_max, r.num_heads, d)
        else:
            qp = q.new_zeros(n, t_max, r.num_heads, d)
            qp[self.slot, self.within] = q
        qg = qp.view(n, t_max, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(n, kvh, t_max * g, d)
        if self.fused:
            out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=self.mask_g, scale=r.scale)
        else:
            scores = (qg @ keys.transpose(2, 3)) * r.scale  # [n, KVH, T*G, span]
            scores = scores.view(n, kvh, t_max, g, span).masked_fill(~self.causal, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(r.dtype).view(n, kvh, t_max * g, span)
            out = probs @ vals
        out = out.view(n, kvh, t_max, g, d).permute(0, 2, 1, 3, 4)  # [n, T, KVH, G, D]
        return (out if self.uniform else out[self.slot, self.within]).reshape(self.total, r.q_size)


class PerSequence:
    def __init__(self, r: Heads, slots: Sequence[int], lens: Sequence[int], starts: Sequence[int]) -> None:
        self.r = r
        self.items = list(zip(slots, lens, starts))
        self.masks = [torch.arange(start + n).unsqueeze(0) <= torch.arange(start, start + n).unsqueeze(1)
                      for _, n, start in self.items]

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        r = self.r
        kvh, g, d = r.num_kv_heads, r.group, r.head_dim
        outs = []
        off = 0
        for (slot, t, start), mask in zip(self.items, self.masks):
            end = start + t
            keys = kc[slot, :, :end]  # [KVH, end, D]
            vals = vc[slot, :, :end]
            # Query heads grouped per shared KV head: [KVH, G*T, D] against [KVH, end, D].
            qg = q[off : off + t].view(t, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * t, d)
            if r.dtype == torch.float32:
                # fp32 is the batch-invariant mode: the same kernels as ever (tests hold it to that).
                scores = (qg @ keys.transpose(1, 2)) * r.scale  # [KVH, G*T, end]
                scores = scores.view(kvh, g, t, end).masked_fill(~mask, float("-inf"))
                probs = torch.softmax(scores.float(), dim=-1).to(r.dtype)
                out = probs.view(kvh, g * t, end) @ vals  # [KVH, G*T, D]
            else:
                # bf16/fp16: the fused kernel, ~2x faster for a turn's suffix over a long cached
                # history (145 tokens after 1,520: 269 -> 133 ms here), no [G*T, end] scores in memory.
                out = F.scaled_dot_product_attention(
                    qg.unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0), attn_mask=mask.repeat(g, 1),
                    scale=r.scale)[0]
            outs.append(out.view(kvh, g, t, d).permute(2, 0, 1, 3).reshape(t, r.q_size))
            off += t
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class Native:
    """Rows through the native kernel (native/attend.c): the rotary embedding, the KV write at (slot,
    head, position) and attention over positions 0..position, one call a layer where the torch path
    takes ~15 dispatches. The runner uses it for batched passes (decode, verify) when blockq serves its
    weights, and in float32 for every pass, prompts too (llama_runner.LlamaRunner.run_layers); every
    row is computed on its own, so its output does not depend on the pass that carried it."""

    def __init__(self, r: NativeHeads, kernel: Kernel, slot_of: torch.Tensor, pos: torch.Tensor) -> None:
        self.r, self.kernel = r, kernel
        self.slot = slot_of.contiguous()
        self.pos = pos.contiguous()
        self.rows = int(pos.numel())
        self.bf16 = r.dtype == torch.bfloat16

    def __call__(self, qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """`qkv` [rows, (heads + 2 kv_heads) * head_dim] (unroped) -> [rows, heads * head_dim]; KV written."""
        r = self.r
        qkv = qkv.contiguous()
        out = torch.empty(self.rows, r.q_size, dtype=r.dtype)
        if self.kernel.attend(qkv.data_ptr(), self.rows, r.num_heads, r.num_kv_heads, r.head_dim, r.cos.data_ptr(),
                              r.sin_signed.data_ptr(), self.slot.data_ptr(), self.pos.data_ptr(), kc.data_ptr(),
                              vc.data_ptr(), r.max_len, out.data_ptr(), r.scale, self.bf16, torch.get_num_threads()):
            raise RuntimeError("native attention refused its arguments (a position past max_len?)")
        return out


class Mixed:
    """A prompt's pass that carries one-token rows when the native kernel serves only batched passes (bf16
    on blockq): each one-token row (a decoding sequence's) through `Native`, as its decode steps go,
    the chunks through the torch path (rotary embedding, KV write, `PerSequence`), as their prompt passes
    go. A row's numerics then do not depend on what shares its pass: the decoding sequences' tokens went
    through SDPA whenever a prompt joined their step, which moved their logits by bf16 rounding, so a
    seeded text or a greedy reply changed with the load (choice 0 of n > 1, its siblings' prompts beside it)."""

    def __init__(self, r: RopeHeads, kernel: Kernel, slots: Sequence[int], lens: Sequence[int],
                 starts: Sequence[int], slot_of: torch.Tensor, pos: torch.Tensor, kv_rows: torch.Tensor) -> None:
        self.r = r
        self.one = torch.tensor([n == 1 for n in lens for _ in range(n)])
        self.rest = ~self.one
        self.native = Native(r, kernel, slot_of[self.one], pos[self.one])
        chunks = [(s, n, p) for s, n, p in zip(slots, lens, starts) if n > 1]
        self.attend = PerSequence(r, [c[0] for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks])
        self.cos, self.sin = r.rope_tables(pos[self.rest])
        self.kv_rows = kv_rows.view(len(pos), r.num_kv_heads)[self.rest].reshape(-1)  # the chunks' KV rows

    def __call__(self, qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """As `Native.__call__`: `qkv` [rows, ...] unroped -> [rows, heads * head_dim]; KV written."""
        r, d = self.r, self.r.head_dim
        out = torch.empty(len(self.one), r.q_size, dtype=r.dtype)
        out[self.one] = self.native(qkv[self.one], kc, vc)
        q, k, v = r.rope(qkv[self.rest], self.cos, self.sin)
        kc.view(-1, d).index_copy_(0, self.kv_rows, k.reshape(-1, d))  # as LlamaRunner._write_kv
        vc.view(-1, d).index_copy_(0, self.kv_rows, v.reshape(-1, d))
        out[self.rest] = self.attend(q, kc, vc)
        return out


class NativeHeads(Heads, Protocol):
    """What the native path reads besides `Heads` (LlamaRunner has it): the rotary tables and cache length."""

    cos: torch.Tensor
    sin_signed: torch.Tensor
    max_len: int


class RopeHeads(NativeHeads, Protocol):
    """What `Mixed` reads besides `NativeHeads`: the torch path's rotary embedding (LlamaRunner has it)."""

    def rope_tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope(self, qkv: torch.Tensor, cos: torch.Tensor,
             sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
