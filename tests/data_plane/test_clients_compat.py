"""The client libraries applications use, driven the way their own docs show, against a real gateway and
the real model: the openai SDK's Responses stream with parallel function calls (item by item, as OpenAI
sends them) and its Chat Completions `stream()` helper, instructor's other modes (MD_JSON, JSON_SCHEMA
partials and iterables, a validator that fails once and is retried), LangChain's `ChatOpenAI`
(`stream_usage`, `json_mode`, `use_responses_api` with tools and streaming) and the Agents SDK streamed
on both its models, with sessions and a server-side conversation. What `test_structured_api.py` and
`test_responses_*.py` cover already is not repeated here.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_clients_compat.py -q   # ~3 min (real model)

The model is tiny: these tests check the protocol (what each client sends, parses and waits for), not
how good the answers are. Real processes: the session's fp32 shard, a cache node and a gateway on loopback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field, field_validator

from tests.support.chat import sdk
from tests.support.cluster import KEYS, gateway_before
from tests.support.procs import Service
from tests.support.schemas import GetWeather, Person

MODEL = "SmolLM2-135M-Instruct"
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def gateway(fp32_shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with gateway_before(fp32_shard, tmp_path_factory.mktemp("clients-compat")) as gw:
        yield gw


def async_sdk(gw: Service) -> Any:
    """A client per event loop (an AsyncOpenAI's connection pool belongs to the loop that opened it)."""
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=120)


def test_parallel_function_calls_stream_one_item_at_a_time(gateway: Service) -> None:
    """Parallel calls in a Responses stream came interleaved: call 1's `output_item.added` before call
    0's `function_call_arguments.done` / `output_item.done`, every call's `.done` held to the end of the
    reply. OpenAI sends items one after another, and a client that runs a call when its item is done
    (the Agents SDK's streamed runs, UIs rendering calls) waited for all of them; now each call is done
    when the next begins, and the terminal response holds the items as their `.done` events gave them."""
    with sdk(gateway).responses.stream(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                       tool_choice="required", max_output_tokens=40, temperature=0) as stream:
        events = list(stream)
    calls = [e.item for e in events if e.type == "response.output_item.added"]
    assert len(calls) >= 2 and all(c.type == "function_call" for c in calls), [e.type for e in events]
    per_item: dict[int, list[str]] = {}
    order: list[int] = []
    for e in events:
        index = getattr(e, "output_index", None)
        if index is not None:
            per_item.setdefault(index, []).append(e.type)
            if not order or order[-1] != index:
                order.append(index)
    assert order == sorted(set(order)), order  # no item is taken up again once the next began
    for index, kinds in per_item.items():
        assert kinds[0] == "response.output_item.added" and kinds[-2:] == [
            "response.function_call_arguments.done", "response.output_item.done"], (index, kinds)
        assert set(kinds[1:-2]) == {"response.function_call_arguments.delta"}, (index, kinds)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    terminal = events[-1]
    assert terminal.type in ("response.completed", "response.incomplete"), terminal.type
    assert [(o.call_id, o.arguments, o.status) for o in terminal.response.output] == [
        (o.call_id, o.arguments, o.status) for o in done]
    assert all(o.status == "completed" for o in done[:-1])  # a call followed by another is whole


def test_chat_stream_helper_events_usage_and_n(gateway: Service) -> None:
    """The openai SDK's `chat.completions.stream()`: its content events, the final completion with the
    usage chunk (`stream_options.include_usage`), n=2 choices (each seeded), a strict tool's parsed
    arguments; `get_final_completion` raises LengthFinishReasonError only when the reply was cut."""
    client = sdk(gateway)
    ask = [{"role": "user", "content": "Say hello."}]
    with client.chat.completions.stream(model=MODEL, messages=ask, max_tokens=60, temperature=0, stop=["!", "."],
                                        stream_options={"include_usage": True}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_completion()
    assert {"chunk", "content.delta", "content.done"} <= set(kinds)
    assert final.choices[0].finish_reason == "stop" and final.usage is not None
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens > 0
    plain = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=60, temperature=0, stop=["!", "."])
    assert plain.choices[0].message.content == final.choices[0].message.content
    assert plain.usage is not None and plain.usage.completion_tokens == final.usage.completion_tokens
    with client.chat.completions.stream(model=MODEL, messages=ask, max_tokens=60, n=2, seed=5, temperature=0.8,
                                        stop=["!", ".", "\n"]) as stream:
        list(stream)
        both = stream.get_final_completion()
    assert [c.index for c in both.choices] == [0, 1]
    with client.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=60, temperature=0) as stream:
        kinds = [e.type for e in stream]
        call = stream.get_final_completion().choices[0].message.tool_calls[0]
    assert "tool_calls.function.arguments.done" in kinds and isinstance(call.function.parsed_arguments, GetWeather)
    with (pytest.raises(openai.LengthFinishReasonError),
          client.chat.completions.stream(model=MODEL, messages=ask, max_tokens=2) as stream):
        list(stream)
        stream.get_final_completion()


