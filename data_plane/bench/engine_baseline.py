"""`switchboard bench engine --baseline-tree DIR`: the engine of another checkout, measured in the same run.

    git worktree add /tmp/sb-base <pre-change commit>
    switchboard bench engine --systems switchboard,naive --speculation on,off --baseline-tree /tmp/sb-base
    # rows switchboard@base / switchboard-spec@base; ratios switchboard/switchboard@base, ...

Called by data_plane/bench/engine.py's main for each `<system>@base` name: that tree's own
`data_plane.bench.engine.measure_system` runs in a child Python (cwd and PYTHONPATH = the tree, so
its engine, runner and bench code are imported, not this checkout's), with this run's config and
prompt ids on stdin; its result dict comes back on stdout. So "today's engine" is measured between
the other systems, under the same load, with the same prompts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from data_plane.bench.engine_systems import BenchConfig, Skip

SUFFIX = "@base"
_MARK = "@@baseline-result@@"
_CHILD = f"""
import dataclasses, json, sys
from data_plane.bench import engine
cfg_cls = getattr(engine, "BenchConfig", None)
if cfg_cls is None:
    from data_plane.bench.engine_systems import BenchConfig as cfg_cls
a = json.load(sys.stdin)
names = {{f.name for f in dataclasses.fields(cfg_cls)}}
cfg = cfg_cls(**{{k: (tuple(v) if k == "concurrency" else v) for k, v in a["config"].items() if k in names}})
out = engine.measure_system(a["name"], cfg, a["prompts"])
print({_MARK!r} + json.dumps(out), flush=True)
"""


def run_baseline(tree: str, name: str, config: BenchConfig, prompt_ids: list[list[int]]) -> dict[str, Any]:
    """Measure `name` (e.g. "switchboard@base") with the code at `tree`; rows are renamed to `name`."""
    root = Path(tree).expanduser().resolve()
    if not (root / "data_plane" / "bench" / "engine.py").is_file():
        raise Skip(f"--baseline-tree {tree} is not a switchboard checkout")
    system = name.removesuffix(SUFFIX)
    env = {**os.environ, "PYTHONPATH": str(root)}
    payload = json.dumps({"name": system, "config": asdict(config), "prompts": prompt_ids})
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=payload, text=True, cwd=root, env=env,
                          stdout=subprocess.PIPE, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    for line in proc.stdout.splitlines():
        if not line.startswith(_MARK):
            print(line.replace(f"[bench] {system} ", f"[bench] {name} ", 1), flush=True)
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the baseline at {root} exited {proc.returncode}")
    out: dict[str, Any] = json.loads(lines[-1][len(_MARK):])
    for row in out["rows"]:
        row["system"] = name
        row["tree"] = str(root)
    return out
