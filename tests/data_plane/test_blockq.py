"""The blockq kernel (data_plane/shard/engines/blockq.py, native/blockq.c and its float-activation path
native/blockq_exact.c): every CPU path this machine runs gives the portable C path's bits; rows do not
depend on the batch or the thread count; the weight layout holds the GGUF's blocks exactly; the exact path
is float32 GEMM close to the dequantized weights; the policy picks each as documented."""

from __future__ import annotations

import pytest
import torch

from data_plane.shard.engines import blockq
from data_plane.shard.engines.weight_source import CpuCaps, DtypeReason, QuantReason, resolve_plan

kernel = blockq.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler here: blockq is not built")
PATHS = [isa for name, isa in blockq.ISAS.items() if kernel is not None and isa <= kernel.isa]


def _layer(fmt: str, n: int = 48, k: int = 128, dtype: torch.dtype = torch.float32,
           exact: bool = False, planes: int = 1) -> blockq.BlockLinear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    w[:, 5] *= 30  # an outlier channel, as real activations and weights have
    return blockq.BlockLinear.from_dense(w, fmt, dtype=dtype, exact=exact, planes=planes)


@pytest.mark.parametrize("exact,planes", [(False, 1), (False, 2), (True, 1)],
                         ids=["int8_activations", "two_int8_planes", "exact"])
@pytest.mark.parametrize("fmt", ["q4", "q8", "q6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_cpu_path_gives_the_portable_bits(fmt: str, dtype: torch.dtype, exact: bool, planes: int) -> None:
    lin = _layer(fmt, dtype=dtype, exact=exact, planes=planes)
    g = torch.Generator().manual_seed(2)
    norm = torch.rand(128, generator=g).to(dtype) + 0.5
    for m in (1, 3, 4, 7, 16):
        x = (torch.randn(m, 128, generator=g) * 3).to(dtype)
        res = torch.randn(m, 48, generator=g).to(dtype)
        outs = []
        for isa in PATHS:
            lin.isa = isa
            outs.append((lin(x), lin.add(x, res), lin.normed(x, norm, 1e-5)))
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                assert torch.equal(a, b), (fmt, dtype, m)


@pytest.mark.parametrize("fmt", ["q4", "q8", "q6"])
def test_close_to_the_dequantized_gemm_and_rows_independent_of_the_batch(fmt: str) -> None:
    lin = _layer(fmt)
    w = lin.dequantize()
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(3))
    y = lin(x)
    ref = x @ w.T
    # the activations' int8 rounding per block of 32 (llama.cpp's): ~0.4 % of a block's largest value
    assert (y - ref).abs().max() <= 0.02 * ref.abs().max()
    torch.set_num_threads(2)
    batched = lin(x)
    torch.set_num_threads(1)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(9)])
    assert torch.equal(batched, alone) and torch.equal(y, alone)
    # the fused norm and residual agree with doing them outside (float32: the same math, other rounding)
    norm = torch.rand(128) + 0.5
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
    assert torch.allclose(lin.normed(x, norm, 1e-5), lin(normed), rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    res = torch.randn(9, 48)
    assert torch.allclose(lin.add(x, res), res + y, atol=1e-5)


@pytest.mark.parametrize("fmt", ["q4", "q8", "q6"])
def test_the_exact_path_is_float32_gemm_on_the_blocks_weights(fmt: str) -> None:
    """float32 activations (native/blockq_exact.c): against a float64 GEMM of the dequantized weights, no
    further from it than torch's own float32 GEMM is (a few ulps of accumulation); rows alone = batched."""
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(5)) * 0.05
    lin = blockq.BlockLinear.from_dense(w, fmt, dtype=torch.float32, exact=True)
    dq = lin.dequantize()
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(6))
    x[:, 7] *= 40  # an outlier channel: int8 activations would lose the rest of its block
    ref = x.double() @ dq.double().T
    torch_err = ((x @ dq.T).double() - ref).abs().max().item()
    y = lin(x)
    assert (y.double() - ref).abs().max().item() <= 4 * torch_err + 1e-6 * ref.abs().max().item()
    alone = torch.cat([lin(x[i : i + 1]) for i in range(9)])
    assert torch.equal(y, alone)
    inexact = blockq.BlockLinear.from_dense(w, fmt, dtype=torch.float32)  # the same blocks, int8 activations
    assert (inexact(x).double() - ref).abs().max().item() > 10 * (y.double() - ref).abs().max().item()


