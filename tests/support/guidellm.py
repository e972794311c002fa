"""guidellm (a real load generator) run against a gateway from a test; the one benchmark it reports.

    bench = run_guidellm(tmp_path, backend=f"kind=openai_http,target={url},model={model},api_key={key}",
                         profile="kind=concurrent,streams=4", constraint="kind=max_requests,count=8",
                         data="kind=synthetic_text,prompt_tokens=32,output_tokens=16")
    bench["scheduler_metrics"]["requests_made"], bench["requests"]["successful"]

Skips the test when guidellm is not installed (it is in the test extra). guidellm runs offline with the
default model's tokenizer, in `tmp_path` (its cache there is removed afterwards).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def run_guidellm(tmp_path: Path, *, backend: str, profile: str, constraint: str, data: str,
                 timeout: float = 300) -> dict[str, Any]:
    """`guidellm run` with these options; asserts it exits 0 and returns its single benchmark."""
    exe = Path(sys.executable).with_name("guidellm")
    if not exe.exists():
        pytest.skip("guidellm is not installed (it is in the test extra)")
    from data_plane.model_store import resolve_model

    out = tmp_path / "report.json"
    cmd = [str(exe), "run", "--backend", backend, "--profile", profile, "--constraint", constraint,
           "--data", data, "--tokenizer", f"kind=hf_auto,model={resolve_model(None)}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    shutil.rmtree(tmp_path / ".cache", ignore_errors=True)
    return dict(bench)
