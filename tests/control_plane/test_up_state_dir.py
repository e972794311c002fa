"""What `switchboard up` owns in its state dir (control_plane/state_dir.py): one `up` per folder, and
logs that stop growing at their cap.

A second `up` in the same folder on other ports started a whole second platform on the first one's files:
it rewrote credentials.json's URLs (`switchboard admin` then talked to it, and to nothing after it
stopped) and its cache nodes overwrote the first platform's snapshots. And nothing bounded the logs in
STATE_DIR/logs: a platform that runs for weeks fills its disk."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from control_plane.state_dir import LogRotation
from control_plane.supervisor import Child, Supervisor
from tests.support.procs import free_port, start_up, stop_up, wait_up


def _up_args(gw: int, cp: int) -> list[str]:
    return ["--engine", "synthetic", "--gateway-port", str(gw), "--control-plane-port", str(cp), "--no-console",
            "--shards", "1", "--cache-nodes", "1"]


def test_a_second_up_in_the_same_folder_refuses_and_a_killed_ones_lock_is_not_stale(tmp_path: Path) -> None:
    state = tmp_path / ".switchboard"
    gw, cp = free_port(), free_port()
    first = start_up(tmp_path, *_up_args(gw, cp), "--log-max-bytes", "1000", "--log-backups", "1")
    try:
        wait_up(first, tmp_path)
        urls = {k: v for k, v in json.loads((state / "credentials.json").read_text()).items() if k.endswith("_url")}
        second = subprocess.run([sys.executable, "-m", "control_plane.cli", "up", *_up_args(free_port(), free_port())],
                                check=False, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"another `switchboard up` (pid {first.pid})" in second.stderr, second.stderr
        assert "starting control plane" not in second.stdout and "Traceback" not in second.stderr
        after = {k: v for k, v in json.loads((state / "credentials.json").read_text()).items() if k.endswith("_url")}
        assert after == urls == {"control_plane_url": f"http://127.0.0.1:{cp}", "gateway_url": f"http://127.0.0.1:{gw}"}

        # --log-max-bytes reaches the supervision loop: the start-up lines alone fill 1000 bytes
        deadline = time.monotonic() + 10
        while not list((state / "logs").glob("*.log.1")):
            assert time.monotonic() < deadline, sorted(p.name for p in (state / "logs").iterdir())
            time.sleep(0.2)
        assert not list((state / "logs").glob("*.log.2"))

        first.send_signal(signal.SIGKILL)  # its lock file stays behind, its lock does not
        first.wait(10)
        time.sleep(1)  # its children follow it (lifeline) and free their ports
        again = start_up(tmp_path, *_up_args(gw, cp))
        try:
            assert "Switchboard is up" in wait_up(again, tmp_path)
        finally:
            stop_up(again)
    finally:
        stop_up(first)


def test_logs_are_rotated_at_their_cap_while_the_process_keeps_writing(tmp_path: Path) -> None:
    """A child appending to its log (as every child of `up` does) keeps writing into the emptied file
    after each rotation; the copies stop at --log-backups."""
    writer = ("import sys, time\n"
              "for i in range(100000):\n"
              "    sys.stdout.write(f'line {i:06d} ' + 'x' * 50 + '\\n'); sys.stdout.flush(); time.sleep(0.0005)\n"
              "time.sleep(60)\n")
    child = Child("writer", [], "http://127.0.0.1:9", tmp_path / "writer.log", command=[sys.executable, "-c", writer])
    other = tmp_path / "shard-local-1.log"  # a log the supervisor did not open (an autoscaled shard's)
    other.write_bytes(b"y" * 25_000)
    sup = Supervisor([child], LogRotation(max_bytes=20_000, backups=2), tmp_path)
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "writer.log.2").exists() or (tmp_path / "writer.log").stat().st_size < 100:
            assert time.monotonic() < deadline, sorted(p.name for p in tmp_path.iterdir())
            sup._rotate_logs()
            time.sleep(0.05)
        assert (tmp_path / "shard-local-1.log.1").read_bytes() == b"y" * 25_000
        assert (tmp_path / "shard-local-1.log").stat().st_size == 0
        assert not (tmp_path / "writer.log.3").exists()
        live = (tmp_path / "writer.log").read_bytes()
        assert b"\0" not in live and live.startswith(b"line "), live[:80]  # appended at the new start, not sparse
        for copy in ("writer.log.1", "writer.log.2"):
            assert (tmp_path / copy).read_bytes().startswith(b"line ")
    finally:
        child.stop(signal.SIGKILL)
        if child.proc is not None:
            child.proc.wait(5)


def test_a_failed_copy_keeps_the_older_backups(tmp_path: Path) -> None:
    """The backups were shifted before the copy: a copy that failed (a full disk; here RLIMIT_FSIZE) left a
    partial .1 and the log untruncated, and each later pass (every 0.5 s) shifted again, until every backup
    was a partial copy of the current log."""
    script = f"""
