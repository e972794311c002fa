"""What every benchmark shares: per-request results, percentiles, tables, machine facts.

Imported by every `switchboard bench` subcommand's module in data_plane/bench/ (serve, engine,
multiturn, tiers, overhead, route, ...), and by tests/data_plane/test_bench.py.

    results = await closed_loop(prompts, concurrency=4, one=send)   # list[RequestResult]
    ttft = summarize([r.ttft_s * 1000 for r in results if r.ok])    # {"mean", "median", "p99", ...}
    print(format_table(["system", "tok/s"], [["switchboard", "248.1"]]))

Percentiles interpolate linearly between the closest ranks (numpy's default, which vLLM's
`bench serve` uses), so numbers here compare with vLLM's at the same definitions.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import resource
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from data_plane.common.cores import usable_cores

T = TypeVar("T")

PROMPTS: tuple[str, ...] = (
    "Write a detailed essay about the history of the printing press and how it changed Europe.",
    "Explain step by step how a bicycle works, covering the frame, wheels, chain, gears and brakes.",
    "Describe in detail the water cycle, from evaporation to precipitation, for a school textbook.",
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how the internet works, from a web browser request to the server and back, in depth.",
    "Write a thorough guide to growing tomatoes at home, including soil, watering and pests.",
    "Describe the life cycle of a star, from a nebula to its final stage, in several paragraphs.",
    "Explain the causes and consequences of the French Revolution in a detailed essay.",
    "Write a step-by-step recipe for baking bread from scratch and explain why each step matters.",
    "Describe how vaccines train the immune system, with examples, for a general audience.",
    "Write a detailed travel guide to Japan covering cities, food, transport and customs.",
    "Explain how photosynthesis works in plants, including the light and dark reactions.",
    "Write a long letter from a sailor to his family describing a voyage across the Atlantic.",
    "Explain the basics of personal finance: budgeting, saving, debt and investing, in detail.",
    "Describe the rules and strategy of chess for a complete beginner, in several paragraphs.",
    "Explain how an electric car works, from the battery to the motor, and compare it to petrol cars.",
)
"""Chat prompts that draw long answers, so most requests run to max_tokens."""


@dataclass
class RequestResult:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    submitted: float
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    """Every gap between consecutive content chunks (vLLM's ITL)."""
    error: str | None = None
    usage_reported: bool = True
    """False when the server sent no usage and output_tokens counts content chunks."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None and self.finished is not None

    @property
    def ttft_s(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.submitted

    @property
    def e2el_s(self) -> float:
        assert self.finished is not None
        return self.finished - self.submitted

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1); None for one-token answers."""
        if self.output_tokens < 2 or self.finished is None or self.first_token is None:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy.percentile's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, median (= p50), std and p99 of `values`; NaN for an empty list."""
    if not values:
        return {"mean": math.nan, "median": math.nan, "std": math.nan, "p50": math.nan, "p99": math.nan}
    median = percentile(values, 50)
    return {
        "mean": statistics.fmean(values),
        "median": median,
        "std": statistics.pstdev(values),
        "p50": median,
        "p99": percentile(values, 99),
    }


async def closed_loop(
    items: Sequence[T], concurrency: int, one: Callable[[T], Awaitable[RequestResult]]
) -> list[RequestResult]:
    """`concurrency` workers; each takes the next item as soon as its previous one is done.

    Results come back in item order."""
    results: list[RequestResult | None] = [None] * len(items)
    next_index = iter(range(len(items)))

    async def worker() -> None:
        for i in next_index:  # a shared iterator: each index goes to exactly one worker
            results[i] = await one(items[i])

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(items))))))
    return [r for r in results if r is not None]


async def one_at_a_time(prompts: Sequence[list[int]], concurrency: int, max_tokens: int,
                        generate: Callable[[list[int], int, RequestResult], None]) -> list[RequestResult]:
    """A server that holds one sequence (naive HF `generate`, llama.cpp's high-level API): a closed
    loop of `concurrency` clients whose requests are served in FIFO order, `generate(ids, max_tokens,
    result)` run in a worker thread, so at concurrency N the TTFT includes the queueing."""
    lock = asyncio.Lock()

    async def one(ids: list[int]) -> RequestResult:
        r = RequestResult(submitted=time.perf_counter(), prompt_tokens=len(ids))
        async with lock:
            await asyncio.to_thread(generate, ids, max_tokens, r)
        return r

    return await closed_loop(prompts, concurrency, one)


def cycle(items: Sequence[T], n: int) -> list[T]:
    """The first n items of items repeated."""
    return [items[i % len(items)] for i in range(n)]


def parse_int_list(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (positive, deduplicated, in order)."""
    out: list[int] = []
    for part in text.split(","):
        value = int(part)
        if value < 1:
            raise ValueError(f"{value} is not a positive integer")
        if value not in out:
            out.append(value)
    return out


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain, right-aligned text table (first column left-aligned)."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def machine_info(packages: Iterable[str] = ("torch", "transformers")) -> dict[str, Any]:
    """CPU model, cores, load, ISA flags that matter for bf16, and the versions of `packages`
    (read from their metadata: nothing is imported)."""
    from importlib import metadata

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "cpu_model": platform.processor() or None,
        "loadavg": list(os.getloadavg()),
    }
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        info["cpu_flags"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    except OSError:
        pass
    for name in packages:
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    return info


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write `payload` as indented JSON; NaN becomes null so any JSON reader accepts it."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and math.isnan(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    Path(path).write_text(json.dumps(clean(payload), indent=2) + "\n")
    print(f"wrote {path}")


def finish(result: dict[str, Any], logs: Path, json_path: str | None, summary: Any = None) -> None:
    """The end of a cluster benchmark's report: `summary` (default: ``result["summary"]``) as JSON, where
    the processes' logs are, and `result` written to `json_path` when one was given (``--json``)."""
    print(json.dumps(result.get("summary", {}) if summary is None else summary, indent=2))
    print(f"logs in {logs}")
    if json_path:
        write_json(json_path, result)
