"""Loss scalers: a dynamic one for fp16, a null one for everything else (one code path)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from accumix.errors import ConfigError, LossScaleError


@dataclass(kw_only=True)
class DynamicLossScale:
    """fp16 dynamic loss scaling with hysteresis and a floor (DeepSpeed's meaning of hysteresis).

    The loss is multiplied by ``scale`` before backward and the gradients divided by it before
    the step. On each optimizer boundary, with ``found_inf`` agreed by all ranks::

        if found_inf:                       # the step is skipped (optimizer and scheduler)
            clean = 0
            if budget > 1: budget -= 1      # absorbed: the scale is kept
            elif scale <= min_scale: raise LossScaleError   # advise bf16
            else: scale = max(scale * backoff_factor, min_scale)
        else:
            clean += 1
            if clean % growth_interval == 0: scale *= growth_factor; budget = hysteresis

    ``budget`` starts at ``hysteresis``. With ``hysteresis=2`` the first overflow of a run is
    absorbed and the second and each later one back off, until ``growth_interval`` clean steps
    refill the budget. ``hysteresis=1`` is ``torch.amp.GradScaler``'s behaviour.

    Args:
        init_scale: the first scale.
        growth_factor: multiplier after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiplier on an overflow that is not absorbed (in (0, 1)).
        growth_interval: clean steps between growths (>= 1).
        hysteresis: overflows absorbed before backing off, counting the one that backs off (>= 1).
        min_scale: the floor; an overflow at the floor raises ``LossScaleError``.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    scale: float = field(init=False)
    clean_steps: int = field(init=False, default=0)
    budget: int = field(init=False)

    enabled = True

    def __post_init__(self) -> None:
        checks = {
            "init_scale": self.init_scale > 0 and math.isfinite(self.init_scale),
            "growth_factor": self.growth_factor > 1,
            "backoff_factor": 0 < self.backoff_factor < 1,
            "growth_interval": isinstance(self.growth_interval, int) and self.growth_interval >= 1,
            "hysteresis": isinstance(self.hysteresis, int) and self.hysteresis >= 1,
            "min_scale": 0 < self.min_scale <= self.init_scale,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(
                    f"DynamicLossScale({name}={getattr(self, name)!r}) is invalid; need "
                    "init_scale>0, growth_factor>1, 0<backoff_factor<1, growth_interval>=1, "
                    "hysteresis>=1, 0<min_scale<=init_scale"
                )
        self.scale = float(self.init_scale)
        self.budget = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Moves the scale after one optimizer boundary (``found_inf``: the gradients, agreed
        across ranks, held an inf or NaN), as the class docstring states.

        Raises:
            LossScaleError: an overflow while the scale is already at ``min_scale``.
        """
        if found_inf:
            self.clean_steps = 0
            if self.budget > 1:
                self.budget -= 1
            elif self.scale <= self.min_scale:
                raise LossScaleError(
                    f"fp16 gradients overflowed with the loss scale at its floor "
                    f"min_scale={self.min_scale}: the model's values exceed fp16's range; "
                    "train with precision='bf16-mixed' (or lower the learning rate)"
                )
            else:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
                self.budget = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        """The scale, the clean steps since the last overflow and the hysteresis budget: what
        a checkpoint stores to resume the same scale trace."""
        return {"scale": self.scale, "clean_steps": self.clean_steps, "budget": self.budget}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``state``, what ``state_dict`` returned."""
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.budget = int(state["budget"])


class NoLossScale:
    """The null scaler of fp32 and bf16: scale 1, never overflows, nothing to update.

    Keeps one code path in the step, as nanoGPT does with ``GradScaler(enabled=False)``.
    """

    enabled = False
    scale = 1.0

    def update(self, found_inf: bool) -> None:
        """Nothing to move: the scale stays 1."""

    def state_dict(self) -> dict[str, Any]:
        """Empty: nothing to save."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


LossScaler = DynamicLossScale | NoLossScale


def check_loss_scale_use(loss_scale: Any, *, precision: str, chosen: str, scales: bool) -> None:
    """Validates ``loss_scale=`` against the precision that was resolved (both backends).

    Args:
        loss_scale: the user's argument (None, or a ``DynamicLossScale``).
        precision: the user's precision word.
        chosen: the resolved policy's name.
        scales: whether the resolved policy scales the loss (fp16).

    Raises:
        ConfigError: not a ``DynamicLossScale``, or given with a precision word that never
            scales. Under ``precision="auto"`` an unused one is said once in the log instead
            (the same script may resolve to fp16 on another machine).
    """
    if loss_scale is None:
        return
    if not isinstance(loss_scale, DynamicLossScale):
        raise ConfigError(
            f"loss_scale={loss_scale!r} is invalid; use ax.DynamicLossScale(...) or None")
    if scales:
        return
    if precision != "auto":
        raise ConfigError(f"loss_scale is only used by precision='fp16-mixed', not {chosen!r}")
    logging.getLogger("accumix").warning(
        "loss_scale=%r is unused: precision='auto' chose %r, which does not scale the loss "
        "(only 'fp16-mixed' does)", loss_scale, chosen)
