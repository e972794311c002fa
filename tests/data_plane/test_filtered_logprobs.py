"""Logprobs under the output safety filter: each entry names its token, so an entry goes out only with
the text it stands for (data_plane/gateway/stream.py). Real processes: the session's fp32 shard, a cache
node and a gateway whose output rule blocks a word of the model's greedy reply.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_filtered_logprobs.py -q
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from data_plane.gateway.safety.pipeline import DEFAULT_POLICIES
from tests.support.chat import sdk
from tests.support.cluster import gateway_before
from tests.support.procs import Service

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
BLOCKED = "Fils"
"""A word of the greedy reply to ASK (the batch-invariant shard's: "L'Étoile, la Cité, le Roi, le Fils, le
Coeur, ..."), blocked by the gateway's output rule."""


@pytest.fixture(scope="module")
def gateway(fp32_shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    state: Path = tmp_path_factory.mktemp("filtered-logprobs")
    policies: dict[str, Any] = yaml.safe_load(yaml.safe_dump(DEFAULT_POLICIES))
    policies["policies"]["default"]["output"] = [{"type": "rules", "categories": {"test_word": [BLOCKED]}}]
    (state / "safety.yaml").write_text(yaml.safe_dump(policies))
    with gateway_before(fp32_shard, state, args=["--safety-file", str(state / "safety.yaml")]) as gw:
        yield gw


def test_logprobs_never_carry_the_text_the_output_filter_holds_or_blocks(gateway: Service) -> None:
    """The filter held a reply's text back while it could still become a blocked phrase, and then cut it, but
    the logprobs of the same tokens went out at once: with `logprobs: true` the blocked word (and the rest
    of the reply after it) reached the client as `token`, `bytes` and `top_logprobs`, streamed or not, with
    finish_reason content_filter. Now an entry goes out once its whole token is in the released text: what is
sent spells the content, but for a token only partly released (" Fils" after "le ")."""
    client = sdk(gateway)
    ask: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 0, "logprobs": True,
                           "top_logprobs": 2}
    whole = client.chat.completions.create(**ask)
    choice = whole.choices[0]
    assert choice.finish_reason == "content_filter", choice.message.content  # else the reply lacks the word: the test proves nothing
    entries = choice.logprobs.content
    assert choice.message.content.encode().startswith(b"".join(bytes(e.bytes) for e in entries)) and entries
    assert BLOCKED not in "".join(e.token for e in entries) + choice.message.content

    text, finish = "", None
    streamed: list[Any] = []
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            streamed += (chunk.choices[0].logprobs.content or []) if chunk.choices[0].logprobs else []
            # every entry so far stands for text already sent
            assert text.encode().startswith(b"".join(bytes(e.bytes) for e in streamed))
            finish = chunk.choices[0].finish_reason or finish
    assert (finish, text) == ("content_filter", choice.message.content)
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_logprobs_of_an_unblocked_reply_are_all_sent(gateway: Service) -> None:
    """Held entries are released with the text they stand for, the last ones with the reply's end: an
    unblocked reply's logprobs are complete, streamed or not, a multibyte character's partial tokens
    included."""
    client = sdk(gateway)
    ask: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello in Japanese."}],
                           "max_tokens": 12, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(**ask)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens or whole.choices[0].finish_reason == "stop"
    streamed = [e for chunk in client.chat.completions.create(**ask, stream=True) if chunk.choices
                and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content or []]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in entries]
    assert b"".join(bytes(e.bytes) for e in entries).decode(errors="replace").startswith(whole.choices[0].message.content)
