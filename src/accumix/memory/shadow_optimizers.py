"""The optimizers' states during a ``micro_batch_size="auto"`` probe (``micro_batch_probe``): an
optimizer with no state yet is copied with ``lr=0`` over the same parameters and stepped, so its
states are allocated and held through the probe while the real optimizer stays untouched.
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

log = logging.getLogger("accumix")


class ShadowOptimizers:
    """A copy of each stateless optimizer with ``lr=0`` over the same parameters, stepped once
    at creation: its states are allocated as the real first step's would be and stay alive
    until ``shadows`` is cleared; ``step()`` again is the window end's temporaries. A copy that
    cannot be built, or whose step refuses zero gradients without the user's closure
    (``LBFGS``) or dense ones (``SparseAdam``), is left out with a warning: the probe then
    misses its states, where raising would stop a run the explicit size trains."""

    def __init__(self, run: RunState) -> None:
        self.shadows: list[torch.optim.Optimizer] = []
        for wrapped in run.optimizers:
            optimizer = run.strategy.state_optimizer(wrapped.optimizer)
            if optimizer.state:
                continue
            groups = [{**g, "lr": 0.0} for g in optimizer.param_groups]
            # Each group carries every hyper-parameter; the constructor gets the defaults it
            # names.
            accepted = inspect.signature(type(optimizer)).parameters
            defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            try:
                shadow = type(optimizer)(groups, **defaults)
                _shadow_step(shadow)
            except torch.OutOfMemoryError:
                raise
            except (TypeError, ValueError, RuntimeError) as exc:
                log.warning("micro_batch_size='auto' cannot step a copy of %s to measure its "
                            "states (%s); they are left out of the probe",
                            type(optimizer).__name__, str(exc).splitlines()[0][:120])
                continue
            self.shadows.append(shadow)

    def step(self) -> None:
        for shadow in self.shadows:
            _shadow_step(shadow)


def _shadow_step(shadow: torch.optim.Optimizer) -> None:
    """``shadow.step()``, a zero gradient made for each parameter without one (at the boundary
    the others hold the window's gradients) and dropped after."""
    made = [p for g in shadow.param_groups for p in g["params"]
            if p.requires_grad and p.grad is None]
    for p in made:
        p.grad = torch.zeros_like(p)
    try:
        shadow.step()
    finally:
        for p in made:
            p.grad = None
