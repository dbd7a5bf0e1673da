"""The training state: one pytree that the jitted step takes (donated) and returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from accumix.jax.loss_scale import LossScaleState


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    """Everything a step changes, sharded on the mesh by the strategy.

    Attributes:
        params: the parameters, in the policy's storage dtype (float32 unless bf16-true).
        opt_state: the optax optimizer's state.
        loss_scale: the fp16 scaler's state (scale, clean-step count, hysteresis budget).
        step: optimizer steps really taken (a skipped fp16 window does not count).
        rng: a typed PRNG key; each window splits it, each micro-step and device folds in.
    """

    params: Any
    opt_state: Any
    loss_scale: LossScaleState
    step: jax.Array
    rng: jax.Array

    def replace(self, **changes: Any) -> TrainState:
        """A copy with ``changes`` applied (the state is immutable)."""
        return TrainState(**{**self.__dict__, **changes})
