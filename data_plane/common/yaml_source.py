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


def is_inline(text: str) -> bool:
    """Whether a str given for a policy is YAML text rather than a file's name."""
    return "\n" in text or ": " in text or text.lstrip().startswith("{")


def parse_yaml(text: str, where: str) -> Any:
    """`text` parsed; YAML that does not parse is a ValueError naming `where` (a file, "inline YAML")."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ValueError(f"{where} is not valid YAML ({at}{problem or exc})") from None


def load_yaml(text_or_path: str | Path) -> Any:
    """A Path, or a str without newlines / ': ' / '{', is a file; any other str is YAML text."""
    if isinstance(text_or_path, Path):
        return parse_yaml(text_or_path.read_text(), str(text_or_path))
    text = str(text_or_path)
    if is_inline(text):
        return parse_yaml(text, "inline YAML")
    return parse_yaml(Path(text).read_text(), text)
