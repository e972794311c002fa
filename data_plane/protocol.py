"""OpenAI chat-completions wire schemas, shared by the shard and the gateway (a request's messages:
data_plane/chat_messages.py).

    req = ChatCompletionRequest.model_validate(body)   # 400 on unknown / bad fields
    req.check_supported()                              # 400 naming an unsupported param
    messages = req.plain_messages()                    # [{"role": ..., "content": str}]

Extension fields the gateway sets on its way to a shard (any OpenAI-compatible server
ignores what it does not know; ours reads them): ``priority`` (lower runs first),
``request_id`` and ``deadline`` (unix seconds after which work still waiting for a slot is abandoned), and vLLM's
``cache_salt`` (the prefix-cache scope: the gateway sets the tenant, so reuse never crosses
tenants).
"""

from __future__ import annotations

import enum
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from data_plane.chat_messages import ChatMessage, tool_call_list, valid_unicode
from data_plane.common.errors import InvalidRequest, UnsupportedParameter
from data_plane.legacy_functions import FunctionChoice, as_tools, check_supported
from data_plane.request_checks import WholeNumber, check_metadata, json_body, validated
from data_plane.structured import (
    FunctionDef,
    OutputPlan,
    ResponseFormat,
    StructuredOutputs,
    ToolChoice,
    ToolDef,
    check_output_fields,
    output_plan,
)
from data_plane.tool_calls import envelope_text, holds_tool_calls

MAX_STOP_SEQUENCES = 4
TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key (the engine checks it against its vocabulary)
MAX_STOP_LENGTH = 256


class UsageChunks(enum.IntEnum):
    """Which chunks of a stream carry usage."""

    NONE = 0
    FINAL = 1
    """`include_usage`: a last chunk with the whole usage (every other chunk's ``usage`` null)."""
    EVERY = 2
    """vLLM's `continuous_usage_stats` (with `include_usage`, as vLLM reads it): every chunk carries the
    usage so far too."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's extension: usage (so far) on every chunk; the gateway uses it to resume streams."""

    def usage_chunks(self) -> UsageChunks:
        if not self.include_usage:
            return UsageChunks.NONE
        return UsageChunks.EVERY if self.continuous_usage_stats else UsageChunks.FINAL
    include_obfuscation: bool | None = None
    """OpenAI's padding of stream chunks against size side channels (the openai SDK sends it): accepted;
    chunks here are not padded, whatever it says (None: not sent, and not passed on to the shard)."""


