"""XLA_FLAGS for the suite's JAX processes: host devices, and a CPU compiler told to spend
less on machine code that these tiny models run for milliseconds.

Compiling dominates the JAX tests' CPU time (a step compiles in seconds and runs in
milliseconds). LLVM at level 0 without its expensive passes, and XLA's older loop emitter
for fusions instead of the fusion emitters, compile a train step in about a third of the CPU
time (measured on this suite's ddp/fsdp step: 5.6 s -> 1.8 s). They change the machine code,
not what it computes nor XLA's buffer assignment: every bitwise comparison in the suite is
between two runs compiled alike, and the memory jobs' argument and temporary bytes were equal
with and without them (``tests/scripts/jax_fsdp_memory.py``). Users' runs keep XLA's defaults.
"""

from __future__ import annotations

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a JAX process of the suite: ``devices`` host devices (None: JAX's own
    count, one) and the fast CPU compile."""
    count = f"--xla_force_host_platform_device_count={devices} " if devices else ""
    return count + FAST_COMPILE
