"""Linear layers of the slot runner: y = x @ W.T (+ b), W prepacked for oneDNN where that pays.

    lin = Linear(w, bias=None, pack=should_pack(torch.bfloat16))
    y = lin(x)                    # [..., out_features]
    x = lin.add(h, x)             # x + h @ W.T: the residual add fused into the GEMM when packed

Used by data_plane/shard/engines/llama_runner.py (and spec_runner.py through it) for every projection and the
LM head. Packing (bf16/fp16): `torch.ops.mkldnn._reorder_linear_weight` once at load, then
`_linear_pointwise` per call, the kernels inductor's freezing pass emits. Measured on this CPU
(bf16, SmolLM2-135M's 121 GEMMs of a decode step, weights streamed from memory): a decode step's
GEMMs ~35 -> ~24 ms at batch 1 and ~41 -> ~28 ms at batch 16; the LM head alone 6.5 -> 2.5 ms;
outputs bit-identical to `x @ W.T` in bf16. float32 keeps plain `x @ W.T`: it is the
batch-invariant mode, held by its tests to the kernels it always used. A packed weight is an
opaque mkldnn tensor: only this class reads it (the embedding keeps its own dense copy).
Weight-only int8/int4 layers with this interface: data_plane/shard/engines/quant_linear.py.
"""

from __future__ import annotations

import torch


def should_pack(dtype: torch.dtype) -> bool:
    """Whether `dtype` weights are prepacked here: bf16/fp16 with oneDNN support on this CPU."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


class Linear:
    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = False) -> None:
        self.out_features, self.in_features = w.shape
        self.numel = w.numel()
        self.nbytes = w.numel() * w.element_size()  # the bytes a call reads (as the dense weight)
        self.bias = bias
        self.packed = pack
        if pack:
            self.w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
        else:
            self.w = w.contiguous()
            self._wt = self.w.T

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.w, self.bias, "none", [], "")
        y = x @ self._wt
        return y if self.bias is None else y + self.bias

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T (+ b)."""
        if self.packed and self.bias is None and residual.shape[:-1] == x.shape[:-1]:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.w, None, "add")
        return residual + self(x)
