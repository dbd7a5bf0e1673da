"""The memory one rank may use on its device: a GPU's free memory, or its share of the host's
available memory (the container's cgroup limit where lower)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from accumix.errors import ConfigError
from accumix.memory.model import _check_int

if TYPE_CHECKING:
    import torch

def device_free_bytes(device: torch.device | str, *, local_world_size: int = 1) -> int:
    """Free memory one rank may use on ``device``.

    Args:
        device: A CUDA device (its free memory, ``torch.cuda.mem_get_info``) or the CPU (the
            host's available memory shared by the ranks on this host).
        local_world_size: Ranks sharing the host's memory; divides the CPU figure.

    Returns:
        Bytes.

    Raises:
        ConfigError: ``local_world_size < 1`` or a device type other than cuda or cpu.
    """
    _check_int("local_world_size", local_world_size, minimum=1)
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return _host_available_bytes() // local_world_size
    raise ConfigError(f"cannot size memory of device type {device.type!r}; choose cuda or cpu")


def _host_available_bytes() -> int:
    # MemAvailable counts reclaimable page cache; SC_AVPHYS_PAGES (MemFree) does not and reads
    # far too low on a host that has been reading files for a while.
    meminfo = _read_text("/proc/meminfo") or ""
    lines = [line.split() for line in meminfo.splitlines() if line.startswith("MemAvailable:")]
    if lines:
        available = int(lines[0][1]) * 1024
    else:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    # Inside a container /proc/meminfo shows the whole host; the cgroup v2 limit is what kills us.
    limit = _read_text("/sys/fs/cgroup/memory.max")
    current = _read_text("/sys/fs/cgroup/memory.current")
    if limit is None or current is None or not limit.isdigit() or not current.isdigit():
        return available
    return min(available, max(int(limit) - int(current), 0))


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return None
