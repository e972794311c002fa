"""`switchboard bench quality`: what a dtype / weight format costs in output quality, against float32.

    switchboard bench quality                                   # auto, bf16, int8, int4 against fp32
    switchboard bench quality --formats bfloat16:int4,float32:none --prompts 8 --json /tmp/quality.json

For each format (``DTYPE:QUANTIZATION``, as the shard's --dtype / --quantization) the torch runner
(data_plane/shard/engines/llama_runner.py) is loaded as the shard would load it, then:
- perplexity of a fixed English text (below, ~280 tokens; each token scored from the ones before it),
- greedy agreement with float32 dense: the first `--tokens` (32) greedy tokens of each chat prompt,
  generated for all prompts together (one decode batch, as a shard serves them); ``agree_prompts`` is
  the share of prompts whose tokens are all identical, ``agree_tokens`` the mean share of tokens
  before the first difference;
- the weights' bytes a decode step reads (each weight once) and those resident (dense bf16 holds its
  tied table twice: the embedding and the oneDNN-packed head), each over dense bf16's.
The reference is always float32 with dense weights (`--quantization none`). Quantized rows are checked
in tests too: tests/data_plane/test_quant_engine.py.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from data_plane.bench.common import fmt, format_table, machine_info, write_json

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way. The river runs slowly past the old mill, and in the evening the children come "
    "down to the bank to watch the boats. A computer program is a sequence of instructions that a machine "
    "follows to carry out a task; programs are written in languages such as Python, C and Rust, and are "
    "translated into machine code before they run. Water boils at one hundred degrees Celsius at sea level, "
    "and freezes at zero. The capital of France is Paris, the capital of Italy is Rome, and the capital of "
    "Japan is Tokyo. To make bread, mix flour, water, salt and yeast, knead the dough for ten minutes, let "
    "it rise for an hour, shape it, and bake it in a hot oven until the crust is golden brown."
)
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three fruits that are red.",
    "How do I reverse a list in Python?",
    "What is 12 times 7?",
    "Give me a tip for sleeping better.",
    "Translate 'good morning' into Spanish.",
    "What does HTTP stand for?",
    "Name the planets of the solar system.",
    "Why is the sky blue?",
    "Write one sentence about autumn.",
]
DEFAULT_FORMATS = "auto:auto,bfloat16:none,bfloat16:int8,bfloat16:int4"


def _runner(path: Any, gguf: Any, source: str, spec: str, max_seqs: int, max_len: int) -> tuple[Any, Any]:
    import torch

    from data_plane.shard.engines.llama_runner import LlamaRunner
    from data_plane.shard.engines.weight_source import CpuCaps, resolve_plan

    dtype, _, quant = spec.partition(":")
    plan = resolve_plan(dtype or "auto", quant or "auto", source=source, caps=CpuCaps.detect())
    runner = LlamaRunner.from_pretrained(path, dtype=getattr(torch, plan.dtype), max_num_seqs=max_seqs,
                                         max_len=max_len, plan=plan, gguf=gguf)
    return runner, plan


def perplexity(runner: Any, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:], each token scored by a decode step after the ones before it (slot 0)."""
    import torch

    nll = 0.0
    logits = runner.prefill(0, ids[:1], 0)
    for pos in range(1, len(ids)):
        nll -= float(torch.log_softmax(logits.float(), -1)[ids[pos]])
        if pos < len(ids) - 1:
            logits = runner.decode([ids[pos]], [pos])[0]
    return math.exp(nll / (len(ids) - 1))


