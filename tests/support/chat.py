"""One chat call through a gateway, and the checks on an OpenAI-shaped error, for tests.

    r = chat(gw.url, "free", "hello", max_tokens=8)          # httpx.Response (stream=True for SSE)
    err = assert_openai_error(r, 429, "rate_limit_exceeded")  # status, shape, Retry-After, no leak
    assert_no_leak(r.text)                                    # no stack trace or source path
    got = stream_all(gw.url, "synthetic", prompts, 16, on_progress=kill_once)  # [(text, finish_reason)]

Used by the reliability, hop-auth and at-rest tests; `stream_all` by the mid-stream failover tests
(tests/data_plane/test_faults.py, test_pipeline.py, test_pipeline_hosts.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import openai
import pytest

from tests.support.cluster import KEYS

LEAK_MARKERS = ("Traceback", 'File "', "site-packages", "/work/", '.py"', ".py:")
"""What a stack trace or a source path looks like inside an error body."""


def sdk(gw: Any, key: str = KEYS["plus"], timeout: float = 120.0) -> Any:
    """The openai SDK on the gateway `gw` (a Service), no retries (typed Any: its request types are
    TypedDicts the tests' plain dicts do not name)."""
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def chat(
    url: str,
    tier: str = "plus",
    content: str = "hello there",
    *,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
    **body: Any,
) -> httpx.Response:
    """One chat completion through a gateway (non-streaming unless stream=True is passed)."""
    body.setdefault("max_tokens", 4)
    messages = body.pop("messages", None) or [{"role": "user", "content": content}]
    auth = {"Authorization": f"Bearer {key or KEYS[tier]}"}
    return httpx.post(
        url + "/v1/chat/completions",
        json={"messages": messages, **body},
        headers={**auth, **(headers or {})},
        timeout=timeout,
    )


def assert_openai_error(resp: httpx.Response, status: int | Iterable[int], code: str | None = None) -> dict:
    """`resp` is an OpenAI-shaped error with `status` (and `code`); returns the error object."""
    statuses = {status} if isinstance(status, int) else set(status)
    assert resp.status_code in statuses, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert err["message"], err
    if code is not None:
        assert err["code"] == code, err
    if resp.status_code in (429, 503):
        assert int(resp.headers["retry-after"]) >= 1, dict(resp.headers)
    assert_no_leak(resp.text)
    return err


def refusal(call: Callable[..., Any]) -> dict[str, Any]:
    """The error object of the 400 the openai SDK must raise for `call()` (its BadRequestError's `body`):
    ``refusal(lambda: client.chat.completions.create(...))["param"]``."""
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body = info.value.body
    assert isinstance(body, dict)
    return body


def assert_no_leak(text: str) -> None:
    """An error body carries no stack trace and no source path."""
    for marker in LEAK_MARKERS:
        assert marker not in text, f"{marker!r} leaked in {text[:500]!r}"


def stream_all(url: str, model: str, prompts: list[str], max_tokens: int,
               on_progress: Callable[[int, int], None] | None = None) -> list[tuple[str, str]]:
    """Stream every prompt concurrently (greedy, `model`); return (text, finish_reason) per prompt.

    `on_progress(streams_started, chunks)` runs after every chunk: how many streams have sent text so
    far and how many chunks arrived in all (a test kills a process from it, mid-stream)."""

    async def run() -> list[tuple[str, str]]:
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["plus"], max_retries=0, timeout=120)
        chunks_seen = 0
        started: set[str] = set()

        async def one(p: str) -> tuple[str, str]:
            nonlocal chunks_seen
            text, finish = "", ""
            stream = await sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": p}], max_tokens=max_tokens, temperature=0,
                stream=True)
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                    chunks_seen += 1
                    if chunk.choices[0].delta.content:
                        started.add(p)
                    if on_progress is not None:
                        on_progress(len(started), chunks_seen)
            return text, finish

        out = await asyncio.gather(*(one(p) for p in prompts))
        await sdk.close()
        return out

    return asyncio.run(run())
