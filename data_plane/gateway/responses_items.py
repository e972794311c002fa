"""The Responses API's wire shapes, and their translation to and from the chat request path.

    req = parse_responses_request(raw, content_type)     # 400 on unknown / unsupported fields
    chat = req.chat_request(history_len=0)                # a ChatCompletionRequest (same checks as chat)
    items = input_items(req.input)                        # input as items (data_plane/gateway/responses_input.py)
    body = response_object(resp_id, req, output, usage)   # what POST/GET /v1/responses return

The Responses API is a translation layer over the chat request path (data_plane/gateway/chat.py):
`instructions` -> a leading system message, message items -> chat messages, `text.format` ->
`response_format`, function `tools` -> `tools`, `function_call` / `function_call_output` items ->
an assistant message with `tool_calls` / a `tool` message. Whatever the chat path supports, this
supports; what it rejects comes back as the same 400 naming the Responses field.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from data_plane.common.errors import InvalidRequest, PermissionDenied, SwitchboardError, UnsupportedParameter
from data_plane.gateway.responses_calls import call_status, chat_function, check_call_outputs, check_choice_fields
from data_plane.gateway.responses_input import content_part, items_to_messages, new_id
from data_plane.protocol import ChatCompletionRequest
from data_plane.request_checks import (
    REASONING_EFFORTS,
    WholeNumber,
    check_metadata,
    check_one_of,
    json_body,
    json_type,
    validated,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDABLE = ("code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
              "message.input_image.image_url", LOGPROBS_INCLUDE, "reasoning.encrypted_content",
              "web_search_call.action.sources", "web_search_call.results")
"""OpenAI's `include` values (any other is its 400 "Invalid value")."""
SUMMARIES = ("auto", "concise", "detailed")
"""OpenAI's values of `reasoning.summary`."""
REASONING_CONTEXTS = ("auto", "current_turn", "all_turns")  # `reasoning.context`'s (as `mode`, a no-op here)
FORMAT_FIELDS = {"text": {"type"}, "json_object": {"type"},
                 "json_schema": {"type", "name", "schema", "strict", "description"}}
"""The fields of each `text.format` type (OpenAI's); another type is the chat path's 400."""


