"""`switchboard bench quality`: what a dtype / weight format costs in output quality, against float32.

    switchboard bench quality                                   # auto, bf16, int8, int4 against fp32
    switchboard bench quality --formats bfloat16:int4,float32:none --prompts 8 --json /tmp/quality.json

For each format (``DTYPE:QUANTIZATION[:KERNEL]``, as the shard's --dtype / --quantization /
--quantization-kernel) the torch runner
(data_plane/shard/engines/llama_runner.py) is loaded as the shard would load it, then:
- perplexity of a fixed English text (below, ~280 tokens; each token scored from the ones before it),
- greedy agreement with float32 dense: the first `--tokens` (32) greedy tokens of each chat prompt,
  generated for all prompts together (one decode batch, as a shard serves them); ``agree_prompts`` is
  the share of prompts whose tokens are all identical, ``agree_tokens`` the mean share of tokens
  before the first difference; for each prompt that differs, the float32 reference's top-1 minus
  top-2 logit at the first differing token (``margin@diff``: a near-tie that any rounding may break,
  or a real difference);
- the weights' bytes a decode step reads (each weight once) and those resident (dense bf16 holds its
  tied table twice: the embedding and the oneDNN-packed head), each over dense bf16's.
The reference is always float32 with dense weights (`--quantization none`): for a GGUF model those
*are* the file's blocks dequantized (the converted checkpoint), so the reference and the int4 formats
hold the same weights and every difference is rounding. ``float32:int4`` (the exact mode) serves them
exactly: blockq's float path (native/blockq_exact.c) meets the Q4_1 / Q8_0 blocks as the GGUF holds
them with float32 activations (``float32:int4:torch``: torch's int4 kernel, exact too, but a reference
loop, ~0.6 s a token; data_plane/shard/engines/weight_source.py). Quantized rows are checked
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
DEFAULT_FORMATS = ("auto:auto,bfloat16:none,bfloat16:int8:torch,bfloat16:int4:torch,bfloat16:int4:blockq,"
                   "float32:int4:blockq,auto:auto:blockq_x2,float32:int4")


def _runner(path: Any, gguf: Any, source: str, spec: str, max_seqs: int, max_len: int) -> tuple[Any, Any]:
    import torch

    from data_plane.shard.engines.llama_runner import LlamaRunner
    from data_plane.shard.engines.weight_source import CpuCaps, resolve_plan

    dtype, _, rest = spec.partition(":")
    quant, _, kernel = rest.partition(":")
    plan = resolve_plan(dtype or "auto", quant or "auto", source=source, caps=CpuCaps.detect(), kernel=kernel or "auto")
    runner = LlamaRunner.from_pretrained(path, dtype=getattr(torch, plan.dtype), max_num_seqs=max_seqs,
                                         max_len=max_len, plan=plan, gguf=gguf)
    return runner, plan


def check_formats(formats: list[str], model: str | None) -> None:
    """Every format resolved as the shard would resolve it, before anything loads: a ValueError names the first
    that a shard would refuse (a typo found after the two reference runs cost minutes and printed a traceback)."""
    from data_plane.model_store import model_source
    from data_plane.shard.engines.weight_source import CpuCaps, resolve_plan

    caps, kind = CpuCaps.detect(), model_source(model).kind
    for spec in formats:
        dtype, _, rest = spec.partition(":")
        quant, _, kernel = rest.partition(":")
        try:
            resolve_plan(dtype or "auto", quant or "auto", source=kind, caps=caps, kernel=kernel or "auto")
        except ValueError as e:
            raise ValueError(f"{spec!r}: {e}") from None


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
    return greedy_margins(runner, prompts, tokens)[0]


def greedy_margins(runner: Any, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """`greedy`, plus each step's top-1 minus top-2 logit (how near a tie the pick was)."""

    def pick(row: Any, o: list[int], m: list[float]) -> None:
        top = row.float().topk(2).values
        o.append(int(row.argmax()))
        m.append(float(top[0] - top[1]))

    out: list[list[int]] = [[] for _ in prompts]
    margins: list[list[float]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        pick(runner.prefill(i, p, 0), out[i], margins[i])
    pos = [len(p) for p in prompts]
    for _ in range(tokens - 1):
        logits = runner.decode([o[-1] for o in out], pos)
        for i, o in enumerate(out):
            pick(logits[i], o, margins[i])
        pos = [p + 1 for p in pos]
    return out, margins


def divergence_margins(ref: list[list[int]], ref_margins: list[list[float]], got: list[list[int]]) -> list[float]:
    """For each prompt whose tokens differ from the reference: the reference's top-1 minus top-2 logit at
    the first differing step (small: a near-tie any rounding may flip; large: a real difference)."""
    out = []
    for r, m, g in zip(ref, ref_margins, got):
        n = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None)
        if n is not None:
            out.append(m[n])
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
    ref_margins: list[list[float]] = []
    bf16_bytes = bf16_resident = 0
    for spec in ["float32:none", "bfloat16:none", *[f for f in formats if f not in ("float32:none", "bfloat16:none")]]:
        t0 = time.monotonic()
        runner, plan = _runner(src.path, src.gguf, src.kind, spec, len(prompts), max_len)
        load_s = time.monotonic() - t0
        ppl = perplexity(runner, text_ids)
        out, margins = greedy_margins(runner, prompts, tokens)
        if spec == "float32:none":
            ref, ref_margins = out, margins
        if spec == "bfloat16:none":
            bf16_bytes, bf16_resident = runner.weight_bytes, runner.resident_weight_bytes
        same, prefix = agreement(ref, out)
        rows.append({"format": spec, "dtype": plan.dtype, "quantization": plan.quantization,
                     "weights": runner.weight_format, "weight_bytes": runner.weight_bytes,
                     "resident_bytes": runner.resident_weight_bytes,
                     "load_s": load_s, "perplexity": ppl, "agree_prompts": same, "agree_tokens": prefix,
                     "divergence_margins": divergence_margins(ref, ref_margins, out),
                     "median_margin": sorted(x for m in margins for x in m)[len(prompts) * tokens // 2]})
        print(f"[bench] {spec} -> {plan.describe()}: ppl {ppl:.3f}, agreement {same:.2f} / {prefix:.2f}, "
              f"float32 margins at the first differences {[round(m, 2) for m in rows[-1]['divergence_margins']]}",
              flush=True)
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
                   help=f"comma-separated DTYPE:QUANTIZATION[:KERNEL] (default {DEFAULT_FORMATS}; float32:none and "
                        "bfloat16:none always run)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"chat prompts (default {len(PROMPTS)})")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens compared per prompt (default 32)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default 0 = the cores this process may use)")
    p.add_argument("--model", default=None, help="HF model folder or GGUF (default SmolLM2-135M-Instruct)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.tokens < 1:
        p.error("--prompts and --tokens take 1 or more")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    try:
        check_formats(formats, args.model)
    except ValueError as e:
        p.error(f"--formats {e}")
    info = machine_info()
    rows = measure(formats, args.prompts, args.tokens, args.model, args.threads)
    print(f"machine: {info.get('cpu_model')} | flags {' '.join(info.get('cpu_flags') or []) or '-'}")
    print(format_table(
        ["format", "served as", "weights", "MiB read/step", "x bf16", "MiB resident", "x bf16", "perplexity",
         "vs fp32", "agree prompts", "agree tokens", "margin@diff max"],
        [[r["format"], f"{r['dtype']}/{r['quantization']}", r["weights"], fmt(r["weight_bytes"] / 2**20),
          fmt(r["bytes_vs_bf16"], 3), fmt(r["resident_bytes"] / 2**20), fmt(r["resident_vs_bf16"], 3),
          fmt(r["perplexity"], 3), f"{100 * r['perplexity_vs_fp32']:+.2f} %",
          f"{100 * r['agree_prompts']:.0f} %", f"{100 * r['agree_tokens']:.0f} %",
          fmt(max(r["divergence_margins"], default=None), 2)] for r in rows]))
    print("margin@diff max: the largest float32 top-1 minus top-2 logit at a prompt's first differing token "
          f"(median margin over all steps: {fmt(rows[0]['median_margin'], 2)})")
    if args.json:
        write_json(args.json, {"machine": info, "tokens": args.tokens, "rows": rows})
