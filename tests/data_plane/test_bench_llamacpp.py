"""`switchboard bench engine --systems llamacpp,llamacpp-lookup`: llama.cpp plain and with its
prompt-lookup draft on the same GGUF (skipped where llama-cpp-python is not installed: it is not a
project dependency, it builds from source in ~8-19 min here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from data_plane.bench.engine import SYSTEMS, parse_args
from tests.support.bench import ENGINE_ROW_KEYS, needs_model
from tests.support.procs import switchboard

needs_llamacpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                    reason="llama-cpp-python is not installed (pip install llama-cpp-python)")


def test_the_lookup_system_is_on_the_default_list() -> None:
    args = parse_args([])
    assert "llamacpp-lookup" in args.systems and "llamacpp-lookup" in SYSTEMS


@pytest.mark.slow
@needs_model
@needs_llamacpp
def test_llamacpp_plain_and_prompt_lookup_in_one_run(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    run = switchboard("bench", "engine", "--systems", "llamacpp,llamacpp-lookup", "--workload", "quote",
                      "--concurrency", "1", "--max-tokens", "16", "--num-prompts", "2", "--json", str(out),
                      timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert not result["skipped"], result["skipped"]
    rows = {r["system"]: r for r in result["rows"]}
    assert rows.keys() == {"llamacpp", "llamacpp-lookup"}
    for row in rows.values():
        assert ENGINE_ROW_KEYS <= row.keys()
        assert row["output_tokens"] == 2 * 16  # EOS ignored: exactly max-tokens each
    assert result["ratios"]["llamacpp-lookup/llamacpp"]["1"] > 0


def test_the_build_command_fits_the_cpu() -> None:
    from data_plane.bench.engine_llamacpp import build_command

    assert build_command(frozenset({"avx2", "fma"})) == "MAKEFLAGS=-j2 nice pip install llama-cpp-python diskcache"
    amx = build_command(frozenset({"avx512f", "amx_tile", "amx_bf16"}))
    assert amx.startswith('CMAKE_ARGS="-DGGML_NATIVE=OFF') and "-DGGML_AMX_TILE=OFF" in amx


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed")
def test_without_llama_cpp_the_bench_says_how_to_build_it() -> None:
    from data_plane.bench.engine_llamacpp import LlamaCppSystem
    from data_plane.bench.engine_systems import Skip

    with pytest.raises(Skip, match="not installed.*pip install llama-cpp-python diskcache"):
        LlamaCppSystem(parse_args([]))  # type: ignore[arg-type]
