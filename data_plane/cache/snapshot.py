"""An in-memory cache node's records kept across its restarts: one file, read at start, rewritten
while it runs (when something changed) and when it stops.

    snapshot = Snapshot(Path(".switchboard/cache/cache-0.jsonl"))
    for record, expires_at in snapshot.read(now=time.time()):   # the unexpired ones, least recent first
        ...
    snapshot.write([(record, expires_at), ...])                  # whole, renamed into place

Why: `switchboard up` runs in-memory cache nodes (no Redis needed), and every stored response and
conversation was gone after a restart, while the keys, the tier policy and the usage ledger in the
same state dir survived. The records are sealed by the gateways (data_plane/common/crypto.py), so the
file holds what Redis would: ciphertext under ids. It is mode 600 all the same.

Each line is ``{"record": <Transcript.to_wire()>, "expires_at": <unix seconds>}``. A line that does
not parse is skipped (and counted in the log), never fatal: a node starts with what it can read, and
the damaged file is kept beside it as ``<name>.corrupt`` before anything rewrites it.
Blocking file I/O: the storage calls both methods through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from data_plane.cache.model import Transcript

log = logging.getLogger(__name__)


class Snapshot:
    """The file at `path` (its folder made mode 700 on the first write)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self, now: float) -> list[tuple[Transcript, float]]:
        """The records the file holds that expire after `now`, in the file's order; [] without a file.
        A write cut off by a crash (kill -9, power) left its temporary file: removed here, each as large
        as the store."""
        for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()
        try:
            with self.path.open("rb") as f:  # bytes: json.loads decodes each line, a bad one is skipped
                records, bad = _parse(f, now)
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning("cache snapshot %s unreadable (%s): starting empty; moved to %s", self.path,
                        type(exc).__name__, self._aside(os.replace))
            return []
        if bad:
            log.warning("cache snapshot %s: %d malformed lines skipped, %d records kept; the file as it was "
                        "is copied to %s", self.path, bad, len(records), self._aside(shutil.copy2))
        return records

    def _aside(self, how: Callable[[Path, Path], object]) -> Path:
        """Keep the damaged file as ``<name>.corrupt`` (the node's next write replaces the file): what did
        not parse may still be recovered by hand, as the control plane keeps its state files."""
        aside = self.path.with_name(self.path.name + ".corrupt")
        try:
            how(self.path, aside)
        except OSError as exc:
            log.warning("cache snapshot %s: could not keep it as %s (%s)", self.path, aside, type(exc).__name__)
        return aside

    def write(self, entries: Iterable[tuple[Transcript, float]]) -> int:
        """Replace the file with `entries` so that a crash leaves the old file or the new one; returns
        how many were written."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        count = 0
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for record, expires_at in entries:
                    f.write(json.dumps({"record": record.to_wire(), "expires_at": expires_at},
                                       separators=(",", ":"), ensure_ascii=False))
                    f.write("\n")
                    count += 1
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            folder = os.open(self.path.parent, os.O_RDONLY)  # the rename itself outlives a power loss
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return count


def _parse(lines: Iterator[bytes], now: float) -> tuple[list[tuple[Transcript, float]], int]:
    records: list[tuple[Transcript, float]] = []
    bad = 0
    for line in lines:
        try:
            data = json.loads(line)
            record, expires_at = Transcript.from_wire(data["record"]), float(data["expires_at"])
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        if expires_at > now:
            records.append((record, expires_at))
    return records, bad


__all__ = ["Snapshot"]
