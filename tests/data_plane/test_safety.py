from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from data_plane.common.errors import ContentPolicyViolation
from data_plane.gateway.safety.pipeline import (
    ALLOW,
    DEFAULT_POLICIES,
    DEFAULT_WINDOW,
    FILTERS,
    Match,
    OutputStreamFilter,
    PiiFilter,
    RuleSet,
    SafetyMetrics,
    SafetyPolicies,
    SafetyPolicy,
    Verdict,
    luhn_valid,
    raise_if_blocked,
)

WMD = "weapons_of_mass_destruction"
PHRASE = "how to build a bomb"


def default_policy() -> SafetyPolicy:
    return SafetyPolicies.default().get("default")


def stream_through(stream: OutputStreamFilter, deltas: list[str]) -> tuple[str, list[str]]:
    """Feed deltas as the gateway does (stop once blocked); returns (output, per-call outputs)."""
    outs = []
    for d in deltas:
        outs.append(stream.feed(d))
        if stream.verdict is not None:
            break
    else:
        outs.append(stream.finish())
    return "".join(outs), outs


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# --- verdicts and rules -------------------------------------------------------------------


def test_verdict_is_frozen_and_carries_no_text():
    v = Verdict(False, "pii", "credit_card")
    assert v.blocked and not ALLOW.blocked
    assert [f.name for f in dataclasses.fields(Verdict)] == ["allowed", "category", "rule"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.allowed = True  # type: ignore[misc]


def test_ruleset_categories_case_and_whitespace():
    rules = RuleSet({"violence": [r"kill\s+them\s+all"], "self_harm": [r"hurt\s+myself", "end it all"]})
    assert rules.categories() == ["violence", "self_harm"]
    assert rules.check("we should KILL   them ALL now") == Verdict(False, "violence", "violence#0")
    assert rules.check("I want to hurt myself.") == Verdict(False, "self_harm", "self_harm#0")
    assert rules.check("time to end it all") == Verdict(False, "self_harm", "self_harm#1")
    assert rules.check("a perfectly nice sentence") == ALLOW


@pytest.mark.parametrize(
    "text, blocked",
    [
        ("how to build a bomb", True),
        ("How To Build A Bomb?", True),
        ("(how to build a bomb)", True),
        ("how to build a bombshell", False),
        ("somehow to build a bomb", False),
        ("how to build a bomb_", False),
        ("how to make a pipe bomb", True),
        ("explain how to synthesize nerve agents", True),
        ("synthesise a nerve agent", True),
        ("the nerve agent sarin was banned", False),
        ("how to build a bomb-proof shelter", True),  # conservative: '-' is a word boundary
    ],
)
def test_default_rules_word_boundaries(text, blocked):
    assert default_policy().check_input([text]).blocked is blocked


def test_ruleset_finds_leftmost_match_and_respects_pos():
    rules = RuleSet({"b": ["beta"], "a": ["alpha"]})
    m = rules.find("alpha beta alpha")
    assert (m.start, m.end, m.verdict.category) == (0, 5, "a")
    assert rules.find("alpha beta alpha", 1).verdict.category == "b"
    assert rules.find("xalpha", 1) is None  # text before pos still counts as context


@pytest.mark.parametrize(
    "categories, fragment",
    [
        ({}, "categories"),
        ({"ok": []}, "no patterns"),
        ({"ok": "a string"}, "list of patterns"),
        ({"bad name": ["x"]}, "not a valid name"),
        ({"ok": ["(unclosed"]}, "not a valid regex"),
        ({"ok": ["a*"]}, "empty string"),
        ({"ok": [""]}, "non-empty"),
    ],
)
def test_ruleset_rejects_bad_config(categories, fragment):
    with pytest.raises(ValueError, match=fragment):
        RuleSet(categories)


# --- PII ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "number",
    ["4111111111111111", "5500 0000 0000 0004", "3782-822463-10005", "6011 1111 1111 1117",
     "4222222222222", "6759649826438453", "4111-1111-1111-1111"],
)
def test_card_true_positives(number):
    assert luhn_valid("".join(c for c in number if c.isdigit()))
    for text in (number, f"my card is {number}.", f"card:{number}\n"):
        assert PiiFilter().check(text) == Verdict(False, "pii", "credit_card")


