"""`client.responses.input_tokens.count` and `client.responses.cancel` with the openai SDK against
real processes: the session's fp32 shard, a cache node and a gateway on loopback. A count must be
the `usage.input_tokens` that `responses.create` with the same input reports (new, continued with
previous_response_id, with tools), generate nothing, and keep the tenant binding of stored state.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_responses_count.py -q
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from openai.types.responses import FunctionToolParam

from tests.support.cluster import KEYS, cache_node
from tests.support.metrics import metric
from tests.support.procs import Service

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
WEATHER: FunctionToolParam = {"type": "function", "strict": False, "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def gateway(fp32_shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    state = tmp_path_factory.mktemp("responses-count")
    cache = cache_node().start()
    keys = ",".join([f"{KEYS['plus']}:acme:plus", f"{KEYS['plus2']}:acme:plus"])
    gw = Service(["gateway", "--shard-urls", fp32_shard.url, "--cache-urls", cache.url, "--state-dir", str(state),
                  "--usage-db", "off"], env={"SWITCHBOARD_GATEWAY_API_KEYS": keys}, ready_timeout=240)
    try:
        with gw:
            yield gw
    finally:
        cache.stop()


def param(error: openai.APIStatusError) -> object:
    """The OpenAI error body's `param` (the SDK hands the body over untyped)."""
    assert isinstance(error.body, dict)
    return error.body.get("param")


def sdk(gateway: Service, key: str = "plus") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEYS[key], max_retries=0, timeout=120)


def test_count_is_the_input_tokens_create_reports(gateway: Service, fp32_shard: Service) -> None:
    client = sdk(gateway)
    prompt = metric(fp32_shard.url, "vllm:prompt_tokens_total")
    counted = client.responses.input_tokens.count(model=MODEL, input="Name the capital of France.",
                                                  instructions=SYSTEM)
    assert counted.object == "response.input_tokens" and counted.input_tokens > 10
    assert metric(fp32_shard.url, "vllm:prompt_tokens_total") == prompt, "a count generates nothing"
    first = client.responses.create(model=MODEL, input="Name the capital of France.", instructions=SYSTEM,
                                    max_output_tokens=8, temperature=0)
    assert first.usage is not None and counted.input_tokens == first.usage.input_tokens

    # continued: the stored turn (its reply as the shard generated it) is counted with the new input
    more = client.responses.input_tokens.count(model=MODEL, input="And of Italy?", previous_response_id=first.id)
    second = client.responses.create(model=MODEL, input="And of Italy?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.usage is not None and more.input_tokens == second.usage.input_tokens
    assert more.input_tokens > first.usage.input_tokens

    # a conversation's items come first, as create prepends them
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}])
    in_conv = client.responses.input_tokens.count(model=MODEL, input="What is my name?", conversation=conv.id)
    answered = client.responses.create(model=MODEL, input="What is my name?", conversation=conv.id,
                                       max_output_tokens=8, temperature=0)
    assert answered.usage is not None and in_conv.input_tokens == answered.usage.input_tokens

    # tools: their definitions are in the prompt, as the shard's template renders them
    with_tools = client.responses.input_tokens.count(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    plain = client.responses.input_tokens.count(model=MODEL, input="Weather in Paris?")
    called = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                     max_output_tokens=16, temperature=0, store=False)
    assert called.usage is not None and with_tools.input_tokens == called.usage.input_tokens
    assert with_tools.input_tokens > plain.input_tokens + 20
    assert metric(gateway.url, "switchboard_responses_requests_total", op="input_tokens", status="200") >= 4


def test_count_errors_and_tenant_binding(gateway: Service) -> None:
    client = sdk(gateway)
    refused = metric(gateway.url, "switchboard_responses_requests_total", op="input_tokens", status="400")
    stored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError) as e:  # another key's response is not there for it (the create's 400)
        sdk(gateway, "plus2").responses.input_tokens.count(model=MODEL, input="x", previous_response_id=stored.id)
    assert e.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_tokens.count(model=MODEL, input="x", previous_response_id="resp_" + "0" * 48)
    assert param(e.value) == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:  # a create-only field is not a count's
        client.responses.input_tokens.count(model=MODEL, input="x", extra_body={"max_output_tokens": 5})
    assert param(e.value) == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_tokens.count(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert param(e.value) == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_tokens.count(model=MODEL, input=[{"type": "function_call_output", "call_id": "c1",
                                                                 "output": "sunny"}])
    assert param(e.value) == "input"
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.input_tokens.count(model="no-such-model", input="x")
    assert param(missing.value) == "model"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-wrong", max_retries=0).responses.input_tokens.count(
            model=MODEL, input="x")
    assert metric(gateway.url, "switchboard_responses_requests_total", op="input_tokens", status="400") == refused + 5


def test_cancel_is_refused_for_a_response_not_made_in_the_background(gateway: Service) -> None:
    client = sdk(gateway)
    done = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(done.id)
    assert "background=true" in e.value.message and param(e.value) == "response_id"
    assert client.responses.retrieve(done.id).status == done.status  # untouched
    for who, rid in (("plus2", done.id), ("plus", "resp_" + "0" * 48)):  # another key's, or none at all
        with pytest.raises(openai.NotFoundError):
            sdk(gateway, who).responses.cancel(rid)
    assert metric(gateway.url, "switchboard_responses_requests_total", op="cancel", status="404") == 2
