"""The Conversations API's writes under the key's rate limits (a synthetic shard, a cache node and a
gateway on loopback; no model is needed to store a conversation).

    .venv/bin/python -m pytest tests/data_plane/test_conversation_limits.py -q     # ~15 s

`conversations.create` and `conversations.items.create` store what they are sent in the cache nodes,
whose in-memory store is one LRU shared by every tenant. They took nothing from the key's RPM/TPM: one
free key stored ~45 conversations a second, up to 1 MiB each, and evicted every tenant's conversations
and stored responses within seconds. Each now takes one request and its items' tokens, as a turn that
sent them would. So does `responses.input_tokens.count` (one request, no tokens): a shard encodes
what it is sent, and 200 counts in a row passed a 60 RPM key; and `responses.compact`. A turn of a conversation takes what can
reach the shard, at most the context window, not the whole history its window slides over.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.support.cluster import cache_node
from tests.support.metrics import metric
from tests.support.procs import Service

KEYS = {"free": "sk-convlim-free-0123456789", "plus": "sk-convlim-plus-0123456789",
        "free2": "sk-convlim-free2-0123456789", "long": "sk-convlim-long-0123456789",
        "roomy": "sk-convlim-roomy-0123456789", "free3": "sk-convlim-free3-0123456789",
        "free4": "sk-convlim-free4-0123456789"}
TIERS = {"tiers": {
    "free": {"priority": 2, "rpm": 3, "tpm": 20000, "max_context_tokens": 2048, "max_output_tokens": 256,
             "replication": 1, "shed_order": 0},
    "plus": {"priority": 1, "rpm": 600, "tpm": 600, "max_context_tokens": 2048, "max_output_tokens": 256,
             "replication": 1, "shed_order": 1},
    "long": {"priority": 1, "rpm": 600, "tpm": 3000, "max_context_tokens": 512, "max_output_tokens": 64,
             "replication": 1, "shed_order": 2},
    "roomy": {"priority": 1, "rpm": 600, "tpm": 1_000_000, "max_context_tokens": 2048, "max_output_tokens": 64,
              "replication": 1, "shed_order": 3},
}}
HEADERS = [f"x-ratelimit-{what}-{kind}" for kind in ("requests", "tokens") for what in ("limit", "remaining", "reset")]


@pytest.fixture(scope="module")
def shard() -> Iterator[Service]:
    with Service(["shard", "--engine", "synthetic"]) as synthetic:
        yield synthetic


@contextmanager
def gateway_on(shard: Service, state: Path, *cache_args: str) -> Iterator[Service]:
    """A gateway in front of `shard`, with a cache node of its own started with `cache_args`."""
    (state / "tiers.yaml").write_text(yaml.safe_dump(TIERS))
    keys = ",".join(f"{key}:acme-{name}:{name.rstrip('0123456789')}" for name, key in KEYS.items())
    cache = cache_node(*cache_args).start()
    try:
        with Service(["gateway", "--shard-urls", shard.url, "--cache-urls", cache.url, "--tokenizer", "whitespace",
                      "--model-name", "synthetic", "--tiers-file", str(state / "tiers.yaml"),
                      "--state-dir", str(state), "--usage-db", "off"],
                     env={"SWITCHBOARD_GATEWAY_API_KEYS": keys}) as gw:
            yield gw
    finally:
        cache.stop()


@pytest.fixture(scope="module")
def gateway(shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with gateway_on(shard, tmp_path_factory.mktemp("conversation-limits")) as gw:
        yield gw


def sdk(gateway: Service, tier: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEYS[tier], max_retries=0, timeout=30)


def test_creating_conversations_takes_from_the_keys_rpm(gateway: Service) -> None:
    client = sdk(gateway, "free")
    for _ in range(3):
        raw = client.conversations.with_raw_response.create(items=[{"role": "user", "content": "hi"}])
        assert raw.status_code == 200 and all(h in raw.headers for h in HEADERS), raw.headers
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
    with pytest.raises(openai.RateLimitError) as refused:
        client.conversations.create(items=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "rate_limit_exceeded" and int(refused.value.response.headers["retry-after"]) >= 1


def test_the_items_stored_take_from_the_keys_tpm(gateway: Service) -> None:
    client = sdk(gateway, "plus")
    conv = client.conversations.create(items=[{"role": "user", "content": "word " * 100}])
    raw = client.conversations.items.with_raw_response.create(conv.id, items=[{"role": "user", "content": "hi"}])
    assert raw.status_code == 200 and int(raw.headers["x-ratelimit-remaining-tokens"]) < 600 - 100
    big = [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "word " * 400}]
    with pytest.raises(openai.RateLimitError):  # more than the key's whole TPM: never stored
        client.conversations.create(items=big)
    with pytest.raises(openai.RateLimitError):
        client.conversations.items.create(conv.id, items=big)
    assert len(client.conversations.items.list(conv.id).data) == 2


def test_counting_input_tokens_takes_a_request_from_the_keys_rpm(gateway: Service) -> None:
    client = sdk(gateway, "free2")
    for _ in range(3):
        raw = client.responses.input_tokens.with_raw_response.count(model="synthetic", input="hello there")
        assert raw.status_code == 200 and raw.parse().input_tokens > 0
        assert raw.headers["x-ratelimit-limit-requests"] == "3" and all(h in raw.headers for h in HEADERS)
    with pytest.raises(openai.RateLimitError) as refused:
        client.responses.input_tokens.count(model="synthetic", input="hello there")
    assert int(refused.value.response.headers["retry-after"]) >= 1


def test_compacting_takes_a_request_from_the_keys_rpm(gateway: Service) -> None:
    client = sdk(gateway, "free3")
    items = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]
    for _ in range(3):
        raw = client.responses.with_raw_response.compact(model="synthetic", input=items)
        assert raw.status_code == 200 and raw.parse().output, raw.text
        assert raw.headers["x-ratelimit-limit-requests"] == "3" and all(h in raw.headers for h in HEADERS)
    with pytest.raises(openai.RateLimitError) as refused:
        client.responses.compact(model="synthetic", input=items)
    assert int(refused.value.response.headers["retry-after"]) >= 1


def test_a_turn_of_a_long_conversation_reserves_at_most_the_context_window(gateway: Service) -> None:
    """With truncation "auto" a turn sends the window, not the history, so the key's TPM is asked for no more
    than the context: the whole history was reserved, and a free key's conversation past ~20k tokens was
    "Request too large ... needs 21224 tokens but the limit is 20000" on every turn, for good (QA)."""
    client = sdk(gateway, "long")  # TPM 3000, a 512-token context
    turn = [{"role": "user", "content": "word " * 1000}, {"role": "assistant", "content": "ok"}]
    conv = client.conversations.create(items=turn)
    client.conversations.items.create(conv.id, items=turn)  # ~2000 of the key's 3000 tokens gone
    raw = client.responses.with_raw_response.create(model="synthetic", input="hi", conversation=conv.id,
                                                    truncation="auto", max_output_tokens=16)
    reply = raw.parse()
    assert raw.status_code == 200 and reply.status in ("completed", "incomplete"), raw.text
    assert reply.usage is not None and reply.usage.input_tokens <= 512
    assert len(client.conversations.items.list(conv.id, limit=100).data) == 6



TURN: list[Any] = [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]


def _filled_conversation(client: openai.OpenAI) -> tuple[Any, openai.BadRequestError]:
    """A conversation grown by 300-word turns (TURN) until its cache node refuses the next: it and that 400."""
    conv = client.conversations.create(items=TURN)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as full:
        for _ in range(20):
            client.conversations.items.create(conv.id, items=TURN)  # type: ignore[arg-type]
    assert full.value.code == "record_too_large", full.value
    return conv, full.value

def test_a_conversation_past_what_a_cache_node_holds_is_a_400_that_says_so(
        shard: Service, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every turn rewrites the whole conversation; once its record passed a cache node's --max-body-bytes, each
    items.create and each turn was the node's 413 "request body exceeds 4194304 bytes", which the client reads
    as its own (QA: a 40 KB items.create, a 1-word turn after its whole generation)."""
    with gateway_on(shard, tmp_path_factory.mktemp("small-store"), "--max-body-bytes", "16384") as gw:
        client = sdk(gw, "roomy")
        conv, full = _filled_conversation(client)
        assert "too large to store" in full.message, full
        with pytest.raises(openai.BadRequestError) as turn_refused:
            client.responses.create(model="synthetic", input="hi", conversation=conv.id, max_output_tokens=4,
                                    truncation="auto")
        assert turn_refused.value.code == "record_too_large"
        events = list(client.responses.create(model="synthetic", input="hi", conversation=conv.id,
                                              max_output_tokens=4, truncation="auto", stream=True))
        error = next(e for e in events if e.type == "error")
        assert error.code == "record_too_large" and events[-1].type == "response.failed"
        assert client.conversations.retrieve(conv.id).id == conv.id  # what was stored stays


