"""The tests' fork server (tests/support/forkserver.py): a forked child runs its module in its own
environment, cwd and output, and its end is reported as `subprocess.Popen` reports one."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.forkserver import ForkServer
from tests.support.procs import ROOT


@pytest.fixture(scope="module")
def server() -> ForkServer:
    found = ForkServer.shared(ROOT)
    if found is None:
        pytest.skip("no fork server here (SWITCHBOARD_TEST_FORKSERVER=0, or a kernel without pidfds)")
    return found


def test_a_child_runs_in_its_own_environment_cwd_and_output(server: ForkServer, tmp_path: Path) -> None:
    out = tmp_path / "out.log"
    code = "import os, sys; print(os.getcwd(), os.environ['PROBE'], sys.argv[1:]); sys.exit(3)"
    (tmp_path / "probe.py").write_text(code)
    with open(out, "wb") as log:  # `python -m probe` run in tmp_path: the module is found there
        proc = server.spawn("probe", ["a", "b"], env={**os.environ, "PROBE": "here"}, cwd=tmp_path, log=log.fileno())
    assert proc is not None
    assert proc.wait(30) == 3
    assert out.read_text().split() == [str(tmp_path), "here", "['a',", "'b']"]


def test_a_killed_child_reads_as_popen_reads_it(server: ForkServer, tmp_path: Path) -> None:
    with open(tmp_path / "out.log", "wb") as log:
        proc = server.spawn("http.server", ["0", "--bind", "127.0.0.1"], env=dict(os.environ), cwd=tmp_path,
                            log=log.fileno())
    assert proc is not None
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL


def test_a_changed_interpreter_variable_is_not_forked(server: ForkServer, tmp_path: Path) -> None:
    with open(tmp_path / "out.log", "wb") as log:
        same = server.spawn("calendar", [], env=dict(os.environ), cwd=tmp_path, log=log.fileno())
        assert same is not None and same.wait(30) == 0  # the control: the same environment is forked
        assert server.spawn("calendar", [], env={**os.environ, "PYTHONHASHSEED": "7"}, cwd=tmp_path,
                            log=log.fileno()) is None


def test_pythonunbuffered_output_reaches_the_file_before_a_kill(server: ForkServer, tmp_path: Path) -> None:
    """As with a fresh `python -u`: a line written and never flushed is in the log when the child is killed
    (a cache node is started so, and a test reads its log)."""
    out = tmp_path / "out.log"
    (tmp_path / "talker.py").write_text("import sys, time\nsys.stdout.write('said')\ntime.sleep(60)\n")
    with open(out, "wb") as log:
        proc = server.spawn("talker", [], env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=tmp_path,
                            log=log.fileno())
    assert proc is not None
    deadline = time.monotonic() + 30
    while out.read_text() != "said" and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL
    assert out.read_text() == "said"
