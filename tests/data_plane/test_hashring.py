"""Consistent hashing: even spread, minimal movement, bounded loads, stable across processes."""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys

import pytest

from data_plane.membership.hashring import HashRing, stable_hash

NODES = [f"node-{i}" for i in range(10)]
KEYS = [f"session-{i}" for i in range(20_000)]


def owners(ring: HashRing) -> dict[str, str]:
    return {k: ring.preference_list(k, 1)[0] for k in KEYS}


def test_distribution_is_roughly_even() -> None:
    counts = collections.Counter(owners(HashRing(NODES)).values())
    mean = len(KEYS) / len(NODES)
    assert set(counts) == set(NODES)
    assert max(counts.values()) < 1.3 * mean, counts
    assert min(counts.values()) > 0.7 * mean, counts


def test_adding_a_node_moves_only_its_share_and_only_to_it() -> None:
    before = owners(HashRing(NODES))
    after = owners(HashRing([*NODES, "node-new"]))
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "node-new" for k in moved)
    assert 0.5 / 11 < len(moved) / len(KEYS) < 1.6 / 11


def test_removing_a_node_moves_only_its_keys() -> None:
    before = owners(HashRing(NODES))
    after = owners(HashRing([n for n in NODES if n != "node-3"]))
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == "node-3"}


def test_preference_list_is_distinct_ring_order_and_stable_under_removal() -> None:
    ring = HashRing(NODES)
    for key in KEYS[:200]:
        prefs = ring.preference_list(key, 3)
        assert len(prefs) == len(set(prefs)) == 3
        assert prefs[0] == ring.preference_list(key, 1)[0]
        assert prefs == list(ring.walk(key))[:3]
        # Removing the owner promotes the next replica: the survivors keep their order.
        shrunk = HashRing([n for n in NODES if n != prefs[0]])
        assert shrunk.preference_list(key, 2) == prefs[1:]
    assert sorted(ring.preference_list("k", 99)) == sorted(NODES)
    assert ring.preference_list("k", 0) == []
    assert HashRing([]).preference_list("k", 2) == []
    assert len(HashRing(["a", "a", "b"])) == 2


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.25, 1.0])
def test_bounded_load_invariant_holds(epsilon: float) -> None:
    ring = HashRing(NODES[:5])
    loads: dict[str, int] = collections.Counter()
    # A skewed key stream: most requests share a few keys, as hot sessions do.
    stream = [f"hot-{i % 3}" if i % 4 else f"cold-{i}" for i in range(2_000)]
    for key in stream:
        node = ring.bounded_load_choice(key, loads, epsilon)
        loads[node] += 1
        total = sum(loads.values())
        # Every node stays within the cap computed over the requests placed so far.
        assert max(loads.values()) <= math.ceil((1 + epsilon) * total / 5 - 1e-9)


def test_bounded_load_keeps_affinity_while_under_cap_and_spills_in_ring_order() -> None:
    ring = HashRing(NODES[:4])
    key = "session-affine"
    walk = list(ring.walk(key))
    assert ring.bounded_load_choice(key, {}, 0.25) == walk[0]
    loads = {walk[0]: 10, walk[1]: 0, walk[2]: 0, walk[3]: 0}  # cap = ceil(1.25 * 11 / 4) = 4
    assert ring.bounded_load_choice(key, loads, 0.25) == walk[1]
    loads[walk[1]] = 5  # total 15: cap = ceil(1.25 * 16 / 4) = 5, and 5 + 1 > 5
    assert ring.bounded_load_choice(key, loads, 0.25) == walk[2]
    with pytest.raises(LookupError):
        HashRing([]).bounded_load_choice(key, {}, 0.25)
    with pytest.raises(ValueError):
        ring.bounded_load_choice(key, {}, -0.1)


def test_hash_is_stable_across_processes() -> None:
    code = (
        "from data_plane.membership.hashring import HashRing, stable_hash;"
        "print(stable_hash('session-1'), HashRing(['a','b','c']).preference_list('session-1', 3))"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=root,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    here = f"{stable_hash('session-1')} {HashRing(['a', 'b', 'c']).preference_list('session-1', 3)}\n"
    assert outs == {here}
