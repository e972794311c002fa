"""`switchboard bench coldstart`: where a shard's start-up goes, from a fresh interpreter to ready.

    switchboard bench coldstart                                  # default dtype/quantization, 3 runs
    switchboard bench coldstart --dtype float32 --quantization none --runs 5 --json /tmp/cold.json

Each run starts a new Python process (nothing imported, page cache warm as on a restart) that does
what `switchboard shard` does before it is ready: imports torch and the shard app, then
`TorchEngine.start()` (plan and config, tokenizer, weights incl. int4 packing and the KV cache,
prefix cache, warm-up pass; `TorchEngine.load_phases`). Printed: each phase's median over the runs,
the total (median, min, max), the CPU seconds beside the wall seconds (a loaded host stretches
wall time; CPU time much less), the CPU model and the load average. The target (issue 23) is a total of at most 4 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from data_plane.bench.common import fmt, format_table, machine_info, write_json

ROOT = Path(__file__).resolve().parents[2]
TARGET_S = 4.0


def child(dtype: str, quantization: str, spawned_at: float) -> dict[str, Any]:
    """One cold start in this (fresh) process; each phase's wall and CPU seconds."""
    t_entry = time.time()
    wall: dict[str, float] = {"python_start": t_entry - spawned_at}
    cpu: dict[str, float] = {"python_start": time.process_time()}
    t, c = time.monotonic(), time.process_time()
    import torch  # noqa: F401 - timed on purpose

    wall["import_torch"], cpu["import_torch"] = time.monotonic() - t, time.process_time() - c
    t, c = time.monotonic(), time.process_time()
    import data_plane.shard.app  # noqa: F401 - what the shard process imports before it loads
    from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine

    wall["import_shard"], cpu["import_shard"] = time.monotonic() - t, time.process_time() - c
    engine = TorchEngine(EngineConfig(dtype=dtype, quantization=quantization))

    async def start() -> None:
        await engine.start()

    t, c = time.monotonic(), time.process_time()
    asyncio.run(start())
    load, load_cpu = time.monotonic() - t, time.process_time() - c
    wall.update({f"load.{k}": v for k, v in engine.load_phases.seconds.items()})
    cpu.update({f"load.{k}": v for k, v in engine.load_phases.cpu_seconds.items()})
    wall["load.other"] = max(0.0, load - sum(engine.load_phases.seconds.values()))
    cpu["load.other"] = max(0.0, load_cpu - sum(engine.load_phases.cpu_seconds.values()))
    return {"phases": wall, "cpu_phases": cpu, "total_s": time.time() - spawned_at,
            "total_cpu_s": time.process_time(), "served_as": engine.weight_plan.describe(),
            "weights": engine._runner.weight_format}


def run_once(dtype: str, quantization: str) -> dict[str, Any]:
    spawned = time.time()
    code = ("import json,sys; from data_plane.bench.coldstart import child; "
            f"print('COLDSTART ' + json.dumps(child({dtype!r}, {quantization!r}, {spawned!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
                         check=False)
    for line in out.stdout.splitlines():
        if line.startswith("COLDSTART "):
            return dict(json.loads(line.removeprefix("COLDSTART ")))
    raise RuntimeError(f"the cold-start child failed (rc {out.returncode}): {out.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="switchboard bench coldstart",
                                description="A shard's start-up, phase by phase, from a fresh interpreter to ready.")
    p.add_argument("--dtype", default="auto", help="as the shard's --dtype (default auto)")
    p.add_argument("--quantization", default="auto", help="as the shard's --quantization (default auto)")
    p.add_argument("--runs", type=int, default=3, help="fresh processes (default 3)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    info = machine_info()
    runs = []
    for i in range(args.runs):
        runs.append(run_once(args.dtype, args.quantization))
        print(f"run {i + 1}: {runs[-1]['total_s']:.2f} s", flush=True)
    names = list(dict.fromkeys(k for r in runs for k in r["phases"]))
    rows = [[n, fmt(statistics.median(r["phases"].get(n, 0.0) for r in runs), 3),
             fmt(statistics.median(r["cpu_phases"].get(n, 0.0) for r in runs), 3)] for n in names]
    totals = [r["total_s"] for r in runs]
    rows.append(["TOTAL (median)", fmt(statistics.median(totals), 3),
                 fmt(statistics.median(r["total_cpu_s"] for r in runs), 3)])
    print(f"machine: {info.get('cpu_model')} | usable cores {info.get('usable_cores')} | "
          f"load average {' '.join(f'{x:.1f}' for x in info.get('loadavg') or [])}")
    print(f"served as: {runs[0]['served_as']}, weights {runs[0]['weights']}")
    print(format_table(["phase", "wall s", "CPU s"], rows))
    verdict = "meets" if statistics.median(totals) <= TARGET_S else "misses"
    print(f"cold start {statistics.median(totals):.2f} s median (min {min(totals):.2f}, max {max(totals):.2f}) "
          f"over {len(runs)} runs: {verdict} the {TARGET_S:g} s target"
          f"{' (the host is loaded: figures measured under load)' if (info.get('loadavg') or [0])[0] > 1 else ''}")
    if args.json:
        write_json(args.json, {"machine": info, "dtype": args.dtype, "quantization": args.quantization,
                               "runs": runs, "median_total_s": statistics.median(totals)})


if __name__ == "__main__":
    main()
