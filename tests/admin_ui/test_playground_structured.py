"""The console's Playground sends a JSON schema or tools and shows what came back: against a cluster with
a real float32 torch shard, in-process (AppTest) and in headless Chromium with screenshots (the answer
shown as valid JSON; the tool call with its name and arguments).

    .venv/bin/python -m pytest tests/admin_ui/test_playground_structured.py -q      # ~3 min (real model)

Screenshots go to a temporary folder, or to ``docs/img/`` with ``SWITCHBOARD_UPDATE_SCREENSHOTS=1``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from admin_ui.client import ChatToolCall
from admin_ui.screenshot import find_chromium
from admin_ui.views.playground import EXAMPLE_SCHEMA, ToolCalls, output_fields, structured_json
from data_plane.strict_schema import strict_schema_problem
from tests.support.cluster import ADMIN_TOKEN, Cluster
from tests.support.console import ConsoleRunner, texts
from tests.support.formats import INVARIANT_ARGS

DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
PERSON = "Invent a person. Give their name and age."
WEATHER = "What is the weather in Paris?"


def test_output_fields_and_tool_call_assembly() -> None:
    assert output_fields("Text", "", "", "auto") == {}
    rf = output_fields("JSON schema", EXAMPLE_SCHEMA, "", "auto")["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["schema"]["required"] == ["name", "age"]
    assert rf["json_schema"]["strict"] and strict_schema_problem(rf["json_schema"]["schema"]) is None  # else a 400
    with pytest.raises(ValueError, match="not valid JSON"):
        output_fields("JSON schema", "{name", "", "auto")
    with pytest.raises(ValueError, match="JSON list"):
        output_fields("Tools", "", "{}", "auto")
    assert output_fields("Tools", "", "[{}]", "required", parallel=False)["parallel_tool_calls"] is False
    calls = ToolCalls()
    for e in (ChatToolCall(0, "call_1", "get_weather", ""), ChatToolCall(0, None, None, '{"city":'),
              ChatToolCall(0, None, None, '"Paris"}')):
        calls.add(e)
    assert calls.done() == [{"id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'}]
    assert structured_json("{") [0] is None and structured_json('{"a": 1}') == ({"a": 1}, None)


@pytest.fixture(scope="module")
def torch_cluster() -> Iterator[Cluster]:
    with Cluster(shards=1, caches=1, engine="torch",
                 shard_args=[*INVARIANT_ARGS, "--max-num-seqs", "4", "--max-model-len", "2048"],
                 gateway_args=["--silence-timeout-s", "30"]) as c:
        yield c


def _runner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, c: Cluster) -> ConsoleRunner:
    runner = ConsoleRunner(monkeypatch, tmp_path)
    runner.point_at(c.control_plane.url, gateway_url=c.gateway.url, keys={"plus": c.keys["plus"]})
    return runner


def test_playground_sends_a_schema_and_tools(monkeypatch, tmp_path, torch_cluster) -> None:
    at = _runner(monkeypatch, tmp_path, torch_cluster).page("playground", timeout=240)  # a real model, loaded CPU
    at.selectbox(key="pg_tier").set_value("plus")
    at.radio(key="pg_output").set_value("JSON schema").run()
    at.text_area(key="pg_prompt").input(PERSON)
    next(b for b in at.button if b.label == "Send").click().run()
    assert not at.exception
    last = at.session_state["pg_last"]
    assert last["status"] == 200 and last["finish"] == "stop", last
    person = json.loads(last["answer"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert "Valid JSON" in texts(at)

    at.radio(key="pg_output").set_value("Tools").run()
    at.radio(key="pg_tool_choice").set_value("required").run()
    assert at.checkbox(key="pg_parallel").value is False  # one call by default (a small model repeats calls)
    at.text_area(key="pg_prompt").input(WEATHER)
    next(b for b in at.button if b.label == "Send").click().run()
    assert not at.exception
    last = at.session_state["pg_last"]
    assert last["finish"] == "tool_calls", last
    (call,) = last["tool_calls"]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(json.loads(call["arguments"])) == {"city"}
    assert "Tool call" in texts(at)

    at.radio(key="pg_output").set_value("JSON schema").run()
    at.text_area(key="pg_schema").input("{not json").run()
    at.text_area(key="pg_prompt").input(PERSON)
    next(b for b in at.button if b.label == "Send").click().run()
    assert "The JSON schema is not valid JSON" in texts(at)


@pytest.mark.slow
@pytest.mark.skipif(find_chromium() is None, reason="no chromium binary (apt-get install chromium)")
def test_playground_in_chromium_shows_the_json_and_the_tool_call(tmp_path, torch_cluster) -> None:
    pytest.importorskip("websocket", reason="needs websocket-client")
    from admin_ui.screenshot import Chromium, click_label, send_chat
    from tests.support.live_platform import console_service

    out = DOCS_IMG if os.environ.get("SWITCHBOARD_UPDATE_SCREENSHOTS") == "1" else tmp_path / "img"
    credentials = tmp_path / "credentials.json"
    credentials.write_text(json.dumps({"keys": {"plus": torch_cluster.keys["plus"]}, "admin_token": ADMIN_TOKEN}))
    # generous waits: a loaded 2-core machine renders and answers slowly
    with console_service(torch_cluster.control_plane.url, torch_cluster.gateway.url, credentials) as console, \
            Chromium(token=ADMIN_TOKEN) as browser:
        browser.capture(console.url + "/playground", tmp_path / "empty.png", expect=["Playground", "Output"],
                        timeout=120)
        click_label(browser, "JSON schema")
        browser.wait_ready(["Send"], timeout=120)
        send_chat(browser, PERSON, timeout=120)
        shots = [browser.snapshot(out / "console-playground-json.png", expect=["Valid JSON"], timeout=120)]
        click_label(browser, "Tools")
        click_label(browser, "required")
        # a new conversation clears the last answer, so the next trace link is the tool call's
        browser.evaluate("[...document.querySelectorAll('button')].find(b => b.innerText.trim()"
                         ".endsWith('New conversation')).click()")
        deadline = time.monotonic() + 60
        while browser.evaluate("document.body.innerText.includes('Open trace')") and time.monotonic() < deadline:
            time.sleep(0.3)
        browser.wait_ready(["Tool choice"], timeout=120)
        send_chat(browser, WEATHER, timeout=120)
        shots.append(browser.snapshot(out / "console-playground-tools.png", expect=["Tool call", "get_weather"],
                                      timeout=120))
        # the call is shown in the assistant's bubble (it used to stay empty: a tool call has no text)
        bubble = browser.evaluate("[...document.querySelectorAll('[data-testid=\"stChatMessage\"]')]"
                                  ".map(m => m.innerText).pop() || ''")
        assert "Tool call" in bubble and "get_weather" in bubble, bubble
        page = browser.evaluate("document.body.innerText")
        assert page.count("Tool call") == 1 and "finish tool_calls" in page.replace("\n", " "), page[-800:]
    for path in shots:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000, path