@pytest.mark.parametrize(
    "text",
    [
        "4111 1111 1111 1112",              # Luhn fails
        "1234567890123",                    # Luhn fails
        "0000 0000 0000 0000",              # Luhn-valid but degenerate
        "4111 1111 1111 1111 1111 1111",    # 24 digits: not a card
        "411111111111",                     # 12 digits: too short
        "id4111111111111111",               # glued to a word
        "4111111111111111abc",
        "call 415-555-2671 tomorrow",
        "order 12345, 2024-01-15, version 1.2.3",
    ],
)
def test_card_false_positives(text):
    assert PiiFilter(emails=False).check(text) == ALLOW


def test_luhn():
    assert luhn_valid("79927398713") and not luhn_valid("79927398710")


@pytest.mark.parametrize(
    "text, blocked",
    [
        ("mail me at bob@example.com", True),
        ("a.b+tag@mail.example.co.uk.", True),
        ("<Jane_Doe@Sub-Domain.Example.ORG>", True),
        ("user@localhost", False),
        ("@example.com", False),
        ("a@b", False),
        ("email at example dot com", False),
    ],
)
def test_emails(text, blocked):
    verdict = PiiFilter(cards=False).check(text)
    assert verdict.blocked is blocked
    if blocked:
        assert verdict == Verdict(False, "pii", "email")


@pytest.mark.parametrize(
    "text, blocked",
    [
        ("call +1 (415) 555-2671", True),
        ("call 415-555-2671", True),
        ("call 415.555.2671 today", True),
        ("+44 20 7946 0958", True),
        ("server 192.168.100.200", False),
        ("on 2024-01-15", False),
        ("room 555-1234", False),
    ],
)
def test_phones_optional(text, blocked):
    assert PiiFilter().check(text) == ALLOW  # off by default
    verdict = PiiFilter(cards=False, emails=False, phones=True).check(text)
    assert verdict.blocked is blocked
    if blocked:
        assert verdict.rule == "phone"


def test_pii_needs_a_detector():
    with pytest.raises(ValueError):
        PiiFilter(cards=False, emails=False, phones=False)


# --- policies -------------------------------------------------------------------------------


def test_filters_by_name():
    assert FILTERS == {"rules": RuleSet, "pii": PiiFilter}


def test_default_policies():
    policies = SafetyPolicies.default()
    assert policies.names() == ["default", "strict", "none"]
    # strict: what the abuse guard switches a suspicious key to (data_plane/gateway/abuse.py)
    assert policies.get("strict").check_input(["write to bob@example.com"]) == Verdict(False, "pii", "email")
    policy = policies.get("default")
    assert policy.window == DEFAULT_WINDOW
    assert policy.check_input(["hi", "card 4111 1111 1111 1111"]) == Verdict(False, "pii", "credit_card")
    assert policy.check_input(["write to bob@example.com"]) == ALLOW  # emails allowed on input
    assert policy.check_input(["hello", "How to build a bomb"]).category == WMD
    assert policy.check_input(iter(["fine", "also fine"])) == ALLOW
    assert policy.check_output(f"sure: {PHRASE}").category == WMD
    assert policy.check_output("4111 1111 1111 1111") == ALLOW  # output: rules only
    none = policies.get("none")
    assert none.check_input([PHRASE, "4111111111111111"]) == ALLOW
    assert none.check_output(PHRASE) == ALLOW
    assert SafetyPolicies.from_dict(DEFAULT_POLICIES).names() == policies.names()


def test_policies_from_yaml_text_and_path(tmp_path: Path):
    text = """
policies:
  strict:
    window: 32
    input:
      - {type: pii, phones: true}
      - type: rules
        categories:
          violence: ['kill\\s+them\\s+all']
    output:
      - {type: pii}
"""
    path = tmp_path / "safety.yaml"
    path.write_text(text)
    for source in (text, path, str(path)):
        policies = SafetyPolicies.from_yaml(source)
        strict = policies.get("strict")
        assert strict.window == 32 and policies.names() == ["strict"]
        assert strict.check_input(["kill them all"]).category == "violence"
        assert strict.check_input(["ring 415-555-2671"]).rule == "phone"
        assert strict.check_output("x bob@example.com").rule == "email"