import resource, signal
from pathlib import Path
from control_plane.state_dir import LogRotation
d = Path({str(tmp_path)!r})
for n in (1, 2, 3):
    (d / f"a.log.{{n}}").write_text(f"history {{n}}\\n")
(d / "a.log").write_bytes(b"current line\\n" * 20000)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
rotation = LogRotation(200_000, 3)
for _ in range(3):
    assert rotation.rotate_full(d) == []
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # room again
assert rotation.rotate_full(d) == []  # a failed log is left alone for retry_s: no copy every 0.5 s
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert [(tmp_path / f"a.log.{n}").read_text() for n in (1, 2, 3)] == [f"history {n}\n" for n in (1, 2, 3)]
    assert (tmp_path / "a.log").stat().st_size == 20000 * 13 and not list(tmp_path.glob("*.tmp"))
    assert LogRotation(200_000, 3).rotate_full(tmp_path) == [tmp_path / "a.log"]  # past the wait: rotated
    assert (tmp_path / "a.log.1").stat().st_size == 20000 * 13 and (tmp_path / "a.log.2").read_text() == "history 1\n"


def test_a_damaged_keys_file_is_refused_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    """keys.yaml cut short (a full disk, a bad edit): `up` refused it, rightly (it is the truth of who may call),
    but with a 20-line Python traceback."""
    state = tmp_path / ".switchboard"
    state.mkdir()
    (state / "keys.yaml").write_text("keys:\n- key_sha256: " + "ab" * 32 + "\n  tenant: dev\n")  # its tier cut off
    (state / "keys.yaml").chmod(0o600)
    up = subprocess.run([sys.executable, "-m", "control_plane.cli", "up", *_up_args(free_port(), free_port())],
                        check=False, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert up.returncode == 1, up.stdout + up.stderr
    assert "Traceback" not in up.stderr, up.stderr
    assert up.stderr.strip().splitlines() == [
        f"switchboard up: invalid API keys in {state / 'keys.yaml'}: keys.0.tier: Field required"], up.stderr
    assert "starting control plane" not in up.stdout


def test_a_state_dir_that_cannot_be_made_is_refused_in_one_line(tmp_path: Path) -> None:
    """`up --state-dir` under a file (or a read-only disk, another user's folder) ended in a Python traceback
    from mkdir; a file named as the state dir too."""
    (tmp_path / "afile").write_text("")
    for state, why in ((tmp_path / "afile" / "state", "Not a directory"), (tmp_path / "afile", "a file, not a folder")):
        up = subprocess.run([sys.executable, "-m", "control_plane.cli", "up", "--state-dir", str(state),
                             *_up_args(free_port(), free_port())],
                            check=False, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert up.returncode == 1 and "Traceback" not in up.stderr, up.stderr
        assert up.stderr.strip().splitlines() == [
            f"switchboard up: cannot use --state-dir {state}: {why}; give a folder this user can write"], up.stderr
        assert "starting control plane" not in up.stdout
