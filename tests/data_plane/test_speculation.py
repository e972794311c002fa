"""N-gram drafting, adaptive draft length and the acceptance rules (data_plane/shard/engines/speculation.py),
on synthetic inputs: the rejection sampler's output law is checked exactly against sampling the
target distributions one step at a time."""

from __future__ import annotations

import logging
import math
from collections import Counter

import pytest
import torch

from data_plane.shard.engines.base import SamplingParams
from data_plane.shard.engines.speculation import (
    CostProbe,
    NgramIndex,
    SeqSpec,
    SharedEvidence,
    VerifyCost,
    accept_greedy,
    accept_sampled,
)


def test_ngram_matches_the_longest_tail_at_its_latest_occurrence() -> None:
    index = NgramIndex(min_n=2, max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # tail (1,2,3) matched at 0..2 (max_n first): 4 5 9 followed
    assert index.match(tokens) == (3, 3) and tokens[3:6] == [4, 5, 9]
    tokens += [7]  # tail (2,3,7) occurred at 6..8: 8 1 2 followed
    assert index.match(tokens) == (3, 9) and tokens[9:12] == [8, 1, 2]
    tokens += [6]  # (3,7,6), (7,6) never seen
    assert index.match(tokens) is None


def test_ngram_short_continuation_and_no_self_match() -> None:
    index = NgramIndex(min_n=2, max_n=2)
    assert index.match([5, 6]) is None  # the tail itself is no match
    assert index.match([5, 6, 5, 6]) == (2, 2)  # only two tokens (5, 6) followed the earlier (5,6)


def test_seq_spec_drafts_as_many_tokens_as_pay() -> None:
    s = SeqSpec(max_k=8)
    assert s.draft_len(0.0, 4) == 8  # rows free: the most
    assert s.draft_len(0.02, 4) == 5  # no evidence (a = 0.5): 0.5^5 > 0.02 > 0.5^6
    s.record(5, 5, 4)  # a = 6/7: even the 8th token pays
    assert s.accept_rate(4) == pytest.approx(6 / 7)
    assert s.draft_len(0.02, 4) == 8
    assert s.draft_len(0.3, 4) == 7  # dearer rows (a bigger batch): a shorter draft
    s.record(8, 0, 4)  # a rejection at once: a = (0.9 * 5 + 1) / (0.9 * 5 + 1 + 2)
    assert s.accept_rate(4) == pytest.approx(5.5 / 7.5)
    assert s.draft_len(0.1, 4) == int(math.log(0.1) / math.log(5.5 / 7.5)) == 7
    assert (s.drafts, s.draft_tokens, s.accepted_tokens) == (2, 13, 5)


def test_evidence_is_kept_per_match_length() -> None:
    """A long copy (4-gram matches, all accepted) says nothing about 2-gram coincidences, and their
    misses do not shorten the copy's drafts (one rate for both drafted 15 tokens on every 2-gram match
    right after a copy: tests/data_plane/test_spec_replay.py)."""
    s = SeqSpec(max_k=15)
    for _ in range(4):
        s.record(15, 15, 4)
    assert s.draft_len(0.2, 4) == 15
    assert s.accept_rate(2) == 0.5 and s.draft_len(0.2, 2) == 2  # 0.5^2 > 0.2 > 0.5^3
    for _ in range(3):
        s.record(2, 0, 2)
    assert s.draft_len(0.2, 2) <= 1 and s.draft_len(0.2, 4) == 15
    assert s.accept_rate(9) == s.accept_rate(4)  # matches longer than the table count as the longest


def test_new_sequences_start_from_the_engines_evidence() -> None:
    shared = SharedEvidence(4, weight=16.0)
    first = SeqSpec(max_k=15, evidence=shared.prior(), shared=shared)
    assert first.draft_len(0.2, 4) == 2  # nothing known yet: a = 0.5
    for _ in range(6):
        first.record(15, 15, 4)
        first.record(1, 0, 1)
    second = SeqSpec(max_k=15, evidence=shared.prior(), shared=shared)
    assert second.draft_len(0.2, 4) >= 8  # copies from its first match, as the last request did
    assert second.accept_rate(1) == 0.5  # one-token matches take no prior (they never back off to retry)
    acc, rej = second.evidence[3]
    assert acc + rej == pytest.approx(16.0)  # worth at most `weight` observations: its own soon outweigh it
    lengths = []
    for _ in range(4):  # this text does not copy: its own misses shorten the drafts at once
        second.record(15, 0, 4)
        lengths.append(second.draft_len(0.2, 4))
    assert lengths == sorted(lengths, reverse=True) and lengths[-1] <= 4


def test_seq_spec_backs_off_after_misses_then_probes_one_token() -> None:
    s = SeqSpec(max_k=8, miss_limit=3)
    for _ in range(3):
        s.record(s.draft_len(0.02, 2) or 1, 0, 2)  # nothing ever accepted
    assert [s.draft_len(0.02, 2) for _ in range(8)] == [0] * 8  # off for the back-off
    assert s.draft_len(0.02, 2) == 1  # then one token, to see whether the text copies again
    s.record(1, 1, 2)
    assert s.draft_len(0.02, 2) >= 1 and s.misses == 0  # it did: drafting goes on
    for _ in range(3):
        s.record(1, 0, 2)
    assert sum(1 for _ in range(40) if s.draft_len(0.02, 2) == 0) == 16  # the back-off doubled


def test_seq_spec_backs_off_when_not_even_one_token_pays() -> None:
    s = SeqSpec(max_k=8)
    s.record(4, 0, 3)
    s.record(4, 0, 3)  # a = 1 / (1.9 + 2) = 0.26 < row cost 0.3: expected to lose
    assert s.draft_len(0.3, 3) == 0
    assert s.cooldown == 8 and s.probe


def test_weak_matches_keep_their_own_evidence_and_never_stop_strong_drafts() -> None:
    s = SeqSpec(max_k=8)
    for _ in range(10):
        s.record(s.draft_len(0.3, 1) or 1, 0, 1)  # one-token matches never accepted
    assert s.accept_rate(1) < 0.3 and s.draft_len(0.3, 1) == 0  # they stop by themselves
    assert s.cooldown == 0 and s.misses == 0  # and cost the strong drafts nothing
    assert s.accept_rate(2) == 0.5 and s.draft_len(0.3, 2) == 1
    s.record(1, 1, 2)
    assert s.accept_rate(2) == pytest.approx(2 / 3) and s.accept_rate(1) < 0.3


def test_forced_drafts_keep_no_evidence() -> None:
    s = SeqSpec(max_k=8)
    s.record(6, 6, 0)  # a grammar-forced draft (n = 0): counted, but it says nothing about n-gram drafts
    assert (s.drafts, s.accepted_tokens) == (1, 6) and all(ev == [0.0, 0.0] for ev in s.evidence)


def test_ngram_match_says_how_long_the_match_is() -> None:
    index = NgramIndex(min_n=1, max_n=3)
    tokens = [1, 2, 3, 4, 9, 3]
    assert index.match(tokens) == (1, 3)  # only (3,) occurred before: it ended at 2, so 4 followed
    tokens += [4]
    assert index.match(tokens) == (2, 4)  # (3, 4) ended at 3: 9 followed
    assert index.match([7]) is None


def test_verify_cost_learns_the_row_price_per_batch_size() -> None:
    c = VerifyCost(prior=0.02)
    assert c.row_cost(1) == pytest.approx(0.02)  # unseen: the prior, x batch
    assert c.row_cost(4) == pytest.approx(0.08)
    c.verify(1, 9, 0.030)  # no plain step at batch 1 yet: nothing to price the rows against
    assert c.row_cost(1) == pytest.approx(0.02)
    c.plain(1, 0.026)
    c.verify(1, 9, 0.030)  # 8 extra rows cost 4 ms against a 26 ms token
    assert c.row_cost(1) == pytest.approx(0.004 / 8 / 0.026)
    c.plain(4, 0.032)
    c.verify(4, 12, 0.036)  # at batch 4 a token is 8 ms of the step: each row costs 4/8 ms of it
    assert c.row_cost(4) == pytest.approx(0.0005 * 4 / 0.032)
    c.verify(1, 9, 0.020)  # faster than a plain step (noise): the rows cost nothing, clamped
    assert c.row_cost(1) == pytest.approx(0.9 * 0.004 / 8 / 0.026)
    assert VerifyCost().row_cost(64) == 1.0  # never above one token's share


def test_one_slow_verify_pass_does_not_stop_drafting() -> None:
    """A single slow pass (under load: a 1.46 s step among 7 ms ones) once priced rows at a whole
    step (row cost 1.0): no draft paid, and nothing re-measured them until the next VERIFY probe."""
    c = VerifyCost(prior=0.02)
    c.plain(1, 0.007)
    for _ in range(5):
        c.verify(1, 9, 0.007 + 8 * 0.0014)  # a row: 1.4 ms, a fifth of a step
    assert c.row_cost(1) == pytest.approx(0.2)
    c.verify(1, 9, 1.46)
    assert c.row_cost(1) < 0.3  # one sample counts at most clip x the average
    assert SeqSpec(max_k=15, evidence=[[0.0, 0.0]] * 3 + [[9.0, 1.0]]).draft_len(c.row_cost(1), 4) >= 5
    for _ in range(30):  # rows that really got dearer (3 ms) still get there
        c.verify(1, 9, 0.007 + 8 * 0.003)
    assert c.row_cost(1) == pytest.approx(3 / 7, rel=0.05)


def test_accept_greedy() -> None:
    assert accept_greedy([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert accept_greedy([4, 5, 6], [4, 5, 6, 1]) == [4, 5, 6, 1]
    assert accept_greedy([4], [3, 8]) == [3]
    assert accept_greedy([], [7]) == [7]


VOCAB = 5
DRAFT = [1, 3, 0]
PROBS = torch.tensor([[0.1, 0.5, 0.2, 0.15, 0.05],
                      [0.3, 0.1, 0.1, 0.4, 0.1],
                      [0.05, 0.05, 0.6, 0.2, 0.1],
                      [0.2, 0.2, 0.2, 0.2, 0.2]])


def exact_law() -> dict[tuple[int, ...], float]:
    """The law of accept_sampled's output when it is right: sampling row j while the output so
    far equals the draft, stopping at the first token off the draft (or after the bonus)."""
    law: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], mass: float) -> None:
        j = len(prefix)
        for x in range(VOCAB):
            m = mass * float(PROBS[j, x])
            if j < len(DRAFT) and x == DRAFT[j]:
                walk(prefix + (x,), m)
            else:
                law[prefix + (x,)] = m

    walk((), 1.0)
    return law


def chi_square(counts: Counter, law: dict[tuple[int, ...], float], n: int) -> tuple[float, int]:
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in law.items())
    assert set(counts) <= set(law), set(counts) - set(law)
    return stat, len(law) - 1


