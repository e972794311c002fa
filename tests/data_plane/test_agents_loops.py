"""Agent programs as an app developer writes them with the OpenAI Agents SDK, against the real model: a
triage agent hands off to a weather agent whose function tool runs once (function_call ->
function_call_output -> the answer), streamed and not, on a server-side chain, with an output type, and
every body and stream event the gateway sent checked against the openai SDK's own types (what a typed
client or proxy validates). A chain whose previous response is gone is OpenAI's 400
`previous_response_not_found`, the code clients read to start the chain again with the whole history; a
run that stops on its tool leaves the call open and the next turn sends its output.
What test_clients_compat.py, test_structured_api.py and test_responses_*.py cover is not repeated here.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_agents_loops.py -q   # ~1 min (real model)

Real processes: the session's fp32 shard, a cache node and a gateway on loopback.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    RunContextWrapper,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from tests.support.chat import sdk
from tests.support.cluster import KEYS, gateway_before
from tests.support.procs import Service

MODEL = "SmolLM2-135M-Instruct"
EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
set_tracing_disabled(True)  # (no trace export to OpenAI from a test)


@pytest.fixture(scope="module")
def gateway(fp32_shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    keys = ",".join([f"{KEYS['plus']}:acme:plus", f"{KEYS['enterprise']}:bigco:enterprise"])
    with gateway_before(fp32_shard, tmp_path_factory.mktemp("agents-loops"), keys) as gw:
        yield gw


class Wire:
    """What the gateway sent an AsyncOpenAI client on /v1/responses, as raw JSON: each body and each
    stream's events (read whole in httpx's response hook; the SDK then reads the same bytes)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.streams: list[list[dict[str, Any]]] = []

    async def record(self, response: Any) -> None:  # an httpx2.Response (the openai SDK's httpx)
        if not response.request.url.path.endswith("/responses"):
            return
        await response.aread()
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            self.streams.append([json.loads(line[6:]) for line in response.text.splitlines()
                                 if line.startswith("data: ")])
        else:
            self.bodies.append(response.json())

    def client(self, gw: Service) -> openai.AsyncOpenAI:
        http = openai.DefaultAsyncHttpxClient(timeout=120, event_hooks={"response": [self.record]})
        return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["plus"], max_retries=0, http_client=http)


def check_stream(events: list[dict[str, Any]]) -> None:
    """One Responses stream as OpenAI's spec has it: every event valid as the SDK types it, sequence numbers
    0, 1, 2, ..., created and in_progress first, one terminal event last, and each output item opened, filled
    and closed before the next is added."""
    for event in events:
        EVENT.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete") and kinds.count(kinds[-1]) == 1, kinds
    opened = -1
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == opened + 1, kinds
            opened = e["output_index"]
        else:
            assert e["output_index"] == opened, (e, kinds)
    Response.model_validate(events[-1]["response"])