def test_a_turn_whose_record_is_known_not_to_fit_is_refused_before_it_generates(
        shard: Service, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A turn whose conversation, with its input, is already past what its cache node stores ran its whole
    generation (shard time, the key's tokens) before the 400 record_too_large. The node's limit known (its 413
    says it, a registered node advertises it), a turn whose history and input alone cannot be stored is the 400
    at once, streamed or not, and a background one too; a turn that fits still runs."""
    with gateway_on(shard, tmp_path_factory.mktemp("full-store"), "--max-body-bytes", "16384") as gw:
        client = sdk(gw, "roomy")
        conv, _ = _filled_conversation(client)
        generated = metric(shard.url, "vllm:request_success_total")
        long_input = "word " * 400
        for extra in ({}, {"background": True}):
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.create(model="synthetic", input=long_input, conversation=conv.id, max_output_tokens=4,
                                        truncation="auto", **extra)
            assert refused.value.code == "record_too_large" and "would be" in refused.value.message, refused.value
        with pytest.raises(openai.BadRequestError) as streamed:
            client.responses.create(model="synthetic", input=long_input, conversation=conv.id, max_output_tokens=4,
                                    truncation="auto", stream=True)
        assert streamed.value.code == "record_too_large"
        assert metric(shard.url, "vllm:request_success_total") == generated  # no shard time spent on any
        small = client.conversations.create(items=TURN)  # one that fits still runs
        assert client.responses.create(model="synthetic", input=long_input, conversation=small.id, truncation="auto",
                                       max_output_tokens=4).status in ("completed", "incomplete")


def test_conversation_updates_and_item_deletes_take_from_the_keys_rpm(gateway: Service) -> None:
    """Every other call that writes a conversation took a request from the key's RPM; a metadata update and an
    item delete took nothing, and with no x-ratelimit-* headers: a key could rewrite a large record on every
    replica as fast as the gateway answered. Each takes one request now (429 + Retry-After beyond)."""
    client = sdk(gateway, "free4")  # 3 RPM
    conv = client.conversations.create(items=[{"role": "user", "content": "hi"}, {"role": "user", "content": "yo"}])
    raw = client.conversations.with_raw_response.update(conv.id, metadata={"topic": "a"})
    assert raw.status_code == 200 and raw.parse().metadata == {"topic": "a"}
    assert raw.headers["x-ratelimit-remaining-requests"] == "1" and all(h in raw.headers for h in HEADERS)
    first = client.conversations.items.list(conv.id).data[0].id
    raw = client.conversations.items.with_raw_response.delete(first, conversation_id=conv.id)
    assert raw.status_code == 200 and raw.parse().id == conv.id and raw.headers["x-ratelimit-remaining-requests"] == "0"
    for call in (lambda: client.conversations.update(conv.id, metadata={"topic": "b"}),
                 lambda: client.conversations.items.delete(first, conversation_id=conv.id)):
        with pytest.raises(openai.RateLimitError) as refused:
            call()
        assert refused.value.code == "rate_limit_exceeded" and int(refused.value.response.headers["retry-after"]) >= 1
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "a"}  # the refused update changed nothing


def test_counting_a_conversation_longer_than_a_shard_reads_counts_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A count sends the whole untruncated conversation to a shard; past the shard's --max-body-bytes it was the
    shard's 413 "request body exceeds 1048576 bytes" for a 50-byte request (QA: a 4 MB conversation). The
    gateway's tokenizer counts it then, as it counts create's window."""
    with Service(["shard", "--engine", "synthetic", "--max-body-bytes", "4096"]) as small, \
            gateway_on(small, tmp_path_factory.mktemp("count-large")) as gw:
        client = sdk(gw, "roomy")
        turn = [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]
        conv = client.conversations.create(items=turn)
        counted = client.responses.input_tokens.count(model="synthetic", input="hi", conversation=conv.id)
        assert 300 < counted.input_tokens < 400  # by the shard: the body fits
        client.conversations.items.create(conv.id, items=turn * 3)
        raw = client.responses.input_tokens.with_raw_response.count(model="synthetic", input="hi", conversation=conv.id)
        assert raw.status_code == 200, raw.text
        assert 4 * 300 < raw.parse().input_tokens < 4 * 400


def test_record_limits_prefer_what_a_node_advertises_and_forget_what_they_learnt() -> None:
    """A registered node's advertised --max-body-bytes is its limit; a node listed by URL is known by its last
    413 (the limit it states, else less than the write it refused) for a while only: a restart may raise it."""
    import time as clock

    from data_plane.cache.client_values import RecordLimits
    from data_plane.common.errors import InvalidRequest
    from data_plane.membership.view import Member

    class Refusal:
        def __init__(self, said: bytes | None) -> None:
            self.said = said

        def header(self, name: bytes) -> bytes | None:
            return self.said if name == b"x-max-body-bytes" else None

    listed, registered = Member("a", "cache", "http://a"), Member("b", "cache", "http://b", {"max_body_bytes": "9000"})
    limits = RecordLimits()
    assert limits.limit(listed) is None and limits.limit(registered) == 9000
    limits.check([listed], 10**6, lambda: 10**7)  # unknown: the write will say
    limits.refused("a", 20000, Refusal(b"16384"))  # type: ignore[arg-type]
    limits.refused("b", 20000, Refusal(None))  # type: ignore[arg-type]
    assert limits.limit(listed) == 16384 and limits.limit(registered) == 9000
    limits.check([listed], 100, lambda: 10**7)  # far below: not even sized
    with pytest.raises(InvalidRequest) as e:
        limits.check([listed, registered], 9000, lambda: 16385)
    assert e.value.code == "record_too_large" and "16385 bytes, over the 16384" in e.value.message
    limits._refused["a"] = (16384, clock.monotonic() - RecordLimits.LEARNED_S - 1)
    assert limits.limit(listed) is None
