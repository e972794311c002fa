"""`switchboard bench multiturn`'s bookkeeping (the run itself needs the real model: it is a
benchmark, not a test): rows per turn, the ideal hit under affinity, the summary."""

from __future__ import annotations

from data_plane.bench.multiturn import Turn, summary, turn_rows, user_message


def test_rows_hit_rates_and_summary() -> None:
    turns = [Turn(0, 0, 0.2, 160, 40, 0, "length"), Turn(0, 1, 0.3, 360, 40, 192, "stop", ideal_cached=192),
             Turn(1, 0, 0.4, 160, 40, 0, "stop"), Turn(1, 1, 0.5, 360, 40, 192, "stop", ideal_cached=192)]
    on = turn_rows("on", turns)
    assert [r["turn"] for r in on] == [0, 1]
    assert on[1]["history_tokens"] == 360 and on[1]["prefill_tokens_computed"] == 168
    assert on[1]["hit_rate"] == on[1]["ideal_hit_rate"] == 192 / 360
    assert on[0]["ttft_p50_ms"] == 300.0
    off = turn_rows("off", [Turn(t.conversation, t.turn, t.ttft_s * 4, t.prompt_tokens, 40) for t in turns])
    result = {"rows": off + on, "throughput": {"off": [{"output_tok_s": 100.0, "cached_tokens": 0}],
                                                "on": [{"output_tok_s": 99.0, "cached_tokens": 0}]}}
    s = summary(result)
    assert s["last_turn_ttft_speedup"] == 4.0 and s["hit_rate_vs_ideal"] == 1.0
    assert s["zero_hit_on_over_off"] == 0.99


def test_user_messages_differ_per_conversation_and_turn() -> None:
    a, b, c = user_message(0, 0, 150), user_message(1, 0, 150), user_message(0, 1, 150)
    assert len({a, b, c}) == 3 and user_message(0, 0, 150) == a
    assert 100 <= len(a.split()) <= 130


def test_responses_rows_ratios_and_summary() -> None:
    from data_plane.bench.multiturn_responses import ratios
    from data_plane.bench.multiturn_responses import summary as responses_summary

    sessions = [Turn(0, 0, 0.2, 160, 40), Turn(0, 1, 0.30, 360, 40, 192), Turn(0, 2, 0.40, 560, 40, 384)]
    chains = [Turn(1000, 0, 0.2, 160, 40), Turn(1000, 1, 0.32, 362, 40, 192), Turn(1000, 2, 0.48, 561, 40, 384)]
    got = ratios(turn_rows("sessions", sessions) + turn_rows("responses", chains))
    assert [x["turn"] for x in got] == [0, 1, 2]
    assert got[1]["history_tokens"] == {"sessions": 360, "responses": 362}
    assert abs(got[1]["ratio"] - 0.32 / 0.30) < 1e-9 and abs(got[2]["ratio"] - 1.2) < 1e-9
    s = responses_summary(got)
    assert s["follow_up_turns"] == 2 and s["worst_turn"] == 2 and s["within_target"] is False
    assert responses_summary(got[:2])["within_target"] is True
