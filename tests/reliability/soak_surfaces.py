"""The soak's newer surfaces (tests/reliability/test_soak.py): what an app built on the openai SDK sends
besides chats, each one request kind of the soak's mix, so an hour of traffic goes through every table
these keep on the gateway (background runs, record locks, disconnect watches, item indexes, a tenant's
stored-completions index) and on the cache node (records, tombstones).

    surfaces = Surfaces(gateway_url, keys)
    extra = surfaces.one("background", rng)    # raises SurfaceError(status, code) when a step went wrong

Each kind returns what the soak records beside the status (``extra``) or raises `SurfaceError` with the
status and code of the step that failed; every step is checked as the SDK's user would check it:

- ``responses``: a stored response, then 1-2 turns on it with ``previous_response_id`` (a chain whose
  previous response is gone is a lost turn, as a lost session is);
- ``responses_unstored``: ``store: false``, then its retrieve must be a 404 (nothing kept);
- ``background``: ``background: true``, polled until it ends (completed or incomplete), or cancelled
  after a moment (then cancelled, or completed if it ended first): never left queued or in progress;
- ``abandoned``: a stream (Responses or Chat Completions, stored or not) closed after a few events;
- ``conversation``: create with an item, add items, a response in it, list, delete an item, delete
  it; then it must be a 404;
- ``stored_chat``: ``store: true`` with metadata, update it, list a page and the next, delete it;
- ``structured``: ``response_format`` json_schema: the content parses and has the required keys;
- ``tools``: ``tool_choice: required``: a tool call with JSON arguments;
- ``not_found``: an unknown response (retrieve) or conversation (items): the 404 (an expected 4xx).
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import openai
from openai import OpenAI

KINDS = ("responses", "responses_unstored", "background", "abandoned", "conversation", "stored_chat",
         "structured", "tools", "not_found")
EXPECTED_4XX = {"not_found": 404}
"""Kinds whose answer is a 4xx on purpose (the others must all succeed)."""
TERMINAL = {"completed", "incomplete", "failed", "cancelled"}
POLL_S = 0.5
POLL_LIMIT_S = 90.0
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


class SurfaceError(Exception):
    """A step of a kind went wrong: the status it got (0: no answer) and its code."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(f"{status} {code}")
        self.status, self.code = status, code


