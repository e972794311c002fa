"""Pipeline-parallel torch shards (data_plane/shard/engines/pipeline.py), with the real model and
real stage processes: fp32 greedy output identical to the unsharded engine (solo, batched, chunked
prefill, speculation's verify passes through the stages); a stage killed or frozen fails the shard's
streams into the gateway's mid-stream resume, and the shard exits."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from itertools import pairwise

import pytest

from data_plane.common.cores import usable_cores
from data_plane.shard.engines.base import GenerationRequest, SamplingParams, StageSpan
from data_plane.shard.engines.pipeline import PassTiming, head_layers, split_layers
from data_plane.shard.engines.torch_config import StepListener
from data_plane.shard.engines.torch_engine import EngineConfig, TorchEngine
from tests.support.formats import BLOCKQ, INVARIANT, INVARIANT_ARGS
from tests.support.metrics import scrape
from tests.support.pipeline import exit_within, stage_pids
from tests.support.procs import Service

PROMPTS = [
    "What is 2+2?",
    "Repeat this sentence exactly, twice: the quick brown fox jumps over the lazy dog near the river bank.",
    ("Write a long, detailed paragraph about the history of the printing press in Europe, its inventors, and "
     "how it changed the spread of knowledge, religion and science across the continent over two centuries."),
    "Name three colors.",
]


def test_split_layers_even_remainder_and_override() -> None:
    assert split_layers(30, 1) == [(0, 30)]
    assert split_layers(30, 2) == [(0, 15), (15, 30)]
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert split_layers(30, 3, "5,25") == [(0, 5), (5, 25), (25, 30)]
    # What only stage 0 does (the LM head: SmolLM2's is 8.0 layers' worth) counted in: even work a stage.
    assert head_layers(576, 1536, 9, 3, 49152) == pytest.approx(8.0, abs=0.01)
    assert split_layers(30, 2, head=8.0) == [(0, 11), (11, 30)]
    assert split_layers(30, 3, head=8.0) == [(0, 5), (5, 18), (18, 30)]
    assert split_layers(30, 3, "5,25", head=8.0) == [(0, 5), (5, 25), (25, 30)]  # an explicit split wins
    assert split_layers(2, 2, head=40.0) == [(0, 1), (1, 2)]  # every stage keeps at least one layer
    for bad in ("5", "25,5", "0,10", "10,30"):
        with pytest.raises(ValueError):
            split_layers(30, 3, bad)
    with pytest.raises(ValueError):
        split_layers(30, 31)


def test_micro_batches_split_items_contiguously_by_tokens() -> None:
    from data_plane.shard.engines.llama_runner import micro_batches

    assert micro_batches([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]  # a decode step: two halves of the slots
    assert micro_batches([40, 1, 1, 1], 2) == [(0, 1), (1, 4)]  # by tokens, an item never split
    assert micro_batches([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    assert micro_batches([7], 3) == [(0, 1)]  # fewer items than micro-batches
    assert micro_batches([1, 1], 1) == [(0, 2)]  # micro-batching off


def _overlapping(passes: list[PassTiming]) -> int:
    """Pairs of consecutive passes where a later stage ran pass k while stage 0 ran pass k+1."""
    count = 0
    for a, b in pairwise(passes):
        if b.in_flight >= 2 and any(a.spans[s][0] < b.spans[0][1] and b.spans[0][0] < a.spans[s][1]
                                    for s in range(1, len(a.spans))):
            count += 1
    return count


class _Counting(StepListener):
    def __init__(self) -> None:
        self.hops = 0
        self.hop_bytes = 0
        self.drafted = 0
        self.stages: dict[int, bool] = {}
        self.passes: list[PassTiming] = []
        self.batches: list[tuple[int, bool]] = []

    def on_batch_sent(self, in_flight: int, decode: bool) -> None:
        self.batches.append((in_flight, decode))

    def on_pipeline_pass(self, timing: PassTiming) -> None:
        self.hops += 1
        self.hop_bytes += sum(timing.hop_bytes)
        self.passes.append(timing)

    def on_spec_draft(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted

    def on_stage(self, stage: int, up: bool) -> None:
        self.stages[stage] = up


async def _generate(engine: TorchEngine, i: int, prompt: str, max_tokens: int = 32,
                    stages: list[tuple[StageSpan, ...]] | None = None) -> str:
    ids = engine.encode_chat([{"role": "user", "content": prompt}])
    text = ""
    async for out in engine.generate(GenerationRequest(f"r{i}-{time.monotonic()}", ids,
                                                       SamplingParams(temperature=0.0, max_tokens=max_tokens))):
        text += out.text
        if out.finish_reason is not None and stages is not None:
            stages.append(out.stages)
    return text


async def _outputs(pp: int, listener: StepListener | None = None,
                   stages: list[tuple[StageSpan, ...]] | None = None,
                   fmt: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    engine = TorchEngine(EngineConfig(**(fmt or INVARIANT), max_num_seqs=4, max_model_len=512, threads=1,
                                      prefill_chunk=32, prefix_caching=False, speculation="ngram",
                                      pipeline_parallel_size=pp), listener)
    await engine.start()
    try:
        solo = [await _generate(engine, i, p, stages=stages) for i, p in enumerate(PROMPTS)]
        batched = list(await asyncio.gather(*(_generate(engine, i, p, stages=stages) for i, p in enumerate(PROMPTS))))
    finally:
        await engine.aclose()
    return solo, batched


def test_two_and_three_stages_greedy_identical_to_unsharded_solo_and_batched() -> None:
    """Mixed prompt lengths (4 to ~45 tokens, chunked at 32), solo then all four batched, n-gram
    speculation on: N = 2 and N = 3 give the unsharded engine's tokens; every pass reports each
    stage's compute and each hop, and every request's final output each stage's part (its spans)."""
    unsharded: list[tuple[StageSpan, ...]] = []
    solo1, batched1 = asyncio.run(_outputs(1, stages=unsharded))
    assert batched1 == solo1
    assert unsharded == [()] * 8
    for pp in (2, 3):
        counting, stages = _Counting(), []
        solo, batched = asyncio.run(_outputs(pp, counting, stages))
        assert solo == solo1, pp
        assert batched == solo1, pp
        assert counting.stages == dict.fromkeys(range(pp), True)
        assert counting.hops > 0 and counting.hop_bytes > 0
        assert counting.drafted > 0  # verify passes went through every stage
        # Micro-batches in flight (on by default: as many as stages): passes sent before the
        # previous one came back, and a later stage's interval on pass k overlapping stage 0's on k+1.
        assert max(t.in_flight for t in counting.passes) == pp
        # The batch queue (on by default: as many plans as stages): decode plans of other sequences
        # sent while earlier ones were still in the later stages, never more than pp at once.
        assert any(n >= 2 and decode for n, decode in counting.batches)
        assert max(n for n, _ in counting.batches) <= pp
        assert _overlapping(counting.passes) > 0
        assert sum(t.active_s for t in counting.passes) < sum(t.wall_s for t in counting.passes)
        for timing in counting.passes:
            assert len(timing.step_s) == len(timing.hop_s) == len(timing.hop_bytes) == pp
            assert all(b > 0 for b in timing.hop_bytes) and all(h >= 0 for h in timing.hop_s)
            assert timing.wall_s >= max(timing.step_s[1:]) > 0
            assert len(timing.spans) == pp and all(end >= start for start, end in timing.spans)
        assert len(stages) == 8
        for parts in stages:
            assert [p.stage for p in parts] == list(range(pp))
            assert all(p.passes > 0 and p.busy_s > 0 and p.end >= p.start for p in parts)


