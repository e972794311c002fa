"""The stepped sliding window through a real gateway and the real model (the session's fp32 shard):
one chat, its whole history resent each turn, outgrows a small context (a 256-token tier), and the
turns after the window's first trim are served from the shard's prefix cache while its cut stays
put (`usage.prompt_tokens_details.cached_tokens`), where the exact window (--context-trim-step 0)
re-prefills nearly every prompt past the system prompt (docs/BENCHMARKS.md, "One long chat through
the full stack"). The gateway's `switchboard_gateway_context_slides_total{cut}` tells the two apart.

    .venv/bin/python -m pytest tests/data_plane/test_trim_steps.py -q      # ~1 min on 2 cores (in make test: the end-to-end proof of the stepped window)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.cluster import KEYS
from tests.support.metrics import metric
from tests.support.procs import Service

BLOCK = 16
"""The shard's KV block (data_plane/shard/engines/kv_cache.py DEFAULT_BLOCK_SIZE): hits are whole blocks."""
CONTEXT = 256
"""Was 384 over 26 turns: 71 s of an AVX2 host's suite under load, most of it the exact window's re-prefills."""
STEP = "0.4"
"""The stepped window's step, a share of the context: ~100 tokens, a cut that stays put ~3 turns of ~30 tokens
(at 0.25 of 256 it moved every other turn, and the test wants most turns past the first trim to keep it)."""
TIERS = {"tiers": {"plus": {"priority": 1, "rpm": 6000, "tpm": 2_000_000, "max_context_tokens": CONTEXT,
                            "max_output_tokens": 64, "replication": 1, "shed_order": 0}}}
THINGS = ("river", "bird", "tree", "color", "fruit", "planet", "metal", "tool", "song", "city", "boat", "stone")
TURNS = 18


@pytest.fixture(scope="module")
def tiers_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trim") / "tiers.yaml"
    path.write_text(yaml.safe_dump(TIERS))
    return path


def gateway(shard: Service, tiers_file: Path, step: str) -> Service:
    return Service(["gateway", "--shard-urls", shard.url, "--cache-urls", "http://127.0.0.1:1",
                    "--tiers-file", str(tiers_file), "--context-trim-step", step],
                   env={"SWITCHBOARD_GATEWAY_API_KEYS": f"{KEYS['plus']}:acme:plus"})


@dataclass(frozen=True)
class Turn:
    kept: bool
    """The window dropped turns and its cut is the previous turn's (the gateway's cut="kept")."""
    moved: bool
    """The window dropped turns and its cut moved (cut="moved")."""
    prompt: int
    cached: int


def chat(gw: Service, label: str) -> list[Turn]:
    """One long chat (its system prompt names `label`, so two runs share no KV block past the first):
    per turn, whether the window dropped turns, whether its cut moved, and the usage."""
    messages = [{"role": "system", "content": f"You are a terse assistant for run {label}."}]
    turns = []
    for t in range(TURNS):
        messages.append({"role": "user", "content": f"Turn {t}: name one {THINGS[t % len(THINGS)]}, briefly."})
        slides = {cut: metric(gw.url, "switchboard_gateway_context_slides_total", cut=cut) for cut in ("kept", "moved")}
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, headers={"authorization": f"Bearer {KEYS['plus']}"},
                       json={"messages": messages, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        now = {cut: metric(gw.url, "switchboard_gateway_context_slides_total", cut=cut) for cut in ("kept", "moved")}
        turns.append(Turn(now["kept"] > slides["kept"], now["moved"] > slides["moved"], body["usage"]["prompt_tokens"],
                          body["usage"]["prompt_tokens_details"]["cached_tokens"]))
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return turns


def past_the_first_trim(turns: list[Turn]) -> list[tuple[Turn, Turn]]:
    """(previous turn, turn) for each turn after the first whose window dropped turns."""
    first = next(i for i, t in enumerate(turns) if t.kept or t.moved)
    assert first <= TURNS // 2, "the chat must outgrow the window sooner: make its turns longer"
    return list(zip(turns[first:], turns[first + 1:]))


def test_turns_past_the_window_hit_the_prefix_cache_while_the_stepped_cut_stays(fp32_shard: Service,
                                                                               tiers_file: Path) -> None:
    with gateway(fp32_shard, tiers_file, STEP) as gw:
        stepped = past_the_first_trim(chat(gw, "stepped"))
    with gateway(fp32_shard, tiers_file, "0") as gw:
        exact = past_the_first_trim(chat(gw, "exact"))
    kept = [(before, t) for before, t in stepped if t.kept]
    assert len(kept) >= 0.6 * len(stepped), stepped
    for before, t in kept:  # the previous turn's whole prompt starts this one: each of its full blocks hits
        assert t.cached >= before.prompt // BLOCK * BLOCK, (before, t)
    for _, t in stepped:
        assert t.kept or t.moved
        if t.moved:
            assert t.cached < 3 * BLOCK, t  # only the system prompt's blocks
    # the exact window: nearly every turn moves its cut and misses past the system prompt
    assert sum(t.moved for _, t in exact) >= 0.8 * len(exact), exact
    assert sum(t.cached < 3 * BLOCK for _, t in exact) >= 0.8 * len(exact), exact
