"""`switchboard bench engine --workload json|tools`: constrained decoding against the same prompts unconstrained.

    switchboard bench engine --workload json --concurrency 1,16 --max-tokens 256 --rounds 2
    switchboard bench engine --workload tools --concurrency 1 --max-tokens 64 --num-prompts 8 --json out.json

Three things over the schema corpus (data_plane/bench/schema_corpus.py, 52 real-world schemas):

1. Grammar compile time, p50 / p99 / max, every schema compiled fresh (no cache), as the shard compiles it
   (`json`: the response_format schema; `tools`: the tool envelope with the schema as a named tool's
   parameters, data_plane/structured.py), and how many the grammar engine refuses.
2. Decode tokens/s at each concurrency, the same prompts constrained (the grammar's mask in every step,
   `--max-tokens` at most) and unconstrained with each output exactly as long as its constrained one
   (`ignore_eos`); the ratio is constrained / unconstrained.
3. The share of outputs valid against their schema (jsonschema): constrained vs the prompt alone, each to
   its natural end (for `tools`: the arguments of the named tool's call, parsed from the envelope), with
   the share cut by `--max-tokens` apart; a constrained output that stopped on its own and is invalid is a
   bug and is listed. Use a limit the outputs fit in (`--max-tokens 256`).

In-process torch engine (one event loop, the engine's scheduler thread), like `bench engine` itself.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Outcome:
    """One request's result: output tokens, valid against its schema, how it ended, decode seconds."""

    tokens: int
    valid: bool
    finish: str
    decode_s: float


async def _one(engine: Any, workload: str, index: int, constrained: bool, max_tokens: int,
               exact: bool = False) -> Outcome:
    """`exact`: exactly `max_tokens` tokens (ignore_eos), the length a constrained output had."""
    from data_plane.shard.generation import generation_requests

    name, schema = CORPUS[index % len(CORPUS)]
    req = _request(workload, name, schema, constrained)
    plan = req.output_plan()
    if not constrained:  # the prompt alone: no grammar (tools: the envelope is described, not forced)
        plan = type(plan)(None, plan.tool_mode, plan.tools_prompt, plan.json_response)
    update: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
    if exact:
        update["ignore_eos"] = True
    (gen,) = generation_requests(req.model_copy(update=update), engine, uuid.uuid4().hex, (), plan)
    await engine.prepare(gen)
    text, tokens, decode_s, finish = [], 0, 0.0, ""
    async for out in engine.generate(gen):
        text.append(out.text)
        tokens = out.completion_tokens
        finish = out.finish_reason or finish
        if out.timings is not None:
            decode_s = out.timings.decode_s
    return Outcome(tokens, _valid(_payload(workload, "".join(text)), schema), finish, decode_s)


async def run_level(engine: Any, workload: str, concurrency: int, prompts: int, constrained: bool,
                    max_tokens: int, lengths: list[int] | None = None) -> dict[str, Any]:
    """One pass over `prompts` requests, `concurrency` at a time. `lengths`: unconstrained, request i
    exactly lengths[i] tokens (the constrained run's), for the speed comparison."""
    sem = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> Outcome:
        async with sem:
            if lengths is not None:
                return await _one(engine, workload, i, False, max(lengths[i], 1), exact=True)
            return await _one(engine, workload, i, constrained, max_tokens)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(bounded(i) for i in range(prompts)))
    wall = time.perf_counter() - t0
    tokens = sum(r.tokens for r in results)
    decode_tokens = sum(r.tokens - 1 for r in results if r.tokens > 1)
    # Decode speed per stream: tokens after the first over the time after it (prefill and the schema-laden
    # prompt excluded).
    per_stream = decode_tokens / max(sum(r.decode_s for r in results if r.tokens > 1), 1e-9)
    stopped = [r for r in results if r.finish == "stop"]
    mode = "unconstrained" if lengths is not None else "constrained" if constrained else "prompt-only"
    return {"mode": mode, "concurrency": concurrency, "requests": prompts, "tokens": tokens, "tok_s": tokens / wall,
            "decode_tok_s": per_stream * concurrency, "lengths": [r.tokens for r in results],
            "valid_pct": 100.0 * sum(r.valid for r in results) / prompts,
            "cut_pct": 100.0 * sum(r.finish == "length" for r in results) / prompts,
            "finished_invalid": [CORPUS[i % len(CORPUS)][0] for i, r in enumerate(results)
                                 if r.finish == "stop" and not r.valid],
            "valid_of_finished_pct": 100.0 * sum(r.valid for r in stopped) / max(len(stopped), 1),
            "mean_tokens": statistics.mean(r.tokens for r in results)}


def run(args: Any) -> dict[str, Any]:
    """Per concurrency: constrained, then the same prompts unconstrained to exactly the constrained outputs'
    lengths (the speed pair; rounds alternate which goes first), and once the prompt alone to its natural
    end (validity without a grammar)."""
    from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine

    loop = asyncio.new_event_loop()
    engine = TorchEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max(args.concurrency),
                                      max_model_len=2048, threads=args.threads, prefix_caching=False))
    loop.run_until_complete(engine.start())
    level = lambda *a, **k: loop.run_until_complete(run_level(engine, args.workload, *a, **k))
    try:
        compiled = compile_times(engine, args.workload)
        rows = []
        for c in args.concurrency:
            prompts = args.num_prompts or max(2 * c, 4)
            first = level(c, prompts, True, args.max_tokens)
            rows.append(first)
            for round_no in range(args.rounds):
                free = level(c, prompts, False, args.max_tokens, lengths=first["lengths"])
                if round_no % 2:  # B A: the constrained pass after the unconstrained one
                    rows.append(free)
                    rows.append(level(c, prompts, True, args.max_tokens))
                elif round_no:
                    rows.append(level(c, prompts, True, args.max_tokens))
                    rows.append(free)
                else:
                    rows.append(free)
            if not args.skip_prompt_only:
                rows.append(level(c, prompts, False, args.max_tokens))
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
    print(f"{'mode':<14}{'conc':>5}{'reqs':>6}{'tokens':>8}{'tok/s':>9}{'decode tok/s':>14}{'mean tok':>10}"
          f"{'valid %':>9}{'cut %':>7}{'valid of stopped %':>20}")
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in result["rows"]:
        by.setdefault((r["mode"], r["concurrency"]), []).append(r)
        print(f"{r['mode']:<14}{r['concurrency']:>5}{r['requests']:>6}{r['tokens']:>8}{r['tok_s']:>9.1f}"
              f"{r['decode_tok_s']:>14.1f}{r['mean_tokens']:>10.1f}{r['valid_pct']:>9.0f}{r['cut_pct']:>7.0f}"
              f"{r['valid_of_finished_pct']:>20.0f}")
        if r["mode"] == "constrained" and r["finished_invalid"]:
            print(f"  BUG: finished (stop) but invalid: {', '.join(r['finished_invalid'])}")
    for conc in sorted({k[1] for k in by}):
        con = statistics.mean(r["decode_tok_s"] for r in by[("constrained", conc)])
        free = statistics.mean(r["decode_tok_s"] for r in by[("unconstrained", conc)])
        print(f"concurrency {conc}: constrained / unconstrained decode tokens/s = {con / free:.2f}x "
              "(same prompts, each unconstrained output exactly as long as its constrained one; "
              "cut %: outputs ended by --max-tokens)")


def main(args: Any) -> None:
    result = run(args)
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
