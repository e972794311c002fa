"""Input and output safety filters: a pipeline of pluggable filters per named policy.

    policies = SafetyPolicies.default()                  # or SafetyPolicies.from_yaml(path)
    policy = policies.get(tier.safety)
    raise_if_blocked(policy.check_input(m.text() for m in req.messages))   # 400, before any byte

    stream = policy.output_stream()
    for delta in deltas:
        send(stream.feed(delta))                         # what is safe to emit now
        if stream.verdict is not None:                   # blocked: end with "content_filter"
            break
    else:
        send(stream.finish())                            # checked, held-back tail

A verdict names the category and rule that blocked, never the matched text, so it is safe
to log, count and return to the caller.

Operators configure policies in YAML (it replaces the defaults; tiers name a policy in their
``safety`` field)::

    policies:
      default:
        window: 64                 # output hold-back, >= the longest phrase a rule can match
        input:
          - {type: pii, cards: true, emails: false, phones: false}
          - type: rules
            categories:
              weapons_of_mass_destruction: ['how\\s+to\\s+build\\s+an?\\s+bomb']
        output:
          - type: rules
            categories: {weapons_of_mass_destruction: ['synthesi[sz]e\\s+nerve\\s+agents?']}
      none: {}                     # no filtering

Filter types come from :data:`FILTERS` (``rules``: :class:`RuleSet`, ``pii``:
:class:`PiiFilter`); every other key of a filter entry is passed to its constructor. Rule
patterns are Python regular expressions, matched case-insensitively as whole words.

The output stream holds back the last ``window`` + 2 characters (more while a longer
candidate is still open), so a match no longer than ``window`` is never partly sent; when
a filter blocks, at most the text before the match is released. A match counts once two
characters follow it (so ``bomb`` is not taken for ``bombshell``), or at
:meth:`OutputStreamFilter.finish`. A match longer than ``window`` may be partly sent or,
in a stream, missed: keep phrases short. ``check_input`` and ``check_output`` see whole
texts and have no such limit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from data_plane.errors import ContentPolicyViolation
from data_plane.yaml_source import load_yaml

DEFAULT_WINDOW = 64
"""Characters of output held back by default: a bound on the longest blockable match."""
_RIGHT_CONTEXT = 2
"""Characters that must follow a match before it counts (word boundaries, digit runs)."""
_LABEL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")

DEFAULT_RULES: dict[str, list[str]] = {
    "weapons_of_mass_destruction": [
        r"how\s+to\s+(?:build|make)\s+an?\s+(?:pipe\s+|nuclear\s+|dirty\s+)?bomb",
        r"synthesi[sz]e\s+(?:an?\s+|the\s+)?nerve\s+agents?",
        r"weaponi[sz]e\s+(?:anthrax|smallpox|botulinum)",
    ],
}
"""Deliberately conservative: explicit phrases only. Operators extend this per policy."""

DEFAULT_POLICIES: dict[str, Any] = {
    "policies": {
        "default": {
            "window": DEFAULT_WINDOW,
            "input": [
                {"type": "pii", "cards": True, "emails": False, "phones": False},
                {"type": "rules", "categories": DEFAULT_RULES},
            ],
            "output": [{"type": "rules", "categories": DEFAULT_RULES}],
        },
        "none": {},
    }
}
"""What :meth:`SafetyPolicies.default` builds, in the YAML file's shape."""


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


class RuleSet(Filter):
    """Categories of regular expressions, matched case-insensitively as whole words.

        RuleSet({"violence": [r"kill\\s+them\\s+all"], "self_harm": [...]})
    """

    def __init__(self, categories: Mapping[str, Iterable[str]], name: str = "rules") -> None:
        if not isinstance(categories, Mapping) or not categories:
            raise ValueError("a rules filter needs 'categories': a mapping of category to patterns")
        self.name = name
        self._rules: list[tuple[re.Pattern[str], Verdict]] = []
        for category, patterns in categories.items():
            if not isinstance(category, str) or not _LABEL.match(category):
                raise ValueError(f"category {category!r} is not a valid name (letters, digits, _ . -)")
            if isinstance(patterns, str) or not isinstance(patterns, Iterable):
                raise ValueError(f"category {category!r}: expected a list of patterns")
            compiled = [_compile_rule(category, i, p) for i, p in enumerate(patterns)]
            if not compiled:
                raise ValueError(f"category {category!r} has no patterns")
            self._rules += [(c, Verdict(False, category, f"{category}#{i}")) for i, c in enumerate(compiled)]

    def find(self, text: str, pos: int = 0) -> Match | None:
        best: Match | None = None
        for pattern, verdict in self._rules:
            m = pattern.search(text, pos)
            if m is not None and (best is None or m.start() < best.start):
                best = Match(m.start(), m.end(), verdict)
        return best

    def categories(self) -> list[str]:
        return list(dict.fromkeys(v.category or "" for _, v in self._rules))


