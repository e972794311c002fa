"""Writing the control plane's state files so that a crash leaves the old file or the new one.

    write_json_atomic(state_dir / "tiers.json", {"version": 1, ...})

Used by the policy store (tier policy, degradation level), the registry's drain marks and the
abuse monitor's sealed state. Its own module, importing nothing of ours, so that the registry can
use it without importing the policy store (which would make an import cycle in control_plane).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace `path` with `data` as JSON so that a crash leaves the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # the rename itself is durable only once the directory entry is
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


__all__ = ["write_json_atomic"]
