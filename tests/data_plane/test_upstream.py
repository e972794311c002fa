"""Upstream supervision on its own (data_plane/routing/upstream.py), over a scripted hop pool:
one retry on another shard before the first token, an error (the gateway's error event) after
it, never a second retry, 4xx passed through, and a mid-stream resume that continues the text.

    .venv/bin/python -m pytest tests/data_plane/test_upstream.py -q       # < 1 s

The pool hands out scripted responses in call order, so the tests assert on which shard each
attempt went to and how many attempts there were. No processes.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from data_plane.common.errors import NoHealthyBackend, SwitchboardError, UpstreamError
from data_plane.membership.view import Member, StaticMembership, routable
from data_plane.protocol import ShardRequest
from data_plane.routing.failures import CircuitState, FailureReason
from data_plane.routing.hop_client import HopConnectError, HopDisconnected
from data_plane.routing.router import EJECTION_REASONS, LATENCY_SPILL_REASONS, Router, RouterMetrics
from data_plane.routing.upstream import (
    RESUME_LEAVE_S,
    Delta,
    Finish,
    ToolCallDelta,
    Upstream,
    UpstreamConfig,
    UsageEvent,
)
from tests.support.clock import FakeClock


def token(text: str, completion: int | None = None) -> bytes:
    chunk: dict[str, Any] = {"choices": [{"delta": {"content": text}}]}
    if completion is not None:
        chunk["usage"] = {"prompt_tokens": 7, "completion_tokens": completion}
    return b"data: " + json.dumps(chunk).encode()


FINISH = b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}'
USAGE = b'data: {"usage": {"prompt_tokens": 7, "completion_tokens": 3}}'
ERROR_EVENT = b'data: {"error": {"message": "engine died", "type": "server_error", "param": null, "code": null}}'


class Response:
    """A HopResponse stand-in: `batches` are returned by successive lines() calls (an exception
    in the list is raised instead); after the last, end of stream."""

    def __init__(self, status: int = 200, batches: list[Any] | None = None, body: bytes = b"") -> None:
        self.status = status
        self._batches = list(batches or [])
        self._body = body
        self.closed = False

    def header(self, name: bytes) -> bytes | None:
        return None

    async def read(self, deadline: float = 0.0) -> bytes:
        return self._body

    async def lines(self, timeout: float = 0.0) -> list[bytes]:
        if not self._batches:
            return []
        item = self._batches.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def fail(self, error: Exception) -> None:
        self._batches = [error]

    def close(self) -> None:
        self.closed = True


class Pool:
    """Answers the n-th post with `script[n]` (a Response, or an exception to raise)."""

    def __init__(self, *script: Response | BaseException) -> None:
        self.script = list(script)
        self.posts: list[tuple[str, dict[str, Any]]] = []

    async def post(self, url: str, path: str, body: bytes, headers: dict[str, str] | None = None,
                   timeout: float = 0.0) -> Response:
        self.posts.append((url, json.loads(body)))
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


def upstream(pool: Pool, shards: int = 3, **config: Any) -> tuple[Upstream, CollectorRegistry]:
    registry = CollectorRegistry()
    members = [Member(f"s{i}", "shard", f"http://s{i}") for i in range(shards)]
    router = Router(StaticMembership(members), RouterMetrics(registry), policy="least_loaded",
                    rng=random.Random(3))
    return Upstream(router, pool, UpstreamConfig(**config)), registry


def count(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


BODY = ShardRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True})


async def drain(stream: Any) -> list[Any]:
    return [e async for batch in stream.batches() for e in batch]


# -- before the first token: one retry elsewhere ----------------------------------------------


@pytest.mark.parametrize("failure, reason", [
    (HopConnectError("refused"), "connect"),
    (Response(503, body=b'{"error": {"message": "busy", "type": "server_error", "code": "overloaded"}}'),
     "status_503"),
    (Response(200, [HopDisconnected("reset")]), "transport"),
    (Response(200, []), "empty_stream"),
    (Response(200, [[ERROR_EVENT]]), "stream_error_before_first_token"),
])
async def test_a_failure_before_the_first_token_is_retried_once_on_another_shard(failure: Any, reason: str) -> None:
    pool = Pool(failure, Response(200, [[token("Hello")], [FINISH]]))
    up, registry = upstream(pool)
    stream = await up.open(BODY, session_id=None)
    (first_url, _), (second_url, _) = pool.posts
    assert second_url != first_url and stream.member.url == second_url and stream.attempts == 2
    assert await drain(stream) == [Delta("Hello"), Finish("stop")]
    assert count(registry, "switchboard_router_retries_total", reason=reason) == 1
    assert count(registry, "switchboard_router_upstream_failures_total", reason=reason) == 1


async def test_a_second_failure_is_not_retried_again_and_the_last_error_is_raised() -> None:
    busy = b'{"error": {"message": "busy", "type": "server_error", "code": "overloaded"}}'
    pool = Pool(HopConnectError("refused"), Response(503, body=busy), Response(200, [[token("never")]]))
    up, registry = upstream(pool, shards=3)
    with pytest.raises(SwitchboardError) as raised:
        await up.open(BODY, session_id=None)
    assert len(pool.posts) == 2 and len({url for url, _ in pool.posts}) == 2  # the third shard is never asked
    assert raised.value.code == "overloaded"
    assert count(registry, "switchboard_router_retries_total", reason="connect") == 1
    assert count(registry, "switchboard_router_retries_total", reason="status_503") == 0


async def test_with_one_shard_a_failure_is_not_retried_on_the_same_shard() -> None:
    pool = Pool(HopConnectError("refused"), Response(200, [[token("never")]]))
    up, _ = upstream(pool, shards=1)
    with pytest.raises(NoHealthyBackend):
        await up.open(BODY, session_id=None)
    assert len(pool.posts) == 1


async def test_a_shards_4xx_is_the_requests_fault_passed_through_without_retry() -> None:
    bad = b'{"error": {"message": "max_tokens too large", "type": "invalid_request_error", "code": "bad"}}'
    pool = Pool(Response(400, body=bad), Response(200, [[token("never")]]))
    up, registry = upstream(pool)
    with pytest.raises(SwitchboardError) as raised:
        await up.open(BODY, session_id=None)
    assert raised.value.status == 400 and len(pool.posts) == 1
    assert count(registry, "switchboard_router_upstream_failures_total", reason="status_400") == 0


async def test_a_4xx_error_event_before_the_first_token_is_the_requests_fault_too() -> None:
    """A grammar no output completes is refused once the stream began: an invalid_request_error event."""
    bad = {"error": {"message": "the regex cannot be followed", "type": "invalid_request_error", "code": "invalid_grammar"}}
    pool = Pool(Response(200, [[b"data: " + json.dumps(bad).encode()]]), Response(200, [[token("never")]]))
    up, registry = upstream(pool)
    with pytest.raises(SwitchboardError) as raised:
        await up.open(BODY, session_id=None)
    assert raised.value.status == 400 and raised.value.code == "invalid_grammar" and len(pool.posts) == 1
    assert count(registry, "switchboard_router_upstream_failures_total", reason="stream_error_before_first_token") == 0


async def test_a_grammar_flood_is_the_requests_503_and_ejects_no_shard() -> None:
    """A shard whose grammar compiler is full (one tenant's distinct slow schemas) answers 503
    grammar_compiler_busy: the client gets it with Retry-After, and the shard stays in routing for
    everyone else's plain requests (counted as the shard's failure, three ejected every shard)."""
    busy = (b'{"error": {"message": "16 grammars are compiling on this shard; retry shortly", '
            b'"type": "server_error", "code": "grammar_compiler_busy"}}')
    pool = Pool(*[Response(503, body=busy) for _ in range(3)], Response(200, [[token("hi"), FINISH]]))
    up, registry = upstream(pool, shards=2)
    for _ in range(3):
        with pytest.raises(SwitchboardError) as raised:
            await up.open(BODY, session_id=None)
        assert raised.value.status == 503 and raised.value.code == "grammar_compiler_busy"
    assert len(pool.posts) == 3  # no retry elsewhere: every shard would say the same of this flood
    assert count(registry, "switchboard_router_upstream_failures_total", reason="status_503") == 0
    stream = await up.open(BODY, session_id=None)
    assert stream.member.id in ("s0", "s1")


# -- after the first token: an error, no retry -----------------------------------------------


async def test_a_stream_that_breaks_after_its_first_token_raises_and_is_not_retried() -> None:
    pool = Pool(Response(200, [[token("Hel")], [token("lo")], HopDisconnected("reset")]),
                Response(200, [[token("never")]]))
    up, registry = upstream(pool)
    stream = await up.open(BODY, session_id=None)
    seen: list[Any] = []
    with pytest.raises(UpstreamError):
        async for batch in stream.batches():
            seen += batch
    assert seen == [Delta("Hel"), Delta("lo")] and len(pool.posts) == 1
    assert count(registry, "switchboard_router_upstream_failures_total", reason="stream_broken") == 1
    assert count(registry, "switchboard_router_retries_total", reason="stream_broken") == 0


async def test_an_error_event_after_the_first_token_is_raised_after_the_tokens_before_it() -> None:
    pool = Pool(Response(200, [[token("Hel")], [token("lo"), ERROR_EVENT, token("never")]]))
    up, _ = upstream(pool)
    stream = await up.open(BODY, session_id=None)
    seen: list[Any] = []
    with pytest.raises(SwitchboardError, match="engine died"):
        async for batch in stream.batches():
            seen += batch
    assert seen == [Delta("Hel"), Delta("lo")] and len(pool.posts) == 1


# -- resumable: mid-stream failover continues the text ---------------------------------------


async def test_a_resumable_stream_continues_on_another_shard_with_the_text_so_far() -> None:
    pool = Pool(Response(200, [[token("Hel", 1)], [token("lo", 2)], HopDisconnected("reset")]),
                Response(200, [[token(" there", 1)], [FINISH], [USAGE]]))
    up, registry = upstream(pool)
    stream = await up.open_resumable(BODY, session_id=None)
    events = await drain(stream)
    # running usage is the request's own: 2 tokens before the break + 1 after (the gateway bills it if the
    # stream ends early), not the resumed shard's count
    assert events == [Delta("Hel", (7, 1)), Delta("lo", (7, 2)), Delta(" there", (7, 3)), Finish("stop"),
                      UsageEvent(7, 5)]
    (first_url, _), (second_url, resumed) = pool.posts
    assert second_url != first_url and stream.resumes == 1
    assert resumed["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert resumed["continue_final_message"] is True and resumed["max_tokens"] == 10 - 2
    assert BODY.wire() == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}
    assert resumed["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}  # copies, not edits
    assert count(registry, "switchboard_router_resumes_total", reason="stream_broken") == 1


async def test_a_resumed_streams_cached_tokens_never_exceed_the_requests_prompt() -> None:
    """The continuation's prompt holds the output sent before the break, and the shard's prefix cache can hit
    all of it: 9 cached on a continuation of a 7-token prompt was reported as is (QA: `cached_tokens` 48 beside
    `prompt_tokens` 46 after a shard was frozen mid-stream, in the client's usage and the ledger)."""
    resumed_usage = b'data: {"usage": {"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 9}}}'
    pool = Pool(Response(200, [[token("Hel", 1)], [token("lo", 2)], HopDisconnected("reset")]),
                Response(200, [[token(" there", 1)], [FINISH], [resumed_usage]]))
    up, _ = upstream(pool)
    events = await drain(await up.open_resumable(BODY, session_id=None))
    assert events[-1] == UsageEvent(7, 3, 7)
    # the first shard said what it served from its cache of the request's own prompt: that is kept
    first = json.loads(token("Hel", 1)[6:])
    first["usage"]["prompt_tokens_details"] = {"cached_tokens": 4}
    pool = Pool(Response(200, [[b"data: " + json.dumps(first).encode()], [token("lo", 2)], HopDisconnected("reset")]),
                Response(200, [[token(" there", 1)], [FINISH], [resumed_usage]]))
    up, _ = upstream(pool)
    events = await drain(await up.open_resumable(BODY, session_id=None))
    assert events[-1] == UsageEvent(7, 3, 4)


async def test_resumes_stop_at_the_configured_number() -> None:
    def broken(text: str) -> Response:
        return Response(200, [[token(text, 1)], HopDisconnected("reset")])

    pool = Pool(broken("a"), broken("b"), broken("c"), Response(200, [[token("never")]]))
    up, _ = upstream(pool, shards=4, resumes=2)
    stream = await up.open_resumable(BODY, session_id=None)
    with pytest.raises(UpstreamError):
        await drain(stream)
    assert len(pool.posts) == 3 and stream.resumes == 2


class Restarting:
    """A membership whose shards can leave and come back (a process killed, then restarted by `up`)."""

    def __init__(self, members: list[Member]) -> None:
        self.now = list(members)

    def members(self, service: str) -> list[Member]:
        return routable(self.now, service)


async def restart(membership: Restarting, shard: Member) -> None:
    """A lone shard's restart as membership sees it: its registration expires, then its new process registers
    under the same id."""
    await asyncio.sleep(0.4)
    membership.now = []
    await asyncio.sleep(0.6)
    membership.now = [shard]


async def test_a_lone_shard_dying_mid_stream_is_waited_for_and_the_stream_finishes_on_its_restart() -> None:
    """`up --shards 1 --pipeline-parallel-size 2`, a stage killed mid-stream: the supervisor restarted the
    group within seconds, but every open stream had already ended with upstream_error ("no other shard
    could continue it"). With resume_wait_s the resume waits for a shard; the dead one counts again once it
    left membership and came back (a new process)."""
    shard = Member("s0", "shard", "http://s0")
    membership = Restarting([shard])
    pool = Pool(Response(200, [[token("Hel", 1)], HopDisconnected("reset")]),
                Response(200, [[token("lo", 1)], [FINISH]]))
    router = Router(membership, RouterMetrics(CollectorRegistry()), policy="least_loaded", rng=random.Random(3))
    up = Upstream(router, pool, UpstreamConfig(resume_wait_s=10))

    restarting = asyncio.ensure_future(restart(membership, shard))
    stream = await up.open_resumable(BODY, session_id=None)
    events = await asyncio.wait_for(drain(stream), 10)
    await restarting
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "Hello"
    assert any(isinstance(e, Finish) for e in events) and stream.resumes == 1
    assert len(pool.posts) == 2 and pool.posts[1][1]["messages"][-1]["content"] == "Hel"

    # no shard back within the wait: the stream ends with the shard's failure, bounded by the wait
    pool = Pool(Response(200, [[token("Hel", 1)], HopDisconnected("reset")]))
    router = Router(Restarting([shard]), RouterMetrics(CollectorRegistry()), policy="least_loaded")
    up = Upstream(router, pool, UpstreamConfig(resume_wait_s=0.8))
    stream = await up.open_resumable(BODY, session_id=None)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamError):
        await asyncio.wait_for(drain(stream), 10)
    assert 0.5 <= asyncio.get_running_loop().time() - t0 < 5 and len(pool.posts) == 1
    # a shard that stays registered (an engine error, a cut link) is no restart: the wait ends within seconds
    pool = Pool(Response(200, [[token("Hel", 1)], [ERROR_EVENT]]))
    router = Router(Restarting([shard]), RouterMetrics(CollectorRegistry()), policy="least_loaded")
    up = Upstream(router, pool, UpstreamConfig(resume_wait_s=60))
    stream = await up.open_resumable(BODY, session_id=None)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(SwitchboardError):
        await asyncio.wait_for(drain(stream), 30)
    assert asyncio.get_running_loop().time() - t0 < RESUME_LEAVE_S + 2 and len(pool.posts) == 1


