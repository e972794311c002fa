from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from data_plane.tiers import Tier, TierPolicy

FULL = {
    "priority": 2, "rpm": 60, "tpm": 20000, "max_context_tokens": 2048,
    "max_output_tokens": 256, "replication": 1, "shed_order": 0,
}


def test_default_tiers_ordering_and_numbers():
    policy = TierPolicy.default()
    assert policy.names() == ["free", "plus", "enterprise"]
    free, plus, ent = (policy.get(n) for n in policy.names())
    assert (ent.priority, plus.priority, free.priority) == (0, 1, 2)
    assert (free.rpm, free.tpm, free.max_context_tokens, free.max_output_tokens) == (60, 20000, 2048, 256)
    assert (plus.rpm, plus.tpm, plus.max_output_tokens) == (600, 200000, 1024)
    assert (ent.rpm, ent.tpm, ent.max_output_tokens) == (6000, 2000000, 2048)
    assert (free.replication, plus.replication, ent.replication) == (1, 2, 2)
    assert min(policy.names(), key=lambda n: policy.get(n).shed_order) == "free"
    assert all(policy.get(n).safety == "default" for n in policy)


def test_tier_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TierPolicy.default().get("free").rpm = 1  # type: ignore[misc]


def test_get_unknown_names_known_tiers():
    with pytest.raises(KeyError) as err:
        TierPolicy.default().get("gold")
    assert "gold" in str(err.value) and "free, plus, enterprise" in str(err.value)
    assert "plus" in TierPolicy.default() and "gold" not in TierPolicy.default()
    assert TierPolicy.default()["plus"].priority == 1


def test_dict_and_yaml_round_trip(tmp_path: Path):
    policy = TierPolicy.default()
    assert TierPolicy.from_dict(policy.to_dict()) == policy
    text = yaml.safe_dump(policy.to_dict())
    assert TierPolicy.from_yaml(text) == policy
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    assert TierPolicy.from_yaml(path) == policy
    assert TierPolicy.from_yaml(str(path)) == policy


def test_custom_policy_from_yaml_keeps_order_and_safety():
    policy = TierPolicy.from_yaml(
        "tiers:\n"
        f"  gold: {dict(FULL, priority=0, safety='strict')}\n"
        f"  bronze: {FULL}\n"
    )
    assert policy.names() == ["gold", "bronze"]
    assert policy.get("gold") == Tier("gold", **dict(FULL, priority=0), safety="strict")
    assert policy.get("bronze").safety == "default"
    assert len(policy) == 2


@pytest.mark.parametrize(
    "tier, field",
    [
        (dict(FULL, rpm=0), "rpm"),
        (dict(FULL, tpm=-5), "tpm"),
        (dict(FULL, max_context_tokens=0), "max_context_tokens"),
        (dict(FULL, max_output_tokens="many"), "max_output_tokens"),
        (dict(FULL, replication=0), "replication"),
        (dict(FULL, replication=6), "replication"),
        (dict(FULL, priority=-1), "priority"),
        (dict(FULL, rpm=True), "rpm"),
        (dict(FULL, rpm=1.5), "rpm"),
        ({k: v for k, v in FULL.items() if k != "tpm"}, "tpm"),
        (dict(FULL, burst=3), "burst"),
        # past what a browser or the console's int64 editor holds: stored, it broke the tier editor
        (dict(FULL, rpm=10**30), "rpm"),
        (dict(FULL, tpm=2**53), "tpm"),
    ],
)
def test_invalid_field_named_with_tier(tier, field):
    with pytest.raises(ValueError) as err:
        TierPolicy.from_dict({"tiers": {"free": tier}})
    assert f"tiers.free.{field}" in str(err.value)


def test_invalid_documents():
    with pytest.raises(ValueError, match="tiers"):
        TierPolicy.from_dict({"tiers": {}})
    with pytest.raises(ValueError, match="tiers"):
        TierPolicy.from_dict({"free": FULL})
    with pytest.raises(ValueError, match="mapping"):
        TierPolicy.from_yaml("- just\n- a list\n")
    with pytest.raises(ValueError, match="not valid"):
        TierPolicy.from_dict({"tiers": {"bad name": FULL}})
    with pytest.raises(ValueError, match="not valid") as long_name:  # the admin API's 400 quoted it whole
        TierPolicy.from_dict({"tiers": {"n" * 100_000: FULL}})
    assert len(str(long_name.value)) < 200
    with pytest.raises(FileNotFoundError):
        TierPolicy.from_yaml("/nonexistent/tiers.yaml")


def test_constructor_validates_and_rejects_duplicates():
    free = TierPolicy.default().get("free")
    with pytest.raises(ValueError, match="twice"):
        TierPolicy([free, free])
    with pytest.raises(ValueError, match="tiers.free.replication"):
        TierPolicy([dataclasses.replace(free, replication=9)])
    with pytest.raises(ValueError):
        TierPolicy([])
