"""Checks every public request body gets before its fields are read (chat, Responses, Conversations).

    body = json_body(raw, content_type)           # 415 / 400 invalid_json; lone surrogates refused
    req = validated(ChatCompletionRequest, body)  # strict types; a 400 naming the field as sent
    max_tokens: WholeNumber | None                # an int field that also takes 4.0, never true or "4"

Shared by data_plane/protocol.py (chat, on the gateway and the shard) and
data_plane/gateway/responses_items.py (Responses, Conversations), so the three answer alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from data_plane.common.errors import InvalidRequest, UnsupportedMediaType, UnsupportedParameter
from data_plane.common.http_body import strict_loads

MAX_METADATA_PAIRS = 16


def _whole(value: Any) -> Any:
    """4.0 -> 4 (JSON has one number type; a client that computed a limit may send it so); anything
    else goes on to the strict int check, which refuses true, "4" and 4.5."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


WholeNumber = Annotated[int, BeforeValidator(_whole)]


class CacheBreakpoint(BaseModel):
    """OpenAI's `prompt_cache_breakpoint` on a text content part (the end of a prefix to cache), as the openai
    SDK types it. Accepted as a no-op, as `prompt_cache_options` is: the prefix cache finds shared prefixes by
    content, whatever the request marks."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


def metadata_bounds(value: dict[str, str]) -> tuple[str, str] | None:
    """OpenAI's 400 (message, code) for string pairs past its bounds on `metadata` (16 pairs, keys <= 64 and
    values <= 512 characters), None within them: it is stored with a response or a conversation, so
    unbounded metadata would be unbounded storage per request."""
    if len(value) > MAX_METADATA_PAIRS:
        said = (f"too many properties. Expected an object with at most {MAX_METADATA_PAIRS} properties, but got an "
                f"object with {len(value)} properties instead.")
        return f"Invalid 'metadata': {said}", "object_above_max_properties"
    for key, text in value.items():
        if len(key) > 64:
            said = f"key too long. Expected keys of at most 64 characters, but got a key with length {len(key)} instead."
            return f"Invalid 'metadata': {said}", "string_above_max_length"
        if len(text) > 512:
            said = (f"string too long. Expected a string with maximum length 512, but got a string with length "
                    f"{len(text)} instead.")
            return f"Invalid 'metadata': {said}", "string_above_max_length"
    return None


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """`metadata_bounds` as a field validator (the chat and Responses bodies): OpenAI's words, not pydantic's."""
    problem = metadata_bounds(value) if value is not None else None
    if problem is not None:  # (no client text in the message: pydantic formats it with the context)
        raise PydanticCustomError("openai", problem[0], {"code": problem[1]})
    return value


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""OpenAI's values of `reasoning.effort` (Responses) and `reasoning_effort` (chat): a no-op here, still checked."""


def check_one_of(value: Any, options: Sequence[str], param: str) -> None:
    """OpenAI's 400 for a field that takes one of `options` (None: the field left out): "Invalid value:
    'ultra'. Supported values are: 'low', 'medium', and 'high'." naming `param` (a value of another type:
    its invalid_type)."""
    if value is None or value in options:
        return
    if not isinstance(value, str):
        raise InvalidRequest(f"Invalid type for '{param}': expected a string, but got {json_type(value)} instead.",
                             param=param, code="invalid_type")
    shown = ", ".join(f"'{o}'" for o in options[:-1]) + f", and '{options[-1]}'"
    raise InvalidRequest(f"Invalid value: '{value[:64]}'. Supported values are: {shown}.", param=param,
                         code="invalid_value")


