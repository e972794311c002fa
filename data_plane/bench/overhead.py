"""`switchboard bench overhead`: what the gateway + router add per request over a direct shard call.

    switchboard bench overhead --json /tmp/bench-overhead.json
    switchboard bench overhead --requests 50 --rounds 3 --concurrency 1,16 --no-litellm

Starts, on free loopback ports, one shard with the synthetic engine (instant deterministic
tokens, or one every `--token-interval-ms`, which is what shows the output filter's hold-back), our gateway in static mode pointed at it, and, unless
`--no-litellm`, LiteLLM's proxy pointed at the same shard (one worker, like our gateway). The
same streaming request (`max_tokens` tokens) then goes to three systems:

- `direct`: the shard's own `/v1/chat/completions` (the baseline);
- `switchboard`: gateway -> router -> shard;
- `litellm`: LiteLLM proxy -> shard.

Each round runs, for each concurrency, `--requests` requests per system in a closed loop of
`concurrency` workers over one keep-alive connection pool (the gateway's own lean HTTP/1.1
client, data_plane/hop_client.py: with httpx the load generator's CPU, ~1 ms a request,
made the c=16 tail mostly its own), systems interleaved (direct, switchboard,
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
p99 <= 1/3 of LiteLLM's at each concurrency measured; with a paced engine, c=1 added TTFT
p50 <= 5 ms and p99 <= 15 ms (the gateway's default safety policy is on, so these include the
output filter's hold-back): e.g. `--token-interval-ms 40 --requests 40 --rounds 3`. A target passes when the upper quartile
of its per-round values meets it, fails when the lower quartile misses it, and is inconclusive
in between (rerun on a quieter machine). A missed target is reported, not an exit status.

LiteLLM is found at `--litellm-bin`, else `.venv-litellm/bin/litellm`, else `litellm` on PATH,
else skipped with a message. It runs with `LITELLM_LOG=ERROR`, the bundled model-cost map
(`LITELLM_LOCAL_MODEL_COST_MAP`: no fetch at start), telemetry off and a random per-run master
key (recent LiteLLM refuses to start without one); our gateway authenticates its key too.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from data_plane.bench.common import (
    PROMPTS,
    RequestResult,
    closed_loop,
    cycle,
    fmt,
    format_table,
    machine_info,
    parse_int_list,
    percentile,
    write_json,
)
from data_plane.hop_client import HopError, HopPool
from data_plane.http_server import free_port

DIRECT, SWITCHBOARD, LITELLM = "direct", "switchboard", "litellm"
BENCH_KEY = "sk-bench"
MODEL = "synthetic"
REPO_ROOT = Path(__file__).resolve().parents[2]
REQUEST_TIMEOUT_S = 60.0
CONTENT = re.compile(rb'"content":\s*"(?!")')
"""An SSE chunk carrying non-empty `delta.content` (cheap: no JSON parse per line)."""


# -- processes -----------------------------------------------------------------------------------


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
    """Besides content-type (the client sets it), e.g. authorization."""
    proxy: Proc | None
    """The process whose CPU counts as this system's overhead (None for direct)."""

    def endpoint(self) -> tuple[str, str]:
        """(scheme://host:port, path of chat completions)."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}", parts.path.rstrip("/") + "/chat/completions"


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
    return [json.dumps({"model": MODEL, "messages": [{"role": "user", "content": p}],
                        "max_tokens": max_tokens, "stream": True}).encode() for p in cycle(PROMPTS, n)]


async def send(client: HopPool, system: System, body: bytes) -> RequestResult:
    """One streaming request; `finished` is taken after the last byte (`data: [DONE]`)."""
    r = RequestResult(submitted=time.perf_counter())
    done = False
    base, path = system.endpoint()
    try:
        response = await client.post(base, path, body, system.headers, timeout=REQUEST_TIMEOUT_S)
        try:
            if response.status != 200:
                await response.read()
                r.error = f"HTTP {response.status}"
                return r
            while lines := await response.lines(REQUEST_TIMEOUT_S):
                for line in lines:
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif CONTENT.search(line):
                        r.output_tokens += 1
                        if r.first_token is None:
                            r.first_token = time.perf_counter()
        finally:
            response.close()
        r.finished = time.perf_counter()
        if not done:
            r.error = "stream ended without [DONE]"
    except HopError as exc:
        r.error = type(exc).__name__
    return r


async def run_batch(client: HopPool, system: System, shard: Proc, bodies: list[bytes],
                    concurrency: int, round_no: int) -> Batch:
    one = functools.partial(send, client, system)
    await closed_loop(bodies[:concurrency], concurrency, one)  # warm-up
    cpu0 = system.proxy.cpu_s() if system.proxy else None
    shard0 = shard.cpu_s()
    results = await closed_loop(bodies, concurrency, one)
    cpu1 = system.proxy.cpu_s() if system.proxy else None
    shard1 = shard.cpu_s()

    def per_req_ms(before: float | None, after: float | None) -> float | None:
        return None if before is None or after is None else (after - before) * 1000 / max(1, len(results))

    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error or "no content"
            errors[key] = errors.get(key, 0) + 1
    return Batch(
        system.name, concurrency, round_no,
        latencies_ms=[r.e2el_s * 1000 for r in ok], ttfts_ms=[r.ttft_s * 1000 for r in ok], errors=errors,
        content_chunks=statistics.fmean(r.output_tokens for r in ok) if ok else 0.0,
        proxy_cpu_ms_per_req=per_req_ms(cpu0, cpu1), shard_cpu_ms_per_req=per_req_ms(shard0, shard1),
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
        errors = sum(sum(b.errors.values()) for b in rounds.values())
        row: dict[str, Any] = {"system": system, "concurrency": c, "rounds": len(rounds), "errors": errors,
                               "requests": errors + sum(len(b.latencies_ms) for b in rounds.values())}
        for metric in ("p50", "p99", "ttft_p50", "ttft_p99"):
            row[f"{metric}_ms"] = _median([s[metric] for s in stats.values()])
            diffs = [s[metric] - direct[r].stats()[metric] for r, s in stats.items()
                     if r in direct and direct[r].latencies_ms]
            row[f"added_{metric}_ms"] = _median(diffs)
            row[f"added_{metric}_iqr_ms"] = [percentile(diffs, 25), percentile(diffs, 75)]
        cpu = [b.proxy_cpu_ms_per_req for b in rounds.values() if b.proxy_cpu_ms_per_req is not None]
        shard_cpu = [b.shard_cpu_ms_per_req for b in rounds.values() if b.shard_cpu_ms_per_req is not None]
        row["proxy_cpu_ms_per_req"] = _median(cpu) if cpu else None
        row["shard_cpu_ms_per_req"] = _median(shard_cpu) if shard_cpu else None
        row["content_chunks"] = _median([b.content_chunks for b in rounds.values()])
        rows.append(row)
    order = {DIRECT: 0, SWITCHBOARD: 1, LITELLM: 2}
    return sorted(rows, key=lambda r: (r["concurrency"], order.get(r["system"], 9), r["system"]))


TARGETS_MS: tuple[tuple[str, int, str, float], ...] = (
    ("c=1 added p50 <= 1.5 ms", 1, "added_p50_ms", 1.5),
    ("c=1 added p99 <= 5 ms", 1, "added_p99_ms", 5.0),
    ("c=16 added p99 <= 25 ms", 16, "added_p99_ms", 25.0),
)
"""(name, concurrency, row field, limit) for switchboard's row."""
TTFT_TARGETS_MS: tuple[tuple[str, int, str, float], ...] = (
    ("c=1 added TTFT p50 <= 5 ms", 1, "added_ttft_p50_ms", 5.0),
    ("c=1 added TTFT p99 <= 15 ms", 1, "added_ttft_p99_ms", 15.0),
)
"""First content chunk, safety filter on. Only a paced engine (``--token-interval-ms`` > 0) can
show a hold-back: with instant tokens the whole reply arrives in one burst, so these are
"not measured" then."""
LITELLM_RATIO = 1 / 3
"""Switchboard's added p99 must stay within this fraction of LiteLLM's, at each concurrency."""