def test_history_replayed_from_the_sdks_message_objects(gateway: Service) -> None:
    """Apps keep history as the openai SDK hands it back: `messages.append(reply.choices[0].message)`
    (after `parse`, that object carries `parsed`; a parsed tool call, `parsed_arguments`) or its
    `model_dump()` (which writes `annotations: null`, plus `refusal`/`audio`/`function_call`). Both were
    a 400 (`messages.1.annotations` / `messages.1.parsed`: extra fields forbidden); now they are replayed,
    and a stored completion's messages do not keep the SDK's `parsed`."""
    client = sdk(gateway)
    ask = {"role": "user", "content": "Invent a person."}
    parsed = client.chat.completions.parse(model=MODEL, messages=[ask], response_format=Person, max_tokens=40,
                                           temperature=0).choices[0].message
    weather = {"role": "user", "content": "What is the weather in Paris?"}
    called = client.chat.completions.parse(model=MODEL, messages=[weather], max_tokens=40, temperature=0,
                                           tools=[openai.pydantic_function_tool(GetWeather)],
                                           tool_choice="required", parallel_tool_calls=False).choices[0].message
    assert called.tool_calls and called.tool_calls[0].function.parsed_arguments is not None
    result = {"role": "tool", "tool_call_id": called.tool_calls[0].id, "content": "Sunny"}
    histories = [[ask, parsed, {"role": "user", "content": "Another."}],
                 [ask, parsed.model_dump(), {"role": "user", "content": "Another."}],
                 [weather, called, result], [weather, called.model_dump(), result]]
    for history in histories:
        reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
        assert reply.choices[0].message.content is not None or reply.choices[0].message.tool_calls
    stored = client.chat.completions.create(model=MODEL, messages=histories[0], max_tokens=4, store=True)
    kept = client.chat.completions.messages.list(stored.id, order="asc").data
    assert [m.role for m in kept] == ["user", "assistant", "user"] and kept[1].content == parsed.content
    assert "parsed" not in (kept[1].model_extra or {})


def test_the_answer_after_a_tool_result_is_text_not_a_copied_call(gateway: Service) -> None:
    """The function-calling round trip as OpenAI's guide writes it: a call, its result sent back, then the
    answer asked for with tool_choice "none" or without tools. The call was in the prompt as the tool
    envelope and nothing constrained the reply, so SmolLM2 copied it: the answer's content was
    `{"tool_calls":[{"name":"get_weather",...}]}`, streamed or not, chat or Responses. Now the reply is
    the envelope's answer, sent as plain content (data_plane/structured.py ToolMode.ANSWER)."""
    client = sdk(gateway)
    tools = [{"type": "function", "function": {"name": WEATHER_TOOL["name"], "parameters": WEATHER_TOOL["parameters"]}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=40, temperature=0)
    call = called.choices[0].message.tool_calls[0]
    history = [*ask, called.choices[0].message,
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    for extra in ({"tools": tools, "tool_choice": "none"}, {}):
        answer = client.chat.completions.create(model=MODEL, messages=history, max_tokens=40, temperature=0,
                                                **extra).choices[0]
        assert answer.finish_reason == "stop" and answer.message.content and not answer.message.tool_calls
        assert not answer.message.content.lstrip().startswith("{"), answer.message.content
        chunks = list(client.chat.completions.create(model=MODEL, messages=history, max_tokens=40, temperature=0,
                                                     stream=True, **extra))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.message.content
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=40,
                                    temperature=0)
    (fc,) = [o for o in first.output if o.type == "function_call"]
    after = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL],
                                    tool_choice="none", max_output_tokens=40, temperature=0,
                                    input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "Sunny"}])
    assert after.status == "completed" and after.output_text and not after.output_text.lstrip().startswith("{")


