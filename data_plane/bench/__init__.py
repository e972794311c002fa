"""`switchboard bench`: benchmarks, one module per subcommand, each with `main(argv)`.

    switchboard bench engine --concurrency 1,16 --systems switchboard,naive --json /tmp/engine.json
    switchboard bench serve --url http://127.0.0.1:8000 --api-key KEY --concurrency 8
    switchboard bench overhead ...          # when data_plane/bench/overhead.py is present

Subcommand modules are imported lazily, so `bench serve` never imports torch. A module
listed in SUBCOMMANDS that is not installed (overhead.py is added separately) is reported
as unavailable rather than failing at import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("data_plane.bench.engine", "engine throughput/latency: switchboard vs naive HF vs llama.cpp"),
    "serve": ("data_plane.bench.serve", "latency/throughput of any OpenAI-compatible endpoint (vLLM metrics)"),
    "overhead": ("data_plane.bench.overhead", "what each layer of the stack adds per request"),
    "tiers": ("data_plane.bench.tiers", "a tier mix above capacity: shedding and enterprise TTFT vs unloaded"),
}


def available(name: str) -> bool:
    return importlib.util.find_spec(SUBCOMMANDS[name][0]) is not None


def usage() -> str:
    lines = ["usage: switchboard bench SUBCOMMAND [ARGS...]", "", "subcommands:"]
    for name, (_, desc) in SUBCOMMANDS.items():
        lines.append(f"  {name:<10} {desc}" + ("" if available(name) else " (not available in this build)"))
    lines += ["", "run `switchboard bench SUBCOMMAND --help` for its flags"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS or not available(name):
        why = "unknown" if name not in SUBCOMMANDS else "not available in this build:"
        print(f"switchboard bench: {why} subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    importlib.import_module(SUBCOMMANDS[name][0]).main(rest)
