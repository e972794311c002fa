"""`POST /v1/responses/compact`: a conversation folded into a compaction item and its newest turns.

    done = client.responses.compact(model=..., input=items)               # or previous_response_id=r.id
    client.responses.create(model=..., input=[*done.output, {"role": "user", "content": "go on"}])

The input items (after `previous_response_id`'s chain, when given) become one sealed compaction item
(data_plane/gateway/memory.py) and the turns of the last ``keep_tokens`` (Switchboard's extension,
256 by default). The body takes what OpenAI's does: `prompt_cache_key`, `prompt_cache_retention`,
`prompt_cache_options`, `safety_identifier` and `service_tier` are accepted as on create (no-ops: the
prefix cache finds shared prefixes by content; one processing tier), and `safety_identifier` and the
tier are echoed as OpenAI's CompactedResponse has them; anything else is a 400 naming it. A compaction
takes one request from the key's RPM (429 beyond, `x-ratelimit-*` headers), no tokens (nothing is generated),
as `input_tokens` does: it was unmetered, a free key's 70 compacts of up to 1 MiB each passed its 60 RPM.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from data_plane.common.http_body import read_body
from data_plane.gateway.item_index import resolve_references
from data_plane.gateway.response_store import ConversationStore
from data_plane.gateway.responses import RESPONSES_PATH, record_principal
from data_plane.gateway.responses_compaction import compact_items, conversation_tokens
from data_plane.gateway.responses_input import input_items, new_id
from data_plane.gateway.responses_items import ImageOptions, check_image, response_usage
from data_plane.gateway.responses_metrics import Op, observed
from data_plane.gateway.runtime import Gateway, Runtime
from data_plane.request_checks import WholeNumber, json_body, validated


class CompactRequest(BaseModel):
    """The body of `POST /v1/responses/compact` (strict: a field of the wrong type or unknown is a 400)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(default="", max_length=256)
    input: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=128)
    instructions: str | None = None
    keep_tokens: WholeNumber = Field(default=256, ge=0)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    service_tier: Literal["auto", "default", "fast", "flex", "priority"] | None = None
    image: ImageOptions | None = None


def mount_compact(app: FastAPI, gw: Gateway, store: Callable[[], ConversationStore],
                  runtime: Callable[[], Runtime]) -> None:
    """POST /v1/responses/compact on `app`; `store()` and `runtime()` once the lifespan opened them."""

    @app.post(RESPONSES_PATH + "/compact")
    async def compact_route(request: Request) -> JSONResponse:
        """Fold a conversation (input items, after previous_response_id's) into a compaction item
        and the newest turns; pass them as the next request's input."""
        with observed(gw.responses_metrics, Op.COMPACT, request):
            principal, owner, tier = record_principal(gw, request)  # the abuse guard first; 401s counted
            replicas = tier.replication
            grant = await gw.limiter.admit(principal.key_id, tier, 0)  # one request from the RPM (the docstring)
            raw = json_body(await read_body(request, gw.settings.max_body_bytes), request.headers.get("content-type"))
            body = validated(CompactRequest, raw)
            check_image(body.image)
            items: list[dict[str, Any]] = []
            if body.previous_response_id:
                items = (await store().previous(body.previous_response_id, owner, replicas)).items
            items = items + await resolve_references(store(), input_items(body.input or []), owner, replicas,
                                                     local=items)
            done = compact_items(gw, runtime(), items, owner, body.keep_tokens, "endpoint")
            output = [done.item, *done.kept] if done is not None else items
            tokens = conversation_tokens(items, gw.counter)
            return JSONResponse({"id": new_id("resp"), "object": "response.compaction", "created_at": int(time.time()),
                                 "output": output, "usage": response_usage({"prompt_tokens": tokens,
                                                                            "completion_tokens": 0}),
                                 "safety_identifier": body.safety_identifier, "service_tier": "default"},
                                headers=grant.headers)
