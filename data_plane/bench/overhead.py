"""`switchboard bench overhead`: what the gateway + router add per request over a direct shard call.

    switchboard bench overhead --json /tmp/bench-overhead.json
    switchboard bench overhead --requests 50 --rounds 3 --concurrency 1,16 --no-litellm

Starts, on free loopback ports, one shard with the synthetic engine (instant deterministic
tokens, `--synthetic-token-delay-ms 0`), our gateway in static mode pointed at it, and, unless
`--no-litellm`, LiteLLM's proxy pointed at the same shard (one worker, like our gateway). The
same streaming request (`max_tokens` tokens) then goes to three systems:

- `direct`: the shard's own `/v1/chat/completions` (the baseline);
- `switchboard`: gateway -> router -> shard;
- `litellm`: LiteLLM proxy -> shard.

Each round runs, for each concurrency, `--requests` requests per system in a closed loop of
`concurrency` workers over one httpx.AsyncClient, systems interleaved (direct, switchboard,
litellm, direct, ...) so machine noise lands on all of them alike; `concurrency` warm-up
requests before each batch are not counted. Per request we record latency to the last byte
of the stream (after `data: [DONE]`) and TTFT (first chunk with non-empty `delta.content`).

Definitions (per system s, concurrency c):

- `p50_ms`, `p99_ms`: the median across rounds of the round's p50 / p99 latency-to-last-byte;
- `added_p50_ms`: the median across rounds r of `p50(s, c, r) - p50(direct, c, r)`,
  `added_p99_ms` likewise with p99 (a difference of percentiles, not a percentile of
  differences: requests are not paired);
- `ttft_*`: the same for TTFT; `proxy_cpu_ms_per_req`: CPU time (user + system) the proxy
  process spent per request, median across rounds (steadier than latency on a busy machine).

Percentiles interpolate linearly between closest ranks (numpy's default). Targets for
`switchboard`: c=1 added p50 <= 1.5 ms and added p99 <= 5 ms; c=16 added p99 <= 25 ms; added
p99 <= 1/3 of LiteLLM's at each concurrency measured. A missed target is reported, not an
exit status: the numbers are only as quiet as the machine.

LiteLLM is found at `--litellm-bin`, else `.venv-litellm/bin/litellm`, else `litellm` on PATH,
else skipped with a message. It runs with `LITELLM_LOG=ERROR`, the bundled model-cost map
(`LITELLM_LOCAL_MODEL_COST_MAP`: no fetch at start), telemetry off and a random per-run master
key (recent LiteLLM refuses to start without one); our gateway authenticates its key too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from data_plane.bench.common import (
    PROMPTS,
    RequestResult,
    closed_loop,
    cycle,
    fmt,
    format_table,
    parse_int_list,
    percentile,
    write_json,
)

DIRECT, SWITCHBOARD, LITELLM = "direct", "switchboard", "litellm"
BENCH_KEY = "sk-bench"
MODEL = "synthetic"
REPO_ROOT = Path(__file__).resolve().parents[2]
CONTENT = re.compile(r'"content":\s*"(?!")')
"""An SSE chunk carrying non-empty `delta.content` (cheap: no JSON parse per line)."""


# -- processes -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One child process on a loopback port, logged to a file, polled until `health` says 200."""

    def __init__(self, name: str, args: list[str], port: int, health: str, logs: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.args, self.port, self.health = name, args, port, health
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **(env or {})}
        self.log_path = logs / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL)
        return self

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.health, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 2500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def cpu_s(self) -> float | None:
        """User + system CPU seconds of the process so far (Linux /proc), or None."""
        if self.proc is None:
            return None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def switchboard_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "control_plane.cli", *args]


def find_litellm(explicit: str | None) -> str | None:
    """--litellm-bin, else .venv-litellm/bin/litellm (here or at the repo root), else PATH."""
    if explicit:
        return explicit
    for root in (Path.cwd(), REPO_ROOT):
        candidate = root / ".venv-litellm" / "bin" / "litellm"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("litellm")


