"""The grammar compiler's pool under a flood: a compile that timed out keeps its worker until it ends
(a thread cannot be stopped), so distinct grammars queued or running are bounded per worker and one
more is a 503 at once, not a wait behind every slow one; when they end the compiler takes work again.

    .venv/bin/python -m pytest tests/data_plane/test_grammar_compiler.py -q      # ~2 s
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from data_plane.common.errors import Overloaded
from data_plane.shard.engines.grammar import (
    PENDING_PER_WORKER,
    GrammarCompiler,
    GrammarError,
    GrammarKind,
    GrammarLimits,
    GrammarSpec,
)


def test_distinct_compiles_past_the_bound_are_refused_at_once_until_the_pool_drains() -> None:
    release = threading.Event()
    outcomes: list[str] = []

    class Listener:
        def on_grammar_compile(self, kind: str, seconds: float, outcome: str) -> None:
            outcomes.append(outcome)

    # Every compile waits for the llguidance tokenizer, whose build holds the one worker: a stuck pool.
    compiler = GrammarCompiler.lazy(lambda: release.wait(30) and None, workers=1, listener=Listener(),
                                    limits=GrammarLimits(compile_timeout_s=0.1))

    async def flood() -> None:
        for i in range(PENDING_PER_WORKER):
            with pytest.raises(GrammarError, match="longer than"):
                await compiler.compile(GrammarSpec(GrammarKind.REGEX, f"a{i}"))
        with pytest.raises(Overloaded) as refused:  # at once: not a wait for the 0.1 s compile timeout
            await compiler.compile(GrammarSpec(GrammarKind.REGEX, "another"))
        assert refused.value.retry_after == 1 and refused.value.code == "grammar_compiler_busy"
        assert outcomes == ["timeout"] * PENDING_PER_WORKER + ["busy"]
        # Naming a refused tool checks its parts in the same pool: a full pool answers "not known", queues nothing.
        assert await compiler.refusal(GrammarSpec(GrammarKind.REGEX, "a part")) is None
        assert len(compiler._jobs) == PENDING_PER_WORKER
        release.set()  # the tokenizer arrives (here: none, so each queued compile fails and ends)
        for _ in range(200):
            if not compiler._jobs:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(Exception) as compiled:  # taken again: built (and failed: no real tokenizer), not busy
            await compiler.compile(GrammarSpec(GrammarKind.REGEX, "after"))
        assert not isinstance(compiled.value, Overloaded) and outcomes.count("busy") == 1

    try:
        asyncio.run(flood())
    finally:
        release.set()
        compiler.close()
