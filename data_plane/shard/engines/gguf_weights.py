"""A GGUF file's tensors by their Hugging Face names, quantized blocks kept as they are.

    g = GGUFWeights.open(path, num_heads=9, num_kv_heads=3)
    g.kinds()                                   # {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    t = g["model.layers.0.self_attn.q_proj.weight"]
    t.kind                                      # "Q4_1"
    q, scale, zero = t.int4_parts()             # q [N, K] 0..15, w = (q - 8) * scale + zero per 32 along K
    w = t.dense()                               # float32 [N, K] (any kind gguf can dequantize)

Read with the `gguf` package's GGUFReader (a memory map: nothing is copied until asked). Block
layouts (ggml's): Q4_0 = fp16 d + 16 bytes (w = d * (q - 8)); Q4_1 = fp16 d, fp16 m + 16 bytes
(w = d * q + m); byte j of the 16 holds q[j] in its low nibble and q[j + 16] in its high one. So Q4_0
maps onto torch's int4 kernel exactly with scale = d, zero = 0, and Q4_1 with scale = d,
zero = m + 8d (data_plane/shard/engines/quant_linear.py). Q8_0 (fp16 d + 32 int8, one scale per 32)
has no exact kernel here (`_weight_int8pack_mm` takes one scale per output channel): it is
dequantized (`dense()`) and the caller requantizes it. llama.cpp's converter permutes the rows of
attn_q / attn_k for its rotary layout; `__getitem__` undoes that (a row permutation, exact on blocks),
as transformers' GGUF loader does, so rows match the model's own q_proj / k_proj.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCK = 32
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
INT4_KINDS = frozenset({"Q4_0", "Q4_1"})


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a llama-architecture GGUF tensor (None: not a weight we read)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: str
    rows: int
    cols: int
    raw: np.ndarray  # [rows, bytes per row] for block kinds, [rows, cols] (or [cols]) for float kinds
    qtype: object

    def int4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q int32 [N, K] in 0..15, scale [N, K/32], zero [N, K/32]) with w = (q - 8) * scale + zero."""
        if self.kind not in INT4_KINDS:
            raise ValueError(f"{self.name} is {self.kind}, not Q4_0/Q4_1")
        nb = self.cols // BLOCK
        width = 18 if self.kind == "Q4_0" else 20
        blocks = np.ascontiguousarray(self.raw).reshape(self.rows, nb, width)
        d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        qs = torch.from_numpy(blocks[..., width - 16 :].astype(np.int32))  # [N, nb, 16]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(self.rows, self.cols)
        if self.kind == "Q4_0":
            return q, d, torch.zeros_like(d)
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        return q, d, m + 8 * d

    def q8_blocks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A Q8_0 tensor's blocks as they are: (q int8 [N, K], d float32 [N, K/32]) with w = q * d; None
        for other kinds."""
        if self.kind != "Q8_0":
            return None
        blocks = np.ascontiguousarray(self.raw).reshape(self.rows, self.cols // BLOCK, 34)
        d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(self.rows, self.cols)
        return q, d

    def dense(self) -> torch.Tensor:
        """float32 values, [N, K] (or [K] for a vector)."""
        if self.kind in ("F32", "F16"):
            return torch.from_numpy(np.asarray(self.raw, dtype=np.float32).copy())
        from gguf import quants

        out = quants.dequantize(np.asarray(self.raw), self.qtype)  # type: ignore[arg-type]
        return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(self.rows, self.cols).copy())


class GGUFWeights:
    def __init__(self, tensors: dict[str, GGUFTensor], num_heads: int, num_kv_heads: int) -> None:
        self._tensors = tensors
        self._heads = {"q_proj": num_heads, "k_proj": num_kv_heads}

    @classmethod
    def open(cls, path: Path, *, num_heads: int, num_kv_heads: int) -> GGUFWeights:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            shape = [int(s) for s in t.shape]  # ggml order: ne0 (K, contiguous) first
            cols, rows = shape[0], (shape[1] if len(shape) > 1 else 1)
            raw = t.data if len(shape) > 1 else np.asarray(t.data).reshape(-1)
            tensors[name] = GGUFTensor(name, t.tensor_type.name, rows, cols, raw, t.tensor_type)
        return cls(tensors, num_heads, num_kv_heads)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def kinds(self) -> dict[str, int]:
        return dict(Counter(t.kind for t in self._tensors.values()))

    def __getitem__(self, name: str) -> GGUFTensor:
        t = self._tensors[name]
        proj = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else ""
        heads = self._heads.get(proj)
        n = t.rows if t.raw.ndim == 2 else t.cols  # output features (a bias is a vector of them)
        if heads is None or n % (2 * heads):
            return t
        # Undo llama.cpp's rotary permutation of q/k rows: per head, (D/2, 2) -> (2, D/2).
        order = np.arange(n).reshape(heads, n // heads // 2, 2).transpose(0, 2, 1).reshape(-1)
        return GGUFTensor(t.name, t.kind, t.rows, t.cols, t.raw[order], t.qtype)