def _compile_rule(category: str, index: int, pattern: Any) -> re.Pattern[str]:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"category {category!r} pattern {index}: expected a non-empty string")
    try:
        compiled = re.compile(rf"(?<!\w)(?:{pattern})(?!\w)", re.IGNORECASE)
    except re.error as exc:
        raise ValueError(f"category {category!r} pattern {index} is not a valid regex: {exc}") from None
    if compiled.search("") is not None:
        raise ValueError(f"category {category!r} pattern {index} matches the empty string")
    return compiled


# Maximal runs only: a run of 20+ digits, or one glued to a word, is not a card number.
_CARD = re.compile(r"(?<!\w)(?<!\d[ -])\d(?:[ -]?\d){12,18}(?![ -]?\d)(?!\w)")
_EMAIL = re.compile(
    r"(?<![\w.%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,24}(?![\w-])"
)
_PHONE = re.compile(
    r"(?<![\w+])(?<!\d[ .-])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)|\d{2,4})(?:[ .-]?\d{2,4}){2,3}"
    r"(?![ .-]?\d)(?!\w)"
)
_IPV4 = re.compile(r"^\d{1,3}(?:\.\d{1,3}){3}$")


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
    digits = re.sub(r"\D", "", candidate)
    return 13 <= len(digits) <= 19 and len(set(digits)) > 1 and luhn_valid(digits)


def _is_phone(candidate: str) -> bool:
    digits = re.sub(r"\D", "", candidate)
    return 10 <= len(digits) <= 15 and not _IPV4.match(candidate)


class PiiFilter(Filter):
    """Personal data, category ``pii``: card numbers (Luhn-checked), emails, phone numbers.

        PiiFilter(cards=True, emails=True, phones=False)
    """

    def __init__(
        self, cards: bool = True, emails: bool = True, phones: bool = False, name: str = "pii"
    ) -> None:
        self.name = name
        detectors: list[tuple[re.Pattern[str], Any, Verdict]] = []
        if cards:
            detectors.append((_CARD, _is_card, Verdict(False, "pii", "credit_card")))
        if emails:
            detectors.append((_EMAIL, None, Verdict(False, "pii", "email")))
        if phones:
            detectors.append((_PHONE, _is_phone, Verdict(False, "pii", "phone")))
        if not detectors:
            raise ValueError("a pii filter needs at least one of cards, emails, phones")
        self._detectors = detectors

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


FILTERS: dict[str, type[Filter]] = {"rules": RuleSet, "pii": PiiFilter}
"""Filter strategies by the ``type`` that names them in a policy."""


def _first_block(
    filters: Sequence[Filter], text: str, decided_end: int, start: int = 0
) -> tuple[Match | None, int]:
    """The leftmost match at or after ``start`` over all filters that ends by ``decided_end``,
    and the start of the leftmost undecided match before it (``len(text)`` if none): text
    before both is safe to release."""
    best: Match | None = None
    undecided = len(text)
    for f in filters:
        pos = start
        while (m := f.find(text, pos)) is not None:
            if m.end <= decided_end:
                if best is None or m.start < best.start:
                    best = m
                break
            undecided = min(undecided, m.start)
            pos = m.start + 1  # an undecided match near the end: look for a decided one after it
    return best, undecided