def critical(df: int) -> float:
    """Chi-square 0.999 quantile (Wilson-Hilferty)."""
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_rejection_sampler_has_the_target_law() -> None:
    gen = torch.Generator().manual_seed(1234)
    n = 40_000
    counts = Counter(tuple(accept_sampled(DRAFT, lambda j: int(torch.multinomial(PROBS[j], 1, generator=gen))))
                     for _ in range(n))
    law = exact_law()
    assert math.isclose(sum(law.values()), 1.0, rel_tol=1e-6)
    stat, df = chi_square(counts, law, n)
    assert stat < critical(df), (stat, df)
    # The test has teeth: a sampler that accepts whenever the draft is the argmax is caught.
    wrong: Counter[tuple[int, ...]] = Counter()
    for _ in range(n):
        out: list[int] = []
        for j, x in enumerate(DRAFT):
            if int(PROBS[j].argmax()) == x:
                out.append(x)
                continue
            out.append(int(torch.multinomial(PROBS[j], 1, generator=gen)))
            break
        else:
            out.append(int(torch.multinomial(PROBS[len(DRAFT)], 1, generator=gen)))
        wrong[tuple(out)] += 1
    bad = sum((wrong.get(k, 0) - n * p) ** 2 / (n * p) for k, p in law.items() if p > 0)
    assert bad > 10 * critical(df)


