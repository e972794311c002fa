"""`switchboard bench verify`: what a speculative verify pass costs against a plain decode step.

    switchboard bench verify                                  # batch 1 and 4, 1..17 rows a slot, bf16
    switchboard bench verify --batch 1 --rows 1,9,16,17 --threads 1 --json /tmp/verify.json

For each batch size b, the torch runner (data_plane/shard/engines/llama_runner.py) first prefills b
slots with a `--context`-token prompt, then times, alternately and `--repeats` times each:
- `decode`: one token for each of the b slots;
- `verify` (`LlamaRunner.verify`, data_plane/shard/engines/llama_runner.py): every slot's last token plus r - 1 draft
  tokens, for each r of `--rows`.
It reports the median of each, the ratio verify / decode, and the price of one draft row as a share
of one token's decode time: (verify - decode) / (b (r - 1)) / (decode / b). That share is what
`SeqSpec.draft_len` weighs each draft position against. The engine learns the same price from its
own steps (`VerifyCost`); this benchmark is where its prior (0.02) and the 15-token cap
(`--num-speculative-tokens`) come from: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from data_plane.bench.common import fmt, format_table, machine_info, parse_int_list, write_json


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):  # warm-up: lazy kernel setup, caches
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def measure(batches: list[int], rows: list[int], context: int, repeats: int, dtype: str, threads: int,
            model: str | None) -> list[dict[str, Any]]:
    import torch

    from data_plane.common.cores import usable_cores
    from data_plane.model_store import resolve_model
    from data_plane.shard.engines.llama_runner import LlamaRunner
    from data_plane.shard.engines.torch_config import DTYPES

    torch.set_num_threads(threads or usable_cores())
    runner = LlamaRunner.from_pretrained(resolve_model(model), dtype=DTYPES[dtype], max_num_seqs=max(batches),
                                         max_len=context + max(rows) + 8)
    out = []
    for b in batches:
        for slot in range(b):
            runner.prefill(slot, [10 + (i * 7 + slot) % 1000 for i in range(context)], 0)
        starts = [context] * b
        decode_ms = _median_ms(partial(runner.decode, [5] * b, starts), repeats)
        for r in rows:
            verify_ms = _median_ms(partial(runner.verify, [[5] + [7] * (r - 1) for _ in range(b)], starts), repeats)
            extra = b * (r - 1)
            out.append({
                "batch": b, "rows_per_slot": r, "decode_ms": decode_ms, "verify_ms": verify_ms,
                "ratio": verify_ms / decode_ms,
                "row_cost": (verify_ms - decode_ms) / extra / (decode_ms / b) if extra else None,
            })
            print(f"[bench] batch {b} rows {r}: verify {verify_ms:.1f} ms, decode {decode_ms:.1f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="switchboard bench verify",
                                description="A speculative verify pass against a plain decode step, per rows and batch.")
    p.add_argument("--batch", type=parse_int_list, default=[1, 4], help="comma-separated batch sizes (default 1,4)")
    p.add_argument("--rows", type=parse_int_list, default=[1, 2, 5, 9, 13, 16, 17],
                   help="comma-separated rows a slot (1 = last token, no draft; default 1,2,5,9,13,16,17)")
    p.add_argument("--context", type=int, default=200, help="tokens already in each slot's KV (default 200)")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per figure (default 30)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default 0 = the cores this process may use)")
    p.add_argument("--model", default=None, help="HF model folder or GGUF (default SmolLM2-135M-Instruct)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    if min(args.batch) < 1 or min(args.rows) < 1 or args.context < 1 or args.repeats < 1:
        p.error("--batch, --rows, --context and --repeats must be positive")
    rows = measure(args.batch, args.rows, args.context, args.repeats, args.dtype, args.threads, args.model)
    print()
    print(format_table(["batch", "rows/slot", "decode ms", "verify ms", "verify/decode", "row cost"],
                       [[str(r["batch"]), str(r["rows_per_slot"]), fmt(r["decode_ms"], 1), fmt(r["verify_ms"], 1),
                         fmt(r["ratio"], 2) + "x", fmt(r["row_cost"], 3)] for r in rows]))
    print("\nrow cost: one draft row's price as a share of one token's decode time (what SeqSpec.draft_len weighs)")
    if args.json:
        write_json(args.json, {"rows": rows, "config": vars(args), "machine": machine_info()})
