"""Structured-output metrics of a shard: constrained requests by kind, grammar compiles and resumes, mask time.

    metrics = StructuredMetrics(CollectorRegistry(), model_name="SmolLM2-135M-Instruct")
    metrics.requests.labels(model_name=m, kind="json_schema").inc()

vLLM exports no grammar metrics of its own, so these are `switchboard_shard_*`; labels are bounded
(kind: engines.grammar.GrammarKind, outcome: compiled, cache_hit or a GrammarError reason).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from data_plane.shard.engines.grammar import GrammarKind

COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MASK_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
OUTCOMES = ("compiled", "cache_hit", "unsupported", "invalid", "too_large", "timeout", "busy")
RESUME_OUTCOMES = ("resumed", "rejected")


class StructuredMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        m = ["model_name"]
        self.model_name = model_name
        self.requests = Counter("switchboard_shard_structured_requests",
                                "Requests whose output follows a grammar, by kind (json_object, json_schema, "
                                "regex, choice, grammar, tools).", m + ["kind"], registry=registry)
        self.compile_seconds = Histogram("switchboard_shard_grammar_compile_seconds",
                                         "Grammar compile time (off the scheduler thread), cache misses only.",
                                         m + ["kind"], buckets=COMPILE_BUCKETS, registry=registry)
        self.compiles = Counter("switchboard_shard_grammar_compiles",
                                "Grammar compile requests by outcome: compiled, cache_hit, refused "
                                "(unsupported, invalid, too_large, timeout), or busy (a 503: too many compiling).", m + ["kind", "outcome"],
                                registry=registry)
        self.mask_seconds = Histogram("switchboard_shard_grammar_mask_seconds",
                                      "Per engine step: filling and applying the constrained rows' token masks.",
                                      m, buckets=MASK_BUCKETS, registry=registry)
        self.resumes = Counter("switchboard_shard_grammar_resumes",
                               "Constrained streams resumed here after another shard failed mid-stream: resumed "
                               "(the grammar advanced over the output already sent) or rejected (it did not "
                               "follow the grammar: a 400).", m + ["kind", "outcome"], registry=registry)
        self.mask_seconds.labels(model_name)
        for kind in GrammarKind:
            self.requests.labels(model_name, kind.value)
            for outcome in OUTCOMES:
                self.compiles.labels(model_name, kind.value, outcome)
            for outcome in RESUME_OUTCOMES:
                self.resumes.labels(model_name, kind.value, outcome)

    def on_compile(self, kind: str, seconds: float, outcome: str) -> None:
        self.compiles.labels(self.model_name, kind, outcome).inc()
        if outcome == "compiled":
            self.compile_seconds.labels(self.model_name, kind).observe(seconds)

    def on_resume(self, kind: str, outcome: str) -> None:
        self.resumes.labels(self.model_name, kind, outcome).inc()

    def on_mask(self, seconds: float) -> None:
        self.mask_seconds.labels(self.model_name).observe(seconds)
