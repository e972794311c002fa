"""The layout holds: the import rules (pyproject.toml, [tool.importlinter]; the README's map of the
code), no module over 500 lines, every module with a docstring (STYLE.md; issue 17 item 5).

    .venv/bin/python -m pytest tests/test_layout.py -q        # ~5 s
    .venv/bin/lint-imports                                     # the same check, with the full report

A broken contract fails with the import chain that breaks it (module, line), as lint-imports prints it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=False)
    report = out.stdout + out.stderr
    assert "Contracts:" in report, report  # it analysed the tree rather than failing to start
    assert out.returncode == 0, report
    assert " broken." in report and ", 0 broken." in report, report


MAX_MODULE_LINES = 500
"""STYLE.md: a module that passes ~500 lines wants splitting (issue 17 item 5)."""
TREES = ("data_plane", "control_plane", "admin_ui", "dashboards")


def _modules() -> list[Path]:
    return sorted(p for tree in TREES for p in (ROOT / tree).rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_over_500_lines() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text(encoding="utf-8").splitlines()) for p in _modules()}
    assert len(sizes) > 100, sorted(sizes)  # it found the tree
    over = sorted((n, path) for path, n in sizes.items() if n > MAX_MODULE_LINES)
    listed = ", ".join(f"{path} ({n})" for n, path in reversed(over))
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by what they do): {listed}"


def test_every_module_has_a_docstring() -> None:
    missing = [p.relative_to(ROOT).as_posix() for p in _modules()
               if not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))]
    assert not missing, "modules without a docstring (say what it is for and who calls it): " + ", ".join(missing)
