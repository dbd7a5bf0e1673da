"""The facts of a run that trackers keep as parameters: backend, strategy and precision as
resolved, the effective dtypes (params, compute, gradient accumulation, reduction, optimizer
masters), world size, batch geometry (micro-batch, K, global batch) and versions."""

from __future__ import annotations

import platform
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accumix.trainer.trainer import Trainer


def _version(module: str) -> str | None:
    loaded = sys.modules.get(module)
    return getattr(loaded, "__version__", None) if loaded is not None else None


def batch_geometry(trainer: Trainer) -> dict[str, Any]:
    """The micro-batch, K and global batch in force now (K may change between windows)."""
    acc, steps = trainer.accelerator, trainer.steps
    data_parallel = getattr(acc.strategy, "dp_world_size", acc.world_size)
    micro = getattr(steps, "micro_batch_size", None)
    k = steps.grad_accum_steps
    return {"micro_batch_size": micro, "grad_accum_steps": k,
            "global_batch_size": micro * k * data_parallel if micro is not None else None}


def run_facts(trainer: Trainer) -> dict[str, Any]:
    """What the run resolved to, read from the Trainer's Accelerator and steps object.

    The global batch is micro-batch x K x the data-parallel ranks (processes on JAX): the
    samples of one optimizer step over the whole job.
    """
    import accumix

    acc, steps = trainer.accelerator, trainer.steps
    facts: dict[str, Any] = {
        "backend": getattr(steps, "backend", "torch"),
        "strategy": acc.strategy.name,
        "precision": acc.policy.name,
        "world_size": acc.world_size,
        **batch_geometry(trainer),
        # The dtypes the strategy really runs (dtype_params, dtype_reduction, ...); a backend
        # without the statement yet contributes none.
        **(dtypes.as_params() if (dtypes := getattr(acc, "effective_dtypes", None)) else {}),
        "accumix_version": accumix.__version__,
        "python_version": platform.python_version(),
    }
    for module in ("torch", "jax", "jaxlib", "deepspeed"):
        version = _version(module)
        if version is not None:
            facts[f"{module}_version"] = version
    return facts