@pytest.mark.skipif(not BLOCKQ, reason="no C compiler here: blockq is not built")
@pytest.mark.parametrize("fmt", [{"dtype": "float32", "quantization": "int4"}, {"quantization_kernel": "blockq_x2"}],
                         ids=["exact", "blockq_x2"])
def test_the_exact_mode_through_two_stages_gives_the_unsharded_exact_tokens(fmt: dict[str, str]) -> None:
    """--dtype float32 --quantization int4 (blockq's float path), and blockq's two int8 planes
    (--quantization-kernel blockq_x2, float32 around them): every stage serves it (stage 0 passes its kernel
    down; a stage that knew only one plane would refuse blockq_x2, or serve one), and the tokens are the
    unsharded engine's, solo and batched."""
    solo1, batched1 = asyncio.run(_outputs(1, fmt=fmt))
    assert batched1 == solo1
    solo2, batched2 = asyncio.run(_outputs(2, fmt=fmt))
    assert solo2 == solo1 and batched2 == solo1


@pytest.mark.skipif(usable_cores() < 2, reason="one core: nothing for a lone pass to add")
def test_a_lone_pass_runs_on_every_core_the_stages_share_idle_host_faked(monkeypatch) -> None:
    """One stream's passes go through the stages one after another, so each stage runs them at the
    threads both stages hold (2 here); passes that overlap (the batch queue, micro-batches) at each
    stage's own (1). The host's load at start is faked (the engine measures it): idle, and busy, where
    the passes start at each stage's share (the thread tuner then picks from their times). The thread counts change no token: the blockq kernel and the native
    attention are bit-identical across them."""
    from data_plane.shard.engines import torch_load

    async def run(busy: float | None, counting: _Counting) -> tuple[list[str], bool]:
        monkeypatch.setattr(torch_load.HostCpu, "others_busy", lambda self: busy)
        engine = TorchEngine(EngineConfig(max_num_seqs=4, max_model_len=512, threads=1, prefill_chunk=32,
                                          prefix_caching=False, pipeline_parallel_size=2), counting)
        await engine.start()
        try:
            solo = [await _generate(engine, i, p, max_tokens=16) for i, p in enumerate(PROMPTS)]
            await asyncio.gather(*(_generate(engine, i, p, max_tokens=16) for i, p in enumerate(PROMPTS)))
            return solo, engine.weight_plan.blockq
        finally:
            await engine.aclose()

    idle, busy = _Counting(), _Counting()
    solo, blockq = asyncio.run(run(0.0, idle))
    alone = [t for t in idle.passes if t.alone]
    overlapped = [t for t in idle.passes if t.in_flight > 1]
    assert alone and overlapped
    assert all(t.threads == (2, 2) and t.in_flight == 1 for t in alone)
    assert all(t.threads == (1, 1) for t in overlapped)
    solo_busy, _ = asyncio.run(run(1.5, busy))
    # a busy host starts at the share; the tuner may probe every core after a second of decode
    assert busy.passes and all(t.threads == (1, 1) and not t.alone for t in busy.passes[:10])
    if blockq:
        assert solo_busy == solo


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_frozen_stage_is_detected_in_about_a_second_and_the_shard_exits() -> None:
    shard = Service(["shard", *INVARIANT_ARGS, "--threads", "1", "--pipeline-parallel-size", "2",
                     "--max-model-len", "512"], ready_timeout=240)
    shard.start()
    try:
        metrics = scrape(shard.url)
        assert 'switchboard_shard_pipeline_stage_up{model_name="SmolLM2-135M-Instruct",stage="1"} 1.0' in metrics
        (stage,) = stage_pids(shard)
        t0 = time.monotonic()
        os.kill(stage, signal.SIGSTOP)
        code = exit_within(shard, 15)
        assert code == 1, shard.log_tail()
        assert time.monotonic() - t0 < 10
        assert "silent for" in shard.log_tail()
        deadline = time.monotonic() + 5
        while not _gone(stage) and time.monotonic() < deadline:  # the frozen stage was killed with the group
            time.sleep(0.1)
        assert _gone(stage)
    finally:
        shard.stop()


