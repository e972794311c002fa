"""A chat request's messages: their wire schema (OpenAI's, and what replayed histories carry) and the
checks of their content and tool calls, shared by the shard and the gateway (data_plane/protocol.py).

    m = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "Hi"}]})
    m.text("messages.0")                       # "Hi"; a 400 naming messages.0.content.<j> for a part not text
    tool_call_list(m.tool_calls, "messages.1") # the calls, checked: id, function name and arguments strings
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from data_plane.common.errors import InvalidRequest, UnsupportedParameter
from data_plane.legacy_functions import FunctionCall
from data_plane.request_checks import CacheBreakpoint, json_type

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: data_plane/legacy_functions.py


def valid_unicode(value: str) -> str:
    """JSON can carry lone surrogates ("\\ud800") that no tokenizer or UTF-8 encoder accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text contains invalid Unicode (a lone surrogate)") from None
    return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: CacheBreakpoint | None = None  # a no-op (request_checks.py)

    @field_validator("text")
    @classmethod
    def _text_unicode(cls, v: str) -> str:
        return valid_unicode(v)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Role
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: Any = None
    tool_call_id: str | None = None
    refusal: str | None = None
    """An assistant message's refusal, as OpenAI's replies carry it (null when it answered): replayed
    history stays valid; a refusal with no content is the turn's text."""
    audio: Any = None
    """OpenAI's field this server never produces, accepted as null (replayed replies hold it); else a 400."""
    function_call: FunctionCall | None = None
    """The deprecated form of one tool call (data_plane/legacy_functions.py)."""
    annotations: list[dict[str, Any]] | None = None
    """An OpenAI reply's url citations (`"annotations": []` on every message it sends; the openai SDK's
    `message.model_dump()` writes them as null): replayed history carries them. Not part of the prompt."""
    parsed: Any = None
    """What the openai SDK's `parse` helpers add to a message they return (the content, parsed): an app that
    appends that message object to its history sends it. The content is what the prompt is made of."""

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v: Any) -> None:
        if v is not None:  # pydantic's "Input should be None" said nothing a client could act on
            raise PydanticCustomError("openai", "Audio is not supported by this model: a message's audio (an "
                                      "audio reply's id) cannot be replayed; send its transcript as content "
                                      "instead.", {"code": "unsupported_value"})
        return v

    @field_validator("content")
    @classmethod
    def _content_unicode(cls, v: Any) -> Any:
        if isinstance(v, str):
            valid_unicode(v)
        elif isinstance(v, list):
            for part in v:
                for key in ("text", "refusal"):
                    if isinstance(part, dict) and isinstance(part.get(key), str):
                        valid_unicode(part[key])
        return v

    def text(self, where: str = "messages") -> str:
        """The message's text; a 400 for a content part that is not text (`where`: the message's path,
        ``messages.<i>``, for its param: the request's checks call this first, with it)."""
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            at = f"{where}.content.{j}"
            if isinstance(part, TextPart):
                parts.append(part.text)
            elif self.role == "assistant" and isinstance(part, dict) and part.get("type") == "refusal":
                # OpenAI's assistant content may hold refusal parts ({"type": "refusal", "refusal": "..."}):
                # a history recorded there replays here, the refusal as the turn's text (as `refusal` is)
                if not isinstance(part.get("refusal"), str) or set(part) != {"type", "refusal"}:
                    raise InvalidRequest("a 'refusal' content part needs 'refusal', a string, and nothing else",
                                         param=f"{at}.refusal")
                parts.append(part["refusal"])  # its Unicode checked with the content (_content_unicode)
            elif isinstance(part, dict) and part.get("type") == "text":  # one TextPart refused: say why
                if not isinstance(part.get("text"), str):
                    raise InvalidRequest("a 'text' content part needs 'text', a string", param=f"{at}.text")
                extra = f"{at}.{min(set(part) - {'type', 'text'})}"
                raise UnsupportedParameter(f"Unrecognized request argument supplied: {extra}", param=extra)
            else:
                kind = part.get("type", "unknown") if isinstance(part, dict) else "unknown"
                raise UnsupportedParameter(
                    f"content part type {kind!r} is not supported; only 'text' parts are (and 'refusal' in an"
                    " assistant message)",
                    param=at,
                )
        return "".join(parts)



def tool_call_list(value: Any, where: str = "messages") -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as OpenAI takes them: objects with an `id` and a `function`
    whose `name` and `arguments` are strings (`where`: the message's path, for the 400). Arguments sent as
    a JSON object, or a function as a bare name, were a 500 where the history was written back."""
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        raise InvalidRequest("an assistant message's tool_calls must be a list of objects",
                             param=f"{where}.tool_calls")
    for j, call in enumerate(value):
        if call.get("type", "function") != "function":  # a custom tool's call: {"type": "custom", "custom": ...}
            raise UnsupportedParameter(f"tool call type {call['type']!r} is not supported; only 'function' tool "
                                       "calls are (this server serves function tools only)",
                                       param=f"{where}.tool_calls.{j}.type")
        fn = call.get("function")
        fields: list[tuple[str, Any]] = [("id", call.get("id")), ("function", fn)]
        if isinstance(fn, dict):
            fields += [("function.name", fn.get("name")), ("function.arguments", fn.get("arguments"))]
        for name, field in fields:
            expected = "an object" if name == "function" else "a string"
            if not (isinstance(field, dict) if name == "function" else isinstance(field, str)):
                param = f"{where}.tool_calls.{j}.{name}"
                raise InvalidRequest(f"Invalid type for '{param}': expected {expected}, but got "
                                     f"{json_type(field)} instead.", param=param)
    return value
