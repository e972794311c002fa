"""The policy store: tier policy and ladder state persisted atomically in a state dir.

    .venv/bin/python -m pytest tests/control_plane/test_policy_store.py -q
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from control_plane.ladder import Actor, LevelChange
from control_plane.policy_store import (
    DEGRADATION_FILE,
    TIERS_FILE,
    DegradationRecord,
    PolicyStore,
    open_store,
    write_json_atomic,
)
from data_plane.common.ladder import Level
from data_plane.tiers import TierPolicy


def smaller_policy() -> TierPolicy:
    data = TierPolicy.default().to_dict()
    data["tiers"]["plus"]["max_output_tokens"] = 8
    return TierPolicy.from_dict(data)


def test_in_memory_store_starts_from_the_default() -> None:
    store = PolicyStore(None)
    assert store.tiers == TierPolicy.default() and store.tiers_source == "default"
    assert store.degradation.level == 0 and not store.degradation.pinned
    store.set_tiers(smaller_policy())
    assert store.tiers["plus"].max_output_tokens == 8 and store.tiers_source == "admin"


def test_tiers_and_degradation_survive_a_restart(tmp_path: Path) -> None:
    store = PolicyStore(tmp_path)
    changes: list[str] = []
    store.subscribe(lambda: changes.append("x"))
    store.set_tiers(smaller_policy())
    change = LevelChange(at=123.0, from_level=Level.NORMAL, to=Level.SHED_FREE_TIER, reason="pinned: drill",
                         actor=Actor.OPERATOR, pinned=True)
    record = DegradationRecord(level=Level.SHED_FREE_TIER, reason="pinned: drill", pinned=True, since=123.0,
                               history=(change,))
    store.save_degradation(record)
    assert changes == ["x", "x"]
    on_disk = json.loads((tmp_path / TIERS_FILE).read_text())
    assert on_disk["tiers"]["plus"]["max_output_tokens"] == 8 and on_disk["updated_by"] == "admin"

    again = PolicyStore(tmp_path)
    assert again.tiers == smaller_policy() and again.tiers_source == "state"
    assert again.degradation == record
    assert again.degradation.history == record.history
    assert again.degradation.history[0].to_dict() == {"at": 123.0, "from": 0, "to": 3, "reason": "pinned: drill",
                                                      "signals": {}, "actor": "operator", "pinned": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEGRADATION_FILE, TIERS_FILE]  # no temp files left


def test_state_dir_wins_over_the_tiers_file(tmp_path: Path) -> None:
    tiers_yaml = tmp_path / "tiers.yaml"
    tiers_yaml.write_text("tiers:\n  solo: {priority: 0, rpm: 1, tpm: 10, max_context_tokens: 64,"
                          " max_output_tokens: 8, replication: 1, shed_order: 0}\n")
    settings = SimpleNamespace(state_dir=tmp_path / "state", tiers_file=tiers_yaml)
    first = open_store(settings)
    assert first.tiers.names() == ["solo"] and first.tiers_source == "file"
    first.set_tiers(TierPolicy.default())
    assert open_store(settings).tiers == TierPolicy.default()


def test_a_corrupt_file_is_set_aside_not_fatal(tmp_path: Path) -> None:
    (tmp_path / TIERS_FILE).write_text("{not json")
    (tmp_path / DEGRADATION_FILE).write_text(json.dumps({"level": 9}))
    store = PolicyStore(tmp_path)
    assert store.tiers == TierPolicy.default() and store.degradation.level == 0
    assert (tmp_path / (TIERS_FILE + ".corrupt")).exists()
    assert (tmp_path / (DEGRADATION_FILE + ".corrupt")).exists()
    # a policy that no longer validates is refused the same way
    write_json_atomic(tmp_path / TIERS_FILE, {"tiers": {"free": {"priority": -1}}})
    assert PolicyStore(tmp_path).tiers == TierPolicy.default()


def test_atomic_write_replaces_whole_files(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "x.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"b": 2})
    assert json.loads(target.read_text()) == {"b": 2}
    assert [p.name for p in target.parent.iterdir()] == ["x.json"]
