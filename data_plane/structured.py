"""Structured outputs and tools on the wire, and the one constraint a request's output follows.

    req = ChatCompletionRequest.model_validate(body)     # fields typed by the models below
    plan = output_plan(req)                              # OutputPlan: constraint, tool mode, tools prompt
    plan.constraint                                      # Constraint(kind="json_schema", text=...) or None

The request fields are defined once, on `protocol.ChatCompletionRequest` (the Responses API builds on
them); their shapes are here. What a request asks of its output becomes one `Constraint` (a kind and a
grammar source the engine compiles: data_plane/shard/engines/grammar.py):

- ``response_format`` ``json_object`` -> any JSON object; ``json_schema`` -> its schema (strict or not:
  both are enforced by the grammar; keywords the grammar engine cannot enforce are a 400 naming them; a
  strict schema that breaks strict mode's rules is a 400 as OpenAI gives it: data_plane/strict_schema.py).
- vLLM's ``structured_outputs`` extension: one of ``json``, ``regex``, ``choice``, ``grammar`` (Lark or GBNF), ``json_object``.
- ``tools`` with ``tool_choice`` ``auto`` / ``required`` / a named function: the generic JSON envelope
  (llama.cpp's approach for models without a tool template, which ours is), forced by grammar::

      {"tool_calls": [{"name": "<function>", "arguments": {...its parameters...}}, ...]}
      {"response": "<text for the user>"}                       # auto only

  ``required`` and a named choice allow only ``tool_calls`` (a named one: that function, one call; a
  response_format has nothing left to shape then, as with OpenAI); ``parallel_tool_calls: false`` allows one call. The tools and the envelope are described to the model
  in a system message (`tools_prompt`); data_plane/tool_calls.py parses the envelope back into OpenAI's
  ``tool_calls`` (streamed as deltas). With ``tool_choice: none`` the model still sees the tools, as
  OpenAI's does (and vLLM's, unless ``--exclude-tools-when-tool-choice-none``), told that none may be
  called now (`withheld_tools_prompt`), and calls none: its reply is free text, unconstrained (an engine
  without grammars serves it, as it did before the tools were described). When the conversation already
  holds tool calls (a tool's result came back) and no tool may be called, the reply is the envelope's
  answer alone (``ToolMode.ANSWER``), sent as plain content, so the model answers rather than copy a
  call as text. A response_format or structured_outputs with ``tool_choice: none`` keeps its own
  constraint (the tools described all the same).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from data_plane.schema_rewrite import closed, hoist
from data_plane.strict_schema import object_root_problem, strict_schema_problem

MAX_TOOLS = 128


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    """OpenAI's rule (`NAME_PATTERN`, 64 characters) is checked with its words: `check_output_fields`."""
    description: str | None = Field(default=None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1, max_length=128)


