"""Weight-only quantized linear layers, the same interface as packed_linear.Linear.

    lin = Int4Linear.from_dense(w, dtype=torch.bfloat16)            # quantized at load (group 32, min/max)
    lin = Int4Linear(q, scale, zero, dtype=torch.bfloat16)          # GGUF Q4_0/Q4_1 blocks as they are
    lin = Int8Linear.from_dense(w, dtype=torch.bfloat16)            # per-channel int8
    y = lin(x); x = lin.add(h, x)                                   # as Linear: x @ W.T, residual + h @ W.T
    emb = lin.embedding(); rows = emb[ids]                          # Int8Linear: the tied embedding, same bytes

Built by data_plane/shard/engines/weight_source.py for data_plane/shard/engines/llama_runner.py. The
kernels are torch's CPU weight-only ones: `_weight_int4pack_mm_for_cpu` over a weight packed once by
`_convert_weight_to_int4pack_for_cpu` (w = (q - 8) * s + z per group of `group` weights along K), and
`_weight_int8pack_mm` (w = q * s, one scale per output channel). Activations stay in the serving dtype
and the scales are stored in it (the kernels require that). Measured here (AMD EPYC, avx512_bf16, 1
thread, the 120 projections of a SmolLM2-135M decode step): bf16 dense 7.8 ms at batch 1 / 14.2 ms at
batch 16, int4 3.9 / 22.1, int8 7.3 / 25.0; with float32 activations the same kernels take 169 ms
(int4) and 75 ms (int8) at batch 1, against 27 ms dense: they are only served with bf16 activations
(weight_source.resolve_plan). Both kernels compute each row on its own (a row's output is
bit-identical alone and in a batch of 16, checked by tests/data_plane/test_quant_linear.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

INT4_GROUP = 32
"""Weights per (scale, zero) pair along K: GGUF's Q4_0/Q4_1 block size, one the kernel takes."""
INT4_INNER_K_TILES = 2


def _kernel(name: str) -> Callable[..., torch.Tensor]:
    """torch's C-bound function `name`: `torch.ops.aten.X(...)` goes through a Python
    `OpOverloadPacket.__call__` first (~1 us a call, 121 calls a decode step). A torch without it
    (2.5 has no `_weight_int4pack_mm_for_cpu`) fails when a layer is called, not at import."""
    fn = getattr(torch, name, None)
    return fn if fn is not None else lambda *args: getattr(torch.ops.aten, name)(*args)


_int4_mm = _kernel("_weight_int4pack_mm_for_cpu")
_int8_mm = _kernel("_weight_int8pack_mm")


def int4_parts(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] in 0..15, scale, zero [N, K/group]) of `w`, GGUF Q4_1's rule: per group, min..max in 16 levels."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).reshape(n, k)
    return q.to(torch.int32), scale, lo + 8 * scale


class Int4Linear:
    """4-bit weights in groups along K (asymmetric: a scale and a zero per group), one GEMM kernel."""

    packed = False

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *, dtype: torch.dtype,
                 bias: torch.Tensor | None = None, group: int = INT4_GROUP) -> None:
        """q: int [N, K] in 0..15; scale, zero: [N, K / group]; w[n, k] = (q - 8) * scale + zero."""
        n, k = q.shape
        if n % 16 or k % group:
            raise ValueError(f"int4 weights need N % 16 == 0 and K % {group} == 0 (got {n} x {k})")
        self.out_features, self.in_features, self.numel, self.group = n, k, n * k, group
        self.bias = bias
        self.w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(),
                                                                    INT4_INNER_K_TILES)
        self.scale_zeros = torch.stack([scale.T, zero.T], dim=-1).to(dtype).contiguous()  # [K/g, N, 2]
        self.nbytes = self.w.numel() * self.w.element_size() + self.scale_zeros.numel() * self.scale_zeros.element_size()

    @classmethod
    def from_dense(cls, w: torch.Tensor, *, dtype: torch.dtype, bias: torch.Tensor | None = None,
                   group: int = INT4_GROUP) -> Int4Linear:
        """Quantize at load like GGUF's Q4_1: per group, min..max over 16 levels."""
        return cls(*int4_parts(w, group), dtype=dtype, bias=bias, group=group)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the kernel computes with (tests; never on a serving path)."""
        eye = torch.eye(self.in_features, dtype=self.scale_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.w, self.group, self.scale_zeros).float().T

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the runner's packed rows [T, K]: no reshape/view dispatches (240 of ~1,300 a decode step)
            y = _int4_mm(x, self.w, self.group, self.scale_zeros)
        else:
            y = _int4_mm(x.reshape(-1, self.in_features), self.w, self.group,
                         self.scale_zeros).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T (+ b)."""
        return residual + self(x)


class Int8Linear:
    """8-bit weights with one scale per output channel (row); also serves as the tied embedding table."""

    packed = False

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> None:
        """q: int8 [N, K]; scale: [N]; w[n, k] = q * scale[n]."""
        self.out_features, self.in_features = q.shape
        self.numel = q.numel()
        self.bias = bias
        self.w = q.to(torch.int8).contiguous()
        self.scale = scale.to(dtype).contiguous()
        self.dtype = dtype
        self.nbytes = self.w.numel() + self.scale.numel() * self.scale.element_size()

    @classmethod
    def from_dense(cls, w: torch.Tensor, *, dtype: torch.dtype, bias: torch.Tensor | None = None) -> Int8Linear:
        """Symmetric per-channel quantization: scale = max|row| / 127."""
        wf = w.float()
        scale = (wf.abs().amax(-1) / 127).clamp(min=1e-12)
        q = (wf / scale.unsqueeze(-1)).round().clamp(-127, 127)
        return cls(q, scale, dtype=dtype, bias=bias)

    def dequantize(self) -> torch.Tensor:
        return self.w.float() * self.scale.float().unsqueeze(-1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            y = _int8_mm(x, self.w, self.scale)
        else:
            y = _int8_mm(x.reshape(-1, self.in_features), self.w, self.scale).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self(x)

    def embedding(self) -> Int8Embedding:
        """Row lookups over these very bytes (a tied LM head and embedding are stored once)."""
        return Int8Embedding(self)


class Int8Embedding:
    """`emb[ids]` -> [len(ids), K] rows dequantized to the serving dtype (q * scale: exact per row)."""

    def __init__(self, table: Int8Linear) -> None:
        self.table = table
        self.nbytes = table.nbytes

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        return t.w[ids].to(t.dtype) * t.scale[ids].unsqueeze(-1)