# Parameters OpenAI defines that we accept only at their neutral value.
_NEUTRAL: dict[str, Any] = {
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
}
MAX_N = 8
SERVICE_TIER = "default"
"""The tier a reply says served it (OpenAI's `service_tier`): whatever was asked, all are served alike here."""
MAX_TOP_LOGPROBS = 20
INPUT_TOKENS_PATH = "/v1/chat/completions/input_tokens"
"""A shard's count of a chat request's prompt tokens (the same body; nothing generated)."""


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(default="", max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    """0..1 as OpenAI's: 0 keeps the one most likely token (the gateway sends it as top_k 1, vLLM refusing 0)."""
    top_k: WholeNumber | None = Field(default=None, ge=-1, le=100_000)  # vLLM's: 0 or -1, every token
    max_tokens: WholeNumber | None = Field(default=None, ge=1, le=1_000_000)
    max_completion_tokens: WholeNumber | None = Field(default=None, ge=1, le=1_000_000)
    stop: str | list[str] | None = None
    seed: WholeNumber | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    """null (OpenAI's spec makes it nullable) is false: `_stream`."""
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    # Structured outputs and tools (shapes and the constraint they make: data_plane/structured.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    """vLLM's extension: exactly one of json (schema), regex, choice, grammar, json_object."""
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Sampling.
    n: WholeNumber | None = Field(default=None, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    """vLLM's: > 1 discourages tokens already in the prompt or output."""
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: WholeNumber | None = Field(default=None, ge=0, le=1_000_000)
    """vLLM's: no EOS before this many output tokens."""
    ignore_eos: bool | None = None
    """vLLM's: EOS does not end the output (benchmarks fix output lengths with it)."""
    logprobs: bool | None = None
    top_logprobs: WholeNumber | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    logit_bias: dict[str, float] | None = None
    # Fields the official SDK sends, accepted deliberately (README "Structured outputs, tools, sampling"):
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    """A no-op: our prefix cache finds shared prefixes by content (and routing by session)."""
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    """A no-op: retention is the prefix cache's LRU."""
    prompt_cache_options: Any = None
    """A no-op (as above)."""
    safety_identifier: str | None = Field(default=None, max_length=256)
    """Recorded nowhere (it would be a user id in our logs); accepted so SDK calls work."""
    verbosity: Literal["low", "medium", "high"] | None = None
    """A no-op: the model has no verbosity control."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    """A no-op: the model does not reason."""
    moderation: Any = None
    """A no-op: the gateway's safety filters always apply."""
    functions: list[FunctionDef] | None = None  # the deprecated tools and tool_choice: data_plane/legacy_functions.py
    function_call: FunctionChoice | None = None
    # Accepted only at neutral values (see check_supported).
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    cache: dict[str, Any] | None = None
    """LiteLLM's per-request cache controls: {"no-cache": true} skips the response cache's lookup,
    {"no-store": true} its write (data_plane/gateway/response_cache.py)."""
    # Switchboard extensions (set by the gateway; harmless for other servers).
    priority: WholeNumber | None = Field(default=None, ge=-1_000_000, le=1_000_000)
    request_id: str | None = Field(default=None, max_length=128)
    deadline: float | None = None
    session_id: str | None = Field(default=None, max_length=128)
    cache_salt: str | None = Field(default=None, max_length=256)
    kv_replicas: WholeNumber | None = Field(default=None, ge=1, le=16)
    """Cache nodes that keep this session's KV blocks (the tier's transcript replication)."""
    kv_ttl_s: float | None = Field(default=None, gt=0, le=30 * 24 * 3600.0)
    """Their TTL: the session's (the blocks expire with it)."""
    # vLLM-compatible continuation: the last (assistant) message is continued, not answered.
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # The legacy Completions API's raw prompt (data_plane/gateway/completions.py), from the gateway only:
    raw_prompt: bool = False
    """The messages' text is the prompt as it is, no chat template (continued as one text on a resume)."""
    prompt_token_ids: list[WholeNumber] | None = Field(default=None, max_length=1_000_000)
    """A prompt given as token ids: these, then the messages' text (a resume's output so far)."""
    prompt_logprobs: WholeNumber | None = Field(default=None, ge=0, le=5)
    """The prompt tokens' logprobs and this many alternatives each (vLLM's; the legacy API's echo + logprobs):
    sent back on each choice's first chunk as `logprobs.prompt` (data_plane/shard/engines/prompt_logprobs.py)."""

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_SEQUENCES:  # OpenAI's words: request_checks.openai_words
            raise PydanticCustomError("too_long", "too many stop sequences", {"max_length": MAX_STOP_SEQUENCES})
        for s in stops:
            valid_unicode(s)
            if not s:
                raise ValueError("stop sequences must be non-empty")
            if len(s) > MAX_STOP_LENGTH:
                raise ValueError(f"stop sequences must be at most {MAX_STOP_LENGTH} characters")
        return stops

    _metadata = field_validator("metadata")(check_metadata)

    @field_validator("stream", mode="before")
    @classmethod
    def _stream(cls, v: Any) -> Any:
        return False if v is None else v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        if len(v) > 300:
            raise ValueError("at most 300 logit_bias entries are allowed")
        for key, bias in v.items():
            # ASCII digits only: str.isdigit() takes "²" (int() refuses it: a 500 on the shard) and "٥" (5)
            if not TOKEN_ID.fullmatch(key):
                raise PydanticCustomError("openai", "Invalid key in 'logit_bias': {key}. You should only be "
                                          "submitting non-negative integers.", {"key": key[:32]})
            if not -100.0 <= bias <= 100.0:
                raise ValueError("logit_bias values must be in -100..100")
        return v

    def check_supported(self, continues: bool = False) -> None:
        """Reject OpenAI parameters we do not implement, naming them (400). `continues`: the request goes
        on with a server-side session (X-Session-Id), whose transcript may hold the tool calls its `tool`
        messages answer (the app sends only the new messages: the results)."""
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name)
            if value not in neutral:
                raise UnsupportedParameter(
                    f"Unsupported parameter: {name!r} is not supported with this model.", param=name
                )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        called: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.content is None and m.role != "assistant":  # OpenAI: only an assistant's may be null
                raise InvalidRequest(f"messages.{i}.content: a {m.role} message needs content",
                                     param=f"messages.{i}.content")
            # OpenAI's 400 for every role since 2026-08 (langchain-ai/langchainjs#11416). Served here, deliberately,
            # where real clients send one and it was served before: an assistant's (LangChain and n8n write a
            # tool-call-only turn so), as null; a tool's (LangChain's ToolMessage of a tool that returned an
            # empty list, a search with no hits), as an empty result
            if m.content == [] and m.role not in ("assistant", "tool"):
                raise InvalidRequest(f"Invalid 'messages.{i}.content': empty array. Expected an array with minimum "
                                     "length 1, but got an empty array instead.", param=f"messages.{i}.content",
                                     code="empty_array")
            m.text(f"messages.{i}")  # its content parts, checked here where the message's index is known
            if m.role == "assistant" and m.tool_calls:
                called.update(c["id"] for c in tool_call_list(m.tool_calls, f"messages.{i}"))
            elif m.role == "tool" and (not m.tool_call_id or (m.tool_call_id not in called and not continues)):
                raise InvalidRequest("messages with role 'tool' must answer a preceding assistant message's "
                                     "tool_calls (tool_call_id)", param="messages")
        clash = check_output_fields(self.response_format, self.structured_outputs, self.tools, self.tool_choice,
                                    self.parallel_tool_calls)
        if clash is not None:
            raise InvalidRequest(clash.message, param=clash.param, code=clash.code)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        if self.continue_final_message and (self.add_generation_prompt or (
                self.messages[-1].role != "assistant" and not self.raw_prompt)):
            raise InvalidRequest(
                "continue_final_message needs add_generation_prompt=false and a final assistant message",
                param="continue_final_message",
            )
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise InvalidRequest(
                "max_tokens and max_completion_tokens disagree; set one",
                param="max_completion_tokens",
            )
        if self.min_tokens and self.output_limit is not None and self.min_tokens > self.output_limit:
            # vLLM's 400 too: a shard cannot both stop at max_tokens and generate min_tokens
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must be less than or equal to "
                f"{'max_completion_tokens' if self.max_completion_tokens else 'max_tokens'} ({self.output_limit})",
                param="min_tokens",
            )

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def output_plan(self) -> OutputPlan:
        """The constraint, tool mode and tools prompt of this request (data_plane/structured.py)."""
        history = [{"role": m.role, "content": m.content, "tool_calls": m.tool_calls} for m in self.messages]
        return output_plan(self.response_format, self.structured_outputs, self.tools, self.tool_choice,
                           self.parallel_tool_calls, holds_tool_calls(history))

    def plain_messages(self, tools_prompt: bool = True) -> list[dict[str, str]]:
        """Messages as role/content strings, ready for a chat template: an assistant message's tool calls
        are written as the tool envelope the model produced, a tool result as a user message naming the tool
        (the default template has no tool role); with tools a system message describing them comes first (with
        tool_choice none too: the model sees the tools it may not call, data_plane/structured.py)."""
        out = []
        names: dict[str, str] = {}  # tool call id -> function name, from the assistant messages so far
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            content = m.text()
            if role == "assistant" and m.tool_calls:
                content = envelope_text(content or None, tool_call_list(m.tool_calls))
            elif role == "tool":  # the template has no tool role: the result comes back as the user's turn
                role = "user"
                # (a call in a session's transcript: unknown, or the name a legacy function message gave)
                name = names.get(m.tool_call_id or "") or m.name
                content = f"The tool {name} returned: {content}" if name else f"The tool returned: {content}"
            if m.role == "assistant" and m.tool_calls:
                names.update({c.get("id", ""): (c.get("function") or {}).get("name", "") for c in m.tool_calls
                              if isinstance(c, dict)})
            out.append({"role": role, "content": content})
        prompt = self.output_plan().tools_prompt if tools_prompt else None
        if prompt:
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out


