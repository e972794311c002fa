"""A slot-based forward pass for Llama-family models over a fixed KV cache.

Loaded by the torch engine (data_plane/shard/engines/torch_engine.py); its executor
(torch_executor.py) calls `forward` on the scheduler thread only; the prefix cache uses its KV cache.
gpt-fast's `forward(idx, input_pos)` is the model: one pass for prefill, decode, mixed and verify
steps, one place that writes the KV (`_write_kv`; with blockq weights, decode and verify passes, and in float32
every pass, write it in the native attention call instead, attention.Native); the attention variants are in
attention.py.

    runner = LlamaRunner.from_pretrained(path, dtype=torch.bfloat16, max_num_seqs=16, max_len=2048)
    logits = runner.forward([(slot, token_ids, start), ...])         # last-token logits per item
    logits = runner.forward(items, logits=[1, 4], batched=True)      # decode/verify: slots 0..n-1
    logits = runner.prefill(slot=0, token_ids=[...], start=0)        # [vocab] for the last token
    logits = runner.decode(tokens=[t0, t1], positions=[p0, p1])      # rows = slots 0..n-1

The KV cache is one tensor per layer, ``[slots, kv_heads, max_len, head_dim]``. Decoding
sequences always occupy slots ``0..n-1`` so each decode step attends over a *view* of the
cache (no gather); the scheduler keeps them compact with :meth:`move_slot`.

Why hand-written rather than `model.generate` or transformers' continuous batching: one
decode pass over all running sequences with no per-step Python bookkeeping from the
library was measured at 152 fp32 / 248 bf16 tok/s at 16 streams here, against 85 / 141
for transformers' own continuous batching (docs/FACTS.md). The weights, rotary
tables and tokenizer all come from transformers, so numerics follow the reference model;
`tests/data_plane/test_forward_pass.py` checks a prompt's and a decode step's logits against its forward.

Supported: `LlamaForCausalLM` and architectures with the same block (Mistral, Qwen2 with
q/k/v bias). Others raise `UnsupportedModel` naming the architecture.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol

import torch

from data_plane.shard.engines import blockq
from data_plane.shard.engines.attention import Mixed, Native, PerSequence, SlotBatched
from data_plane.shard.engines.blockq import BlockLinear
from data_plane.shard.engines.model_files import (
    Weightless,
    default_rope,
    lazy_zeros,
    read_config,
    read_dense,
    read_tables,
    stage_tensors,
)
from data_plane.shard.engines.prepared_weights import load_or_prepare
from data_plane.shard.engines.weight_source import (
    DtypeReason,
    LinearLike,
    QuantReason,
    WeightBuilder,
    WeightPlan,
    nbytes,
)

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def _exact_tables(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """float32 activations over quantized weights: the embedding / head as the dense checkpoint holds
    them, so the table is not requantized (weight_source.WeightBuilder._exact_table)."""
    if dtype != torch.float32:
        return None
    return read_tables(path, ("model.embed_tokens.weight", "lm_head.weight")) or None


class UnsupportedModel(RuntimeError):
    pass


class Downstream(Protocol):
    """The later stages of a pipeline, seen from stage 0 (data_plane/shard/engines/pipeline.py);
    called on the scheduler thread, in order."""

    microbatches: int
    """Micro-batches one forward pass is split into (1: the whole pass at once)."""

    def submit(self, slots: Sequence[int], lens: Sequence[int], starts: Sequence[int], wanted: Sequence[int],
               batched: bool, x: torch.Tensor, began: float | None = None) -> Any:
        """Send `x` [T, H] (stage 0's layers done) down the chain without waiting; a ticket for
        `collect`. `began`: when stage 0 started this pass (time.time), for its step time."""
        ...

    def collect(self, ticket: Any) -> torch.Tensor:
        """The hidden states of the submitted pass's `wanted` last rows of each item after the last
        layer (select_rows), [sum(wanted), H]; tickets are collected in the order submitted."""
        ...

    def move_slot(self, src: int, dst: int, length: int) -> None: ...

    def pace(self, parts: int) -> None:
        """Before stage 0's layers of a pass of `parts` micro-batches: set the threads for it."""
        ...


def micro_batches(lens: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous item ranges [i, j) splitting items of `lens` tokens into up to `parts` runs of
    about equal tokens (an item is never split: its rows depend on each other)."""
    n = len(lens)
    parts = max(1, min(parts, n))
    total, bounds, acc = sum(lens), [0], 0
    for i, length in enumerate(lens[:-1], 1):
        acc += length
        if len(bounds) < parts and acc * parts >= total * len(bounds) and n - i >= parts - len(bounds):
            bounds.append(i)
    bounds.append(n)
    return list(pairwise(bounds))


def _unpack(items: Sequence[tuple[int, Sequence[int], int]], logits: Sequence[int] | None
            ) -> tuple[list[int], list[int], list[int], torch.Tensor, list[int]]:
    """A pass's items (slot, token ids, start) as slots, lens, starts, the packed ids and the wanted rows."""
    slots = [slot for slot, _, _ in items]
    lens = [len(ids) for _, ids, _ in items]
    starts = [start for _, _, start in items]
    ids = torch.tensor([t for _, seq, _ in items for t in seq], dtype=torch.long)
    return slots, lens, starts, ids, [1] * len(items) if logits is None else list(logits)


def select_rows(x: torch.Tensor, lens: Sequence[int], wanted: Sequence[int]) -> torch.Tensor:
    """The last `wanted[i]` rows of each item i of packed rows `x` (item i has `lens[i]` rows)."""
    if sum(wanted) == len(x):
        return x
    ends = torch.tensor(list(lens)).cumsum(0).tolist()
    return x[torch.tensor([e - j for e, n in zip(ends, wanted) for j in range(n, 0, -1)], dtype=torch.long)]


@dataclass
class _Layer:
    ln_in: torch.Tensor
    qkv: LinearLike  # q, k and v projections fused: one GEMM
    o: LinearLike
    ln_post: torch.Tensor
    gate_up: LinearLike  # gate and up fused: one GEMM
    down: LinearLike


class LlamaRunner:
    def __init__(self, model: Any, *, dtype: torch.dtype, max_num_seqs: int, max_len: int,
                 pack: bool | None = None, weights: WeightBuilder | None = None,
                 layer_range: tuple[int, int] | None = None) -> None:
        cfg = model.config
        arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"the torch engine supports {', '.join(SUPPORTED_ARCHITECTURES)}; this model is {arch}"
            )
        self.dtype = dtype
        self.total_layers = int(cfg.num_hidden_layers)
        # A pipeline stage (data_plane/shard/engines/pipeline.py) holds layers [first, end) and their KV only.
        first, end = layer_range or (0, self.total_layers)
        self.layer_range = (first, end)
        self.num_layers = end - first
        self.downstream: Downstream | None = None  # the next stages of a pipeline, set by its group
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.group = self.num_heads // self.num_kv_heads
        self.eps = float(cfg.rms_norm_eps)
        self.vocab_size = int(cfg.vocab_size)
        self.max_num_seqs = max_num_seqs
        self.max_len = max_len
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self._qk_v = (self.num_heads + self.num_kv_heads, self.num_kv_heads)  # heads of a fused qkv row
        self._q_k = (self.num_heads, self.num_kv_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

        # The layers in the served weight format (data_plane/shard/engines/weight_source.py): dense
        # (oneDNN-packed for bf16/fp16, plain fp32), int8 or int4; the loops below call them alike.
        if weights is None:
            plan = WeightPlan(_DTYPE_NAMES[dtype], DtypeReason.REQUESTED, "none", QuantReason.REQUESTED)
            weights = WeightBuilder(plan, state=model.state_dict(), pack=pack)
        self.weights = weights
        self.packed = weights.pack and weights.plan.quantization == "none"
        # blockq's library also holds the fused decode/verify attention (attention.Native): used with its weights.
        self.native = blockq.load() if weights.plan.blockq and self.num_heads // self.num_kv_heads <= 8 else None
        # float32 on blockq: prompts and mixed steps through it too, so a row's output does not depend on
        # the pass that carried it (a prefill chunk, a mixed step, a decode step, a verify pass): the batch
        # invariance float32 promises, now with blockq's 87 MiB a token against dense float32's 513 (a
        # resumed stream, a jump-forward run of forced tokens, a draft's rows all give the unbroken text).
        # It is also the faster prompt path there: 1,024 tokens 2.7-3.2 s against 4.1-6.8 s for the torch
        # path's explicit matmul-softmax-matmul, 64-512 tokens the same (1 thread, AMD EPYC Zen 4, under
        # load, 2026-12-03). bf16 keeps torch's fused SDPA for prompts: for long prompts it held its own (1,024
        # tokens 1.6-2.8 s against 2.0-3.2 s, 2 threads; native prompts were 4x slower at 2,000 tokens on the
        # Xeon, 2026-12-05); one-token rows go native in every pass (attention.Mixed), so a decoding
        # sequence's tokens do not depend on a prompt joining its step.
        self.native_prompts = self.native is not None and dtype == torch.float32
        self.hidden_size = int(cfg.hidden_size)
        tied = bool(getattr(cfg, "tie_word_embeddings", False)) or not weights.has("lm_head.weight")
        # The embedding, final norm and LM head live on stage 0 only (it embeds and applies the head:
        # pipeline.py says why); a later stage holds its layers and nothing of the vocabulary.
        self.holds_head = first == 0
        if self.holds_head:
            self.embed, self.lm_head = weights.embed_and_head(tied)
            self.norm = weights.vector("model.norm.weight")
        else:
            self.embed = torch.empty(0, self.hidden_size, dtype=dtype)
            self.lm_head = None  # type: ignore[assignment]
            self.norm = torch.empty(0, dtype=dtype)
        self.layers: list[_Layer] = []

        for i in range(first, end):  # a pipeline stage: its own layers only
            p = f"model.layers.{i}."
            b_qkv = None
            if weights.has(p + "self_attn.q_proj.bias"):
                b_qkv = torch.cat([weights.vector(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            self.layers.append(
                _Layer(
                    ln_in=weights.vector(p + "input_layernorm.weight"),
                    qkv=weights.linear([p + f"self_attn.{x}_proj.weight" for x in "qkv"], bias=b_qkv),
                    o=weights.linear([p + "self_attn.o_proj.weight"]),
                    ln_post=weights.vector(p + "post_attention_layernorm.weight"),
                    gate_up=weights.linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    down=weights.linear([p + "mlp.down_proj.weight"]),
                )
            )
        self.intermediate = self.layers[0].down.in_features
        self._gate_up = (self.intermediate, self.intermediate)
        self.weight_format = weights.label
        weights.release()  # the layers hold their own copies: the checkpoint's tensors go now
        head_params = (self.lm_head.numel * (1 if tied else 2)) if self.holds_head else 0
        self.weight_params = (head_params + self.norm.numel()
                              + sum(l.qkv.numel + l.o.numel + l.gate_up.numel + l.down.numel + 2 * l.ln_in.numel()
                                    for l in self.layers))
        """Parameters (a tied head and embedding once): 2x this is the model's dense bf16 bytes."""
        # Bytes a decode step reads: each weight once (a tied head and embedding are one table).
        head_bytes = (nbytes(self.lm_head) + (0 if tied else nbytes(self.embed))) if self.holds_head else 0
        self._weight_bytes = (head_bytes + nbytes(self.norm)
                              + sum(nbytes(l.qkv) + nbytes(l.o) + nbytes(l.gate_up) + nbytes(l.down)
                                    + 2 * nbytes(l.ln_in) for l in self.layers))
        # Resident: a packed head is a second copy beside the dense embedding table (quantized formats share one).
        self.resident_weight_bytes = self._weight_bytes + (nbytes(self.embed) if tied and self.packed
                                                           and self.holds_head else 0)
        # Rotary tables: a plain rope computed as transformers does (model_files.default_rope, no modeling
        # import); any other variant from the model's own rotary module.
        tables = default_rope(cfg, max_len)
        if tables is None:
            rotary = model.model.rotary_emb
            if any(b.is_meta for b in rotary.buffers()):  # a weightless (meta) model: build its rotary for real
                rotary = type(rotary)(config=cfg)
            with torch.inference_mode():
                pos = torch.arange(max_len).unsqueeze(0)
                probe = torch.zeros(1, max_len, self.head_dim, dtype=torch.float32)
                cos, sin = rotary(probe, pos)
            tables = cos[0], sin[0]
        cos, sin = tables
        self.cos = cos.to(dtype).contiguous()  # [max_len, head_dim]
        self.sin = sin.to(dtype).contiguous()
        # rotate_half(x) * sin == x.roll(half) * sin_signed, exactly (a sign flip is exact): one op, not four.
        half = self.head_dim // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1).contiguous()
        shape = (max_num_seqs, self.num_kv_heads, max_len, self.head_dim)
        # Zero pages on first touch: no start-up cost, and only the slots used become resident.
        self.k_cache = [lazy_zeros(shape, dtype) for _ in range(self.num_layers)]
        self.v_cache = [lazy_zeros(shape, dtype) for _ in range(self.num_layers)]
        # The same caches as flat [slots*kv_heads*max_len, head_dim] views, made once: `_write_kv`'s
        # index_copy_ target (a view per layer per step was 60 of a decode step's ~1,100 dispatches).
        self._k_rows = [kc.view(-1, self.head_dim) for kc in self.k_cache]
        self._v_rows = [vc.view(-1, self.head_dim) for vc in self.v_cache]

    @classmethod
    def from_pretrained(cls, path: Path, *, dtype: torch.dtype, max_num_seqs: int, max_len: int,
                        plan: WeightPlan | None = None, gguf: Path | None = None,
                        layer_range: tuple[int, int] | None = None) -> LlamaRunner:
        """Load `path` (a HF folder) in `plan`'s format (default: dense `dtype`). With a quantized plan
        and the model's GGUF, the weights come from the GGUF's blocks and no dense copy is loaded.
        `layer_range`: a pipeline stage's layers [first, end) (data_plane/shard/engines/pipeline.py)."""
        quantized = plan is not None and plan.quantization != "none" and gguf is not None
        light = read_config(path)
        if light is not None and default_rope(light, 1) is not None:  # no transformers model class needed
            weights: WeightBuilder | None = None
            # A pipeline stage reads its own tensors only: its memory is its share of the weights.
            first, end = layer_range or (0, int(light.num_hidden_layers))
            keep = stage_tensors(first, end, head=first == 0) if layer_range else None
            if quantized:
                assert plan is not None and gguf is not None
                weights = WeightBuilder(plan, gguf=load_or_prepare(gguf, path, light.num_attention_heads,
                                                                   light.num_key_value_heads, keep),
                                        state=None if plan.blockq else _exact_tables(path, dtype))
            elif (state := read_dense(path, dtype, keep)) is not None:
                plan = plan or WeightPlan(_DTYPE_NAMES[dtype], DtypeReason.REQUESTED, "none", QuantReason.REQUESTED)
                weights = WeightBuilder(plan, state=state)
            if weights is not None:
                return cls(Weightless(light), dtype=dtype, max_num_seqs=max_num_seqs, max_len=max_len,
                           weights=weights, layer_range=layer_range)
        from transformers import AutoConfig, AutoModelForCausalLM

        if quantized:
            assert plan is not None and gguf is not None
            cfg = AutoConfig.from_pretrained(str(path))
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
            kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            weights = WeightBuilder(plan, gguf=load_or_prepare(gguf, path, cfg.num_attention_heads, kv_heads),
                                    state=_exact_tables(path, dtype))
            return cls(model, dtype=dtype, max_num_seqs=max_num_seqs, max_len=max_len, weights=weights,
                       layer_range=layer_range)
        # Load straight into the serving dtype: no transient fp32 copy of the weights.
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        model.eval()
        dense = None if plan is None else WeightBuilder(plan, state=model.state_dict())
        return cls(model, dtype=dtype, max_num_seqs=max_num_seqs, max_len=max_len, weights=dense,
                   layer_range=layer_range)

    @property
    def kv_cache_bytes(self) -> int:
        per = self.k_cache[0].numel() * self.k_cache[0].element_size()
        return 2 * per * self.num_layers

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step reads (each weight once; the packed copies are not counted twice)."""
        return self._weight_bytes

    # -- building blocks -------------------------------------------------------------

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # The reference's w * (x * rsqrt(mean(x^2) + eps) in fp32).to(dtype), bit for bit (torch's
        # rms_norm upcasts bf16/fp16 to fp32 inside and casts back, then multiplies by the weight in
        # place: tests/data_plane/test_runner_rms.py checks both forms agree exactly), in fewer ops:
        # float32 takes the weight inside (~3x faster a call here); bf16/fp16 keep the multiply by the
        # weight after the cast (the fused weight would round once, not twice: other numerics).
        # torch.rms_norm and torch._C._nn.silu, not F.*: the same ops without F's Python wrappers (91 calls a step).
        if x.dtype == torch.float32:
            return torch.rms_norm(x, (x.shape[-1],), w, self.eps)
        return w * torch.rms_norm(x, (x.shape[-1],), None, self.eps)

    def rope_tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows for positions `pos` [T], shaped [T, 1, head_dim] for `_qkv`."""
        return self.cos[pos].unsqueeze(1), self.sin_signed[pos].unsqueeze(1)

    def _normed(self, lin: LinearLike, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """lin(RMSNorm(x) * w): blockq layers take the norm inside their kernel (float32, no normalized
        copy, ~25 us a call saved at batch 1); the others get the reference's form (`_rms`)."""
        if isinstance(lin, BlockLinear):
            return lin.normed(x, w, self.eps)
        return lin(self._rms(x, w))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head over final hidden states x [rows, H], float32 [rows, vocab]. A blockq head writes its
        float32 sums as they are: rounded to bf16 first, this model's logits moved in steps of 0.125 (~20 in
        magnitude), so near-ties became exact ties (greedy, top_p and min_p then picked among equals, and
        top_logprobs listed them in arbitrary order)."""
        if isinstance(self.lm_head, BlockLinear):
            return self.lm_head.normed(x, self.norm, self.eps, out=torch.float32)
        return self._normed(self.lm_head, x, self.norm).float()

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gu = self._normed(layer.gate_up, x, layer.ln_post)
        g, u = gu.split_with_sizes(self._gate_up, -1)
        return layer.down.add(torch._C._nn.silu(g) * u, x)

    def _qkv(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor,
             sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D] and k [T, kv_heads, D] with rotary embedding applied (both in one op chain), v [T, kv_heads, D]."""
        return self.rope(self._normed(layer.qkv, x, layer.ln_in), cos, sin_signed)

    def rope(self, qkv: torch.Tensor, cos: torch.Tensor,
              sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_qkv` from the projection's output (attention.Mixed has it for its prompt rows)."""
        qkv = qkv.view(qkv.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # One dispatch for both views (slicing took one each); split_with_sizes, not Tensor.split: that
        # is a Python wrapper in torch (~a third of the split's cost, 90 calls a decode step).
        qk, v = qkv.split_with_sizes(self._qk_v, 1)
        qk = qk * cos + qk.roll(self.head_dim // 2, dims=-1) * sin_signed
        q, k = qk.split_with_sizes(self._q_k, 1)
        return q, k, v

    # -- the forward pass ----------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, items: Sequence[tuple[int, Sequence[int], int]], logits: Sequence[int] | None = None,
                *, batched: bool = False) -> torch.Tensor:
        """One pass for prefill, decode, mixed and verify steps: item i runs its token ids at positions
        start.. in its slot; returns the logits of the last `logits[i]` tokens of each item (default:
        the last one of each; 0 = none), in order, as fp32 [rows, vocab].

        The projections and MLP run once over every token packed together (no padding). With
        `batched` the items are slots 0..n-1 in order (a decode or verify step: attention batched
        over cache views, attention.SlotBatched); else each attends against its own slot
        (attention.PerSequence). KV is written in one place, `_write_kv`."""
        if self.downstream is not None:  # the later stages run their layers and send back the wanted rows
            return self.collect(self.submit(items, logits, batched=batched))
        slots, lens, starts, ids, wanted = _unpack(items, logits)
        x = self.run_layers(self.embed[ids], slots, lens, starts, batched)  # [T, H]
        return self.logits(select_rows(x, lens, wanted))

    @torch.inference_mode()
    def submit(self, items: Sequence[tuple[int, Sequence[int], int]], logits: Sequence[int] | None = None,
               *, batched: bool = False, microbatches: int | None = None) -> list[Any]:
        """Stage 0's part of a pipelined pass (`forward`'s arguments), sent on without waiting for
        its rows: tickets for `collect`. Split into up to `microbatches` (default the downstream's)
        micro-batches in flight: each is sent on as soon as this stage's layers are done, so while
        stage 1 runs micro-batch k this stage runs k+1. A sequence is in exactly one. Several
        passes may be submitted before the first is collected (the engine's batch queue)."""
        down = self.downstream
        assert down is not None, "submit/collect is a pipeline's (a runner with a downstream)"
        slots, lens, starts, ids, wanted = _unpack(items, logits)
        tickets, off = [], 0
        parts = micro_batches(lens, microbatches or down.microbatches)
        down.pace(len(parts))
        for i, j in parts:
            began = time.time()
            n = sum(lens[i:j])
            x = self.run_layers(self.embed[ids[off : off + n]], slots[i:j], lens[i:j], starts[i:j], batched)
            tickets.append(down.submit(slots[i:j], lens[i:j], starts[i:j], wanted[i:j], batched, x, began))
            off += n
        return tickets

    @torch.inference_mode()
    def collect(self, tickets: list[Any]) -> torch.Tensor:
        """The logits of a submitted pass, as `forward` returns them: the wanted rows come back in
        the order sent and get the head one micro-batch at a time (while the later stages still
        work on the next); passes are collected in the order submitted."""
        down = self.downstream
        assert down is not None
        return torch.cat([self.logits(down.collect(t)) for t in tickets])

    def run_layers(self, x: torch.Tensor, slots: Sequence[int], lens: Sequence[int], starts: Sequence[int],
                   batched: bool) -> torch.Tensor:
        """This runner's layers over hidden states `x` [T, H] of the items (slot, len, start): KV written, x out."""
        if max(lens) == 1:  # a decode step: one token a slot
            pos, slot_of = torch.tensor(starts, dtype=torch.long), torch.tensor(slots, dtype=torch.long)
        else:
            pos = torch.cat([torch.arange(start, start + n) for start, n in zip(starts, lens)])
            slot_of = torch.repeat_interleave(torch.tensor(slots, dtype=torch.long), torch.tensor(lens))
        # Flat row index of (slot, kv_head, position) in a [slots*kv_heads*max_len, head_dim] view:
        # index_copy_ there is several times cheaper than advanced-index assignment.
        kv_rows = (((slot_of * self.num_kv_heads).unsqueeze(1) + torch.arange(self.num_kv_heads)) * self.max_len
                   + pos.unsqueeze(1)).reshape(-1)
        # bf16 on blockq: a prompt's pass carrying one-token rows (decoding sequences') sends those native, as
        # their decode steps go (attention.Mixed); a pass of one-token rows alone is a prompt's, as before
        mixed = self.native is not None and not (batched or self.native_prompts) and 1 in lens and max(lens) > 1
        if self.native is not None and (batched or self.native_prompts or mixed):  # one call a layer
            native: Native | Mixed = (Mixed(self, self.native, slots, lens, starts, slot_of, pos, kv_rows) if mixed
                                      else Native(self, self.native, slot_of, pos))
            for i, layer in enumerate(self.layers):
                qkv = self._normed(layer.qkv, x, layer.ln_in)
                x = self._mlp(layer, layer.o.add(native(qkv, self.k_cache[i], self.v_cache[i]), x))
            return x
        attend = SlotBatched(self, lens, starts, slots[0]) if batched else PerSequence(self, slots, lens, starts)
        cos, sin = self.rope_tables(pos)  # [T, 1, D]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            self._write_kv(i, kv_rows, k, v)
            x = layer.o.add(attend(q, self.k_cache[i], self.v_cache[i]), x)
            x = self._mlp(layer, x)
        return x

    def _write_kv(self, layer: int, kv_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The one place the KV cache is written: rows of the flat [slots*kv_heads*max_len, head_dim] view."""
        self._k_rows[layer].index_copy_(0, kv_rows, k.reshape(-1, self.head_dim))
        self._v_rows[layer].index_copy_(0, kv_rows, v.reshape(-1, self.head_dim))

    # Shapes of `forward` the warm-up, the benches and the tests call by name.

    def prefill(self, slot: int, token_ids: list[int], start: int) -> torch.Tensor:
        """Run `token_ids` at positions start.. for one slot; return last-token logits [vocab]."""
        return self.forward([(slot, token_ids, start)])[0]

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step for slots 0..n-1 (token i at positions[i]); return logits [n, vocab]."""
        return self.forward([(i, [t], p) for i, (t, p) in enumerate(zip(tokens, positions))], batched=True)

    def verify(self, rows: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Speculative verification for slots 0..n-1: slot i runs `rows[i]` (its last token and a draft) at
        positions starts[i]..; logits for every row, in order. A rejected draft's KV is rolled back
        by not counting it (the next step overwrites those positions)."""
        return self.forward([(i, row, s) for i, (row, s) in enumerate(zip(rows, starts))],
                            [len(row) for row in rows], batched=True)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of slot src into slot dst."""
        if src == dst or length <= 0:
            return
        for kc, vc in zip(self.k_cache, self.v_cache):
            kc[dst, :, :length] = kc[src, :, :length]
            vc[dst, :, :length] = vc[src, :, :length]
        if self.downstream is not None:
            self.downstream.move_slot(src, dst, length)
