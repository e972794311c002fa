"""GeneratedTokens (data_plane/shard/kv_transcript.py) against a ChatML-like encoder: a remembered reply is put
back as its generated ids; unknown text, another salt or a template that does not render message by
message keep the canonical ids."""

from __future__ import annotations

from data_plane.shard.kv_transcript import GeneratedTokens

START, END, NL = 1, 2, 10


def encode(messages: list[dict[str, str]], continue_final: bool = False) -> list[int]:
    ids: list[int] = []
    for i, m in enumerate(messages):
        ids += [START, ord(m["role"][0]), NL] + [ord(c) for c in m["content"]]
        if not (continue_final and i == len(messages) - 1):
            ids += [END, NL]
    return ids if continue_final else ids + [START, ord("a"), NL]


CONVO = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab\n\ncd"},
         {"role": "user", "content": "more"}]
GENERATED = [ord("a"), ord("b"), 999, ord("c"), ord("d")]   # "\n\n" came out as one token


def test_restores_a_remembered_reply_in_place() -> None:
    memory = GeneratedTokens()
    memory.remember("t", "ab\n\ncd", GENERATED)
    canonical = encode(CONVO)
    out, restored = memory.splice(CONVO, canonical, "t", encode)
    start = len(encode(CONVO[:1]))
    assert restored == 1 and out[start : start + 5] == GENERATED
    assert out[:start] == canonical[:start] and out[start + 5 :] == canonical[start + 6 :]


def test_keeps_canonical_ids_otherwise() -> None:
    memory = GeneratedTokens(max_replies=1)
    canonical = encode(CONVO)
    assert memory.splice(CONVO, canonical, "t", encode) == (canonical, 0)       # nothing remembered
    memory.remember("t", "ab\n\ncd", GENERATED)
    assert memory.splice(CONVO, canonical, "other", encode) == (canonical, 0)   # another tenant's
    memory.remember("t", "something else", [1])                                 # LRU: the first is gone
    assert memory.splice(CONVO, canonical, "t", encode) == (canonical, 0)
    memory.remember("t", "ab\n\ncd", [ord(c) for c in "ab\n\ncd"])             # same as canonical
    assert memory.splice(CONVO, canonical, "t", encode) == (canonical, 0)
    memory.remember("t", "ab\n\ncd", GENERATED)
    whole = lambda m, continue_final=False: [len(m)] + encode(m, continue_final)  # not message by message
    assert memory.splice(CONVO, whole(CONVO), "t", whole)[1] == 0
