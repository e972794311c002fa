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
client, data_plane/routing/hop_client.py: with httpx the load generator's CPU, ~1 ms a request,
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

Aggregation, target checks and the table live in :mod:`data_plane.bench.overhead_report`.

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
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from data_plane.bench.common import (
    PROMPTS,
    RequestResult,
    closed_loop,
    cycle,
    machine_info,
    parse_int_list,
    write_json,
)
from data_plane.bench.overhead_report import (
    DIRECT,
    LITELLM,
    SWITCHBOARD,
    Batch,
    aggregate,
    check_targets,
    render,
)
from data_plane.common.hop_auth import CLUSTER_TOKEN_ENV
from data_plane.common.http_server import free_port
from data_plane.routing.hop_client import HopError, HopPool

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
    # No cluster token, even when the operator's shell has one: the direct baseline and LiteLLM call the
    # shard as any OpenAI-compatible server, with no token (a shard that has one answers them 401).
    open_shard = {CLUSTER_TOKEN_ENV: ""}
    shard = Proc("shard", switchboard_cmd("shard", "--engine", "synthetic", "--synthetic-token-delay-ms", delay,
                                          "--port", str(shard_port)), shard_port, "/health", logs, env=open_shard)
    gateway = Proc("gateway", switchboard_cmd("gateway", "--shard-urls", shard.url, "--tokenizer",
                                              "whitespace", "--model-name", MODEL, "--port", str(gw_port)),
                   gw_port, "/health", logs,
                   env={**open_shard, "SWITCHBOARD_GATEWAY_API_KEYS": f"{BENCH_KEY}:bench:enterprise"})
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
