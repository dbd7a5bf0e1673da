"""This run's K: derived from the batch sizes (the settings, else the first loader's), changed by
the user between windows, and recorded with the batch sizes for checkpoints to restore it by.

The arithmetic is backend-free (``batch_sizes.py``); this is the torch Accelerator's use of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accumix.common.batch_sizes import batch_geometry, derive_grad_accum_steps
from accumix.errors import ConfigError

if TYPE_CHECKING:
    from accumix.step.run_state import BatchSizes, RunState


def assign(run: RunState, steps: int) -> None:
    """``acc.grad_accum_steps = steps``: K for the windows that follow."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"grad_accum_steps={steps!r} is invalid; use an integer >= 1")
    if run.window.micro_step:
        raise ConfigError(
            f"grad_accum_steps can change only between windows, not after micro-step "
            f"{run.window.micro_step} of {run.window.grad_accum_steps}"
        )
    run.window.grad_accum_steps = steps
    run.steps_known = True
    run.steps_assigned = True  # an explicit K: load_state keeps it


def geometry(run: RunState) -> dict[str, Any]:
    """K now, K as the settings give it, and what gave it (checkpoints restore K by it)."""
    steps, global_batch, micro = run.batch_sizes
    micro = micro or run.strategy.micro_batch_size or next(
        (w.batch_size for w in run.loaders if w.batch_size), None)
    given = ("grad_accum_steps" if steps is not None else
             "global_batch_size" if global_batch is not None else "none")
    return batch_geometry(steps=run.grad_accum_steps,
                          configured=derive(run, micro) or 1,
                          given=given, micro_batch_size=micro,
                          dp_world_size=run.strategy.dp_world_size)


def derive(run: RunState, micro_batch_size: int | None) -> int | None:
    """K from the settings and ``micro_batch_size``; None while the micro batch is unknown."""
    return derive_from(run.batch_sizes, run.strategy.dp_world_size, micro_batch_size)


def derive_from(batch_sizes: BatchSizes, dp_world_size: int, micro_batch_size: int | None
                ) -> int | None:
    """K from the settings as given (``batch_sizes``) and ``micro_batch_size``."""
    steps, global_batch, _ = batch_sizes
    return derive_grad_accum_steps(
        grad_accum_steps=steps,
        global_batch_size=global_batch,
        micro_batch_size=micro_batch_size,
        dp_world_size=dp_world_size,
    )
