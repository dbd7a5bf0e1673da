"""Hardware facts shared by both backends: the datasheet peak FLOP/s of known accelerators,
this host's memory.

Backend-free (imports nothing): the torch callbacks and the JAX Accelerator both read it.
"""

from __future__ import annotations

import os

# Dense bf16/fp16 tensor-core peak per GPU (vendor datasheets, no sparsity), for MFU.
_PEAK_FLOPS = (
    ("H200", 989e12), ("H100", 989e12), ("B200", 2250e12), ("A100", 312e12),
    ("L40S", 362e12), ("L4", 121e12), ("A10G", 70e12), ("V100", 125e12),
)


def peak_flops_by_name(name: str) -> float | None:
    """The datasheet bf16 peak FLOP/s of a GPU named ``name`` (e.g. "NVIDIA H200"), or None."""
    return next((peak for key, peak in _PEAK_FLOPS if key in name), None)


def host_memory_bytes() -> int | None:
    """This host's memory: the physical memory, or the container's cgroup limit if lower;
    None where neither can be read."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as file:
            limit = file.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total
