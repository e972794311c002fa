"""What `switchboard up` owns in its state dir while it runs: the folder itself (one `up` at a time) and
the size of the logs its processes write there.

    lock = hold_state_dir(state)            # SystemExit naming the other `up` if one runs on this folder
    rotation = LogRotation(max_bytes=50 * 2**20, backups=3)
    rotation.rotate_full(state / "logs")    # called from the supervision loop

One `up` per folder: a second `up` in the same folder with other ports used to start a whole second
platform on the same files. It took over `credentials.json`'s URLs (`switchboard admin` then talked to
it, and to nothing once it stopped), its cache nodes rewrote the first platform's snapshots
(`cache/cache-N.jsonl`) with their own records, and both wrote the same log files. The lock is an
advisory `flock` on ``up.lock``: the kernel drops it when its holder dies however it dies (kill -9,
a crash), so a lock file left behind is never stale; the file also names the holder's pid.

Log rotation: every process's output goes to ``logs/<name>.log`` (children of `up` and the shards the
autoscaler starts), opened for appending, and nothing bounded them: a platform that ran for weeks filled
its disk with logs. The supervision loop checks their sizes and rotates a full one the way logrotate's
``copytruncate`` does (``x.log`` copied to ``x.log.1``, the older ones shifted to ``.2`` ... ``.N``, the
oldest dropped, ``x.log`` truncated in place): a process keeps its file descriptor and, as it appends,
its next line lands at the start of the emptied file. The price, as with logrotate: a line written
between the copy and the truncation is lost.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

LOCK_NAME = "up.lock"


def hold_state_dir(state: Path) -> IO[str]:
    """Lock `state` for this process's lifetime (keep the returned file open), or exit naming the `up`
    that holds it. Children are started with ``close_fds``: they do not hold it."""
    f = open(state / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115 (held until the process ends)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise SystemExit(f"switchboard up: another `switchboard up` (pid {holder}) is running on the state dir "
                         f"{state}; stop it first (Ctrl-C there, or kill {holder}), or give this one its own "
                         f"--state-dir.") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


@dataclass(frozen=True)
class LogRotation:
    """Size cap of each ``*.log`` in a folder, and how many rotated copies to keep."""

    max_bytes: int
    """A log that reaches this many bytes is rotated (0: never)."""
    backups: int
    """Rotated copies kept (``x.log.1`` is the newest); 0 truncates without a copy."""
    retry_s: float = 60.0
    """After a rotation failed (a full disk), that log is left alone this long: the loop runs every 0.5 s,
    and each try wrote a partial copy up to the disk's last free byte."""
    _failed: dict[Path, float] = field(default_factory=dict, compare=False, repr=False)

    def rotate_full(self, folder: Path) -> list[Path]:
        """Rotate every ``*.log`` in `folder` that reached `max_bytes`; the logs rotated."""
        if self.max_bytes <= 0:
            return []
        rotated = []
        for log in sorted(folder.glob("*.log")):
            try:
                full = log.stat().st_size >= self.max_bytes
            except OSError:  # gone between the glob and the stat
                continue
            if full and time.monotonic() >= self._failed.get(log, 0.0):
                try:
                    self.rotate(log)
                except OSError:
                    self._failed[log] = time.monotonic() + self.retry_s
                    continue
                self._failed.pop(log, None)
                rotated.append(log)
        return rotated

    def rotate(self, log: Path) -> None:
        """``log`` -> ``log.1`` (by copy, then truncated in place), ``log.1`` -> ``log.2``, ...; the
        copies past `backups` removed. The copy goes to a temporary file first: a copy that fails (a full
        disk) shifted nothing (the backups were shifted first and each retry pushed a partial copy down,
        until every backup was one), and the log is left as it is for the next pass."""
        if self.backups:
            fresh = log.with_name(f"{log.name}.1.tmp")
            try:
                with open(log, "rb") as src, open(fresh, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except OSError:
                fresh.unlink(missing_ok=True)
                raise
            for n in range(self.backups, 0, -1):
                older = log.with_name(f"{log.name}.{n}")
                if n == self.backups:
                    older.unlink(missing_ok=True)
                elif older.exists():
                    older.rename(log.with_name(f"{log.name}.{n + 1}"))
            fresh.rename(log.with_name(f"{log.name}.1"))
        os.truncate(log, 0)


__all__ = ["LOCK_NAME", "LogRotation", "hold_state_dir"]
