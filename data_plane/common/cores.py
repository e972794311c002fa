"""The CPU cores this process may actually use, for sizing thread pools and shard counts.

    from data_plane.common.cores import usable_cores
    threads = usable_cores()            # e.g. 2 on a 64-core host under `taskset -c 0,1`

`os.cpu_count()` counts the host's cores. A process pinned by `taskset` / a cpuset sees fewer
(`os.sched_getaffinity`), and a container with a CPU limit (Kubernetes `resources.limits.cpu`,
`docker --cpus`) may run all its threads on every core but only for `quota / period` of each
period: sizing to the host then oversubscribes, and OpenMP threads that spin at a barrier while one
of them is throttled turn milliseconds into tens of milliseconds.

`usable_cores()` = min(affinity, floor(cgroup quota / period)), at least 1. The quota is read from
cgroup v2 (`cpu.max`: "max 100000" or "150000 100000") of the process's own cgroup, else from cgroup
v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`, -1 meaning none). A fractional quota rounds down
(1.5 CPUs -> 1 thread), the way the JVM and Go (since 1.25) size themselves. `root` is the cgroup
mount point, a parameter so tests can hand in a fake tree.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where cgroup v2 (unified) or the v1 controllers are mounted on Linux."""


def affinity_cores() -> int:
    """Cores the scheduler may place this process on (`taskset`, cpusets); the host's count where
    the platform has no affinity call (macOS)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _own_cgroup_paths(proc_self_cgroup: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 cpu-controller path) of this process, from /proc/self/cgroup lines
    `0::/kubepods/pod1/c1` (v2) and `4:cpu,cpuacct:/docker/abc` (v1)."""
    v2 = v1 = None
    try:
        text = proc_self_cgroup.read_text(encoding="utf-8")
    except OSError:
        return None, None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _candidates(base: Path, own: str | None) -> list[Path]:
    """The process's own cgroup dir and its ancestors up to `base` (a limit on a parent binds too;
    inside a container's namespace the own path is often just "/"), deepest first."""
    out: list[Path] = []
    if own:
        rel = Path(own.lstrip("/"))
        while True:
            out.append(base / rel)
            if rel == Path("."):
                break
            rel = rel.parent
    if base not in out:
        out.append(base)
    return out


def _v2_quota(d: Path) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text(encoding="utf-8").split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period) if int(period) > 0 else None
    except ValueError:
        return None


def _v1_quota(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text(encoding="utf-8").strip())
        period = int((d / "cpu.cfs_period_us").read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_quota(root: Path = CGROUP_ROOT, proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time per period the cgroup allows (1.5 = one and a half cores), the tightest
    over this process's cgroup and its ancestors; None when unlimited or unreadable."""
    v2_own, v1_own = _own_cgroup_paths(proc_self_cgroup)
    found: list[float] = []
    if (root / "cgroup.controllers").exists():  # v2 unified hierarchy
        found += [q for d in _candidates(root, v2_own) if (q := _v2_quota(d)) is not None]
    else:  # v1: the cpu controller is mounted at root/cpu (or root/cpu,cpuacct)
        for mount in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
            if mount.is_dir():
                found += [q for d in _candidates(mount, v1_own) if (q := _v1_quota(d)) is not None]
    return min(found) if found else None


def usable_cores(root: Path = CGROUP_ROOT, proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Cores this process can keep busy at once: affinity capped by the cgroup CPU quota (rounded
    down), never below 1. Size intra-op threads and shards-per-host from this, not os.cpu_count()."""
    cores = affinity_cores()
    quota = cgroup_quota(root, proc_self_cgroup)
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, cores)


SPIN_COUNT = "20000"
"""libgomp's GOMP_SPINCOUNT for every switchboard process (control_plane/cli.py sets it unless the
environment has one; libgomp reads it once, when torch loads it): an OpenMP worker whose parallel
region ended spins this many pauses (~0.4 ms on an EPYC) before it sleeps, not libgomp's 300,000
(~6 ms). Within a forward pass the gaps between regions are tens of µs, so the kernels never see the
difference (one stream and 16 streams, 2 threads: no change beyond the run-to-run noise, AMD EPYC).
Between passes it matters to whoever shares the cores: a pipeline's stages take turns (a stage's
workers spun through the whole of the next stage's turn and took a core from it: a 2-thread lone
pass measured slower than 1-thread stages, data_plane/shard/engines/pipeline.py), and a gateway or a
cache node beside a shard gets the core back ~6 ms sooner after each step."""