def test_rejection_sampler_point_mass_draft_is_always_accepted() -> None:
    probs = torch.zeros(3, VOCAB)
    probs[0, 2] = probs[1, 4] = 1.0
    probs[2, 1] = 1.0
    gen = torch.Generator().manual_seed(0)
    assert all(accept_sampled([2, 4], lambda j: int(torch.multinomial(probs[j], 1, generator=gen))) == [2, 4, 1]
               for _ in range(50))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(top_k=2),
                                    SamplingParams(top_p=0.6), SamplingParams(temperature=1.3, top_k=3, top_p=0.9)])
def test_the_sampler_keeps_to_the_top_k_and_top_p_support(params: SamplingParams) -> None:
    """sample_row (the one sampler plain steps and verify rows share) never leaves the support its
    params allow: the k most likely tokens, the smallest prefix of the sorted distribution reaching top_p."""
    from data_plane.shard.engines.torch_sampling import sample_row

    logits = torch.randn(2, 11, generator=torch.Generator().manual_seed(7))
    for row in range(2):
        probs = torch.softmax(logits[row] / params.temperature, -1)
        order = probs.argsort(descending=True).tolist()
        keep = len(order)
        if params.top_k:
            keep = min(keep, params.top_k)
        if params.top_p < 1.0:
            cum = probs[order].cumsum(0)
            keep = min(keep, int((cum < params.top_p).sum()) + 1)
        support = set(order[:keep])
        gen = torch.Generator().manual_seed(3)
        seen = {sample_row(logits[row], params, gen) for _ in range(300)}
        assert seen <= support
        assert len(seen) > 1 or keep == 1