class AllowedToolsChoice(BaseModel):
    """OpenAI's `allowed_tools` choice: calls restricted to a subset of `tools`, in auto or required mode
    (the full list stays in the request, so an app can keep one tool list and narrow it per turn)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools

    def names(self) -> set[str]:
        return {t.function.name for t in self.allowed_tools.tools}


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    """Required, as OpenAI requires it (its 400 is `check_output_fields`'); None: not sent."""
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("openai", "Missing required parameter: 'response_format.json_schema'.",
                                      {"code": "missing_required_parameter"})
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` request field (exactly one constraint)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    """A schema, as an object or as its JSON text (vLLM takes either; the text is read here, so both are
    checked and closed alike: served as sent, the text's objects stayed open and SmolLM2 added keys)."""
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    grammar: str | None = None
    json_object: bool | None = None

    @field_validator("json_", mode="after")
    @classmethod
    def _schema_text_read(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
        """The schema an object's JSON text spells, as that object; other text is left for the grammar
        compiler to refuse in its words."""
        if not isinstance(value, str):
            return value
        try:
            schema = json.loads(value)
        except (ValueError, RecursionError):
            return value
        return schema if isinstance(schema, dict) else value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object")
        return self


class ToolMode(str, Enum):
    """How a request's tools shape its output (a bounded label)."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"
    ANSWER = "answer"
    """No tool may be called (tool_choice none, or no tools) but the conversation holds tool calls, written
    back as the envelope: the reply is the envelope's answer (`{"response": ...}`, sent as plain content).
    Left free, SmolLM2 copied its last turn and sent `{"tool_calls": ...}` as the text of its answer."""


ANSWER_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"response": {"type": "string"}},
                                 "required": ["response"], "additionalProperties": False}
ANSWER_PROMPT = 'Answer with JSON only: {"response": <your answer to the user>}.'


@dataclass(frozen=True)
class Constraint:
    """The grammar a request's output follows: `kind` (json_object, json_schema, regex, choice, grammar,
    tools) and its source text (a JSON schema, a regex, a JSON list of strings, a Lark/GBNF grammar)."""

    kind: str
    text: str


EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""A function's parameters when it has none."""


class FunctionSchema(NamedTuple):
    """A function a tool envelope offers, kept to name it when the grammar refuses the envelope: the
    grammar's words are about the envelope (`"required property 'tool_calls' is unsatisfiable"`), which
    the client never sent."""

    param: str
    """Where the request holds its parameters (``tools.<i>.function.parameters``)."""
    name: str
    parameters: dict[str, Any] | None

    def grammar_source(self) -> str:
        """Its parameters' schema as the envelope holds it (closed), alone."""
        return json.dumps(closed(self.parameters or EMPTY_PARAMETERS))


@dataclass(frozen=True)
class OutputPlan:
    constraint: Constraint | None
    tool_mode: ToolMode
    tools_prompt: str | None
    """A system message describing the tools and the envelope, or (tool_choice none) the tools none may call
    (None without tools)."""
    json_response: bool = False
    """Auto tools with a response_format: the envelope's answer is a JSON value (its text is the content)."""
    param: str = "response_format"
    """The request field the constraint came from (the `param` of a 400 refusing it)."""
    functions: tuple[FunctionSchema, ...] = ()
    """The functions a tool envelope offers (none without one)."""


ANY_JSON_OBJECT = '{"type": "object"}'
STRUCTURED = "structured_outputs"


def _call_schema(tool: ToolDef, prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    params = hoist(closed(tool.function.parameters or EMPTY_PARAMETERS), prefix, defs)
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def envelope_schema(tools: list[ToolDef], mode: ToolMode, parallel: bool,
                    response: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON schema of the generic tool envelope for `tools` under `mode` (module docstring); in auto
    mode `response` (a response_format's schema) replaces the plain-text answer."""
    defs: dict[str, Any] = {}
    calls = [_call_schema(t, f"t{i}_", defs) for i, t in enumerate(tools)]
    item: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel or mode == ToolMode.NAMED:
        array["maxItems"] = 1
    tool_calls = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
                  "additionalProperties": False}
    root: dict[str, Any] = tool_calls
    if mode == ToolMode.AUTO:
        answer = hoist(response, "r_", defs) if response is not None else {"type": "string"}
        root = {"anyOf": [tool_calls, {"type": "object", "properties": {"response": answer},
                                       "required": ["response"], "additionalProperties": False}]}
    return {**root, "$defs": defs} if defs else root


def _described(tools: list[ToolDef]) -> list[str]:
    """One line per tool: its name, description and the JSON schema of its arguments."""
    return [json.dumps({"name": t.function.name, "description": t.function.description or "",
                        "parameters": t.function.parameters or {}}, ensure_ascii=False) for t in tools]


def tools_prompt(tools: list[ToolDef], mode: ToolMode) -> str:
    lines = ["You can call these tools (JSON schemas of their arguments):", *_described(tools)]
    lines.append('Answer with JSON only. To call tools: {"tool_calls": [{"name": "<tool name>", '
                 '"arguments": {<the arguments>}}]}.')
    if mode == ToolMode.AUTO:
        lines.append('To answer the user directly instead, or once a tool has returned what you need: '
                     '{"response": <your answer>}.')
    return "\n".join(lines)


def withheld_tools_prompt(tools: list[ToolDef], answer: bool) -> str:
    """``tool_choice: none``: the tools described, none to be called now; `answer`: the reply is the
    envelope's answer (ToolMode.ANSWER), else a response format shapes it."""
    lines = ["These tools exist (JSON schemas of their arguments), but none may be called in this reply:",
             *_described(tools)]
    lines.append(ANSWER_PROMPT if answer else "Reply without calling any of them.")
    return "\n".join(lines)


def tool_mode(tools: list[ToolDef] | None, choice: Any) -> ToolMode:
    if not tools or choice == "none":
        return ToolMode.NONE
    if isinstance(choice, NamedToolChoice):
        return ToolMode.NAMED
    if isinstance(choice, AllowedToolsChoice):
        return ToolMode.REQUIRED if choice.allowed_tools.mode == "required" else ToolMode.AUTO
    return ToolMode.REQUIRED if choice == "required" else ToolMode.AUTO


def output_plan(response_format: ResponseFormat | None, structured: StructuredOutputs | None,
                tools: list[ToolDef] | None, choice: Any, parallel: bool | None,
                tool_history: bool = False) -> OutputPlan:
    """The constraint and tool mode of a request (validated already: `check_output_fields`);
    `tool_history`: its messages hold tool calls (ToolMode.ANSWER when none may be called now)."""
    mode = tool_mode(tools, choice)
    # tool_choice none: the tools are still described, as OpenAI's model and vLLM's chat template get them
    withheld = tools if tools and choice == "none" else None
    notice = withheld_tools_prompt(withheld, answer=False) if withheld else None
    if mode != ToolMode.NONE:
        assert tools is not None
        chosen = tools
        if isinstance(choice, NamedToolChoice):
            chosen = [t for t in tools if t.function.name == choice.function.name]
        elif isinstance(choice, AllowedToolsChoice):  # only these are described and may be called
            chosen = [t for t in tools if t.function.name in choice.names()]
        answer = response_schema(response_format)
        schema = envelope_schema(chosen, mode, parallel is not False, answer)
        offered = {t.function.name for t in chosen}
        functions = tuple(FunctionSchema(f"tools.{i}.function.parameters", t.function.name, t.function.parameters)
                          for i, t in enumerate(tools) if t.function.name in offered)
        return OutputPlan(Constraint("tools", json.dumps(schema)), mode, tools_prompt(chosen, mode),
                          answer is not None, param="tools", functions=functions)
    if structured is not None:
        if structured.json_ is not None:
            text = structured.json_ if isinstance(structured.json_, str) else json.dumps(closed(structured.json_))
            return OutputPlan(Constraint("json_schema", text), mode, notice, param=STRUCTURED)
        if structured.regex is not None:
            return OutputPlan(Constraint("regex", structured.regex), mode, notice, param=STRUCTURED)
        if structured.choice is not None:
            return OutputPlan(Constraint("choice", json.dumps(structured.choice)), mode, notice, param=STRUCTURED)
        if structured.grammar is not None:
            return OutputPlan(Constraint("grammar", structured.grammar), mode, notice, param=STRUCTURED)
        return OutputPlan(Constraint("json_object", ANY_JSON_OBJECT), mode, notice, param=STRUCTURED)
    if response_format is None or response_format.type == "text":
        if tool_history:
            prompt = withheld_tools_prompt(withheld, answer=True) if withheld else ANSWER_PROMPT
            return OutputPlan(Constraint("tools", json.dumps(ANSWER_SCHEMA)), ToolMode.ANSWER, prompt,
                              param="tools")
        return OutputPlan(None, mode, notice)  # tool_choice none: free text (any engine serves it)
    answer = response_schema(response_format)
    assert answer is not None
    kind = "json_object" if response_format.type == "json_object" else "json_schema"
    return OutputPlan(Constraint(kind, json.dumps(answer)), mode, notice)


def response_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object" or response_format.json_schema is None:
        return {"type": "object"}
    return closed(response_format.json_schema.schema_ or {"type": "object"})


@dataclass(frozen=True)
class Clash:
    """Why a request's output fields cannot be served as sent: a 400 naming `param` (and an OpenAI `code`)."""

    param: str | None
    message: str
    code: str | None = None


NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]+$")
"""OpenAI's rule for a function's and a json_schema response format's name (at most 64 characters)."""


def _name_clash(param: str, name: str | None) -> Clash | None:
    """OpenAI's 400 for a function or json_schema `name` missing, too long, or with other characters."""
    if name is None:
        return Clash(param, f"Missing required parameter: '{param}'.", "missing_required_parameter")
    if len(name) > 64:
        return Clash(param, f"Invalid '{param}': string too long. Expected a string with maximum length 64, but "
                            f"got a string with length {len(name)} instead.", "string_above_max_length")
    if not NAME_PATTERN.fullmatch(name):
        return Clash(param, f"Invalid '{param}': string does not match pattern. Expected a string that matches "
                            f"the pattern '{NAME_PATTERN.pattern}'.", "invalid_value")
    return None


def _tools_clash(tools: list[ToolDef]) -> Clash | None:
    """OpenAI's 400s for the tools themselves: none at all, too many, a bad name, parameters that are
    not an object's schema (the arguments are an object: a function's root is ``type: "object"``)."""
    if not tools:
        return Clash(None, "[] is too short - 'tools'")
    if len(tools) > MAX_TOOLS:
        return Clash("tools", f"at most {MAX_TOOLS} tools are allowed")
    for i, tool in enumerate(tools):
        f = tool.function
        if (clash := _name_clash(f"tools.{i}.function.name", f.name)) is not None:
            return clash
        if f.parameters and (problem := object_root_problem(f.parameters)) is not None:
            return Clash(f"tools.{i}.function.parameters", f"Invalid schema for function {f.name!r}: {problem}",
                         "invalid_function_parameters")
    return None


MAX_SCHEMA_DEPTH = 124
"""How deeply a schema may nest (JSON levels: objects and arrays): the deepest the grammar compiler takes
(llguidance reads the schema 3 levels down in its grammar's JSON, with serde_json's 128-level recursion
limit; deeper was its 400 "recursion limit exceeded"). A tool's parameters sit ~10 levels further down, in
the envelope, where the compiler's own 400 still speaks. Checked first: past ~300 levels the gateway's and
the shard's recursive walks of a schema (`closed`, the strict-mode check) ran out of Python's stack, a 500
(a 502 from the shard) for a request that was only a bad schema."""


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether `value` nests more than `limit` JSON levels (objects and arrays), found without recursion
    and without walking past that level: the walk is as safe and as bounded for any body."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth == limit:
                return True
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return False


_TOO_DEEP = object()


def _beyond_recursion(text: str) -> bool:
    try:
        json.loads(text)
    except RecursionError:
        return True
    except ValueError:
        pass
    return False


def _depth_clash(response_format: ResponseFormat | None, structured: StructuredOutputs | None,
                 tools: list[ToolDef] | None) -> Clash | None:
    """A 400 for a schema nested deeper than MAX_SCHEMA_DEPTH, naming where the request holds it; checked
    before any recursive walk of the schema."""
    schemas: list[tuple[str, Any]] = [(f"tools.{i}.function.parameters", t.function.parameters)
                                      for i, t in enumerate(tools or [])]
    if response_format is not None and response_format.json_schema is not None:
        schemas.append(("response_format", response_format.json_schema.schema_))
    if structured is not None and isinstance(structured.json_, dict):
        schemas.append((STRUCTURED, structured.json_))
    elif structured is not None and isinstance(structured.json_, str) and _beyond_recursion(structured.json_):
        schemas.append((STRUCTURED, _TOO_DEEP))  # text too deep for json.loads itself: deeper than any limit
    for param, schema in schemas:
        if schema is _TOO_DEEP or nests_deeper(schema, MAX_SCHEMA_DEPTH):
            return Clash(param, f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep; at most "
                                f"{MAX_SCHEMA_DEPTH} are accepted", "grammar_too_large")
    return None


def check_output_fields(response_format: ResponseFormat | None, structured: StructuredOutputs | None,
                        tools: list[ToolDef] | None, choice: Any, parallel: bool | None = None) -> Clash | None:
    """What is wrong with a request's output fields (they contradict each other, a name or a schema is
    one OpenAI refuses, or a strict schema breaks strict mode's rules: data_plane/strict_schema.py), else
    None. `parallel`: the request's parallel_tool_calls."""
    if (clash := _depth_clash(response_format, structured, tools)) is not None:
        return clash
    if tools is not None and (clash := _tools_clash(tools)) is not None:
        return clash
    if parallel is not None and not tools:
        return Clash("parallel_tool_calls", "Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is "
                                            "only allowed when 'tools' are specified.")
    if choice is not None and choice != "none" and not tools:
        return Clash("tool_choice", "tool_choice needs tools")
    if isinstance(choice, NamedToolChoice) and tools and choice.function.name not in {
            t.function.name for t in tools}:
        return Clash("tool_choice", f"tool_choice names {choice.function.name[:128]!r}, which is not among the tools")
    if isinstance(choice, AllowedToolsChoice) and tools:
        unknown = sorted(choice.names() - {t.function.name for t in tools})
        if unknown:
            verb = "is" if len(unknown) == 1 else "are"
            return Clash("tool_choice", f"allowed_tools names {', '.join(map(repr, unknown))}, which {verb} not among the tools")
    if tools and len({t.function.name for t in tools}) != len(tools):
        return Clash("tools", "tool names must be unique")
    constrained = response_format is not None and response_format.type != "text"
    if constrained and structured is not None:
        return Clash("structured_outputs", "set response_format or structured_outputs, not both")
    mode = tool_mode(tools, choice)
    if mode != ToolMode.NONE and structured is not None:
        return Clash("structured_outputs", "structured_outputs cannot be combined with tools")
    return _strict_clash(response_format, tools)


def json_word_clash(response_format: ResponseFormat | None, texts: Iterable[str], responses: bool = False) -> Clash | None:
    """OpenAI's rule for JSON mode: a ``json_object`` format needs the word "json" (any case) in the
    messages, `texts` (in the Responses API, `responses`, the input's: the instructions do not count), or it
    is a 400 in its words. Served, such a request got ``{}`` or whitespace to the limit from a model not told
    to write JSON, and an app tested here failed on OpenAI. The gateway checks what the client sent (the
    shard gets a window, which may have dropped the message that said it)."""
    if response_format is None or response_format.type != "json_object" or any("json" in t.lower() for t in texts):
        return None
    if responses:
        return Clash("text.format", "Response input messages must contain the word 'json' in some form to use "
                                    "'text.format' of type 'json_object'.")
    return Clash("messages", "'messages' must contain the word 'json' in some form, to use 'response_format' of "
                             "type 'json_object'.")


def _strict_clash(response_format: ResponseFormat | None, tools: list[ToolDef] | None) -> Clash | None:
    """A 400 for a json_schema format without a good name, or a schema sent with ``strict: true`` that
    strict mode refuses (OpenAI's code and words)."""
    fmt = response_format.json_schema if response_format is not None and response_format.type == "json_schema" \
        else None
    if fmt is not None and (clash := _name_clash("response_format.json_schema.name", fmt.name)) is not None:
        return clash
    if fmt is not None and fmt.strict and fmt.schema_ is not None:
        problem = strict_schema_problem(fmt.schema_)
        if problem is not None:
            return Clash("response_format", f"Invalid schema for response_format {fmt.name!r}: {problem}",
                         "invalid_json_schema")
    for i, tool in enumerate(tools or []):
        f = tool.function
        if f.strict and f.parameters is not None:
            problem = strict_schema_problem(f.parameters)
            if problem is not None:
                return Clash(f"tools.{i}.function.parameters", f"Invalid schema for function {f.name!r}: {problem}",
                             "invalid_function_parameters")
    return None
