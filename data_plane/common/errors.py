"""One error tree for the data plane, rendered in the OpenAI error shape.

Raised by every component of both planes; ``install_error_handlers(app)`` renders them in every
process's FastAPI app (gateway, shard, cache node, control plane), the gateway's chat path too.

    raise InvalidRequest("max_tokens must be >= 1", param="max_tokens")

renders as HTTP 400 with::

    {"error": {"message": "max_tokens must be >= 1", "type": "invalid_request_error",
               "param": "max_tokens", "code": "invalid_value"}}

The tree::

    SwitchboardError                      500 server_error / internal_error
    ├── InvalidRequest                    400 invalid_request_error
    │   ├── ContextLengthExceeded         400 ... / context_length_exceeded
    │   ├── UnsupportedParameter          400 ... / unsupported_parameter
    │   └── ContentPolicyViolation        400 ... / content_policy_violation
    ├── AuthenticationError               401 authentication_error / invalid_api_key
    ├── PermissionDenied                  403 permission_error
    ├── NotFound                          404 invalid_request_error / not_found
    │   └── ModelNotFound                 404 ... / model_not_found
    ├── RequestTimeout                    408 invalid_request_error / request_timeout
    ├── PayloadTooLarge                   413 invalid_request_error / payload_too_large
    ├── UnsupportedMediaType              415 invalid_request_error / unsupported_media_type
    ├── RateLimited                       429 rate_limit_error / rate_limit_exceeded (Retry-After);
    │                                         RPM/TPM: type requests / tokens, as OpenAI's
    ├── Overloaded                        503 server_error / overloaded (Retry-After)
    │   ├── NoHealthyBackend              503 ... / no_healthy_backend
    │   └── ShuttingDown                  503 ... / server_shutting_down
    ├── UpstreamError                     502 server_error / upstream_error
    └── UpstreamTimeout                   504 server_error / upstream_timeout

Foreign exceptions (pydantic, httpx, JSON) are mapped onto this tree at each service's
boundary, once (see :func:`install_error_handlers`). Anything else is a bug: `as_error` logs it with
its traceback and stands a 500 in for it, the one place that does (FastAPI's handler here, the
gateway's chat path before and after its first byte).
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from opentelemetry import propagate, trace
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


ECHO_CHARS = 128
"""The most of a client's value an error message repeats: an id of ours is ~55 characters, and a 500 KB
one (a conversation id, an item reference, a call_id: no schema bounds them) came back whole."""


def clipped(value: object, limit: int = ECHO_CHARS) -> str:
    """`value` as text to quote in an error message, cut past `limit` characters (marked with "...")."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


class SwitchboardError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def body(self, request_id: str | None = None, trace_id: str | None = None) -> dict[str, Any]:
        err: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        if request_id:
            err["request_id"] = request_id
        if trace_id:
            err["trace_id"] = trace_id  # a user's complaint leads straight to the trace
        return {"error": err}

    def response_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.retry_after is not None:  # rounded up: a client retrying at Retry-After must not be early
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after - 1e-9)))
        return headers


