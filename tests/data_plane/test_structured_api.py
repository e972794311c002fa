"""Structured outputs, tools and the sampling parameters through a whole cluster (gateway, router, one real
torch shard in float32, a cache node), driven by the clients applications use: the openai SDK (`parse`,
streamed `parse`, tools streamed and not), instructor (TOOLS, JSON_SCHEMA), LangChain
(`with_structured_output`, `bind_tools`), the OpenAI Agents SDK (Chat Completions model, a function tool
and an output type) and guidellm's fixed-length synthetic benchmark (it sends vLLM's `ignore_eos`).

    .venv/bin/python -m pytest tests/data_plane/test_structured_api.py -q      # ~3 min (real model)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from pydantic import BaseModel, Field

from tests.support.cluster import KEYS, Cluster
from tests.support.formats import INVARIANT_ARGS
from tests.support.guidellm import run_guidellm
from tests.support.metrics import scrape
from tests.support.schemas import GetWeather, Person

BLOCKED = "nukeville"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from data_plane.gateway.safety.pipeline import DEFAULT_POLICIES
    from data_plane.tiers import TierPolicy

    tmp = tmp_path_factory.mktemp("structured")
    policies = json.loads(json.dumps(DEFAULT_POLICIES))
    policies["policies"]["strict"] = {"window": 16, "input": [],
                                      "output": [{"type": "rules", "categories": {"test_word": [BLOCKED]}}]}
    (tmp / "safety.yaml").write_text(yaml.safe_dump(policies))
    tiers = TierPolicy.default().to_dict()
    tiers["tiers"]["enterprise"]["safety"] = "strict"
    (tmp / "tiers.yaml").write_text(yaml.safe_dump(tiers))
    with Cluster(shards=1, caches=1, engine="torch",
                 shard_args=[*INVARIANT_ARGS, "--max-num-seqs", "8", "--max-model-len", "2048"],
                 # a generous silence bound: these tests are about the API, not failover (2 cores, loaded)
                 gateway_args=["--safety-file", str(tmp / "safety.yaml"), "--tiers-file", str(tmp / "tiers.yaml"),
                               "--silence-timeout-s", "30"]
                 ) as c:
        yield c


def sdk(c: Cluster, tier: str = "plus") -> openai.OpenAI:
    return openai.OpenAI(base_url=c.gateway.url + "/v1", api_key=KEYS[tier], max_retries=0, timeout=120)


ASK_PERSON = [{"role": "user", "content": "Invent a person. Give their name and age."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_openai_parse_plain_and_streamed(cluster: Cluster) -> None:
    client = sdk(cluster)
    done = client.chat.completions.parse(model="", messages=ASK_PERSON, response_format=Person, max_tokens=60,
                                         temperature=0)
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and done.choices[0].finish_reason == "stop"
    assert done.system_fingerprint
    with client.chat.completions.stream(model="", messages=ASK_PERSON, response_format=Person, max_tokens=60,
                                        temperature=0) as stream:
        streamed = stream.get_final_completion()
    assert streamed.choices[0].message.parsed == person  # greedy fp32: the same object either way


def test_openai_tools_required_named_auto_streamed(cluster: Cluster) -> None:
    client = sdk(cluster)
    tool = openai.pydantic_function_tool(GetWeather)
    out = client.chat.completions.create(model="", messages=ASK_WEATHER, tools=[tool], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=40, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "GetWeather" and call.id.startswith("call_")
    GetWeather.model_validate_json(call.function.arguments)
    named = client.chat.completions.create(
        model="", messages=ASK_WEATHER, tools=[tool], max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    assert named.choices[0].finish_reason == "stop"
    assert named.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    # Streamed: OpenAI's delta shape; the SDK's accumulator rebuilds the same call.
    chunks = list(client.chat.completions.create(model="", messages=ASK_WEATHER, tools=[tool], tool_choice="required",
                                                 parallel_tool_calls=False, max_tokens=40, temperature=0,
                                                 stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "GetWeather" and deltas[0].index == 0
    assert all(d.id is None and d.function.name is None for d in deltas[1:])  # id and name once
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]
    with client.chat.completions.stream(model="", messages=ASK_WEATHER, tools=[tool], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=40, temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == GetWeather.model_validate_json(
        call.function.arguments)
    # The tool's result in the history, then auto: the model may answer or call again; either is well-formed.
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    auto = client.chat.completions.create(model="", messages=history, tools=[tool], max_tokens=60, temperature=0)
    msg = auto.choices[0]
    assert (msg.finish_reason == "tool_calls") == bool(msg.message.tool_calls)
    assert msg.finish_reason in ("stop", "tool_calls", "length")


def test_logprobs_under_tools_cover_the_content_not_the_envelope(cluster: Cluster) -> None:
    """Under tools the model writes an envelope (`{"response": ...}` / `{"tool_calls": [...]}`); logprobs
    are the client's tokens: a call has none, an answer's tokens spell its content (they named the
    envelope's `{"tool_calls":[{"name"...` tokens and skipped the arguments' before)."""
    client = sdk(cluster)
    kw: dict[str, Any] = {"model": "", "messages": ASK_WEATHER, "tools": [openai.pydantic_function_tool(GetWeather)],
                          "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 40,
                          "temperature": 0, "logprobs": True}
    call = client.chat.completions.create(**kw)
    assert call.choices[0].message.tool_calls and not (call.choices[0].logprobs and call.choices[0].logprobs.content)
    streamed = list(client.chat.completions.create(**kw, stream=True))
    assert not [ch for ch in streamed if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content]
    made = call.choices[0].message.tool_calls[0]
    history = ASK_WEATHER + [{"role": "assistant", "content": None, "tool_calls": [made.model_dump()]},
                             {"role": "tool", "tool_call_id": made.id, "content": "Sunny, 21 C"}]
    answer = client.chat.completions.create(**{**kw, "messages": history, "tool_choice": "none", "max_tokens": 12,
                                               "top_logprobs": 1})
    content = answer.choices[0].message.content or ""
    tokens = "".join(e.token for e in answer.choices[0].logprobs.content)
    assert content and "response" not in tokens and tokens.startswith(content[:4]), (content, tokens)


def test_logprobs_stop_where_the_content_stops(cluster: Cluster) -> None:
    """A stop string's tokens are cut from the text and so from logprobs (they were sent: the joined
    tokens ran on past the content by the whole stop string), streamed or not."""
    client = sdk(cluster)
    kw: dict[str, Any] = {"model": "", "messages": [{"role": "user", "content": "Count from 1 to 20."}],
                          "max_tokens": 24, "temperature": 0, "logprobs": True}
    tokens = [e.token for e in client.chat.completions.create(**kw).choices[0].logprobs.content]
    i = next(i for i in range(4, len(tokens) - 2) if "".join(tokens).find(tokens[i] + tokens[i + 1])
             == len("".join(tokens[:i])) and tokens[i].strip())
    stop, before = tokens[i] + tokens[i + 1], "".join(tokens[:i])
    done = client.chat.completions.create(**kw, stop=[stop])
    assert done.choices[0].message.content == before and done.choices[0].finish_reason == "stop"
    assert "".join(e.token for e in done.choices[0].logprobs.content) == before
    chunks = list(client.chat.completions.create(**kw, stop=[stop], stream=True))
    assert "".join(e.token for ch in chunks if ch.choices and ch.choices[0].logprobs
                   for e in ch.choices[0].logprobs.content or []) == before


def test_stop_strings_under_tools_cut_the_content_not_the_envelope(cluster: Cluster) -> None:
    """The engine applied stop strings to the tool envelope it writes: `stop: ["name"]` (or `"`, `,`)
    cut every call at `{"tool_calls":[{"`, an empty message with finish "stop" under tool_choice
    required. Now calls are never cut and an answer's content stops at the stop string, streamed or not."""
    client = sdk(cluster)
    tool = openai.pydantic_function_tool(GetWeather)
    kw: dict[str, Any] = {"model": "", "messages": ASK_WEATHER, "tools": [tool], "tool_choice": "required",
                          "parallel_tool_calls": False, "max_tokens": 40, "temperature": 0, "stop": ["name", '"']}
    call = client.chat.completions.create(**kw)
    assert call.choices[0].finish_reason == "tool_calls" and call.choices[0].message.tool_calls
    made = call.choices[0].message.tool_calls[0]
    history = ASK_WEATHER + [{"role": "assistant", "content": None, "tool_calls": [made.model_dump()]},
                             {"role": "tool", "tool_call_id": made.id, "content": "Sunny, 21 C"}]
    answer = {**kw, "messages": history, "tool_choice": "none", "stop": None, "max_tokens": 16}
    full = client.chat.completions.create(**answer).choices[0].message.content or ""
    word = next(w for w in full.split()[1:] if full.find(w) > 0)
    cut = client.chat.completions.create(**{**answer, "stop": [word]}).choices[0]
    assert (cut.message.content, cut.finish_reason) == (full[:full.find(word)], "stop")
    chunks = list(client.chat.completions.create(**{**answer, "stop": [word]}, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full[:full.find(word)]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]


class GetTime(BaseModel):
    """Get the current time in a city."""

    city: str = Field(max_length=24)


def test_allowed_tools_narrow_the_calls_in_chat_and_responses(cluster: Cluster) -> None:
    """OpenAI's `allowed_tools` choice: the request keeps its whole tool list and may call only the named
    subset (here the tool the question does not ask for, so only the constraint can pick it), in
    required and auto mode; a name not among the tools, or a non-function allowed tool, is a 400."""
    client = sdk(cluster)
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]

    def allowed(mode: str, *names: str) -> Any:
        return {"type": "allowed_tools",
                "allowed_tools": {"mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}

    out = client.chat.completions.create(model="", messages=ASK_WEATHER, tools=tools, max_tokens=40, temperature=0,
                                         parallel_tool_calls=False, tool_choice=allowed("required", "GetTime"))
    assert out.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["GetTime"]
    GetTime.model_validate_json(out.choices[0].message.tool_calls[0].function.arguments)
    auto = client.chat.completions.create(model="", messages=ASK_WEATHER, tools=tools, max_tokens=40, temperature=0,
                                          tool_choice=allowed("auto", "GetTime"))
    assert {c.function.name for c in auto.choices[0].message.tool_calls or []} <= {"GetTime"}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=ASK_WEATHER, tools=tools, max_tokens=8,
                                       tool_choice=allowed("required", "GetTime", "Nope"))
    assert err.value.body["param"] == "tool_choice" and "'Nope'" in err.value.body["message"]  # type: ignore[index]
    functions = [{"type": "function", "name": t.__name__, "parameters": t.model_json_schema()} for t in (GetWeather, GetTime)]
    resp = client.responses.create(model="", input="What is the weather in Paris?", tools=functions,  # type: ignore[arg-type]
                                   max_output_tokens=40, temperature=0, parallel_tool_calls=False,
                                   tool_choice={"type": "allowed_tools", "mode": "required",
                                                "tools": [{"type": "function", "name": "GetTime"}]})
    assert [item.name for item in resp.output if item.type == "function_call"] == ["GetTime"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="", input="Hi", tools=functions, max_output_tokens=8,  # type: ignore[arg-type]
                                tool_choice={"type": "allowed_tools", "mode": "auto",
                                             "tools": [{"type": "mcp", "server_label": "deepwiki"}]})
    assert err.value.body["param"] == "tool_choice.tools[0].type"  # type: ignore[index]


def test_blocked_phrase_inside_tool_arguments_is_never_sent(cluster: Cluster) -> None:
    tool = {"type": "function", "function": {"name": "travel", "parameters": {
        "type": "object", "properties": {"city": {"const": "Nukeville"}}, "required": ["city"]}}}
    chunks = list(sdk(cluster, "enterprise").chat.completions.create(
        model="", messages=ASK_WEATHER, tools=[tool], tool_choice="required", max_tokens=30, temperature=0,
        stream=True))
    sent = "".join(tc.function.arguments or "" for ch in chunks if ch.choices
                   for tc in (ch.choices[0].delta.tool_calls or []))
    assert BLOCKED not in sent.lower()
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        "content_filter"]