class ShardRequest(ChatCompletionRequest):
    """The request the gateway sends a shard, typed end to end and never mutated.

        req = ShardRequest(messages=[ChatMessage(role="user", content="hi")], max_tokens=16, stream=True)
        payload = json.dumps(req.wire()).encode()       # what goes on the wire
        resumed = req.model_copy(update={"max_tokens": 8})   # a changed copy (data_plane/routing/resume.py)

    Built once per request by the gateway (data_plane/gateway/phases.py shard_request); the shard parses the wire
    form back as a ChatCompletionRequest. Only the fields that were given go on the wire."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def wire(self) -> dict[str, Any]:
        """The JSON body: every field that was set and is not None (nested models by their wire names)."""
        return self.model_dump(include=set(self.model_fields_set), exclude_none=True, by_alias=True)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (OpenAI's field)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    def wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion_body(
    *,
    completion_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: Usage,
    fingerprint: str | None,
    created: int | None = None,
) -> dict[str, Any]:
    """One chat.completion. `fingerprint`: the serving shard's `system_fingerprint`, what decides its
    numerics (data_plane/shard/engines/fingerprint.py; None: no shard said)."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "system_fingerprint": fingerprint,
        "service_tier": SERVICE_TIER,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage.wire(),
    }


def chunk_body(
    *,
    completion_id: str,
    model: str,
    created: int,
    fingerprint: str | None,
    delta: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    usage: Usage | None = None,
    empty_choices: bool = False,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One chat.completion.chunk. `include_usage` (the request's ``stream_options.include_usage``): the
    chunk carries ``usage``, null until the final usage chunk, as OpenAI sends it (the spec types it
    nullable, not optional, and clients built from the spec read the key). `fingerprint`: as in
    `completion_body`."""
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "service_tier": SERVICE_TIER,
        "choices": []
        if empty_choices
        else [{"index": index, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if usage is not None or include_usage:
        body["usage"] = usage.wire() if usage is not None else None
    return body


ROLE_DELTA: dict[str, Any] = {"role": "assistant", "content": ""}
"""The delta that opens a choice's stream, as OpenAI sends it before text."""


def opening_deltas(first: dict[str, Any]) -> list[dict[str, Any]]:
    """The deltas that open a choice whose first delta is `first`, as OpenAI streams them. A reply that
    starts with a tool call opens with one delta, ``{"role": "assistant", "content": null, "tool_calls":
    [...]}``: a stream helper (the openai SDK's ``ChatCompletionStreamState``) then assembles content
    None, as the non-streamed message has it; it assembled "" from the ``content: ""`` a text reply opens
    with (`ROLE_DELTA`, a delta of its own before the first text)."""
    if "tool_calls" in first or "function_call" in first:
        return [{"role": "assistant", "content": None, **first}]
    return [dict(ROLE_DELTA), first]


class Openings:
    """A stream's choices opened in index order. The openai SDK's stream helper (`ChatCompletionStreamState`,
    behind `client.chat.completions.stream()`) keeps its snapshot's choices in a list and reads a chunk's
    `index` as a position in it: with `n` > 1, a choice whose first delta came before a lower one's (that
    one's first text held back by a stop string's prefix or the output filter, or nothing until its end)
    made it raise IndexError, or add the choice's text to another's. Now a choice opens with the role alone
    when a higher one opens first (its content is then whatever it sends first: text, or none beside a tool
    call, as `opening_deltas` gives them), and with `content: ""` at its end if it sent nothing."""

    def __init__(self) -> None:
        self.count = 0
        """Choices 0 .. count-1 are open."""
        self.bare: set[int] = set()
        """Choices opened ahead of their first delta that have sent no content since."""

    def deltas(self, index: int, delta: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
        """The (choice index, delta) pairs that send choice `index`'s next `delta`."""
        if index >= self.count:
            return self._below(index) + [(index, d) for d in opening_deltas(delta)]
        if delta.keys() & {"content", "tool_calls", "function_call"}:
            self.bare.discard(index)
        return [(index, delta)]

    def ending(self, index: int) -> list[tuple[int, dict[str, Any]]]:
        """The (choice index, delta) pairs to send before choice `index`'s finish: a choice that sent
        nothing still opens, with the `""` a text reply opens with."""
        if index >= self.count:
            return self._below(index) + [(index, dict(ROLE_DELTA))]
        if index in self.bare:
            self.bare.discard(index)
            return [(index, {"content": ""})]
        return []

    def _below(self, index: int) -> list[tuple[int, dict[str, Any]]]:
        """Opens choice `index` and, role only, every lower one not open yet."""
        ahead = range(self.count, index)
        self.bare.update(ahead)
        self.count = index + 1
        return [(j, {"role": "assistant"}) for j in ahead]


DEFAULT_MAX_BODY_BYTES = 1 << 20


def parse_chat_request(raw: bytes, content_type: str | None, session: str | None = None, *,
                       client: bool = True) -> ChatCompletionRequest:
    """Decode and validate a chat-completions body (4xx SwitchboardError). `session`: X-Session-Id (or the body's
    `session_id`): it may hold the calls tool messages answer; it keeps whole turns: no continue_final_message
    from a `client` (a shard's resumes continue with sessions and tools: data_plane/routing/resume.py)."""
    req = validated(ChatCompletionRequest, json_body(raw, content_type))
    session = session or req.session_id
    req = as_tools(req, continues := bool(session) and session != "new")  # deprecated function calling: tools
    if client and req.continue_final_message and (session or req.tools):  # (the tools' reply is an envelope, not its text)
        raise InvalidRequest("continue_final_message cannot be used with a session or tools", param="continue_final_message")
    check_supported(req, continues)  # (its 400s in the legacy fields' terms when the body gave those)
    if client and (req.raw_prompt or req.prompt_token_ids is not None or req.prompt_logprobs is not None):
        # the gateway's, for POST /v1/completions
        name = ("raw_prompt" if req.raw_prompt else "prompt_token_ids" if req.prompt_token_ids is not None
                else "prompt_logprobs")
        raise UnsupportedParameter(f"Unrecognized request argument supplied: {name}", param=name)
    return req