def test_agents_loop_handoff_tool_and_output_type_on_the_wire(gateway: Service) -> None:
    """A triage agent hands off (a function call the SDK turns into the other agent), the weather agent's
    tool runs once and its output goes back as a function_call_output, the answer ends the run: streamed
    and not, the second run on a server-side chain (`auto_previous_response_id`: only the new items go
    up); an agent with an output type gets it through `text.format` (and its prompt_cache_options and
    moderation, the chat path's no-ops, were a 400 on /v1/responses). Every body and event the SDK read
    validates against openai's types: `usage.input_tokens_details` lacked `cache_write_tokens`, which
    OpenAI's schema requires (openai-python's ResponseUsage since 2.45), so `response.completed`, every
    body and every stored response failed `Response.model_validate`."""
    def not_yet_called(ctx: RunContextWrapper[Any], agent: Any) -> bool:  # the model would call it forever
        return not ctx.context["calls"]

    @function_tool(is_enabled=not_yet_called)
    def get_weather(ctx: RunContextWrapper[Any], city: str) -> str:
        """Get the current weather in a city."""
        ctx.context["calls"].append(city)
        return f"Sunny in {city}"

    class Report(BaseModel):
        city: str = Field(max_length=20)
        sky: str = Field(max_length=20)

    wire = Wire()
    model = OpenAIResponsesModel(MODEL, wire.client(gateway))
    forced = ModelSettings(temperature=0, max_tokens=60, tool_choice="required", parallel_tool_calls=False)
    weather = Agent(name="weather", instructions="Use the tool, then answer briefly.", tools=[get_weather],
                    model=model, model_settings=forced)
    triage = Agent(name="triage", instructions="Hand off to the weather agent.", handoffs=[weather], model=model,
                   model_settings=forced)
    # prompt_cache_options (ModelSettings) and moderation: the chat path's no-ops, a 400 "unrecognized request
    # argument" on /v1/responses (every Agents SDK agent on the Responses model setting the first)
    typed = Agent(name="report", instructions="Report the weather: it is sunny in Paris.", output_type=Report,
                  model=model, model_settings=ModelSettings(
                      temperature=0, max_tokens=60, prompt_cache_options={"mode": "implicit", "ttl": "30m"},
                      extra_body={"moderation": {"model": "omni-moderation-latest"}}))

    async def run() -> list[Any]:
        done = []
        for streamed, chained in ((True, False), (False, True)):
            context: dict[str, list[str]] = {"calls": []}
            if streamed:
                result: Any = Runner.run_streamed(triage, "What is the weather in Paris?", context=context,
                                                  max_turns=4)
                async for _ in result.stream_events():
                    pass
            else:
                result = await Runner.run(triage, "What is the weather in Paris?", context=context, max_turns=4,
                                          auto_previous_response_id=chained)
            kinds = [type(item).__name__ for item in result.new_items]
            assert kinds == ["HandoffCallItem", "HandoffOutputItem", "ToolCallItem", "ToolCallOutputItem",
                             "MessageOutputItem"], kinds
            assert result.last_agent is weather and len(context["calls"]) == 1 and result.final_output
            done.append(result)
        done.append(await Runner.run(typed, "Report.", max_turns=1))
        return done

    *_, report = asyncio.run(run())
    assert isinstance(report.final_output, Report)
    assert len(wire.streams) == 3 and len(wire.bodies) == 4, (len(wire.streams), len(wire.bodies))
    for events in wire.streams:
        check_stream(events)
    for body in wire.bodies:
        assert Response.model_validate(body).usage.input_tokens_details.cache_write_tokens == 0  # type: ignore[union-attr]
    stored = httpx.get(f"{gateway.url}/v1/responses/{wire.bodies[-1]['id']}", timeout=30,
                       headers={"Authorization": f"Bearer {KEYS['plus']}"})
    Response.model_validate(stored.json())


def test_a_previous_response_that_is_gone_is_openais_400_and_the_app_starts_again(gateway: Service) -> None:
    """`previous_response_id` naming a response this key cannot see (unknown, deleted, `store: false`, another
    key's) was a 404 `not_found` with param `response_id`, the answer to GET /v1/responses/{id}. OpenAI
    answers a 400 `previous_response_not_found`, param `previous_response_id`, and clients read that code to
    resend the whole history (pydantic-ai's `openai_previous_response_id="auto"`, Codex bridges); the Agents
    SDK raised openai.NotFoundError where an app catching BadRequestError recovers. The same for a streamed
    create, `input_tokens` and `compact`; GET of the id stays a 404."""
    plus = sdk(gateway)
    ask = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    deleted = plus.responses.create(input="Say hi.", **ask)
    plus.responses.delete(deleted.id)
    unstored = plus.responses.create(input="Say hi.", store=False, **ask)
    others = sdk(gateway, KEYS["enterprise"]).responses.create(input="Say hi.", **ask)

    def attempts(gone: str) -> list[Callable[[], object]]:
        return [lambda: plus.responses.create(input="And?", previous_response_id=gone, **ask),
                lambda: list(plus.responses.create(input="And?", previous_response_id=gone, stream=True, **ask)),
                lambda: plus.responses.input_tokens.count(model=MODEL, input="And?", previous_response_id=gone),
                lambda: plus.post("/responses/compact", cast_to=object,
                                  body={"model": MODEL, "input": "And?", "previous_response_id": gone})]

    for gone in ("resp_" + "0" * 48, deleted.id, unstored.id, others.id):
        for call in attempts(gone):
            with pytest.raises(openai.BadRequestError) as refused:
                call()
            assert refused.value.code == "previous_response_not_found", refused.value.body
            assert refused.value.param == "previous_response_id"
            assert refused.value.body["message"] == f"Previous response with id '{gone}' not found."  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        plus.responses.retrieve(deleted.id)

    agent = Agent(name="chat", instructions="Be brief.", model=OpenAIResponsesModel(MODEL, openai.AsyncOpenAI(
        base_url=gateway.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=120)),
        model_settings=ModelSettings(temperature=0, max_tokens=200))

    async def chat_on(previous: str) -> Any:
        try:
            return await Runner.run(agent, "Say hi.", previous_response_id=previous, max_turns=1)
        except openai.BadRequestError as exc:  # the chain expired: start it again
            assert exc.code == "previous_response_not_found"
            return await Runner.run(agent, "Say hi.", max_turns=1)

    again = asyncio.run(chat_on(deleted.id))
    assert again.final_output and again.last_response_id


