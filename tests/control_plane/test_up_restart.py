"""`switchboard up` stopped with Ctrl-C and started again in the same folder: what an application
stored through the Responses and Conversations APIs is still there (the in-memory cache nodes keep
their records in the state dir, data_plane/cache/snapshot.py), and what it deleted stays deleted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import openai
import pytest

from tests.support.procs import free_port, start_up, stop_up, wait_up

MODEL = "synthetic"


def _up(tmp_path: Path, gw: int, cp: int, running: list[subprocess.Popen[bytes]]) -> openai.OpenAI:
    proc = start_up(tmp_path, "--engine", "synthetic", "--gateway-port", str(gw), "--control-plane-port", str(cp),
                    "--no-console", "--shards", "1", "--cache-nodes", "2")
    running.append(proc)
    wait_up(proc, tmp_path)
    key = json.loads((tmp_path / ".switchboard" / "credentials.json").read_text())["keys"]["plus"]
    return openai.OpenAI(base_url=f"http://127.0.0.1:{gw}/v1", api_key=key, max_retries=0, timeout=60)


def test_conversations_and_stored_responses_outlive_an_up_restart(tmp_path: Path) -> None:
    """Every stored response and conversation was gone after `switchboard up` restarted (404 for the
    conversation, its items and the response; previous_response_id a 400), while the keys, the tier
    policy and the usage ledger in the same state dir came back."""
    gw, cp = free_port(), free_port()
    running: list[subprocess.Popen[bytes]] = []
    try:
        client = _up(tmp_path, gw, cp, running)
        conv = client.conversations.create(metadata={"user": "u1"},
                                           items=[{"type": "message", "role": "user", "content": "My name is Zed."}])
        turn = client.responses.create(model=MODEL, input="What is my name?", conversation=conv.id, max_output_tokens=8)
        chained = client.responses.create(model=MODEL, input="hello", max_output_tokens=8)
        gone = client.conversations.create(items=[{"type": "message", "role": "user", "content": "forget me"}])
        client.conversations.delete(gone.id)
        items_before = [i.id for i in client.conversations.items.list(conv.id, order="asc")]
        assert len(items_before) == 3
        stop_up(running.pop())

        client = _up(tmp_path, gw, cp, running)
        assert client.conversations.retrieve(conv.id).metadata == {"user": "u1"}
        assert [i.id for i in client.conversations.items.list(conv.id, order="asc")] == items_before
        assert client.responses.retrieve(turn.id).conversation.id == conv.id
        after = client.responses.create(model=MODEL, input="And now?", conversation=conv.id, max_output_tokens=8)
        assert after.usage.input_tokens > turn.usage.input_tokens  # the earlier turns are in its prompt
        assert client.responses.create(model=MODEL, input="again", previous_response_id=chained.id,
                                       max_output_tokens=8).previous_response_id == chained.id
        with pytest.raises(openai.NotFoundError):
            client.conversations.retrieve(gone.id)
    finally:
        for proc in running:
            stop_up(proc)
