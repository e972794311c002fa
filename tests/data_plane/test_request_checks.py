"""Request bodies before any field is read (data_plane/request_checks.py): a body nested just deep
enough to parse but not to re-encode, and the nulls real SDKs send, in process (no server needed).

    .venv/bin/python -m pytest tests/data_plane/test_request_checks.py -q   # ~2 s
"""

from __future__ import annotations

import threading

import pytest

from data_plane.common.errors import SwitchboardError
from data_plane.gateway.responses_items import input_items, parse_responses_request
from data_plane.protocol import parse_chat_request


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("parse,body", [
    (parse_chat_request, '{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "metadata": {{"k": {}}}}}'),
    (parse_responses_request, '{{"model": "m", "input": "hi", "metadata": {{"k": {}}}}}'),
])
def test_a_body_nested_near_the_parsers_limit_is_a_400_never_a_recursion_error(parse, body) -> None:
    """Review: encoding the body again to find lone surrogates takes a few more frames than parsing
    it, so some depths parsed and then failed in json.dumps: an uncaught RecursionError, a 500."""
    failures: list[str] = []

    def scan() -> None:  # on a thread of its own: a stack as shallow as a server's handler's, not pytest's
        for depth in range(850, 1010):
            try:
                parse(body.format(nested(depth)).encode(), "application/json")
            except SwitchboardError as e:
                if e.status != 400:
                    failures.append(f"{depth}: {e}")
            except Exception as e:  # noqa: BLE001 - what the test is for
                failures.append(f"{depth}: {type(e).__name__}")

    t = threading.Thread(target=scan)
    t.start()
    t.join()
    assert not failures, failures[:3]


def test_an_input_item_id_of_null_is_no_id() -> None:
    """The openai SDK's input item types declare `id: Optional[str]`: null means none, as absent
    (review: a 400 "input[0].id must be a string" since the sweep's id check)."""
    items = [{"type": "message", "role": "user", "content": "What is the weather?", "id": None},
             {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}", "id": None,
              "status": None},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny", "id": None, "status": None}]
    out = input_items(items)
    assert [i["type"] for i in out] == ["message", "function_call", "function_call_output"]
    assert all(isinstance(i.get("id"), str) and i["id"] for i in out)  # given ids of their own
    with pytest.raises(SwitchboardError) as e:
        input_items([{**items[0], "id": 5}])
    assert e.value.status == 400 and e.value.param == "input[0].id"