async def test_a_lone_shard_lost_before_the_first_token_is_waited_for_too() -> None:
    """QA through `up --shards 1`: the shard SIGSTOPped (or killed) while a request was queued or prefilling
    answered the client 504 "sent nothing ... for 2 s" (502/503 when killed), while a stream one token further
    on waited for the shard and finished. Nothing was sent yet, so with resume_wait_s the request waits as a
    resume does; a live shard's own failure (a 503) is answered at once, as before."""
    shard = Member("s0", "shard", "http://s0")
    membership = Restarting([shard])
    pool = Pool(HopConnectError("refused"), Response(200, [[token("Hi", 1)], [FINISH]]))
    router = Router(membership, RouterMetrics(CollectorRegistry()), policy="least_loaded", rng=random.Random(3))
    up = Upstream(router, pool, UpstreamConfig(resume_wait_s=10))

    restarting = asyncio.ensure_future(restart(membership, shard))
    body = BODY.model_copy(update={"request_id": "r1"})
    stream = await asyncio.wait_for(up.open_resumable(body, session_id=None), 10)
    events = await asyncio.wait_for(drain(stream), 10)
    await restarting
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "Hi" and len(pool.posts) == 2
    assert pool.posts[1][1]["messages"] == BODY.wire()["messages"]  # the request as it was: nothing to continue
    # under another id: a frozen shard that runs again may still hold the first attempt (duplicate_request_id)
    assert pool.posts[0][1]["request_id"] == "r1" and pool.posts[1][1]["request_id"].startswith("r1-retry")

    busy = b'{"error": {"message": "busy", "type": "server_error", "code": "overloaded"}}'
    up = Upstream(Router(Restarting([shard]), RouterMetrics(CollectorRegistry()), policy="least_loaded"),
                  Pool(Response(503, body=busy)), UpstreamConfig(resume_wait_s=60))
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(SwitchboardError):
        await up.open_resumable(BODY, session_id=None)
    assert asyncio.get_running_loop().time() - t0 < 1.0
    # a shard that stays registered is not restarting: its failure comes back within seconds, not the wait
    up = Upstream(Router(Restarting([shard]), RouterMetrics(CollectorRegistry()), policy="least_loaded"),
                  Pool(HopConnectError("refused")), UpstreamConfig(resume_wait_s=60))
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(NoHealthyBackend, match="could not connect"):
        await up.open_resumable(BODY, session_id=None)
    assert asyncio.get_running_loop().time() - t0 < 5.0


