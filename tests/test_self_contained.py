"""The repository stands on its own in a fresh clone: no tracked file points outside it.

    .venv/bin/python -m pytest tests/test_self_contained.py -q      # < 1 s

A relative path to a file (parent-directory steps, then a file name) must resolve inside the
repository, from the file that names it or, for prose that names paths from the top (README,
docstrings), from the root; and the design notes the project grew from are in docs/, not in a
sibling folder.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RELATIVE = re.compile(r"(?<![\w/.])((?:\.\./)+[\w.-]+(?:/[\w.-]+)*\.(?:md|py|ya?ml|json|toml|txt|sh|png|cfg|ini))")
OUTSIDE = re.compile(r"(?:/work/shared|\bshared/(?:DESIGN|FACTS|STYLE)\.md)")
TEXT = {".md", ".py", ".yaml", ".yml", ".json", ".toml", ".txt", ".sh", ".cfg", ".ini", ""}


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def inside(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def test_no_tracked_file_points_outside_the_repository() -> None:
    bad: list[str] = []
    for path in tracked():
        if path.suffix not in TEXT or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{lineno}"
            for ref in RELATIVE.findall(line):
                from_file = path.parent / ref
                if not (inside(from_file) and from_file.exists()) and not inside(ROOT / ref):
                    bad.append(f"{where}: {ref}")
            if OUTSIDE.search(line) and path.name != Path(__file__).name:
                bad.append(f"{where}: {OUTSIDE.search(line).group(0)}")  # type: ignore[union-attr]
    assert not bad, "paths outside the repository:\n" + "\n".join(bad)


def test_the_design_documents_are_in_the_repository() -> None:
    for doc in ("docs/ARCHITECTURE.md", "docs/FACTS.md", "docs/metrics.md"):
        assert (ROOT / doc).is_file(), doc
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for link in re.findall(r"\]\(((?!https?:)[^)#]+)\)", readme):
        assert (ROOT / link).exists(), f"README links to a missing file: {link}"
