"""Speculative-decoding metrics under vLLM's names (its spec-decode dashboard panels work as-is).

    spec = SpecMetrics(registry, model_name="SmolLM2-135M-Instruct")   # ShardMetrics builds one
    spec.observe_draft(drafted=4, accepted=2)      # one sequence's draft in one engine step
    spec.observe_iteration(tokens=19)              # tokens one engine step computed

Acceptance rate = rate(vllm:spec_decode_num_accepted_tokens_total) /
rate(vllm:spec_decode_num_draft_tokens_total); mean accepted length = 1 + accepted / drafts;
`..._per_pos_total{position="j"}` counts drafts whose token j (0-based) was accepted.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

ITERATION_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class SpecMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        m = ["model_name"]
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Speculative drafts proposed (one per sequence "
                              "and step that drafted).", m, registry=registry)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", m,
                                    registry=registry)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens the model accepted.",
                                       m, registry=registry)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Drafts whose token at `position` (0-based) was accepted.",
                                        m + ["position"], registry=registry)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens computed per engine step "
                                          "(prefill tokens, decode rows, draft rows).", m,
                                          buckets=ITERATION_TOKEN_BUCKETS, registry=registry)
        self.cost_probes = Counter("switchboard_spec_decode_cost_probes", "Decode steps run to re-measure "
                                   "the verify row cost (kind: plain = nobody drafted, verify = drafted at "
                                   "the prior's price).", m + ["kind"], registry=registry)
        for kind in ("plain", "verify"):
            self.cost_probes.labels(model_name, kind)
        for metric in (self.drafts, self.draft_tokens, self.accepted_tokens):
            metric.labels(model_name)
        self.accepted_per_pos.labels(model_name, "0")

    def observe_draft(self, drafted: int, accepted: int) -> None:
        m = self.model_name
        self.drafts.labels(m).inc()
        self.draft_tokens.labels(m).inc(drafted)
        self.accepted_tokens.labels(m).inc(accepted)
        for pos in range(accepted):
            self.accepted_per_pos.labels(m, str(pos)).inc()

    def observe_iteration(self, tokens: int) -> None:
        self.iteration_tokens.labels(self.model_name).observe(tokens)
