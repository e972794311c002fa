"""The console's only HTTP code: the control plane's admin API, and the gateway for the Playground.

    admin = AdminClient("http://127.0.0.1:8300", token="...")
    admin.members()["members"]                 # GET /admin/v1/members
    admin.pin_degradation(3, "load test")      # PUT /admin/v1/degradation
    try:
        admin.put_tiers(policy)
    except Rejected as exc:                    # the server's own validation message
        print(exc.status, exc.message, exc.param)

    chat = GatewayClient("http://127.0.0.1:8000")
    for event in chat.stream_chat(api_key, [{"role": "user", "content": "hi"}]):
        ...                                     # ChatStart, then text deltas, then ChatEnd

Every failure is one of these (httpx's own exceptions never leave this module)::

    ConsoleError
    ├── Unreachable        connection refused, DNS, timeout: nothing answered
    ├── Unauthorized       401/403: missing or wrong admin token
    ├── NotAvailable       404/405 on a route: that endpoint is not implemented by this control plane
    └── Rejected           any other 4xx/5xx, carrying the OpenAI-shaped error (message, type, param, code)
"""

from __future__ import annotations

import json
import secrets
import ssl
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

ADMIN_PREFIX = "/admin/v1"


class ConsoleError(Exception):
    """Base of every error the console's HTTP calls raise."""

    def __init__(self, message: str, *, status: int | None = None, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type


class Unreachable(ConsoleError):
    """Nothing answered at the URL (refused, unresolvable, or timed out)."""


class Unauthorized(ConsoleError):
    """The admin API refused the token (401/403)."""


class NotAvailable(ConsoleError):
    """The route does not exist on this server (an endpoint not implemented yet)."""


class Rejected(ConsoleError):
    """The server answered with an error; ``message``/``param``/``code`` are the server's own."""


def _error_from(response: httpx.Response, what: str) -> ConsoleError:
    """Map one non-2xx response onto the tree above."""
    status = response.status_code
    err: dict[str, Any] = {}
    try:
        body = response.json()
        if isinstance(body, dict):
            raw = body.get("error", body.get("detail"))
            err = raw if isinstance(raw, dict) else {"message": str(raw)} if raw is not None else {}
    except ValueError:
        pass
    message = str(err.get("message") or response.reason_phrase or f"HTTP {status}")
    cls: type[ConsoleError] = Rejected
    if status in (401, 403):
        cls = Unauthorized
    # A missing *route* answers OpenAI's "Invalid URL (GET /path)" (the framework's bare "Not Found" before);
    # a missing *member* says which.
    elif status == 405 or (status == 404 and (message.startswith("Invalid URL (")
                                              or message.strip().lower() in ("not found", ""))):
        cls, message = NotAvailable, f"{what} is not available on this control plane yet"
    return cls(message, status=status, param=err.get("param"), code=err.get("code"), type=err.get("type"))


class AdminClient:
    """Typed calls to ``/admin/v1`` with the admin bearer token; thread-safe (one httpx.Client)."""

    def __init__(self, base_url: str, token: str | None, *, timeout_s: float = 3.0,
                 transport: httpx.BaseTransport | None = None, verify: ssl.SSLContext | bool = True) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport,
                                  verify=verify)
        self.has_token = bool(token)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, *, json_body: Any = None,
              params: Mapping[str, Any] | None = None, text: bool = False) -> Any:
        what = f"{method} {ADMIN_PREFIX}{path}"
        clean = {k: v for k, v in (params or {}).items() if v not in (None, "")}
        try:
            response = self._http.request(method, ADMIN_PREFIX + path, json=json_body, params=clean or None)
        except httpx.TimeoutException as exc:
            raise Unreachable(f"the control plane at {self.base_url} did not answer in time ({type(exc).__name__})")
        except httpx.HTTPError as exc:
            raise Unreachable(f"cannot reach the control plane at {self.base_url} ({type(exc).__name__})")
        if response.status_code >= 400:
            raise _error_from(response, what)
        if text:
            return response.text
        if not response.content:
            return {}
        try:
            return response.json()
        except ValueError:
            raise Rejected(f"{what} answered with something that is not JSON", status=response.status_code)

    def health(self) -> bool:
        """True when the control plane's ``/health`` answers 200 (no token needed)."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    # -- cluster -------------------------------------------------------------------------------
    def members(self) -> dict[str, Any]:
        return self._call("GET", "/members")

    def drain(self, member_id: str) -> dict[str, Any]:
        return self._call("POST", f"/members/{member_id}/drain")

    def undrain(self, member_id: str) -> dict[str, Any]:
        return self._call("POST", f"/members/{member_id}/undrain")

    def zones(self) -> dict[str, Any]:
        """``GET /admin/v1/zones``: each zone's state and members, ``down`` and recent events."""
        return self._call("GET", "/zones")

    # -- signals and decisions -----------------------------------------------------------------
    def signals(self) -> dict[str, Any]:
        return self._call("GET", "/signals")

    def decisions(self, limit: int | None = None) -> dict[str, Any]:
        return self._call("GET", "/decisions", params={"limit": limit})

    # -- degradation ---------------------------------------------------------------------------
    def degradation(self) -> dict[str, Any]:
        return self._call("GET", "/degradation")

    def pin_degradation(self, level: int, reason: str) -> dict[str, Any]:
        return self._call("PUT", "/degradation", json_body={"level": int(level), "reason": reason})

    def release_degradation(self) -> dict[str, Any]:
        return self._call("DELETE", "/degradation")

    # -- tiers ---------------------------------------------------------------------------------
    def tiers(self) -> dict[str, Any]:
        return self._call("GET", "/tiers")

    def put_tiers(self, policy: Mapping[str, Any]) -> dict[str, Any]:
        return self._call("PUT", "/tiers", json_body=dict(policy))

    # -- traces and alerts ---------------------------------------------------------------------
    def traces(self, *, limit: int | None = None, tier: str | None = None, status: str | None = None,
               min_ms: float | None = None, trace_id: str | None = None) -> dict[str, Any]:
        return self._call("GET", "/traces", params={"limit": limit, "tier": tier, "status": status,
                                                     "min_ms": min_ms, "trace_id": trace_id})

    def alerts(self) -> dict[str, Any]:
        return self._call("GET", "/alerts")

    def processes(self) -> dict[str, Any]:
        """``GET /admin/v1/processes``: what `switchboard up` supervises (pids, starts, restarts, exits)."""
        return self._call("GET", "/processes")

    # -- abuse monitor -------------------------------------------------------------------------
    def abuse(self, events: int | None = None) -> dict[str, Any]:
        """``GET /admin/v1/abuse``: actions in force, ended ones, the latest `events` events (the API's
        default: 200), thresholds."""
        return self._call("GET", "/abuse", params={"events": events})

    def lift_abuse(self, action_id: int, by: str = "console") -> dict[str, Any]:
        return self._call("POST", f"/abuse/actions/{int(action_id)}/lift", json_body={"by": by})

    def confirm_abuse(self, action_id: int) -> dict[str, Any]:
        return self._call("POST", f"/abuse/actions/{int(action_id)}/confirm")

    # -- usage ledger --------------------------------------------------------------------------
    def usage(self, **filters: Any) -> dict[str, Any]:
        """``GET /usage`` (tenant, key, tier, model, start, end, group_by=hour|day|none, by=...)."""
        return self._call("GET", "/usage", params=filters)

    def usage_csv(self, **filters: Any) -> str:
        """The same rows as CSV text (``format=csv``)."""
        return str(self._call("GET", "/usage", params={**filters, "format": "csv"}, text=True))