def test_the_layout_holds_q4_1_q8_0_and_q6_blocks_exactly() -> None:
    g = torch.Generator().manual_seed(4)
    q4 = torch.randint(0, 16, (32, 64), generator=g)
    d = torch.rand(32, 2, generator=g).half().float()
    m = (torch.rand(32, 2, generator=g) - 0.5).half().float()
    lin = blockq.BlockLinear.q4(q4, d, m, dtype=torch.float32)
    expect = (q4.float().view(32, 2, 32) * d.unsqueeze(-1) + m.unsqueeze(-1)).view(32, 64)
    assert torch.equal(lin.dequantize(), expect)
    q8 = torch.randint(-128, 128, (32, 64), generator=g, dtype=torch.int8)
    lin8 = blockq.BlockLinear.q8(q8, d, dtype=torch.bfloat16)
    table = (q8.float().view(32, 2, 32) * d.unsqueeze(-1)).view(32, 64)
    assert torch.equal(lin8.dequantize(), table)
    ids = torch.tensor([[0, 31], [16, 15]])
    assert torch.equal(lin8.embedding()[ids], table[ids].to(torch.bfloat16))
    with pytest.raises(IndexError):
        lin8.embedding()[torch.tensor([32])]
    q6 = torch.randint(-31, 32, (32, 64), generator=g)
    d16 = torch.rand(32, 4, generator=g).half().float()  # a scale per 16
    lin6 = blockq.BlockLinear.q6(q6, d16, dtype=torch.float32)
    assert torch.equal(lin6.dequantize(), (q6.float().view(32, 4, 16) * d16.unsqueeze(-1)).view(32, 64))


def test_shapes_the_tiles_cannot_hold_are_refused() -> None:
    with pytest.raises(ValueError, match="N % 16"):
        blockq.BlockLinear.from_dense(torch.randn(20, 64), "q4", dtype=torch.float32)


def test_shard_help_says_what_dtype_blockq_x2_serves() -> None:
    """`switchboard shard --help` said blockq_x2 meant "float32 activations" and --dtype auto meant bfloat16
    on a native-bf16 CPU: blockq_x2 takes float32 from --dtype auto (whatever the CPU) and keeps bfloat16
    when asked for it."""
    from data_plane.shard.settings import ShardSettings

    native = CpuCaps("AVX512", frozenset({"avx512_bf16"}), blockq="avx512_vnni")
    assert resolve_plan("auto", "auto", source="q4", caps=native, kernel="blockq_x2").dtype == "float32"
    assert resolve_plan("bfloat16", "auto", source="q4", caps=native, kernel="blockq_x2").dtype == "bfloat16"
    kernel_help = ShardSettings.model_fields["quantization_kernel"].description or ""
    x2 = kernel_help[kernel_help.index("blockq_x2"):kernel_help.index("blockq_exact or torch")]
    assert "with --dtype auto" in x2 and "bfloat16" in x2, x2
    dtype_help = ShardSettings.model_fields["dtype"].description or ""
    assert "blockq_x2" in dtype_help.split("else bfloat16")[0], dtype_help