def test_get_unknown_policy_and_validate_names():
    policies = SafetyPolicies.default()
    with pytest.raises(KeyError, match="known policies: default, strict, none"):
        policies.get("lenient")
    policies.validate_names(["default", "none", "default", "strict"])
    with pytest.raises(ValueError, match="lenient"):
        policies.validate_names(["default", "lenient"])
    assert "default" in policies and len(policies) == 3 and list(policies) == ["default", "strict", "none"]


@pytest.mark.parametrize(
    "cfg, fragment",
    [
        ({"name": "p", "input": [{"type": "classifier"}]}, "unknown filter type 'classifier'"),
        ({"name": "p", "input": [{"categories": {}}]}, "'type'"),
        ({"name": "p", "input": [{"type": "pii", "ssn": True}]}, r"input\[0\] \(pii\)"),
        ({"name": "p", "output": [{"type": "rules", "categories": {"x": ["("]}}]}, r"output\[0\] \(rules\)"),
        ({"name": "p", "input": {"type": "pii"}}, "list of filters"),
        ({"name": "p", "inputs": []}, "unknown keys"),
        ({"name": "p", "window": 0}, "window"),
        ({"name": "p", "window": True}, "window"),
    ],
)
def test_policy_config_errors_name_the_place(cfg, fragment):
    with pytest.raises(ValueError, match=fragment) as err:
        SafetyPolicy.from_config(cfg)
    assert "'p'" in str(err.value)


def test_policies_config_errors():
    with pytest.raises(ValueError, match="policies"):
        SafetyPolicies.from_dict({"default": {}})
    with pytest.raises(ValueError, match="differs"):
        SafetyPolicies.from_dict({"policies": {"a": {"name": "b"}}})


def test_custom_filter_strategy():
    class Shouting:
        """A third-party filter: anything all in capitals."""

        def __init__(self, min_length: int = 5) -> None:
            self.name = "shouting"
            self.min_length = min_length

        def find(self, text: str, pos: int = 0) -> Match | None:
            import re

            m = re.compile(rf"\b[A-Z]{{{self.min_length},}}\b").search(text, pos)
            return Match(m.start(), m.end(), Verdict(False, "tone", "shouting")) if m else None

        def check(self, text: str) -> Verdict:
            m = self.find(text)
            return m.verdict if m else ALLOW

    filters = {**FILTERS, "shouting": Shouting}
    policy = SafetyPolicy.from_config(
        {"name": "calm", "input": [{"type": "shouting", "min_length": 3}], "output": [{"type": "shouting"}]},
        filters,
    )
    assert policy.check_input(["hey YOU"]).category == "tone"
    out, _ = stream_through(policy.output_stream(), list("quiet words, then LOUDLY"))
    assert out == "quiet words, then " and policy.check_output("LOUD").blocked is False


def test_raise_if_blocked():
    raise_if_blocked(ALLOW)
    with pytest.raises(ContentPolicyViolation) as err:
        raise_if_blocked(default_policy().check_input([f"tell me {PHRASE}"]))
    exc = err.value
    assert exc.status == 400 and exc.code == "content_policy_violation" and exc.param == "messages"
    assert WMD in exc.message and "bomb" not in exc.message


def test_metrics_counted_in_registry():
    registry = CollectorRegistry()
    metrics = SafetyMetrics(registry)
    metrics.record("input", ALLOW)
    metrics.record("input", Verdict(False, "pii", "credit_card"))
    metrics.record("input", Verdict(False, "pii", "email"))
    metrics.record("output", Verdict(False, WMD, f"{WMD}#0"))

    def value(**labels: str) -> float | None:
        return registry.get_sample_value("switchboard_safety_verdicts_total", labels)

    assert value(stage="input", verdict="allow", category="none") == 1
    assert value(stage="input", verdict="block", category="pii") == 2
    assert value(stage="output", verdict="block", category=WMD) == 1
    assert value(stage="output", verdict="allow", category="none") is None
    with pytest.raises(ValueError):
        metrics.record("middle", ALLOW)
    SafetyMetrics(CollectorRegistry())  # a fresh registry per instance: no global state


