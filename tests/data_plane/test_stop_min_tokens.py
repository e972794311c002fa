"""`min_tokens` beside stop strings on a real torch shard, as vLLM serves them: a stop string counts only
once the reply has more than `min_tokens` tokens (vLLM's detokenizer; its tests/detokenizer/test_min_tokens.py).
Here a stop string in the first token ended the reply with no text, whatever `min_tokens` asked for, so a
torch shard and a vLLM shard answered the same request differently."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.support.procs import CLUSTER_HEADERS, Service

MODEL = "SmolLM2-135M-Instruct"
PROMPT = [{"role": "user", "content": "Count from 1 to 30 separated by commas."}]


def _ask(shard: Service, **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": PROMPT, "temperature": 0, "max_tokens": 40, "logprobs": True, **kw}
    reply: dict[str, Any] = httpx.post(shard.url + "/v1/chat/completions", headers=CLUSTER_HEADERS, json=body,
                                       timeout=120).json()
    return reply


def _streamed(shard: Service, **kw: Any) -> str:
    body = {"model": MODEL, "messages": PROMPT, "temperature": 0, "max_tokens": 40, "stream": True, **kw}
    text = ""
    with httpx.stream("POST", shard.url + "/v1/chat/completions", headers=CLUSTER_HEADERS, json=body,
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    return text


def test_a_stop_string_counts_only_past_min_tokens(fp32_shard: Service) -> None:
    free = _ask(fp32_shard)
    full = free["choices"][0]["message"]["content"]
    tokens = [t["token"] for t in free["choices"][0]["logprobs"]["content"]]
    assert full.startswith("1") and len(tokens) > 12, full

    early = _ask(fp32_shard, stop=["1"])["choices"][0]
    assert (early["message"]["content"], early["finish_reason"]) == ("", "stop")

    reply = _ask(fp32_shard, stop=["1"], min_tokens=6)
    choice = reply["choices"][0]
    past = len("".join(tokens[:6]))  # the text of the first min_tokens tokens: a "1" there does not stop
    cut = full.index("1", past)
    assert (choice["message"]["content"], choice["finish_reason"]) == (full[:cut], "stop"), full
    assert reply["usage"]["completion_tokens"] > 6
    assert _streamed(fp32_shard, stop=["1"], min_tokens=6) == full[:cut]


def test_a_raw_prompts_text_is_not_output_already_made(fp32_shard: Service) -> None:
    """The legacy Completions API's raw prompt is sent as a continued final message (so a resume continues it as
    one text), and the shard took a continued message for output already sent: a prompt of 13 tokens counted
    against `min_tokens` 6 (a stop string ended the reply at once) and its tokens were penalized as output by
    presence/frequency penalties."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "1, 2, 3, 4, 5, 6, 7,"}], "raw_prompt": True,
            "continue_final_message": True, "add_generation_prompt": False, "temperature": 0, "max_tokens": 20,
            "stop": [","], "min_tokens": 6}
    reply = httpx.post(fp32_shard.url + "/v1/chat/completions", headers=CLUSTER_HEADERS, json=body,
                       timeout=120).json()
    assert reply["usage"]["completion_tokens"] > 6, reply