class ContextManagement(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["compaction"]
    compact_threshold: WholeNumber | None = Field(default=None, ge=64)


class AccessPrograms(BaseModel):
    """OpenAI's domain access programs: only Standard here (the Daybreak programs need a model that has them)."""
    model_config = ConfigDict(extra="forbid")
    cyber: Literal["standard", "daybreak_blue", "daybreak_red"] | None = None


class BackgroundOptions(BaseModel):
    """How a background response runs: every one here starts as soon as it can, so any completion window is
    met (a discounted window changes no price here); `continuation_id` (related requests) is a no-op."""
    model_config = ConfigDict(extra="forbid")
    completion_window: Literal["soonest", "2h", "8h"] | None = None
    continuation_id: str | None = Field(default=None, min_length=1, max_length=256)


class ImageOptions(BaseModel):
    """Request-level image options: this model reads text only, so no image is ever compressed."""
    model_config = ConfigDict(extra="forbid")
    context_compression: Literal["auto", "enabled", "disabled"] | None = None


def check_image(image: ImageOptions | None) -> None:
    """A 400 for `image.context_compression` "enabled": it requires compression support this model lacks."""
    if image is not None and image.context_compression == "enabled":
        raise UnsupportedParameter("image.context_compression 'enabled' requires image context compression, which "
                                   "this model does not support (it takes no images); use 'auto' or 'disabled'.",
                                   param="image.context_compression")


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Fields OpenAI defines that we do not implement are accepted only at
    their neutral value (400 naming them otherwise); unknown fields are a 400 too."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(default="", max_length=256)
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=128)
    conversation: Annotated[str, Field(min_length=1)] | dict[str, Any] | None = None
    store: bool | None = True
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    max_output_tokens: WholeNumber | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: WholeNumber | None = None
    """Not OpenAI's (it has none on responses); vLLM's extension, passed to the chat path."""
    ignore_eos: bool | None = None
    """vLLM's extension (guidellm sends it for fixed output lengths), passed to the chat path."""
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    context_management: list[ContextManagement] | None = None
    cache: dict[str, Any] | None = None
    """LiteLLM's per-request cache controls: {"no-cache": true} skips the response cache."""
    context_recall: bool = True
    """Switchboard's extension: with truncation "auto", re-inject the dropped turns most relevant to
    the new message (data_plane/gateway/memory.py); false: a plain sliding window."""
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None  # no-ops, as on the chat path (the Agents SDK sends this
    moderation: dict[str, Any] | None = None  # one from ModelSettings); the gateway's safety filters always apply
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    """Accepted (OpenAI's values); every request runs at this server's one processing tier, "default"."""
    include: list[str] | None = None
    """Only ``message.output_text.logprobs`` (the chat path's logprobs on the output text); any
    other includable names output this server never makes (a 400 naming it)."""
    top_logprobs: WholeNumber | None = Field(default=None, ge=0, le=20)
    background: bool | None = None
    """Run it in the gateway, apart from this connection (data_plane/gateway/responses_background.py)."""
    background_options: BackgroundOptions | None = None
    access_programs: AccessPrograms | None = None
    image: ImageOptions | None = None
    reasoning: dict[str, Any] | None = None  # a no-op as chat's reasoning_effort (the Response says effort null)
    max_tool_calls: WholeNumber | None = Field(default=None, ge=0)  # a no-op: it counts built-in tools' calls
    prompt: Any = None  # accepted only at its neutral value (see check_supported)
    stop: Any = None
    """Not a Responses field; guidellm sends `"stop": null` beside `ignore_eos`, as vLLM accepts."""

    _metadata = field_validator("metadata")(check_metadata)

    def check_supported(self) -> None:
        for name in ("prompt", "stop"):
            if getattr(self, name) is not None:
                raise UnsupportedParameter(f"Unsupported parameter: {name!r} is not supported with this model.", param=name)
        check_include(self.include or [])
        reasoning = self.reasoning or {}
        for key in set(reasoning) - {"effort", "summary", "generate_summary", "context", "mode"}:
            raise InvalidRequest(f"Unrecognized request argument supplied: reasoning.{key}", param=f"reasoning.{key}",
                                 code="unsupported_parameter")
        for key, options in (("effort", REASONING_EFFORTS), ("summary", SUMMARIES), ("generate_summary", SUMMARIES),
                             ("context", REASONING_CONTEXTS)):
            check_one_of(reasoning.get(key), options, f"reasoning.{key}")  # no-ops, still OpenAI's values
        if reasoning.get("mode") is not None and not isinstance(reasoning["mode"], str):  # any name: "standard", "pro"
            raise InvalidRequest(f"Invalid type for 'reasoning.mode': expected a string, but got "
                                 f"{json_type(reasoning['mode'])} instead.", param="reasoning.mode", code="invalid_type")
        if self.previous_response_id and self.conversation:
            raise InvalidRequest("Mutually exclusive parameters. Ensure you are only providing one of: "
                                 "'previous_response_id' or 'conversation'.", code="mutually_exclusive_parameters")
        if self.stream_options and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        self._check_options()

    def _check_options(self) -> None:
        """`access_programs`, `background_options` and `image` at the values this server serves (the classes'
        docstrings); a 400 naming the field for one it cannot honour, or one OpenAI refuses."""
        cyber = self.access_programs.cyber if self.access_programs else None
        if cyber not in (None, "standard"):  # OpenAI's: "Requests that require unavailable Daybreak access return 403"
            raise PermissionDenied(f"access_programs.cyber {cyber!r} is not available with this model; only "
                                   "'standard'.", param="access_programs.cyber")
        check_image(self.image)
        window = self.background_options.completion_window if self.background_options else None
        if window in ("2h", "8h"):  # OpenAI's: a discounted window needs background, Standard processing, no stream
            needs = ("background: true" if not self.background else "stream false or omitted" if self.stream
                     else "Standard processing (service_tier 'auto' or 'default')"
                     if self.service_tier not in (None, "auto", "default") else None)
            if needs:
                raise InvalidRequest(f"background_options.completion_window {window!r} requires {needs}.",
                                     param="background_options.completion_window", code="invalid_value")

    @property
    def with_logprobs(self) -> bool:
        """Whether the output text carries logprobs (OpenAI's `include`; `top_logprobs` alone does not)."""
        return LOGPROBS_INCLUDE in (self.include or ())

    @property
    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, dict):
            conv = self.conversation.get("id")
            if not isinstance(conv, str) or not conv:
                raise InvalidRequest("conversation.id must be a non-empty string", param="conversation")
            return conv
        return self.conversation

    @property
    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as the chat path's `response_format` (None: plain text)."""
        fmt = (self.text or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise InvalidRequest("text.format must be an object", param="text.format")
        unknown = [f"text.{k}" for k in self.text or {} if k not in ("format", "verbosity")]
        if (verbosity := (self.text or {}).get("verbosity")) not in (None, "low", "medium", "high"):
            raise InvalidRequest(f"Invalid value: {verbosity!r}. Supported values are: 'low', 'medium' and 'high'.",
                                 param="text.verbosity", code="invalid_value")
        if fmt:  # (a type not among them is the chat path's 400, naming text.format.type)
            known = FORMAT_FIELDS.get(str(fmt.get("type")), set(fmt))
            unknown += [f"text.format.{k}" for k in fmt if k not in known]
        if unknown:  # as the body's other unknown fields: a 400, never a setting silently dropped
            raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                                 code="unsupported_parameter")
        if not fmt or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_schema":  # Responses flattens what chat nests under json_schema
            for required in ("name", "schema"):  # OpenAI's 400s: no silently unconstrained output
                if fmt.get(required) is None:
                    raise InvalidRequest(f"Missing required parameter: 'text.format.{required}'.",
                                         param=f"text.format.{required}", code="missing_required_parameter")
            schema = {k: v for k, v in fmt.items() if k in ("name", "schema", "strict", "description")}
            return {"type": "json_schema", "json_schema": schema}
        return dict(fmt)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """Function tools in the chat path's shape; other tool types are a 400."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise UnsupportedParameter(f"tool type {tool.get('type')!r} is not supported; only 'function'",
                                           param=f"tools[{i}].type")
            out.append({"type": "function", "function": chat_function(tool, i)})
        return out

    def chat_tool_choice(self) -> Any:
        """The Responses form of a choice in chat's: a function is named at the top level there, and an
        `allowed_tools` choice holds its mode and tools beside its type (function tools only here)."""
        choice = self.tool_choice
        check_choice_fields(choice)
        if isinstance(choice, dict) and choice.get("type") == "function":
            return {"type": "function", "function": {"name": choice.get("name")}}
        if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
            allowed = choice.get("tools")
            for i, tool in enumerate(allowed if isinstance(allowed, list) else []):
                if not isinstance(tool, dict) or tool.get("type") != "function":
                    kind = tool.get("type") if isinstance(tool, dict) else None
                    raise UnsupportedParameter(f"allowed tool type {kind!r} is not supported; only 'function'",
                                               param=f"tool_choice.tools[{i}].type")
            return {"type": "allowed_tools", "allowed_tools": {
                "mode": choice.get("mode"),
                "tools": [{"type": "function", "function": {"name": t.get("name")}} for t in allowed]
                if isinstance(allowed, list) else allowed}}
        return choice

    def turn_request(self, history: list[dict[str, Any]], new: list[dict[str, Any]],
                     summary: Callable[[str], str]) -> tuple[ChatCompletionRequest, int]:
        """The chat request of a whole turn: the instructions, the stored `history`, the `new` input (a
        function_call_output must answer a call the two hold; `summary` opens a compaction item); and how
        many of its messages are history (not counted against the per-request message limit). A create
        and an input-token count build the same prompt with it."""
        check_call_outputs(history + new)
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        earlier = items_to_messages(history, summary)
        messages = system + earlier + items_to_messages(new, summary)
        if not messages and new:  # every item withheld (reasoning): "Invalid 'input': empty array" was untrue
            raise InvalidRequest("input holds only reasoning items, which this model does not take (they are "
                                 "withheld from it): add a message for it to respond to", param="input")
        return self.chat_request(messages), len(earlier)

    def chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this response is generated by: `messages` are instructions + input."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": bool(self.stream)}
        for name, value in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("seed", self.seed), ("ignore_eos", self.ignore_eos),
                            ("response_format", self.response_format),
                            ("tools", self.chat_tools()), ("tool_choice", self.chat_tool_choice()),
                            ("parallel_tool_calls", self.parallel_tool_calls), ("user", self.user),
                            ("cache", self.cache)):
            if value is not None:
                body[name] = value
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.with_logprobs:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        if not self.tools and body.get("tool_choice") in ("auto", "none"):
            body.pop("tool_choice")  # the Agents SDK names a choice without tools
        if not self.tools:
            body.pop("parallel_tool_calls", None)
        try:
            req = validated(ChatCompletionRequest, body)
            req.check_supported()
        except InvalidRequest as exc:  # the chat path's verdict, in the Responses API's names
            raise in_responses_terms(exc)
        return req


CHAT_TO_RESPONSES = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input"}


def in_responses_terms(exc: SwitchboardError, chat: bool = True) -> SwitchboardError:
    """`exc` (a chat request's error: the gateway's checks, or the shard's, such as a schema its grammar
    cannot compile) naming the Responses body's field, in its `param` and its message; others unchanged.
    With `chat` False `exc` is about the Responses body itself: its names stay, only indexes are OpenAI's.

        except SwitchboardError as exc:
            raise in_responses_terms(exc) from None
    """
    if getattr(exc, "_responses_terms", False):  # already named so (the body's errors pass through here twice)
        return exc
    exc._responses_terms = True  # type: ignore[attr-defined]
    renamed = _responses_param(exc.param, chat)
    if exc.param and renamed and renamed != exc.param:
        message = exc.message.replace(repr(exc.param), repr(renamed))
        if message.startswith(exc.param + ":"):  # a validation error: "<param>: <what is wrong>"
            message = renamed + message[len(exc.param):]
        exc.message, exc.param = message, renamed
    if chat:
        exc.message = re.sub(r"\bmax_tokens\b", "max_output_tokens", exc.message)  # "lower max_tokens"
    return exc


CHAT_FIELDS = {**CHAT_TO_RESPONSES, "max_completion_tokens": "max_output_tokens"}
"""Chat Completions fields an app moving to the Responses API may still send, and their Responses names."""


def _body_error(exc: SwitchboardError) -> SwitchboardError:
    """A Responses body's own validation error, in its own names (a chat field sent here, `max_tokens`, was
    reported as its Responses twin, `max_output_tokens`, being unrecognized), saying what a chat field is
    called here."""
    exc = in_responses_terms(exc, chat=False)
    if exc.param in CHAT_FIELDS and exc.message.startswith("Unrecognized request argument"):
        exc.message += f" (a Chat Completions field: the Responses API's is '{CHAT_FIELDS[exc.param]}')"
    return exc


def _responses_param(param: str | None, chat: bool = True) -> str | None:
    """A chat request's parameter name as the Responses API calls it (`chat` False: a Responses body's
    own name, with OpenAI's indexes)."""
    if param is None:
        return None
    if not chat:
        return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", param)
    if param.startswith("response_format.json_schema."):  # text.format is flat: no json_schema level
        return "text.format." + param.removeprefix("response_format.json_schema.")
    # a Responses function tool (and a named choice) is flat: no `function` level
    param = re.sub(r"^(tools\.\d+|tool_choice)\.function(?=\.|$)", r"\1", param)
    head, dot, rest = param.partition(".")
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", CHAT_TO_RESPONSES.get(head, head) + dot + rest)  # tools[0].name


