"""A GGUF's weights unpacked once into a safetensors file, so a quantized shard starts in seconds.

    path = prepared_path(folder)                       # beside the converted model folder
    write_prepared(gguf_weights, path)                 # `switchboard model prepare` (or the first load)
    w = PreparedWeights.open(path)                     # then: WeightBuilder(plan, gguf=w), as a GGUF
    t = w["model.layers.0.mlp.down_proj.weight"]; t.kind   # "Q4_1": where the blocks came from

Why: reading the default model's GGUF with GGUFReader parses its whole header (the tokenizer's 49,152
strings) and dequantizing its Q8_0 embedding with `gguf.quants` is numpy: together ~7-11 s of a
shard's start here, against ~4 s for the dense safetensors copy. The file holds what the int4/int8
layers are built from, CPU-independent (torch's int4 packing differs per CPU: AVX512 packs 64 rows
per block, AVX2 32, so it is packed at load, ~1 ms a layer):
- Q4_0/Q4_1 tensors: ``NAME:q4`` uint8 [N, K/2] (byte i holds q[2i] low, q[2i+1] high),
  ``NAME:scale`` / ``NAME:zero`` float32 [N, K/32] (w = (q - 8) * scale + zero, exactly the GGUF's);
- the embedding / LM head: ``NAME:q8`` int8 [N, K] and ``NAME:scale8`` float32 [N] (per-channel
  int8, requantized from Q8_0 once, as WeightBuilder would at every load, for torch's int8 kernel),
  and where the GGUF holds Q8_0 its blocks as they are, ``NAME:q8b`` int8 [N, K] and ``NAME:d8b``
  float32 [N, K/32] (blockq.py serves those; v2 of the file added them);
- everything else (norms, biases, other block kinds): ``NAME`` float32, dequantized.
``__kind__`` maps names to their GGUF kinds (the builder's label and the KV seed use them).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from data_plane.shard.engines.gguf_weights import INT4_KINDS, GGUFWeights
from data_plane.shard.engines.quant_linear import Int8Linear

log = logging.getLogger(__name__)
PREPARED_FILE = "switchboard-prepared-v2.safetensors"
TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def prepared_path(folder: Path) -> Path:
    return folder / PREPARED_FILE


class PreparedTensor:
    def __init__(self, name: str, kind: str, tensors: dict[str, torch.Tensor]) -> None:
        self.name, self.kind, self._t = name, kind, tensors

    def int4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        packed = self._t[self.name + ":q4"]
        q = torch.empty((packed.shape[0], packed.shape[1], 2), dtype=torch.int32)  # written once, no temporaries
        torch.bitwise_and(packed, 0xF, out=q[..., 0])
        torch.bitwise_right_shift(packed, 4, out=q[..., 1])
        return q.view(packed.shape[0], -1), self._t[self.name + ":scale"], self._t[self.name + ":zero"]

    def q8_blocks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        q = self._t.get(self.name + ":q8b")
        return None if q is None else (q, self._t[self.name + ":d8b"])

    def int8_parts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        q = self._t.get(self.name + ":q8")
        return None if q is None else (q, self._t[self.name + ":scale8"])

    def dense(self) -> torch.Tensor:
        if self.name in self._t:
            return self._t[self.name]
        parts = self.int8_parts()
        if parts is not None:
            return parts[0].float() * parts[1].unsqueeze(-1)
        q, scale, zero = self.int4_parts()
        n, k = q.shape
        w = (q.float() - 8).view(n, k // 32, 32) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
        return w.view(n, k)


class PreparedWeights:
    """GGUFWeights' interface over a prepared file (rows already in the model's order)."""

    def __init__(self, tensors: dict[str, torch.Tensor], kinds: dict[str, str]) -> None:
        self._t, self._kinds = tensors, kinds

    @classmethod
    def open(cls, path: Path, keep: Callable[[str], bool] | None = None) -> PreparedWeights:
        """`keep`: only the weights it accepts (by model name) are read (a pipeline stage's layers)."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            kinds = json.loads((f.metadata() or {})["__kind__"])
            if keep is not None:
                kinds = {k: v for k, v in kinds.items() if keep(k)}
            # Copies: a tensor left a view of the file would keep all of its mapped pages resident.
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()  # noqa: SIM118 - safe_open has no iterator
                       if k.split(":", 1)[0] in kinds}
        return cls(tensors, kinds)

    def __contains__(self, name: str) -> bool:
        return name in self._kinds

    def __getitem__(self, name: str) -> PreparedTensor:
        return PreparedTensor(name, self._kinds[name], self._t)

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self._kinds.values():
            out[k] = out.get(k, 0) + 1
        return out


def load_or_prepare(gguf: Path, folder: Path, num_heads: int, num_kv_heads: int,
                    keep: Callable[[str], bool] | None = None) -> PreparedWeights | GGUFWeights:
    """The prepared file beside `folder` (written from `gguf` first if missing); the GGUF itself when the
    folder is not writable (a memory map: only the tensors a stage builds are ever read). `keep`: read
    only those weights (a pipeline stage's, model_files.stage_tensors)."""
    path = prepared_path(folder)
    if not path.exists():
        g = GGUFWeights.open(gguf, num_heads=num_heads, num_kv_heads=num_kv_heads)
        try:
            write_prepared(g, path)
        except OSError as exc:
            log.warning("could not write %s (%s): serving from the GGUF", path, exc)
            return g
        log.info("prepared %s from %s", path.name, gguf.name)
    return PreparedWeights.open(path, keep)


def write_prepared(g: GGUFWeights, path: Path) -> Path:
    """Unpack `g` into `path` (atomically: written beside, then renamed)."""
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for name in g.names():
        t = g[name]
        kinds[name] = t.kind
        if t.kind in INT4_KINDS:
            q, scale, zero = t.int4_parts()
            qb = q.to(torch.uint8).view(q.shape[0], -1, 2)
            out[name + ":q4"] = (qb[..., 0] | (qb[..., 1] << 4)).contiguous()
            out[name + ":scale"], out[name + ":zero"] = scale.contiguous(), zero.contiguous()
        elif name in TABLES:
            table = Int8Linear.from_dense(t.dense(), dtype=torch.float32)
            out[name + ":q8"], out[name + ":scale8"] = table.w, table.scale
            if (blocks := t.q8_blocks()) is not None:
                out[name + ":q8b"], out[name + ":d8b"] = blocks
        else:
            out[name] = t.dense().contiguous()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(out, str(tmp), metadata={"__kind__": json.dumps(kinds)})
    tmp.replace(path)
    return path
