"""The engine's default thread count: the affinity mask and the cgroup CPU quota (v1 and v2), read
from a faked file system root; the flag and OMP_NUM_THREADS come first."""

from __future__ import annotations

from pathlib import Path

import pytest

import nanoserve.engine.cpu_quota as cpu_quota
from nanoserve.engine.cpu_quota import cgroup_cpu_quota, cpu_budget


def fake_root(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> Path:
    """A root directory with /proc/self/cgroup and the given files (paths below the root)."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(proc_cgroup)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


@pytest.fixture
def cpus(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Four CPUs in the affinity mask, no OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_quota.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    return monkeypatch


def test_cgroup_v2_quota_limits_the_threads(tmp_path: Path, cpus: pytest.MonkeyPatch) -> None:
    root = fake_root(tmp_path, "0::/kubepods/pod1/c1\n",
                     {"sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "250000 100000\n"})
    assert cgroup_cpu_quota(root) == (2.5, "cgroup v2 cpu.max 250000 100000")
    budget = cpu_budget(root=root)
    assert (budget.threads, budget.source) == (2, "cgroup quota")  # 2.5 CPUs: 2 threads, rounded down
    assert "affinity 4 CPUs" in budget.detail and "cpu.max 250000 100000" in budget.detail


def test_cgroup_v2_quota_of_a_parent_counts(tmp_path: Path, cpus: pytest.MonkeyPatch) -> None:
    root = fake_root(tmp_path, "0::/a/b\n", {"sys/fs/cgroup/a/b/cpu.max": "max 100000",
                                              "sys/fs/cgroup/a/cpu.max": "150000 100000",
                                              "sys/fs/cgroup/cpu.max": "300000 100000"})
    assert cpu_budget(root=root).threads == 1  # the smallest on the way up: 1.5 CPUs


def test_cgroup_v2_max_is_no_quota(tmp_path: Path, cpus: pytest.MonkeyPatch) -> None:
    root = fake_root(tmp_path, "0::/\n", {"sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root) is None
    budget = cpu_budget(root=root)
    assert (budget.threads, budget.source) == (4, "affinity")
    assert budget.detail == "affinity 4 CPUs, no cgroup CPU quota"


def test_cgroup_v1_quota_inside_a_container(tmp_path: Path, cpus: pytest.MonkeyPatch) -> None:
    # Without a cgroup namespace the path is the host's; the container's cgroup is the mount itself.
    root = fake_root(tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
                     {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "100000\n",
                      "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(root) == (1.0, "cgroup v1 cpu.cfs_quota_us 100000 / cpu.cfs_period_us 100000")
    budget = cpu_budget(root=root)
    assert (budget.threads, budget.source) == (1, "cgroup quota")


def test_cgroup_v1_minus_one_is_no_quota(tmp_path: Path, cpus: pytest.MonkeyPatch) -> None:
    root = fake_root(tmp_path, "3:cpu:/\n", {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1",
                                             "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(root) is None
    assert cpu_budget(root=root).threads == 4


def test_a_quota_above_the_affinity_leaves_the_affinity(tmp_path: Path, cpus: pytest.MonkeyPatch) -> None:
    root = fake_root(tmp_path, "0::/\n", {"sys/fs/cgroup/cpu.max": "800000 100000"})
    budget = cpu_budget(root=root)
    assert (budget.threads, budget.source) == (4, "affinity")


def test_a_quota_below_one_cpu_still_gives_one_thread(tmp_path: Path, cpus: pytest.MonkeyPatch) -> None:
    root = fake_root(tmp_path, "0::/\n", {"sys/fs/cgroup/cpu.max": "50000 100000"})
    assert cpu_budget(root=root).threads == 1


def test_an_affinity_of_one_cpu_gives_one_thread(tmp_path: Path, cpus: pytest.MonkeyPatch) -> None:
    cpus.setattr(cpu_quota.os, "sched_getaffinity", lambda pid: {3})
    root = fake_root(tmp_path, "0::/\n", {})
    budget = cpu_budget(root=root)
    assert (budget.threads, budget.source) == (1, "affinity")
    assert budget.detail == "affinity 1 CPU, no cgroup CPU quota"
    assert budget.describe() == "1 CPU thread, from the affinity mask (affinity 1 CPU, no cgroup CPU quota)"


def test_no_cgroup_files_is_no_quota(tmp_path: Path, cpus: pytest.MonkeyPatch) -> None:
    assert cgroup_cpu_quota(tmp_path) is None  # no /proc/self/cgroup at all
    assert cpu_budget(root=tmp_path).threads == 4


def test_the_flag_then_omp_num_threads_come_before_the_host(tmp_path: Path, cpus: pytest.MonkeyPatch) -> None:
    root = fake_root(tmp_path, "0::/\n", {"sys/fs/cgroup/cpu.max": "100000 100000"})
    assert cpu_budget(3, root=root) == cpu_quota.CpuBudget(3, "flag", "--cpu-threads 3")
    cpus.setenv("OMP_NUM_THREADS", "2")
    assert cpu_budget(root=root) == cpu_quota.CpuBudget(2, "OMP_NUM_THREADS", "OMP_NUM_THREADS=2")
    assert cpu_budget(3, root=root).source == "flag"


def test_this_machine_is_read_without_error() -> None:
    budget = cpu_budget()
    assert budget.threads >= 1 and budget.source in {"affinity", "cgroup quota", "OMP_NUM_THREADS"}
