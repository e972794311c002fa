"""KV-block test helpers: a shard's KV tier without an engine, sealing or not.

    tier = kv_tier(sealer_keys=ring("k1"))          # KVTier whose prefix is a stub of SHAPE blocks
    frames = tier._frames(hashes, kv, ["tenant:a"] * len(hashes))
    kv, used, reason = tier._verify(b"".join(frames), hashes, ["tenant:a"] * len(hashes))

Used by tests/data_plane/test_kv_blocks.py and tests/reliability/test_at_rest.py.
"""

from __future__ import annotations

import base64
import os
from types import SimpleNamespace

import torch
from prometheus_client import CollectorRegistry

from data_plane.common.crypto import Keyring
from data_plane.shard.kv_metrics import KVTierMetrics
from data_plane.shard.kv_seal import KVSealer
from data_plane.shard.kv_tier import KVTier

SHAPE = (2, 2, 1, 4, 8)
LAYOUT = "llama.L2.kvh1.d8.bs4"


def ring(*kids: str, keys: dict[str, bytes] | None = None) -> Keyring:
    """A keyring of fresh random keys (or the given ones), the first sealing."""
    keys = keys or {}
    return Keyring.parse([(k, base64.b64encode(keys.get(k) or os.urandom(32)).decode()) for k in kids], "test")


def kv_tier(sealer_keys: Keyring | None = None, registry: CollectorRegistry | None = None) -> KVTier:
    """A KVTier with no remote and a stub prefix cache of SHAPE float32 blocks (4 tokens each)."""
    metrics = KVTierMetrics(registry or CollectorRegistry(), "m")
    sealer = KVSealer(sealer_keys, metrics) if sealer_keys is not None else None
    tier = KVTier(None, metrics, sealer=sealer)  # type: ignore[arg-type]  # no remote needed
    tier.prefix = SimpleNamespace(model_id="model-x", dtype="float32", layout=LAYOUT, block_shape=SHAPE,  # type: ignore[assignment]
                                  torch_dtype=torch.float32, block_size=SHAPE[3])
    return tier