def greedy(runner: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """`tokens` greedy tokens for every prompt, decoded together (prompt i in slot i)."""
    out = [[int(runner.prefill(i, p, 0).argmax())] for i, p in enumerate(prompts)]
    pos = [len(p) for p in prompts]
    for _ in range(tokens - 1):
        logits = runner.decode([o[-1] for o in out], pos)
        for i, o in enumerate(out):
            o.append(int(logits[i].argmax()))
        pos = [p + 1 for p in pos]
    return out


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(share of prompts identical throughout, mean share of tokens before the first difference)."""
    same, prefix = 0, 0.0
    for r, g in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
        same += n == len(r)
        prefix += n / len(r)
    return same / len(ref), prefix / len(ref)


def measure(formats: list[str], n_prompts: int, tokens: int, model: str | None, threads: int) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoTokenizer

    from data_plane.common.cores import usable_cores
    from data_plane.model_store import model_source

    torch.set_num_threads(threads or usable_cores())
    src = model_source(model)
    tok = AutoTokenizer.from_pretrained(str(src.path))
    text_ids = tok.encode(TEXT)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False))
               for p in (PROMPTS * (n_prompts // len(PROMPTS) + 1))[:n_prompts]]
    max_len = max(len(text_ids), max(len(p) for p in prompts) + tokens) + 8
    rows: list[dict[str, Any]] = []
    ref: list[list[int]] = []
    bf16_bytes = bf16_resident = 0
    for spec in ["float32:none", "bfloat16:none", *[f for f in formats if f not in ("float32:none", "bfloat16:none")]]:
        t0 = time.monotonic()
        runner, plan = _runner(src.path, src.gguf, src.kind, spec, len(prompts), max_len)
        load_s = time.monotonic() - t0
        ppl = perplexity(runner, text_ids)
        out = greedy(runner, prompts, tokens)
        if spec == "float32:none":
            ref = out
        if spec == "bfloat16:none":
            bf16_bytes, bf16_resident = runner.weight_bytes, runner.resident_weight_bytes
        same, prefix = agreement(ref, out)
        rows.append({"format": spec, "dtype": plan.dtype, "quantization": plan.quantization,
                     "weights": runner.weight_format, "weight_bytes": runner.weight_bytes,
                     "resident_bytes": runner.resident_weight_bytes,
                     "load_s": load_s, "perplexity": ppl, "agree_prompts": same, "agree_tokens": prefix})
        print(f"[bench] {spec} -> {plan.describe()}: ppl {ppl:.3f}, agreement {same:.2f} / {prefix:.2f}", flush=True)
        del runner
    base = rows[0]["perplexity"]
    for r in rows:
        r["perplexity_vs_fp32"] = r["perplexity"] / base - 1
        r["bytes_vs_bf16"] = r["weight_bytes"] / bf16_bytes if bf16_bytes else None
        r["resident_vs_bf16"] = r["resident_bytes"] / bf16_resident if bf16_resident else None
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="switchboard bench quality",
                                description="Perplexity and greedy agreement against float32, per dtype/weight format.")
    p.add_argument("--formats", default=DEFAULT_FORMATS,
                   help=f"comma-separated DTYPE:QUANTIZATION (default {DEFAULT_FORMATS}; float32:none and "
                        "bfloat16:none always run)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"chat prompts (default {len(PROMPTS)})")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens compared per prompt (default 32)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default 0 = the cores this process may use)")
    p.add_argument("--model", default=None, help="HF model folder or GGUF (default SmolLM2-135M-Instruct)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    info = machine_info()
    rows = measure([f.strip() for f in args.formats.split(",") if f.strip()], args.prompts, args.tokens,
                   args.model, args.threads)
    print(f"machine: {info.get('cpu_model')} | flags {' '.join(info.get('cpu_flags') or []) or '-'}")
    print(format_table(
        ["format", "served as", "weights", "MiB read/step", "x bf16", "MiB resident", "x bf16", "perplexity",
         "vs fp32", "agree prompts", "agree tokens"],
        [[r["format"], f"{r['dtype']}/{r['quantization']}", r["weights"], fmt(r["weight_bytes"] / 2**20),
          fmt(r["bytes_vs_bf16"], 3), fmt(r["resident_bytes"] / 2**20), fmt(r["resident_vs_bf16"], 3),
          fmt(r["perplexity"], 3), f"{100 * r['perplexity_vs_fp32']:+.2f} %",
          f"{100 * r['agree_prompts']:.0f} %", f"{100 * r['agree_tokens']:.0f} %"] for r in rows]))
    if args.json:
        write_json(args.json, {"machine": info, "tokens": args.tokens, "rows": rows})
