"""A conversation's item pages while its items are deleted: the cursor (`after`) of an item deleted since it
was handed out still finds its place, as OpenAI's lists do (a synthetic shard, a cache node and a gateway on
loopback for the SDK's loop; `page` itself for the orders and chains).

    .venv/bin/python -m pytest tests/data_plane/test_conversation_pages.py -q     # ~5 s

The openai SDK pages by sending the last id of a page as the next one's `after`. A client that deletes what it
pages through (clearing a conversation item by item, a UI whose user removes a message while another view
scrolls the history) sent a deleted id, and got a 400 "no item with id" half way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from data_plane.common.errors import InvalidRequest
from data_plane.gateway.item_pages import deleted_before, page
from tests.data_plane.test_conversation_limits import KEYS, gateway_on
from tests.support.procs import Service


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    state: Path = tmp_path_factory.mktemp("conversation-pages")
    with Service(["shard", "--engine", "synthetic"]) as shard, gateway_on(shard, state) as gw:
        yield gw


def test_deleting_each_item_while_paging_through_them_clears_the_conversation(gateway: Service) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEYS["roomy"], max_retries=0, timeout=30)
    conv = client.conversations.create(items=[{"role": "user", "content": f"m{i}"} for i in range(20)])
    client.conversations.items.create(conv.id, items=[{"role": "user", "content": f"n{i}"} for i in range(10)])
    seen = []
    for item in client.conversations.items.list(conv.id, order="asc", limit=7):  # the SDK's pages, `after` each
        seen.append(item.content[0].text)
        client.conversations.items.delete(item.id, conversation_id=conv.id)
    assert seen == [f"m{i}" for i in range(20)] + [f"n{i}" for i in range(10)]
    assert client.conversations.items.list(conv.id).data == []


def items(*ids: str) -> list[dict[str, str]]:
    return [{"id": i} for i in ids]


def listed(result: dict[str, Any]) -> list[str]:
    return [i["id"] for i in result["data"]]


def test_a_deleted_cursor_lists_what_followed_it_in_either_order() -> None:
    stored = items("a", "b", "c", "d", "e")
    gone: dict[str, str | None] = {}
    for deleted in ("c", "b"):  # c goes while b stands before it; then b (before it: a)
        deleted_before(gone, stored, deleted)
        stored = [i for i in stored if i["id"] != deleted]
    assert gone == {"c": "b", "b": "a"}
    assert listed(page(stored, limit=10, order="asc", after="c", gone=gone)) == ["d", "e"]
    assert listed(page(stored, limit=10, order="desc", after="c", gone=gone)) == ["a"]
    deleted_before(gone, stored, "a")  # the first item: nothing before it
    stored = stored[1:]
    assert listed(page(stored, limit=10, order="asc", after="c", gone=gone)) == ["d", "e"]
    assert listed(page(stored, limit=10, order="desc", after="b", gone=gone)) == []
    assert listed(page(stored, limit=1, order="desc", after="e", gone=gone)) == ["d"]  # a live cursor, as before
    with pytest.raises(InvalidRequest):  # never listed here: still the 400
        page(stored, limit=10, order="asc", after="zzz", gone=gone)