def check_targets(rows: list[dict[str, Any]], concurrencies: list[int],
                  paced: bool = False) -> list[dict[str, Any]]:
    """Each target with its value (median over rounds), limit and verdict.

    `pass` when even the upper quartile of the per-round values meets the limit, `fail` when even
    the lower quartile misses it, `inconclusive` when the rounds straddle it (a noisy machine:
    rerun), `not measured` without the row; `ok` is True / False / None accordingly."""
    table = {(r["system"], r["concurrency"]): r for r in rows}

    def get(system: str, c: int, key: str) -> float | None:
        value = table.get((system, c), {}).get(key)
        return None if value is None or math.isnan(value) else value

    specs: list[tuple[str, int, str, float | None]] = list(TARGETS_MS)
    specs += [(name, c, key, limit if paced else None) for name, c, key, limit in TTFT_TARGETS_MS]
    for c in concurrencies:
        theirs = get(LITELLM, c, "added_p99_ms")
        specs.append((f"c={c} added p99 <= 1/3 of litellm's", c, "added_p99_ms",
                      None if theirs is None else theirs * LITELLM_RATIO))
    checks = []
    for name, c, key, limit in specs:
        value = get(SWITCHBOARD, c, key)
        lo, hi = table.get((SWITCHBOARD, c), {}).get(key.replace("_ms", "_iqr_ms")) or (value, value)
        if value is None or limit is None or lo is None or hi is None:
            verdict, ok = "not measured", None
        elif hi <= limit:
            verdict, ok = "pass", True
        elif lo > limit:
            verdict, ok = "fail", False
        else:
            verdict, ok = "inconclusive", None
        checks.append({"target": name, "value_ms": value, "iqr_ms": [lo, hi], "limit_ms": limit,
                       "verdict": verdict, "ok": ok})
    return checks


