"""This run's K: derived from the batch sizes (the settings, else the first loader's), changed by
the user between windows, and recorded with the batch sizes for checkpoints to restore it by.

The arithmetic is backend-free (``batch_sizes.py``); this is the torch Accelerator's use of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accumix.common.batch_sizes import batch_geometry, derive_grad_accum_steps
from accumix.errors import ConfigError

if TYPE_CHECKING:
    from accumix.accelerator import Accelerator


def assign(acc: Accelerator, steps: int) -> None:
    """``acc.grad_accum_steps = steps``: K for the windows that follow."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"grad_accum_steps={steps!r} is invalid; use an integer >= 1")
    if acc._window.micro_step:
        raise ConfigError(
            f"grad_accum_steps can change only between windows, not after micro-step "
            f"{acc._window.micro_step} of {acc._window.grad_accum_steps}"
        )
    acc._window.grad_accum_steps = steps
    acc._steps_known = True
    acc._steps_assigned = True  # an explicit K: load_state keeps it


def geometry(acc: Accelerator) -> dict[str, Any]:
    """K now, K as the settings give it, and what gave it (checkpoints restore K by it)."""
    steps, global_batch, micro = acc._batch_sizes
    micro = micro or acc.strategy.micro_batch_size or next(
        (w.batch_size for w in acc._loaders if w.batch_size), None)
    given = ("grad_accum_steps" if steps is not None else
             "global_batch_size" if global_batch is not None else "none")
    return batch_geometry(steps=acc.grad_accum_steps,
                          configured=derive(acc, micro) or 1,
                          given=given, micro_batch_size=micro,
                          dp_world_size=acc.strategy.dp_world_size)


def derive(acc: Accelerator, micro_batch_size: int | None) -> int | None:
    """K from the settings and ``micro_batch_size``; None while the micro batch is unknown."""
    steps, global_batch, _ = acc._batch_sizes
    return derive_grad_accum_steps(
        grad_accum_steps=steps,
        global_batch_size=global_batch,
        micro_batch_size=micro_batch_size,
        dp_world_size=acc.strategy.dp_world_size,
    )
