"""Token-exact transcripts: a previous reply re-enters the prompt as the tokens the model generated.

Owned by the torch engine (data_plane/shard/engines/torch_engine.py): it remembers each reply's
tokens when a request ends and splices them into the next turn's prompt.

    memory = GeneratedTokens()
    memory.remember("tenant:acme", reply_text, output_ids)        # when a request ends (engine thread)
    ids, restored = memory.splice(messages, ids, "tenant:acme", engine.encode_chat)   # next turn

The gateway keeps a conversation as text, so turn N+1's prompt carries turn N's reply re-tokenized.
A model does not always emit the canonical tokenization of its own text: SmolLM2 emits "\\n\\n" as one
token (1116) before a word, where its tokenizer splits "\\n\\n1" into "\\n", "\\n1". From that token on,
the re-rendered prompt differs from what the previous turn's slot held, and the prefix cache misses
the rest of the reply and everything after it (a silent 0 % hit in other projects). So the shard
remembers, per cache salt and reply text, the ids it generated, and puts them back in place of the
re-tokenized reply when a later prompt carries that exact text. Only a span that checks out is
replaced: the prompt rendered up to the reply's start and up to its end must be prefixes of the
full prompt (the chat template tokenizes each message on its own), so an unknown template or an
edited reply just keeps the canonical tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import xxhash

DEFAULT_MAX_REPLIES = 8192
"""Replies remembered (LRU beyond); a forgotten one is re-tokenized, which may cost a re-prefill."""

Encode = Callable[..., list[int]]
"""engine.encode_chat(messages, continue_final=False) -> ids."""


class GeneratedTokens:
    def __init__(self, max_replies: int = DEFAULT_MAX_REPLIES) -> None:
        self.max_replies = max_replies
        self._ids: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()  # remembered on the engine thread, read on the event loop

    @staticmethod
    def _key(salt: str | None, text: str) -> bytes:
        return xxhash.xxh3_128_digest((salt or "").encode() + b"\x00" + text.encode())

    def remember(self, salt: str | None, text: str, ids: Sequence[int]) -> None:
        if not text or not ids:
            return
        key = self._key(salt, text)
        with self._lock:
            self._ids[key] = tuple(ids)
            self._ids.move_to_end(key)
            while len(self._ids) > self.max_replies:
                self._ids.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ids)

    def splice(self, messages: Sequence[dict[str, str]], ids: list[int], salt: str | None,
               encode: Encode) -> tuple[list[int], int]:
        """`ids` with every remembered assistant reply restored to its generated tokens; returns
        (ids, replies restored whose tokens differed from the re-tokenization)."""
        if not self._ids:
            return ids, 0
        restored = 0
        out = list(ids)
        # Last reply first: a replacement never moves the spans of the replies before it.
        for i in range(len(messages) - 1, -1, -1):
            m = messages[i]
            if m["role"] != "assistant" or not m["content"]:
                continue
            key = self._key(salt, m["content"])
            with self._lock:
                generated = self._ids.get(key)
                if generated is not None:
                    self._ids.move_to_end(key)
            if generated is None:
                continue
            if i == 0:
                continue
            head = encode(list(messages[: i + 1]), continue_final=True)   # ... up to the reply's end
            start = len(encode(list(messages[:i])))                        # ... up to its first token
            if start > len(head) or ids[: len(head)] != head:
                continue  # the template does not render messages one by one: keep the canonical ids
            canonical = head[start:]
            if list(generated) != canonical:
                out[start : len(head)] = generated
                restored += 1
        return out, restored