def test_a_tool_round_trip_in_a_server_side_session(gateway: Service) -> None:
    """With `X-Session-Id` the app sends only the new messages, so the turn after a call is the tool's
    result alone: it was a 400 ("messages with role 'tool' must answer a preceding assistant message's
    tool_calls"), the call being in the session's transcript, not in the request. It is answered now
    (the transcript holds the call as the envelope); without a session, an unanswered result is still
    a 400, and the answer is text, not a copied call."""
    client = sdk(gateway)
    tools = [{"type": "function", "function": {"name": WEATHER_TOOL["name"], "parameters": WEATHER_TOOL["parameters"]}}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=tools,
        tool_choice="required", parallel_tool_calls=False, max_tokens=40, temperature=0,
        extra_headers={"X-Session-Id": "new"})
    session, call = raw.headers["x-session-id"], raw.parse().choices[0].message.tool_calls[0]
    result = [{"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=result, max_tokens=40, temperature=0,
                                            extra_headers={"X-Session-Id": session}).choices[0]
    assert answer.finish_reason == "stop" and answer.message.content
    assert not answer.message.content.lstrip().startswith("{"), answer.message.content
    for headers in ({}, {"X-Session-Id": "new"}):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, messages=result, max_tokens=4, extra_headers=headers)
        body: Any = bad.value.body
        assert body["param"] == "messages"


def test_instructor_md_json_partial_iterable_and_retry(gateway: Service) -> None:
    """instructor beyond TOOLS/JSON_SCHEMA: MD_JSON (plain text, no response_format), `create_partial`
    (streamed partial objects), `create_iterable` and a retry after a validator that fails once (the
    validation error goes back to the model as a new message; the second try passes)."""
    import instructor

    ask = [{"role": "user", "content": "Invent a person. Give their name and age as JSON."}]
    md: Any = instructor.from_openai(sdk(gateway), mode=instructor.Mode.MD_JSON)
    parts = list(md.chat.completions.create_partial(model=MODEL, response_model=Person, messages=ask,
                                                    max_tokens=200, temperature=0, max_retries=0))
    assert parts and isinstance(parts[-1], Person) and parts[-1].name
    schema: Any = instructor.from_openai(sdk(gateway), mode=instructor.Mode.JSON_SCHEMA)
    parts = list(schema.chat.completions.create_partial(model=MODEL, response_model=Person, messages=ask,
                                                        max_tokens=60, temperature=0, max_retries=0))
    assert len(parts) > 2 and Person.model_validate(parts[-1].model_dump())
    people = list(schema.chat.completions.create_iterable(
        model=MODEL, response_model=Person, messages=[{"role": "user", "content": "Invent two people with name and age."}],
        max_tokens=120, temperature=0, max_retries=0))
    assert people and all(isinstance(p, Person) for p in people)
    seen: list[str] = []

    class Checked(BaseModel):
        name: str = Field(max_length=24)
        age: int

        @field_validator("name")
        @classmethod
        def first_is_refused(cls, v: str) -> str:
            seen.append(v)
            if len(seen) == 1:
                raise ValueError("try another name")
            return v

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        seen.clear()
        client: Any = instructor.from_openai(sdk(gateway), mode=mode)
        person = client.chat.completions.create(model=MODEL, response_model=Checked, messages=ask, max_tokens=80,
                                                temperature=0, max_retries=2)
        assert isinstance(person, Checked) and len(seen) == 2, (mode, seen)