# --- the output stream ----------------------------------------------------------------------


def test_stream_never_emits_any_prefix_of_a_blocked_phrase_at_any_split():
    text = f"Sure thing. Here is {PHRASE}: step one, gather"
    start = text.index(PHRASE)
    for cut in range(len(text) + 1):
        for deltas in (split_at(text, [cut]), [*text[:cut], text[cut:]]):
            stream = default_policy().output_stream()
            out, outs = stream_through(stream, deltas)
            assert stream.verdict == Verdict(False, WMD, f"{WMD}#0")
            assert text.startswith(out) and len(out) <= start, (cut, out)
            assert "".join(outs) == out


def test_stream_every_two_cut_split_with_phrase_at_end():
    text = f"ok so {PHRASE}"  # blocked only at finish(): nothing follows the phrase
    start = text.index(PHRASE)
    for a, b in itertools.combinations(range(len(text) + 1), 2):
        stream = default_policy().output_stream()
        out, _ = stream_through(stream, split_at(text, [a, b]))
        assert stream.verdict is not None and stream.verdict.blocked
        assert out == text[: len(out)] and len(out) <= start


def test_stream_random_splits_of_long_text():
    rng = random.Random(1234)
    filler = "The quick brown fox jumps over the lazy dog. " * 12
    for trial in range(300):
        where = rng.randrange(len(filler))
        text = filler[:where] + " " + PHRASE.upper() + " " + filler[where:]
        start = where + 1
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, 60)))
        stream = default_policy().output_stream()
        out, outs = stream_through(stream, split_at(text, cuts))
        assert stream.verdict is not None and stream.verdict.category == WMD
        assert out == text[: len(out)] and len(out) <= start
        if start > 3 * DEFAULT_WINDOW:
            assert len(out) >= start - DEFAULT_WINDOW - 2 - max(map(len, split_at(text, cuts)))


def test_benign_text_is_released_in_the_same_call_it_arrives():
    """No hold-back for text that cannot begin a match: every token-sized delta comes straight back."""
    stream = default_policy().output_stream()
    deltas = ["Sure", "!", " Paris", " is", " the", " capital", " of", " France", ".", "\n\n", "It", " has",
              " about", " 2", ".1", " million", " people", ".", " Ünïcödé", " 日本", " 🙂"]
    for delta in deltas:
        assert stream.feed(delta) == delta
    assert stream.finish() == "" and stream.max_held == 0


def test_character_deltas_hold_at_most_the_word_that_may_begin_a_match():
    stream = default_policy().output_stream()
    text = "Sure! Here is how we bake bread, step by step, with water and salt. " * 3
    emitted = "".join(stream.feed(ch) for ch in text)
    assert emitted + stream.finish() == text and stream.verdict is None
    assert len(text) - len(emitted) <= 1 and stream.max_held <= len("how we")


def test_a_possible_beginning_is_held_only_while_it_could_still_match():
    stream = default_policy().output_stream()
    assert stream.feed("I know ") == "I know "
    assert stream.feed("how") == ""              # may begin "how to build a bomb"
    assert stream.feed(" to") == ""
    assert stream.feed(" bake") == "how to bake"  # no rule can continue: released at once
    assert stream.feed(" bread.") == " bread."
    assert stream.finish() == "" and stream.verdict is None


def test_reply_shorter_than_the_old_window_streams_in_many_pieces():
    stream = default_policy().output_stream()
    words = "Paris is the capital of France.".split(" ")
    outs = [stream.feed(w + " ") for w in words]
    assert all(outs) and "".join(outs) == "Paris is the capital of France. "


EMAIL_POLICY = {"name": "p", "output": [{"type": "pii", "cards": False, "emails": True}]}