def test_killed_stage_mid_stream_every_stream_completes_as_uninterrupted() -> None:
    """kill -9 of the pipelined shard's stage 1 during 16 greedy streams through a gateway with two
    shards (one pipelined): 16/16 complete, each text equal to an uninterrupted run, and the
    pipelined shard exits (its supervisor would replace the group)."""
    from tests.support.chat import stream_all
    from tests.support.cluster import FP32_SHARD, static_shards

    with static_shards((*FP32_SHARD, "--pipeline-parallel-size", "2"), FP32_SHARD,
                       ready_timeout=240) as ((piped, _plain), gw):
        prompts = [f"Write a short story about a robot named Unit-{i} who learns to paint." for i in range(16)]
        reference = stream_all(gw.url, "SmolLM2-135M-Instruct", prompts, 32)
        (stage,) = stage_pids(piped)
        killed: list[bool] = []

        def kill_once(streams_started: int, chunks: int) -> None:
            if streams_started == len(prompts) and not killed:
                killed.append(True)
                os.kill(stage, signal.SIGKILL)

        got = stream_all(gw.url, "SmolLM2-135M-Instruct", prompts, 32, on_progress=kill_once)
        assert killed
        assert got == reference
        assert exit_within(piped, 15) == 1, piped.log_tail()
        assert "stage 1" in piped.log_tail()
        # the gateway counts those resumes under the loss's own reason (SwitchboardPipelineStageLostStreams)
        metrics = scrape(gw.url, timeout=10)
        resumed = [line for line in metrics.splitlines()
                   if line.startswith('switchboard_router_resumes_total{reason="pipeline_stage_lost"}')]
        assert resumed and float(resumed[0].split()[-1]) >= 1, metrics