async def test_failure_labels_stay_bounded_whatever_the_shard_answers() -> None:
    """A remote status or error code never becomes a label: 507 is status_5xx, a mid-stream error
    event with the shard's own code resumes as stream_error."""
    odd = b'data: {"error": {"message": "x", "type": "server_error", "code": "my-own-code-123"}}'
    pool = Pool(Response(507, body=b'{"error": {"message": "full", "type": "server_error", "code": "disk_full"}}'),
                Response(200, [[token("Hel", 1)], [odd]]),
                Response(200, [[token("lo", 1)], [FINISH]]))
    up, registry = upstream(pool)
    stream = await up.open_resumable(BODY, session_id=None)
    await drain(stream)
    assert count(registry, "switchboard_router_upstream_failures_total", reason="status_5xx") == 1
    assert count(registry, "switchboard_router_resumes_total", reason="stream_error") == 1
    labels = {s.labels.get("reason") for m in registry.collect() for s in m.samples if "reason" in s.labels}
    # ejections: why it was ejected; latency spills: why a session left its shard
    assert labels <= {r.value for r in FailureReason} | set(EJECTION_REASONS) | set(LATENCY_SPILL_REASONS)


def test_a_shard_circuit_goes_closed_open_half_open_closed() -> None:
    registry = CollectorRegistry()
    clock = FakeClock(0.0)
    a, b = Member("a", "shard", "http://a"), Member("b", "shard", "http://b")
    router = Router(StaticMembership([a, b]), RouterMetrics(registry), policy="least_loaded", eject_after=2,
                    eject_s=5.0, clock=clock, rng=random.Random(1))
    router.report_failure(a, FailureReason.CONNECT)
    assert router.circuit_state("a") is CircuitState.CLOSED
    router.report_failure(a, FailureReason.CONNECT)
    assert router.circuit_state("a") is CircuitState.OPEN and router.pick(None).id == "b"
    clock.advance(5.0)
    assert router.pick(None).id == "a" and router.circuit_state("a") is CircuitState.HALF_OPEN  # the probe
    assert router.pick(None).id == "b"  # one probe at a time
    router.report_failure(a, FailureReason.TIMEOUT)  # the probe failed: open again, for twice as long
    assert router.circuit_state("a") is CircuitState.OPEN
    clock.advance(9.9)
    assert router.pick(None).id == "b"
    clock.advance(0.1)
    assert router.pick(None).id == "a"
    router.report_success(a)
    assert router.circuit_state("a") is CircuitState.CLOSED and not router.is_ejected("a")
    with pytest.raises(ValueError):
        router.report_failure(a, "status_418")  # type: ignore[arg-type]  # not a FailureReason


