"""N-gram drafting, adaptive draft length and the acceptance rules (data_plane/shard/engines/speculation.py),
on synthetic inputs: the rejection sampler's output law is checked exactly against sampling the
target distributions one step at a time."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from data_plane.shard.engines.base import SamplingParams
from data_plane.shard.engines.speculation import NgramIndex, SeqSpec, accept_greedy, accept_sampled, target_probs


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    index = NgramIndex(min_n=2, max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # tail (1,2,3) matched at 0..2 (max_n first) -> 4 5 9
    assert index.propose(tokens, 3) == [4, 5, 9]
    tokens += [7]  # tail (2,3,7) occurred at 6..8 -> 8 1 2
    assert index.propose(tokens, 3) == [8, 1, 2]
    tokens += [6]  # (3,7,6), (7,6) never seen
    assert index.propose(tokens, 3) == []
    assert index.propose(tokens, 0) == []


def test_ngram_short_continuation_and_no_self_match() -> None:
    index = NgramIndex(min_n=2, max_n=2)
    assert index.propose([5, 6], 4) == []  # the tail itself is no match
    assert index.propose([5, 6, 5, 6], 4) == [5, 6]  # only two tokens followed the earlier (5,6)


def test_seq_spec_adapts_and_backs_off() -> None:
    s = SeqSpec(max_k=4, miss_limit=2)
    assert s.draft_len() == 4
    s.record(4, 1)
    assert s.draft_len() == 2  # cut to accepted + 1
    s.record(2, 2)
    assert s.draft_len() == 3  # full acceptance grows it
    s.record(3, 0)
    s.record(1, 0)  # second miss in a row: off for the back-off
    assert [s.draft_len() for _ in range(16)] == [0] * 16
    assert s.draft_len() == 1
    s.record(1, 0)
    s.record(1, 0)
    assert sum(1 for _ in range(40) if s.draft_len() == 0) == 32  # the back-off doubled
    assert (s.drafts, s.draft_tokens, s.accepted_tokens) == (6, 12, 3)


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
    counts = Counter(tuple(accept_sampled(DRAFT, PROBS, gen)) for _ in range(n))
    law = exact_law()
    assert math.isclose(sum(law.values()), 1.0, rel_tol=1e-6)
    stat, df = chi_square(counts, law, n)
    assert stat < critical(df), (stat, df)
    # The test has teeth: a sampler that accepts whenever the draft is the argmax is caught.
    wrong = Counter()
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
    assert all(accept_sampled([2, 4], probs, gen) == [2, 4, 1] for _ in range(50))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(top_k=2),
                                    SamplingParams(top_p=0.6), SamplingParams(temperature=1.3, top_k=3, top_p=0.9)])
def test_target_probs_matches_the_engine_sampler(params: SamplingParams) -> None:
    from data_plane.shard.engines.torch_engine import _sample_row

    logits = torch.randn(2, 11, generator=torch.Generator().manual_seed(7))
    probs = target_probs(logits, params)
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    for row in range(2):
        support = {i for i in range(11) if probs[row, i] > 0}
        gen = torch.Generator().manual_seed(3)
        seen = {_sample_row(logits[row], params, gen) for _ in range(300)}
        assert seen <= support
        if params.top_k:
            assert len(support) <= params.top_k
