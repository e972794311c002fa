"""Operator state that must survive a control-plane restart: the tier policy and the ladder.

    store = PolicyStore(Path("/var/lib/switchboard"), initial=TierPolicy.default())
    store.tiers                                  # the policy in force (TierPolicy)
    store.set_tiers(TierPolicy.from_dict(body))  # validated by the caller; written atomically
    store.degradation                            # DegradationRecord(level, reason, pinned, since, history)
    store.save_degradation(record)               # after every ladder change

    PolicyStore(None)                            # in memory only (nothing survives a restart)

Files in the state dir (JSON, each replaced atomically: write a temp file, fsync, rename)::

    tiers.json         {"version": 1, "updated_at": 1700000000.0, "updated_by": "admin", "tiers": {...}}
    degradation.json   {"version": 1, "level": 3, "reason": "...", "pinned": true, "since": ..., "history": [...]}

At start a valid ``tiers.json`` wins over the ``initial`` policy (a ``--tiers-file`` or the
built-in default): what an operator set through the admin API is what was in force. A file
that cannot be read or parsed is logged and ignored, never fatal; it is moved aside to
``*.corrupt`` so the next save does not silently overwrite the evidence. A file that cannot be
written (a full or read-only disk) does not stop the change: it is in force in memory (gateways get it),
the failure is logged and counted (:class:`StateWriteMetrics`), and the next change writes the file whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from control_plane.json_files import write_json_atomic
from control_plane.ladder import LevelChange
from data_plane.common.ladder import Level
from data_plane.tiers import TierPolicy

if TYPE_CHECKING:
    from control_plane.settings import ControlPlaneSettings

log = logging.getLogger(__name__)

TIERS_FILE = "tiers.json"
DEGRADATION_FILE = "degradation.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class DegradationRecord:
    """The ladder's persisted state: where it stands and how it got there."""

    level: Level = Level.NORMAL
    """Level in force."""
    reason: str = "initial"
    """Why the last change happened (operator text, or the signals that caused it)."""
    pinned: bool = False
    """True while an operator holds the level; the automatic controller does not move it."""
    since: float = 0.0
    """Unix time of the last change."""
    history: tuple[LevelChange, ...] = field(default=(), hash=False)
    """Recent changes, oldest first (bounded by the controller)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": int(self.level),
            "reason": self.reason,
            "pinned": self.pinned,
            "since": self.since,
            "history": [e.to_dict() for e in self.history],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DegradationRecord:
        level = Level.parse(data["level"])
        history = data.get("history") or []
        if not isinstance(history, list) or not all(isinstance(e, dict) for e in history):
            raise ValueError("history must be a list of objects")
        return cls(
            level=level,
            reason=str(data.get("reason") or ""),
            pinned=bool(data.get("pinned", False)),
            since=float(data.get("since") or 0.0),
            history=tuple(LevelChange.from_dict(e) for e in history),
        )


class StateWriteMetrics:
    """``switchboard_control_plane_state_writes_total{file,result}`` and ``..._state_unsaved`` (files whose
    last write failed: what a restart of the control plane would lose)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.writes = Counter("switchboard_control_plane_state_writes_total", "Writes of the control plane's state "
                              "files (file tiers|degradation) by result (ok|error: a full or read-only disk).",
                              ["file", "result"], registry=registry)
        self.unsaved = Gauge("switchboard_control_plane_state_unsaved", "State files whose last write failed: the "
                             "change is in force, but a restart of the control plane would lose it.", registry=registry)
        self._failing: set[str] = set()
        for name in (TIERS_FILE, DEGRADATION_FILE):
            for result in ("ok", "error"):
                self.writes.labels(name.removesuffix(".json"), result)

    def record(self, name: str, ok: bool) -> None:
        self.writes.labels(name.removesuffix(".json"), "ok" if ok else "error").inc()
        (self._failing.discard if ok else self._failing.add)(name)
        self.unsaved.set(len(self._failing))


