"""usable_cores(): affinity capped by the cgroup CPU quota, on fake cgroup v1/v2 trees and under a
real `taskset -c 0` (data_plane/common/cores.py).

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_cores.py -q
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data_plane.common import cores
from data_plane.common.cores import cgroup_quota, usable_cores

ROOT = Path(__file__).resolve().parents[2]


def _v2(tmp_path: Path, own: str, limits: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for rel, cpu_max in limits.items():
        d = root / rel.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(cpu_max + "\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::{own}\n")
    return root, proc


def _v1(tmp_path: Path, own: str, quota: int, period: int, mount: str = "cpu,cpuacct") -> tuple[Path, Path]:
    root = tmp_path / "cg"
    d = root / mount / own.lstrip("/")
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (d / "cpu.cfs_period_us").write_text(f"{period}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"5:memory:{own}\n4:cpu,cpuacct:{own}\n0::/\n")
    return root, proc


@pytest.fixture
def many_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the affinity mask holds 64 cores, so the quota is what binds."""
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda _pid: set(range(64)))


@pytest.mark.parametrize(("cpu_max", "expected"), [
    ("max 100000", 64),          # no limit: the affinity count
    ("200000 100000", 2),        # limits.cpu: 2
    ("150000 100000", 1),        # 1.5 rounds down
    ("50000 100000", 1),         # half a core: still at least 1
    ("800000 200000", 4),
])
def test_v2_quota_of_own_cgroup(tmp_path: Path, many_cores: None, cpu_max: str, expected: int) -> None:
    root, proc = _v2(tmp_path, "/kubepods/pod1/c1", {"/kubepods/pod1/c1": cpu_max})
    assert usable_cores(root, proc) == expected


def test_v2_parent_limit_binds(tmp_path: Path, many_cores: None) -> None:
    root, proc = _v2(tmp_path, "/kubepods/pod1/c1",
                     {"/kubepods/pod1/c1": "max 100000", "/kubepods/pod1": "300000 100000", "/": "max 100000"})
    assert cgroup_quota(root, proc) == 3.0
    assert usable_cores(root, proc) == 3


def test_v2_namespaced_root_path(tmp_path: Path, many_cores: None) -> None:
    """Inside a container's cgroup namespace /proc/self/cgroup says `0::/` and the limit sits at the root."""
    root, proc = _v2(tmp_path, "/", {"/": "400000 100000"})
    assert usable_cores(root, proc) == 4


@pytest.mark.parametrize(("quota", "period", "expected"), [(-1, 100000, 64), (250000, 100000, 2), (100000, 100000, 1)])
def test_v1_cfs_quota(tmp_path: Path, many_cores: None, quota: int, period: int, expected: int) -> None:
    root, proc = _v1(tmp_path, "/docker/abc", quota, period)
    assert usable_cores(root, proc) == expected


def test_v1_separate_cpu_mount(tmp_path: Path, many_cores: None) -> None:
    root, proc = _v1(tmp_path, "/", 200000, 100000, mount="cpu")
    assert usable_cores(root, proc) == 2


def test_affinity_binds_below_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda _pid: {0, 1})
    root, proc = _v2(tmp_path, "/", {"/": "800000 100000"})
    assert usable_cores(root, proc) == 2


def test_unreadable_tree_means_no_limit(tmp_path: Path, many_cores: None) -> None:
    assert cgroup_quota(tmp_path / "absent", tmp_path / "absent_proc") is None
    assert usable_cores(tmp_path / "absent", tmp_path / "absent_proc") == 64
    root, proc = _v2(tmp_path, "/", {"/": "garbage"})
    assert usable_cores(root, proc) == 64


@pytest.mark.skipif(shutil.which("taskset") is None or not hasattr(os, "sched_getaffinity"), reason="needs taskset")
def test_taskset_one_core_real_process() -> None:
    """A real process pinned with `taskset -c N` sizes itself to one core, and so does the engine's
    thread default (N: a core this test may already use, so the pin takes no core from anyone)."""
    core = min(os.sched_getaffinity(0))
    code = ("from data_plane.common.cores import usable_cores;"
            "from data_plane.shard.engines.torch_load import auto_threads;"
            "print(usable_cores(), auto_threads(True), auto_threads(False))")
    out = subprocess.run(["taskset", "-c", str(core), sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.split() == ["1", "1", "1"], out.stdout + out.stderr
