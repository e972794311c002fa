"""Which dtype and weight format a shard serves, decided once at load, and the layers built for it.

    caps = CpuCaps.detect()                                   # torch's capability + /proc/cpuinfo flags
    plan = resolve_plan("auto", "auto", source="q4", caps=caps)
    plan.dtype, plan.dtype_reason                             # "bfloat16", "quantized_kernel"
    plan.quantization, plan.quantization_reason               # "int4", "gguf_q4"
    build = WeightBuilder(plan, state=model.state_dict(), gguf=None)   # or gguf=GGUFWeights.open(...)
    lin = build.linear(["...q_proj.weight", "...k_proj.weight", "...v_proj.weight"])
    embed, head = build.embed_and_head(tied=True)

`resolve_plan` is pure (capabilities passed in) and is the whole policy:

kernel auto (``--quantization-kernel``; the plan's ``kernel``)
  - quantized weights -> blockq (blockq.py: a C kernel built at first use; int8 activations per 32 x the
    weight blocks, integer dot products, llama.cpp's numerics) wherever it loaded, on the best path the
    CPU runs (``blockq_avx512_vnni`` / ``blockq_avx2`` / ``blockq_portable``). Measured on an Intel Xeon
    (avx512_vnni, 2 threads, one 576 -> 1536 projection): 12 / 25 / 76 us at 1 / 4 / 16 rows against
    torch's int4 kernel's 24 / 45 / 170; a decode step of the default model 11.2 -> 6.0 ms at batch 1
    (with attention.Native). Its tables (embedding / LM head): int4 models at 6 bits with a scale per 16
    (`_table`; 0.339x of bf16's bytes in all, against 0.359x with the GGUF's Q8_0 table), int8 models
    the Q8_0 blocks as they are. Its cost: int8 activations break more near-ties (`switchboard bench
    quality`: bf16 +1.45 % perplexity, float32 +0.27 %, against torch int4's +0.79 % in bf16; with the
    Q8_0 table bf16 read +0.69 %; llama.cpp's greedy text on the same GGUF is what it gives).
  - ``blockq_x2`` by name (never auto) -> blockq with two int8 planes of activations (``blockq_x2_<path>``:
    each block of 32 and its rounding residual, ~16 bits, met by the same unpacked weights), float32
    activations around it (dtype reason ``agreement``; bf16 rounding elsewhere broke half the prompts) and
    the GGUF's Q8_0 table (the 6-bit table alone broke 4 of 12): float32 dense's greedy tokens on 12 of 12 of
    `switchboard bench quality`'s prompts x 32 tokens, perplexity +0.00 % (Intel Xeon, 2026-12-05; one plane
    3 of 12, and no choice of projections kept in float32 reached 11: docs/BENCHMARKS.md). Its cost (`switchboard
    bench engine`, chat, 64 tokens, quiet, 2 cores): 85.2 / 299.9 tok/s at 1 / 16 streams against the default's
    101.3 / 471.8 (0.84x / 0.64x; TTFT p50 75.0 against 47.7 ms at 1 stream): twice the integer dot
    products, 5 MiB more read a token (the Q8_0 table), float32 activations and KV. So auto stays one plane.
  - the exact mode (float32 asked for with an explicit quantized format, or ``blockq_exact`` by name) ->
    blockq's float path (``blockq_exact_<path>``, native/blockq_exact.c): the same blocks, float32
    activations, each weight's integer met in a float32 FMA, and int4 models keep the GGUF's Q8_0 table as
    it is. It computes float32 dense's own weights (the GGUF's blocks dequantized) in float32: `switchboard
    bench quality --formats float32:int4` 2026-12-04 (AMD EPYC Zen 4): perplexity +0.00 %, greedy tokens
    identical on 12 of 12 prompts x 32 tokens, 92.1 MiB read a step (0.359x bf16), 0.297x resident. Its
    cost is compute (a float32 FMA per weight and row): `switchboard bench engine` (chat, 64 tokens, quiet,
    2 threads) 89.0 / 217.8 tok/s at 1 / 16 streams against the default's 165.9 / 545.8; a decode step
    (1 thread, under load, in-process A/B) 28 ms at batch 1 and 184 ms at 16 against 13.5 / 68 ms for
    float32 on blockq's int8 activations and 99 / 228 ms for dense float32.
  - float16 with an explicit format, and machines where blockq did not build (no C compiler) -> torch's
    weight-only kernels (below).

dtype auto
  - blockq takes either activation dtype at the same speed: it follows the CPU as dense weights do (below);
    ``blockq_x2`` -> float32 (``agreement``): what its greedy tokens were measured with (above).
  - a quantized format on torch's kernels -> bfloat16 (``quantized_kernel``): they are only fast
    with bf16 activations (float32: 169 / 75 ms against 27 ms dense for a decode step's GEMMs here).
    Measured again 2026-12-02 (AMD EPYC Zen 4, avx512_bf16, 1 thread, under load, A/B in one run):
    `_weight_int4pack_mm_for_cpu` does take float32 activations (exact: within 1.4e-6 of the
    dequantized GEMM) but runs a reference loop, the model's four projections 70 ms against 0.12 ms
    with bf16 activations at batch 1 (1.2 s / 9.3 ms at batch 16). What float32 buys is exactness:
    the float32 reference's weights *are* the GGUF's blocks dequantized (the converted checkpoint), the
    int4 kernel with float32 scales/zeros dequantizes Q4_1 bit-exactly (zero = m + 8d: w = (q - 8)d +
    m + 8d = dq + m), and with float32 activations the table stays exact (below), so
    ``--dtype float32 --quantization int4`` gives float32 dense's greedy tokens on 12 of 12 of
    `switchboard bench quality`'s prompts x 32 tokens, perplexity +0.00 % (all 210 Q4_1 tensors
    checked bit-exact). With bf16 activations agreement is bounded by bf16 rounding,
    not by the Q4_1 weights (measured 2026-12-02, same bench): dense bf16 67 % of prompts identical,
    bf16 int4 50 %; bf16 int4 with the exact float32 head 75 %; every first difference at a near-tie
    (float32's top-1 minus top-2 logit 0.01-0.17, against a median of 1.33 over all steps). An earlier
    58 % for "float32 activations" kept the per-row int8 table, which alone (float32 dense, only the
    table requantized) agreed on 75 %: it was the table, not the Q4_1 blocks. So auto keeps bf16 for
    quantized weights; ``--dtype float32 --quantization int4`` is the exact and batch-invariant mode, on
    blockq's float path where it builds (above; tests/data_plane/test_quant_engine.py).
  - else a CPU with native bf16 (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo, and oneDNN agrees)
    -> bfloat16 (``native_bf16``): a decode step's GEMMs 7.8 ms against 26.6 fp32 (batch 1).
  - else float32 (``no_native_bf16``): on an AVX2-only EPYC one GEMM was 1.7x (batch 1) to 6.1x
    (batch 16) slower in bf16 than fp32 (docs/BENCHMARKS.md).
quantization auto
  - float32 or float16 asked for explicitly -> none (``dense_activations``): the numerics asked for
    (blockq would round the activations to int8; its exact path and torch's int4 kernel are asked for
    with an explicit format); ``blockq_exact`` or ``blockq_x2`` by name -> what the GGUF ships (its blocks). float32 is batch-invariant dense and on blockq alike; ``--quantization int4
    --quantization-kernel blockq`` is the fast batch-invariant choice (3-5x dense float32 at 1-4
    streams, 1 thread, 2026-12-03: tests/support/formats.py), chosen by name, not by auto.
  - a GGUF whose projections are Q4_0/Q4_1 -> int4 (``gguf_q4``): its blocks served as they are. The
    decode step at a few streams is memory-bound (bytes per token): the step's GEMMs 3.9 ms int4
    against 7.8 ms bf16 at batch 1 on avx512_bf16, and with AVX2 kernels only (ATEN_CPU_CAPABILITY=avx2,
    ONEDNN_MAX_CPU_ISA=AVX2 on the same machine) 11.9 ms int4 / 26.4 ms fp32 at batch 1 and 48.6 /
    68.8 ms at batch 16. The cost: where bf16 is native, at batch 16 int4 is 22.1 ms against 14.2 ms
    packed bf16; a shard that always runs many streams there serves faster with ``--quantization none``.
  - a GGUF of Q8_0 projections -> int8 (``gguf_q8``); a dense model -> none (``dense_model``): auto
    never quantizes a dense checkpoint by itself (vLLM's rule: serve what the checkpoint is).

What is quantized (int8 and int4): every projection (q/k/v fused, o, gate/up fused, down). With bf16 activations the LM head
and the embedding (tied: one table) are int8 per output channel in both formats: the head is 21 % of
SmolLM2-135M's weights and its logits decide greedy output, so it keeps 8 bits (measured: an int4 head,
per 32 like Q4_1, took perplexity from +0.9 % to +4.4 % of float32 and greedy agreement on 32 tokens
from 0.65 to 0.21, though its GEMM was 2.5 ms against 6.0 ms int8 and 4.8 ms packed bf16); a GGUF's Q8_0 table
(one scale per 32) is requantized to one scale per row (no kernel takes per-32 int8 scales), which
alone moves greedy output (1.2 % relative error in the table; float32 dense with only the table
requantized agreed with float32 on 75 % of the bench's prompts). With float32 activations (the exact
mode) the table stays float32 as the checkpoint holds it (`_exact_table`: Q8_0 dequantized exactly),
so ``--dtype float32 --quantization int4`` computes the GGUF's own weights exactly (the int4 kernel
dequantizes Q4_1 bit-exactly with float32 scales/zeros) at 4x the table's int8 bytes.
Norms and biases stay in the serving dtype. int4 from a GGUF is exact (its Q4_0/Q4_1 blocks,
data_plane/shard/engines/gguf_weights.py); from a dense model it is quantized at load like Q4_1
(per 32, min/max). `WeightBuilder.label` names what was built; the prefix cache seeds its block
digests with it (data_plane/shard/engines/kv_cache.py layout_seed), so formats never share KV.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import torch

from data_plane.shard.engines import blockq
from data_plane.shard.engines.blockq import BlockEmbedding, BlockLinear
from data_plane.shard.engines.gguf_weights import INT4_KINDS, GGUFWeights
from data_plane.shard.engines.packed_linear import Linear, should_pack
from data_plane.shard.engines.prepared_weights import PreparedWeights
from data_plane.shard.engines.quant_linear import Int4Linear, Int8Embedding, Int8Linear

DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
KERNEL_CHOICES = ("auto", "blockq", "blockq_x2", "blockq_exact", "torch")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


class DtypeReason(str, Enum):
    REQUESTED = "requested"
    NATIVE_BF16 = "native_bf16"
    NO_NATIVE_BF16 = "no_native_bf16"
    QUANTIZED_KERNEL = "quantized_kernel"
    EXACT_KERNEL = "exact_kernel"
    AGREEMENT = "agreement"


class QuantReason(str, Enum):
    REQUESTED = "requested"
    GGUF_Q4 = "gguf_q4"
    GGUF_Q8 = "gguf_q8"
    DENSE_MODEL = "dense_model"
    DENSE_ACTIVATIONS = "dense_activations"


@dataclass(frozen=True)
class CpuCaps:
    """What the CPU offers: torch's dispatch level (AVX512, AVX2, ...), cpuinfo flags, model name."""

    capability: str
    flags: frozenset[str]
    model: str = ""
    onednn_bf16: bool = True
    blockq: str = ""
    """The block-quantized kernel's path on this CPU (blockq.py: avx512_vnni | avx2 | portable), "" if unavailable."""

    @property
    def native_bf16(self) -> bool:
        return bool(self.flags & NATIVE_BF16_FLAGS) and self.onednn_bf16

    @classmethod
    def detect(cls) -> CpuCaps:
        flags: frozenset[str] = frozenset()
        model = ""
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features") and not flags:
                flags = frozenset(value.split())
            elif key.strip() == "model name" and not model:
                model = value.strip()
        onednn = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        kernel = blockq.load()
        return cls(torch.backends.cpu.get_cpu_capability(), flags, model, onednn, kernel.isa_name if kernel else "")

    def summary(self) -> str:
        """`model; torch CAPABILITY; bf16/amx/avx flags` for reports and the ready line."""
        keep = sorted(f for f in self.flags if f.startswith(("avx", "amx", "fma", "f16c")))
        return (f"{self.model or 'unknown CPU'}; torch {self.capability}; flags {' '.join(keep) or '-'}; "
                f"blockq {self.blockq or '-'}")


