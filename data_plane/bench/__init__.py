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


def main(argv: list[str] | None = None) -> None:
    dispatch("switchboard bench", SUBCOMMANDS, argv)