class OutputStreamFilter:
    """Filters a stream of output deltas, holding back enough text to never half-send a match.

        stream = policy.output_stream()
        safe = stream.feed(delta)   # may be "" while text is held back
        tail = stream.finish()      # once the upstream stream ends (unless already blocked)

    After a block, :attr:`verdict` is set, the held text is dropped and ``feed``/``finish``
    return "". Every character :meth:`feed` returns stays emitted, so the stream only grows.
    """

    def __init__(self, filters: Sequence[Filter], window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._filters = tuple(filters)
        self._window = window
        self._hold = window + _RIGHT_CONTEXT
        # The tail of released text. Matches are looked for from its last `window` characters
        # on, so each candidate sees `window` characters of true left context (lookbehinds,
        # word boundaries) instead of an artificial start of text.
        self._context = ""
        self._pending = ""
        self._finished = False
        self.verdict: Verdict | None = None

    def feed(self, delta: str) -> str:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self.verdict is not None or not delta:
            return ""
        if not self._filters:
            return delta  # nothing to hold back for
        self._pending += delta
        return self._advance(final=False)

    def finish(self) -> str:
        if self._finished:
            return ""
        self._finished = True
        if self.verdict is not None:
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        off = len(self._context)
        region = self._context + self._pending
        n = len(region)
        cut = n if final else n - self._hold
        if self._filters:
            decided_end = n if final else n - _RIGHT_CONTEXT
            search_from = max(0, off - self._window)
            block, undecided = _first_block(self._filters, region, decided_end, search_from)
            if block is not None:
                self.verdict = block.verdict
                self._pending = ""
                # Text before the match may still start a longer match that has not ended yet,
                # so the usual hold-back applies. A match that began in released text (longer
                # than the window) releases nothing.
                return region[off : max(off, min(cut, block.start, undecided))]
            cut = min(cut, undecided)  # a candidate that may still block stays held, whatever its length
        cut = max(off, cut)
        out = region[off:cut]
        self._pending = region[cut:]
        self._context = (self._context + out)[-2 * self._window :]
        return out


class SafetyPolicy:
    """A named pipeline of input filters and output filters.

        policy = SafetyPolicy.from_config({"name": "strict", "input": [{"type": "pii"}]})
    """

    def __init__(
        self,
        name: str,
        input_filters: Sequence[Filter] = (),
        output_filters: Sequence[Filter] = (),
        window: int = DEFAULT_WINDOW,
    ) -> None:
        if window < 1:
            raise ValueError(f"safety policy {name!r}: window must be >= 1")
        self.name = name
        self.input_filters = tuple(input_filters)
        self.output_filters = tuple(output_filters)
        self.window = window

    @classmethod
    def from_config(
        cls, cfg: Mapping[str, Any], filters: Mapping[str, type[Filter]] = FILTERS
    ) -> SafetyPolicy:
        """``{"name", "input": [{"type": ..., **params}], "output": [...], "window": 64}``."""
        if not isinstance(cfg, Mapping):
            raise ValueError(f"safety policy: expected a mapping, got {type(cfg).__name__}")
        name = cfg.get("name", "unnamed")
        where = f"safety policy {name!r}"
        unknown = set(cfg) - {"name", "input", "output", "window"}
        if unknown:
            raise ValueError(
                f"{where}: unknown keys {sorted(unknown)} (allowed: name, input, output, window)"
            )
        window = cfg.get("window", DEFAULT_WINDOW)
        if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= 4096:
            raise ValueError(f"{where}: window must be an integer in 1..4096")
        stages = {stage: _build_filters(cfg.get(stage) or [], f"{where} {stage}", filters)
                  for stage in ("input", "output")}
        return cls(str(name), stages["input"], stages["output"], window)

    def check_input(self, texts: Iterable[str]) -> Verdict:
        """The first block over every text (each checked on its own), else ALLOW."""
        if not self.input_filters:
            return ALLOW
        for text in texts:
            for f in self.input_filters:
                verdict = f.check(text)
                if verdict.blocked:
                    return verdict
        return ALLOW

    def check_output(self, text: str) -> Verdict:
        """For a whole (non-streamed) completion."""
        match, _ = _first_block(self.output_filters, text, len(text))
        return match.verdict if match is not None else ALLOW

    def output_stream(self) -> OutputStreamFilter:
        return OutputStreamFilter(self.output_filters, self.window)

    def __repr__(self) -> str:
        return (f"SafetyPolicy({self.name!r}, input={[f.name for f in self.input_filters]}, "
                f"output={[f.name for f in self.output_filters]})")


def _build_filters(specs: Any, where: str, filters: Mapping[str, type[Filter]]) -> list[Filter]:
    if not isinstance(specs, list):
        raise ValueError(f"{where}: expected a list of filters")
    built = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping) or "type" not in spec:
            raise ValueError(f"{where}[{i}]: expected a mapping with 'type'")
        params = dict(spec)
        kind = params.pop("type")
        cls = filters.get(kind)
        if cls is None:
            raise ValueError(f"{where}[{i}]: unknown filter type {kind!r}; known: {sorted(filters)}")
        try:
            built.append(cls(**params))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}[{i}] ({kind}): {exc}") from None
    return built