def call_delta(index: int, name: str | None = None, arguments: str = "", call_id: str | None = None) -> bytes:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if name is not None:
        call.update(id=call_id, type="function")
        call["function"]["name"] = name
    return b"data: " + json.dumps({"choices": [{"delta": {"tool_calls": [call]}}]}).encode()


async def test_a_tool_call_stream_resumes_with_its_envelope_so_far() -> None:
    """The shard sent parsed tool-call deltas: the resumed request continues the envelope they came from
    (compact, as the grammar writes it), and the second shard's deltas continue the call under way."""
    body = ShardRequest.model_validate({**BODY.wire(), "tools": [{"type": "function", "function": {"name": "get_weather"}}],
                                        "tool_choice": "required"})
    pool = Pool(Response(200, [[call_delta(0, "get_weather", call_id="call_a")], [call_delta(0, arguments='{"ci')],
                               HopDisconnected("reset")]),
                Response(200, [[call_delta(0, arguments='ty":"Paris"}')], [FINISH]]))
    up, _ = upstream(pool)
    stream = await up.open_resumable(body, session_id=None)
    events = await drain(stream)
    assert [e.arguments for e in events[:3]] == ["", '{"ci', 'ty":"Paris"}']
    assert events[0].id == "call_a" and events[0].name == "get_weather" and events[2].name is None
    (_, resumed) = pool.posts[1]
    assert resumed["messages"][-1] == {"role": "assistant",
                                       "content": '{"tool_calls":[{"name":"get_weather","arguments":{"ci'}
    assert resumed["continue_final_message"] is True