# -- the Playground's chat -------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatStart:
    """The gateway accepted the request: its ids, read from the response headers."""

    request_id: str | None
    trace_id: str
    status: int
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ChatDelta:
    text: str


@dataclass(frozen=True)
class ChatToolCall:
    """One streamed tool-call fragment: `id` and `name` on a call's first, `arguments` pieces after."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ChatEnd:
    finish_reason: str | None
    usage: dict[str, Any] | None
    error: str | None = None
    response_id: str | None = None
    """The Responses API's response id (continue the conversation with it as previous_response_id)."""


ChatEvent = ChatStart | ChatDelta | ChatToolCall | ChatEnd


def new_traceparent() -> tuple[str, str]:
    """A fresh W3C ``traceparent`` (sampled) and its trace id, so the console knows the trace to link."""
    trace_id = secrets.token_hex(16)
    return f"00-{trace_id}-{secrets.token_hex(8)}-01", trace_id


class GatewayClient:
    """Streams one chat completion from the gateway as a chosen API key (the Playground)."""

    def __init__(self, base_url: str, *, timeout_s: float = 120.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = httpx.Timeout(timeout_s, connect=3.0)
        self._transport = transport

    def stream_chat(self, api_key: str, messages: list[dict[str, str]], *, max_tokens: int | None = None,
                    temperature: float | None = None, model: str | None = None,
                    output: Mapping[str, Any] | None = None) -> Iterator[ChatEvent]:
        """`output`: fields shaping the answer, sent as they are (``response_format``; ``tools`` and
        ``tool_choice``); tool calls come back as ChatToolCall events."""
        traceparent, trace_id = new_traceparent()
        body: dict[str, Any] = {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
                                **(output or {})}
        if model:
            body["model"] = model
        if max_tokens:
            body["max_tokens"] = max_tokens
        if temperature is not None:
            body["temperature"] = temperature
        yield from self._stream("/v1/chat/completions", api_key, body, traceparent, trace_id, _sse_events)

    def stream_response(self, api_key: str, text: str, *, previous_response_id: str | None = None,
                        max_tokens: int | None = None, temperature: float | None = None,
                        model: str | None = None) -> Iterator[ChatEvent]:
        """One turn through the Responses API: only the new message goes out; the gateway keeps the
        conversation (`previous_response_id`: the last ChatEnd's response_id)."""
        traceparent, trace_id = new_traceparent()
        body: dict[str, Any] = {"input": text, "stream": True, "truncation": "auto"}
        for name, value in (("model", model), ("max_output_tokens", max_tokens), ("temperature", temperature),
                            ("previous_response_id", previous_response_id)):
            if value is not None and value != "":
                body[name] = value
        yield from self._stream("/v1/responses", api_key, body, traceparent, trace_id, _response_events)

    def _stream(self, path: str, api_key: str, body: dict[str, Any], traceparent: str, trace_id: str,
                parse: Any) -> Iterator[ChatEvent]:
        headers = {"Authorization": f"Bearer {api_key}", "traceparent": traceparent}
        try:
            with (httpx.Client(base_url=self.base_url, timeout=self._timeout, transport=self._transport) as http,
                  http.stream("POST", path, json=body, headers=headers) as response):
                resp_headers = {k.lower(): v for k, v in response.headers.items()}
                yield ChatStart(resp_headers.get("x-request-id"), resp_headers.get("x-trace-id", trace_id),
                                response.status_code, resp_headers)
                if response.status_code >= 400:
                    response.read()
                    yield ChatEnd(None, None, error=str(_error_from(response, "chat")))
                    return
                yield from parse(response.iter_lines())
        except httpx.HTTPError as exc:
            raise Unreachable(f"cannot reach the gateway at {self.base_url} ({type(exc).__name__}: {exc})") from None


def _response_events(lines: Iterator[str]) -> Iterator[ChatEvent]:
    """The Responses API's SSE events as the Playground's chat events."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:].strip())
        except ValueError:
            continue
        kind = event.get("type")
        if kind == "response.output_text.delta":
            yield ChatDelta(event.get("delta", ""))
        elif kind == "error":
            yield ChatEnd(None, None, error=str(event.get("message")))
            return
        elif kind in ("response.completed", "response.incomplete"):
            r = event["response"]
            u = r.get("usage") or {}
            usage = {"prompt_tokens": u.get("input_tokens"), "completion_tokens": u.get("output_tokens"),
                     "prompt_tokens_details": u.get("input_tokens_details")}
            reason = "stop" if kind == "response.completed" else (r.get("incomplete_details") or {}).get("reason")
            yield ChatEnd(reason, usage, response_id=r.get("id"))
            return
    yield ChatEnd(None, None, error="the stream ended without a final response event")


def _sse_events(lines: Iterator[str]) -> Iterator[ChatEvent]:
    finish: str | None = None
    usage: dict[str, Any] | None = None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            continue
        if "error" in chunk:
            err = chunk["error"]
            yield ChatEnd(finish, usage, error=str(err.get("message") if isinstance(err, dict) else err))
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                yield ChatDelta(delta["content"])
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                yield ChatToolCall(int(call.get("index") or 0), call.get("id"), fn.get("name"),
                                   fn.get("arguments") or "")
            finish = choice.get("finish_reason") or finish
    yield ChatEnd(finish, usage)
