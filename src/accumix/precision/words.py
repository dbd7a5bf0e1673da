"""The precision words and the CPU bf16 check: shared by the torch and JAX backends (torch-free)."""

from __future__ import annotations

import os
import platform
from functools import cache

PRECISION_WORDS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "auto")


@cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU executes bf16 matmuls natively (AVX512-BF16, AMX, Arm BF16).

    Without it bf16 autocast is emulated and many times slower than fp32 (pytorch #118499), so
    ``"auto"`` must not pick it. ``ACCUMIX_CPU_BF16=0|1`` overrides the detection.
    """
    forced = os.environ.get("ACCUMIX_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return platform.machine() == "arm64"  # Apple silicon has bf16 (M2 and later)
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
