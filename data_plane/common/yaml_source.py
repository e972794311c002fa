"""Policy files given as a path or inline: the tier and safety flags accept either.

Called by the tier policy loader (data_plane/tiers.py) and the safety policy loader
(data_plane/gateway/safety/pipeline.py).

    load_yaml(Path("tiers.yaml"))           # a file
    load_yaml("tiers.yaml")                 # a file (no newline, no ': ', no '{')
    load_yaml("free: {rpm: 60}")            # YAML text
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def load_yaml(text_or_path: str | Path) -> Any:
    """A Path, or a str without newlines / ': ' / '{', is a file; any other str is YAML text."""
    if isinstance(text_or_path, Path):
        return yaml.safe_load(text_or_path.read_text())
    text = str(text_or_path)
    if "\n" in text or ": " in text or text.lstrip().startswith("{"):
        return yaml.safe_load(text)
    return yaml.safe_load(Path(text).read_text())
