"""Usage records for the ledger's tests (store, API, console).

    store.insert([usage_record(1, tenant="acme", prompt_tokens=10), usage_record(2)])
"""

from __future__ import annotations

import time
from typing import Any

from data_plane.ledger.writer import UsageRecord


def usage_record(i: int, **over: Any) -> UsageRecord:
    """Record `req-i` (plus tier, acme, 10/2/5 tokens, 200, now) with the fields in `over` replaced."""
    now = time.time()
    base: dict[str, Any] = {
        "request_id": f"req-{i}", "trace_id": "0" * 32, "key_id": "k1", "tenant": "acme", "tier": "plus", "model": "m",
        "prompt_tokens": 10, "cached_tokens": 2, "completion_tokens": 5, "status": 200, "error_code": "", "ttft_s": 0.01,
        "latency_s": 0.05, "shard": "shard-0", "degradation_level": 0, "session": False, "gateway": "gw", "started_at": now,
        "finished_at": now}
    base.update(over)
    return UsageRecord(**base)
