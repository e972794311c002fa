"""The layout's import rules hold (pyproject.toml, [tool.importlinter]; the README's map of the code).

    .venv/bin/python -m pytest tests/test_layout.py -q        # ~5 s
    .venv/bin/lint-imports                                     # the same check, with the full report

A broken contract fails with the import chain that breaks it (module, line), as lint-imports prints it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = out.stdout + out.stderr
    assert "Contracts:" in report, report  # it analysed the tree rather than failing to start
    assert out.returncode == 0, report
    assert " broken." in report and ", 0 broken." in report, report