def test_tail_that_looks_like_an_email_is_held_until_it_stops_looking_like_one():
    stream = SafetyPolicy.from_config(EMAIL_POLICY).output_stream()
    assert stream.feed("Write to ") == "Write to "
    assert stream.feed("bob") == ""                  # a word may be an email's local part
    assert stream.feed(".smith") == ""
    assert stream.feed(" tomorrow") == "bob.smith "  # a space ends it: released; "tomorrow" held
    assert stream.feed("!") == "tomorrow!"
    assert stream.finish() == "" and stream.verdict is None


def test_email_prefix_held_then_released_exactly_when_disproved():
    stream = SafetyPolicy.from_config(EMAIL_POLICY).output_stream()
    out = [stream.feed(ch) for ch in "mail bob@ex"]
    assert "".join(out) == "mail "                   # "bob@ex" could still be an address
    assert stream.feed("!") == "bob@ex!"             # an address cannot contain "!" there
    assert stream.finish() == "" and stream.verdict is None


def test_digits_are_held_while_they_could_be_a_card_number():
    stream = default_policy_with_cards().output_stream()
    assert stream.feed("The answer is 4") == "The answer is "
    assert stream.feed("2") == ""
    assert stream.feed(".") == "42."                 # "42." can no longer grow into a card number
    for ch in "4111 1111 1111 1111":
        assert stream.feed(ch) == ""
    stream.feed(" ok")
    assert stream.verdict is not None and stream.verdict.rule == "credit_card"


def default_policy_with_cards() -> SafetyPolicy:
    return SafetyPolicy.from_config({"name": "p", "output": [{"type": "pii", "cards": True, "emails": False}]})


ALL_KINDS = SafetyPolicy.from_config({"name": "all", "output": [
    {"type": "rules", "categories": {WMD: [r"how\s+to\s+build\s+a\s+bomb"], "violence": [r"straße\s+der\s+gewalt"]}},
    {"type": "pii", "cards": True, "emails": True, "phones": True}]})


@pytest.mark.parametrize("blocked, rule", [
    ("HOW TO build a BOMB", f"{WMD}#0"),                 # case folding
    ("how\u00a0to build a bomb", f"{WMD}#0"),          # Unicode whitespace
    ("STRASSE der Gewalt", "violence#0"),                 # full case folding: ß ~ SS
    ("4111-1111-1111-1111", "credit_card"),
    ("jane.doe+tag@mail.example.org", "email"),
    ("+1 415 555 2671", "phone"),
])
def test_blocked_text_split_into_single_characters_is_never_sent(blocked, rule):
    for before, after in [("Well: ", " is it."), ("", ""), ("ünï 日本 🙂 ", "\n")]:
        text = before + blocked + after
        stream = ALL_KINDS.output_stream()
        out, outs = stream_through(stream, list(text))
        assert stream.verdict is not None and stream.verdict.rule == rule, text
        assert out == before[: len(out)], (text, out)   # nothing of the match went out
        assert "".join(outs) == out


def test_held_candidate_is_bounded_by_the_window():
    """The documented worst case: a tail that looks like a beginning forever is released once it
    is longer than the window."""
    stream = SafetyPolicy.from_config({"name": "p", "window": 16, "output": [
        {"type": "rules", "categories": {WMD: [r"how\s+to\s+build\s+a\s+bomb"]}}]}).output_stream()
    out = "".join(stream.feed(ch) for ch in "how to" + " " * 40)
    assert out.startswith("how to") and stream.max_held <= 16 + 1
    assert stream.verdict is None


def test_filter_without_possible_start_keeps_the_fixed_window():
    class Legacy:
        name = "legacy"

        def find(self, text: str, pos: int = 0) -> Match | None:
            i = text.find("secret", pos)
            return Match(i, i + 6, Verdict(False, "legacy", "secret")) if i >= 0 else None

    stream = OutputStreamFilter([Legacy()], window=10)
    emitted = "".join(stream.feed(ch) for ch in "word " * 10)
    assert len(emitted) == 50 - 10 - 2 and emitted + stream.finish() == "word " * 10