def check_include(values: list[str]) -> None:
    """OpenAI's 400 for an `include` value it does not define, naming it; for one it defines but this
    server never makes (anything but the output text's logprobs), a 400 saying so."""
    for i, value in enumerate(values):
        if value not in INCLUDABLE:
            supported = ", ".join(repr(v) for v in INCLUDABLE)
            raise InvalidRequest(f"Invalid value: {value!r}. Supported values are: {supported}.",
                                 param=f"include[{i}]", code="invalid_value")
        if value != LOGPROBS_INCLUDE:
            raise UnsupportedParameter(f"include value {value!r} is not supported; only {LOGPROBS_INCLUDE!r}",
                                       param=f"include[{i}]")


def text_settings(text: dict[str, Any] | None) -> dict[str, Any]:
    """The Response object's `text`: the request's, with OpenAI's defaults (plain text, medium verbosity)."""
    return {"format": {"type": "text"}, "verbosity": "medium", **{k: v for k, v in (text or {}).items() if v}}


def parse_responses_request(raw: bytes, content_type: str | None) -> ResponsesRequest:
    """Decode and validate a Responses body; every failure is a 4xx SwitchboardError."""
    try:
        req = validated(ResponsesRequest, json_body(raw, content_type))  # strict: "stream": "no" is a 400
    except SwitchboardError as exc:  # OpenAI's indexes: context_management[0].type, not context_management.0.type
        raise _body_error(exc) from None
    req.check_supported()
    return req