UNSUPPORTED = ["not", "if", "uniqueItems", "contains", "propertyNames", "dependentSchemas", "unevaluatedProperties"]


def test_every_unsupported_keyword_is_a_400_naming_it(cluster: Cluster) -> None:
    client = sdk(cluster)
    for keyword in UNSUPPORTED:
        schema = {"type": "object", "properties": {"a": {"type": "string"}}, keyword: {} if keyword != "uniqueItems"
                  else True}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="", messages=ASK_PERSON, max_tokens=5, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert keyword in info.value.message and info.value.body["param"] == "response_format", keyword
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=ASK_PERSON, max_tokens=5, tools=[{
            "type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}])
    # named as the client's function (test_chat_conformance: the tool envelope is ours, not the client's)
    assert "not" in info.value.message and info.value.body["param"] == "tools.0.function.parameters"
    assert info.value.body["message"].startswith("Invalid schema for function 'f': ")


def test_a_schema_no_output_satisfies_is_a_400_not_an_empty_reply(cluster: Cluster) -> None:
    """A $ref cycle with no base case compiles, but admits no first token: served, it was a 200 with
    content "" and finish_reason "stop" (no parser of the schema accepts that). A 400 names it now,
    streamed or not; the same schema with a way out is still served."""
    client = sdk(cluster)
    cycle = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="", messages=ASK_PERSON, max_tokens=5, stream=stream,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": cycle}})
        assert info.value.body["param"] == "response_format" and "no output satisfies" in info.value.message
    way_out = {"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "integer"}]}}, "$ref": "#/$defs/A"}
    reply = client.chat.completions.create(model="", messages=ASK_PERSON, max_tokens=8, temperature=0,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": way_out}})
    assert isinstance(json.loads(reply.choices[0].message.content or ""), int)


def test_sampling_parameters(cluster: Cluster) -> None:
    client = sdk(cluster)
    kw: dict[str, Any] = {"model": "", "messages": ASK_PERSON, "max_tokens": 12, "temperature": 1.0, "seed": 1234}
    texts = {client.chat.completions.create(**kw).choices[0].message.content for _ in range(3)}
    assert len(texts) == 1  # same seed, same text (float32)
    many = client.chat.completions.create(**kw, n=3, logprobs=True, top_logprobs=2, presence_penalty=0.5,
                                          frequency_penalty=0.5, extra_body={"min_p": 0.05})
    assert [c.index for c in many.choices] == [0, 1, 2]
    for c in many.choices:
        assert c.logprobs.content and all(len(e.top_logprobs) == 2 and e.bytes for e in c.logprobs.content)
    streamed = list(client.chat.completions.create(model="", messages=ASK_PERSON, max_tokens=6, temperature=0,
                                                   logprobs=True, top_logprobs=1, stream=True))
    entries = [e for ch in streamed if ch.choices and ch.choices[0].logprobs
               for e in ch.choices[0].logprobs.content or []]
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert entries and "".join(e.token for e in entries).startswith(text[:3])
    fixed = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Say OK."}], max_tokens=20,
                                           temperature=0, extra_body={"ignore_eos": True, "min_tokens": 5},
                                           prompt_cache_key="k", safety_identifier="u1", verbosity="low")
    assert fixed.usage.completion_tokens == 20 and fixed.choices[0].finish_reason == "length"
    choice = client.chat.completions.create(model="", messages=ASK_PERSON, max_tokens=5, temperature=0,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")


def test_instructor_tools_and_json_schema(cluster: Cluster) -> None:
    import instructor

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(sdk(cluster), mode=mode)
        person = client.chat.completions.create(model="SmolLM2-135M-Instruct", response_model=Person,
                                                messages=ASK_PERSON, max_tokens=60, temperature=0, max_retries=0)
        assert isinstance(person, Person), mode


def test_langchain_structured_output_and_bind_tools(cluster: Cluster) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=cluster.gateway.url + "/v1", api_key=KEYS["plus"], model="SmolLM2-135M-Instruct",
                     temperature=0, max_tokens=60, max_retries=0)
    person = llm.with_structured_output(Person).invoke("Invent a person. Give their name and age.")
    assert isinstance(person, Person)
    msg = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "GetWeather"
    GetWeather.model_validate(msg.tool_calls[0]["args"])


def test_agents_sdk_chat_completions_model(cluster: Cluster) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    class Report(BaseModel):
        city: str = Field(max_length=24)
        summary: str = Field(max_length=40)

    client = openai.AsyncOpenAI(base_url=cluster.gateway.url + "/v1", api_key=KEYS["plus"], max_retries=0)
    model = OpenAIChatCompletionsModel("SmolLM2-135M-Instruct", client)
    settings = ModelSettings(temperature=0, max_tokens=80)
    # A function tool: the SDK sends it, our envelope's call comes back as its tool call, the SDK runs it.
    # (One agent with both a tool and an output type needs the model to decide when to stop calling the
    # tool; SmolLM2-135M keeps calling it, so the two halves are proven apart.)
    tool_agent = Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model,
                       model_settings=ModelSettings(temperature=0, max_tokens=80, tool_choice="required"),
                       tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(tool_agent, "What is the weather in Paris?", max_turns=2)
    assert calls and result.final_output == f"Sunny in {calls[0]}"
    # An output type: the SDK sends it as a strict json_schema response_format and parses the reply.
    typed = Agent(name="report", instructions="Report the weather in Paris: it is sunny.", output_type=Report,
                  model=model, model_settings=settings)
    assert isinstance(Runner.run_sync(typed, "Report.", max_turns=1).final_output, Report)


def test_guidellm_fixed_length_benchmark(cluster: Cluster, tmp_path: Path) -> None:
    bench = run_guidellm(tmp_path, backend=(f"kind=openai_http,target={cluster.gateway.url},"
                                            f"model=SmolLM2-135M-Instruct,api_key={KEYS['plus']}"),
                         profile="kind=concurrent,streams=4", constraint="kind=max_requests,count=8",
                         data="kind=synthetic_text,prompt_tokens=32,output_tokens=16")
    made = bench["scheduler_metrics"]["requests_made"]
    assert made["successful"] == 8 and made["errored"] == 0 and made["incomplete"] == 0, made
    assert {r["output_tokens"] for r in bench["requests"]["successful"]} == {16}  # ignore_eos: fixed lengths


def test_gateway_metrics_and_ledger_kinds(cluster: Cluster) -> None:
    shard = cluster.shards[0].url
    text = scrape(shard)
    assert 'switchboard_shard_structured_requests_total{kind="tools"' in text
    assert "switchboard_shard_grammar_compile_seconds_bucket" in text
    assert 'outcome="unsupported"' in text
