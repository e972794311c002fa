"""A small disk of its own for a test (a tmpfs), to fill up and free again: a full disk, for real.

    with small_disk(tmp_path / "spool", size="1m") as disk:   # skips where it cannot be mounted
        disk.fill()                                          # every free byte taken: writes get ENOSPC
        disk.free()                                          # the space back

Needs root (mount); the test skips elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


class SmallDisk:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._filler = path / ".filler"

    def fill(self) -> None:
        """Take every free byte (the tmpfs's last pages too)."""
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (65536, 1):
                with contextlib.suppress(OSError):
                    while os.write(fd, b"\0" * size):
                        pass
        finally:
            os.close(fd)

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)


@contextlib.contextmanager
def small_disk(path: Path, *, size: str = "1m") -> Iterator[SmallDisk]:
    if os.geteuid() != 0:
        pytest.skip("needs root (mount -t tmpfs) for a disk to fill")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield SmallDisk(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