def render(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    headers = ["system", "concurrency", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms",
               "ttft p50 ms", "added ttft p50", "added ttft p99", "chunks", "proxy cpu ms/req", "errors"]
    body = []
    for r in rows:
        base = r["system"] == DIRECT
        added = [("-" if base else fmt(r[k], 2)) for k in ("added_p50_ms", "added_p99_ms")]
        added_ttft = [("-" if base else fmt(r[k], 2)) for k in ("added_ttft_p50_ms", "added_ttft_p99_ms")]
        body.append([r["system"], str(r["concurrency"]), fmt(r["p50_ms"], 2), fmt(r["p99_ms"], 2), *added,
                     fmt(r["ttft_p50_ms"], 2), *added_ttft, fmt(r["content_chunks"], 1),
                     fmt(r["proxy_cpu_ms_per_req"], 2), str(r["errors"])])
    lines = [format_table(headers, body), "", "targets (switchboard):"]
    for c in checks:
        lo, hi = c["iqr_ms"]
        lines.append(f"  {c['verdict'].upper():<12}  {c['target']:<36} {fmt(c['value_ms'], 2)} ms "
                     f"(rounds' IQR {fmt(lo, 2)}..{fmt(hi, 2)}), limit {fmt(c['limit_ms'], 2)} ms")
    return "\n".join(lines)


# -- the run -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="switchboard bench overhead",
        description="Latency the gateway+router (and LiteLLM's proxy) add over calling a shard directly.")
    p.add_argument("--json", metavar="FILE", help="write rows, per-round stats and target checks here")
    p.add_argument("--requests", type=int, default=200,
                   help="measured requests per system, concurrency and round (default 200)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds; medians are taken across them")
    p.add_argument("--concurrency", type=parse_int_list, default=[1, 16],
                   help="comma-separated (default 1,16)")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="tokens per completion (the synthetic engine stops at 16)")
    p.add_argument("--token-interval-ms", type=float, default=0.0,
                   help="pace the synthetic engine: one token every N ms (e.g. 40, a realistic decode); 0 = "
                        "instant. Only a paced engine shows what the output filter holds back (TTFT targets)")
    p.add_argument("--no-litellm", action="store_true", help="skip LiteLLM's proxy")
    p.add_argument("--litellm-bin", help="LiteLLM executable (default: .venv-litellm/bin/litellm, else PATH)")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for each process")
    args = p.parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--requests, --rounds and --max-tokens must be positive")
    if not 0 <= args.token_interval_ms <= 10_000:
        p.error("--token-interval-ms must be in 0..10000")
    return args