def test_policy_blockq_where_it_loads_and_its_exact_path_for_the_exact_mode() -> None:
    native = CpuCaps("AVX512", frozenset({"avx512_bf16"}), blockq="avx512_vnni")
    avx2 = CpuCaps("AVX2", frozenset({"avx2"}), onednn_bf16=False, blockq="avx2")
    none = CpuCaps("AVX2", frozenset({"avx2"}), onednn_bf16=False)
    # the default: one int8 plane (llama.cpp's numerics), the table at 6 bits, the dtype by the CPU (two
    # planes cost 0.84x / 0.64x its tok/s at 1 / 16 streams: opt-in, below)
    plan = resolve_plan("auto", "auto", source="q4", caps=native)
    assert (plan.dtype, plan.quantization, plan.kernel) == ("bfloat16", "int4", "blockq_avx512_vnni")
    assert (plan.planes, plan.kernel_choice, plan.float32_table) == (1, "blockq", False)
    assert resolve_plan("auto", "auto", source="q4", caps=native, kernel="blockq") == plan
    # no native bf16: blockq takes float32 activations as fast, so auto follows the CPU
    plan = resolve_plan("auto", "auto", source="q4", caps=avx2)
    assert (plan.dtype, plan.dtype_reason, plan.kernel) == ("float32", DtypeReason.NO_NATIVE_BF16, "blockq_avx2")
    # two planes by name: float32 activations whatever the CPU (dtype reason agreement), the GGUF's Q8_0
    # table, what the GGUF ships even with float32 asked for; bf16 only asked for; never float16
    for caps in (native, avx2):
        plan = resolve_plan("auto", "auto", source="q4", caps=caps, kernel="blockq_x2")
        assert (plan.dtype, plan.dtype_reason, plan.quantization, plan.kernel) == (
            "float32", DtypeReason.AGREEMENT, "int4", f"blockq_x2_{caps.blockq}")
        assert (plan.planes, plan.kernel_choice, plan.float32_table, plan.exact) == (2, "blockq_x2", True, False)
    plan = resolve_plan("float32", "auto", source="q8", caps=native, kernel="blockq_x2")
    assert (plan.quantization, plan.quantization_reason, plan.kernel) == ("int8", QuantReason.GGUF_Q8,
                                                                          "blockq_x2_avx512_vnni")
    plan = resolve_plan("bfloat16", "int4", source="q4", caps=avx2, kernel="blockq_x2")
    assert (plan.dtype, plan.dtype_reason, plan.planes) == ("bfloat16", DtypeReason.REQUESTED, 2)
    with pytest.raises(ValueError, match="blockq_x2"):
        resolve_plan("float16", "int4", source="q4", caps=native, kernel="blockq_x2")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_plan("auto", "auto", source="q4", caps=native, kernel="blockq_int8")
    # where blockq did not build, two planes by name are torch's kernels (a pipeline stage refuses that) with
    # float32 activations, the exact mode: the greedy tokens asked for (it served bf16 on torch's fast kernels)
    plan = resolve_plan("auto", "auto", source="q4", caps=none, kernel="blockq_x2")
    assert (plan.kernel_choice, plan.dtype, plan.dtype_reason, plan.quantization) == (
        "torch", "float32", DtypeReason.EXACT_KERNEL, "int4")
    assert resolve_plan("bfloat16", "auto", source="q4", caps=none, kernel="blockq_x2").dtype == "bfloat16"
    # torch's weight-only kernels need bf16 activations to be fast
    plan = resolve_plan("auto", "auto", source="q4", caps=none)
    assert (plan.dtype, plan.dtype_reason, plan.kernel) == ("bfloat16", DtypeReason.QUANTIZED_KERNEL, "torch")
    # float32 with an explicit format: the exact mode, float32 activations on blockq (torch's exact kernels
    # where blockq did not build); blockq by name rounds them to int8 (fast, batch-invariant, not exact)
    plan = resolve_plan("float32", "int4", source="q4", caps=native)
    assert (plan.kernel, plan.exact, plan.blockq) == ("blockq_exact_avx512_vnni", True, True)
    assert resolve_plan("float32", "int4", source="q4", caps=none).kernel == "torch"
    assert resolve_plan("float32", "int4", source="q4", caps=native, kernel="blockq").kernel == "blockq_avx512_vnni"
    assert resolve_plan("float32", "int4", source="q4", caps=native, kernel="torch").kernel == "torch"
    # blockq takes float32 or bf16 activations: float16 is torch's, even by name (its buffers are not float32)
    assert resolve_plan("float16", "int4", source="q4", caps=native).kernel == "torch"
    assert resolve_plan("float16", "int4", source="q4", caps=native, kernel="blockq").kernel == "torch"
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        blockq.BlockLinear.from_dense(torch.randn(16, 32), "q4", dtype=torch.float16)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        _layer("q4")(torch.randn(2, 128).half())
    # blockq_exact by name: the model's own blocks, float32 activations whatever the CPU
    plan = resolve_plan("auto", "auto", source="q4", caps=native, kernel="blockq_exact")
    assert (plan.dtype, plan.dtype_reason, plan.quantization, plan.kernel) == (
        "float32", DtypeReason.EXACT_KERNEL, "int4", "blockq_exact_avx512_vnni")
    assert resolve_plan("auto", "auto", source="q4", caps=none, kernel="blockq_exact").dtype == "float32"
    with pytest.raises(ValueError, match="float32 activations"):
        resolve_plan("bfloat16", "auto", source="q4", caps=native, kernel="blockq_exact")
    assert resolve_plan("auto", "auto", source="q4", caps=native, kernel="torch").kernel == "torch"
    assert resolve_plan("auto", "none", source="q4", caps=native).kernel == "torch"  # dense: no blockq
    with pytest.raises(ValueError, match="kernel"):
        resolve_plan("auto", "auto", source="q4", caps=native, kernel="fast")


