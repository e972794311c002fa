"""The ladder, the autoscaler and the console read signals by attribute, and mypy checks it: a
renamed or missing Signals field is a type error, never a silently absent (calm) figure.

    .venv/bin/python -m pytest tests/control_plane/test_typed_signals.py -q      # ~15 s (mypy, cached after)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.procs import ROOT

TYPED = ["control_plane/signals/model.py", "control_plane/signals/scrape.py", "control_plane/signals/prometheus.py", "control_plane/degradation.py",
         "control_plane/degradation_rule.py", "control_plane/scaling/policy.py", "control_plane/scaling/loop.py", "control_plane/scaling/simulate.py",
         "admin_ui/views/"]


def _mypy(*paths: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", *paths], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_signal_readers_type_check(tmp_path: Path) -> None:
    out = _mypy(*TYPED)
    assert out.returncode == 0, out.stdout + out.stderr
    # a reader of a field that does not exist (a rename on one side) is caught before it runs
    probe = tmp_path / "renamed_probe.py"
    probe.write_text("from control_plane.signals.model import Signals\n\n"
                     "def hot(s: Signals) -> bool:\n"
                     "    return (s.queue_p95_s or 0.0) > 1.0\n")
    out = _mypy(str(probe))
    assert out.returncode != 0 and '"Signals" has no attribute "queue_p95_s"' in out.stdout, out.stdout