def litellm_config(shard_url: str) -> str:
    return f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: {shard_url}/v1
      api_key: unused
litellm_settings:
  telemetry: false
  set_verbose: false
  turn_off_message_logging: true
general_settings:
  disable_spend_logs: true
  disable_error_logs: true
"""


# -- one system under load -----------------------------------------------------------------------


@dataclass
class System:
    name: str
    url: str
    """Base URL of the OpenAI API (…/v1)."""
    headers: dict[str, str]
    proxy: Proc | None
    """The process whose CPU counts as this system's overhead (None for direct)."""


@dataclass
class Batch:
    """One system at one concurrency in one round."""

    system: str
    concurrency: int
    round: int
    latencies_ms: list[float]
    ttfts_ms: list[float]
    errors: dict[str, int] = field(default_factory=dict)
    content_chunks: float = 0.0
    proxy_cpu_ms_per_req: float | None = None
    shard_cpu_ms_per_req: float | None = None

    def stats(self) -> dict[str, float]:
        return {"p50": percentile(self.latencies_ms, 50), "p99": percentile(self.latencies_ms, 99),
                "ttft_p50": percentile(self.ttfts_ms, 50), "ttft_p99": percentile(self.ttfts_ms, 99)}


def request_bodies(n: int, max_tokens: int) -> list[bytes]:
    import json

    return [json.dumps({"model": MODEL, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                        "stream": True}).encode() for p in cycle(PROMPTS, n)]