@pytest.fixture(scope="module")
def runner():  # type: ignore[no-untyped-def]
    """The default model on blockq (bf16 activations), 4 slots."""
    from data_plane.model_store import model_source
    from data_plane.shard.engines.llama_runner import LlamaRunner

    src = model_source(None)
    plan = resolve_plan("bfloat16", "int4", source=src.kind, caps=CpuCaps.detect(), kernel="blockq")
    return LlamaRunner.from_pretrained(src.path, dtype=torch.bfloat16, max_num_seqs=4, max_len=256, plan=plan,
                                       gguf=src.gguf)


def test_native_attention_is_as_close_to_float32_as_the_torch_path_and_rows_stand_alone(runner) -> None:  # type: ignore[no-untyped-def]
    """Decode and verify passes through attention.Native (rope + KV write + attention in C) are at least
    as close to float32 dense as the same weights through the torch attention path (measured: max logit
    error 0.80 against 1.25: the rope stays float32), and a row's logits are bit-identical alone and
    beside other slots (every op of a blockq pass computes rows on their own)."""
    from data_plane.model_store import model_source
    from data_plane.shard.engines.llama_runner import LlamaRunner

    assert runner.native is not None
    src = model_source(None)
    dense = LlamaRunner.from_pretrained(src.path, dtype=torch.float32, max_num_seqs=4, max_len=256)
    prompts = [list(range(300, 340)), list(range(500, 517)), list(range(700, 760))]
    lens = [len(p) for p in prompts]
    rows = [[11, 21, 22], [12, 23, 24], [13, 25, 26]]

    def passes(r):  # type: ignore[no-untyped-def]
        with torch.inference_mode():
            for slot, ids in enumerate(prompts):
                r.prefill(slot, ids, 0)
            return r.decode([11, 12, 13], lens), r.verify(rows, lens)

    ref_decode, ref_verify = passes(dense)
    native = passes(runner)
    kernel, runner.native = runner.native, None
    try:
        torch_path = passes(runner)
    finally:
        runner.native = kernel
    for got, other, ref in zip(native, torch_path, (ref_decode, ref_verify)):
        assert (got - ref).abs().max() <= 1.5 * (other - ref).abs().max()
        assert (got.argmax(-1) == ref.argmax(-1)).sum() >= (other.argmax(-1) == ref.argmax(-1)).sum() - 1
    decode, verify = native
    assert torch.equal(verify[::3], decode)  # a verify pass's first row of each slot is its decode step
    with torch.inference_mode():
        alone = runner.decode([11], lens[:1])  # slot 0 by itself: the same bits as beside slots 1 and 2
    assert torch.equal(alone[0], decode[0])


