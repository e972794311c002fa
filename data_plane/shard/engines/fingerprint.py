"""A shard's `system_fingerprint`: a name for what decides its numerics, so that `seed` can be trusted.

    fp = Numerics(engine="torch", model="SmolLM2-135M-Instruct", digest=model_digest(path),
                  dtype="bfloat16", quantization="int4", kernel="blockq_avx2",
                  weights="int4a8[q4_1,q6,q8_0]").fingerprint()          # "fp_" + 10 hex digits

OpenAI documents the field as the backend configuration a model runs with, to be read beside `seed`: the
same seed gives the same text only while the fingerprint stays the same. Here it was a constant
("fp_switchboard_1") while a bf16/int4 shard, a float32 shard and a blockq_x2 shard gave one seed three
texts. It is now derived from what makes those differ, and from nothing else (not the port, the host, the
thread count or the start time), so it is stable across restarts of one configuration and equal on every
shard that computes alike:

- the model: its served name and a digest of its files (`model_digest`: config.json, and each weight file's
  name, size and first and last MiB; a fine-tune of the same shape differs there, and no start-up reads
  gigabytes to say so);
- the resolved weight plan (data_plane/shard/engines/weight_source.py `WeightPlan`): the activation dtype,
  the quantization, the kernel with its CPU path (``blockq_avx512vnni`` and ``blockq_avx2`` round alike but
  are separate code), the weight format it built (``int4a8[q4_1,q6,q8_0]``: the blocks' tables) and whether
  dense weights are oneDNN-packed;
- the engine kind (torch, vllm, synthetic) and its runtime: torch's version and CPU dispatch level, vLLM's
  version and parallel layout;
- `NUMERICS_VERSION`, bumped by hand whenever a change to the kernels, the sampler or the forward pass can
  change a seeded reply (the commit that moves the numbers bumps it: tests/data_plane/test_fingerprint.py
  pins the digest of one configuration, so a bump is a deliberate edit).

The shard puts it on every body and chunk it makes, in `/v1/models`, its ready line and its registration
(`meta["fingerprint"]`); the gateway passes the serving shard's value through (data_plane/routing/events.py
`Fingerprint`), a resumed stream's chunks taking the new shard's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

NUMERICS_VERSION = 1
"""Bump when a kernel, the sampler or the forward pass changes what a seeded request produces."""
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
EDGE_BYTES = 1 << 20
"""How much of each weight file's head and tail the digest reads."""


@dataclass(frozen=True)
class Numerics:
    """What decides a shard's numerics (see the module docstring); its `fingerprint` names it."""

    engine: str
    model: str
    digest: str = ""
    dtype: str = ""
    quantization: str = ""
    kernel: str = ""
    weights: str = ""
    packed: bool = False
    runtime: str = ""
    """What computes the rest (attention, norms, sampling): torch's version and the CPU dispatch level it
    chose (``AVX512``, ``AVX2``: its GEMMs and reductions differ by path)."""
    version: int = NUMERICS_VERSION

    def fingerprint(self) -> str:
        material = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return "fp_" + hashlib.sha256(material.encode()).hexdigest()[:10]


def model_digest(*paths: str | Path | None) -> str:
    """A digest of the model files at `paths` (folders or single files; None skipped): each config.json
    whole, each weight file's size and first and last `EDGE_BYTES` (and its name within a folder, a
    sharded checkpoint's order). Independent of where the files are, what a single file is called and
    their timestamps: the same model copied to another host digests the same."""
    h = hashlib.sha256()
    for p in paths:
        if p is None:
            continue
        path = Path(p)
        files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file()) if path.is_dir() else []
        for f in files:
            if f.name == "config.json":
                h.update(b"config\0" + f.read_bytes())
            elif f.name.endswith(WEIGHT_SUFFIXES):
                size = f.stat().st_size
                h.update(f"weights\0{f.name if f is not path else f.suffix}\0{size}\0".encode())
                with f.open("rb") as fh:
                    h.update(fh.read(EDGE_BYTES))
                    if size > EDGE_BYTES:
                        fh.seek(max(EDGE_BYTES, size - EDGE_BYTES))
                        h.update(fh.read(EDGE_BYTES))
    return h.hexdigest()[:16]


__all__ = ["NUMERICS_VERSION", "Numerics", "model_digest"]