async def test_a_json_schema_stream_resumes() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    pool = Pool(Response(200, [[token('{"a":', 1)], HopDisconnected("reset")]),
                Response(200, [[token("1}", 1)], [FINISH]]))
    up, _ = upstream(pool)
    stream = await up.open_resumable(ShardRequest.model_validate({**BODY.wire(), "response_format": schema}),
                                     session_id=None)
    assert "".join(e.text for e in await drain(stream) if isinstance(e, Delta)) == '{"a":1}'
    assert pool.posts[1][1]["messages"][-1]["content"] == '{"a":'


def choice(index: int, text: str, completion: int, finish: str | None = None) -> bytes:
    chunk: dict[str, Any] = {"choices": [{"index": index, "delta": {"content": text}, "finish_reason": finish}],
                             "usage": {"prompt_tokens": 7, "completion_tokens": completion}}
    return b"data: " + json.dumps(chunk).encode()


async def test_several_choices_resume_each_from_its_own_text() -> None:
    """n=2, the shard dies with choice 1 finished and choice 0 half-way: choice 0 alone is continued (one
    choice, its own text, the tokens it has left), its events come back as index 0, and usage is the
    original prompt once with both choices' tokens; a choice that fails past the resumes ends the stream."""
    pool = Pool(Response(200, [[choice(0, "Hello", 1), choice(1, "Hi", 1)], [choice(1, " all", 2), choice(1, "", 2, "stop")],
                               HopDisconnected("reset")]),
                Response(200, [[token(" there", 1)], [FINISH], [USAGE]]))
    up, registry = upstream(pool)
    stream = await up.open_resumable(ShardRequest.model_validate({**BODY.wire(), "n": 2, "max_tokens": 10,
                                                                  "request_id": "r1"}), session_id=None)
    events = await drain(stream)
    text = {i: "".join(e.text for e in events if isinstance(e, Delta) and e.index == i) for i in (0, 1)}
    assert text == {0: "Hello there", 1: "Hi all"}
    assert sorted((e.index, e.reason) for e in events if isinstance(e, Finish)) == [(0, "stop"), (1, "stop")]
    (_, resumed) = pool.posts[1]
    assert len(pool.posts) == 2 and resumed["n"] == 1 and resumed["max_tokens"] == 9
    assert resumed["messages"][-1] == {"role": "assistant", "content": "Hello"} and resumed["continue_final_message"]
    assert resumed["request_id"].startswith("r1-lane0-retry")  # its own id: another choice may continue on the same shard
    assert events[-1] == UsageEvent(7, (1 + 3) + 2, 0)  # choice 0: 1 then 3 on the second shard; choice 1: 2
    assert [e.usage for e in events if isinstance(e, Delta) and e.index == 0] == [(7, 1), (7, 2)]
    assert count(registry, "switchboard_router_resumes_total", reason="stream_broken") == 1
    # past the resumes: the stream ends with the shard's failure (an error event), it never hangs
    pool = Pool(Response(200, [[choice(0, "a", 1), choice(1, "b", 1)], HopDisconnected("reset")]),
                Response(200, [[token("c", 1)], HopDisconnected("reset")]), Response(200, [[token("d", 1)]]),
                Response(200, [[token("e", 1)]]))
    up, _ = upstream(pool, resumes=1)
    stream = await up.open_resumable(ShardRequest.model_validate({**BODY.wire(), "n": 2, "max_tokens": 10}),
                                     session_id=None)
    with pytest.raises(UpstreamError):
        await asyncio.wait_for(drain(stream), 10)
    stream.close()
    assert [body["messages"][-1]["content"] for _, body in pool.posts[1:3]] == ["a", "b"]  # each its own text
    # a continuation whose shard sends an error event past the resumes: the stream ends with it
    pool = Pool(Response(200, [[choice(0, "a", 1), choice(1, "b", 1)], HopDisconnected("reset")]),
                Response(200, [[token("c", 1)], [ERROR_EVENT]]), Response(200, [[token("d", 1)], [ERROR_EVENT]]))
    up, _ = upstream(pool, resumes=1)
    stream = await up.open_resumable(ShardRequest.model_validate({**BODY.wire(), "n": 2, "max_tokens": 10}),
                                     session_id=None)
    with pytest.raises(SwitchboardError) as raised:
        await asyncio.wait_for(drain(stream), 10)
    assert "engine died" in raised.value.message
    stream.close()


