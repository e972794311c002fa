"""Resuming a constrained stream on another shard, without processes: the envelope the gateway rebuilds
from the deltas it received (data_plane/tool_calls.py SentOutput) is what the grammar would have written,
the shard's grammar advances over it (data_plane/shard/engines/grammar.py `CompiledGrammar.resumed`) and
its envelope parser emits only what comes after (data_plane/shard/choices.py).

    .venv/bin/python -m pytest tests/data_plane/test_structured_resume.py -q     # a few seconds (tokenizer)
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from data_plane.protocol import ChatCompletionRequest
from data_plane.shard.choices import Choice
from data_plane.shard.engines.base import GenerationOutput
from data_plane.shard.engines.grammar import GrammarCompiler, GrammarError, GrammarKind, GrammarSpec
from data_plane.structured import ToolDef, ToolMode, output_plan
from data_plane.tool_calls import CallStart, EnvelopeParser, SentOutput, assemble

TOOLS = [ToolDef.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}),
    ToolDef.model_validate({"type": "function", "function": {"name": "now"}})]
ENVELOPE = ('{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris \\"Nord\\"","days":3}},'
            '{"name":"now","arguments":{}}]}')


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    import llguidance.hf
    from transformers import AutoTokenizer

    from data_plane.model_store import model_source

    tokenizer: Any = AutoTokenizer.from_pretrained(str(model_source(None).path))
    return GrammarCompiler(llguidance.hf.from_tokenizer(tokenizer))


def _sent(text: str, body: dict) -> str:
    """What a gateway that received `text`'s deltas (as the shard parses them) would resume with."""
    sent = SentOutput.for_body(body)
    for e in EnvelopeParser(sent.json_response).feed(text) if sent.envelope else []:
        if isinstance(e, CallStart):
            sent.call(e.index, e.name, "")
        elif hasattr(e, "index"):
            sent.call(e.index, None, e.text)
        else:
            sent.content(e.text)
    if not sent.envelope:
        sent.content(text)
    return sent.text()


def test_every_cut_of_a_tool_envelope_resumes_into_a_grammar_valid_prefix(compiler: GrammarCompiler) -> None:
    plan = output_plan(None, None, TOOLS, "required", True)
    assert plan.constraint is not None
    grammar = asyncio.run(compiler.compile(GrammarSpec(GrammarKind.TOOLS, plan.constraint.text)))
    body = {"tools": [t.model_dump() for t in TOOLS], "tool_choice": "required"}
    for cut in range(len(ENVELOPE) + 1):
        prefix = _sent(ENVELOPE[:cut], body)
        assert ENVELOPE.startswith(prefix), (cut, prefix)
        resumed = grammar.resumed(prefix)
        rest = ENVELOPE[len(prefix):]
        m = resumed.matcher()
        tokens = compiler.tokenizer.tokenize_str(rest)
        assert m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting(), cut
        # the resumed shard's choice emits only the rest: the calls keep their indexes, names come once
        choice = Choice(0, plan, None, prefix)
        deltas = choice.feed(GenerationOutput(rest, None, 0, 0))
        starts = [d["tool_calls"][0]["index"] for d in deltas if "id" in d.get("tool_calls", [{}])[0]]
        assert starts == [i for i, name in enumerate(['"get_weather"', '"now"'])
                          if f'"name":{name}' not in prefix]
        assert choice.finish("stop") == "tool_calls"
    assert json.loads(assemble(EnvelopeParser().feed(ENVELOPE))["tool_calls"][0]["function"]["arguments"]) == {
        "city": 'Paris "Nord"', "days": 3}


def test_a_plain_response_and_a_json_schema_resume(compiler: GrammarCompiler) -> None:
    plan = output_plan(None, None, TOOLS, "auto", True)
    assert plan.constraint is not None
    grammar = asyncio.run(compiler.compile(GrammarSpec(GrammarKind.TOOLS, plan.constraint.text)))
    answer = '{"response":"It is \\"sunny\\"\\nin Paris, 20 °C"}'
    body = {"tools": [t.model_dump() for t in TOOLS]}
    for cut in range(len(answer)):
        prefix = _sent(answer[:cut], body)
        assert answer.startswith(prefix), (cut, prefix)
        grammar.resumed(prefix)
    schema = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}))
    g = asyncio.run(compiler.compile(schema))
    assert g.resumed('{"n":1').resumed_tokens > 0 and g.resumed("") is g
    with pytest.raises(GrammarError) as err:
        g.resumed('{"m":')
    assert err.value.reason == "resume_rejected"
    assert ToolMode.AUTO == plan.tool_mode