def _failed(exc: Exception) -> SurfaceError:
    if isinstance(exc, openai.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        return SurfaceError(exc.status_code, str(body.get("code") or body.get("type") or ""))
    return SurfaceError(0, type(exc).__name__)


class Surfaces:
    """One openai client per tier key; `one` runs a kind start to end."""

    def __init__(self, url: str, keys: dict[str, str], model: str) -> None:
        self.model = model
        self.clients: dict[str, Any] = {tier: OpenAI(base_url=url + "/v1", api_key=key, timeout=120, max_retries=0)
                        for tier, key in keys.items()}

    def one(self, kind: str, rng: random.Random) -> dict[str, Any]:
        client = self.clients[rng.choice(["plus", "enterprise"])]
        try:
            return dict(getattr(self, "_" + kind)(client, rng))
        except SurfaceError:
            raise
        except (openai.APIError, ValueError, KeyError, TypeError) as exc:
            raise _failed(exc) from None

    def _responses(self, c: Any, rng: random.Random) -> dict[str, Any]:
        r = c.responses.create(model=self.model, input="Count to three.", max_output_tokens=6)
        turns = rng.randint(1, 2)
        for _ in range(turns):
            r = c.responses.create(model=self.model, input="And then?", max_output_tokens=6, previous_response_id=r.id)
        return {"turns": turns}

    def _responses_unstored(self, c: Any, rng: random.Random) -> dict[str, Any]:
        r = c.responses.create(model=self.model, input="Say hi.", max_output_tokens=6, store=False)
        try:
            c.responses.retrieve(r.id)
        except openai.NotFoundError:
            return {}
        raise SurfaceError(200, "unstored_response_kept")

    def _background(self, c: Any, rng: random.Random) -> dict[str, Any]:
        r = c.responses.create(model=self.model, input="Tell me a story.", max_output_tokens=24, background=True)
        cancel = rng.random() < 0.4
        if cancel:
            time.sleep(rng.random())
            try:
                r = c.responses.cancel(r.id)
            except openai.BadRequestError:  # it ended first: "Cannot cancel a completed response."
                r = c.responses.retrieve(r.id)
        deadline = time.monotonic() + POLL_LIMIT_S
        while r.status not in TERMINAL and time.monotonic() < deadline:
            time.sleep(POLL_S)
            r = c.responses.retrieve(r.id)
        wanted = {"cancelled", "completed", "incomplete"} if cancel else {"completed", "incomplete"}
        if r.status not in wanted:
            raise SurfaceError(200, f"background_{r.status}")
        return {"cancelled": r.status == "cancelled"}

    def _abandoned(self, c: Any, rng: random.Random) -> dict[str, Any]:
        store, events = rng.random() < 0.5, 0
        if rng.random() < 0.5:
            stream: Any = c.responses.create(model=self.model, input="Write a long poem.", max_output_tokens=64,
                                             stream=True, store=store)
        else:
            stream = c.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "Write a poem."}],
                                               max_tokens=64, stream=True, store=store)
        with stream:
            for _ in stream:
                events += 1
                if events >= 4:
                    break  # the client goes: the connection closes mid-stream
        return {"events": events}

    def _conversation(self, c: Any, rng: random.Random) -> dict[str, Any]:
        conv = c.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi"}],
                                      metadata={"soak": "1"})
        for _ in range(rng.randint(1, 3)):
            c.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "More " * 10}])
        c.responses.create(model=self.model, input="Reply briefly.", max_output_tokens=6, conversation=conv.id)
        items = c.conversations.items.list(conv.id, limit=3).data
        if items:
            c.conversations.items.delete(items[-1].id, conversation_id=conv.id)
        c.conversations.delete(conv.id)
        try:
            c.conversations.items.list(conv.id)
        except openai.NotFoundError:
            return {"items": len(items)}
        raise SurfaceError(200, "deleted_conversation_listed")

    def _stored_chat(self, c: Any, rng: random.Random) -> dict[str, Any]:
        done = c.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "Name a fruit."}],
                                         max_tokens=6, store=True, metadata={"soak": "1"})
        c.chat.completions.update(done.id, metadata={"soak": "2"})
        page = c.chat.completions.list(limit=5)
        listed = len(page.data)
        if page.has_more:
            listed += len(page.get_next_page().data)
        c.chat.completions.delete(done.id)
        return {"listed": listed}

    def _structured(self, c: Any, rng: random.Random) -> dict[str, Any]:
        done = c.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "Give a person."}], max_tokens=48,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
        choice = done.choices[0]
        if choice.finish_reason == "stop":
            value = json.loads(choice.message.content or "")
            if not isinstance(value, dict) or set(SCHEMA["required"]) - set(value):
                raise SurfaceError(200, "schema_not_followed")
        return {"finish": choice.finish_reason}

    def _tools(self, c: Any, rng: random.Random) -> dict[str, Any]:
        done = c.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                         max_tokens=32, tools=TOOLS, tool_choice="required")
        calls = done.choices[0].message.tool_calls or []
        if done.choices[0].finish_reason == "tool_calls":
            if not calls:
                raise SurfaceError(200, "no_tool_call")
            json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
        return {"calls": len(calls)}

    def _not_found(self, c: Any, rng: random.Random) -> dict[str, Any]:
        try:
            if rng.random() < 0.5:
                c.responses.retrieve(f"resp_{rng.getrandbits(64):016x}")
            else:
                c.conversations.items.list(f"conv_{rng.getrandbits(64):016x}")
        except openai.NotFoundError as exc:
            raise _failed(exc) from None
        raise SurfaceError(200, "unknown_id_found")
