"""`switchboard bench engine`: our engine against the naive server and llama.cpp, in one run.

    switchboard bench engine                                   # c = 1,4,16; 128 tokens; bf16
    switchboard bench engine --concurrency 1,16 --systems switchboard,naive --json /tmp/e.json
    switchboard bench engine --dtype float32 --num-prompts 8 --max-tokens 64
    switchboard bench engine --systems switchboard --baseline-tree /tmp/sb-base   # + an older checkout's engine
    switchboard bench engine --workload quote --speculation on,off --rounds 4       # orders A B, B A, A B, B A; pooled

Every system gets the same chat-templated prompts (token ids from the model's tokenizer),
greedy decoding, and a closed loop: `concurrency` workers each take the next prompt as soon
as their previous one finishes, until `num-prompts` are done (default 2 x concurrency).

- switchboard: `TorchEngine` in-process, one asyncio task per worker consuming `generate`.
- naive: HF `model.generate` one request at a time (what a minimal server does); requests
  queue behind each other, so at concurrency N the TTFT includes that queueing.
- llamacpp: llama-cpp-python's low-level batch API on the GGUF, one seq_id per stream so it
  batches; only when `llama_cpp` imports (`pip install llama-cpp-python`, ~8 min build).
- llamacpp-lookup: llama.cpp with its prompt-lookup draft (`LlamaPromptLookupDecoding`), one request
  at a time (its high-level API holds one sequence).

Every system runs with the same number of compute threads (`--threads`, 0 = all cores).

The systems live in data_plane/bench/engine_systems.py (switchboard, naive) and
engine_llamacpp.py; this module, run by `switchboard bench` (data_plane/bench/__init__.py), measures
each in its own process and parses the command line; engine_report.py pools the rounds and prints
the tables.

The naive and llama.cpp paths ignore EOS so every request yields exactly max-tokens; our
engine has no such flag, so throughput is computed from the tokens actually generated and
the table shows the mean per request. Each system runs in its own spawned process, so the
peak RSS printed is that system's alone (Python + torch + weights + KV cache).

Also printed: batch-1 decode speed against the memory-bandwidth ceiling (a decode step must
read every weight once, so tok/s <= copy bandwidth / weight bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from typing import Any

from data_plane.bench.common import (
    RequestResult,
    cycle,
    machine_info,
    parse_int_list,
    peak_rss_mb,
    summarize,
    write_json,
)
from data_plane.bench.engine_baseline import SUFFIX as BASE
from data_plane.bench.engine_baseline import run_baseline
from data_plane.bench.engine_llamacpp import LlamaCppLookupSystem, LlamaCppSystem
from data_plane.bench.engine_pipeline import parse_pipeline, pipeline_names, pipeline_targets, print_targets
from data_plane.bench.engine_report import (
    bandwidth_report,
    cpu_summary,
    pool_rounds,
    print_report,
    print_weights,
    ratios,
)
from data_plane.bench.engine_systems import (
    BenchConfig,
    NaiveSystem,
    Skip,
    SpeculativeSystem,
    SwitchboardSystem,
    System,
)
from data_plane.common.cores import usable_cores

SYSTEMS: dict[str, type] = {"switchboard": SwitchboardSystem, "switchboard-spec": SpeculativeSystem,
                            "naive": NaiveSystem, "llamacpp": LlamaCppSystem, "llamacpp-lookup": LlamaCppLookupSystem}


# -- measuring -----------------------------------------------------------------------------


def make_row(system: System, name: str, concurrency: int, results: list[RequestResult], duration_s: float,
             max_tokens: int) -> dict[str, Any]:
    """One table/JSON row from a concurrency level's results."""
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    ttft = summarize([r.ttft_s * 1000 for r in ok])
    tpot = summarize([t * 1000 for r in ok if (t := r.tpot_s) is not None])
    return {
        "system": name,
        "concurrency": concurrency,
        "output_tok_s": tokens / duration_s if duration_s > 0 else math.nan,
        "ttft_mean_ms": ttft["mean"],
        "ttft_p50_ms": ttft["p50"],
        "ttft_p99_ms": ttft["p99"],
        "tpot_mean_ms": tpot["mean"],
        "tpot_p50_ms": tpot["p50"],
        "tpot_p99_ms": tpot["p99"],
        "dtype": system.dtype,
        "max_tokens": max_tokens,
        "requests": len(ok),
        "failed": len(results) - len(ok),
        "output_tokens": tokens,
        "mean_output_tokens": tokens / len(ok) if ok else 0.0,
        "duration_s": duration_s,
    }


