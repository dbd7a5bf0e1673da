"""Per-rank system metrics: process CPU %, resident memory, device memory, GPU use, step time.

Every rank measures its own numbers; they travel to rank 0 as extra columns of the gather the
Trainer already makes at each optimizer step (torch: ``WindowMeter.finish``'s ``all_gather``;
JAX: the host gather at each metrics read), never in a collective of their own, and are logged
as ``system/rank<r>/<name>`` to every logger. Backend-free: the backend hands in how to read its
device's memory and utilisation.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence

# The order of the values in each rank's gathered row.
SYSTEM_NAMES = ("cpu_percent", "rss_mb", "device_mem_mb", "device_peak_mb", "gpu_util",
                "step_time_s")
SYSTEM_WIDTH = len(SYSTEM_NAMES)


def resident_mb() -> float:
    """This process's resident memory now, in MiB (NaN where it cannot be read)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return math.nan


class SystemSampler:
    """Measures this rank's system metrics every ``every`` optimizer steps.

    Args:
        every: sample at steps that are a multiple of this (>= 1).
        device_memory: returns (in use, peak) device memory in MiB, or None on a CPU.
        gpu_util: returns the GPU's utilisation in percent (NVML), or None where unknown.
    """

    def __init__(self, every: int, *,
                 device_memory: Callable[[], tuple[float, float] | None] | None = None,
                 gpu_util: Callable[[], float | None] | None = None) -> None:
        self.every = every
        self.device_memory = device_memory
        self.gpu_util = gpu_util
        self._last_wall = time.perf_counter()
        self._last_cpu = time.process_time()

    def due(self, step: int) -> bool:
        """Whether the window ending at optimizer step ``step`` is sampled (same on all ranks)."""
        return step % self.every == 0

    def sample(self, step_time_s: float) -> list[float]:
        """This rank's values in ``SYSTEM_NAMES`` order (NaN: not measured here).

        ``cpu_percent`` is the process's CPU time over wall time since the last sample (100 per
        busy core); ``step_time_s`` is this rank's own wall time of the window.
        """
        wall, cpu = time.perf_counter(), time.process_time()
        elapsed = wall - self._last_wall
        cpu_percent = 100.0 * (cpu - self._last_cpu) / elapsed if elapsed > 0 else math.nan
        self._last_wall, self._last_cpu = wall, cpu
        memory = self.device_memory() if self.device_memory is not None else None
        in_use, peak = memory if memory is not None else (math.nan, math.nan)
        util = self.gpu_util() if self.gpu_util is not None else None
        return [cpu_percent, resident_mb(), in_use, peak,
                math.nan if util is None else float(util), step_time_s]

    def empty(self) -> list[float]:
        """The row of a window that is not sampled (the gather's width stays fixed)."""
        return [math.nan] * SYSTEM_WIDTH


def system_columns(rows: Sequence[Sequence[float]]) -> dict[str, float]:
    """``{"system/rank<r>/<name>": value}`` from every rank's values (NaN ones left out)."""
    out: dict[str, float] = {}
    for rank, values in enumerate(rows):
        for name, value in zip(SYSTEM_NAMES, values, strict=True):
            if not math.isnan(value):
                out[f"system/rank{rank}/{name}"] = float(value)
    return out