async def test_a_choice_seeded_near_the_int64_limit_resumes() -> None:
    """Choice i of n samples with seed + i; a request seeded 2**63 - 1 sent its choice 1's lane seed 2**63,
    which the shard refuses (400: seed is an int64), so the choice could not continue. The lane's seed is
    wrapped into int64, the same seed modulo 2**64 (what the shard's draws mix: torch_sampling._mix)."""
    pool = Pool(Response(200, [[choice(0, "Hi", 1), choice(0, "", 1, "stop"), choice(1, "Hello", 1)],
                               HopDisconnected("reset")]),
                Response(200, [[token(" there", 1)], [FINISH], [USAGE]]))
    up, _ = upstream(pool)
    stream = await up.open_resumable(ShardRequest.model_validate({**BODY.wire(), "n": 2, "max_tokens": 10,
                                                                  "seed": 2**63 - 1}), session_id=None)
    await drain(stream)
    (_, resumed) = pool.posts[1]
    assert resumed["messages"][-1]["content"] == "Hello"
    assert resumed["seed"] == -(2**63) and (resumed["seed"] - 2**63) % 2**64 == 0
    ShardRequest.model_validate(resumed)  # what the shard validates: in range


# -- counting a prompt (POST /v1/responses/input_tokens): no stream, the same retry rules ------------


