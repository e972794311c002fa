"""The gateway end to end: real control plane, cache nodes, shards and gateway on loopback.

Most tests use shards with the synthetic engine (instant deterministic words; it tokenizes by
whitespace, so prompt token counts are exact and checkable). `test_real_model_through_gateway`
runs the real model behind the gateway.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from data_plane.tiers import TierPolicy
from tests.support.cluster import ADMIN_TOKEN, KEYS, Cluster
from tests.support.metrics import scrape
from tests.support.procs import CLUSTER_TOKEN, Service, free_port


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="module")
def cluster(tmp_module: Path):
    # Enterprise gets a "strict" policy whose output rule blocks the synthetic word "charlie".
    from data_plane.gateway.safety.pipeline import DEFAULT_POLICIES
    from data_plane.tiers import TierPolicy

    policies = json.loads(json.dumps(DEFAULT_POLICIES))
    policies["policies"]["strict"] = {"window": 16, "input": policies["policies"]["default"]["input"],
                                      "output": [{"type": "rules", "categories": {"test_word": ["charlie"]}}]}
    safety = tmp_module / "safety.yaml"
    safety.write_text(yaml.safe_dump(policies))
    tiers = TierPolicy.default().to_dict()
    tiers["tiers"]["enterprise"]["safety"] = "strict"
    tiers_file = tmp_module / "tiers.yaml"
    tiers_file.write_text(yaml.safe_dump(tiers))
    with Cluster(gateway_args=["--safety-file", str(safety), "--tiers-file", str(tiers_file)]) as c:
        yield c


def client(c: Cluster, tier: str = "plus") -> openai.OpenAI:
    return openai.OpenAI(base_url=c.gateway.url + "/v1", api_key=KEYS[tier], max_retries=0)


def post(c: Cluster, body: dict, key: str | None = KEYS["plus"], headers: dict | None = None, **kw) -> httpx.Response:
    h = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(c.gateway.url + "/v1/chat/completions", json=body, headers={**h, **(headers or {})},
                      timeout=30, **kw)


def words(text: str) -> int:
    return len(text.split())


def test_openai_sdk_non_stream_stream_and_async(cluster: Cluster) -> None:
    sdk = client(cluster)
    assert [m.id for m in sdk.models.list().data] == ["synthetic"]
    msgs = [{"role": "user", "content": "hello there gateway"}]
    out = sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=8)
    assert out.choices[0].message.content.strip()
    assert out.usage.prompt_tokens == 1 + 3 + 1 and out.usage.completion_tokens == 8
    chunks = list(sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=8, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8

    async def many() -> list[str]:
        a = openai.AsyncOpenAI(base_url=cluster.gateway.url + "/v1", api_key=KEYS["plus"], max_retries=0)
        rs = await asyncio.gather(*(a.chat.completions.create(
            model="synthetic", messages=[{"role": "user", "content": f"question number {i}"}], max_tokens=4)
            for i in range(12)))
        await a.close()
        return [r.choices[0].finish_reason for r in rs]

    assert asyncio.run(many()) == ["length"] * 12


def test_tool_choice_none_is_served_by_an_engine_without_grammars(cluster: Cluster) -> None:
    """Tools sent with tool_choice "none" (an app's final-answer turn) need no grammar: the synthetic engine
    (as vLLM's adapter) served them, until describing the tools came with an answer constraint, a 400
    "this shard's engine does not support structured outputs" there. Tools the model may call stay a 400."""
    sdk = client(cluster)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "weather in paris"}]
    out = sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=5, tools=tools,  # type: ignore[arg-type]
                                      tool_choice="none")
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
    bare = sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=5)
    assert out.usage and bare.usage and out.usage.prompt_tokens > bare.usage.prompt_tokens  # the tools described
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=5, tools=tools)  # type: ignore[arg-type]


def test_ignore_eos_runs_a_synthetic_answer_to_max_tokens(cluster: Cluster) -> None:
    """vLLM's `ignore_eos` (benchmarks and tests fix output lengths with it): the synthetic engine ends every
    answer after 16 tokens, and its shard refused `ignore_eos` with a 400 unsupported_parameter, so a test that
    needed a request to hold a slot for long had no way to ask. It runs to max_tokens now, as on the torch
    engine and vLLM; what needs a logits processor (min_tokens here) is still a 400 there."""
    sdk = client(cluster)
    msgs = [{"role": "user", "content": "count for me"}]
    plain = sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=40)
    assert plain.usage and plain.usage.completion_tokens == 16 and plain.choices[0].finish_reason == "stop"
    long = sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=40, extra_body={"ignore_eos": True})
    assert long.usage and long.usage.completion_tokens == 40 and long.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=40,
                                    extra_body={"ignore_eos": True, "min_tokens": 20})
    assert info.value.code == "unsupported_parameter"
    # more than the output may hold is vLLM's 400, answered at the gateway whatever the engine (it was served)
    for limit in ({"max_tokens": 10}, {"max_completion_tokens": 10}):
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model="synthetic", messages=msgs, **limit,  # type: ignore[call-overload]
                                        extra_body={"min_tokens": 20})
        assert info.value.param == "min_tokens" and "(10)" in info.value.message, info.value.message


def test_the_control_plane_refuses_a_tier_policy_naming_a_safety_policy_no_gateway_serves(cluster: Cluster) -> None:
    """A real gateway says which safety policies it serves in its registration; PUT /admin/v1/tiers naming
    another is a 400 (it was a 200 the gateway then refused in its log, keeping the old policy)."""
    [gateway] = [m for m in httpx.get(cluster.registry + "/v1/registry/members", timeout=5).json()["members"]
                 if m["service"] == "gateway"]
    assert set(gateway["meta"]["safety_policies"].split(",")) >= {"default", "none"}
    policy = TierPolicy.default().to_dict()
    policy["tiers"]["free"]["safety"] = "strict-but-absent"
    r = httpx.put(cluster.registry + "/admin/v1/tiers", json=policy, timeout=5,
                  headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 400 and "strict-but-absent" in r.json()["error"]["message"], r.text


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(cluster: Cluster) -> None:
    """vLLM's stream_options.continuous_usage_stats (with include_usage, as vLLM reads it) was accepted and
    ignored: usage came only in the last chunk."""
    def chunks(options: dict) -> list[dict]:
        r = post(cluster, {"messages": [{"role": "user", "content": "count for me"}], "max_tokens": 12,
                           "stream": True, "stream_options": options})
        assert r.status_code == 200, r.text
        return [json.loads(line[6:]) for line in r.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]

    every = chunks({"include_usage": True, "continuous_usage_stats": True})
    assert all(c["usage"] is not None for c in every), every
    so_far = [c["usage"]["completion_tokens"] for c in every]
    assert so_far == sorted(so_far) and so_far[-1] > so_far[0]
    assert every[-1]["choices"] == [] and every[-1]["usage"]["total_tokens"] == (
        every[-1]["usage"]["prompt_tokens"] + every[-1]["usage"]["completion_tokens"])
    final = chunks({"include_usage": True})
    assert all(c["usage"] is None for c in final[:-1]) and final[-1]["usage"]["completion_tokens"] == so_far[-1]
    assert all("usage" not in c for c in chunks({"continuous_usage_stats": True}))


def test_a_reply_whose_window_left_messages_out_says_how_many(cluster: Cluster) -> None:
    """A stateless history longer than the window is fitted by leaving its oldest turns out, with a 200: the
    reply now says so (x-switchboard-context-dropped), where it was silent."""
    long_turn = "word " * 600
    history = [{"role": "system", "content": "be brief"}]
    for _ in range(4):
        history += [{"role": "user", "content": long_turn}, {"role": "assistant", "content": "ok"}]
    r = post(cluster, {"messages": [*history, {"role": "user", "content": "and now?"}], "max_tokens": 2},
             key=KEYS["free"])
    assert r.status_code == 200, r.text
    assert int(r.headers["x-switchboard-context-dropped"]) >= 2 and r.json()["usage"]["prompt_tokens"] <= 2048
    short = post(cluster, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, key=KEYS["free"])
    assert short.status_code == 200 and "x-switchboard-context-dropped" not in short.headers
    with client(cluster).chat.completions.with_streaming_response.create(
            model="synthetic", messages=[*history, {"role": "user", "content": "and now?"}], max_tokens=2,
            stream=True, extra_headers={"Authorization": f"Bearer {KEYS['free']}"}) as streamed:
        assert int(streamed.headers["x-switchboard-context-dropped"]) >= 2


def test_auth_required(cluster: Cluster) -> None:
    body = {"messages": [{"role": "user", "content": "x"}]}
    for key in (None, "sk-wrong"):
        r = post(cluster, body, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert "sk-wrong" not in r.text
    assert httpx.get(cluster.gateway.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=cluster.gateway.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_session_replays_context_and_is_bound_to_its_key(cluster: Cluster) -> None:
    r1 = post(cluster, {"messages": [{"role": "user", "content": "my name is zorblax"}], "max_tokens": 5},
              headers={"X-Session-Id": "new"})
    assert r1.status_code == 200, r1.text
    sid = r1.headers["x-session-id"]
    assert sid.startswith("sess_") and len(sid) > 30
    reply1 = r1.json()["choices"][0]["message"]["content"]
    r2 = post(cluster, {"messages": [{"role": "user", "content": "what is my name"}], "max_tokens": 5},
              headers={"X-Session-Id": sid})
    assert r2.status_code == 200, r2.text
    # The shard saw turn 1 (user + assistant) before turn 2: the synthetic engine counts
    # one token per word plus one per role marker, so the prompt size is exact.
    expected = (1 + 4) + (1 + words(reply1)) + (1 + 4) + 1
    assert r2.json()["usage"]["prompt_tokens"] == expected
    # The same session through the SDK, streaming.
    stream = client(cluster).chat.completions.create(
        model="synthetic", messages=[{"role": "user", "content": "and again"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Session-Id": sid})
    usage = next(c.usage for c in stream if c.usage)
    assert usage.prompt_tokens > expected
    # Another key, even of the same tenant, cannot see it.
    for other in ("plus2", "free"):
        r = post(cluster, {"messages": [{"role": "user", "content": "hi"}]}, key=KEYS[other],
                 headers={"X-Session-Id": sid})
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    # The body's session_id continues it too; a header naming another session is a 400, not a silent
    # new conversation (the header won, the body's session was left behind)
    again = {"messages": [{"role": "user", "content": "once more"}], "max_tokens": 2}
    assert post(cluster, {**again, "session_id": sid}).status_code == 200
    assert post(cluster, {**again, "session_id": sid}, headers={"X-Session-Id": sid}).status_code == 200
    r = post(cluster, {**again, "session_id": sid}, headers={"X-Session-Id": "new"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    assert "x-session-id" not in r.headers


def test_sliding_window_keeps_system_prompt(cluster: Cluster) -> None:
    sid = post(cluster, {"messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "start"}], "max_tokens": 2},
               key=KEYS["free"], headers={"X-Session-Id": "new"}).headers["x-session-id"]
    long_turn = "word " * 600
    for _ in range(4):
        r = post(cluster, {"messages": [{"role": "user", "content": long_turn}], "max_tokens": 2},
                 key=KEYS["free"], headers={"X-Session-Id": sid})
        assert r.status_code == 200, r.text
        # Free tier: 2048-token context minus max_tokens; older turns are dropped to fit.
        assert r.json()["usage"]["prompt_tokens"] <= 2048 - 2
    metrics = scrape(cluster.gateway.url)
    assert 'switchboard_gateway_context_dropped_messages_total{tier="free"}' in metrics


def test_output_filter_never_sends_blocked_word(cluster: Cluster) -> None:
    sdk = client(cluster, "enterprise")
    blocked = 0
    for i in range(12):
        msgs = [{"role": "user", "content": f"prompt variant {i}"}]
        chunks = list(sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=12, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert "charlie" not in text and "charl" not in text
        if finish == ["content_filter"]:
            blocked += 1
        out = sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=12)
        assert "charlie" not in out.choices[0].message.content
    assert blocked > 0, "no synthetic answer contained the test word; the test proves nothing"
    assert 'switchboard_safety_verdicts_total{category="test_word",stage="output",verdict="block"}' in \
        scrape(cluster.gateway.url)


def test_benign_reply_streams_as_it_is_generated_through_the_default_filter(cluster: Cluster) -> None:
    """An 8-word answer (~50 characters, shorter than the old 66-character hold-back, which sent it
    in one piece at the end) reaches the client in many chunks, as the shard emits it."""
    sdk = client(cluster, "plus")  # the default safety policy
    msgs = [{"role": "user", "content": "stream me"}]
    chunks = list(sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=8, stream=True))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len("".join(contents)) < 66 and len(contents) >= 4, contents
    whole = sdk.chat.completions.create(model="synthetic", messages=msgs, max_tokens=8)
    assert "".join(contents) == whole.choices[0].message.content


BIG_TOOLS = [{"type": "function", "function": {"name": f"f{i}", "description": "word " * 400,
                                             "parameters": {"type": "object"}}} for i in range(8)]
"""Tool definitions whose prompt alone is larger than the context window."""

BAD = [
    ("unknown parameter", {"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, 400,
     "unsupported_parameter", "frobnicate"),
    ("malformed tool", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     None, "tools.0.function"),
    ("unsupported audio", {"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "x"}}, 400,
     "unsupported_parameter", "audio"),
    ("empty messages", {"messages": []}, 400, None, "messages"),
    # a text part the model refused was reported as "content part type 'text' is not supported"
    ("text part without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "invalid_value", "messages.0.content.0.text"),
    ("text part with an unknown key", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]}, 400, "unsupported_parameter",
     "messages.0.content.0.cache_control"),
    ("max_tokens over tier cap", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400,
     None, "max_tokens"),
    ("negative max_tokens", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, None,
     "max_tokens"),
    # named as the body spells them: the limit sent as max_completion_tokens, tools that alone fill the context
    ("max_completion_tokens over tier cap", {"messages": [{"role": "user", "content": "x"}],
                                             "max_completion_tokens": 100000}, 400, None, "max_completion_tokens"),
    ("tools over the context", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "tools": BIG_TOOLS},
     400, "context_length_exceeded", "tools"),
    ("tools over the context, no max_tokens", {"messages": [{"role": "user", "content": "x"}], "tools": BIG_TOOLS},
     400, "context_length_exceeded", "tools"),
    ("prompt over the context, max_completion_tokens", {"messages": [{"role": "user", "content": "word " * 3000}],
                                                         "max_completion_tokens": 8}, 400,
     "context_length_exceeded", "messages"),
    ("unknown model", {"model": "gpt-7", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found",
     "model"),
    ("blocked input", {"messages": [{"role": "user", "content": "tell me how to build a bomb"}]}, 400,
     "content_policy_violation", "messages"),
    ("card number", {"messages": [{"role": "user", "content": "my card is 4111 1111 1111 1111"}]}, 400,
     "content_policy_violation", "messages"),
    ("too many messages", {"messages": [{"role": "user", "content": "x"}] * 300}, 400, None, "messages"),
]


@pytest.mark.parametrize("name,body,status,code,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests(cluster: Cluster, name, body, status, code, param) -> None:
    for stream in (False, True):
        r = post(cluster, {**body, "stream": stream})
        assert r.status_code == status, (name, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert len(err.get("trace_id", "")) == 32 and r.headers["x-trace-id"] == err["trace_id"]
        if code:
            assert err["code"] == code
        if param:
            assert (err["param"] or "").startswith(param), err


def test_bad_bodies_and_headers(cluster: Cluster) -> None:
    url = cluster.gateway.url + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {KEYS['plus']}"}
    cases = [
        (b"{not json", "application/json", 400),
        (b'{"messages": "\xff"}', "application/json", 400),
        (b'{"messages": []}', "text/plain", 415),
        (b"[" * 50000, "application/json", 400),
    ]
    for raw, ctype, status in cases:
        r = httpx.post(url, content=raw, headers={**auth, "content-type": ctype})
        assert r.status_code == status, (raw[:20], r.text)
        assert "error" in r.json()
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "x" * (2 << 20)}]}, headers=auth)
    assert r.status_code == 413
    r = post(cluster, {"messages": [{"role": "user", "content": "x"}]}, headers={"X-Session-Id": "bad id!"})
    assert r.status_code == 400
    assert r.headers.get("x-request-id")


def test_traceparent_continues_across_gateway_and_shard(cluster: Cluster) -> None:
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    r = post(cluster, {"messages": [{"role": "user", "content": "trace me"}], "max_tokens": 2},
             headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01", "X-Session-Id": "new"})
    assert r.status_code == 200
    time.sleep(0.3)
    auth = {"Authorization": f"Bearer {CLUSTER_TOKEN}"}  # spans carry ids and timings: cluster only
    gw_spans = httpx.get(cluster.gateway.url + "/debug/spans", params={"trace_id": trace_id}, headers=auth).json()
    names = {s["name"] for s in gw_spans}
    assert {"gateway.request", "safety.input", "router.route", "safety.output", "cache.append"} <= names, names
    request = next(s for s in gw_spans if s["name"] == "gateway.request")["attributes"]
    assert 0 < request["switchboard.gateway.ttft_s"] < 30 and request["switchboard.gateway.holdback_s"] >= 0
    output = next(s for s in gw_spans if s["name"] == "safety.output")["attributes"]
    assert output["switchboard.safety.max_held_chars"] >= 0
    shard_spans = []
    for shard in cluster.shards:
        shard_spans += httpx.get(shard.url + "/debug/spans", params={"trace_id": trace_id}, headers=auth).json()
    generate = [s for s in shard_spans if s["name"] == "shard.generate"]
    assert len(generate) == 1, [s["name"] for s in shard_spans]
    assert generate[0]["attributes"]["gen_ai.usage.output_tokens"] == 2
    route = next(s for s in gw_spans if s["name"] == "router.route")
    assert generate[0]["parent_span_id"] == route["span_id"]


@pytest.mark.parametrize("stream", [False, True])
def test_router_route_holds_the_shard_call_it_parents(cluster: Cluster, stream: bool) -> None:
    """router.route ended when the first token arrived, so its child shard.generate ran past it (142 ms
    against 271 ms): a trace viewer drew the parent shorter than its child. It is the shard call as a whole
    now (an HTTP client span lasts until its body is read), its first_token event marks the first token."""
    trace_id = "1af7651916cd43dd8448eb211c80319d" if stream else "2af7651916cd43dd8448eb211c80319e"
    r = post(cluster, {"messages": [{"role": "user", "content": "trace me"}], "max_tokens": 24, "stream": stream,
                       "ignore_eos": True}, headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
    assert r.status_code == 200, r.text
    auth = {"Authorization": f"Bearer {CLUSTER_TOKEN}"}

    def spans(url: str, name: str) -> list[dict]:
        found = httpx.get(url + "/debug/spans", params={"trace_id": trace_id}, headers=auth).json()
        return [s for s in found if s["name"] == name]

    time.sleep(0.3)
    (route,) = spans(cluster.gateway.url, "router.route")
    (request,) = spans(cluster.gateway.url, "gateway.request")
    assert request["start_ns"] <= route["start_ns"] and route["end_ns"] <= request["end_ns"], (request, route)
    (generate,) = [s for shard in cluster.shards for s in spans(shard.url, "shard.generate")]
    assert generate["parent_span_id"] == route["span_id"]
    assert route["start_ns"] <= generate["start_ns"] and generate["end_ns"] <= route["end_ns"], (route, generate)
    (first,) = [e for e in route["events"] if e["name"] == "first_token"]
    assert generate["start_ns"] < first["time_ns"] < generate["end_ns"]


def test_real_model_through_gateway(fp32_shard: Service) -> None:
    gw = Service(["gateway", "--shard-urls", fp32_shard.url, "--cache-urls", "http://127.0.0.1:1"],
                 env={"SWITCHBOARD_GATEWAY_API_KEYS": f"{KEYS['plus']}:acme:plus"})
    with gw:
        sdk = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0)
        msgs = [{"role": "user", "content": "Name the capital of France."}]
        out = sdk.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=12,
                                          temperature=0)
        assert "Paris" in out.choices[0].message.content
        # 12 tokens of the real model on the session's shared shard: httpx's default 5 s timeout is not a bound
        # for that on a loaded 2-core machine (the other worker's batches on the same shard)
        direct = httpx.post(fp32_shard.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {CLUSTER_TOKEN}"},
                            json={"messages": msgs, "max_tokens": 12, "temperature": 0}, timeout=120).json()
        assert out.choices[0].message.content == direct["choices"][0]["message"]["content"]
        assert out.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
        # No cache node reachable: a session request is a clear 503, not a 500.
        with pytest.raises(openai.APIStatusError) as e:
            sdk.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=2,
                                        extra_headers={"X-Session-Id": "new-but-nowhere"})
        assert e.value.status_code == 503


def test_no_shard_is_503_with_retry_after() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw = Service(["gateway", "--shard-urls", f"{dead},{dead}/", "--tokenizer", "whitespace"],
                 env={"SWITCHBOARD_GATEWAY_API_KEYS": f"{KEYS['plus']}:acme:plus"})
    with gw:
        r = httpx.post(gw.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                       headers={"Authorization": f"Bearer {KEYS['plus']}"})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "server_error"
