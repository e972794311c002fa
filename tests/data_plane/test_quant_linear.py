"""Weight-only int4/int8 layers and the dtype/quantization policy, without the model:
- Int4Linear/Int8Linear compute x @ W.T of the weight they hold (dequantized), rows batch-invariant;
- GGUF Q4_1/Q4_0 block bytes map onto the int4 kernel exactly (scale = d, zero = m + 8d);
- resolve_plan's choices on a CPU with native bf16 and on an AVX2-only one (capabilities passed in)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data_plane.model_store import gguf_source_kind
from data_plane.shard.engines.gguf_weights import GGUFTensor
from data_plane.shard.engines.quant_linear import Int4Linear, Int8Linear
from data_plane.shard.engines.weight_source import CpuCaps, DtypeReason, QuantReason, resolve_plan

XEON = CpuCaps("AVX512", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}), "Intel Xeon")
EPYC_AVX2 = CpuCaps("AVX2", frozenset({"fma", "avx", "avx2"}), "AMD EPYC")


def test_auto_on_a_cpu_with_native_bf16() -> None:
    p = resolve_plan("auto", "auto", source="dense", caps=XEON)
    assert (p.dtype, p.dtype_reason, p.quantization, p.quantization_reason) == (
        "bfloat16", DtypeReason.NATIVE_BF16, "none", QuantReason.DENSE_MODEL)
    p = resolve_plan("auto", "auto", source="q4", caps=XEON)
    assert (p.dtype, p.dtype_reason, p.quantization, p.quantization_reason) == (
        "bfloat16", DtypeReason.QUANTIZED_KERNEL, "int4", QuantReason.GGUF_Q4)


def test_auto_on_an_avx2_only_cpu_never_picks_dense_bf16() -> None:
    p = resolve_plan("auto", "auto", source="dense", caps=EPYC_AVX2)
    assert (p.dtype, p.dtype_reason, p.quantization) == ("float32", DtypeReason.NO_NATIVE_BF16, "none")
    p = resolve_plan("auto", "none", source="q4", caps=EPYC_AVX2)
    assert (p.dtype, p.dtype_reason) == ("float32", DtypeReason.NO_NATIVE_BF16)
    p = resolve_plan("auto", "auto", source="q8", caps=EPYC_AVX2)
    assert (p.dtype, p.quantization, p.quantization_reason) == ("bfloat16", "int8", QuantReason.GGUF_Q8)
    # onednn without bf16 support counts as no native bf16 even if cpuinfo lists the flag
    assert not CpuCaps("AVX512", frozenset({"avx512_bf16"}), "x", onednn_bf16=False).native_bf16


def test_explicit_float32_stays_dense_and_batch_invariant() -> None:
    for caps in (XEON, EPYC_AVX2):
        p = resolve_plan("float32", "auto", source="q4", caps=caps)
        assert (p.dtype, p.dtype_reason, p.quantization, p.quantization_reason) == (
            "float32", DtypeReason.REQUESTED, "none", QuantReason.DENSE_ACTIVATIONS)
    p = resolve_plan("float32", "int4", source="q4", caps=XEON)  # asked for: served, slowly
    assert (p.dtype, p.quantization, p.quantization_reason) == ("float32", "int4", QuantReason.REQUESTED)
    with pytest.raises(ValueError):
        resolve_plan("fp8", "auto", source="q4", caps=XEON)
    with pytest.raises(ValueError):
        resolve_plan("auto", "gptq", source="q4", caps=XEON)


def test_gguf_source_kind() -> None:
    assert gguf_source_kind({"Q4_1": 210, "F32": 61, "Q8_0": 1}) == "q4"
    assert gguf_source_kind({"Q8_0": 211, "F32": 61}) == "q8"
    assert gguf_source_kind({"F16": 211, "F32": 61}) == "dense"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_and_int8_compute_with_the_weight_they_hold_and_rows_are_batch_invariant(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 96) * 0.05
    x = torch.randn(5, 96).to(dtype)
    for lin in (Int4Linear.from_dense(w, dtype=dtype), Int8Linear.from_dense(w, dtype=dtype)):
        wq = lin.dequantize()
        assert (wq - w).abs().max() < (0.05 * 6 / 15 if isinstance(lin, Int4Linear) else 0.05 * 6 / 127)
        y = lin(x)
        ref = x.float() @ wq.T
        assert y.dtype == dtype and y.shape == (5, 48)
        assert (y.float() - ref).abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-4)
        solo = torch.cat([lin(x[i : i + 1]) for i in range(5)])
        assert torch.equal(solo, y)  # each row computed on its own: batch-invariant
        r = torch.randn(5, 48).to(dtype)
        assert torch.equal(lin.add(x, r), r + y)
    assert Int4Linear.from_dense(w, dtype=torch.bfloat16).nbytes < w.numel() * 2 * 0.35


def test_int8_table_serves_as_embedding() -> None:
    w = torch.randn(64, 32)
    lin = Int8Linear.from_dense(w, dtype=torch.float32)
    ids = torch.tensor([3, 0, 63])
    assert torch.allclose(lin.embedding()[ids], lin.dequantize()[ids])


def _q4_block(kind: str, d: float, m: float, q: np.ndarray) -> bytes:
    out = np.float16(d).tobytes() + (np.float16(m).tobytes() if kind == "Q4_1" else b"")
    return out + bytes(int(q[j]) | (int(q[j + 16]) << 4) for j in range(16))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_map_exactly_onto_the_int4_kernel(kind: str) -> None:
    rng = np.random.default_rng(1)
    rows, cols = 16, 64
    q = rng.integers(0, 16, size=(rows, cols))
    d = rng.uniform(0.01, 0.1, size=(rows, cols // 32)).astype(np.float16)
    m = -rng.uniform(0.1, 0.8, size=(rows, cols // 32)).astype(np.float16)
    raw = np.frombuffer(b"".join(_q4_block(kind, d[r, b], m[r, b], q[r, b * 32 : (b + 1) * 32])
                                 for r in range(rows) for b in range(cols // 32)), dtype=np.uint8).reshape(rows, -1)
    t = GGUFTensor("w", kind, rows, cols, raw, None)
    qq, scale, zero = t.int4_parts()
    assert torch.equal(qq, torch.from_numpy(q).to(torch.int32))
    # ggml's own formula, per element
    df = np.repeat(d.astype(np.float32), 32, axis=1)
    ref = df * (q - 8) if kind == "Q4_0" else df * q + np.repeat(m.astype(np.float32), 32, axis=1)
    lin = Int4Linear(qq, scale, zero, dtype=torch.float32)
    assert np.allclose(lin.dequantize().numpy(), ref, atol=1e-6)


def test_kv_digests_are_seeded_with_the_weight_format() -> None:
    from data_plane.shard.engines.kv_cache import BlockHasher, layout_seed

    ids = list(range(64))
    digests = {w: BlockHasher(layout_seed("m", "bfloat16", "L30", weights=w), 16).hashes(ids)
               for w in ("dense", "int4[q4_1,q8_0]", "int4[rtn]", "int8[q4_1,q8_0]")}
    assert len({d[0] for d in digests.values()}) == 4  # no block of one format ever answers another
    assert layout_seed("m", "bfloat16", "L30") == layout_seed("m", "bfloat16", "L30", weights="dense")
