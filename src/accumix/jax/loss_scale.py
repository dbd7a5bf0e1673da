"""fp16 dynamic loss scaling as a pytree: ``ax.DynamicLossScale``'s algorithm, with ``jnp.where``.

The settings (growth, backoff, interval, hysteresis, floor) come from the same
``ax.DynamicLossScale`` object the torch side uses; only the moving parts (``scale``,
``clean_steps``, ``budget``) live on the device, so the update runs inside the jitted step with no
host sync. On each optimizer boundary, with ``found_inf`` taken from the global gradients::

    if found_inf:                       # the window is skipped: params and opt state kept
        clean = 0
        if budget > 1: budget -= 1      # absorbed: the scale is kept
        elif scale <= min_scale: floor_hit = True   # raised as LossScaleError on the host
        else: scale = max(scale * backoff_factor, min_scale)
    else:
        clean += 1
        if clean % growth_interval == 0: scale *= growth_factor; budget = hysteresis

A jitted step cannot raise, so an overflow at the floor sets ``floor_hit`` (sticky; every later
window is skipped too); the accelerator raises ``LossScaleError`` when it next looks (every
``check_every`` steps, at ``save_state``, or on ``acc.check(state)``). jmp's scaler has no
hysteresis and loses its floor across jit (jmp PR #44), hence this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from accumix.errors import LossScaleError
from accumix.precision.loss_scale import DynamicLossScale


@jax.tree_util.register_dataclass
@dataclass
class LossScaleState:
    """The scaler's moving parts: device scalars, replicated on the mesh.

    Attributes:
        scale: the loss scale the next window multiplies its loss by.
        clean_steps: windows since the last overflow (the scale grows every
            ``growth_interval`` of them).
        budget: overflows left to absorb before the scale backs off (``hysteresis``).
        floor_hit: an overflow came at ``min_scale``; ``acc.check`` raises ``LossScaleError``.
    """

    scale: jax.Array
    clean_steps: jax.Array
    budget: jax.Array
    floor_hit: jax.Array


@dataclass(frozen=True)
class LossScaleRule:
    """The static half of the scaler: the settings of an ``ax.DynamicLossScale``, or disabled.

    Args:
        config: the settings; None for fp32/bf16 (scale 1, never skips: the null scaler).
    """

    config: DynamicLossScale | None = None
    enabled: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "enabled", self.config is not None)

    def init(self) -> LossScaleState:
        """The state a run starts from (``init_scale``, no clean steps, a full budget)."""
        cfg = self.config
        return LossScaleState(
            scale=jnp.asarray(cfg.scale if cfg else 1.0, jnp.float32),
            clean_steps=jnp.asarray(cfg.clean_steps if cfg else 0, jnp.int32),
            budget=jnp.asarray(cfg.budget if cfg else 1, jnp.int32),
            floor_hit=jnp.asarray(False),
        )

    def update(self, state: LossScaleState, found_inf: jax.Array) -> LossScaleState:
        """The state after one boundary, as the module docstring states (traceable)."""
        cfg = self.config
        if cfg is None:
            return state
        clean = jnp.where(found_inf, 0, state.clean_steps + 1)
        grow = ~found_inf & (clean % cfg.growth_interval == 0)
        absorbed = found_inf & (state.budget > 1)
        at_floor = found_inf & ~absorbed & (state.scale <= cfg.min_scale)
        backoff = found_inf & ~absorbed & ~at_floor
        backed_off = jnp.maximum(state.scale * cfg.backoff_factor, cfg.min_scale)
        scale = jnp.where(grow, state.scale * cfg.growth_factor,
                          jnp.where(backoff, backed_off, state.scale))
        budget = jnp.where(grow, cfg.hysteresis,
                           jnp.where(absorbed, state.budget - 1, state.budget))
        return LossScaleState(scale=scale.astype(jnp.float32), clean_steps=clean.astype(jnp.int32),
                              budget=budget.astype(jnp.int32),
                              floor_hit=state.floor_hit | at_floor)

    def check(self, state: LossScaleState) -> None:
        """Raises ``LossScaleError`` if an overflow happened at the floor (one host read).

        Raises:
            LossScaleError: the gradients overflowed with the scale at ``min_scale``.
        """
        if self.config is not None and bool(state.floor_hit):
            raise LossScaleError(
                f"fp16 gradients overflowed with the loss scale at its floor "
                f"min_scale={self.config.min_scale}: the model's values exceed fp16's range; "
                "train with precision='bf16-mixed' (or lower the learning rate)"
            )