def text_logprobs(entries: list[dict[str, Any]] | None, *, with_bytes: bool = True) -> list[dict[str, Any]]:
    """The chat path's logprobs entries as the Responses API's: `output_text.logprobs` has the chat
    shape (token, bytes, logprob, top_logprobs); the stream's text delta/done events have no bytes
    (OpenAI's ResponseTextDeltaEvent.Logprob)."""
    def entry(e: dict[str, Any]) -> dict[str, Any]:
        out = {"token": e["token"], "logprob": e["logprob"]}
        if with_bytes:
            out["bytes"] = e.get("bytes") or []
        return out

    return [{**entry(e), "top_logprobs": [entry(t) for t in e.get("top_logprobs") or []]} for e in entries or ()]


def output_items(message: dict[str, Any], status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A chat completion's message as Responses output items: function_call items, then the text
    (with `logprobs`, the chat path's entries, when the request included them)."""
    items: list[dict[str, Any]] = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        items.append({"type": "function_call", "id": new_id("fc"), "status": call_status(fn.get("arguments", ""), status),
                      "call_id": call.get("id") or new_id("call"), "name": fn.get("name", ""),
                      "arguments": fn.get("arguments", "")})
    text = message.get("content")
    if text or not items:
        part = content_part("output_text", text or "")
        part["logprobs"] = text_logprobs(logprobs)
        items.append({"type": "message", "id": new_id("msg"), "status": status, "role": "assistant",
                      "content": [part]})
    return items


def response_usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """A chat usage body in the Responses shape (cached tokens included; `cache_write_tokens`, which OpenAI's
    schema requires since openai-python 2.45, is 0: filling the prefix cache is not billed here)."""
    u = chat_usage or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    prompt, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def response_object(resp_id: str, req: ResponsesRequest, model: str, *, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, created_at: float | None = None,
                    incomplete: str | None = None, items: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Response object (OpenAI's shape) for POST, GET and the stream's events: the request's settings
    echoed, `completed_at` once it is completed, `service_tier` the one it ran at. `items`: the input as
    stored (input_items: a reasoning item sent without an id has the one it is stored under), else `req.input`."""
    conversation = req.conversation_id
    return {
        "id": resp_id, "object": "response", "created_at": int(created_at or time.time()), "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "background": bool(req.background), "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "store": req.store is not False, "temperature": req.temperature, "top_p": req.top_p,
        "text": text_settings(req.text), "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [], "truncation": req.truncation or "disabled", "usage": usage,
        "user": req.user, "metadata": req.metadata or {}, "top_logprobs": req.top_logprobs,
        "conversation": {"id": conversation} if conversation else None, "max_tool_calls": req.max_tool_calls,
        "prompt_cache_key": req.prompt_cache_key, "prompt_cache_retention": req.prompt_cache_retention,
        "safety_identifier": req.safety_identifier, "service_tier": "default",
        "access_programs": req.access_programs.model_dump(exclude_none=True) or None if req.access_programs else None,
        "image": {"context_compression": "disabled"} if req.image else None,  # the effective policy: no images
        **withheld_reasoning(req.input if items is None else items),
    }


def withheld_reasoning(value: str | list[dict[str, Any]]) -> dict[str, Any]:
    """The Response's `input_transformations` for the request's reasoning items (OpenAI's: each reasoning input
    withheld from the model, in input order; this model does not reason, so every one is), or nothing."""
    removed = [{"id": item.get("id"), "type": "reasoning", "action": "removed", "reason": "model_mismatch"}
               for item in value if isinstance(item, dict) and item.get("type") == "reasoning"] \
        if isinstance(value, list) else []
    return {"input_transformations": removed} if removed else {}


def output_text(output: list[dict[str, Any]]) -> str:
    return "".join(p.get("text", "") for item in output if item["type"] == "message" for p in item["content"])