@dataclass(frozen=True)
class WeightPlan:
    dtype: str
    dtype_reason: DtypeReason
    quantization: str
    quantization_reason: QuantReason
    kernel: str = "torch"
    """What computes the projections: ``torch`` (dense GEMMs, or torch's weight-only int4/int8 kernels),
    ``blockq_<path>`` (blockq.py: int8 activations x block-quantized weights, llama.cpp's numerics),
    ``blockq_x2_<path>`` (two int8 planes of activations: float32 dense's greedy tokens) or
    ``blockq_exact_<path>`` (float32 activations x the same blocks: the exact mode)."""

    @property
    def blockq(self) -> bool:
        return self.kernel.startswith("blockq")

    @property
    def planes(self) -> int:
        """blockq's int8 planes of activations: 2 (``blockq_x2``), else 1 (unused off blockq's int8 path)."""
        return 2 if self.kernel.startswith("blockq_x2_") else 1

    @property
    def kernel_choice(self) -> str:
        """The ``--quantization-kernel`` that names this plan's kernel (what a pipeline stage is told)."""
        if not self.blockq:
            return "torch"
        return "blockq_exact" if self.exact else "blockq_x2" if self.planes == 2 else "blockq"

    @property
    def float32_table(self) -> bool:
        """An int4 model's table stays the GGUF's Q8_0 blocks (not q6): the modes that aim at float32
        dense's greedy tokens (the exact mode, two planes; q6 alone moved them, module docstring)."""
        return self.exact or self.planes == 2

    @property
    def exact(self) -> bool:
        """blockq with float32 activations (native/blockq_exact.c): float32 dense's numerics on the blocks."""
        return self.kernel.startswith("blockq_exact")

    def describe(self) -> str:
        return (f"{self.dtype} ({self.dtype_reason.value}), weights {self.quantization} "
                f"({self.quantization_reason.value}) on {self.kernel}")