class InvalidRequest(SwitchboardError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_value"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class UnsupportedParameter(InvalidRequest):
    code = "unsupported_parameter"


class ContentPolicyViolation(InvalidRequest):
    code = "content_policy_violation"


class AuthenticationError(SwitchboardError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(SwitchboardError):
    status = 403
    type = "permission_error"
    code = "permission_denied"


class NotFound(SwitchboardError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class RequestTimeout(SwitchboardError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(SwitchboardError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class UnsupportedMediaType(SwitchboardError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class RateLimited(SwitchboardError):
    """`limit` ("requests" or "tokens") for an RPM or TPM refusal: OpenAI's body names the limit hit in `type`
    (``{"type": "tokens", "code": "rate_limit_exceeded"}``); other 429s (abuse, background) keep
    ``rate_limit_error``. The openai SDKs map a 429 by its status, so `type` is for the client to read."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        if limit is not None:
            self.type = limit


class Overloaded(SwitchboardError):
    status = 503
    type = "server_error"
    code = "overloaded"


class NoHealthyBackend(Overloaded):
    code = "no_healthy_backend"


class ShuttingDown(Overloaded):
    """The gateway stopped (a restart, a deploy, Ctrl-C) past its shutdown grace with this stream still
    running: the stream ends with this error event and ``[DONE]`` instead of a cut connection."""

    code = "server_shutting_down"


class PipelineStageLost(Overloaded):
    """A pipelined shard lost a stage mid-stream: retry on another shard (the gateway resumes the stream, and
    counts the resume under its own reason: switchboard_router_resumes_total{reason="pipeline_stage_lost"})."""

    code = "pipeline_stage_lost"


class UpstreamError(SwitchboardError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class UpstreamTimeout(SwitchboardError):
    status = 504
    type = "server_error"
    code = "upstream_timeout"


_STATUS_TO_ERROR: dict[int, type[SwitchboardError]] = {
    400: InvalidRequest,
    401: AuthenticationError,
    403: PermissionDenied,
    404: NotFound,
    405: InvalidRequest,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    429: RateLimited,
    503: Overloaded,
}


def from_openai_body(status: int, body: Any) -> SwitchboardError:
    """Rebuild an error from an upstream's OpenAI-shaped error body (used by the gateway)."""
    cls = _STATUS_TO_ERROR.get(status, UpstreamError)
    message, param, code = f"upstream answered {status}", None, None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        message = str(err.get("message") or message)
        param = err.get("param")
        code = err.get("code")
    return cls(message, param=param, code=code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    where = list(first.get("loc", ()))
    if where and where[0] in ("body", "query", "path", "header"):  # FastAPI's location: `limit`, not `query.limit`
        where = where[1:]
    loc = [str(p) for p in where]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "request body is not valid JSON", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    msg = first.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def as_error(exc: BaseException, what: str) -> SwitchboardError:
    """`exc` itself if it is one of ours; otherwise (a bug) it is logged with its traceback as
    "`what`: unhandled error" and an OpenAI-shaped 500 stands in for it.

        except Exception as exc:
            error = as_error(exc, f"request {request_id}")
    """
    if isinstance(exc, SwitchboardError):
        return exc
    log.error("%s: unhandled error", what, exc_info=exc)
    return SwitchboardError("internal server error")


def render(exc: SwitchboardError, request: Request | None = None) -> JSONResponse:
    request_id = trace_id = None
    if request is not None:
        request_id = getattr(request.state, "request_id", None)
        trace_id = getattr(request.state, "trace_id", None)
    headers = exc.response_headers()
    if request_id:
        headers.setdefault("X-Request-Id", request_id)
    if trace_id:
        headers.setdefault("X-Trace-Id", trace_id)
    return JSONResponse(exc.body(request_id, trace_id), status_code=exc.status, headers=headers)


def name_request(request: Request, span: Any) -> str:
    """A new request id for `request`, and its trace id, on its state (what `render` puts in an error's
    body and headers) and the id on `span`; the id."""
    request_id: str = uuid.uuid4().hex
    request.state.request_id = request_id
    request.state.trace_id = format(span.get_span_context().trace_id, "032x")
    span.set_attribute("switchboard.request_id", request_id)
    return request_id


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a service can raise onto the OpenAI error shape, once."""

    def named(request: Request, error: SwitchboardError) -> JSONResponse:
        """`error` rendered; a request no route named (FastAPI refused a parameter before the route ran, or
        a route that does not name its requests: the admin API's) gets a request id and a trace of its own,
        as every other error does."""
        if getattr(request.state, "request_id", None) is not None:
            return render(error, request)
        # in the caller's trace when it sent one (a hop's traceparent, a client's): a root of its own
        # each time was a trace per refused hop that nothing led to, and an error body naming it
        with tracer.start_as_current_span("http.request.invalid", context=propagate.extract(request.headers)) as span:
            name_request(request, span)
            span.set_attribute("url.path", request.url.path)
            span.set_attribute("error.type", error.code or "error")
            return render(error, request)

    @app.exception_handler(SwitchboardError)
    async def _sb(request: Request, exc: SwitchboardError) -> JSONResponse:
        return named(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        kind = (exc.errors() or [{}])[0].get("type", "")
        code = "unsupported_parameter" if kind == "extra_forbidden" else "invalid_value"
        return named(request, InvalidRequest(message, param=param, code=code))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        cls = _STATUS_TO_ERROR.get(exc.status_code, SwitchboardError)
        # no route: OpenAI's words, with what was asked ("Not Found" told a client nothing)
        detail = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code == 404 else str(exc.detail)
        err = cls(detail, code=None if cls is not SwitchboardError else "http_error")
        err.status = exc.status_code
        return render(err, request)

    @app.exception_handler(json.JSONDecodeError)
    async def _json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return render(InvalidRequest("request body is not valid JSON", code="invalid_json"), request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return render(as_error(exc, f"{request.method} {request.url.path}"), request)
