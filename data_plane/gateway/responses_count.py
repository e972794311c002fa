"""`POST /v1/responses/input_tokens`: the Responses API's route that generates nothing.

    client.responses.input_tokens.count(model=..., input="And then?", previous_response_id=r.id, tools=[...])
    # InputTokenCountResponse(object="response.input_tokens", input_tokens=57)

A count is the prompt the same `POST /v1/responses` would send: its instructions, the history of its
previous response or conversation (tenant-bound: another key's id is a 404), its input, and its tools
as the shard's chat template renders them. It is counted by a shard (`Upstream.count`, the shard's
`INPUT_TOKENS_PATH`), with the very code that encodes a prompt for generation
(data_plane/shard/generation.py `prompt_ids`), on the shard the turn would go to; so it equals the
`usage.input_tokens` that create reports. Nothing is generated, stored, rate-limited as tokens or
written to the usage ledger; it takes one request from the key's RPM.

With `truncation: "auto"` the count is of what create would send: OpenAI's count is "the exact number of
tokens the model receives", and with auto a conversation past the context window loses its oldest turns
(and, ours, gets the most relevant of them recalled: `context_recall`) before the model sees it. The window
is the one create fits at degradation level 0 (the key's tier's context, no max_output_tokens: the count
takes none), data_plane/gateway/memory.py `fit_turn`; a transient level-1 shrink is not counted, so a count
does not change with the load. Without truncation, or when even the newest message alone does not fit (a
create would be a 400 context_length_exceeded), the count is the whole conversation: a count is never
refused for its size. A prompt more than a shard takes in one body (its --max-body-bytes, 1 MiB: a
conversation of some 250k tokens, untruncated) is counted by the gateway's own tokenizer, the one that fits
create's window: it was the shard's 413 "request body exceeds 1048576 bytes" for a 50-byte request.

(`POST /v1/responses/{id}/cancel` is with the background responses it cancels:
data_plane/gateway/responses_detached.py.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from data_plane.common.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    UnsupportedParameter,
)
from data_plane.common.http_body import read_body
from data_plane.gateway.context import prompt_room, trim_step
from data_plane.gateway.item_index import resolve_references
from data_plane.gateway.memory import fit_turn, open_compaction
from data_plane.gateway.phases import FORWARDED, cache_salt
from data_plane.gateway.response_store import ConversationStore, Kind
from data_plane.gateway.responses import RESPONSES_PATH, record_principal
from data_plane.gateway.responses_compaction import unsealer
from data_plane.gateway.responses_input import input_items
from data_plane.gateway.responses_items import ResponsesRequest
from data_plane.gateway.responses_metrics import Op, observed
from data_plane.gateway.runtime import Gateway, Runtime
from data_plane.protocol import ChatCompletionRequest, ChatMessage, ShardRequest
from data_plane.request_checks import json_body, validated
from data_plane.tiers import Tier

log = logging.getLogger(__name__)

COUNT_FIELDS = frozenset((
    "model", "input", "instructions", "tools", "text", "previous_response_id", "conversation", "reasoning",
    "tool_choice", "parallel_tool_calls", "truncation", "personality", "context_recall",
))
"""The body `client.responses.input_tokens.count` sends (openai-python's input_token_count_params), and
create's `context_recall` (ours: it changes what truncation "auto" sends)."""


def count_request(body: dict[str, Any]) -> ResponsesRequest:
    """The count's body as a Responses request (the same 400s as create); other fields are a 400."""
    unknown = set(body) - COUNT_FIELDS
    if unknown:
        raise UnsupportedParameter(f"Unrecognized request argument supplied: {min(unknown)}", param=min(unknown))
    if body.get("personality") is not None:
        raise UnsupportedParameter("Unsupported parameter: 'personality' is not supported with this model.", param="personality")
    rreq = validated(ResponsesRequest, {k: v for k, v in body.items() if k != "personality"})
    rreq.check_supported()
    return rreq


def tools_tokens(gw: Gateway, chat: ChatCompletionRequest) -> int:
    """The tools' prompt (the shard renders it beside the messages), counted as the gateway's phases count it."""
    plan = chat.output_plan()
    return gw.counter.prompt_tokens([{"role": "system", "content": plan.tools_prompt}]) if plan.tools_prompt else 0


def fitted(gw: Gateway, tier: Tier, model_context: int, rreq: ResponsesRequest, chat: ChatCompletionRequest,
           messages: list[dict[str, str]], memory: list[dict[str, str]]) -> list[dict[str, str]]:
    """`messages` as create would send them with truncation "auto" (the module docstring): the window its
    phases fit (data_plane/gateway/chat.py `_prepare`: the reply's reserve, then the most the prompt may take),
    or all of them when none fits."""
    context = min(tier.max_context_tokens, model_context)
    tools = tools_tokens(gw, chat)
    try:
        budget, most = prompt_room(context, tier.max_output_tokens, False, tools, "max_output_tokens",
                                   gw.counter.slack)
    except ContextLengthExceeded:
        return messages
    step = trim_step(context, gw.settings.context_trim_step)
    for room in sorted({budget, most}):
        try:
            return fit_turn(messages, memory, gw.counter, room, step, "auto", rreq.context_recall)[0].messages
        except ContextLengthExceeded:
            continue
    return messages


def mount_input_tokens(app: FastAPI, gw: Gateway, store: Callable[[], ConversationStore],
                                  runtime: Callable[[], Runtime]) -> None:
    """The route on `app`; `store()` and `runtime()` once the lifespan opened them."""

    @app.post(RESPONSES_PATH + "/input_tokens")
    async def input_tokens(request: Request) -> JSONResponse:
        with observed(gw.responses_metrics, Op.INPUT_TOKENS, request) as span:
            principal, owner, tier = record_principal(gw, request)  # the abuse guard first; 401s counted
            replicas = tier.replication
            # one request from the key's RPM (a shard encodes up to a whole body; it was unmetered: 200 counts
            # in a row on a 60 RPM key), no tokens: nothing is generated
            grant = await gw.limiter.admit(principal.key_id, tier, 0)
            raw = await read_body(request, gw.settings.max_body_bytes)
            rreq = count_request(json_body(raw, request.headers.get("content-type")))
            new_items = input_items(rreq.input)
            if not new_items:
                raise InvalidRequest("input is required", param="input")
            rt = runtime()
            history: list[dict[str, Any]] = []
            route: str | None = None
            conversation = rreq.conversation_id
            if rreq.previous_response_id or conversation:  # unknown or another key's: the create's 400 / 404
                record = (await store().previous(rreq.previous_response_id, owner, replicas)
                          if rreq.previous_response_id else
                          await store().load(conversation or "", owner, replicas, Kind.CONVERSATION))
                history, route = record.items, record.route
            new_items = await resolve_references(store(), new_items, owner, replicas, local=history)
            unseal = unsealer(rt, owner)
            memory: list[dict[str, str]] = []  # the turns compaction items hold: recall's candidates, as create's

            def summary(encrypted: str) -> str:
                turns, text = open_compaction(encrypted, unseal)
                memory.extend(turns)
                return text

            chat, earlier = rreq.turn_request(history, new_items, summary)
            if len(chat.messages) - earlier > gw.settings.max_messages:
                raise InvalidRequest(f"at most {gw.settings.max_messages} messages are allowed per request",
                                     param="input")
            models = rt.models()
            model = chat.model or next(iter(models), "")
            if model not in models:
                raise ModelNotFound(f"the model {chat.model!r} does not exist", param="model")
            # The request a shard would get for this turn (data_plane/gateway/phases.py shard_request).
            fields: dict[str, Any] = {name: value for name, value in chat if name in FORWARDED and value is not None}
            if chat.model:
                fields["model"] = model
            messages = chat.plain_messages(tools_prompt=False)
            if rreq.truncation == "auto":
                messages = fitted(gw, tier, models[model], rreq, chat, messages, memory)
            shard_req = ShardRequest(messages=[ChatMessage.model_validate(m) for m in messages],
                                     cache_salt=cache_salt(principal.tenant), **fields)
            try:
                tokens = await rt.upstream.count(shard_req, route)
            except PayloadTooLarge:  # more than a shard reads in one body (the module docstring)
                tokens = gw.counter.prompt_tokens(messages) + tools_tokens(gw, chat)
            span.set_attribute("gen_ai.usage.input_tokens", tokens)
            log.info("input tokens counted: %d (%d history items, %d new)", tokens, len(history), len(new_items))
            return JSONResponse({"object": "response.input_tokens", "input_tokens": tokens}, headers=grant.headers)