def parse_microbatches(text: str) -> list[int]:
    """'1,0' -> [1, 0]: micro-batch counts in 0..64 (0: as many as stages)."""
    values = [int(part) for part in text.split(",")]
    if not all(0 <= v <= 64 for v in values):
        raise ValueError(f"micro-batches must be in 0..64: {text}")
    return list(dict.fromkeys(values))


def make_system(name: str, config: BenchConfig) -> System:
    """`switchboard@pp2`: the switchboard system as a 2-stage pipeline (--pipeline-parallel-size);
    `switchboard@pp2mb1bq1`: one micro-batch a pass, no batch queue (engine_pipeline.py)."""
    base, _, pp = name.partition("@pp")
    v = parse_pipeline(pp)
    system: System = SYSTEMS[base](replace(config, pipeline_parallel_size=v.stages,
                                           pipeline_microbatches=v.microbatches, pipeline_batch_queue=v.batch_queue))
    return system


async def _measure(name: str, config: BenchConfig, prompt_ids: list[list[int]]) -> dict[str, Any]:
    system = make_system(name, config)
    await system.start()
    rows = []
    try:
        for c in config.concurrency:
            prompts = cycle(prompt_ids, config.requests_at(c))
            t0 = time.perf_counter()
            results = await system.run(prompts, c, config.max_tokens)
            row = make_row(system, name, c, results, time.perf_counter() - t0, config.max_tokens)
            report = getattr(system, "spec_report", None)
            if report is not None:
                row.update(report())
            row["workload"] = config.workload
            threads = f" ({row['intra_op_threads']} threads, {row['thread_switches']} switches)" if report else ""
            if row.get("pipeline_idle_share") is not None:
                threads += (f", stage idle share {row['pipeline_idle_share']}, "
                            f"{row['pipeline_max_in_flight']} passes, {row.get('pipeline_max_steps_in_flight')} "
                            "steps in flight at most")
            print(f"[bench] {name:<11} c={c:<3} {row['requests']} requests, {row['output_tokens']} tokens "
                  f"in {row['duration_s']:.1f} s: {row['output_tok_s']:.1f} tok/s{threads}", flush=True)
            rows.append(row)
        stage_rss = getattr(system, "stage_rss_mb", None)
        if stage_rss is not None:  # memory per pipeline stage (one stage: the whole engine)
            rss_mb, weights_mb = stage_rss(), system.stage_weights_mb()  # type: ignore[attr-defined]
            for row in rows:
                row["stage_rss_mb"], row["stage_weights_mb"] = rss_mb, weights_mb
                row["stage_overhead_mb"] = [round(r - w, 1) for r, w in zip(rss_mb, weights_mb)]
            print(f"[bench] {name}: resident memory per stage {rss_mb} MiB, of which weights {weights_mb} MiB "
                  f"(the rest: KV touched, the process's fixed overhead; stage 0 is this bench process)", flush=True)
    finally:
        await system.aclose()
    rss = peak_rss_mb()
    for row in rows:
        row["peak_rss_mb"] = rss
    for row in rows:  # what the system resolved its dtype/format to (auto), known once it started
        row["dtype"] = system.dtype
    return {"rows": rows, "weight_bytes": system.weight_bytes,
            "dense_bf16_bytes": getattr(system, "dense_bf16_bytes", 0),
            "resident_weight_bytes": getattr(system, "resident_weight_bytes", system.weight_bytes)}


def measure_system(name: str, config: BenchConfig, prompt_ids: list[list[int]]) -> dict[str, Any]:
    """Run every concurrency level for one system (called in a fresh spawned process)."""
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    return asyncio.run(_measure(name, config, prompt_ids))


