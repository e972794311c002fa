"""What each process imports before it serves: no torch (or other model library) where no model runs.

    .venv/bin/python -m pytest tests/test_startup_imports.py -q        # ~5 s

A synthetic shard, a gateway, a cache node and a control plane start hundreds of times in the suite
(and on every restart in production); torch alone costs 2-3 s of import on a 2-core machine, up to
~10 s under load (issue 23: a synthetic shard's start went from ~11 s to ~3.5 s under load once its
metrics and KV tier stopped importing torch at module level). Each entry module is imported in a
fresh interpreter, as `switchboard <command>` imports it, and must leave the heavy packages unloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.procs import ROOT

HEAVY = ("torch", "transformers", "tokenizers", "safetensors", "llguidance", "gguf")
"""Model libraries: imported by what loads or runs a model, never by a process that only serves HTTP."""

ENTRY_MODULES = {
    "shard": "data_plane.shard.app",  # the synthetic engine; the torch engine imports torch when it loads
    "gateway": "data_plane.gateway.app",
    "cache-node": "data_plane.cache.node",
    "control-plane": "control_plane.app",
    "up": "control_plane.launcher",
}


@pytest.mark.parametrize("command", sorted(ENTRY_MODULES))
def test_entry_module_imports_no_model_library(command: str) -> None:
    module = ENTRY_MODULES[command]
    probe = (f"import json, sys; import control_plane.cli, {module}; "
             f"print(json.dumps(sorted(m for m in {list(HEAVY)!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], (f"`switchboard {command}` ({module}) imports {loaded} at start-up: make that import "
                          f"lazy (run `python -X importtime -c 'import {module}'` to see the chain)")


def test_the_gateways_counter_for_the_default_model_loads_no_model_library_but_tokenizers() -> None:
    """A gateway in front of real shards counts tokens with the model's tokenizer.json (data_plane/gateway/
    context.py): the `tokenizers` library, not transformers (whose import, and torch's with it, cost seconds)."""
    probe = ("import json, sys; from data_plane.gateway.context import TokenCounter; "
             "n = TokenCounter.for_model(None).count('hello world'); "
             f"print(json.dumps([n, sorted(m for m in {list(HEAVY)!r} if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    count, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert count == 2 and loaded == ["tokenizers"], loaded