def test_verify_cost_probes_the_kind_it_stops_seeing() -> None:
    c = VerifyCost(prior=0.02, probe_every=4)
    c.plain(1, 0.020)
    assert c.probe(1) is CostProbe.NONE
    for _ in range(4):
        c.verify(1, 9, 0.024)  # speculating: only verify steps at batch 1 from here
    assert c.probe(1) is CostProbe.PLAIN  # the baseline is 4 verify steps old
    c.plain(1, 0.020)
    assert c.probe(1) is CostProbe.NONE
    for _ in range(4):
        c.plain(1, 0.020)  # nobody drafts any more: rows unseen for 4 steps
    assert c.probe(1) is CostProbe.VERIFY
    c.verify(1, 9, 0.024)
    assert c.probe(1) is CostProbe.NONE
    assert c.probe(2) is CostProbe.NONE  # never seen at batch 2: nothing to re-measure


def test_verify_cost_follows_a_drift_fast() -> None:
    c = VerifyCost(prior=0.02, probe_every=64, alpha=0.1)
    for _ in range(20):
        c.plain(1, 0.020)
        c.verify(1, 9, 0.024)  # rows: 0.5 ms, 2.5 % of a 20 ms step
    assert c.row_cost(1) == pytest.approx(0.025, rel=1e-6)
    c.plain(1, 0.060)  # the host got busy: the step tripled
    assert c.drifts == 1
    # rows were priced against a 20 ms step: re-probe them at once, then every 8 steps
    assert c.probe(1) is CostProbe.VERIFY
    for _ in range(8):
        c.verify(1, 9, 0.072)  # rows now 1.5 ms of a 60 ms step
    assert c.probe(1) is CostProbe.PLAIN
    c.plain(1, 0.060)
    assert c.drifts == 1 and c.probe(1) is CostProbe.NONE  # it agrees: back to every 64 steps
    assert c.row_cost(1) == pytest.approx(0.0015 / 0.060, rel=0.05)
    for _ in range(10):
        c.plain(1, 0.060)
        c.verify(1, 9, 0.072)
    assert c.row_cost(1) == pytest.approx(0.0015 / 0.060, rel=0.05)


def test_a_noisy_host_drifts_without_a_log_line_a_step(caplog: pytest.LogCaptureFixture) -> None:
    """Every plain step 1.5x or 1/1.5x the last is a drift each time (counted), but the shard's log
    gets one line for it, not one a step."""
    cost = VerifyCost()
    with caplog.at_level(logging.INFO, logger="data_plane.shard.engines.speculation"):
        for i in range(40):
            cost.plain(1, 0.010 if i % 2 else 0.015)
    assert cost.drifts == 39
    assert len([r for r in caplog.records if r.levelno >= logging.INFO]) == 1