def test_a_lone_pipelined_shard_losing_a_stage_ends_each_stream_with_a_clear_error() -> None:
    """kill -9 of stage 1 of the only shard, 4 streams open (the openai SDK): nowhere to resume, so each
    stream ends at once with an error the client can act on: `upstream_error`, saying the shard failed
    (it was the shard's word to the gateway, `overloaded` "the engine failed; retry on another shard");
    the next request is a 503 with Retry-After, not a hang; the shard's log says so without a traceback."""
    import openai

    from tests.support.chat import assert_openai_error, chat
    from tests.support.cluster import FP32_SHARD, KEYS, static_shards

    with static_shards((*FP32_SHARD, "--pipeline-parallel-size", "2"), ready_timeout=240) as ((piped,), gw):
        (stage,) = stage_pids(piped)
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=60)
        started: set[int] = set()

        async def one(i: int) -> dict | None:
            stream = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": f"Tell a long story, {i}."}],
                max_tokens=400, temperature=0, stream=True)
            try:
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        started.add(i)
                        if len(started) == 4 and not _gone(stage):
                            os.kill(stage, signal.SIGKILL)
            except openai.APIError as exc:
                return exc.body if isinstance(exc.body, dict) else {"message": exc.message}
            return None

        async def run() -> list[dict | None]:
            try:
                return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), 60)
            finally:
                await client.close()

        t0 = time.monotonic()
        errors = asyncio.run(run())
        assert time.monotonic() - t0 < 45
        for err in errors:
            assert err is not None, "a stream finished although its shard lost a stage"
            assert err["code"] == "upstream_error", err
            assert "failed" in err["message"] and "another shard" not in err["message"], err
        assert exit_within(piped, 15) == 1, piped.log_tail()
        assert_openai_error(chat(gw.url, max_tokens=4), 503)
        log = piped.log_tail(20_000)  # an expected event, told in a line each: no traceback for the operator
        assert "stage 1 exited (-9)" in log and "Traceback" not in log, log


def test_switchboard_up_starts_pipeline_groups_and_caps_stage_processes(tmp_path) -> None:
    from control_plane.launcher import UpSettings, local_max_shards, plan
    from data_plane.common.settings_cli import parse_settings
    from data_plane.shard.settings import ShardSettings

    _, _, shards, _ = plan(UpSettings(shards=2, pipeline_parallel_size=2), tmp_path, "admin", "cluster")
    (tmp_path / "session_keys").touch()  # `switchboard up` writes it before it starts a shard
    for shard in shards:  # the shard's own parser reads the flag
        assert parse_settings(ShardSettings, shard.args[1:], "switchboard shard").pipeline_parallel_size == 2
    # 16 cores at 2 threads a stage: 8 stage processes = 4 groups of 2, or 2 groups of 4.
    assert local_max_shards(UpSettings(autoscale=True, min_replicas=1, pipeline_parallel_size=2), 2, cores=16) == 4
    assert local_max_shards(UpSettings(autoscale=True, min_replicas=1, pipeline_parallel_size=4), 2, cores=16) == 2
    assert local_max_shards(UpSettings(autoscale=True, min_replicas=1), 2, cores=16) == 8
    cp, *_ = plan(UpSettings(autoscale=True, pipeline_parallel_size=2), tmp_path, "admin", "cluster")
    assert "--pipeline-parallel-size 2" in " ".join(cp.args)  # shards the autoscaler starts too


