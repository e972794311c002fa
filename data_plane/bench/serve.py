"""`switchboard bench serve`: latency and throughput of any OpenAI-compatible chat endpoint.

    switchboard bench serve --url http://127.0.0.1:8000 --api-key sk-test --concurrency 8 --num-prompts 64
    switchboard bench serve --url http://127.0.0.1:8101 --api-key x --request-rate 4 \\
        --goodput ttft:500 tpot:60 --json /tmp/serve.json

Streams `POST /v1/chat/completions` (temperature 0, `stream_options.include_usage`) over one
httpx.AsyncClient and reads the SSE events. Metric definitions follow vLLM's `bench serve`:

- TTFT: request sent -> first chunk with non-empty `delta.content` (vLLM counts the
  role-only first chunk; we don't, since it carries no token)
- TPOT: (E2EL - TTFT) / (output_tokens - 1), per request with at least two tokens
- ITL: every gap between consecutive content chunks
- E2EL: request sent -> end of stream
- output tokens: `usage.completion_tokens` from the final chunk (content chunks are counted
  instead, with a warning, if the server sends no usage)
- goodput: completed requests per second meeting every `--goodput` SLO (ms)

Two systems in one run: `--compare-url` (e.g. a shard directly, with `--compare-api-key` the cluster
token: a shard's chat API asks for it whenever the cluster has one) is
measured beside `--url` (e.g. the gateway in front of it), in `--rounds` interleaved rounds
(A, B, B, A, ...) of the same workload so machine drift lands on both alike; both result blocks
are printed, then the ratios of A to B (TTFT p50/p99, E2EL p50), the first of which is what a
chat user feels of the stack in front of the engine:

    switchboard bench serve --url http://127.0.0.1:8000 --api-key $KEY \
        --compare-url http://127.0.0.1:8101 --compare-api-key $SWITCHBOARD_CLUSTER_TOKEN --max-tokens 40 --num-prompts 20

Load: `--request-rate inf` (default) is a closed loop of `--concurrency` workers; a finite
rate sends Poisson arrivals, at most `--concurrency` in flight (unbounded if not given).
Each prompt gets a `(request N)` suffix so a response cache cannot answer it
(`--same-prompts` to measure with repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from typing import Any

import httpx

from data_plane.bench.common import PROMPTS, RequestResult, closed_loop, cycle, summarize, write_json

SLO_METRICS = ("ttft", "tpot", "e2el")


# -- one request -------------------------------------------------------------------------


class Endpoint:
    """Where and how to send: base URL (with or without /v1), bearer key, model, sampling."""

    def __init__(self, url: str, api_key: str, model: str, max_tokens: int) -> None:
        base = url.rstrip("/")
        self.base = base.removesuffix("/v1")
        self.headers = {"authorization": f"Bearer {api_key}"}
        self.model = model
        self.max_tokens = max_tokens

    @property
    def chat_url(self) -> str:
        return self.base + "/v1/chat/completions"

    def body(self, prompt: str) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


async def send(client: httpx.AsyncClient, endpoint: Endpoint, prompt: str) -> RequestResult:
    """Stream one chat completion, stamping every content chunk; errors land in `.error`."""
    r = RequestResult(submitted=time.perf_counter())
    try:
        async with client.stream("POST", endpoint.chat_url, json=endpoint.body(prompt),
                                 headers=endpoint.headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {text[:200]}"
                return r
            await _read_sse(resp, r)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"
    if r.error is None and r.first_token is None:
        r.error = "the stream carried no content"
    return r


async def _read_sse(resp: httpx.Response, r: RequestResult) -> None:
    last = 0.0
    chunks = 0
    got_usage = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        now = time.perf_counter()
        if "error" in event:
            r.error = f"stream error: {json.dumps(event['error'])[:200]}"
            break
        if usage := event.get("usage"):
            got_usage = True
            r.output_tokens = int(usage.get("completion_tokens") or 0)
            r.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        for choice in event.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                if r.first_token is None:
                    r.first_token = now
                else:
                    r.itls.append(now - last)
                last = now
                chunks += 1
    r.finished = time.perf_counter()
    if not got_usage:
        r.output_tokens = chunks
        r.usage_reported = False


# -- load --------------------------------------------------------------------------------


async def poisson_load(prompts: list[str], rate: float, concurrency: int | None, seed: int,
                       one: Any) -> list[RequestResult]:
    """Poisson arrivals at `rate` req/s, at most `concurrency` in flight (vLLM's max-concurrency)."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency or len(prompts))

    async def limited(prompt: str) -> RequestResult:
        async with gate:
            return await one(prompt)

    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(limited(prompt)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


# -- metrics -----------------------------------------------------------------------------


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:60'] -> {'ttft': 500.0, 'tpot': 60.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {SLO_METRICS}, got {item!r}")
        slos[name] = float(value)
    return slos


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft_s * 1000, "tpot": (r.tpot_s or 0.0) * 1000, "e2el": r.e2el_s * 1000}
    return all(values[k] <= limit for k, limit in slos.items())


def compute_metrics(results: list[RequestResult], duration_s: float, slos: dict[str, float]) -> dict[str, Any]:
    """vLLM's serving metrics (names as in its --save-result JSON)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": sum(meets(r, slos) for r in ok) / duration_s if slos else None,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "usage_missing": sum(1 for r in ok if not r.usage_reported),
    }
    series = {
        "ttft": [r.ttft_s * 1000 for r in ok],
        "tpot": [t * 1000 for r in ok if (t := r.tpot_s) is not None],
        "itl": [gap * 1000 for r in ok for gap in r.itls],
        "e2el": [r.e2el_s * 1000 for r in ok],
    }
    for name, values in series.items():
        s = summarize(values)
        m.update({f"mean_{name}_ms": s["mean"], f"median_{name}_ms": s["median"],
                  f"std_{name}_ms": s["std"], f"p99_{name}_ms": s["p99"]})
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    m["errors"] = errors
    return m


SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def print_metrics(m: dict[str, Any], concurrency: int | None, rate: float) -> None:
    """The result block, laid out as vLLM's `bench serve` prints it."""
    def row(label: str, value: Any) -> None:
        print(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Maximum request concurrency:", concurrency if concurrency else "unbounded")
    row("Request rate (req/s):", "inf" if math.isinf(rate) else rate)
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    if m["request_goodput"] is not None:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    for key, short, title in SECTIONS:
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", m[f"median_{key}_ms"])
        row(f"P99 {short} (ms):", m[f"p99_{key}_ms"])
    print("=" * 50)
    if m["usage_missing"]:
        print(f"warning: {m['usage_missing']} streams had no usage chunk; their tokens were counted as chunks")
    for error, count in m["errors"].items():
        print(f"failed x{count}: {error}")


# -- command line ------------------------------------------------------------------------


class BenchError(Exception):
    """A run that cannot start (nothing at the URL, a refused key): one line for the operator,
    never a traceback through httpx."""


def _why(resp: httpx.Response) -> str:
    """The server's own words for an error answer (OpenAI's ``error.message`` when it has one)."""
    try:
        body = resp.json()
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
    except (ValueError, AttributeError):
        message = None
    return str(message or resp.text[:200] or resp.reason_phrase)


async def discover_model(client: httpx.AsyncClient, endpoint: Endpoint) -> str:
    url = endpoint.base + "/v1/models"
    try:
        resp = await client.get(url, headers=endpoint.headers)
    except httpx.HTTPError as exc:
        tls = ("; its certificate is not one this machine trusts: pass --ca-bundle (or SSL_CERT_FILE) with the CA "
               "that signed it (`switchboard up --tls`: STATE_DIR/tls/ca.pem)") if "CERTIFICATE_VERIFY_FAILED" in str(
            exc) else ""
        raise BenchError(f"cannot reach {url} ({type(exc).__name__}: {exc}); check --url{tls}") from None
    if resp.status_code >= 400:
        hint = "; check --api-key" if resp.status_code in (401, 403) else ""
        raise BenchError(f"{url} answered {resp.status_code}: {_why(resp)}{hint}")
    try:
        data = resp.json().get("data") or []
        return str(data[0]["id"])
    except (ValueError, AttributeError, LookupError, TypeError):
        raise BenchError(f"{url} lists no model; pass --model") from None


def _workload(args: argparse.Namespace) -> tuple[int | None, list[str]]:
    concurrency = args.concurrency or (1 if math.isinf(args.request_rate) else None)
    num = args.num_prompts or 2 * (concurrency or 4)
    texts = cycle(PROMPTS, num)
    if not args.same_prompts:
        texts = [f"{t} (request {i})" for i, t in enumerate(texts)]
    return concurrency, texts


async def _load(client: httpx.AsyncClient, endpoint: Endpoint, texts: list[str], concurrency: int | None,
                args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    async def one(prompt: str) -> RequestResult:
        return await send(client, endpoint, prompt)

    t0 = time.perf_counter()
    if math.isinf(args.request_rate):
        results = await closed_loop(texts, concurrency or len(texts), one)
    else:
        results = await poisson_load(texts, args.request_rate, concurrency, args.seed, one)
    return results, time.perf_counter() - t0


async def run(args: argparse.Namespace, slos: dict[str, float]) -> dict[str, Any]:
    concurrency, texts = _workload(args)
    num = len(texts)
    limits = httpx.Limits(max_connections=concurrency or num, max_keepalive_connections=concurrency or num)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=10.0), limits=limits) as client:
        endpoint = Endpoint(args.url, args.api_key, args.model or "", args.max_tokens)
        if not args.model:
            endpoint.model = await discover_model(client, endpoint)
        print(f"[bench] {num} requests to {endpoint.chat_url} (model {endpoint.model}, "
              f"concurrency {concurrency or 'unbounded'}, rate {args.request_rate})", flush=True)
        results, duration = await _load(client, endpoint, texts, concurrency, args)
    m = compute_metrics(results, duration, slos)
    print_metrics(m, concurrency, args.request_rate)
    return {**m, "config": {"url": args.url, "model": endpoint.model, "concurrency": concurrency,
                            "request_rate": args.request_rate, "num_prompts": num,
                            "max_tokens": args.max_tokens, "goodput": slos}}


RATIOS = (("ttft_p50", "median_ttft_ms"), ("ttft_p99", "p99_ttft_ms"), ("e2el_p50", "median_e2el_ms"))
"""(name, metric) pairs reported as A / B by a comparison run."""


async def run_compare(args: argparse.Namespace, slos: dict[str, float]) -> dict[str, Any]:
    """`--url` (A) and `--compare-url` (B) in interleaved rounds of the same workload."""
    concurrency, texts = _workload(args)
    limits = httpx.Limits(max_connections=2 * (concurrency or len(texts)))
    results: dict[str, list[RequestResult]] = {"a": [], "b": []}
    durations = {"a": 0.0, "b": 0.0}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=10.0), limits=limits) as client:
        a = Endpoint(args.url, args.api_key, args.model or "", args.max_tokens)
        b = Endpoint(args.compare_url, args.compare_api_key, args.model or "", args.max_tokens)
        for e in (a, b):
            if not args.model:
                e.model = await discover_model(client, e)
        print(f"[bench] A {a.chat_url} vs B {b.chat_url}: {args.rounds} rounds x {len(texts)} requests each "
              f"(concurrency {concurrency or 'unbounded'}, rate {args.request_rate})", flush=True)
        await _load(client, a, texts[:1], 1, args)  # warm both paths (connections, first-request costs)
        await _load(client, b, texts[:1], 1, args)
        for r in range(args.rounds):
            order = [("a", a), ("b", b)] if r % 2 == 0 else [("b", b), ("a", a)]
            for key, endpoint in order:
                got, took = await _load(client, endpoint, texts, concurrency, args)
                results[key] += got
                durations[key] += took
    metrics = {k: compute_metrics(results[k], durations[k], slos) for k in ("a", "b")}
    for key, url in (("a", args.url), ("b", args.compare_url)):
        print(f"\n[{key.upper()}] {url}")
        print_metrics(metrics[key], concurrency, args.request_rate)
    ratios = {}
    for name, metric in RATIOS:
        va, vb = metrics["a"][metric], metrics["b"][metric]
        ratios[name] = va / vb if vb and not math.isnan(vb) and not math.isnan(va) else None
    print("\nA / B (same run):  " + "   ".join(
        f"{name} {'n/a' if v is None else f'{v:.3f}x'}" for name, v in ratios.items()))
    print(f"TTFT p50: A {metrics['a']['median_ttft_ms']:.1f} ms, B {metrics['b']['median_ttft_ms']:.1f} ms "
          f"(A - B = {metrics['a']['median_ttft_ms'] - metrics['b']['median_ttft_ms']:+.1f} ms)")
    return {"a": metrics["a"], "b": metrics["b"], "ratios": ratios,
            "config": {"url": args.url, "compare_url": args.compare_url, "model": a.model,
                       "concurrency": concurrency, "request_rate": args.request_rate, "rounds": args.rounds,
                       "num_prompts": len(texts), "max_tokens": args.max_tokens, "goodput": slos}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="switchboard bench serve",
                                description="Benchmark an OpenAI-compatible chat endpoint (vLLM metrics).")
    p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--api-key", default="none", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="model id (default: the first one /v1/models lists)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="closed-loop workers, or the in-flight cap with --request-rate (default 1 / unbounded)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests to send (default 2 x concurrency)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default 128)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (default inf: closed loop)")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=None,
                   help="SLOs for goodput, from ttft, tpot, e2el, e.g. --goodput ttft:500 tpot:60")
    p.add_argument("--same-prompts", action="store_true",
                   help="repeat the prompt texts verbatim (default: a unique suffix per request)")
    p.add_argument("--seed", type=int, default=0, help="seed for Poisson arrivals")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the metrics as JSON")
    p.add_argument("--compare-url", default=None,
                   help="a second endpoint (e.g. the shard behind --url) measured in the same run; prints A/B ratios")
    p.add_argument("--compare-api-key", default="none", help="bearer key for --compare-url")
    p.add_argument("--rounds", type=int, default=3, help="with --compare-url: interleaved rounds (default 3)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be positive")
    for name in ("concurrency", "num_prompts", "max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not args.request_rate > 0:
        p.error("--request-rate must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        slos = parse_goodput(args.goodput)
    except ValueError as exc:
        raise SystemExit(f"switchboard bench serve: {exc}") from None
    try:
        result = asyncio.run(run_compare(args, slos) if args.compare_url else run(args, slos))
    except BenchError as exc:
        raise SystemExit(f"switchboard bench serve: {exc}") from None
    if args.json:
        write_json(args.json, result)
    # A run in which nothing was served measured nothing: exit 1 so a script or CI step notices
    # (it used to print a table of nan and exit 0 when every request was refused).
    for name, m in ((("A", result["a"]), ("B", result["b"])) if args.compare_url else (("", result),)):
        if not m["completed"]:
            where = f" ({name}: {args.url if name == 'A' else args.compare_url})" if name else ""
            raise SystemExit(f"switchboard bench serve: every request failed{where}; see 'failed x' above")