def test_langchain_usage_json_mode_and_responses_api(gateway: Service) -> None:
    """LangChain's ChatOpenAI: `stream_usage` gives the streamed message the usage `invoke` reports,
    `with_structured_output(method="json_mode")` sends json_object, and `use_responses_api=True` runs
    invoke, stream (usage too), a named tool whose output goes back as a function_call_output, and a
    json_schema structured output over /v1/responses."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat_openai: Any = ChatOpenAI  # (its stubs want a SecretStr key and have no max_tokens alias)

    def llm(**kw: Any) -> Any:
        return chat_openai(base_url=gateway.url + "/v1", api_key=KEYS["plus"], model=MODEL, temperature=0,
                          max_tokens=60, max_retries=0, **kw)

    said = llm().invoke("Say hi.")
    chunks = list(llm(stream_usage=True).stream("Say hi."))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    counts = ("input_tokens", "output_tokens", "total_tokens")  # (cache_read: the second finds the first's prefix)
    assert streamed.content == said.content and streamed.usage_metadata and said.usage_metadata
    assert [streamed.usage_metadata[k] for k in counts] == [said.usage_metadata[k] for k in counts]
    assert said.usage_metadata and said.usage_metadata["output_tokens"] > 0
    raw = llm().with_structured_output(Person, method="json_mode", include_raw=True).invoke(
        "Invent a person as JSON with keys name and age.")
    assert raw["raw"].content.startswith("{")  # a JSON object (whether it fits Person is up to the model)

    responses = llm(use_responses_api=True, stream_usage=True)
    answer = responses.invoke("Say hi.")
    assert answer.text and answer.usage_metadata and answer.response_metadata["status"] == "completed"
    merged: Any = None
    for chunk in responses.stream("Say hi."):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and merged.text == answer.text
    assert merged.usage_metadata and merged.usage_metadata["output_tokens"] == answer.usage_metadata["output_tokens"]
    called = responses.bind_tools([GetWeather], tool_choice="GetWeather").invoke("What is the weather in Paris?")
    (call,) = called.tool_calls
    GetWeather.model_validate(call["args"])
    follow = responses.bind_tools([GetWeather], tool_choice="none").invoke(
        [HumanMessage("What is the weather in Paris?"), called, ToolMessage("Sunny", tool_call_id=call["id"])])
    assert follow.text and not follow.tool_calls and not follow.text.startswith('{"tool_calls"')
    assert isinstance(responses.with_structured_output(Person, method="json_schema").invoke("Invent a person."),
                      Person)


def test_agents_sdk_streamed_runs_sessions_and_conversations(gateway: Service, tmp_path: Path) -> None:
    """The Agents SDK streamed (`Runner.run_streamed`) on the Responses and the Chat Completions model: a
    function tool round-trips (tool_called, tool_output, then the run stops on it), an output type is
    parsed from the stream; a SQLiteSession and an OpenAIConversationsSession carry a second turn (the
    session replays the first turn's items; the conversation lives on the platform), and a run on a
    `conversation_id` leaves its message and call items in that conversation."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        SQLiteSession,
        function_tool,
        set_tracing_disabled,
    )
    from agents.memory import OpenAIConversationsSession

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"Sunny in {city}"

    class Report(BaseModel):
        city: str = Field(max_length=24)
        summary: str = Field(max_length=40)

    def models(client: openai.AsyncOpenAI) -> list[Any]:
        return [OpenAIResponsesModel(MODEL, client), OpenAIChatCompletionsModel(MODEL, client)]

    async def streamed() -> None:
        for model in models(async_sdk(gateway)):
            tools = Agent(name="w", instructions="Use the tool.", tools=[get_weather], model=model,
                          model_settings=ModelSettings(temperature=0, max_tokens=80, tool_choice="required",
                                                       parallel_tool_calls=False),
                          tool_use_behavior="stop_on_first_tool")
            run = Runner.run_streamed(tools, "What is the weather in Paris?", max_turns=2)
            names = [e.name async for e in run.stream_events() if e.type == "run_item_stream_event"]
            assert names == ["tool_called", "tool_output"] and run.final_output == "Sunny in Paris", (model, names)
            typed = Agent(name="r", instructions="Report the weather in Paris: it is sunny.", output_type=Report,
                          model=model, model_settings=ModelSettings(temperature=0, max_tokens=80))
            run = Runner.run_streamed(typed, "Report.", max_turns=1)
            async for _ in run.stream_events():
                pass
            assert isinstance(run.final_output, Report), model

    async def sessions() -> None:
        client = async_sdk(gateway)
        responses_model, chat_model = models(client)
        # (OpenAIConversationsSession with the Chat Completions model fails in the SDK itself, against
        # OpenAI too: it strips the replayed assistant message's id and its chat converter then refuses the
        # item, which still has its `status`. So the conversation session runs on the Responses model.)
        for session, model in ((SQLiteSession("responses", str(tmp_path / "agents.db")), responses_model),
                               (SQLiteSession("chat", str(tmp_path / "agents.db")), chat_model),
                               (OpenAIConversationsSession(openai_client=client), responses_model)):
            chat = Agent(name="c", instructions="Be brief.", model=model,
                         model_settings=ModelSettings(temperature=0, max_tokens=200))
            await Runner.run(chat, "My name is Zed.", session=session)
            second = await Runner.run(chat, "What is my name?", session=session)
            assert second.final_output and len(await session.get_items()) == 4, (session, model)
        conv = await client.conversations.create()
        tools = Agent(name="w", instructions="Use the tool.", tools=[get_weather], model=models(client)[0],
                      model_settings=ModelSettings(temperature=0, max_tokens=80, tool_choice="required",
                                                   parallel_tool_calls=False), tool_use_behavior="stop_on_first_tool")
        await Runner.run(tools, "What is the weather in Paris?", conversation_id=conv.id, max_turns=2)
        items = await client.conversations.items.list(conv.id, order="asc")
        assert [i.type for i in items.data] == ["message", "function_call"]

    asyncio.run(streamed())
    asyncio.run(sessions())
