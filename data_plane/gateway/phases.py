"""The values the chat request path's phases hand each other (data_plane/gateway/chat.py), and the
pure steps between them: the shard request built once, the system/history merge written once.

    caller = handler._authenticate()                 # Caller: principal, tier, tier policy, abuse measures
    checked = await handler._validate(caller)        # Checked: the request, model, output cap, messages
    checked, policy = await handler._budget(caller, checked)  # the default output cap fitted to the TPM;
                                                     # the rate-limit grant taken; the input screened
    prepared = await handler._prepare(caller, checked)   # Prepared: the window and the ShardRequest
    stream = await handler._route(caller, checked, prepared)  # response cache, or admission + a shard

Each is frozen: a phase reads what the earlier ones decided and cannot change it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from data_plane.gateway.abuse import Measures
from data_plane.gateway.auth import Principal
from data_plane.gateway.context import Window
from data_plane.gateway.stream import Completion, EventSource
from data_plane.protocol import ChatCompletionRequest, ChatMessage, ShardRequest, UsageChunks
from data_plane.tiers import Tier, TierPolicy

log = logging.getLogger(__name__)

FORWARDED = frozenset((
    "temperature", "top_p", "top_k", "stop", "seed", "min_p", "n", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "ignore_eos", "logprobs", "top_logprobs", "logit_bias",
    "response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls",
))
"""Request fields the gateway sends on to the shard as the client gave them (data_plane/protocol.py)."""
DEADLINE_FIRST_TOKEN_TIMEOUTS = 5
"""The shard abandons the work this many first-token timeouts after the gateway sent it, if it is still
waiting for a slot then (a stream already running is ended by its length or its client, not the clock)."""


@dataclass(frozen=True)
class Caller:
    """Who is asking: the authenticated key, its tier (from the hot tier policy when it has it) and the
    abuse measures in force for it."""

    principal: Principal
    tier: Tier
    tiers: TierPolicy
    measures: Measures


@dataclass(frozen=True)
class Checked:
    """A valid request this caller may make: the model it names (and that model's context), the output
    cap after the tier's, the level's and the abuse measures' limits, and its messages as plain text."""

    req: ChatCompletionRequest
    model: str
    model_context: int
    max_tokens: int
    messages: list[dict[str, str]]
    tools_tokens: int
    """The tool definitions' prompt, counted like a system message outside the sliding window."""

    @property
    def choices(self) -> int:
        return self.req.n or 1

    def within_tpm(self, tpm: int, prompt_tokens: int) -> Checked:
        """Without max_tokens, the default output cap (the tier's) lowered to what a minute's tokens (`tpm`,
        the tightest limit on the key) leave after the prompt, the tools and the choices: counted whole, a
        tier whose TPM is below its output cap (plus: cap 1024, tpm 600) refused every such request as
        "too large", forever. The reply stops there with finish_reason "length". A max_tokens the client
        set is kept: that request is refused as too large, as it asked."""
        if self.req.output_limit:
            return self
        room = (tpm - prompt_tokens - self.tools_tokens) // self.choices
        return replace(self, max_tokens=room) if 0 < room < self.max_tokens else self

    @property
    def output_hint(self) -> str:
        """What a refusal as too large for the TPM adds when the request set no max_tokens: its reply was
        already capped to the room the limit leaves, so the prompt itself is what does not fit."""
        if self.req.output_limit:
            return ""
        return "The request sets no max_tokens, and its prompt leaves no room for a reply within that limit."


@dataclass
class Opened:
    """A request that passed every check, with its shard stream's first token in hand (not frozen: a
    detached Responses run streams what the request would have answered in one body)."""

    stream: EventSource
    completion: Completion
    headers: dict[str, str]
    include_usage: UsageChunks | bool | None
    """None: answer with one JSON body; else stream SSE (with usage chunks: UsageChunks; True is FINAL)."""


@dataclass(frozen=True)
class Prepared:
    """The prompt with its conversation, the window of it that fits, and the request for a shard."""

    prompt: list[dict[str, str]]
    window: Window
    max_tokens: int
    request: ShardRequest


def merge_history(history: list[dict[str, str]], messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A session's stored `history` continued by the new `messages`: new system messages first and in
    place of the stored ones, then the history, then the rest of the new messages."""
    if not any(m["role"] == "system" for m in messages):
        return history + messages
    system = [m for m in messages if m["role"] == "system"]
    return system + [m for m in history if m["role"] != "system"] + [m for m in messages if m["role"] != "system"]


def shard_request(checked: Checked, caller: Caller, window: Window, max_tokens: int, *, request_id: str,
                  deadline: float, session_id: str | None, kv_ttl_s: float) -> ShardRequest:
    """The one request sent to a shard (a resume sends a changed copy, data_plane/routing/resume.py):
    the fitted window, the output cap, the tier's priority, the tenant's prefix-cache scope, and the
    client's sampling and output fields as given."""
    req = checked.req
    fields: dict[str, Any] = {name: value for name, value in req if name in FORWARDED and value is not None}
    if session_id:  # the shard keeps this session's KV blocks on its transcript's cache nodes
        fields.update(session_id=session_id, kv_replicas=caller.tier.replication, kv_ttl_s=kv_ttl_s)
    if req.model:
        fields["model"] = checked.model
    if req.continue_final_message:  # vLLM's: the final (assistant) message is continued, not answered
        fields.update(continue_final_message=True, add_generation_prompt=False)
    if req.raw_prompt:  # the legacy Completions API's prompt, no chat template (data_plane/gateway/completions.py)
        fields.update(raw_prompt=True, prompt_token_ids=req.prompt_token_ids, prompt_logprobs=req.prompt_logprobs)
    if fields.get("top_p") == 0:  # the nucleus of the one most likely token, as vLLM takes it (it refuses top_p 0)
        fields.pop("top_p")
        fields["top_k"] = 1
    return ShardRequest(
        messages=[ChatMessage.model_validate(m) for m in window.messages],
        max_tokens=max_tokens, stream=True, priority=caller.tier.priority,
        cache_salt=cache_salt(caller.principal.tenant), request_id=request_id, deadline=deadline, **fields)


def cache_salt(tenant: str) -> str:
    """The prefix-cache scope of a tenant's requests: KV is reused within a tenant only (no timing side
    channel across tenants); the shard's token-exact transcripts are kept per scope too."""
    return f"tenant:{tenant}"


async def keep_first_turn(handler: Any) -> None:
    """Keep a new chat session (`session_version` 0: no turn saved) whose first turn ended unsaved
    after its id went out in the stream's headers (the client stopped the reply; an error after the
    first byte), with that turn's system messages only. A later turn that ends so leaves its session
    as it was (never a question without its answer, never half an answer); the first one leaves it
    existing, with the app's system prompt, so the id the client holds keeps working: it was a 404
    session_not_found on the next turn. Never raises: the request is over either way.
    `handler` is the request's data_plane/gateway/chat.ChatHandler."""
    h, opened = handler, handler.opened
    if (h.OPERATION != "chat" or h.session_version or not h.session_id or h.tier is None or opened is None
            or opened.include_usage is None):
        return
    kept = [m for m in h.new_messages if m["role"] == "system"]
    try:
        await h.rt.sessions.save(h.session_id, h.owner, kept, 1, h.tier.replication,
                                 ttl_s=h.gw.settings.session_ttl_s, only_newer=True)
    except Exception as exc:  # noqa: BLE001 -- the next turn on the id then says 404, as before
        log.warning("request %s: new session not kept after its first turn ended unsaved: %s",
                    h.request_id, type(exc).__name__)
