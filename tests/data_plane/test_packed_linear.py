"""packed_linear.Linear: the oneDNN-prepacked bf16 path gives x @ W.T exactly; fp32 is never packed."""

from __future__ import annotations

import pytest
import torch

from data_plane.shard.engines.packed_linear import Linear, should_pack

needs_pack = pytest.mark.skipif(not should_pack(torch.bfloat16), reason="no oneDNN bf16 on this CPU")


def test_float32_stays_plain() -> None:
    assert not should_pack(torch.float32)
    w, b = torch.randn(12, 8), torch.randn(12)
    x = torch.randn(3, 8)
    lin = Linear(w, b, pack=False)
    assert torch.equal(lin(x), x @ w.T + b)
    assert torch.equal(lin.add(x, torch.ones(3, 12)), torch.ones(3, 12) + (x @ w.T + b))


@needs_pack
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_packed_bf16_equals_plain_matmul(rows: int) -> None:
    torch.manual_seed(rows)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    lin = Linear(w, pack=True)
    assert lin.packed and (lin.out_features, lin.in_features, lin.numel) == (96, 64, 96 * 64)
    assert torch.equal(lin(x), x @ w.T)
    residual = torch.randn(rows, 96, dtype=torch.bfloat16)
    fused = lin.add(x, residual).float()
    exact = residual.float() + x.float() @ w.float().T
    assert (fused - exact).abs().max() <= 2 ** -6 * exact.abs().max()  # one bf16 rounding
    biased = Linear(w, torch.randn(96, dtype=torch.bfloat16), pack=True)
    assert biased(x).shape == (rows, 96)
