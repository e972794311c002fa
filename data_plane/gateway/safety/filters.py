"""Safety filters: what a blocked text looks like, and where a blocked text could still begin.

    rules = RuleSet({"violence": [r"kill\\s+them\\s+all"]})
    rules.check("please kill them all")            # Verdict(allowed=False, category='violence', ...)
    rules.find("x kill them all", 0)               # Match(start=2, end=15, verdict=...)
    rules.possible_start("well, kill th", 0)       # 6: the tail may still become a match

Two questions make a filter. ``find`` answers "which complete match blocks here?" for whole
texts (inputs, non-streamed replies) and for the output stream. ``possible_start`` answers
"could the end of this text be the beginning of a match?": the output stream
(:mod:`data_plane.gateway.safety.stream`) holds back exactly that tail and releases everything before
it, so benign text streams at once and a blocked phrase is still never half-sent. Both use the
``regex`` package, whose ``partial=True`` reports a match cut short by the end of the text.

Rule patterns are regular expressions matched with full Unicode case folding (``ß`` matches
``SS``) as whole words. PII detectors find card numbers (Luhn-checked), emails and phone
numbers; a partial card or phone number cannot be checked yet, so it is held until it is
complete or stops looking like one. A filter written elsewhere only needs ``find``; without
``possible_start`` the stream holds a fixed window for it instead (see the stream's docs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import regex

RIGHT_CONTEXT = 2
"""Characters that must follow a complete match before it counts (word boundaries, digit runs):
until then it may still grow (``4111 1111 1111 1`` into a card number), so it is "possible"."""
_LABEL = regex.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_RULE_FLAGS = regex.IGNORECASE | regex.FULLCASE | regex.V0


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    category: str | None = None
    """Why it was blocked (a bounded, configured name such as ``pii``); None when allowed."""
    rule: str | None = None
    """Which rule blocked (``credit_card``, ``weapons_of_mass_destruction#0``); never the text."""

    @property
    def blocked(self) -> bool:
        return not self.allowed


ALLOW = Verdict(True)


@dataclass(frozen=True)
class Match:
    """Where a filter blocked: ``text[start:end]`` matched (the span stays internal)."""

    start: int
    end: int
    verdict: Verdict


class Filter(Protocol):
    """One check on text. ``find`` is what the output stream uses to hold back a match."""

    name: str

    def find(self, text: str, pos: int = 0) -> Match | None:
        """The blocking match that starts leftmost at or after ``pos`` (text before pos is context)."""
        ...

    def check(self, text: str) -> Verdict:
        """Allow, or the verdict of the first blocking match."""
        match = self.find(text)
        return match.verdict if match is not None else ALLOW

    def categories(self) -> list[str]:
        """The categories its blocks can name, for their metric series at 0 from the start; a filter whose
        categories are not known in advance names none."""
        return []


@runtime_checkable
class PrefixAware(Protocol):
    """A filter that can tell where a match may still begin. Called by the output stream on every
    delta, over at most a few hundred characters: it must be cheap."""

    def possible_start(self, text: str, pos: int) -> int | None:
        """The leftmost index >= ``pos`` at which ``text`` ends inside an unfinished match (more
        text could complete it), or None. Complete matches are ``find``'s business, not this."""
        ...


def _leftmost_partial(patterns: Iterable[regex.Pattern[str]], text: str, pos: int) -> int | None:
    """The leftmost start >= pos of a match of any pattern that the end of the text cut short
    (partial), or that ends so near the end that more text could still extend it."""
    n = len(text)
    best: int | None = None
    for pattern in patterns:
        at = pos
        while at < n and (best is None or at < best):
            m = pattern.search(text, at, partial=True)
            if m is None or m.start() >= n:
                break
            if m.partial or m.end() > n - RIGHT_CONTEXT:
                if best is None or m.start() < best:
                    best = m.start()
                break
            at = m.start() + 1  # a complete match (find's business): look for a partial after it
    return best


class RuleSet(Filter):
    """Categories of regular expressions, matched case-insensitively as whole words.

        RuleSet({"violence": [r"kill\\s+them\\s+all"], "self_harm": [...]})
    """

    def __init__(self, categories: Mapping[str, Iterable[str]], name: str = "rules") -> None:
        if not isinstance(categories, Mapping) or not categories:
            raise ValueError("a rules filter needs 'categories': a mapping of category to patterns")
        self.name = name
        self._rules: list[tuple[regex.Pattern[str], Verdict]] = []
        for category, patterns in categories.items():
            if not isinstance(category, str) or not _LABEL.match(category):
                raise ValueError(f"category {category!r} is not a valid name (letters, digits, _ . -)")
            if isinstance(patterns, str) or not isinstance(patterns, Iterable):
                raise ValueError(f"category {category!r}: expected a list of patterns")
            compiled = [_compile_rule(category, i, p) for i, p in enumerate(patterns)]
            if not compiled:
                raise ValueError(f"category {category!r} has no patterns")
            self._rules += [(c, Verdict(False, category, f"{category}#{i}")) for i, c in enumerate(compiled)]
        self._patterns = [p for p, _ in self._rules]

    def find(self, text: str, pos: int = 0) -> Match | None:
        best: Match | None = None
        for pattern, verdict in self._rules:
            m = pattern.search(text, pos)
            if m is not None and (best is None or m.start() < best.start):
                best = Match(m.start(), m.end(), verdict)
        return best

    def possible_start(self, text: str, pos: int) -> int | None:
        return _leftmost_partial(self._patterns, text, pos)

    def categories(self) -> list[str]:
        return list(dict.fromkeys(v.category or "" for _, v in self._rules))


def _compile_rule(category: str, index: int, pattern: Any) -> regex.Pattern[str]:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"category {category!r} pattern {index}: expected a non-empty string")
    try:
        compiled = regex.compile(rf"(?<!\w)(?:{pattern})(?!\w)", _RULE_FLAGS)
    except regex.error as exc:
        raise ValueError(f"category {category!r} pattern {index} is not a valid regex: {exc}") from None
    if compiled.search("") is not None:
        raise ValueError(f"category {category!r} pattern {index} matches the empty string")
    return compiled


