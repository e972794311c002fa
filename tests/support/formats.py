"""The real model's batch-invariant format for tests: float32 activations on blockq's int4 kernel.

    Service(["shard", *INVARIANT_ARGS, "--threads", "1"])         # a shard's flags
    TorchEngine(EngineConfig(**INVARIANT, max_num_seqs=4, ...))   # an in-process engine

Why not float32 dense: the tests that need a sequence's tokens not to depend on its batch (solo =
batched, speculation on = off, N stages = 1, a resumed stream = an unbroken one) need a batch-invariant
format, not float32's numerics. blockq (data_plane/shard/engines/blockq.py) computes a row's logits
bit-identically whatever the batch, the thread count or the CPU path, like float32 dense, and reads
87 MiB of weights a token against dense float32's 513 MiB: the engine tests' workload (a 30-token
prompt, 24 greedy tokens) took 0.3 s against 1.6 s at one stream and 0.8 s against 2.7 s at four, one
thread, on an AMD EPYC with avx512_vnni and on its AVX2 path alike (2026-12-03). Where blockq cannot be
built here (no C compiler) `--quantization int4` would fall back to torch's exact int4 loop, several
times slower than dense: these tests then keep float32 dense. Tests of float32 dense itself (its
exactness against transformers, its memory) name their flags themselves.
"""

from __future__ import annotations

from typing import Any


def _blockq_loads() -> bool:
    from data_plane.shard.engines import blockq

    return blockq.load() is not None


BLOCKQ = _blockq_loads()
INVARIANT: dict[str, Any] = (
    {"dtype": "float32", "quantization": "int4", "quantization_kernel": "blockq"} if BLOCKQ else {"dtype": "float32"})
"""EngineConfig keywords of the batch-invariant format."""
INVARIANT_ARGS: tuple[str, ...] = (
    ("--dtype", "float32", "--quantization", "int4", "--quantization-kernel", "blockq") if BLOCKQ
    else ("--dtype", "float32"))
"""`switchboard shard` flags of the same format."""