@dataclass
class Stack:
    """The processes under test and the systems measured through them."""

    shard: Proc
    systems: list[System]
    procs: list[Proc]
    note: str | None = None

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def start_stack(args: argparse.Namespace, litellm_bin: str | None, logs: Path) -> Stack:
    """The shard, our gateway and (with `litellm_bin`) LiteLLM, started together."""
    shard_port, gw_port = free_port(), free_port()
    delay = f"{args.token_interval_ms:g}"
    shard = Proc("shard", switchboard_cmd("shard", "--engine", "synthetic", "--synthetic-token-delay-ms", delay,
                                          "--port", str(shard_port)), shard_port, "/health", logs)
    gateway = Proc("gateway", switchboard_cmd("gateway", "--shard-urls", shard.url, "--tokenizer",
                                              "whitespace", "--model-name", MODEL, "--port", str(gw_port)),
                   gw_port, "/health", logs,
                   env={"SWITCHBOARD_GATEWAY_API_KEYS": f"{BENCH_KEY}:bench:enterprise"})
    ours = [System(DIRECT, shard.url + "/v1", {}, None),
            System(SWITCHBOARD, gateway.url + "/v1", {"authorization": f"Bearer {BENCH_KEY}"},
                   gateway)]
    stack = Stack(shard, ours, [shard, gateway])
    litellm: Proc | None = None
    if litellm_bin is not None:
        cfg = logs / "litellm.yaml"
        cfg.write_text(litellm_config(shard.url))
        port, master = free_port(), "sk-" + secrets.token_hex(16)
        cmd = [litellm_bin, "--config", str(cfg), "--port", str(port), "--host", "127.0.0.1",
               "--num_workers", "1"]
        litellm = Proc("litellm", cmd, port, "/health/liveliness", logs,
                       env={"LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                            "LITELLM_MASTER_KEY": master, "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true"})
        try:
            litellm.start()  # its imports take ~20 s: start it first, while ours come up
        except OSError as exc:
            stack.note, litellm = f"litellm skipped: cannot run {litellm_bin}: {exc}", None
    for p in stack.procs:
        p.start()
    try:
        shard.wait_healthy(args.startup_timeout)
        gateway.wait_healthy(args.startup_timeout)
    except BaseException:
        stack.stop()
        if litellm is not None:
            litellm.stop()
        raise
    if litellm is not None:
        try:
            litellm.wait_healthy(args.startup_timeout)
        except RuntimeError as exc:
            litellm.stop()
            stack.note = f"litellm skipped: it did not start ({exc})"
        else:
            stack.procs.append(litellm)
            stack.systems.append(System(LITELLM, litellm.url + "/v1",
                                        {"authorization": f"Bearer {master}"}, litellm))
    return stack


async def measure(args: argparse.Namespace, stack: Stack) -> list[Batch]:
    top, systems = max(args.concurrency), stack.systems
    pool = 4 * top
    bodies = request_bodies(args.requests, args.max_tokens)
    batches: list[Batch] = []
    client = HopPool(connect_timeout_s=5.0, max_idle_per_host=pool)
    try:
        for s in systems:  # first requests pay for lazy imports and connection set-up
            probe = await send(client, s, bodies[0])
            if not probe.ok:
                raise RuntimeError(f"{s.name} at {s.url} does not answer a chat request: {probe.error}")
            await closed_loop(cycle(bodies, 4 * top), top, functools.partial(send, client, s))
        for r in range(args.rounds):
            for c in args.concurrency:
                for s in systems:
                    batches.append(await run_batch(client, s, stack.shard, bodies, c, r))
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
    finally:
        await client.aclose()
    return batches


def _litellm_version(binary: str) -> str | None:
    """The version of the litellm package beside `binary` (its venv's python), if it says."""
    python = Path(binary).with_name("python")
    if not python.exists():
        return None
    try:
        code = "import importlib.metadata as m; print(m.version('litellm'))"
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=30,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.monotonic()
    litellm_bin = None if args.no_litellm else find_litellm(args.litellm_bin)
    note = None
    if args.no_litellm:
        note = "litellm skipped (--no-litellm)"
    elif litellm_bin is None:
        note = ("litellm skipped: no executable (pass --litellm-bin, or: python3 -m venv .venv-litellm && "
                ".venv-litellm/bin/pip install 'litellm[proxy]')")
    logs = Path(tempfile.mkdtemp(prefix="sb-bench-overhead-"))
    what = "shard, gateway" + ("" if litellm_bin is None else " and litellm")
    print(f"starting {what} (logs in {logs}, kept if it fails)", flush=True)
    stack = start_stack(args, litellm_bin, logs)
    note = stack.note or note
    try:
        if note:
            print(note, flush=True)
        names = [s.name for s in stack.systems]
        print(f"measuring {', '.join(names)}: {args.rounds} rounds x {args.requests} requests x "
              f"concurrency {','.join(map(str, args.concurrency))}", flush=True)
        batches = asyncio.run(measure(args, stack))
    finally:
        stack.stop()
    shutil.rmtree(logs, ignore_errors=True)  # kept only when something failed
    rows = aggregate(batches)
    checks = check_targets(rows, args.concurrency, paced=args.token_interval_ms > 0)
    elapsed = time.monotonic() - t0
    print()
    print(render(rows, checks))
    print(f"\n{len(batches)} batches in {elapsed:.0f} s; added = median over rounds of "
          f"(system percentile - direct percentile, same round)")
    if args.json:
        write_json(args.json, {
            "config": {"requests": args.requests, "rounds": args.rounds, "concurrency": args.concurrency,
                       "max_tokens": args.max_tokens, "token_interval_ms": args.token_interval_ms,
                       "systems": names, "note": note,
                       "litellm_version": _litellm_version(litellm_bin) if LITELLM in names and litellm_bin
                       else None},
            "rows": rows,
            "targets": checks,
            "per_round": [{"system": b.system, "concurrency": b.concurrency, "round": b.round, **b.stats(),
                           "errors": b.errors, "proxy_cpu_ms_per_req": b.proxy_cpu_ms_per_req,
                           "shard_cpu_ms_per_req": b.shard_cpu_ms_per_req} for b in batches],
            "machine": machine_info(("httpx", "httptools", "fastapi", "uvicorn", "starlette", "pydantic",
                                       "opentelemetry-sdk")),
            "elapsed_s": elapsed,
        })


if __name__ == "__main__":
    main()
