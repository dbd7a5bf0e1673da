"""accumix on JAX: the same words and exact semantics on ``jax.distributed`` + jit + a mesh.

    import optax
    import accumix.jax as axj

    acc = axj.Accelerator(strategy="ddp", precision="bf16-mixed", grad_accum_steps=4)
    state = acc.setup(params, optax.adamw(3e-4))
    step = acc.train_step(loss_fn, clip_norm=1.0)   # loss_fn(params, batch, rng)
    state, metrics = step(state, acc.window([mb1, mb2, mb3, mb4]))

The contract is ``shared/JAX.md``; install with ``pip install "accumix[jax]"``.
"""

from __future__ import annotations

from accumix.errors import AccumixError, ConfigError, LossScaleError
from accumix.jax.accelerator import Accelerator, TrainStep
from accumix.jax.checkpoint import CheckpointError
from accumix.jax.data import Window
from accumix.jax.hsdp import HSDPStrategy
from accumix.jax.loss_output import Loss
from accumix.jax.loss_scale import LossScaleState
from accumix.jax.precision import JaxPolicy
from accumix.jax.state import TrainState
from accumix.jax.strategies import (
    DDPStrategy,
    FSDPStrategy,
    JaxStrategy,
    SingleStrategy,
    ZeRO1Strategy,
)
from accumix.precision.loss_scale import DynamicLossScale

__all__ = [
    "AccumixError",
    "Accelerator",
    "CheckpointError",
    "ConfigError",
    "DDPStrategy",
    "DynamicLossScale",
    "FSDPStrategy",
    "HSDPStrategy",
    "JaxPolicy",
    "JaxStrategy",
    "Loss",
    "LossScaleError",
    "LossScaleState",
    "SingleStrategy",
    "TrainState",
    "TrainStep",
    "Window",
    "ZeRO1Strategy",
]