def resolve_plan(dtype: str, quantization: str, *, source: str, caps: CpuCaps, kernel: str = "auto") -> WeightPlan:
    """The served dtype and weight format (the policy in the module docstring). `source` is what the
    model's projections ship as: ``q4`` (GGUF Q4_0/Q4_1), ``q8`` (GGUF Q8_0) or ``dense``. `kernel`: what
    computes quantized projections (auto | blockq | blockq_x2 | blockq_exact | torch); blockq where it did not load
    is torch."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}")
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}")
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"quantization kernel must be one of {', '.join(KERNEL_CHOICES)}")
    if kernel == "blockq_exact" and dtype not in ("auto", "float32"):
        raise ValueError("quantization kernel blockq_exact takes float32 activations (--dtype float32 or auto)")
    if kernel == "blockq_x2" and dtype == "float16":
        raise ValueError("quantization kernel blockq_x2 takes float32 or bfloat16 activations (--dtype float32, "
                         "bfloat16 or auto)")
    if quantization != "auto":
        quant, q_reason = quantization, QuantReason.REQUESTED
    elif kernel in ("blockq_exact", "blockq_x2") and source in ("q4", "q8"):
        quant, q_reason = ("int4", QuantReason.GGUF_Q4) if source == "q4" else ("int8", QuantReason.GGUF_Q8)
    elif dtype in ("float32", "float16"):
        quant, q_reason = "none", QuantReason.DENSE_ACTIVATIONS
    elif source == "q4":
        quant, q_reason = "int4", QuantReason.GGUF_Q4
    elif source == "q8":
        quant, q_reason = "int8", QuantReason.GGUF_Q8
    else:
        quant, q_reason = "none", QuantReason.DENSE_MODEL
    # blockq serves quantized weights wherever it loaded. The exact mode (float32 asked for together with a
    # quantized format, or blockq_exact by name) keeps float32 activations on it (blockq_exact.c); where
    # blockq did not load, and for float16, torch's kernels, which dequantize the GGUF's blocks exactly.
    exact = (kernel == "blockq_exact" or (dtype == "float32" and quantization != "auto" and kernel == "auto")
             # two planes by name where blockq did not build: what they are for (float32 dense's greedy tokens)
             # is torch's exact kernels with float32 activations, not its fast bf16 ones
             or (kernel == "blockq_x2" and not caps.blockq and dtype in ("auto", "float32")))
    if quant == "none" or not caps.blockq or kernel == "torch" or dtype == "float16":
        kernel = "torch"  # blockq takes float32 or bf16 activations only
    elif exact:
        kernel = f"blockq_exact_{caps.blockq}"
    else:
        kernel = f"blockq_x2_{caps.blockq}" if kernel == "blockq_x2" else f"blockq_{caps.blockq}"
    if dtype != "auto":
        return WeightPlan(dtype, DtypeReason.REQUESTED, quant, q_reason, kernel)
    if exact:  # blockq_exact by name: float32 activations, on torch's exact kernels where blockq did not load
        return WeightPlan("float32", DtypeReason.EXACT_KERNEL, quant, q_reason, kernel)
    if kernel.startswith("blockq_x2_"):
        # two planes: float32 dense's greedy tokens (bf16 activations elsewhere would break its near-ties)
        return WeightPlan("float32", DtypeReason.AGREEMENT, quant, q_reason, kernel)
    if quant != "none" and kernel == "torch":
        return WeightPlan("bfloat16", DtypeReason.QUANTIZED_KERNEL, quant, q_reason)
    if caps.native_bf16:
        return WeightPlan("bfloat16", DtypeReason.NATIVE_BF16, quant, q_reason, kernel)
    return WeightPlan("float32", DtypeReason.NO_NATIVE_BF16, quant, q_reason, kernel)


class LinearLike(Protocol):
    out_features: int
    in_features: int
    numel: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor: ...


def nbytes(obj: object) -> int:
    """Bytes held by a layer, an embedding table or a plain tensor."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return int(obj.nbytes)  # type: ignore[attr-defined]


