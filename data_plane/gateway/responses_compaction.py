"""Compaction items of the Responses API: sealed for the key that made them, opened for it alone, and what folds
a stored conversation's older turns into one (`context_management` compaction, off the request path).

    item = compact_items(gw, rt, items, owner, keep_tokens=256, trigger="endpoint")   # POST /v1/responses/compact
    summary = open_compaction(item["encrypted_content"], unsealer(rt, owner))       # 400 for another key's
    gw_store.later(compact_record(gw, rt, store, record, owner, replicas, threshold), name="responses-compaction")

The folding itself (what is kept, the summary, recall's turns) is data_plane/gateway/memory.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from opentelemetry import trace

from data_plane.common.crypto import SealError
from data_plane.common.errors import InvalidRequest, SwitchboardError
from data_plane.gateway.memory import Compaction, compact
from data_plane.gateway.record_locks import record_key
from data_plane.gateway.response_store import ConversationStore, Kind, Record
from data_plane.gateway.responses_input import items_to_messages, new_id
from data_plane.gateway.runtime import Gateway, Runtime
from data_plane.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

COMPACTION_SCOPE = "responses-compaction"
"""What compaction items are sealed for (with the key's digest): they open for that key only."""


def unsealer(rt: Runtime, owner: str) -> Callable[[str], list[dict[str, str]]]:
    """Opens compaction items this key made (400 for anything else: another key's, or tampered)."""
    def unseal(encrypted: str) -> list[dict[str, str]]:
        if rt.sealer is None:
            raise InvalidRequest("compaction items need session encryption", param="input")
        try:
            return rt.sealer.open(COMPACTION_SCOPE, owner, [{"role": "sealed", "content": encrypted}])
        except SealError:
            raise InvalidRequest("a compaction item's encrypted_content does not open for this API key",
                                 param="input", code="invalid_encrypted_content") from None
    return unseal


def sealer_for(rt: Runtime, owner: str) -> Callable[[list[dict[str, str]]], str]:
    def seal(content: list[dict[str, str]]) -> str:
        if rt.sealer is None:
            raise InvalidRequest("compaction items need session encryption", param="input")
        return rt.sealer.seal(COMPACTION_SCOPE, owner, content)[0]["content"]
    return seal


def plain(items: list[dict[str, Any]]) -> list[dict[str, str]]:
    """`items` as the chat path's plain messages (tool calls as the model's envelope, results as user
    turns naming the tool); compaction items as empty system messages."""
    messages = items_to_messages(items, lambda e: "")
    if not messages:
        return []
    return ChatCompletionRequest.model_validate({"messages": messages}).plain_messages(tools_prompt=False)


def conversation_tokens(items: list[dict[str, Any]], counter: Any) -> int:
    return int(counter.prompt_tokens(plain(items)))


def compact_items(gw: Gateway, rt: Runtime, items: list[dict[str, Any]], owner: str, keep_tokens: int,
                  trigger: str) -> Compaction | None:
    done = compact(items, keep_tokens, gw.counter, seal=sealer_for(rt, owner), unseal=unsealer(rt, owner),
                   to_messages=plain, item_id=new_id("cmp"))
    if done is not None:
        gw.memory_metrics.compactions.labels(trigger).inc()
        gw.memory_metrics.compacted_tokens.inc(done.tokens)
        span = trace.get_current_span()
        span.add_event("context.compaction", {"switchboard.compaction.items": done.compacted,
                                              "switchboard.compaction.tokens": done.tokens,
                                              "switchboard.compaction.trigger": trigger})
        log.info("compaction (%s): %d item(s), %d tokens folded into one item", trigger, done.compacted, done.tokens)
    return done


async def compact_record(gw: Gateway, rt: Runtime, store: ConversationStore, record: Record, owner: str,
                         replicas: int, threshold: int) -> None:
    """`context_management` compaction, off the request path: the stored record's older turns become
    one compaction item once the conversation passes `threshold` tokens."""
    with tracer.start_as_current_span("responses.compaction"):
        lock = record_key(owner, record.id)
        try:  # the conversation's write lock (record_locks.py): a turn under way would be overwritten
            await gw.record_locks.acquire(lock, wait_s=0.0)
        except SwitchboardError:
            log.info("background compaction skipped: a turn is under way")
            return
        try:
            current = await store.load(record.id, owner, replicas, record.kind)
            if current.version != record.version:  # a newer turn was saved meanwhile: compact it next time
                log.info("background compaction skipped: the record changed")
                return
            done = compact_items(gw, rt, record.items, owner, threshold // 2, "threshold")
            if done is None:
                return
            start, end = record.input_range
            folded = done.compacted
            record.items = [done.item, *done.kept]
            if record.kind is Kind.RESPONSE:  # the input range moves with the items (or goes, if folded)
                record.input_range = (start - folded + 1, end - folded + 1) if start >= folded else (0, 0)
            await store.save(record, owner, replicas)
        except SwitchboardError as exc:  # the nodes failed (or the record is gone): next time
            log.info("background compaction skipped: %s", exc.code)
        finally:
            gw.record_locks.release(lock)
