"""`switchboard bench`: benchmarks, one module per subcommand, each with `main(argv)`.

    switchboard bench engine --concurrency 1,16 --systems switchboard,naive --json /tmp/engine.json
    switchboard bench serve --url http://127.0.0.1:8000 --api-key KEY --concurrency 8
    switchboard bench overhead --json /tmp/overhead.json
    switchboard bench multiturn --conversations 8 --turns 8 --json /tmp/multiturn.json --png /tmp/mt.png
    switchboard bench route --sizes 10,100,1000,10000 --json /tmp/route.json
    switchboard bench ttft --conversations 4 --turns 9 --json /tmp/ttft.json
    switchboard bench verify --batch 1,4 --json /tmp/verify.json
    switchboard bench memory --conversations 4 --turns 120 --json /tmp/memory.json
    switchboard bench response-cache --requests 300 --repeat-share 0.3 --json /tmp/response-cache.json
    switchboard bench hops --rows 1,16 --json /tmp/hops.json
    switchboard bench quality --formats bfloat16:int4 --json /tmp/quality.json
    switchboard bench coldstart --runs 3 --json /tmp/coldstart.json
    switchboard bench tuner --rates 0,0.3,1,2 --json /tmp/tuner.json

Subcommand modules are imported lazily, so `bench serve` never imports torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from data_plane.common.settings_cli import dispatch

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("data_plane.bench.engine", "engine throughput/latency: switchboard vs naive HF vs llama.cpp"),
    "serve": ("data_plane.bench.serve", "latency/throughput of any OpenAI-compatible endpoint (vLLM metrics)"),
    "overhead": ("data_plane.bench.overhead", "what each layer of the stack adds per request"),
    "tiers": ("data_plane.bench.tiers", "a tier mix above capacity: shedding and enterprise TTFT vs unloaded"),
    "multiturn": ("data_plane.bench.multiturn", "growing conversations, prefix caching off vs on: TTFT per turn, hit rate"),
    "route": ("data_plane.bench.route", "per-request routing cost (pick + lease) at 10 to 10,000 shards"),
    "ttft": ("data_plane.bench.ttft_breakdown", "where a follow-up turn's TTFT goes (spans), prefix caching off vs on"),
    "memory": ("data_plane.bench.memory", "facts planted early in 100+-turn conversations, asked late: retrieval recall, accuracy"),
    "response-cache": ("data_plane.bench.response_cache", "a workload with ~30 % repeats, response cache on vs off: hit latency, shard work saved"),
    "hops": ("data_plane.bench.hop_cost", "one step's hidden state between two processes: gloo send/recv, the pipeline's link, a gloo all-reduce"),
    "quality": ("data_plane.bench.quality", "perplexity and greedy agreement against float32, per dtype/weight format"),
    "coldstart": ("data_plane.bench.coldstart", "a shard's start-up phase by phase (imports, tokenizer, weights, warm-up) to ready"),
    "tuner": ("data_plane.bench.tuner_sim", "the adaptive thread tuner on a modelled noisy host: bursts, contention, held counts"),
    "verify": ("data_plane.bench.verify_cost", "a speculative verify pass against a decode step, per draft rows and batch"),
}


OUTPUT_FLAGS = ("--json", "--png")
"""Flags of the subcommands that name a file written when the run ends."""


def unwritable_output(argv: list[str]) -> str | None:
    """Why an output file in `argv` could not be written (checked before a run that may take minutes,
    whose numbers were lost to a traceback at the end), or None."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in OUTPUT_FLAGS or (not eq and i + 1 >= len(argv)):
            continue  # argparse says what is missing
        path = Path(value if eq else argv[i + 1]).expanduser()
        folder = path.parent
        if path.is_dir():
            return f"{flag} {path}: is a folder; name a file"
        if not folder.is_dir():
            return f"{flag} {path}: there is no folder {folder} to write it in"
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            return f"{flag} {path}: not writable"
    return None


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS and (why := unwritable_output(args[1:])):
        print(f"switchboard bench {args[0]}: {why} (nothing was run)", file=sys.stderr)
        raise SystemExit(2)
    dispatch("switchboard bench", SUBCOMMANDS, args)