async def test_a_count_is_retried_once_elsewhere_and_a_4xx_is_the_requests_own() -> None:
    pool = Pool(HopConnectError("refused"), Response(200, body=b'{"object": "chat.input_tokens", "input_tokens": 42}'))
    up, registry = upstream(pool)
    assert await up.count(BODY, session_id=None) == 42
    (first_url, first), (second_url, _) = pool.posts
    assert second_url != first_url and first["messages"] == [{"role": "user", "content": "hi"}]
    assert count(registry, "switchboard_router_retries_total", reason="connect") == 1
    bad = b'{"error": {"message": "tools: bad", "type": "invalid_request_error", "param": "tools", "code": null}}'
    pool = Pool(Response(400, body=bad), Response(200, body=b'{"input_tokens": 1}'))
    up, registry = upstream(pool)
    with pytest.raises(SwitchboardError) as raised:
        await up.count(BODY, session_id=None)
    assert raised.value.status == 400 and raised.value.param == "tools" and len(pool.posts) == 1
    pool = Pool(Response(200, body=b"<html>"), Response(200, body=b"{}"))  # no count in either answer
    up, registry = upstream(pool)
    with pytest.raises(UpstreamError):
        await up.count(BODY, session_id=None)
    assert len(pool.posts) == 2 and count(registry, "switchboard_router_upstream_failures_total",
                                          reason="transport") == 2


def _stage_lost_event() -> bytes:
    return (b'data: {"error": {"message": "a pipeline stage of the shard failed", "type": "server_error", '
            b'"param": null, "code": "pipeline_stage_lost"}}')


async def test_a_stage_loss_is_counted_under_its_reason_and_the_client_reads_the_codes_it_always_did() -> None:
    """A pipelined shard that lost a stage ends its streams with `pipeline_stage_lost`, the gateway's word for
    its metrics (SwitchboardPipelineStageLostStreams): before the first token a failure under that reason,
    mid-stream a resume; the client never reads the new code: `overloaded` before the first token (retries
    spent), `upstream_error` mid-stream with nowhere to resume, `overloaded` after the finish."""
    up, registry = upstream(Pool(Response(200, [[_stage_lost_event()]])), shards=1)
    with pytest.raises(SwitchboardError) as before:
        await up.open(BODY, session_id=None)
    assert before.value.code == "overloaded" and "stage" in before.value.message
    assert count(registry, "switchboard_router_upstream_failures_total", reason="pipeline_stage_lost") == 1

    up, registry = upstream(Pool(Response(200, [[token("Hi", 1)], [_stage_lost_event()]])), shards=1)
    with pytest.raises(SwitchboardError) as mid:
        await drain(await up.open_resumable(BODY, session_id=None))
    assert mid.value.code == "upstream_error"

    up, registry = upstream(Pool(Response(200, [[token("Hi", 1)], [_stage_lost_event()]]),
                                 Response(200, [[token(" there", 2)], [FINISH]])), shards=2)
    assert await drain(await up.open_resumable(BODY, session_id=None))
    assert count(registry, "switchboard_router_resumes_total", reason="pipeline_stage_lost") == 1

    up, _ = upstream(Pool(Response(200, [[token("Hi", 1)], [FINISH], [_stage_lost_event()]])), shards=1)
    with pytest.raises(SwitchboardError) as after:
        await drain(await up.open_resumable(BODY, session_id=None))
    assert after.value.code == "overloaded"

    # n = 2: a resumed choice whole before the loss read the shard's own code (a 502 pipeline_stage_lost)
    pool = Pool(Response(200, [[choice(0, "a", 1), choice(1, "b", 1)], HopDisconnected("reset")]),
                Response(200, [[token("c", 1)], [FINISH], [_stage_lost_event()]]),
                Response(200, [[token("d", 1)], [FINISH]]))
    up, _ = upstream(pool)
    stream = await up.open_resumable(ShardRequest.model_validate({**BODY.wire(), "n": 2, "max_tokens": 10}),
                                     session_id=None)
    with pytest.raises(SwitchboardError) as lane:
        await asyncio.wait_for(drain(stream), 10)
    stream.close()
    assert lane.value.code == "overloaded", lane.value.code