async def send(client: httpx.AsyncClient, system: System, body: bytes) -> RequestResult:
    """One streaming request; `finished` is taken after the last byte (`data: [DONE]`)."""
    r = RequestResult(submitted=time.perf_counter())
    done = False
    try:
        async with client.stream("POST", system.url + "/chat/completions", content=body,
                                 headers=system.headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                r.error = f"HTTP {resp.status_code}"
                return r
            async for line in resp.aiter_lines():
                if line.startswith("data: [DONE]"):
                    done = True
                elif CONTENT.search(line):
                    r.output_tokens += 1
                    if r.first_token is None:
                        r.first_token = time.perf_counter()
        r.finished = time.perf_counter()
        if not done:
            r.error = "stream ended without [DONE]"
    except httpx.HTTPError as exc:
        r.error = type(exc).__name__
    return r


async def run_batch(client: httpx.AsyncClient, system: System, shard: Proc, bodies: list[bytes],
                    concurrency: int, round_no: int) -> Batch:
    await closed_loop(bodies[:concurrency], concurrency, lambda b: send(client, system, b))  # warm-up
    cpu0 = system.proxy.cpu_s() if system.proxy else None
    shard0 = shard.cpu_s()
    results = await closed_loop(bodies, concurrency, lambda b: send(client, system, b))
    cpu1 = system.proxy.cpu_s() if system.proxy else None
    shard1 = shard.cpu_s()
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error or "no content"
            errors[key] = errors.get(key, 0) + 1
    n = max(1, len(results))
    return Batch(
        system.name, concurrency, round_no,
        latencies_ms=[r.e2el_s * 1000 for r in ok], ttfts_ms=[r.ttft_s * 1000 for r in ok], errors=errors,
        content_chunks=statistics.fmean(r.output_tokens for r in ok) if ok else 0.0,
        proxy_cpu_ms_per_req=(cpu1 - cpu0) * 1000 / n if cpu0 is not None and cpu1 is not None else None,
        shard_cpu_ms_per_req=(shard1 - shard0) * 1000 / n if shard0 is not None and shard1 is not None else None,
    )


# -- aggregation and targets ---------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def aggregate(batches: list[Batch]) -> list[dict[str, Any]]:
    """One row per (system, concurrency): medians across rounds of per-round percentiles and of
    per-round differences against `direct` in the same round (see the module docstring)."""
    by_key: dict[tuple[str, int], dict[int, Batch]] = {}
    for b in batches:
        by_key.setdefault((b.system, b.concurrency), {})[b.round] = b
    rows = []
    for (system, c), rounds in by_key.items():
        direct = by_key.get((DIRECT, c), {})
        stats = {r: b.stats() for r, b in rounds.items() if b.latencies_ms}
        row: dict[str, Any] = {"system": system, "concurrency": c, "rounds": len(rounds),
                               "requests": sum(len(b.latencies_ms) + sum(b.errors.values()) for b in rounds.values()),
                               "errors": sum(sum(b.errors.values()) for b in rounds.values())}
        for metric in ("p50", "p99", "ttft_p50", "ttft_p99"):
            row[f"{metric}_ms"] = _median([s[metric] for s in stats.values()])
            diffs = [s[metric] - direct[r].stats()[metric] for r, s in stats.items()
                     if r in direct and direct[r].latencies_ms]
            row[f"added_{metric}_ms"] = _median(diffs)
        cpu = [b.proxy_cpu_ms_per_req for b in rounds.values() if b.proxy_cpu_ms_per_req is not None]
        shard_cpu = [b.shard_cpu_ms_per_req for b in rounds.values() if b.shard_cpu_ms_per_req is not None]
        row["proxy_cpu_ms_per_req"] = _median(cpu) if cpu else None
        row["shard_cpu_ms_per_req"] = _median(shard_cpu) if shard_cpu else None
        row["content_chunks"] = _median([b.content_chunks for b in rounds.values()])
        rows.append(row)
    order = {DIRECT: 0, SWITCHBOARD: 1, LITELLM: 2}
    return sorted(rows, key=lambda r: (r["concurrency"], order.get(r["system"], 9), r["system"]))


@dataclass(frozen=True)
class Target:
    name: str
    value: Callable[[dict[tuple[str, int], dict[str, Any]]], float | None]
    limit: Callable[[dict[tuple[str, int], dict[str, Any]]], float | None]


def _get(rows: dict[tuple[str, int], dict[str, Any]], system: str, c: int, key: str) -> float | None:
    row = rows.get((system, c))
    return None if row is None else row[key]


def _third_of_litellm(c: int) -> Callable[[dict[tuple[str, int], dict[str, Any]]], float | None]:
    def limit(rows: dict[tuple[str, int], dict[str, Any]]) -> float | None:
        v = _get(rows, LITELLM, c, "added_p99_ms")
        return None if v is None else v / 3

    return limit


def targets(concurrencies: list[int]) -> list[Target]:
    out = [
        Target("c=1 added p50 <= 1.5 ms", lambda t: _get(t, SWITCHBOARD, 1, "added_p50_ms"), lambda t: 1.5),
        Target("c=1 added p99 <= 5 ms", lambda t: _get(t, SWITCHBOARD, 1, "added_p99_ms"), lambda t: 5.0),
        Target("c=16 added p99 <= 25 ms", lambda t: _get(t, SWITCHBOARD, 16, "added_p99_ms"), lambda t: 25.0),
    ]
    for c in concurrencies:
        out.append(Target(f"c={c} added p99 <= 1/3 of litellm's",
                          lambda t, c=c: _get(t, SWITCHBOARD, c, "added_p99_ms"), _third_of_litellm(c)))
    return out


def check_targets(rows: list[dict[str, Any]], concurrencies: list[int]) -> list[dict[str, Any]]:
    """Each target with its value, limit and verdict; `ok` is None when it was not measured."""
    table = {(r["system"], r["concurrency"]): r for r in rows}
    checks = []
    for t in targets(concurrencies):
        value, limit = t.value(table), t.limit(table)
        measured = value is not None and limit is not None and value == value and limit == limit  # not NaN
        checks.append({"target": t.name, "value_ms": value, "limit_ms": limit,
                       "ok": (value <= limit) if measured else None})
    return checks


def render(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    headers = ["system", "concurrency", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms",
               "ttft p50 ms", "proxy cpu ms/req", "errors"]
    body = [[r["system"], str(r["concurrency"]), fmt(r["p50_ms"], 2), fmt(r["p99_ms"], 2),
             "-" if r["system"] == DIRECT else fmt(r["added_p50_ms"], 2),
             "-" if r["system"] == DIRECT else fmt(r["added_p99_ms"], 2),
             fmt(r["ttft_p50_ms"], 2), fmt(r["proxy_cpu_ms_per_req"], 2), str(r["errors"])] for r in rows]
    lines = [format_table(headers, body), "", "targets (switchboard):"]
    for c in checks:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[c["ok"]]
        lines.append(f"  {verdict}  {c['target']:<38} value {fmt(c['value_ms'], 2)} ms, limit {fmt(c['limit_ms'], 2)} ms")
    return "\n".join(lines)


# -- the run -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="switchboard bench overhead",
                                description="Latency the gateway+router (and LiteLLM's proxy) add over a direct shard call.")
    p.add_argument("--json", metavar="FILE", help="write rows, per-round stats and target checks here")
    p.add_argument("--requests", type=int, default=200, help="measured requests per system, concurrency and round")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (medians are taken across them)")
    p.add_argument("--concurrency", type=parse_int_list, default=[1, 16], help="comma-separated, e.g. 1,16")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (the synthetic engine caps at 16)")
    p.add_argument("--no-litellm", action="store_true", help="skip LiteLLM's proxy")
    p.add_argument("--litellm-bin", help="LiteLLM executable (default: .venv-litellm/bin/litellm, else PATH)")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for each process")
    args = p.parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--requests, --rounds and --max-tokens must be positive")
    return args


def start_processes(args: argparse.Namespace, logs: Path) -> tuple[Proc, list[System], list[Proc], str | None]:
    """The shard, our gateway and (maybe) LiteLLM, started together; returns (shard, systems, procs, note)."""
    shard_port = free_port()
    shard = Proc("shard", switchboard_cmd("shard", "--engine", "synthetic", "--synthetic-token-delay-ms", "0",
                                          "--port", str(shard_port)), shard_port, "/health", logs)
    gw_port = free_port()
    gateway = Proc("gateway", switchboard_cmd("gateway", "--shard-urls", shard.url, "--tokenizer", "whitespace",
                                              "--model-name", MODEL, "--port", str(gw_port)),
                   gw_port, "/health", logs, env={"SWITCHBOARD_GATEWAY_API_KEYS": f"{BENCH_KEY}:bench:enterprise"})
    procs = [shard, gateway]
    systems = [System(DIRECT, shard.url + "/v1", {"content-type": "application/json"}, None),
               System(SWITCHBOARD, gateway.url + "/v1",
                      {"content-type": "application/json", "authorization": f"Bearer {BENCH_KEY}"}, gateway)]
    note = None
    litellm: Proc | None = None
    binary = None if args.no_litellm else find_litellm(args.litellm_bin)
    if args.no_litellm:
        note = "litellm skipped (--no-litellm)"
    elif binary is None:
        note = ("litellm skipped: no executable (pass --litellm-bin, or: python3 -m venv .venv-litellm && "
                ".venv-litellm/bin/pip install 'litellm[proxy]')")
    else:
        cfg = logs / "litellm.yaml"
        cfg.write_text(litellm_config(shard.url))
        ll_port = free_port()
        master = "sk-" + secrets.token_hex(16)
        litellm = Proc("litellm", [binary, "--config", str(cfg), "--port", str(ll_port), "--host", "127.0.0.1",
                                   "--num_workers", "1"], ll_port, "/health/liveliness", logs,
                       env={"LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                            "LITELLM_MASTER_KEY": master, "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true"})
        systems.append(System(LITELLM, litellm.url + "/v1", {"content-type": "application/json",
                                                             "authorization": f"Bearer {master}"}, litellm))
    for p in procs:
        p.start()
    if litellm is not None:
        litellm.start()  # its import takes ~20 s: start it while ours come up
    try:
        shard.wait_healthy(args.startup_timeout)
        gateway.wait_healthy(args.startup_timeout)
    except BaseException:
        for p in procs + ([litellm] if litellm else []):
            p.stop()
        raise
    if litellm is not None:
        try:
            litellm.wait_healthy(args.startup_timeout)
            procs.append(litellm)
        except RuntimeError as exc:
            litellm.stop()
            systems = [s for s in systems if s.name != LITELLM]
            note = f"litellm skipped: it did not start ({exc})"
    return shard, systems, procs, note


async def measure(args: argparse.Namespace, shard: Proc, systems: list[System]) -> list[Batch]:
    top = max(args.concurrency)
    limits = httpx.Limits(max_connections=4 * top * len(systems), max_keepalive_connections=4 * top * len(systems))
    bodies = request_bodies(args.requests, args.max_tokens)
    batches: list[Batch] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0), limits=limits) as client:
        for s in systems:  # first requests pay for lazy imports and connection set-up
            probe = await send(client, s, bodies[0])
            if not probe.ok:
                raise RuntimeError(f"{s.name} at {s.url} does not answer a chat request: {probe.error}")
            await closed_loop(cycle(bodies, 4 * top), top, lambda b, s=s: send(client, s, b))
        for r in range(args.rounds):
            for c in args.concurrency:
                for s in systems:
                    batches.append(await run_batch(client, s, shard, bodies, c, r))
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
    return batches


def _versions() -> dict[str, Any]:
    from importlib import metadata

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu_count": os.cpu_count()}
    try:
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    for name in ("httpx", "fastapi", "uvicorn", "starlette", "pydantic", "opentelemetry-sdk"):
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    return info


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.monotonic()
    logs = Path(tempfile.mkdtemp(prefix="sb-bench-overhead-"))
    print(f"starting shard, gateway{'' if args.no_litellm else ' and litellm'} (logs in {logs})", flush=True)
    shard, systems, procs, note = start_processes(args, logs)
    try:
        if note:
            print(note, flush=True)
        litellm_version = None
        if any(s.name == LITELLM for s in systems):
            litellm_version = _litellm_version(find_litellm(args.litellm_bin))
        print(f"measuring {', '.join(s.name for s in systems)}: {args.rounds} rounds x "
              f"{args.requests} requests x concurrency {args.concurrency}", flush=True)
        batches = asyncio.run(measure(args, shard, systems))
    finally:
        for p in reversed(procs):
            p.stop()
    rows = aggregate(batches)
    checks = check_targets(rows, args.concurrency)
    print()
    print(render(rows, checks))
    elapsed = time.monotonic() - t0
    print(f"\n{len(batches)} batches in {elapsed:.0f} s; added = median over rounds of "
          f"(system percentile - direct percentile, same round)")
    if args.json:
        write_json(args.json, {
            "config": {"requests": args.requests, "rounds": args.rounds, "concurrency": args.concurrency,
                       "max_tokens": args.max_tokens, "systems": [s.name for s in systems], "note": note,
                       "litellm_version": litellm_version},
            "rows": rows,
            "targets": checks,
            "per_round": [{"system": b.system, "concurrency": b.concurrency, "round": b.round, **b.stats(),
                           "errors": b.errors, "proxy_cpu_ms_per_req": b.proxy_cpu_ms_per_req,
                           "shard_cpu_ms_per_req": b.shard_cpu_ms_per_req} for b in batches],
            "machine": _versions(),
            "elapsed_s": elapsed,
        })


def _litellm_version(binary: str | None) -> str | None:
    """The version of the litellm package next to `binary` (its venv's python), if it says."""
    if binary is None:
        return None
    python = Path(binary).with_name("python")
    if not python.exists():
        return None
    try:
        out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


if __name__ == "__main__":
    main()