def test_a_run_that_stops_on_its_tool_leaves_the_call_open_and_the_next_turn_answers_it(gateway: Service) -> None:
    """`tool_use_behavior="stop_on_first_tool"` on a server-side conversation (or chain): the run ends on the
    tool's result, which the SDK never sends up (it only delivers items with a model call), so the conversation
    holds a function_call without its output and a next run with only a new message is OpenAI's 400 "No tool
    output found for function call ..." (the same at OpenAI: openai-agents-python#1061; not ours to change).
    The app goes on by sending the outputs the first run made: at the head of the next run's input, or added
    to the conversation with `conversations.items.create` (streamed too); the refused turn left nothing."""
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=120)

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"Sunny in {city}"

    agent = Agent(name="weather", instructions="Use the tool.", tools=[get_weather],
                  model=OpenAIResponsesModel(MODEL, client), tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(temperature=0, max_tokens=40, tool_choice="required",
                                               parallel_tool_calls=False))

    def outputs(result: Any) -> list[Any]:
        return [item.raw_item for item in result.new_items if item.type == "tool_call_output_item"]

    async def run() -> None:
        conv = (await client.conversations.create()).id
        first = await Runner.run(agent, "What is the weather in Paris?", conversation_id=conv, max_turns=2)
        assert first.final_output == "Sunny in Paris"
        with pytest.raises(openai.BadRequestError) as refused:
            await Runner.run(agent, "And in Rome?", conversation_id=conv, max_turns=2)
        (call,) = [i for i in first.new_items if i.type == "tool_call_item"]
        assert refused.value.body["message"] == (  # type: ignore[index]
            f"No tool output found for function call {call.raw_item.call_id}.")  # type: ignore[union-attr]
        second = await Runner.run(agent, [*outputs(first), {"role": "user", "content": "And in Rome?"}],
                                  conversation_id=conv, max_turns=2)
        await client.conversations.items.create(conv, items=outputs(second))
        third = Runner.run_streamed(agent, "And in Oslo?", conversation_id=conv, max_turns=2)
        async for _ in third.stream_events():
            pass
        items = (await client.conversations.items.list(conv, order="asc", limit=100)).data
        assert [i.type for i in items] == [*["message", "function_call", "function_call_output"] * 2, "message",
                                          "function_call"], items
        assert [second.final_output, third.final_output] == ["Sunny in Rome", "Sunny in Oslo"]

        chained = await Runner.run(agent, "What is the weather in Paris?", auto_previous_response_id=True,
                                   max_turns=2)
        with pytest.raises(openai.BadRequestError):
            await Runner.run(agent, "And in Rome?", previous_response_id=chained.last_response_id, max_turns=2)
        again = await Runner.run(agent, [*outputs(chained), {"role": "user", "content": "And in Rome?"}],
                                 previous_response_id=chained.last_response_id, max_turns=2)
        assert again.final_output == "Sunny in Rome"

    asyncio.run(run())