def run_isolated(name: str, config: BenchConfig, prompt_ids: list[list[int]]) -> dict[str, Any]:
    """`measure_system` in its own process, so memory and threads are that system's alone."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure_system, name, config, prompt_ids).result()


def encode_prompts(model: str | None, workload: str = "chat") -> list[list[int]]:
    """The workload's prompts (PROMPTS for chat) as chat-templated token ids, from the model's own tokenizer."""
    from transformers import AutoTokenizer

    from data_plane.bench.engine_spec import workload_prompts
    from data_plane.model_store import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    out: list[list[int]] = []
    for text in workload_prompts(workload):
        ids: Any = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def copy_bandwidth_gb_s(mib: int = 256, repeats: int = 5, threads: int = 0) -> float:
    """Best memory-copy bandwidth over `repeats` copies of a `mib` MiB tensor (bytes read + written)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best / 1e9


# -- rounds ------------------------------------------------------------------------------------


def round_orders(systems: list[str], rounds: int) -> list[list[str]]:
    """Each round's order: as listed, then reversed, alternately (A B, B A, A B, ...). A system
    measured first on a just-quiet host reads a few percent differently from the next one (seen on
    spec on vs off, which run the same steps above 4 streams); alternating cancels that in the pool."""
    return [list(systems) if r % 2 == 0 else systems[::-1] for r in range(rounds)]


