"""Which logprobs go out with which text through the gateway's output filter (data_plane/gateway/stream.py),
for replies whose tokens' bytes do not spell the text: a tool envelope's content. The shard's own
:class:`~data_plane.shard.choices.Choice` makes the chunks, `parse_line` reads them as the gateway does,
and the gateway's :class:`~data_plane.gateway.stream.Completion` releases them through a real rule filter.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_logprobs_release.py -q
"""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import AsyncIterator

from data_plane.gateway.safety.filters import RuleSet
from data_plane.gateway.safety.stream import OutputStreamFilter
from data_plane.gateway.stream import Completion
from data_plane.protocol import chunk_body
from data_plane.routing.events import Event, parse_line
from data_plane.shard.choices import Choice
from data_plane.shard.engines.base import GenerationOutput, TokenLogprob
from data_plane.structured import OutputPlan, ToolMode

ENVELOPE = ['{"', 'response', '":', ' "', 'Line', ' one', '\\n', 'Line', ' two', '\\n', '\\"', 'Line', '\\"',
            ' three', '\\n', 'Fils', ' four', '"}']
"""A tool-mode reply's tokens, as the model writes them: its content is `Line one\\nLine two\\n"Line" three...`,
each `\\n` and `\\"` two bytes of the tokens for one character of the content."""


def _shard_lines() -> list[bytes]:
    """The SSE lines a shard sends for ENVELOPE (tools, logprobs requested)."""
    vocab = {i: t.encode() for i, t in enumerate(ENVELOPE)}
    choice = Choice(0, OutputPlan(constraint=None, tool_mode=ToolMode.AUTO, tools_prompt="tools"), vocab.__getitem__)
    lines = []
    for i, token in enumerate(ENVELOPE):
        last = i == len(ENVELOPE) - 1
        out = GenerationOutput(text=token, finish_reason="stop" if last else None, prompt_tokens=5,
                               completion_tokens=i + 1, logprobs=(TokenLogprob(i, -0.5),))
        for delta in choice.feed(out):
            logprobs = delta.pop("logprobs", None)
            body = chunk_body(completion_id="c", model="m", created=0, fingerprint="fp_0", delta=delta, logprobs=logprobs)
            lines.append(b"data: " + json.dumps(body).encode())
    return lines


class _Source:
    member = None

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    async def batches(self) -> AsyncIterator[list[Event]]:
        for line in self.lines:
            events = parse_line(line)
            assert isinstance(events, list)
            yield events

    def close(self) -> None:
        pass


def _pieces(blocked: list[str]) -> tuple[list[tuple[str, list[str]]], Completion]:
    exchange = types.SimpleNamespace(tool_calls=0, usage=None, first_content_at=0.0)
    completion = Completion(exchange, "m", lambda: OutputStreamFilter([RuleSet({"test": blocked})]),  # type: ignore[arg-type]
                            types.SimpleNamespace(record=lambda *a: None), save_turn=None, logprobs=True)  # type: ignore[arg-type]

    async def run() -> list[tuple[str, list[str]]]:
        return [(delta.get("content", ""), [e["token"] for e in (delta.get("logprobs") or {}).get("content", [])])
                async for pieces in completion._batches(_Source(_shard_lines()))  # type: ignore[arg-type]
                for _, delta in pieces]

    return asyncio.run(run()), completion


def test_each_entry_goes_out_with_its_own_text_when_token_bytes_do_not_spell_the_text() -> None:
    """Entries were released once the tokens' bytes fitted in the released text's bytes; an escaped `\\n`
    is two bytes of tokens for one of text, so after it every entry lagged a token behind (after k escapes,
    k bytes): the chunk with the text "Line" carried the logprob of `\\n`, the reply's last entries came
    alone at its end, and a client pairing a chunk's text with its logprobs read them against the wrong
    text. Each entry now goes out with the text its own delta brought."""
    pieces, completion = _pieces(["nothing matches this"])
    sent = [(text, tokens) for text, tokens in pieces if text or tokens]
    assert sent[2] == ("\n", ["\\n"]) and sent[3] == ("Line", ["Line"]), sent
    texts = [t for t, _ in sent]
    assert "".join(texts) == 'Line one\nLine two\n"Line" three\nFils four', texts
    lagging = [(text, tokens) for text, tokens in sent if tokens and text != "".join(tokens).replace("\\n", "\n")
               .replace('\\"', '"')]
    assert not lagging, lagging
    assert [e["token"] for e in completion.choices[0].logprobs] == ENVELOPE[4:-1]


def test_a_blocked_word_s_entries_never_go_out_under_tools() -> None:
    """Blocked at "Fils": what went out is the text before it and the entries of exactly that text."""
    pieces, completion = _pieces(["Fils"])
    text = "".join(t for t, _ in pieces)
    tokens = [tok for _, toks in pieces for tok in toks]
    assert "Fils" not in text + "".join(tokens)
    assert text.startswith('Line one\nLine two\n"Line" three'), text
    assert tokens == ENVELOPE[4:15], tokens
    assert completion.choices[0].logprobs == [] or [e["token"] for e in completion.choices[0].logprobs] == tokens