class WeightBuilder:
    """Builds the runner's layers in the plan's format from a dense state dict and/or a GGUF."""

    def __init__(self, plan: WeightPlan, *, state: Mapping[str, torch.Tensor] | None = None,
                 gguf: GGUFWeights | PreparedWeights | None = None, pack: bool | None = None) -> None:
        if state is None and gguf is None:
            raise ValueError("WeightBuilder needs a state dict or a GGUF")
        self.plan = plan
        self.dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[plan.dtype]
        self.pack = should_pack(self.dtype) if pack is None else pack
        self._state = state
        self._gguf = gguf
        self._origins: set[str] = set()

    @property
    def label(self) -> str:
        """What was built, e.g. ``int4[q4_1]+int8[q8_0]`` or ``dense``: the prefix cache's seed part."""
        if not self._origins:
            return "dense"
        # blockq rounds activations to int8 (a8; a8x2 in two planes), its exact path keeps them float32 (a32):
        # other numerics than torch's kernels and than each other, so other KV.
        acts = ("a32" if self.plan.exact else "a8x2" if self.plan.planes == 2 else "a8" if self.plan.blockq
                else "")
        return f"{self.plan.quantization}{acts}[{','.join(sorted(self._origins))}]"

    def _dense(self, name: str) -> torch.Tensor:
        if self._gguf is not None and name in self._gguf:
            t = self._gguf[name]
            if self.plan.quantization != "none" and t.kind not in ("F32", "F16"):
                self._origins.add(t.kind.lower())
            return t.dense()
        assert self._state is not None, name
        if self.plan.quantization != "none":
            self._origins.add("rtn")
        return self._state[name].detach()

    def vector(self, name: str) -> torch.Tensor:
        """A norm weight or bias, in the serving dtype."""
        if self._gguf is not None and name in self._gguf:
            return self._gguf[name].dense().reshape(-1).to(self.dtype)
        assert self._state is not None, name
        return _aligned(self._state[name].detach().to(self.dtype))

    def has(self, name: str) -> bool:
        return (self._gguf is not None and name in self._gguf) or (self._state is not None and name in self._state)

    def linear(self, names: Sequence[str], bias: torch.Tensor | None = None) -> LinearLike:
        """One layer computing the named weights' outputs concatenated (rows stacked in order)."""
        q = self.plan.quantization
        b = None if bias is None else bias.to(self.dtype)
        if q == "int4" and self._gguf is not None and all(n in self._gguf and self._gguf[n].kind in INT4_KINDS
                                                           for n in names):
            parts = [self._gguf[n].int4_parts() for n in names]
            self._origins.update(self._gguf[n].kind.lower() for n in names)
            q4, scale, zero = (torch.cat(p) for p in zip(*parts))
            if self.plan.blockq:  # w = (q - 8) * scale + zero = q * scale + (zero - 8 * scale): Q4_1's d, m
                return BlockLinear.q4(q4, scale, zero - 8 * scale, dtype=self.dtype, bias=b, exact=self.plan.exact,
                                      planes=self.plan.planes)
            return Int4Linear(q4, scale, zero, dtype=self.dtype, bias=b)
        w = torch.cat([self._dense(n) for n in names])
        if q in ("int4", "int8") and self.plan.blockq:
            return BlockLinear.from_dense(w, "q4" if q == "int4" else "q8", dtype=self.dtype, bias=b,
                                          exact=self.plan.exact, planes=self.plan.planes)
        if q == "int4":
            return Int4Linear.from_dense(w, dtype=self.dtype, bias=b)
        if q == "int8":
            return Int8Linear.from_dense(w, dtype=self.dtype, bias=b)
        return Linear(w.to(self.dtype), b, pack=self.pack)

    def _exact_table(self, name: str) -> torch.Tensor | None:
        """float32 activations: the table as the checkpoint holds it (a GGUF's Q8_0 dequantized exactly),
        not requantized per row; None for other dtypes or where no exact copy is at hand."""
        if self.dtype != torch.float32:
            return None
        if self._state is not None and name in self._state:
            if self._gguf is not None and name in self._gguf:
                self._origins.add(self._gguf[name].kind.lower())
            return self._state[name].detach().float()
        if isinstance(self._gguf, GGUFWeights) and name in self._gguf:
            return self._dense(name)
        return None

    def embed_and_head(self, tied: bool) -> tuple[torch.Tensor | Int8Embedding | BlockEmbedding, LinearLike]:
        """The embedding table (row lookups) and the LM head; one shared table when tied."""
        if (self.plan.quantization != "none" and not self.plan.blockq
                and (table32 := self._exact_table("model.embed_tokens.weight")) is not None):
            head32 = table32 if tied else self._exact_table("lm_head.weight")
            if head32 is not None:
                return table32.contiguous(), Linear(head32.contiguous(), pack=False)
        if self.plan.quantization == "none":
            embed = _aligned(self._dense("model.embed_tokens.weight").to(self.dtype).contiguous())
            head = embed if tied else _aligned(self._dense("lm_head.weight").to(self.dtype).contiguous())
            return embed, Linear(head, pack=self.pack)
        if self.plan.blockq:
            btable = self._table("model.embed_tokens.weight")
            return btable.embedding(), btable if tied else self._table("lm_head.weight")
        table = self._int8("model.embed_tokens.weight")
        qhead = table if tied else self._int8("lm_head.weight")
        return table.embedding(), qhead

    def release(self) -> None:
        """Drop the sources (the state dict, the GGUF or prepared tensors) once the layers are built:
        every layer holds its own copy (fused, packed or quantized), so keeping them would hold the
        checkpoint twice. `label` and `plan` stay."""
        self._state = None
        self._gguf = None

    def _table(self, name: str) -> BlockLinear:
        """The embedding / LM head table in blockq's blocks. int8 models: Q8 per 32, the GGUF's Q8_0 blocks
        as they are. int4 models: 6 bits per 32 (q6, from those blocks or the dense table), as llama.cpp's
        int4 mixes keep their output table at 6 bits: 0.81 bytes a weight against 1.06, which brings the
        default model to 0.33x of bf16's bytes; quality: `switchboard bench quality` (module docstring).
        The exact mode keeps the GGUF's Q8_0 table as it is for int4 models too (its logits decide greedy
        tokens: float32 dense's, on the GGUF's own weights)."""
        blocks = None
        if self._gguf is not None and name in self._gguf and (blocks := self._gguf[name].q8_blocks()) is not None:
            self._origins.add(self._gguf[name].kind.lower())
        kw: dict[str, Any] = {"dtype": self.dtype, "exact": self.plan.exact, "planes": self.plan.planes}
        if self.plan.quantization != "int4" or self.plan.float32_table:
            if blocks:
                return BlockLinear.q8(*blocks, **kw)
            return BlockLinear.from_dense(self._dense(name), "q8", **kw)
        self._origins.add("q6")
        if blocks is not None:
            q, d = blocks
            w = (q.float().view(q.shape[0], -1, 32) * d.unsqueeze(-1)).view(q.shape)
        else:
            w = self._dense(name)
        return BlockLinear.from_dense(w, "q6", **kw)

    def _int8(self, name: str) -> Int8Linear:
        """A per-channel int8 table: as prepared (data_plane/shard/engines/prepared_weights.py) or quantized now."""
        if isinstance(self._gguf, PreparedWeights) and name in self._gguf:
            t = self._gguf[name]
            parts = t.int8_parts()
            if parts is not None:
                self._origins.add(t.kind.lower())
                return Int8Linear(*parts, dtype=self.dtype)
        return Int8Linear.from_dense(self._dense(name), dtype=self.dtype)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or an allocator-aligned copy when it starts off a 64-byte boundary (a transformers model's
    tensors are views into the mapped file at arbitrary offsets). fp32 GEMMs round differently on
    differently aligned operands, so a runner built from a model and one built from the file give the
    same logits only when both tables are aligned; an aligned tensor (the light load's) is not copied."""
    return t if t.data_ptr() % 64 == 0 else t.clone()