def test_bench_engine_runs_switchboard_per_pipeline_size_on_the_same_cores() -> None:
    from data_plane.bench.engine import make_system, parse_args
    from data_plane.bench.engine_systems import BenchConfig

    args = parse_args(["--systems", "switchboard,naive", "--pipeline-parallel-size", "1,2"])
    assert args.systems == ["switchboard", "switchboard@pp2", "naive"]
    config = BenchConfig(model=None, dtype="float32", max_tokens=8, concurrency=(1,), num_prompts=None,
                         max_prompt_len=64, threads=4)
    one, two = make_system("switchboard", config), make_system("switchboard@pp2", config)
    assert (one.engine.config.pipeline_parallel_size, one.engine.config.threads) == (1, 4)  # type: ignore[attr-defined]
    assert (two.engine.config.pipeline_parallel_size, two.engine.config.threads) == (2, 2)  # type: ignore[attr-defined]
    # before/after micro-batching in one run: one pass at a time, then as many in flight as stages
    args = parse_args(["--systems", "switchboard", "--pipeline-parallel-size", "1,2", "--pipeline-microbatches", "1,0"])
    assert args.systems == ["switchboard", "switchboard@pp2mb1", "switchboard@pp2"]
    one_pass = make_system("switchboard@pp2mb1", config)
    assert one_pass.engine.config.pipeline_microbatches == 1  # type: ignore[attr-defined]
    assert two.engine.config.pipeline_microbatches == 0  # type: ignore[attr-defined]
    # the batch queue off and on (plans in flight across steps), and the targets from the rows
    args = parse_args(["--systems", "switchboard", "--pipeline-parallel-size", "1,2", "--pipeline-batch-queue", "1,0"])
    assert args.systems == ["switchboard", "switchboard@pp2bq1", "switchboard@pp2"]
    no_queue = make_system("switchboard@pp2mb1bq1", config)
    assert no_queue.engine.scheduler.config.batch_queue == 1  # type: ignore[attr-defined]
    assert no_queue.engine.config.pipeline_microbatches == 1  # type: ignore[attr-defined]
    assert two.engine.scheduler.config.batch_queue == 2  # type: ignore[attr-defined]
    assert one.engine.scheduler.config.batch_queue == 1  # type: ignore[attr-defined]
    from data_plane.bench.engine_pipeline import pipeline_targets

    rows = [{"system": s, "concurrency": c, "output_tok_s": tok, "tpot_p50_ms": tpot, "pipeline_idle_share": idle}
            for s, c, tok, tpot, idle in [("switchboard", 1, 30.0, 30.0, None), ("switchboard", 16, 100.0, 150.0, None),
                                          ("switchboard@pp2", 1, 27.0, 33.0, [0.5, 0.5]),
                                          ("switchboard@pp2", 16, 80.0, 190.0, [0.1, 0.2])]]
    t = pipeline_targets(rows)["switchboard@pp2"]
    assert (t["concurrency"], t["tok_s_ratio"], t["tok_s_target_met"]) == (16, 0.8, False)
    assert (t["tpot_ratio"], t["tpot_target_met"], t["idle_share_top"]) == (1.1, True, [0.1, 0.2])


def test_prefix_cache_hits_through_two_stages() -> None:
    """Stage 0's prefix cache picks the blocks, each stage keeps its layers' part: a prompt asked
    again after another prompt overwrote the slot hits the cache and answers the same greedy tokens
    (a stage that did not load its part would attend to the other prompt's KV)."""
    async def ask(engine: TorchEngine, rid: str, prompt: str) -> tuple[str, int]:
        ids = engine.encode_chat([{"role": "user", "content": prompt}])
        text, cached = "", 0
        async for out in engine.generate(GenerationRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=16))):
            text += out.text
            cached = out.cached_tokens
        return text, cached

    async def run() -> list[tuple[str, int]]:
        # one slot: the second prompt (24 tokens in common, 51 + 16 in all) overwrites the first's KV there
        engine = TorchEngine(EngineConfig(**INVARIANT, max_num_seqs=1, max_model_len=512, threads=1,
                                          prefill_chunk=32, prefix_caching=True, pipeline_parallel_size=2))
        await engine.start()
        try:
            return [await ask(engine, f"p{i}", prompt) for i, prompt in enumerate((PROMPTS[2], PROMPTS[1], PROMPTS[2]))]
        finally:
            await engine.aclose()

    (first, cached_first), (_, _), (again, cached_again) = asyncio.run(run())
    assert cached_first == 0
    assert cached_again == 64  # the 68-token prompt's 4 full blocks (16 tokens each; one token left to compute)
    assert again == first