def test_the_websocket_mode_serves_agents_and_the_sdks_connection(gateway: Service) -> None:
    """OpenAI's WebSocket mode on /v1/responses (the Agents SDK's `responses_websocket_session`, the openai SDK's
    `responses.connect()`): the upgrade was refused with uvicorn's bare 403 (the SDK: "server rejected WebSocket
    connection: HTTP 403"), so an agent on that transport could not start. Each `response.create` frame is the
    streamed POST: a tool loop runs, streamed too, on a chain; a refusal is an `error` frame with OpenAI's error
    and its status, and the socket goes on; `store: false` chains on the socket's last response, as in OpenAI's
    mode; a bad key is the 401 on the upgrade; a socket closed mid-stream
    aborts it as a client that leaves (stored `incomplete`, `client_disconnected`)."""
    from agents import responses_websocket_session
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    context: dict[str, list[str]] = {"calls": []}

    def not_yet_called(ctx: RunContextWrapper[Any], agent: Any) -> bool:
        return not ctx.context["calls"]

    @function_tool(is_enabled=not_yet_called)
    def get_weather(ctx: RunContextWrapper[Any], city: str) -> str:
        """Get the current weather in a city."""
        ctx.context["calls"].append(city)
        return f"Sunny in {city}"

    agent = Agent(name="weather", instructions="Use the tool, then answer.", tools=[get_weather], model=MODEL,
                  model_settings=ModelSettings(temperature=0, max_tokens=60, tool_choice="required",
                                               parallel_tool_calls=False))

    async def agents() -> list[Any]:
        async with responses_websocket_session(api_key=KEYS["plus"], base_url=gateway.url + "/v1") as ws:
            ran = await ws.run(agent, "What is the weather in Paris?", context=context, max_turns=3)
            context["calls"].clear()
            streamed = ws.run_streamed(agent, "What is the weather in Rome?", context=context, max_turns=3,
                                       auto_previous_response_id=True)
            names = [e.name async for e in streamed.stream_events() if e.type == "run_item_stream_event"]
            assert names == ["tool_called", "tool_output", "message_output_created"], names
            return [ran, streamed]

    ran, streamed = asyncio.run(agents())
    assert [type(i).__name__ for i in ran.new_items] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert ran.final_output and streamed.final_output and context["calls"] == ["Rome"]

    with sdk(gateway).responses.connect() as conn:
        def create(**body: Any) -> Any:
            """One frame, read to its end: the terminal event (or the error frame)."""
            conn.response.create(**{"model": MODEL, "input": "Say hi.", "max_output_tokens": 8, "temperature": 0,
                                    **body})
            kinds = []
            for event in conn:
                kinds.append(event.type)
                if event.type in ("response.completed", "response.incomplete", "error"):
                    assert event.type == "error" or kinds[:2] == ["response.created", "response.in_progress"], kinds
                    return event
            raise AssertionError(kinds)

        refused = create(model="no-such-model")
        assert refused.type == "error" and refused.status == 404, refused
        assert refused.error.code == "model_not_found" and refused.error.param == "model", refused
        assert create(background=True).error.param == "background"  # (OpenAI's: not over a WebSocket)
        first = create(input="My name is Zed.", store=False).response  # and the socket went on
        chained = create(input="And my name?", previous_response_id=first.id, store=False)  # the socket's own
        assert chained.type != "error" and chained.response.usage.input_tokens > first.usage.input_tokens, chained
        assert create(previous_response_id=first.id).error.code == "previous_response_not_found"  # not the last

    url = gateway.url.replace("http://", "ws://") + "/v1/responses"
    with pytest.raises(InvalidStatus) as bad:
        connect(url, additional_headers={"Authorization": "Bearer sk-not-a-key"}, open_timeout=30)
    assert bad.value.response.status_code == 401  # with the body a POST gets
    assert json.loads(bad.value.response.body or b"{}")["error"]["type"] == "authentication_error"

    with connect(url, additional_headers={"Authorization": f"Bearer {KEYS['plus']}"}, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "Tell me a long story.",
                            "max_output_tokens": 400, "temperature": 0}))
        created = json.loads(ws.recv(timeout=120))
        assert created["type"] == "response.created", created
        while json.loads(ws.recv(timeout=120))["type"] != "response.output_text.delta":
            pass
    stored: dict[str, Any] = {}
    for _ in range(120):
        stored = httpx.get(f"{gateway.url}/v1/responses/{created['response']['id']}", timeout=30,
                           headers={"Authorization": f"Bearer {KEYS['plus']}"}).json()
        if stored.get("status") not in (None, "in_progress"):
            break
        time.sleep(0.5)
    assert stored["status"] == "incomplete", stored
    assert stored["incomplete_details"] == {"reason": "client_disconnected"}, stored
