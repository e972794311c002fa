"""`switchboard bench engine --workload json|tools`: constrained decoding against the same prompts unconstrained.

    switchboard bench engine --workload json --concurrency 1,16 --max-tokens 96
    switchboard bench engine --workload tools --concurrency 1 --max-tokens 64 --num-prompts 8 --json out.json

Three things over the schema corpus (data_plane/bench/schema_corpus.py, 52 real-world schemas):

1. Grammar compile time, p50 / p99 / max, every schema compiled fresh (no cache), as the shard compiles it
   (`json`: the response_format schema; `tools`: the tool envelope with the schema as a named tool's
   parameters, data_plane/structured.py), and how many the grammar engine refuses.
2. Tokens/s at each concurrency, the same prompts constrained (the grammar's mask in every step) and
   unconstrained (the prompt alone asks for the JSON), each request `--max-tokens` at most; the ratio is
   constrained / unconstrained.
3. The share of outputs valid against their schema (jsonschema): constrained vs prompt-only (for `tools`:
   the arguments of the named tool's call, parsed from the envelope).

In-process torch engine (one event loop, the engine's scheduler thread), like `bench engine` itself.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from typing import Any

from data_plane.bench.schema_corpus import CORPUS


def _request(workload: str, name: str, schema: dict[str, Any], constrained: bool) -> Any:
    from data_plane.protocol import ChatCompletionRequest

    ask = (f"Write one realistic example of a {name.replace('_', ' ')} as JSON matching this schema: "
           f"{json.dumps(schema)}. Answer with the JSON only.")
    body: dict[str, Any] = {"messages": [{"role": "user", "content": ask}]}
    if workload == "json" and constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    if workload == "tools":
        body["tools"] = [{"type": "function", "function": {"name": name, "parameters": schema}}]
        body["tool_choice"] = {"type": "function", "function": {"name": name}} if constrained else "auto"
    return ChatCompletionRequest.model_validate(body)


def _payload(workload: str, text: str) -> Any:
    """The JSON value an output carries (None when it carries none)."""
    if workload == "tools":
        from data_plane.tool_calls import EnvelopeParser, assemble

        message = assemble(EnvelopeParser().feed(text))
        calls = message.get("tool_calls") or []
        text = calls[0]["function"]["arguments"] if calls else ""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _valid(value: Any, schema: dict[str, Any]) -> bool:
    import jsonschema  # type: ignore[import-untyped]  # a test-extra dependency (via schemathesis)

    if value is None:
        return False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def compile_times(engine: Any, workload: str) -> dict[str, Any]:
    """Every corpus schema compiled fresh, in this thread, as the shard would (seconds)."""
    from data_plane.shard.engines.grammar import GrammarError, GrammarKind, GrammarSpec

    times, refused = [], []
    for name, schema in CORPUS:
        plan = _request(workload, name, schema, True).output_plan()
        assert plan.constraint is not None
        spec = GrammarSpec(GrammarKind(plan.constraint.kind), plan.constraint.text)
        t0 = time.perf_counter()
        try:
            engine.grammars._build(spec)
        except GrammarError as exc:
            refused.append(f"{name}: {exc.message}")
            continue
        times.append(time.perf_counter() - t0)
    times.sort()
    q = lambda p: times[min(len(times) - 1, int(p * len(times)))] * 1000 if times else float("nan")
    return {"schemas": len(CORPUS), "compiled": len(times), "refused": refused, "p50_ms": q(0.5), "p99_ms": q(0.99),
            "max_ms": max(times) * 1000 if times else float("nan")}


async def _one(engine: Any, workload: str, index: int, constrained: bool,
               max_tokens: int) -> tuple[int, bool, float]:
    from data_plane.shard.app import _generation_requests

    name, schema = CORPUS[index % len(CORPUS)]
    req = _request(workload, name, schema, constrained)
    plan = req.output_plan()
    if not constrained:  # the prompt alone: no grammar (tools: the envelope is described, not forced)
        plan = type(plan)(None, plan.tool_mode, plan.tools_prompt, plan.json_response)
    (gen,) = _generation_requests(req.model_copy(update={"max_tokens": max_tokens, "temperature": 0.0}), engine,
                                  uuid.uuid4().hex, (), plan)
    await engine.prepare(gen)
    text, tokens, decode_s = [], 0, 0.0
    async for out in engine.generate(gen):
        text.append(out.text)
        tokens = out.completion_tokens
        if out.timings is not None:
            decode_s = out.timings.decode_s
    return tokens, _valid(_payload(workload, "".join(text)), schema), decode_s


async def run_level(engine: Any, workload: str, concurrency: int, prompts: int, constrained: bool,
                    max_tokens: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> tuple[int, bool, float]:
        async with sem:
            return await _one(engine, workload, i, constrained, max_tokens)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(bounded(i) for i in range(prompts)))
    wall = time.perf_counter() - t0
    tokens = sum(t for t, _, _ in results)
    decode_tokens = sum(t - 1 for t, _, _ in results if t > 1)
    # Decode speed per stream: tokens after the first over the time after it (prefill and the schema-laden
    # prompt excluded, so outputs of different lengths compare).
    per_stream = decode_tokens / max(sum(d for t, _, d in results if t > 1), 1e-9)
    return {"mode": "constrained" if constrained else "prompt-only", "concurrency": concurrency,
            "requests": prompts, "tokens": tokens, "tok_s": tokens / wall, "decode_tok_s": per_stream * concurrency,
            "valid_pct": 100.0 * sum(v for _, v, _ in results) / prompts,
            "mean_tokens": statistics.mean(t for t, _, _ in results)}


def run(args: Any) -> dict[str, Any]:
    from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine

    loop = asyncio.new_event_loop()
    engine = TorchEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max(args.concurrency),
                                      max_model_len=2048, threads=args.threads, prefix_caching=False))
    loop.run_until_complete(engine.start())
    try:
        compiled = compile_times(engine, args.workload)
        rows = []
        for c in args.concurrency:
            prompts = args.num_prompts or max(2 * c, 4)
            for round_no in range(args.rounds):  # order alternates, as bench engine's rounds do
                for constrained in ((True, False) if round_no % 2 == 0 else (False, True)):
                    rows.append(loop.run_until_complete(run_level(engine, args.workload, c, prompts, constrained,
                                                                  args.max_tokens)))
    finally:
        loop.run_until_complete(engine.aclose())
        loop.close()
    return {"workload": args.workload, "compile": compiled, "rows": rows}


def report(result: dict[str, Any]) -> None:
    c = result["compile"]
    print(f"\n[bench] {result['workload']}: grammar compile over {c['schemas']} schemas: {c['compiled']} compiled, "
          f"{len(c['refused'])} refused; p50 {c['p50_ms']:.2f} ms, p99 {c['p99_ms']:.2f} ms, max {c['max_ms']:.2f} ms")
    for line in c["refused"]:
        print(f"  refused: {line}")
    print(f"{'mode':<13}{'conc':>5}{'reqs':>6}{'tokens':>8}{'tok/s':>9}{'decode tok/s':>14}{'mean tok':>10}"
          f"{'valid %':>9}")
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in result["rows"]:
        by.setdefault((r["mode"], r["concurrency"]), []).append(r)
        print(f"{r['mode']:<13}{r['concurrency']:>5}{r['requests']:>6}{r['tokens']:>8}{r['tok_s']:>9.1f}"
              f"{r['decode_tok_s']:>14.1f}{r['mean_tokens']:>10.1f}{r['valid_pct']:>9.0f}")
    for conc in sorted({k[1] for k in by}):
        con = statistics.mean(r["decode_tok_s"] for r in by[("constrained", conc)])
        free = statistics.mean(r["decode_tok_s"] for r in by[("prompt-only", conc)])
        print(f"concurrency {conc}: constrained / unconstrained decode tokens/s = {con / free:.2f}x "
              "(tok/s over the wall clock also counts each prompt's prefill, and the outputs' lengths differ)")


def main(args: Any) -> None:
    result = run(args)
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
