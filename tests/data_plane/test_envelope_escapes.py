"""A tool envelope's answer is unescaped into content as it streams (data_plane/tool_calls.py): every escape
JSON allows gives text that can be sent, whole or cut at any character, half surrogate pairs included."""

from __future__ import annotations

import json

import pytest

from data_plane.tool_calls import Content, EnvelopeParser

CASES = [
    (r'{"response":"a\ud83d\ude00b"}', "a\U0001f600b"),                # a pair: one character
    (r'{"response":"a\u00e9\n\"q\"\\"}', 'aé\n"q"\\'),                # the plain escapes
    (r'{"response":"a\udc00b"}', "a\ufffdb"),                          # a low half alone
    (r'{"response":"a\ud83d"}', "a\ufffd"),                            # a high half at the end
    (r'{"response":"a\ud83dxyzw12"}', "a\ufffdxyzw12"),                # a high half, then text
    (r'{"response":"a\ud83d\u0041"}', "a\ufffdA"),                     # a high half, then another escape
    (r'{"response":"a\ud83d\ud83d\ude00"}', "a\ufffd\U0001f600"),      # a high half, then a pair
    (r'{"response":"a\ud83d\\u"}', "a\ufffd\\u"),                      # a high half, then an escaped backslash
]


def _content(pieces: list[str]) -> str:
    parser = EnvelopeParser()
    out = [e.text for piece in pieces for e in parser.feed(piece) if isinstance(e, Content)]
    for text in out:
        text.encode("utf-8")  # what the shard's SSE line does with it
    assert parser.state == "done"
    return "".join(out)


@pytest.mark.parametrize(("envelope", "content"), CASES)
def test_every_escape_unescapes_to_text_that_can_be_sent(envelope: str, content: str) -> None:
    assert _content([envelope]) == content
    assert _content(list(envelope)) == content  # one character per delta: escapes cut anywhere


def test_a_well_formed_answer_reads_as_json_reads_it() -> None:
    for envelope, _ in CASES[:2]:
        assert _content(list(envelope)) == json.loads(envelope)["response"]
