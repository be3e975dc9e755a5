"""What this process's cgroups allow it: the memory still free (`cgroup_free_bytes`) and the CPUs its quota grants
(`cgroup_cpu_limit`). A container or a batch job caps both with cgroups, which psutil and `os.sched_getaffinity` do
not see: psutil reports the machine's RAM, and a CPU quota (Kubernetes' CPU limits, `docker --cpus`) leaves every
host CPU in the affinity set while letting the process use only a fraction of them.

Both read the cgroup files of v2 ("0::PATH" under the mount) or of the v1 controller ("N:memory:PATH" under
MOUNT/memory, "N:cpu,cpuacct:PATH" under MOUNT/cpu) for the process's group and every ancestor, and take the tightest
limit; None where no limit is set or no cgroup is readable.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

PROC_CGROUP, CGROUP_MOUNT = Path("/proc/self/cgroup"), Path("/sys/fs/cgroup")
# The memory files of the two cgroup versions: (limit, usage, the memory.stat key of reclaimable file pages).
_MEMORY_FILES = {2: ("memory.max", "memory.current", "inactive_file"),
                 1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}
_NO_LIMIT = 1 << 62  # cgroup v1 writes "no memory limit" as a huge page-aligned number, v2 as "max"


def _groups(controller: str, proc_cgroup: Path, mount: Path) -> Iterator[tuple[int, Path]]:
    """(cgroup version, folder) of the process's group for `controller` and of each ancestor up to the mount."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            version, root = 2, mount
        elif controller in controllers.split(","):
            version, root = 1, mount / controllers
            if not root.is_dir():  # "cpu,cpuacct" is mounted as cpu,cpuacct or as cpu (a link) by distribution
                root = mount / controller
        else:
            continue
        folder = root / path.lstrip("/")
        if not folder.is_dir():  # a cgroup namespace: the process's own group is the mount's root
            folder = root
        while True:
            yield version, folder
            if folder == root or root not in folder.parents:
                break
            folder = folder.parent


def cgroup_free_bytes(proc_cgroup: Path = PROC_CGROUP, mount: Path = CGROUP_MOUNT) -> int | None:
    """What the memory cgroup of this process still lets it allocate, the tightest of its own group and every
    ancestor that has a limit: limit - usage, with the inactive file pages (page cache the kernel reclaims before
    it kills anything) not counted as used."""
    free = [f for version, folder in _groups("memory", proc_cgroup, mount)
            if (f := _group_free_bytes(folder, *_MEMORY_FILES[version])) is not None]
    return min(free) if free else None


def _group_free_bytes(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit_text = (folder / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
            return None
        usage = int((folder / usage_file).read_text())
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if " " in line)
        inactive = int(stat.get(inactive_key, 0))
    except (OSError, ValueError):
        return None
    return max(0, int(limit_text) - max(0, usage - inactive))


def cgroup_cpu_limit(proc_cgroup: Path = PROC_CGROUP, mount: Path = CGROUP_MOUNT) -> float | None:
    """The CPUs the CPU quota of this process's cgroup grants (quota / period, e.g. 2.5), the tightest of its own
    group and every ancestor that has one."""
    limits = [c for version, folder in _groups("cpu", proc_cgroup, mount)
              if (c := _group_cpu_limit(folder, version)) is not None]
    return min(limits) if limits else None


def _group_cpu_limit(folder: Path, version: int) -> float | None:
    try:
        if version == 2:  # cpu.max: "QUOTA PERIOD" or "max PERIOD"
            quota, period = (folder / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((folder / "cpu.cfs_quota_us").read_text())  # -1: no quota
        return None if quota < 0 else quota / int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
