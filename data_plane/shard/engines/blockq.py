"""Block-quantized linear layers on a small C kernel: int4/int8 weights x int8 activations (llama.cpp's way).

    lib = blockq.load()                                  # None where it cannot be built or fails its self-check
    lin = BlockLinear.q4(q, d, m, dtype=torch.bfloat16)  # GGUF Q4_1 blocks as they are: w = q * d + m
    lin = BlockLinear.q8(q, d, dtype=torch.float32)      # GGUF Q8_0 blocks as they are: w = q * d
    lin = BlockLinear.from_dense(w, "q4", dtype=...)     # quantized at load, per 32 (Q4_1's / Q8_0's rule)
    y = lin(x); x = lin.add(h, x)                        # as packed_linear.Linear (the residual add fused)
    emb = lin.embedding(); rows = emb[ids]               # a tied table's lookups over the same bytes

Why: torch's weight-only CPU kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`,
quant_linear.py) convert every weight to float and multiply in float, once per row of the batch:
at one row they are compute-bound, not memory-bound, and their cost grows linearly with rows (a
576 -> 1536 projection: 23 us at 1 row, 160 at 16, 318 at 32 on an Intel Xeon with avx512_bf16,
docs/BENCHMARKS.md), which makes a speculative verify pass or a 16-stream step cost nearly as many
decode steps. This kernel (native/blockq.c) quantizes the activations to int8 per block of 32, as
llama.cpp does, and takes integer dot products: VNNI's `dpbusd` multiplies 64 weight-activation pairs
an instruction (AVX2: `maddubs` + `madd`), and each weight block is unpacked once per tile of 16
output columns and reused for every row of the batch.

Built at first use with the system C compiler (~0.7 s) into ~/.cache/switchboard/kernels
(SWITCHBOARD_KERNEL_CACHE), keyed by the sources, the compiler and its flags (SWITCHBOARD_BLOCKQ=0: never
built, torch's kernels serve); the path (AVX512-VNNI, AVX2 or portable C) is chosen at run time from the CPU
(`blockq_best_isa`), overridable with SWITCHBOARD_BLOCKQ_ISA=avx512_vnni|avx2|portable.
OpenMP threads come from the runtime torch already loaded (libgomp.so.1), `torch.get_num_threads()`
of them per call. Every path computes the same integers and the same float operations in the same
order, so output is bit-identical across paths, thread counts and batch compositions: a row's
logits do not depend on the other rows (the batch invariance fp32 dense has; tests hold both).
Numerics: the activations' int8 rounding (relative ~0.4 % per block) is what llama.cpp serves with; it
breaks float32 dense's greedy near-ties on most prompts. With ``planes=2`` (``--quantization-kernel blockq_x2``)
each block's residual goes into a second int8 plane (~16 bits in all, twice the integer dot products over the
same unpacked weights): float32's greedy tokens (`switchboard bench quality` measures both against float32).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from data_plane.shard.engines.quant_linear import int4_parts

log = logging.getLogger(__name__)

NATIVE = Path(__file__).with_name("native")
SOURCES = (NATIVE / "blockq.c", NATIVE / "blockq_exact.c", NATIVE / "attend.c")
"""The GEMM kernels (int8 activations; float32 activations, the exact mode) and the fused decode/verify
attention (attention.Native): one library."""
HEADERS = (NATIVE / "activations.h", NATIVE / "blockq_layout.h")
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-std=c11")
NT, QK = 16, 32
"""Output columns per tile, weights per block along K (native/blockq.c's layout)."""
FORMATS = {"q4": 0, "q8": 1, "q6": 2}
"""q4: GGUF Q4_1 blocks (w = q d + m); q8: Q8_0 blocks (w = q d); q6: 6-bit q in -31..31 with an fp16 d per 16
(llama.cpp's Q6_K has a scale per 16 too): the LM head / embedding table of int4 models."""
ISAS = {"portable": 0, "avx2": 1, "avx512_vnni": 2}
_ISA_NAMES = {v: k for k, v in ISAS.items()}


class KernelCheckFailed(RuntimeError):
    """The CPU path disagreed with the portable one, or the output with the dequantized GEMM."""


class Kernel:
    """The loaded library and the path it runs on this CPU."""

    def __init__(self, lib: ctypes.CDLL, isa: int) -> None:
        self.lib, self.isa = lib, isa
        i, p = ctypes.c_int, ctypes.c_void_p
        self.gemm, self.gemm_exact = lib.blockq_gemm, lib.blockq_gemm_exact
        for fn in (self.gemm, self.gemm_exact):
            fn.restype = ctypes.c_int
            fn.argtypes = [i, i, p, i, i, p, i, i, p, p, i, i, p, ctypes.c_float]
        self.gemm.argtypes = [*self.gemm.argtypes, i]  # planes: 1 or 2 int8 planes of activations
        self.rows = lib.blockq_rows
        self.rows.restype = ctypes.c_int
        self.rows.argtypes = [i, p, i, i, p, i, p, i]
        self.attend = lib.sb_attend
        self.attend.restype = ctypes.c_int
        self.attend.argtypes = [p, i, i, i, i, p, p, p, p, p, p, i, p, ctypes.c_float, i, i]

    @property
    def isa_name(self) -> str:
        return _ISA_NAMES[self.isa]


_kernel: Kernel | None = None
_tried = False


def cache_dir() -> Path:
    """SWITCHBOARD_KERNEL_CACHE, else ~/.cache/switchboard/kernels (beside the models' cache)."""
    return Path(os.environ.get("SWITCHBOARD_KERNEL_CACHE") or Path.home() / ".cache" / "switchboard" / "kernels")


def _compile(cc: str) -> Path:
    """The shared library for these sources, compiler and flags: built once (atomically: several
    processes may start at once), then reused. The compiler is keyed by its resolved path, size and
    mtime (an upgrade changes them): no `cc --version` process at every shard start."""
    exe = Path(shutil.which(cc) or cc).resolve()
    st = exe.stat()
    compiler = f"{exe}:{st.st_size}:{st.st_mtime_ns}".encode()
    source = b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS))
    key = hashlib.sha256(source + compiler + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = cache_dir() / f"blockq-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load() -> Kernel | None:
    """The kernel, built and self-checked once per process; None (logged) where there is no C
    compiler, the build fails or the CPU path disagrees with the portable one."""
    global _kernel, _tried
    if _tried:
        return _kernel
    _tried = True
    if os.environ.get("SWITCHBOARD_BLOCKQ", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("blockq: no C compiler: the torch weight-only kernels serve quantized weights")
        return None
    try:
        lib = ctypes.CDLL(str(_compile(cc)))
        best = int(lib.blockq_best_isa())
        wanted = os.environ.get("SWITCHBOARD_BLOCKQ_ISA")
        isa = min(best, ISAS[wanted]) if wanted in ISAS else best
        kernel = Kernel(lib, isa)
        _self_check(kernel)
    except (OSError, subprocess.SubprocessError, KernelCheckFailed) as exc:
        log.warning("blockq: unavailable (%s): the torch weight-only kernels serve quantized weights", exc)
        return None
    _kernel = kernel
    return kernel


def _self_check(kernel: Kernel) -> None:
    """The CPU path gives the portable path's bits and the dequantized GEMM's values (small shapes), for
    int8 activations (one plane, two planes) and float32 ones (the exact mode: float32 rounding only)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g)
    x = torch.randn(3, 64, generator=g)
    for fmt in FORMATS:
        for exact, planes, tol in ((False, 1, 0.05), (False, 2, 1e-3), (True, 1, 1e-5)):
            lin = BlockLinear.from_dense(w, fmt, dtype=torch.float32, kernel=kernel, exact=exact, planes=planes)
            y = lin(x)
            ref = x @ lin.dequantize().T
            what = f"{fmt}{' exact' if exact else f' {planes} plane(s)'}"
            if (y - ref).abs().max() > tol * ref.abs().max():
                raise KernelCheckFailed(f"{what}: off the dequantized GEMM")
            lin.isa = ISAS["portable"]
            if not torch.equal(y, lin(x)):
                raise KernelCheckFailed(f"{what}: {kernel.isa_name} differs from the portable path")


def _check(n: int, k: int) -> None:
    if n % NT or k % QK:
        raise ValueError(f"block layers need N % {NT} == 0 and K % {QK} == 0 (got {n} x {k})")


def _fp16_bytes(t: torch.Tensor) -> torch.Tensor:
    """[T, nb, 16] float -> [T, nb, 32] uint8 (fp16 little-endian)."""
    return t.to(torch.float16).contiguous().view(torch.uint8)


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15, d and m [N, K/32] (w = q * d + m) -> the kernel's tiles, uint8."""
    n, k = q.shape
    _check(n, k)
    t, nb = n // NT, k // QK
    g = q.to(torch.uint8).reshape(t, NT, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [T, nb, quad, col, 4]
    nib = (g[:, :, :4] | (g[:, :, 4:] << 4)).reshape(t, nb, 256)
    dd = _fp16_bytes(d.reshape(t, NT, nb).permute(0, 2, 1))
    mm = _fp16_bytes(m.reshape(t, NT, nb).permute(0, 2, 1))
    return torch.cat([nib, dd, mm], dim=-1).reshape(-1).contiguous()


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q [N, K] in -128..127, d [N, K/32] (w = q * d) -> the kernel's tiles, uint8 (q stored + 128)."""
    n, k = q.shape
    _check(n, k)
    t, nb = n // NT, k // QK
    u = (q.to(torch.int16) + 128).to(torch.uint8).reshape(t, NT, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, nb, 512)
    return torch.cat([u, _fp16_bytes(d.reshape(t, NT, nb).permute(0, 2, 1))], dim=-1).reshape(-1).contiguous()


def pack_q6(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q [N, K] in -31..31, d [N, K/16] (w = q * d) -> the kernel's tiles, uint8: Q4's nibble layout for
    the low 4 bits of q + 32, two 64-byte chunks of 2-bit highs (quad g: bits 2 (g % 4) of chunk g / 4),
    then the scales of each block's elements 0..15 and of 16..31."""
    n, k = q.shape
    _check(n, k)
    t, nb = n // NT, k // QK
    u = (q.to(torch.int16) + 32).to(torch.uint8).reshape(t, NT, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [T, nb, g, col, 4]
    lo, hi = u & 0xF, u >> 4
    nib = (lo[:, :, :4] | (lo[:, :, 4:] << 4)).reshape(t, nb, 256)
    h = hi.reshape(t, nb, 2, 4, NT, 4)  # [.., chunk, g % 4, col, 4]
    highs = (h[:, :, :, 0] | (h[:, :, :, 1] << 2) | (h[:, :, :, 2] << 4) | (h[:, :, :, 3] << 6)).reshape(t, nb, 128)
    halves = d.reshape(t, NT, nb, 2).permute(0, 2, 3, 1)  # [T, nb, half, col]
    dd = _fp16_bytes(halves[:, :, 0]), _fp16_bytes(halves[:, :, 1])
    return torch.cat([nib, highs, *dd], dim=-1).reshape(-1).contiguous()


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, ...]:
    """GGUF's rules per block of 32 along K: Q4_1 (min..max in 16 levels: q, d, m), Q8_0 (q, d), and
    the symmetric 6-bit q6 (q in -31..31, d = max|w| / 31 per 16); Q8_0's and q6's scales rounded to fp16
    first, as a GGUF stores them (Q4_1's are rounded when packed, as torch's int4 format rounds its own)."""
    n, k = w.shape
    if fmt == "q4":  # torch's int4 format's own Q4_1 rule (zero = m + 8 d there); the kernel stores d, m in fp16
        q, scale, zero = int4_parts(w, QK)
        return q, scale, zero - 8 * scale
    g = w.float().reshape(n, k // QK, QK)
    top = 127 if fmt == "q8" else 31
    if fmt == "q6":
        g = g.reshape(n, k // 16, 16)
    d = (g.abs().amax(-1) / top).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (g * inv.unsqueeze(-1)).round().clamp(-top, top).reshape(n, k).to(torch.int8), d


class BlockLinear:
    """y = x @ W.T (+ b) with W in the kernel's blocks; x float32 or bf16, [T, K] (or [..., K]). `exact`:
    float32 activations meet the weights in float32 (native/blockq_exact.c) instead of int8 blocks. `planes`:
    the int8 activations' planes, 1 (llama.cpp's Q8 activations, ~8 bits a block) or 2 (the block's
    residual in a second int8 plane, ~16 bits: float32 dense's greedy tokens survive its near-ties, for twice
    the integer dot products over the same weight bytes; native/blockq.c)."""

    packed = False

    def __init__(self, fmt: str, tiles: torch.Tensor, n: int, k: int, *, dtype: torch.dtype,
                 bias: torch.Tensor | None = None, kernel: Kernel | None = None, exact: bool = False,
                 planes: int = 1) -> None:
        _check(n, k)
        if planes not in (1, 2):
            raise ValueError(f"blockq takes 1 or 2 int8 planes of activations, not {planes}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"blockq takes float32 or bfloat16 activations, not {dtype}")
        kern = kernel or load()
        if kern is None:
            raise RuntimeError("the blockq kernel is not available on this machine")
        self.kernel, self.isa = kern, kern.isa
        self.fmt, self.code = fmt, FORMATS[fmt]
        self.w = tiles
        self.out_features, self.in_features, self.numel = n, k, n * k
        self.dtype = dtype
        self.bias = bias
        self.nbytes = tiles.numel()
        self.exact = exact
        self.planes = 1 if exact else planes
        self._gemm = kern.gemm_exact if exact else kern.gemm
        self._planes = () if exact else (self.planes,)  # blockq_gemm's last argument (the float path has none)

    @classmethod
    def q4(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, **kw) -> BlockLinear:  # type: ignore[no-untyped-def]
        n, k = q.shape
        return cls("q4", pack_q4(q, d, m), n, k, **kw)

    @classmethod
    def q8(cls, q: torch.Tensor, d: torch.Tensor, **kw) -> BlockLinear:  # type: ignore[no-untyped-def]
        n, k = q.shape
        return cls("q8", pack_q8(q, d), n, k, **kw)

    @classmethod
    def q6(cls, q: torch.Tensor, d: torch.Tensor, **kw) -> BlockLinear:  # type: ignore[no-untyped-def]
        n, k = q.shape
        return cls("q6", pack_q6(q, d), n, k, **kw)

    @classmethod
    def from_dense(cls, w: torch.Tensor, fmt: str, **kw) -> BlockLinear:  # type: ignore[no-untyped-def]
        return getattr(cls, fmt)(*quantize(w, fmt), **kw)

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor | None = None,
             eps: float = 0.0, out: torch.dtype | None = None) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"blockq takes float32 or bfloat16 activations, not {rows.dtype}")
        if not rows.is_contiguous():
            rows = rows.contiguous()
        m = rows.shape[0]
        y = torch.empty(m, self.out_features, dtype=out or rows.dtype)
        res = None
        if residual is not None:
            res = residual.reshape(m, self.out_features).to(y.dtype).contiguous()
        bf16 = rows.dtype == torch.bfloat16
        if m and self._gemm(self.code, self.isa, self.w.data_ptr(), self.out_features, self.in_features,
                                  rows.data_ptr(), bf16, m, None if res is None else res.data_ptr(),
                                  y.data_ptr(), y.dtype == torch.bfloat16, torch.get_num_threads(),
                                  None if norm is None else norm.data_ptr(), eps, *self._planes):
            raise RuntimeError("blockq_gemm failed")
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._run(x, None)
        return y if self.bias is None else y + self.bias

    def normed(self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.dtype | None = None) -> torch.Tensor:
        """(x * w / sqrt(mean(x^2) + eps)) @ W.T (+ b): the RMSNorm before a projection, in the kernel
        (float32, never rounded to the activation dtype). `w` in x's dtype, contiguous. `out`: the output's
        dtype (default x's; float32 keeps the kernel's sums as they are: the head's logits)."""
        y = self._run(x, None, w, eps, out)
        return y if self.bias is None else y + self.bias

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T (+ b): the add in the kernel's float32, rounded once."""
        if self.bias is not None:
            return residual + self(x)
        return self._run(x, residual)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the kernel's blocks hold (tests; never on a serving path)."""
        return BlockEmbedding(self, torch.float32)[torch.arange(self.out_features)]

    def embedding(self) -> BlockEmbedding:
        """Row lookups over these very bytes (a tied LM head and embedding are stored once)."""
        return BlockEmbedding(self, self.dtype)


class BlockEmbedding:
    """`emb[ids]` -> [len(ids), K] rows of the table, dequantized to the serving dtype."""

    def __init__(self, table: BlockLinear, dtype: torch.dtype) -> None:
        self.table, self.dtype = table, dtype
        self.nbytes = table.nbytes

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        flat = ids.reshape(-1).to(torch.long).contiguous()
        out = torch.empty(flat.numel(), t.in_features, dtype=self.dtype)
        if flat.numel() and t.kernel.rows(t.code, t.w.data_ptr(), t.out_features, t.in_features, flat.data_ptr(),
                                          flat.numel(), out.data_ptr(), self.dtype == torch.bfloat16):
            raise IndexError("token id out of the table's range")
        return out.view(*ids.shape, t.in_features)
