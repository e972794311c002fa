"""Smoke tests for `switchboard bench`: each benchmark at tiny sizes, checking the JSON's shape.

    .venv/bin/python -m pytest tests/data_plane/test_bench.py -q      # ~30 s

These check that the benchmarks run and report what they promise, not any number.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from data_plane import bench
from data_plane.bench.common import RequestResult, closed_loop, finish, percentile, summarize
from data_plane.bench.serve import compute_metrics, parse_goodput
from tests.support.bench import ENGINE_ROW_KEYS, needs_model
from tests.support.cluster import Cluster
from tests.support.metrics import scrape
from tests.support.procs import CLUSTER_TOKEN, Service, switchboard

SERVE_KEYS = {
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput",
    *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")),
}


def test_percentiles_match_numpy_linear_interpolation() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == 99.0
    s = summarize([10.0, 20.0])
    assert s["mean"] == s["median"] == 15.0 and s["p99"] == pytest.approx(19.9)
    assert math.isnan(summarize([])["p99"])


async def test_closed_loop_never_exceeds_concurrency_and_keeps_order() -> None:
    import asyncio

    in_flight, peak = 0, 0

    async def one(i: int) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001 * (i % 3))
        in_flight -= 1
        return RequestResult(submitted=float(i))

    results = await closed_loop(list(range(10)), 3, one)
    assert peak == 3
    assert [r.submitted for r in results] == [float(i) for i in range(10)]


def test_goodput_counts_only_requests_meeting_every_slo() -> None:
    fast = RequestResult(submitted=0.0, first_token=0.1, finished=0.5, output_tokens=5)   # tpot 100 ms
    slow = RequestResult(submitted=0.0, first_token=0.9, finished=1.3, output_tokens=5)
    failed = RequestResult(submitted=0.0, error="HTTP 503: busy")
    m = compute_metrics([fast, slow, failed], 2.0, parse_goodput(["ttft:500", "tpot:150"]))
    assert (m["completed"], m["failed"], m["request_goodput"]) == (2, 1, 0.5)
    assert m["errors"] == {"HTTP 503: busy": 1}
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_finish_prints_the_summary_and_writes_nan_free_json(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    result = {"summary": {"hit_rate": 0.5}, "rows": [{"ttft": math.nan}]}
    finish(result, tmp_path / "logs", str(tmp_path / "out.json"))
    out = capsys.readouterr().out
    assert json.loads(out.split("logs in")[0]) == {"hit_rate": 0.5} and f"logs in {tmp_path / 'logs'}" in out
    assert json.loads((tmp_path / "out.json").read_text()) == {"summary": {"hit_rate": 0.5}, "rows": [{"ttft": None}]}
    finish(result, tmp_path, None, summary={"only": 1})  # an explicit summary; no file without --json
    assert json.loads(capsys.readouterr().out.split("logs in")[0]) == {"only": 1}


async def test_bench_tiers_reads_the_guarded_gateway_capacity_with_the_ups_metrics_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench tiers --keys-file .switchboard/credentials.json` reads the gateway's /metrics (guarded) with the
    metrics token beside the keys; a keys YAML falls back to this environment's tokens."""
    import httpx

    from data_plane.bench.tiers import gateway_capacity, load_scrape_headers

    def gateway(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer sb-metrics-x":
            return httpx.Response(401, json={"error": {"code": "invalid_metrics_token"}})
        return httpx.Response(200, text="switchboard_admission_capacity 8.0\n")

    creds = tmp_path / "credentials.json"
    creds.write_text(json.dumps({"keys": {"plus": "sk-1"}, "metrics_token": "sb-metrics-x"}))
    monkeypatch.delenv("SWITCHBOARD_METRICS_TOKEN", raising=False)
    monkeypatch.setenv("SWITCHBOARD_CLUSTER_TOKEN", "sb-cluster-y")
    assert load_scrape_headers(str(tmp_path / "keys.yaml")) == {"authorization": "Bearer sb-cluster-y"}
    async with httpx.AsyncClient(transport=httpx.MockTransport(gateway)) as client:
        assert await gateway_capacity(client, "http://gw", load_scrape_headers(str(creds))) == 8
        assert await gateway_capacity(client, "http://gw") is None


def test_help_and_unknown_subcommands() -> None:
    for sub in ("engine", "serve"):
        out = switchboard("bench", sub, "--help", timeout=30)
        assert out.returncode == 0 and f"switchboard bench {sub}" in out.stdout, out.stderr
    with pytest.raises(SystemExit) as exc:
        bench.main(["nope"])
    assert exc.value.code == 2


def test_bench_serve_refused_or_unreachable_is_one_line_and_exit_1() -> None:
    """A wrong --api-key or --url used to end in an httpx traceback (at model discovery), or, with
    --model, in a table of nan and exit code 0."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from tests.support.http_stub import serve_app
    from tests.support.procs import free_port

    refusing = FastAPI()

    @refusing.api_route("/{path:path}", methods=["GET", "POST"])
    async def refuse(path: str) -> JSONResponse:
        return JSONResponse({"error": {"message": "invalid API key", "type": "authentication_error",
                                       "param": None, "code": "invalid_api_key"}}, status_code=401)

    small = ("--num-prompts", "2", "--max-tokens", "4", "--timeout", "10")
    with serve_app(refusing) as url:
        found = switchboard("bench", "serve", "--url", url, "--api-key", "sk-wrong", *small, timeout=60)
        served = switchboard("bench", "serve", "--url", url, "--model", "m", *small, timeout=60)
    nothing = switchboard("bench", "serve", "--url", f"http://127.0.0.1:{free_port()}", *small, timeout=60)
    for out in (found, served, nothing):
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert found.stderr.strip() == (f"switchboard bench serve: {url}/v1/models answered 401: invalid API key; "
                                    "check --api-key")
    assert "failed x2: HTTP 401" in served.stdout
    assert served.stderr.strip().endswith("every request failed; see 'failed x' above")
    assert "cannot reach" in nothing.stderr and "check --url" in nothing.stderr


def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path) -> None:
    """`--json` in a folder that does not exist was found only at the end: the run's numbers were lost to
    a FileNotFoundError traceback, after minutes of benchmarking."""
    missing = tmp_path / "no-such-folder" / "out.json"
    for argv in (("serve", "--url", "http://127.0.0.1:9", "--json", str(missing)),
                 ("serve", "--url", "http://127.0.0.1:9", f"--json={missing}"),
                 ("serve", "--url", "http://127.0.0.1:9", "--json", str(tmp_path)),
                 ("tuner", "--json", str(missing))):
        out = switchboard("bench", *argv, "--max-tokens", "4", timeout=60) if argv[0] == "serve" else \
            switchboard("bench", *argv, timeout=60)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.strip().startswith(f"switchboard bench {argv[0]}: --json "), out.stderr
        assert "nothing was run" in out.stderr and "cannot reach" not in out.stderr
    assert not missing.parent.exists()


def test_bench_serve_against_a_synthetic_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "serve.json"
    with Service(["shard", "--engine", "synthetic"]) as shard:
        bench.main(["serve", "--url", shard.url + "/v1", "--api-key", CLUSTER_TOKEN, "--concurrency", "2",
                    "--num-prompts", "6", "--max-tokens", "8", "--goodput", "ttft:10000", "tpot:10000",
                    "--json", str(out)])
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TPOT (ms):" in printed
    result = json.loads(out.read_text())
    assert SERVE_KEYS <= result.keys()
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 6 * 8  # from usage: the synthetic engine fills max_tokens
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["config"]["model"] == "synthetic"


def test_bench_serve_compares_gateway_and_shard_in_one_run(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "compare.json"
    with Cluster(shards=1, caches=1, engine="synthetic", token_delay_ms=5) as c:
        bench.main(["serve", "--url", c.gateway.url, "--api-key", c.keys["plus"],
                    "--compare-url", c.shards[0].url + "/v1", "--compare-api-key", CLUSTER_TOKEN,
                    "--num-prompts", "3", "--max-tokens", "12",
                    "--rounds", "2", "--json", str(out)])
        metrics = scrape(c.gateway.url)
    printed = capsys.readouterr().out
    assert "A / B (same run):" in printed and "ttft_p50" in printed
    result = json.loads(out.read_text())
    assert SERVE_KEYS <= result["a"].keys() and SERVE_KEYS <= result["b"].keys()
    assert result["a"]["completed"] == result["b"]["completed"] == 2 * 3 and result["a"]["failed"] == 0
    assert result["ratios"]["ttft_p50"] == pytest.approx(
        result["a"]["median_ttft_ms"] / result["b"]["median_ttft_ms"])
    assert result["config"]["compare_url"].startswith("http://127.0.0.1")
    # the gateway observed the client's TTFT (first content byte) and the hold-back for each request
    # it served: 2 rounds x 3 plus the warm-up request
    for name in ("switchboard_gateway_ttft_seconds_count", "switchboard_gateway_output_holdback_seconds_count"):
        assert f'{name}{{tier="plus"}} 7.0' in metrics, name


@needs_model
def test_bench_engine_tiny(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    run = switchboard("bench", "engine", "--systems", "switchboard,naive", "--concurrency", "1",
                      "--max-tokens", "4", "--num-prompts", "2", "--json", str(out), timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "switchboard/naive" in run.stdout and "% of ceiling" in run.stdout
    result = json.loads(out.read_text())
    assert {"rows", "ratios", "bandwidth", "machine"} <= result.keys()
    rows = {r["system"]: r for r in result["rows"]}
    assert rows.keys() == {"switchboard", "naive"}
    # --dtype auto / --quantization auto (the defaults): each row says what they resolved to on this CPU
    from data_plane.model_store import model_source
    from data_plane.shard.engines.weight_source import CpuCaps, resolve_plan

    caps = CpuCaps.detect()
    plan = resolve_plan("auto", "auto", source=model_source(None).kind, caps=caps)
    served = {"switchboard": f"{plan.dtype}/{plan.quantization}" + ("+a8" if plan.blockq else ""),
              "naive": resolve_plan("auto", "none", source="dense", caps=caps).dtype}
    assert "MiB read/step" in run.stdout and f"CPU: {caps.summary()}" in run.stdout
    for name, row in rows.items():
        assert ENGINE_ROW_KEYS <= row.keys()
        assert (row["concurrency"], row["requests"], row["max_tokens"], row["dtype"]) == (1, 2, 4, served[name])
        assert row["output_tok_s"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0
    assert rows["naive"]["output_tokens"] == 2 * 4  # EOS ignored
    assert 0 < rows["switchboard"]["output_tokens"] <= 2 * 4
    assert result["ratios"]["switchboard/naive"]["1"] > 0
    assert result["bandwidth"]["copy_gb_s"] > 0
    assert 0 < result["bandwidth"]["systems"]["switchboard"]["pct_of_ceiling"]