def json_type(value: Any) -> str:
    """A value's JSON type as OpenAI's type errors name it ("an object", "null")."""
    if value is None:
        return "null"
    kinds = ((bool, "a boolean"), (int, "an integer"), (float, "a decimal"), (str, "a string"), (dict, "an object"),
             (list, "an array"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "a value")


def check_unicode(body: Any) -> None:
    """400 for a body with a lone surrogate anywhere: JSON may escape one ("\\ud800") and no UTF-8
    encoder takes it, so one in a JSON schema, a tool call's arguments or stored metadata was a 500
    wherever the gateway, the grammar compiler or the cache node first encoded it."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("request body contains invalid Unicode (a lone surrogate)", code="invalid_json") from None
    except RecursionError:  # encoding takes a few more frames than the parse did: a body nested just deep enough
        raise InvalidRequest("request body is nested too deeply", code="invalid_json") from None


def json_body(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """A request body as the JSON object every public route takes: 415 for another content type,
    400 ``invalid_json`` for bytes that are not UTF-8, not JSON (NaN, Infinity and 1e400 included: nothing
    could encode them again), nested too deeply, not an object, or holding a lone surrogate."""
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise UnsupportedMediaType(f"Content-Type must be application/json, not {ctype!r}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not valid UTF-8", code="invalid_json") from None
    try:
        body = strict_loads(text)
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    check_unicode(body)
    return body


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], body: dict[str, Any]) -> M:
    """`body` as `model`, in pydantic's strict mode, or the 400 OpenAI gives.

    Strict, because lax mode coerced what a client got wrong into something it did not ask for:
    ``"stream": "yes"`` streamed, ``"n": "2"`` and ``"n": true`` were numbers, ``"store": "no"`` was
    false. OpenAI answers each with a 400 ("Invalid type for 'stream': expected a boolean").
    JSON objects still validate as nested models, and an integer as a float."""
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as exc:
        # of a union's errors (one per member), the one that got furthest into what the client sent
        errors = [(wire_param(e.get("loc", ()), body, e.get("type") == "missing"), e) for e in exc.errors()]
        (param, _), first = max(errors, key=lambda pe: pe[0][1])
        if first.get("type") == "extra_forbidden":
            raise UnsupportedParameter(f"Unrecognized request argument supplied: {param}", param=param) from None
        kinds = {e.get("type") for (p, _), e in errors if p == param}  # a union's members: one type error each
        words = openai_words(param, first, kinds) if param else None
        if words is not None:
            raise InvalidRequest(words[0], param=param, code=words[1]) from None
        said = str(first.get("msg")).removeprefix("Value error, ")  # a validator's own words, without pydantic's
        raise InvalidRequest(f"{param}: {said}" if param else said, param=param) from None


_BOUNDS = {"less_than_equal": ("le", "<=", "above", "max"), "less_than": ("lt", "<", "above", "max"),
           "greater_than_equal": ("ge", ">=", "below", "min"), "greater_than": ("gt", ">", "below", "min")}


_TYPES = {"bool_type": "a boolean", "int_type": "an integer", "float_type": "a decimal", "string_type": "a string",
          "dict_type": "an object", "model_type": "an object", "list_type": "an array"}


def openai_words(param: str, error: Any, kinds: set[Any] | None = None) -> tuple[str, str] | None:
    """OpenAI's message and code for a pydantic error at `param` that OpenAI words its own way: a number out
    of its range ("Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 2.5
    instead.", decimal_above_max_value; integer_... for an integer field), a string or a list too long, an
    empty string or list that needs content, a required field left out ("Missing required parameter:
    'messages'.", missing_required_parameter), a value not among a field's ("Invalid value: 'xml'. Supported values are:
    'text', 'json_object', and 'json_schema'."), a value of the wrong type ("Invalid type for 'n': expected an
    integer, but got a string instead.", invalid_type; `kinds`: the error types at `param`, one per member of
    a union), a validator's own OpenAI words (a PydanticCustomError of type "openai", its
    code in its context, else invalid_value); None for others (pydantic's words, prefixed with the param)."""
    kind, ctx, value = error.get("type"), error.get("ctx") or {}, error.get("input")
    if kind in _TYPES:  # a union's members named in turn ("expected one of a string or an array")
        expected = sorted({_TYPES[k] for k in kinds or {kind} if k in _TYPES})
        wanted = expected[0] if len(expected) == 1 else f"one of {', '.join(expected[:-1])} or {expected[-1]}"
        return f"Invalid type for '{param}': expected {wanted}, but got {json_type(value)} instead.", "invalid_type"
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", "missing_required_parameter"
    if kind == "openai":  # a validator's message in OpenAI's words already: PydanticCustomError("openai", ...)
        return str(error.get("msg")), str(ctx.get("code", "invalid_value"))
    if kind in _BOUNDS:
        key, op, side, end = _BOUNDS[kind]
        bound = ctx.get(key)
        if not isinstance(bound, int | float):
            return None
        number = "decimal" if isinstance(bound, float) else "integer"
        shown = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        what = f"{number} {side} {'maximum' if end == 'max' else 'minimum'} value"
        message = f"Expected a value {op} {shown}, but got {json.dumps(value)} instead."
        return f"Invalid '{param}': {what}. {message}", f"{number}_{side}_{end}_value"
    if kind == "string_too_long" and isinstance(value, str):
        message = (f"Expected a string with maximum length {ctx.get('max_length')}, but got a string with length "
                   f"{len(value)} instead.")
        return f"Invalid '{param}': string too long. {message}", "string_above_max_length"
    if kind == "string_too_short" and value == "" and ctx.get("min_length") == 1:
        message = "Expected a string with minimum length 1, but got an empty string instead."
        return f"Invalid '{param}': empty string. {message}", "empty_string"
    if kind == "too_long" and isinstance(value, list):
        message = (f"Expected an array with maximum length {ctx.get('max_length')}, but got an array with length "
                   f"{len(value)} instead.")
        return f"Invalid '{param}': array too long. {message}", "array_above_max_length"
    if kind == "literal_error" and isinstance(value, str):  # pydantic: "'a', 'b' or 'c'"; OpenAI: "'a', 'b', and 'c'"
        head, _, last = str(ctx.get("expected", "")).rpartition(" or ")
        options = f"{head}, and {last}" if ", " in head else f"{head} and {last}" if head else last
        return f"Invalid value: '{value[:64]}'. Supported values are: {options}.", "invalid_value"
    if kind == "too_short" and value == [] and ctx.get("min_length") == 1:
        message = "Expected an array with minimum length 1, but got an empty array instead."
        return f"Invalid '{param}': empty array. {message}", "empty_array"
    return None


def wire_param(loc: Sequence[Any], body: Any, missing: bool = False) -> tuple[str | None, int]:
    """A validation error's location as a path through the request body (``messages.0.content``),
    and how many of its steps are in the body.

    pydantic puts the union member it tried into `loc` (``str``, ``literal['none','auto','required']``,
    ``NamedToolChoice``), which is no field the client sent: keep the keys and indexes that walk
    `body`, and, for a `missing` error, the last key (the required field)."""
    parts: list[str] = []
    node = body
    for i, step in enumerate(loc):
        walks = (isinstance(node, dict) and isinstance(step, str) and step in node) or (
            isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node))
        if walks:
            node = node[step]
        elif not (missing and i == len(loc) - 1):
            continue  # a union member's tag
        parts.append(str(step))
    return ".".join(parts) or None, len(parts)
