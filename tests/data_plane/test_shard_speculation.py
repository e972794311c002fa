"""`--speculation ngram` (the shard's default) on a real shard (float32): vLLM's spec-decode metrics
and the request span's `speculation` event move on a quote prompt, the streamed text equals a
`--speculation off` shard's, and on that shard the metrics stay at 0."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.support.formats import INVARIANT_ARGS
from tests.support.metrics import metric
from tests.support.procs import CLUSTER_HEADERS, Service

PASSAGE = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
           "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n")
QUOTE = [{"role": "user", "content": "Copy the text below exactly, unchanged:\n" + PASSAGE * 2}]
NAMES = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
         "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total")


@pytest.fixture(scope="module")
def off_shard() -> Iterator[Service]:
    svc = Service(["shard", *INVARIANT_ARGS, "--max-num-seqs", "4", "--max-model-len", "1024",
                   "--speculation", "off"], ready_timeout=180)
    svc.start()
    yield svc
    svc.stop()


def stream(url: str, request_id: str) -> str:
    body = {"messages": QUOTE, "temperature": 0, "max_tokens": 40, "stream": True, "request_id": request_id}
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=CLUSTER_HEADERS, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += (choice.get("delta") or {}).get("content") or ""
    return text


def test_metrics_and_span_move_on_a_quote_prompt(fp32_shard: Service, off_shard: Service) -> None:
    url = fp32_shard.url
    before = {n: metric(url, n) for n in NAMES}
    iters = metric(url, "vllm:iteration_tokens_total_count")
    rid = uuid.uuid4().hex
    text = stream(url, rid)
    delta = {n: metric(url, n) - v for n, v in before.items()}
    assert delta["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < delta["vllm:spec_decode_num_accepted_tokens_total"] <= delta["vllm:spec_decode_num_draft_tokens_total"]
    assert delta["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == delta[
        "vllm:spec_decode_num_accepted_tokens_total"]
    assert metric(url, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert metric(url, "vllm:iteration_tokens_total_count") > iters
    span = next(s for s in httpx.get(url + "/debug/spans", headers=CLUSTER_HEADERS).json()
                if s["name"] == "shard.generate" and s["attributes"].get("switchboard.request_id") == rid)
    event = next(e for e in span["events"] if e["name"] == "speculation")
    assert event["attributes"]["accepted_tokens"] > 0 and event["attributes"]["drafts"] > 0

    off = off_shard.url
    before_off = {n: metric(off, n) for n in NAMES}
    assert stream(off, uuid.uuid4().hex) == text
    assert {n: metric(off, n) for n in NAMES} == before_off == {n: 0.0 for n in NAMES}
