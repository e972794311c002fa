"""TextStream: multi-byte safety and stop strings, with a byte-level 'tokenizer'."""

from __future__ import annotations

import random

import pytest

from data_plane.common.errors import ContextLengthExceeded, InvalidRequest
from data_plane.shard.engines.base import TextStream, check_lengths


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def run(text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    ts = TextStream(byte_decode, stop)
    deltas = []
    for b in text.encode():
        deltas.append(ts.push(b))
        if ts.stopped:
            break
    deltas.append(ts.flush())
    return deltas, ts


@pytest.mark.parametrize("text", ["héllo wörld", "世界你好", "party 🎉🎉 time", "a\u0301b", "plain ascii"])
def test_deltas_never_split_a_character(text: str) -> None:
    deltas, _ = run(text)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stop_string_is_cut_and_never_half_sent() -> None:
    text = "one two STOP three"
    deltas, ts = run(text, stop=("STOP",))
    assert ts.stopped
    assert "".join(deltas) == "one two "
    emitted = ""
    for d in deltas:
        emitted += d
        assert "S" not in emitted  # no prefix of the stop string ever went out


def test_partial_stop_prefix_is_released_when_it_does_not_complete() -> None:
    deltas, ts = run("a STO b", stop=("STOP",))
    assert not ts.stopped
    assert "".join(deltas) == "a STO b"


def test_multibyte_stop_string() -> None:
    deltas, ts = run("x 世界 y", stop=("界",))
    assert ts.stopped and "".join(deltas) == "x 世"


def test_random_text_round_trips() -> None:
    rng = random.Random(7)
    alphabet = "ab é世🎉\n"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        deltas, _ = run(text)
        assert "".join(deltas) == text


def test_check_lengths() -> None:
    assert check_lengths(10, None, 100) == 90
    assert check_lengths(10, 90, 100) == 90
    with pytest.raises(ContextLengthExceeded) as e:
        check_lengths(10, 91, 100)
    assert e.value.param == "max_tokens"
    with pytest.raises(ContextLengthExceeded):
        check_lengths(100, None, 100)
    with pytest.raises(InvalidRequest):
        check_lengths(0, 5, 100)


def word_decode(ids: list[int]) -> str:
    return "".join(WORDS[i] for i in ids)


WORDS = [" is", " Lee", ",", " and", " I", "'m", " a", " stud", "ent", " e", "e", " x"]


def words(ids: list[int], stop: tuple[str, ...], min_tokens: int) -> tuple[str, bool]:
    ts = TextStream(word_decode, stop, min_tokens)
    out = ""
    for i in ids:
        out += ts.push(i)
        if ts.stopped:
            return out, True
    return out + ts.flush(), False


def test_stop_strings_count_only_past_min_tokens_as_in_vllm() -> None:
    """vLLM's detokenizer checks stop strings only once a reply has more than `min_tokens` tokens
    (tests/detokenizer/test_min_tokens.py there: stop "e", min_tokens 5 -> " is Lee, and I'm a stud");
    a stop string ended the reply at its first token here, whatever `min_tokens` asked for."""
    sentence = list(range(9))  # " is Lee, and I'm a student"
    assert words(sentence, ("e",), 0) == (" is L", True)
    assert words(sentence, ("e",), 5) == (" is Lee, and I'm a stud", True)
    assert words(sentence, ("e",), 9) == (" is Lee, and I'm a student", False)
    # a stop string that the first token past min_tokens completes counts, and none is ever half sent
    assert words([11, 9, 10, 0], ("ee",), 2) == (" x ", True)
    assert words([11, 9, 10, 0], ("ee",), 3) == (" x ee is", False)