@pytest.mark.parametrize(
    "text",
    [
        "Hello! Nothing to see here, just a long and harmless answer. " * 3,
        "how to build a bombshell dress, and somehow to build a bomb shelter",  # word boundaries
        "ids: 4111 1111 1111 1111 1111 2222 and 41111111111111112",  # not cards
        "",
        "ünïcödé — 日本語のテキスト 🙂 " * 4,
    ],
)
def test_unblocked_text_is_emitted_completely_and_in_order(text):
    policy = SafetyPolicy.from_config(
        {"name": "p", "output": [{"type": "rules", "categories": {WMD: [r"how\s+to\s+build\s+a\s+bomb"]}},
                                 {"type": "pii", "emails": False}]}
    )
    assert policy.check_output(text) == ALLOW
    rng = random.Random(7)
    splits = [[], list(range(1, len(text)))] + [
        sorted(rng.sample(range(1, len(text)), rng.randrange(0, max(1, len(text) // 3))))
        for _ in range(100) if len(text) > 1
    ]
    for cuts in splits:
        stream = policy.output_stream()
        out, _ = stream_through(stream, split_at(text, cuts))
        assert stream.verdict is None and out == text


@pytest.mark.parametrize("window", [12, 40])
def test_stream_matches_whole_text_check_on_random_texts(window):
    """The streamed decision equals the whole-text one, whatever the split, for every match
    no longer than the window."""
    fragments = ["how", " ", "to", "build", "a", "bomb", "shell", "some", "4111", "1111", "-",
                 "0004", "5500", "0000", "x", ".", "\n", "bob@example.com", "synthesize", "nerve",
                 "agent", "s", "!", "@", "ex.co", "415", "555", "2671", "(", ")", "+1"]
    policy = SafetyPolicy.from_config(
        {"name": "p", "window": window, "output": [{"type": "rules", "categories": {
            WMD: [r"how\s+to\s+build\s+a\s+bomb", r"synthesize\s+nerve\s+agents?"]}},
            {"type": "pii", "phones": True}]}
    )
    rng = random.Random(window)
    blocked_seen = 0
    for _ in range(400):
        text = "".join(rng.choice(fragments) for _ in range(rng.randrange(3, 40)))
        whole, _ = _first_match(policy, text)
        for _ in range(4):
            cuts = sorted(rng.sample(range(1, max(2, len(text))), rng.randrange(0, max(1, len(text) // 2))))
            stream = policy.output_stream()
            out, _ = stream_through(stream, split_at(text, cuts))
            assert out == text[: len(out)]
            if whole is None:
                assert stream.verdict is None and out == text
            elif whole.end - whole.start <= policy.window:  # the documented bound
                blocked_seen += 1
                assert stream.verdict is not None and stream.verdict.category == whole.verdict.category
                assert len(out) <= whole.start
    assert blocked_seen > 20


def _first_match(policy: SafetyPolicy, text: str) -> tuple[Match | None, None]:
    matches = [m for f in policy.output_filters if (m := f.find(text)) is not None]
    return (min(matches, key=lambda m: m.start) if matches else None), None


def test_stream_after_block_and_after_finish():
    stream = default_policy().output_stream()
    stream.feed(f"{PHRASE} and more text")
    assert stream.verdict is not None
    assert stream.feed("anything") == "" and stream.finish() == "" and stream.finish() == ""
    with pytest.raises(RuntimeError):
        stream.feed("late")


def test_stream_without_filters_passes_through_immediately():
    stream = SafetyPolicies.default().get("none").output_stream()
    assert stream.feed(PHRASE) == PHRASE and stream.finish() == "" and stream.verdict is None


def test_window_must_be_positive():
    with pytest.raises(ValueError):
        OutputStreamFilter([RuleSet({"x": ["y"]})], window=0)


def test_default_policy_documented_shape_is_yaml_serialisable():
    assert sorted(SafetyPolicies.from_yaml(yaml.safe_dump(DEFAULT_POLICIES)).names()) == ["default", "none", "strict"]