class PolicyStore:
    """Tier policy + degradation record, in memory, mirrored to `state_dir` when one is given.

    Every write is synchronous and small (a few KB, on operator actions and ladder changes
    only), so handlers call it directly. `subscribe` callbacks run after each change; the
    control plane uses one to bump the ``/v1/state`` index.
    """

    def __init__(
        self,
        state_dir: Path | None,
        *,
        initial: TierPolicy | None = None,
        initial_source: str = "default",
        clock: Callable[[], float] = time.time,
        on_write: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.on_write = on_write or (lambda name, ok: None)
        """Hears of every write of a state file (its name, whether it was saved)."""
        self._clock = clock
        self._subscribers: list[Callable[[], None]] = []
        self._tiers = initial or TierPolicy.default()
        self.tiers_source = initial_source
        """Where the policy in force came from: ``default`` | ``file`` | ``state`` | ``admin``."""
        self.tiers_updated_at = clock()
        self._degradation = DegradationRecord(since=clock())
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            self._load()

    # -- reads -----------------------------------------------------------------------------

    @property
    def tiers(self) -> TierPolicy:
        return self._tiers

    @property
    def degradation(self) -> DegradationRecord:
        return self._degradation

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback()` after every change of the tiers or the degradation record."""
        self._subscribers.append(callback)

    # -- writes ----------------------------------------------------------------------------

    def set_tiers(self, policy: TierPolicy, *, actor: str = "admin") -> None:
        """Put `policy` in force and persist it (the caller validated it: it is a TierPolicy)."""
        now = self._clock()
        self._persist(TIERS_FILE, {"version": FORMAT_VERSION, "updated_at": now, "updated_by": actor,
                                   **policy.to_dict()})
        changed = policy != self._tiers
        self._tiers, self.tiers_source, self.tiers_updated_at = policy, actor, now
        log.info("tier policy %s by %s: %s", "updated" if changed else "re-applied", actor, ", ".join(policy.names()))
        self._notify()

    def save_degradation(self, record: DegradationRecord) -> None:
        self._persist(DEGRADATION_FILE, {"version": FORMAT_VERSION, **record.to_dict()})
        self._degradation = record
        self._notify()

    # -- internals -------------------------------------------------------------------------

    def _persist(self, name: str, data: Mapping[str, Any]) -> None:
        """Write one state file whole; a failure is logged and reported, never raised: the change goes on."""
        if self.state_dir is None:
            return
        try:
            write_json_atomic(self.state_dir / name, data)
        except OSError as exc:
            log.error("cannot save %s (%s): the change is in force, but a restart of the control plane would lose "
                      "it; the next change writes the file again", self.state_dir / name, exc)
            self.on_write(name, False)
            return
        self.on_write(name, True)

    def _notify(self) -> None:
        for callback in list(self._subscribers):
            try:
                callback()
            except Exception:  # a subscriber's bug must not undo a persisted change
                log.exception("policy store subscriber %r failed", callback)

    def _load(self) -> None:
        assert self.state_dir is not None
        tiers = self._read(self.state_dir / TIERS_FILE, _tiers_from_file)
        if tiers is not None:
            policy, updated_at = tiers
            self._tiers, self.tiers_source, self.tiers_updated_at = policy, "state", updated_at
            log.info("tier policy restored from %s (%s)", self.state_dir / TIERS_FILE, ", ".join(policy.names()))
        record = self._read(self.state_dir / DEGRADATION_FILE, DegradationRecord.from_dict)
        if record is not None:
            self._degradation = record
            log.info(
                "degradation restored from %s: level %d%s (%s)",
                self.state_dir / DEGRADATION_FILE,
                record.level,
                ", pinned" if record.pinned else "",
                record.reason,
            )

    @staticmethod
    def _read(path: Path, parse: Callable[[Mapping[str, Any]], Any]) -> Any:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.error("cannot read %s (%s); starting without it", path, exc)
            return None
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError("not a JSON object")
            return parse(data)
        except (ValueError, KeyError, TypeError) as exc:
            aside = path.with_suffix(path.suffix + ".corrupt")
            log.error("ignoring %s: %s (moved to %s)", path, exc, aside)
            with contextlib.suppress(OSError):
                os.replace(path, aside)
            return None


def _tiers_from_file(data: Mapping[str, Any]) -> tuple[TierPolicy, float]:
    return TierPolicy.from_dict({"tiers": data.get("tiers")}), float(data.get("updated_at") or 0.0)


def open_store(settings: ControlPlaneSettings, registry: CollectorRegistry | None = None) -> PolicyStore:
    """The store :class:`~control_plane.settings.ControlPlaneSettings` ask for: ``state_dir`` to
    persist in, ``tiers_file`` (YAML) as the policy when the state dir holds none; its writes counted in
    `registry`."""
    on_write = StateWriteMetrics(registry).record if registry is not None else None
    if settings.tiers_file is not None:
        return PolicyStore(settings.state_dir, initial=TierPolicy.from_yaml(Path(settings.tiers_file)),
                           initial_source="file", on_write=on_write)
    return PolicyStore(settings.state_dir, on_write=on_write)