class SafetyPolicies:
    """An immutable mapping of policy name to :class:`SafetyPolicy`."""

    def __init__(self, policies: Iterable[SafetyPolicy]) -> None:
        by_name: dict[str, SafetyPolicy] = {}
        for policy in policies:
            if policy.name in by_name:
                raise ValueError(f"safety policy {policy.name!r} is defined twice")
            by_name[policy.name] = policy
        self._policies = by_name

    @classmethod
    def default(cls) -> SafetyPolicies:
        """``default`` (card numbers and explicit WMD phrases in; the phrases out) and ``none``."""
        return cls.from_dict(DEFAULT_POLICIES)

    @classmethod
    def from_dict(cls, data: Any, filters: Mapping[str, type[Filter]] = FILTERS) -> SafetyPolicies:
        """Build from ``{"policies": {name: {"input": [...], "output": [...], "window": n}}}``."""
        if not isinstance(data, Mapping) or set(data) != {"policies"} or not isinstance(
            data["policies"], Mapping
        ):
            raise ValueError("safety policies: expected a mapping with only 'policies': {name: policy}")
        policies = []
        for name, cfg in data["policies"].items():
            if cfg is not None and not isinstance(cfg, Mapping):
                raise ValueError(f"safety policy {name!r}: expected a mapping")
            cfg = dict(cfg or {})
            if cfg.setdefault("name", name) != name:
                raise ValueError(f"safety policy {name!r}: 'name' {cfg['name']!r} differs from its key")
            policies.append(SafetyPolicy.from_config(cfg, filters))
        return cls(policies)

    @classmethod
    def from_yaml(
        cls, text_or_path: str | Path, filters: Mapping[str, type[Filter]] = FILTERS
    ) -> SafetyPolicies:
        """Read a YAML file (a Path, or a str naming one) or YAML text; it replaces the defaults."""
        return cls.from_dict(load_yaml(text_or_path), filters)

    def get(self, name: str) -> SafetyPolicy:
        try:
            return self._policies[name]
        except KeyError:
            raise KeyError(
                f"unknown safety policy {name!r}; known policies: {', '.join(self._policies)}"
            ) from None

    def names(self) -> list[str]:
        return list(self._policies)

    def validate_names(self, names: Iterable[str]) -> None:
        """Raise ValueError if any name (e.g. each tier's ``safety``) is not a policy here."""
        missing = sorted(set(names) - set(self._policies))
        if missing:
            raise ValueError(f"unknown safety policies {missing}; known policies: {self.names()}")

    def __getitem__(self, name: str) -> SafetyPolicy:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._policies

    def __iter__(self) -> Iterator[str]:
        return iter(self._policies)

    def __len__(self) -> int:
        return len(self._policies)


def raise_if_blocked(verdict: Verdict, param: str | None = "messages") -> None:
    """Raise ContentPolicyViolation (400) naming the category, never the matched text."""
    if verdict.blocked:
        category = verdict.category or "unspecified"
        raise ContentPolicyViolation(
            f"the request was rejected by the content policy (category: {category})", param=param
        )


class SafetyMetrics:
    """``switchboard_safety_verdicts_total{stage, verdict, category}``.

        metrics = SafetyMetrics(registry)
        metrics.record("input", verdict)
    """

    STAGES = ("input", "output")

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.verdicts = Counter(
            "switchboard_safety_verdicts",
            "Safety filter verdicts by stage (input|output), verdict (allow|block) and category.",
            ["stage", "verdict", "category"],
            registry=registry,
        )

    def record(self, stage: str, verdict: Verdict) -> None:
        if stage not in self.STAGES:
            raise ValueError(f"stage must be one of {self.STAGES}, got {stage!r}")
        self.verdicts.labels(
            stage=stage,
            verdict="allow" if verdict.allowed else "block",
            category=verdict.category or "none",
        ).inc()
