"""How many CPUs this process may use: its affinity mask and its cgroup's CPU quota.

A container is often given fewer CPUs than the host has, in one of two ways: an affinity mask
(`taskset`, `docker --cpuset-cpus`, Kubernetes' static CPU manager), which `os.sched_getaffinity`
reports, or a CPU quota (`docker --cpus`, a Kubernetes CPU limit), which only the cgroup's files
say: cgroup v2's `cpu.max` ("150000 100000": 1.5 CPUs; "max 100000": no quota), v1's
`cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: no quota). A quota may be set on any cgroup above
the process's, so each is read up to the hierarchy's root, and the smallest counts.

Threads beyond the quota do not add speed: the cgroup's CPU time runs out early in each period
and every thread waits for the next one, so the engine takes the quota rounded down (at least 1).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_MOUNT = Path("sys/fs/cgroup")  # below the root directory


@dataclass(frozen=True)
class CpuBudget:
    """The engine thread's CPU threads and where the count came from."""

    threads: int
    source: str  # "flag", "OMP_NUM_THREADS", "affinity" or "cgroup quota"
    detail: str  # what was read, for the log and /info

    def describe(self) -> str:
        source = {"flag": "the flag", "affinity": "the affinity mask", "cgroup quota": "the cgroup CPU quota"}
        threads = f"{self.threads} CPU thread{'s' if self.threads != 1 else ''}"
        return f"{threads}, from {source.get(self.source, self.source)} ({self.detail})"


def _cgroup_paths(root: Path) -> list[tuple[str, str]]:
    """(controllers, path) of each line of /proc/self/cgroup (controllers "" on cgroup v2)."""
    try:
        text = (root / "proc/self/cgroup").read_text()
    except OSError:
        return []
    lines = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            lines.append((parts[1], parts[2]))
    return lines


def _upwards(base: Path, path: str) -> list[Path]:
    """base/path and each of its parents up to base (those that exist). Inside a container without
    its own cgroup namespace the path is the host's, and the container's cgroup is mounted at base:
    the missing levels are skipped."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    dirs = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_quota(directory: Path) -> tuple[float, str] | None:
    text = _read(directory / "cpu.max")
    if text is None:
        return None
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max" or not fields[0].isdigit() or not fields[1].isdigit():
        return None
    quota, period = int(fields[0]), int(fields[1])
    return (quota / period, f"cgroup v2 cpu.max {quota} {period}") if period > 0 else None


def _v1_quota(directory: Path) -> tuple[float, str] | None:
    quota_text, period_text = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if quota_text is None or period_text is None:
        return None
    try:
        quota, period = int(quota_text), int(period_text)
    except ValueError:
        return None
    if quota <= 0 or period <= 0:  # -1: no quota
        return None
    return quota / period, f"cgroup v1 cpu.cfs_quota_us {quota} / cpu.cfs_period_us {period}"


def cgroup_cpu_quota(root: Path = Path("/")) -> tuple[float, str] | None:
    """The smallest CPU quota on this process's cgroup or any above it, in CPUs, with what was
    read; None without one (or without cgroups). `root`: the file system root (tests fake it)."""
    found: list[tuple[float, str]] = []
    for controllers, path in _cgroup_paths(root):
        if controllers == "":  # cgroup v2 (unified)
            for d in _upwards(root / CGROUP_MOUNT, path) + _upwards(root / CGROUP_MOUNT / "unified", path):
                found += [q for q in [_v2_quota(d)] if q]
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                for d in _upwards(root / CGROUP_MOUNT / mount, path):
                    found += [q for q in [_v1_quota(d)] if q]
    return min(found) if found else None


def affinity_cpus() -> int:
    return len(os.sched_getaffinity(0))


def cpu_budget(configured: int | None = None, root: Path = Path("/")) -> CpuBudget:
    """The engine's threads: `configured` (the --cpu-threads flag) when given, else OMP_NUM_THREADS
    when set, else the smaller of the CPUs in the affinity mask and the cgroup quota rounded down."""
    if configured is not None:
        return CpuBudget(configured, "flag", f"--cpu-threads {configured}")
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return CpuBudget(int(env), "OMP_NUM_THREADS", f"OMP_NUM_THREADS={env}")
    cpus = affinity_cpus()
    affinity = f"affinity {cpus} CPU{'s' if cpus != 1 else ''}"
    quota = cgroup_cpu_quota(root)
    if quota is None:
        return CpuBudget(max(1, cpus), "affinity", f"{affinity}, no cgroup CPU quota")
    limit = max(1, math.floor(quota[0]))
    detail = f"{affinity}, {quota[1]} = {quota[0]:g} CPUs"
    return CpuBudget(limit, "cgroup quota", detail) if limit < cpus else CpuBudget(cpus, "affinity", detail)
