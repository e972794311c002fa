"""The operator's drains, kept where a control-plane restart cannot undo them.

    marks = DrainMarks(Path("/var/lib/switchboard"))   # reads drains.json when there is one
    marks.set("shard-1", True)                          # written atomically before the call returns
    "shard-1" in marks                                  # True, in this process and the next one
    marks.set("shard-1", False)                         # undrain, or the member left on its own

    DrainMarks(None)                                    # in memory only (nothing survives a restart)

Why: the embedded registry is in memory, and members re-register after a control-plane restart
with their ordinary heartbeat, which says nothing about draining. Without this file a shard an
operator drained for maintenance went back into rotation the moment the control plane was
restarted (its supervisor does that after a crash), with nothing on screen to say so. The tier
policy and a pinned degradation level already survive a restart (control_plane/policy_store.py);
a drain is the same kind of operator decision.

A mark lasts until the operator undrains the member (present or not) or the member deregisters
itself (a clean shutdown: the local autoscaler drains a shard, then stops it, and may later start
a new shard under the same id, which must not be born drained; when it had to kill the shard, it
undrains the id itself). A member that only dies (kill -9, expiry) keeps its mark: when it comes
back under the same id it is still drained, as it is when the control plane never went away.

File (``drains.json`` in the control plane's ``--state-dir``)::

    {"version": 1, "members": {"shard-1": 1700000000.0}}      # id -> when it was drained
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from control_plane.json_files import write_json_atomic

log = logging.getLogger(__name__)

DRAINS_FILE = "drains.json"
FORMAT_VERSION = 1


class DrainMarks:
    """Member ids an operator drained, mirrored to ``state_dir/drains.json`` when a dir is given."""

    def __init__(self, state_dir: Path | None) -> None:
        self.path = None if state_dir is None else state_dir / DRAINS_FILE
        self._marks: dict[str, float] = self._load() if self.path is not None else {}

    def __contains__(self, member_id: object) -> bool:
        return member_id in self._marks

    def __len__(self) -> int:
        return len(self._marks)

    def ids(self) -> list[str]:
        return sorted(self._marks)

    def set(self, member_id: str, draining: bool) -> None:
        """Record (or clear) a drain; a no-op when nothing changes, so heartbeats never write."""
        if draining == (member_id in self._marks):
            return
        if draining:
            self._marks[member_id] = time.time()
        else:
            del self._marks[member_id]
        self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            write_json_atomic(self.path, {"version": FORMAT_VERSION, "members": self._marks})
        except OSError as exc:  # the drain itself still holds in memory; say the restart will lose it
            log.error("cannot save drains to %s (%s): a control-plane restart will undrain %s",
                      self.path, exc, ", ".join(self.ids()) or "nothing")

    def _load(self) -> dict[str, float]:
        assert self.path is not None
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            members = data["members"]
            if not isinstance(members, dict):
                raise TypeError("members is not an object")
            marks = {str(k): float(v) for k, v in members.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, OverflowError) as exc:
            log.error("ignoring %s (%s): no member starts drained", self.path, exc)
            return {}
        if marks:
            log.info("drains restored from %s: %s", self.path, ", ".join(sorted(marks)))
        return marks


__all__ = ["DRAINS_FILE", "DrainMarks"]
