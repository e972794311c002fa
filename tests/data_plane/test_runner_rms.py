"""The runner's RMSNorm is the reference's formula bit for bit, in every serving dtype (a decode step
calls it 61 times: data_plane/shard/engines/llama_runner.py `_rms` takes the cheaper form)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from data_plane.shard.engines.llama_runner import LlamaRunner


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 16, 257])
def test_rms_is_the_reference_formula_exactly(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 4).to(dtype)
    w = (torch.rand(576, generator=g) * 2).to(dtype)
    eps = 1e-5
    xf = x.float()
    reference = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)  # transformers' LlamaRMSNorm
    got = LlamaRunner._rms(SimpleNamespace(eps=eps, dtype=dtype), x, w)  # type: ignore[arg-type]
    assert got.dtype == dtype
    assert torch.equal(got, reference)
    assert torch.equal(got, w * F.rms_norm(xf, (576,), None, eps).to(dtype))  # the form it replaced