async def test_a_token_sent_with_its_finish_reason_is_kept_as_vllm_sends_the_last_one() -> None:
    """vLLM (and other OpenAI-compatible servers standing as shards) send a choice's last token in the chunk
    that carries its finish_reason, with its logprobs; that chunk was read as the finish alone, so a vLLM
    shard's every reply lost its last token ("Paris." came back "Paris"), streamed or not, and a one-token
    reply came back empty. A tool call's last fragment beside the finish, and several calls in one delta,
    are kept the same way."""
    lp = {"token": ".", "logprob": -0.1, "bytes": [46], "top_logprobs": []}
    last = {"choices": [{"index": 0, "delta": {"content": "."}, "logprobs": {"content": [lp]},
                         "finish_reason": "stop", "stop_reason": None}]}
    pool = Pool(Response(200, [[token("Paris")], [b"data: " + json.dumps(last).encode()], [USAGE]]))
    up, _ = upstream(pool)
    events = await drain(await up.open(BODY, session_id=None))
    assert events == [Delta("Paris"), Delta(".", None, 0, (lp,)), Finish("stop"), UsageEvent(7, 3, 0)]

    only = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Yes"}, "finish_reason": "length"}]}
    pool = Pool(Response(200, [[b"data: " + json.dumps(only).encode()], [USAGE]]))
    up, _ = upstream(pool)
    assert await drain(await up.open(BODY, session_id=None)) == [Delta("Yes"), Finish("length"), UsageEvent(7, 3, 0)]

    calls = {"choices": [{"index": 0, "finish_reason": "tool_calls", "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '"}'}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]}
    opening = {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"a":"x'}}]}}]}
    pool = Pool(Response(200, [[b"data: " + json.dumps(opening).encode()], [b"data: " + json.dumps(calls).encode()]]))
    up, _ = upstream(pool)
    assert await drain(await up.open(BODY, session_id=None)) == [
        ToolCallDelta(0, "call_a", "f", '{"a":"x'), ToolCallDelta(0, None, None, '"}'),
        ToolCallDelta(1, "call_b", "f", "{}"), Finish("tool_calls")]


async def test_a_clients_continuation_resumes_as_one_assistant_message_with_the_text_after_it() -> None:
    """The client asked to continue its final assistant message (vLLM's continue_final_message): a resume
    continues that same message with the text sent since, never a second assistant message after it."""
    pool = Pool(Response(200, [[token(" Par", 1)], HopDisconnected("reset")]),
                Response(200, [[token("is.", 1)], [FINISH], [USAGE]]))
    up, _ = upstream(pool)
    body = ShardRequest.model_validate({
        "messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "It is"}],
        "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 10, "stream": True})
    events = await drain(await up.open_resumable(body, session_id=None))
    assert "".join(e.text for e in events if isinstance(e, Delta)) == " Paris."
    (_, first), (_, resumed) = pool.posts
    assert first["messages"][-1] == {"role": "assistant", "content": "It is"} and first["continue_final_message"]
    assert resumed["messages"] == [{"role": "user", "content": "Capital of France?"},
                                   {"role": "assistant", "content": "It is Par"}]
    assert resumed["continue_final_message"] is True and resumed["add_generation_prompt"] is False


async def test_a_live_shards_own_failure_beside_a_gone_one_is_answered_at_once() -> None:
    """Two shards, one killed (connection refused) and one that answers 503 overloaded: the request waited for a
    shard as if it were alone (resume_wait_s) and sent the overloaded shard the request again, held against it
    twice, where a live shard's own failure is answered at once."""
    busy = b'{"error": {"message": "busy", "type": "server_error", "code": "overloaded"}}'
    pool = Pool(HopConnectError("refused"), Response(503, body=busy), Response(503, body=busy))
    up, _ = upstream(pool, shards=2, resume_wait_s=60)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(SwitchboardError):
        await up.open_resumable(BODY, session_id=None)
    assert len(pool.posts) == 2 and asyncio.get_running_loop().time() - t0 < 1.0
