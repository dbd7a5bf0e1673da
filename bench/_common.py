"""Helpers shared by the benchmark scripts: medians, the machine's description, tables.

The scripts run as ``python bench/NAME.py``, so this module is imported as ``_common`` (the
script's folder is on ``sys.path``).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import torch


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values (a row that never got timed)."""
    return statistics.median(values) if values else float("nan")


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The 25th and 75th percentiles: the middle half of the values lies between them."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` prints it, else what ``platform`` knows."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_line(extra: str = "") -> str:
    """One line naming the machine, the cores this process may use, torch and the date."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [
        f"CPU {cpu_model()} ({cores} cores usable)",
        f"torch {torch.__version__}",
        f"python {platform.python_version()}",
        datetime.date.today().isoformat(),
    ]
    if extra:
        parts.insert(1, extra)
    return "machine: " + "; ".join(parts)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; cells are ``str()``-ed, pipes escaped."""

    def cell(value: object) -> str:
        return str(value).replace("|", "/").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 3) -> str:
    """A number for a table: ``digits`` significant places, or ``n/a`` when missing."""
    if value is None or value != value:  # None or NaN
        return "n/a"
    return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:,.0f}"


class Clock:
    """Times work on a device: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def bf16_peak_flops(device: torch.device, tiny: bool) -> float:
    """FLOP/s of a large bf16 matmul on this device: the denominator of MFU."""
    n, reps = (256, 3) if tiny or device.type != "cuda" else (8192, 50)
    a, b, c = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(3))

    def products() -> None:
        for _ in range(reps):
            torch.mm(a, b, out=c)

    products()  # warm-up: cuBLAS picks its kernel, the clocks rise
    return 2 * n**3 * reps / Clock(device).time(products)
