"""Input and output safety filters: a pipeline of pluggable filters per named policy.

Built by the gateway (data_plane/gateway/app.py) from ``--safety-file`` (or the built-in policies);
the chat handler checks input with it, the stream (data_plane/gateway/safety/stream.py) filters output.

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
        window: 64                 # the longest a possible match is held back (>= longest phrase)
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
patterns are regular expressions (the ``regex`` package), matched with full Unicode case
folding as whole words.

The output stream (:mod:`data_plane.gateway.safety.stream`) holds back only what could still become a
match (partial matching), so benign text streams at once; a match no longer than ``window`` is
never partly sent, and a possible match is held at most ``window`` characters. The filters
themselves live in :mod:`data_plane.gateway.safety.filters`; this module re-exports them. ``check_input``
and ``check_output`` see whole texts and have no length limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from data_plane.common.errors import ContentPolicyViolation
from data_plane.common.yaml_source import load_yaml
from data_plane.gateway.safety.filters import (
    ALLOW,
    FILTERS,
    Filter,
    Match,
    PiiFilter,
    PrefixAware,
    RuleSet,
    Verdict,
    luhn_valid,
)
from data_plane.gateway.safety.stream import DEFAULT_WINDOW, RIGHT_CONTEXT, OutputStreamFilter, first_block

__all__ = [
    "ALLOW", "DEFAULT_POLICIES", "DEFAULT_RULES", "DEFAULT_WINDOW", "FILTERS", "RIGHT_CONTEXT", "Filter",
    "Match", "OutputStreamFilter", "PiiFilter", "PrefixAware", "RuleSet", "SafetyMetrics", "SafetyPolicies",
    "SafetyPolicy", "Verdict", "luhn_valid", "raise_if_blocked",
]

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
        "strict": {  # what the abuse guard switches a suspicious key to (data_plane/gateway/abuse.py)
            "window": DEFAULT_WINDOW,
            "input": [
                {"type": "pii", "cards": True, "emails": True, "phones": True},
                {"type": "rules", "categories": DEFAULT_RULES},
            ],
            "output": [{"type": "pii", "cards": True, "emails": True, "phones": True},
                       {"type": "rules", "categories": DEFAULT_RULES}],
        },
        "none": {},
    }
}
"""What :meth:`SafetyPolicies.default` builds, in the YAML file's shape."""


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
        match, _ = first_block(self.output_filters, text, len(text))
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

    def show(self, policies: SafetyPolicies) -> None:
        """The series a calm system may never see at 0 from the start, so a panel reads 0, not "No data": each
        stage's allowed verdicts and the blocks of every category the policies' filters name."""
        for stage in self.STAGES:
            self.verdicts.labels(stage, "allow", "none")
        for policy in map(policies.get, policies.names()):
            for stage, filters in (("input", policy.input_filters), ("output", policy.output_filters)):
                for category in {c for f in filters for c in f.categories()}:
                    self.verdicts.labels(stage, "block", category)

    def record(self, stage: str, verdict: Verdict) -> None:
        if stage not in self.STAGES:
            raise ValueError(f"stage must be one of {self.STAGES}, got {stage!r}")
        self.verdicts.labels(
            stage=stage,
            verdict="allow" if verdict.allowed else "block",
            category=verdict.category or "none",
        ).inc()