# Maximal runs only: a run of 20+ digits, or one glued to a word, is not a card number.
_CARD = regex.compile(r"(?<!\w)(?<!\d[ -])\d(?:[ -]?\d){12,18}(?![ -]?\d)(?!\w)")
_EMAIL = regex.compile(
    r"(?<![\w.%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,24}(?![\w-])"
)
_PHONE = regex.compile(
    r"(?<![\w+])(?<!\d[ .-])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)|\d{2,4})(?:[ .-]?\d{2,4}){2,3}"
    r"(?![ .-]?\d)(?!\w)"
)
_IPV4 = regex.compile(r"^\d{1,3}(?:\.\d{1,3}){3}$")
_NON_DIGIT = regex.compile(r"\D")


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum every payment card number satisfies."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _is_card(candidate: str) -> bool:
    digits = _NON_DIGIT.sub("", candidate)
    return 13 <= len(digits) <= 19 and len(set(digits)) > 1 and luhn_valid(digits)


def _is_phone(candidate: str) -> bool:
    digits = _NON_DIGIT.sub("", candidate)
    return 10 <= len(digits) <= 15 and not _IPV4.match(candidate)


class PiiFilter(Filter):
    """Personal data, category ``pii``: card numbers (Luhn-checked), emails, phone numbers.

        PiiFilter(cards=True, emails=True, phones=False)
    """

    def __init__(
        self, cards: bool = True, emails: bool = True, phones: bool = False, name: str = "pii"
    ) -> None:
        self.name = name
        detectors: list[tuple[regex.Pattern[str], Callable[[str], bool] | None, Verdict]] = []
        if cards:
            detectors.append((_CARD, _is_card, Verdict(False, "pii", "credit_card")))
        if emails:
            detectors.append((_EMAIL, None, Verdict(False, "pii", "email")))
        if phones:
            detectors.append((_PHONE, _is_phone, Verdict(False, "pii", "phone")))
        if not detectors:
            raise ValueError("a pii filter needs at least one of cards, emails, phones")
        self._detectors = detectors
        self._patterns = [p for p, _, _ in detectors]

    def categories(self) -> list[str]:
        return ["pii"]

    def find(self, text: str, pos: int = 0) -> Match | None:
        best: Match | None = None
        for pattern, valid, verdict in self._detectors:
            for m in pattern.finditer(text, pos):
                if best is not None and m.start() >= best.start:
                    break
                if valid is None or valid(m.group()):
                    best = Match(m.start(), m.end(), verdict)
                    break
        return best

    def possible_start(self, text: str, pos: int) -> int | None:
        # An unfinished number cannot be Luhn-checked yet: any digit run at the end is held.
        return _leftmost_partial(self._patterns, text, pos)


FILTERS: dict[str, type[Filter]] = {"rules": RuleSet, "pii": PiiFilter}
"""Filter strategies by the ``type`` that names them in a policy."""
