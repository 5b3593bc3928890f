"""The host memory and CPUs a container may really use: /proc/meminfo shows the whole host, so cgroup v1 and
v2 limits and CPU quotas are read too. Every reader takes the filesystem root as an argument, so tests build
/proc and /sys trees in a temporary directory.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 reports "no limit" as a page-aligned huge number; anything above this is no limit.
_CGROUP_V1_UNLIMITED = 1 << 60


def read_meminfo(root: Path) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    values: dict[str, int] = {}
    try:
        text = (root / "proc" / "meminfo").read_text()
    except OSError:
        return values
    for line in text.splitlines():
        match = re.match(r"(\w+):\s+(\d+)\s*(kB)?", line)
        if match:
            values[match.group(1)] = int(match.group(2)) * (1024 if match.group(3) else 1)
    return values


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat(path: Path) -> dict[str, int]:
    values: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                values[parts[0]] = int(parts[1])
    except OSError:
        pass
    return values


def _own_cgroup_paths(root: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) of this process from /proc/self/cgroup."""
    v2_path = v1_path = None
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    return v2_path, v1_path


@dataclass(frozen=True)
class CgroupMemory:
    limit_bytes: int | None
    usage_bytes: int | None  # without reclaimable page cache


def _candidate_dirs(base: Path, own_path: str | None) -> list[Path]:
    # Inside a container the own path is usually "/" (a cgroup namespace); on a host it is the
    # full path. Walk from the own cgroup up to the root: the tightest limit wins.
    dirs = []
    if own_path and own_path != "/":
        current = base / own_path.lstrip("/")
        while True:
            dirs.append(current)
            if current == base:
                break
            current = current.parent
    else:
        dirs.append(base)
    return dirs


def read_cgroup_memory(root: Path) -> CgroupMemory:
    """The memory limit that applies to this process and what its cgroup uses now."""
    v2_path, v1_path = _own_cgroup_paths(root)
    cgroup_root = root / "sys" / "fs" / "cgroup"
    if (cgroup_root / "cgroup.controllers").exists():
        limit = usage = None
        for directory in _candidate_dirs(cgroup_root, v2_path):
            value = _read_int(directory / "memory.max")
            if value is not None and (limit is None or value < limit):
                limit = value
            if usage is None and (directory / "memory.current").exists():
                current = _read_int(directory / "memory.current")
                if current is not None:
                    stat = _read_stat(directory / "memory.stat")
                    usage = max(0, current - stat.get("inactive_file", 0))
        return CgroupMemory(limit, usage)
    memory_root = cgroup_root / "memory"
    if memory_root.is_dir():
        limit = usage = None
        for directory in _candidate_dirs(memory_root, v1_path):
            value = _read_int(directory / "memory.limit_in_bytes")
            if value is not None and value < _CGROUP_V1_UNLIMITED and (limit is None or value < limit):
                limit = value
            if usage is None and (directory / "memory.usage_in_bytes").exists():
                current = _read_int(directory / "memory.usage_in_bytes")
                if current is not None:
                    stat = _read_stat(directory / "memory.stat")
                    usage = max(0, current - stat.get("total_inactive_file", stat.get("inactive_file", 0)))
        return CgroupMemory(limit, usage)
    return CgroupMemory(None, None)


def host_memory(root: Path) -> tuple[int, int, int | None]:
    """(total the container may use, available now, cgroup limit or None)."""
    meminfo = read_meminfo(root)
    total = meminfo.get("MemTotal", 0)
    available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    cgroup = read_cgroup_memory(root)
    if cgroup.limit_bytes is not None:
        total = min(total, cgroup.limit_bytes) if total else cgroup.limit_bytes
        if cgroup.usage_bytes is not None:
            available = (
                min(available, max(0, cgroup.limit_bytes - cgroup.usage_bytes))
                if available
                else max(0, cgroup.limit_bytes - cgroup.usage_bytes)
            )
        else:
            available = min(available, cgroup.limit_bytes) if available else cgroup.limit_bytes
    return total, available, cgroup.limit_bytes


def cpu_quota(root: Path) -> float | None:
    """CPUs allowed by the cgroup CPU quota (v2 cpu.max, v1 cfs_quota/cfs_period), or None."""
    cgroup_root = root / "sys" / "fs" / "cgroup"
    try:
        quota_text = (cgroup_root / "cpu.max").read_text().split()
        if len(quota_text) == 2 and quota_text[0] != "max":
            return int(quota_text[0]) / int(quota_text[1])
        if quota_text:
            return None
    except (OSError, ValueError):
        pass
    for directory in (cgroup_root / "cpu", cgroup_root / "cpu,cpuacct"):
        quota = _read_int(directory / "cpu.cfs_quota_us")
        period = _read_int(directory / "cpu.cfs_period_us")
        if quota is not None and period and quota > 0:
            return quota / period
    return None


def allowed_cpus(root: Path) -> int:
    """CPU cores this process may use: affinity mask, capped by the cgroup quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    quota = cpu_quota(root)
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return count