# -- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="switchboard bench engine",
        description="Engine throughput and latency: switchboard vs the naive HF server vs llama.cpp.",
    )
    p.add_argument("--concurrency", type=parse_int_list, default=[1, 4, 16],
                   help="comma-separated closed-loop worker counts (default 1,4,16)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default 128)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per concurrency level (default 2 x concurrency)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="torch dtype for switchboard and naive (default auto: the shard's per-CPU choice)")
    p.add_argument("--quantization", choices=["auto", "none", "int8", "int4"], default="auto",
                   help="switchboard's weight format (default auto: the GGUF's Q4 blocks as int4); naive stays dense")
    p.add_argument("--quantization-kernel", choices=["auto", "blockq", "blockq_x2", "blockq_exact", "torch"], default="auto",
                   help="what computes switchboard's quantized projections (default auto: blockq where it builds)")
    p.add_argument("--systems", default="switchboard,naive,llamacpp,llamacpp-lookup",
                   help=f"comma-separated, from {', '.join(SYSTEMS)} (default all)")
    p.add_argument("--workload", choices=["chat", "quote", "json", "tools"], default="chat",
                   help="chat: open-ended prompts; quote: summarise/rewrite/edit a given passage or code; json / tools: "
                        "constrained decoding vs the prompt alone over a schema corpus, our engine only "
                        "(data_plane/bench/engine_structured.py) (default chat)")
    p.add_argument("--skip-prompt-only", action="store_true",
                   help="json / tools: skip the prompt-only validity pass (speed only)")
    p.add_argument("--speculation", default="off",
                   help="comma-separated on,off: switchboard without (off) and with (on) n-gram speculation "
                        "(default off)")
    p.add_argument("--spec-max-batch", type=int, default=4,
                   help="speculation on: no drafting above this many running sequences (default 4)")
    p.add_argument("--num-speculative-tokens", type=int, default=15,
                   help="speculation on: most draft tokens per sequence and step, 1..16 (default 15)")
    p.add_argument("--pipeline-parallel-size", type=parse_int_list, default=[1],
                   help="switchboard as 1, 2, ... pipeline stages sharing --threads (e.g. 1,2)")
    p.add_argument("--pipeline-microbatches", type=parse_microbatches, default=[0],
                   help="micro-batches a pass that goes alone for N > 1 (0: as many as stages; 1,0: both)")
    p.add_argument("--pipeline-batch-queue", type=parse_microbatches, default=[0],
                   help="plans in flight across steps for N > 1 (0: as many as stages; 1: off; 1,0: both)")
    p.add_argument("--model", default=None, help="HF model folder or GGUF (default SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=0, help="compute threads (default 0 = all cores)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every system this many times, the order reversed each round (A B, B A, ...); "
                        "the table pools the rounds (default 1)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--baseline-tree", default=None, metavar="DIR",
                   help="also measure the switchboard system(s) with the code of this checkout (a git worktree "
                        "of an older commit), rows <system>@base: data_plane/bench/engine_baseline.py")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    modes = [m.strip() for m in args.speculation.split(",") if m.strip()]
    if not modes or set(modes) - {"on", "off"}:
        p.error("--speculation takes on, off or on,off")
    if "switchboard" in args.systems:
        i = args.systems.index("switchboard")
        args.systems[i : i + 1] = [{"off": "switchboard", "on": "switchboard-spec"}[m] for m in modes]
    if "switchboard" in args.systems and args.pipeline_parallel_size != [1]:
        i = args.systems.index("switchboard")
        # N > 1 once per (--pipeline-microbatches, --pipeline-batch-queue) value
        args.systems[i : i + 1] = pipeline_names(args.pipeline_parallel_size, args.pipeline_microbatches,
                                                 args.pipeline_batch_queue)
    unknown = [s for s in args.systems if s.partition("@pp")[0] not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.baseline_tree:
        # Each right after its counterpart, so both see the same load.
        args.systems = [x for s in args.systems for x in ([s, s + BASE] if s.startswith("switchboard") else [s])]
    if args.max_tokens < 1 or args.rounds < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        p.error("--max-tokens, --rounds and --num-prompts must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # One thread count for every system (the torch engine's own 0 means "all cores but one").
    args.threads = args.threads or usable_cores()
    if args.workload in ("json", "tools"):
        from data_plane.bench.engine_structured import main as structured

        structured(args)
        return
    prompt_ids = encode_prompts(args.model, args.workload)
    config = BenchConfig(
        model=args.model, dtype=args.dtype, max_tokens=args.max_tokens, concurrency=tuple(args.concurrency),
        num_prompts=args.num_prompts, max_prompt_len=max(map(len, prompt_ids)), threads=args.threads,
        workload=args.workload, spec_max_batch=args.spec_max_batch,
        num_speculative_tokens=args.num_speculative_tokens, quantization=args.quantization,
        quantization_kernel=args.quantization_kernel,
    )
    print(f"[bench] CPU: {cpu_summary()}", flush=True)
    gb_s = copy_bandwidth_gb_s(threads=args.threads)
    rounds_rows: list[dict[str, Any]] = []
    weights: dict[str, int] = {}
    dense: dict[str, int] = {}
    resident: dict[str, int] = {}
    skipped: dict[str, str] = {}
    for round_no, order in enumerate(round_orders(args.systems, args.rounds)):
        if args.rounds > 1:
            print(f"[bench] round {round_no + 1}/{args.rounds}: {', '.join(order)}", flush=True)
        for name in order:
            if name in skipped:  # skipped or failed in an earlier round
                continue
            try:
                if name.startswith("llamacpp"):
                    SYSTEMS[name](config)  # fails fast, in this process, when llama_cpp is missing
                if name.endswith(BASE):
                    out = run_baseline(args.baseline_tree, name, config, prompt_ids)
                else:
                    out = run_isolated(name, config, prompt_ids)
            except Skip as exc:
                print(f"[bench] {name}: skipped: {exc}", flush=True)
                skipped[name] = str(exc)
                continue
            except Exception as exc:  # noqa: BLE001 -- one broken system must not lose the others' numbers
                print(f"[bench] {name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
                skipped[name] = f"failed: {type(exc).__name__}: {exc}"
                continue
            for row in out["rows"]:
                row["round"] = round_no
            rounds_rows += out["rows"]
            weights[name] = out["weight_bytes"]
            dense[name] = out.get("dense_bf16_bytes") or 0
            resident[name] = out.get("resident_weight_bytes") or out["weight_bytes"]
    rows = pool_rounds(rounds_rows)
    ratio = ratios(rows)
    bw = bandwidth_report(rows, weights, gb_s)
    print_report(rows, ratio, bw)
    print_weights(rows, weights, dense, resident)
    targets = pipeline_targets(rows)
    print_targets(targets)
    if args.json:
        write_json(args.json, {"rows": rows, "round_rows": rounds_rows, "ratios": ratio, "bandwidth": bw,
                               "pipeline_targets": targets, "skipped": skipped,
                               "config": asdict(config), "machine": machine_info()})