def test_after_a_tool_result_with_no_tool_to_call_the_reply_is_the_envelopes_answer(
        compiler: GrammarCompiler) -> None:
    """A conversation whose assistant turn called a tool (written back as the envelope: structurally on the
    gateway, as text on a shard or in a session's transcript) and nothing to call now (tool_choice none, or
    no tools): left free, SmolLM2 copied its last turn and answered `{"tool_calls": ...}` as plain text. The
    reply is now the envelope's answer, sent as content, and a stream cut there resumes inside it; without
    such a turn, or with a response_format, nothing changes."""
    called = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": ENVELOPE}, {"role": "user", "content": "The tool returned: Sunny"}]
    plan = output_plan(None, None, None, None, None, tool_history=True)
    assert plan.tool_mode == ToolMode.ANSWER and plan.constraint is not None and plan.tools_prompt
    withheld = output_plan(None, None, TOOLS, "none", True, tool_history=True)  # the same, the tools described
    assert (withheld.tool_mode, withheld.constraint) == (ToolMode.ANSWER, plan.constraint)
    assert output_plan(None, None, None, None, None).constraint is None
    answer = '{"response":"It is sunny in Paris."}'
    choice = Choice(0, plan, None)
    deltas = choice.feed(GenerationOutput(answer, None, 0, 0))
    assert "".join(d.get("content") or "" for d in deltas) == "It is sunny in Paris."
    assert choice.finish("stop") == "stop"
    grammar = asyncio.run(compiler.compile(GrammarSpec(GrammarKind.TOOLS, plan.constraint.text)))
    for body in ({"messages": called}, {"messages": called, "tools": [t.model_dump() for t in TOOLS],
                                         "tool_choice": "none"}):
        for cut in range(len(answer)):
            prefix = _sent(answer[:cut], body)
            assert answer.startswith(prefix), (cut, prefix)
            grammar.resumed(prefix)
    assert not SentOutput.for_body({"messages": called[:1]}).envelope
    assert not SentOutput.for_body({"messages": called[:1], "tools": [t.model_dump() for t in TOOLS],
                                    "tool_choice": "none"}).envelope  # tools withheld, no call yet: free text
    assert not SentOutput.for_body({"messages": called, "response_format": {"type": "json_object"}}).envelope


def test_with_tool_choice_none_the_model_still_sees_the_tools_and_calls_none() -> None:
    """OpenAI's `tool_choice: "none"`: the model sees the tools but calls none (vLLM renders them into the chat
    template too, unless its operator passes --exclude-tools-when-tool-choice-none). The tools were left out
    of the prompt entirely. Now the system message describes every tool and says none may be called; the
    reply is free text, unconstrained: the answer envelope first put on it made an engine without grammars
    (the synthetic one, vLLM's adapter) refuse the request with a 400, and spent hidden tokens of
    max_tokens. A response_format keeps its own constraint, the tools described all the same."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"messages": ask, "tools": [t.model_dump(exclude_none=True) for t in TOOLS], "tool_choice": "none"}
    req = ChatCompletionRequest.model_validate(body)
    plan = req.output_plan()
    assert plan.tool_mode == ToolMode.NONE and plan.constraint is None and plan.tools_prompt
    system, user = req.plain_messages()
    assert system["role"] == "system" and user == ask[0]
    assert all(f'"name": "{t.function.name}"' in system["content"] for t in TOOLS) and "none may be" in system[
        "content"], system
    choice = Choice(0, plan, None)
    deltas = choice.feed(GenerationOutput('{"tool_calls": [{"name": "get_weather"', None, 0, 0))
    assert "".join(d.get("content") or "" for d in deltas) == '{"tool_calls": [{"name": "get_weather"'  # text
    assert not choice.called_tools and choice.finish("stop") == "stop"
    shaped = ChatCompletionRequest.model_validate({**body, "response_format": {"type": "json_object"}}).output_plan()
    assert shaped.tool_mode == ToolMode.NONE and shaped.constraint is not None
    assert shaped.constraint.kind == "json_object" and shaped.tools_prompt and "get_weather" in shaped.tools_prompt
    assert ChatCompletionRequest.model_validate({"messages": ask}).plain_messages() == ask  # no tools: as it was