def test_a_bf16_runners_logits_are_the_heads_float32_sums_not_bf16_steps(runner) -> None:  # type: ignore[no-untyped-def]
    """With bf16 activations the blockq head still writes float32 logits: the kernel's sums as they are,
    which rounded to bf16 are exactly the bf16 output. Rounded first, this model's logits (~20 in magnitude)
    moved in steps of 0.125: near-ties became exact ties (greedy, top_p and min_p picked among equals and
    top_logprobs listed them in arbitrary order)."""
    with torch.inference_mode():
        logits = runner.prefill(0, list(range(300, 340)), 0)
        hidden = torch.randn(3, runner.lm_head.in_features, dtype=torch.bfloat16)
        sums = runner.lm_head.normed(hidden, runner.norm, runner.eps, out=torch.float32)
        rounded = runner.lm_head.normed(hidden, runner.norm, runner.eps)
    assert logits.dtype == torch.float32
    assert not torch.equal(logits, logits.bfloat16().float())  # off bf16's grid
    assert len(set(logits.topk(20).values.tolist())) == 20  # no exact ties among the top
    assert torch.equal(sums.bfloat16(), rounded)


def test_float32_on_blockq_gives_a_token_the_same_bits_whichever_pass_carried_it() -> None:
    """float32 on blockq sends prompts through attention.Native too (llama_runner.native_prompts), so a
    position's logits are bit-identical whether its token came in a prompt, a chunk of one, a decode step
    or a verify pass: what a resumed stream (its text prefilled) and a jump-forward run of forced tokens
    rely on to continue the unbroken text. Through the torch path for prompts they were not (checked)."""
    from data_plane.model_store import model_source
    from data_plane.shard.engines.llama_runner import LlamaRunner

    src = model_source(None)
    plan = resolve_plan("float32", "int4", source=src.kind, caps=CpuCaps.detect(), kernel="blockq")
    r = LlamaRunner.from_pretrained(src.path, dtype=torch.float32, max_num_seqs=2, max_len=128, plan=plan,
                                    gguf=src.gguf)
    assert r.native is not None and r.native_prompts
    ids = list(range(400, 440))
    with torch.inference_mode():
        whole = r.forward([(1, ids, 0)], logits=[len(ids)])  # slot 1: every position's logits, one prompt pass
        r.forward([(0, ids[:20], 0)])  # slot 0: a chunk of 20, a chunk of 12, then a decode and a verify pass
        chunk = r.forward([(0, ids[20:32], 20)], logits=[12])
        step = r.decode([ids[32]], [32])
        verify = r.verify([ids[33:40]], [33])
    assert torch.equal(chunk, whole[20:32])
    assert torch.equal(step[0], whole[32])
    assert torch.equal(verify, whole[33:40])
    r.native_prompts = False  # the torch path for prompts: the chunk's bits differ from the decode row's
    with torch.inference_mode():
        torch_whole = r.forward([(1, ids, 0)], logits=[len(ids)])
    assert not torch.equal(torch_whole[32], step[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_attention_against_a_float64_reference(dtype: torch.dtype) -> None:
    """native/attend.c alone, on random data: rope, the KV write at (slot, head, position) and
    grouped-query attention over positions 0..position (spans shorter than, equal to and past its
    16-position tiles) against the same arithmetic in float64; bf16 within its rounding."""
    import math

    assert kernel is not None
    heads, kv_heads, d, max_len, slots = 9, 3, 64, 640, 6
    g = torch.Generator().manual_seed(3)
    # spans 6 and 16 (within and at one 16-position tile), then 151, 256, 257 and 600 (tiles and a rest)
    pos = torch.tensor([5, 15, 150, 255, 256, 599], dtype=torch.long)
    slot = torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.long)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_len).float(), inv)
    cos = torch.cat([freqs, freqs], -1).cos().to(dtype).contiguous()
    sin_s = torch.cat([-freqs.sin(), freqs.sin()], -1).to(dtype).contiguous()
    kc = torch.randn(slots, kv_heads, max_len, d, generator=g).to(dtype)
    vc = torch.randn(slots, kv_heads, max_len, d, generator=g).to(dtype)
    qkv = torch.randn(len(pos), (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    out = torch.empty(len(pos), heads * d, dtype=dtype)
    k2, v2 = kc.clone(), vc.clone()
    scale = 1 / math.sqrt(d)
    assert kernel.attend(qkv.data_ptr(), len(pos), heads, kv_heads, d, cos.data_ptr(), sin_s.data_ptr(),
                         slot.data_ptr(), pos.data_ptr(), k2.data_ptr(), v2.data_ptr(), max_len, out.data_ptr(),
                         scale, dtype == torch.bfloat16, 2) == 0

    def rope(x: torch.Tensor, p: int) -> torch.Tensor:
        return x * cos[p].double() + torch.roll(x, d // 2, -1) * sin_s[p].double()

    for r, (p, s) in enumerate(zip(pos.tolist(), slot.tolist())):
        x = qkv[r].double()
        k = rope(x[heads * d : (heads + kv_heads) * d].view(kv_heads, d), p)
        v = x[(heads + kv_heads) * d :].view(kv_heads, d)
        keys, values = kc[s].double().clone(), vc[s].double().clone()
        keys[:, p], values[:, p] = k, v
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(k2[s, :, p].double(), k, atol=tol) and torch.equal(v2[s, :, p].double(), v)
        for h in range(heads):
            kv = h // (heads // kv_heads)
            w = torch.softmax(rope(x[h * d : (h + 1) * d], p) @ keys[kv, : p + 1].T * scale, -1)
            want = w @ values[kv, : p + 1]
            assert torch.allclose(out[r, h * d : (h + 1) * d].double(), want, atol=tol), (r, h)


def test_built_once_into_its_cache_and_absent_without_a_compiler(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The library is built into SWITCHBOARD_KERNEL_CACHE once and reused; a machine without a working C
    compiler gets None (torch's kernels serve) and a warning, never an exception."""
    import shutil

    monkeypatch.setenv("SWITCHBOARD_KERNEL_CACHE", str(tmp_path))
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    first = blockq._compile(cc)
    assert first.parent == tmp_path and first.exists()
    stamp = first.stat().st_mtime_ns
    assert blockq._compile(cc) == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert not [p for p in tmp_path.iterdir() if p != first]  # no temporary left behind
    monkeypatch.setattr(blockq, "_tried", False)
    monkeypatch.setattr(blockq, "_kernel", None)
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails
    monkeypatch.setenv("SWITCHBOARD_KERNEL_CACHE", str(tmp_path / "other"))
    assert blockq.load() is None
    plan = resolve_plan("auto", "auto", source="q4", caps=CpuCaps("AVX512", frozenset({"avx512_bf16"})))
    assert plan.kernel == "torch"  # CpuCaps.blockq is "" where it did not load


@pytest.mark.parametrize("fmt", ["q4", "q8", "q6"])
def test_two_planes_come_within_16_bits_of_the_dequantized_gemm(fmt: str) -> None:
    """The second int8 plane carries each block's rounding residual: ~256x closer than one plane (issue 23:
    one plane broke float32 dense's greedy near-ties on 9 of 12 prompts, two planes on none)."""
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(3))
    one, two = _layer(fmt), _layer(fmt, planes=2)
    ref = x @ one.dequantize().T
    err1, err2 = ((lin(x) - ref).abs().max() / ref.abs().max() for lin in (one, two))
    assert err2 <= 2e-4 and err2 * 50 < err1, (err1, err2)
    alone = torch.cat([two(x[i : i + 1]) for i in range(9)])
    assert torch.equal(two(x), alone)
