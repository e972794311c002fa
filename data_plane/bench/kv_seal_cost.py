"""What sealing KV frames costs, on the shard's own path: frames made and fetched bodies verified
(data_plane/shard/kv_tier.py ``_frames`` / ``_verify``), sealed vs plaintext, per MB.

    .venv/bin/python -m data_plane.bench.kv_seal_cost                 # SmolLM2-135M blocks, bf16 and fp32
    .venv/bin/python -m data_plane.bench.kv_seal_cost --blocks 76 --repeats 7

No model, no processes: random K/V of the real block shape, the keys derived from a token. Prints
one line per dtype (best of ``--repeats``). Figures: docs/kv-cache.md, "Sealed at rest".
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch
from prometheus_client import CollectorRegistry

from data_plane.shard.kv_metrics import KVTierMetrics
from data_plane.shard.kv_seal import KVSealer, kv_keyring
from data_plane.shard.kv_tier import KVTier

SHAPE = (2, 30, 3, 16, 64)
"""One SmolLM2-135M block: (K and V, layers, KV heads, tokens, head size)."""


def _tier(dtype: str, tdt: torch.dtype, sealed: bool) -> KVTier:
    metrics = KVTierMetrics(CollectorRegistry(), "bench")
    sealer = KVSealer(kv_keyring(keys_file=None, keys_env=None, cluster_token="bench"), metrics) if sealed else None
    tier = KVTier(None, metrics, sealer=sealer)  # type: ignore[arg-type]  # no remote: nothing is sent
    tier.prefix = SimpleNamespace(model_id="bench", dtype=dtype, layout="bench", block_shape=SHAPE,  # type: ignore[assignment]
                                  torch_dtype=tdt, block_size=SHAPE[3])
    return tier


def measure(blocks: int, repeats: int, dtype: str, tdt: torch.dtype) -> dict[str, float]:
    kv = torch.randn(blocks, *SHAPE).to(tdt)
    hashes = [i.to_bytes(16, "little") for i in range(blocks)]
    scopes = ["tenant:bench"] * blocks
    out: dict[str, float] = {"mb": kv.numel() * kv.element_size() / 1e6}
    for name in ("plain", "sealed"):
        tier = _tier(dtype, tdt, name == "sealed")
        make = check = float("inf")
        for _ in range(repeats):
            a = time.perf_counter()
            body = b"".join(tier._frames(hashes, kv, scopes))
            b = time.perf_counter()
            got, n, reason = tier._verify(body, hashes, scopes)
            c = time.perf_counter()
            assert n == blocks and reason is None and got is not None and torch.equal(got, kv)
            make, check = min(make, b - a), min(check, c - b)
        out[f"{name}_frames_s"], out[f"{name}_verify_s"] = make, check
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data_plane.bench.kv_seal_cost", description=__doc__)
    parser.add_argument("--blocks", type=int, default=76, help="blocks per run (76 = ~1.2k tokens)")
    parser.add_argument("--repeats", type=int, default=7, help="runs per figure (the best is printed)")
    args = parser.parse_args(argv)
    for dtype, tdt in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        r = measure(args.blocks, args.repeats, dtype, tdt)
        mb = r["mb"]
        print(f"{dtype}: {args.blocks} blocks, {mb:.1f} MB | frames plain {r['plain_frames_s'] * 1e3:.1f} ms, "
              f"sealed {r['sealed_frames_s'] * 1e3:.1f} ms (+{(r['sealed_frames_s'] - r['plain_frames_s']) / mb * 1e3:.3f} "
              f"ms/MB, {mb / r['sealed_frames_s'] / 1e3:.2f} GB/s) | verify plain {r['plain_verify_s'] * 1e3:.1f} ms, "
              f"sealed {r['sealed_verify_s'] * 1e3:.1f} ms (+{(r['sealed_verify_s'] - r['plain_verify_s']) / mb * 1e3:.3f} "
              f"ms/MB, {mb / r['sealed_verify_s'] / 1e3:.2f} GB/s)")


if __name__ == "__main__":
    main()
