"""The window step compiled for shapes alone (lowered and compiled, never run, nothing
allocated): XLA's ``memory_analysis()`` per device, and the activations the JAX memory model
takes from it.

``accumix.jax.memory`` counts what it can name (params, optimizer state, accumulators, the
compute copy, gathered leaves, the window); what a model's forward keeps for its backward
depends on the model, so it is read from XLA instead of guessed:

    activations = (arguments + temporaries of a strategy's compiled step) - the model's row

for the recipe's micro-batch rows and K. Where this process has the devices, each strategy's
row is measured on its own step (fsdp's per-use gathers change what the backward keeps: on a
CPU in fp32 the recipe's fsdp step keeps 0.6 MiB more than ddp's for a 0.1M-parameter GPT);
elsewhere the one-device step's figure serves every row.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from accumix.errors import ConfigError
from accumix.jax import trainable
from accumix.jax.data import Window, canonical
from accumix.jax.loss_scale import LossScaleRule
from accumix.jax.memory import (
    JaxMemoryEstimate,
    estimate_jax_memory,
    row_of,
    strategy_of_row,
)
from accumix.jax.precision import resolve_jax_policy
from accumix.jax.state import TrainState
from accumix.jax.step import LossFn, build_step
from accumix.jax.strategies import JaxStrategy, SingleStrategy
from accumix.precision.loss_scale import DynamicLossScale


def compiled_step_stats(loss_fn: LossFn, params: Any, optimizer: Any, micro_batch: Any, *,
                        grad_accum_steps: int, precision: str,
                        clip_norm: float | None = None,
                        strategy: JaxStrategy | None = None) -> Any:
    """``memory_analysis()`` of the window step ``acc.train_step(loss_fn, clip_norm)`` would
    compile, from shapes alone.

    Args:
        loss_fn: as for ``acc.train_step``.
        params: the params pytree (arrays or ``jax.ShapeDtypeStruct``), float32 masters.
        optimizer: an optax transformation.
        micro_batch: one device's micro-batch (arrays or ``jax.ShapeDtypeStruct``, rows first).
        grad_accum_steps: K.
        precision: a precision word (``"auto"`` resolved on this machine's devices).
        clip_norm: as for ``acc.train_step``.
        strategy: where the state lives (default: one device).
    """
    strategy = strategy or SingleStrategy()
    with warnings.catch_warnings():  # emulated half precision on a CPU: fine for compiling
        warnings.simplefilter("ignore")
        policy = resolve_jax_policy(precision, jax.devices()[0].platform)
    scaler = LossScaleRule(DynamicLossScale() if policy.needs_loss_scaling else None)

    def placed(x: Any, spec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=strategy.sharding(spec))

    structs = jax.tree.map(_struct, params)
    stored = jax.eval_shape(policy.cast_to_param, structs)
    abstract = jax.tree.map(lambda x: placed(x, strategy.param_spec(x)), stored)
    opt = jax.eval_shape(lambda p: optimizer.init(trainable.select(p, p)), stored)
    opt = jax.tree.map(lambda x: placed(x, strategy.opt_spec(x)), opt)
    scale, step, rng = jax.eval_shape(lambda: (scaler.init(), jax.numpy.zeros((), np.int32),
                                               jax.random.key(0)))
    state = TrainState(params=abstract, opt_state=opt,
                       loss_scale=jax.tree.map(lambda x: placed(x, P()), scale),
                       step=placed(step, P()), rng=placed(rng, P()))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    devices, k = strategy.num_devices, grad_accum_steps
    rows = jax.tree.map(lambda x: _struct(x), micro_batch)
    batch = jax.tree.map(lambda x: placed(jax.ShapeDtypeStruct(
        (k, x.shape[0] * devices, *x.shape[1:]), x.dtype), strategy.rows_spec(1)), rows)
    window = Window(batch=batch, mask=placed(jax.ShapeDtypeStruct((k,), np.bool_), P()),
                    device_mask=placed(jax.ShapeDtypeStruct((k, devices), np.bool_),
                                       strategy.rows_spec(1)))
    jitted = build_step(loss_fn, optimizer=optimizer, strategy=strategy, policy=policy,
                        scaler=scaler, grad_accum_steps=k, clip_norm=clip_norm,
                        state_shardings=shardings)
    return jitted.lower(state, window).compile().memory_analysis()


def measured_estimate(loss_fn: LossFn, params: Any, optimizer: Any, micro_batch: Any, *,
                      grad_accum_steps: int, precision: str, clip_norm: float | None = None,
                      strategy: JaxStrategy | None = None) -> JaxMemoryEstimate:
    """``strategy``'s row of the JAX memory model with the window and the activations of its
    compiled step (default: one device; see the module doc): arguments + temporaries of that
    step less what ``estimate_jax_memory`` counts for the row, never below 0. Its total is
    the compiled step's bytes (or the model's, where the model counts more)."""
    strategy = strategy or SingleStrategy()
    stats = compiled_step_stats(loss_fn, params, optimizer, micro_batch,
                                grad_accum_steps=grad_accum_steps, precision=precision,
                                clip_norm=clip_norm, strategy=strategy)
    devices = strategy.num_devices
    window = _window_bytes(micro_batch, devices, grad_accum_steps)
    row = row_of(strategy)
    rows = estimate_jax_memory(params, optimizer, num_devices=devices, precision=precision,
                               platform=jax.devices()[0].platform, window_bytes=window,
                               replicas=int(strategy.mesh.shape.get("replica", 1)))
    model = next(e for e in rows if e.strategy == row)
    measured = int(stats.argument_size_in_bytes + stats.temp_size_in_bytes)
    return dataclasses.replace(
        model, other_bytes=model.other_bytes + max(0, measured - model.total_bytes))


def measured_activation_bytes(loss_fn: LossFn, params: Any, optimizer: Any, micro_batch: Any,
                              *, grad_accum_steps: int, precision: str,
                              clip_norm: float | None = None,
                              strategy: JaxStrategy | None = None) -> int:
    """Activations per device from the compiled step of ``strategy`` (``measured_estimate``'s
    activations alone)."""
    strategy = strategy or SingleStrategy()
    sized = measured_estimate(loss_fn, params, optimizer, micro_batch,
                              grad_accum_steps=grad_accum_steps, precision=precision,
                              clip_norm=clip_norm, strategy=strategy)
    devices = strategy.num_devices
    return sized.other_bytes - _window_bytes(micro_batch, devices, grad_accum_steps) // devices


def _window_bytes(micro_batch: Any, devices: int, grad_accum_steps: int) -> int:
    """The whole window's bytes: ``grad_accum_steps`` micro-batches of one device's rows on each
    of ``devices``."""
    return devices * grad_accum_steps * sum(_nbytes(x) for x in jax.tree.leaves(micro_batch))


def sizing(loss_fn: LossFn, params: Any, optimizer: Any, batch: Any, *, grad_accum_steps: int,
           precision: str) -> Callable[[str], JaxMemoryEstimate]:
    """``strategy="auto"``'s sizing of a row (``memory.choose_auto``): ``measured_estimate`` of
    that strategy on every device, for ``batch`` (one micro-batch of this process's rows)
    split over this process's devices.

    Raises:
        ConfigError: a batch leaf whose rows the local devices do not divide.
    """
    local = jax.local_device_count()

    def per_device(x: Any) -> jax.ShapeDtypeStruct:
        shape = tuple(np.shape(x))
        if not shape or shape[0] % local:
            raise ConfigError(f"a batch leaf of shape {shape} cannot be split over this "
                              f"process's {local} devices; pass one micro-batch whose rows "
                              f"{local} divides")
        dtype = x.dtype if isinstance(x, jax.ShapeDtypeStruct) else canonical(x).dtype
        return jax.ShapeDtypeStruct((shape[0] // local, *shape[1:]), dtype)

    micro = jax.tree.map(per_device, batch)
    return lambda row: measured_estimate(loss_fn, params, optimizer, micro,
                                         grad_accum_steps=grad_accum_steps,
                                         precision=precision, strategy=strategy_of_row(row))


def window_steps(batch: Any, global_batch_size: int) -> int:
    """K of the window that micro-batches of ``batch``'s rows (this process's) make of
    ``global_batch_size`` over every process: what ``strategy="auto"`` sizes before
    ``micro_batch_size="auto"`` has chosen (whatever it chooses, a window holds the same rows
    per process)."""
    rows = max(int(np.shape(jax.tree.leaves(batch)[0])[0]), 1)
    return max(1, global_batch_size // (rows * jax.process_count()))


def strategy_for_row(row: str, devices: list[Any]) -> JaxStrategy:
    """The strategy of one of ``JAX_STRATEGIES``' rows on ``devices`` (``single``: the first)."""
    return strategy_of_row(row, devices)


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    """``x``'s shape and the dtype JAX holds it in (float64 as float32 without x64)."""
    dtype = x.dtype
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        dtype = jax.dtypes.canonicalize_dtype(dtype)
    return jax.ShapeDtypeStruct(tuple(x.shape), dtype)


def _nbytes(x: Any) -> int:
    struct = _struct(x)
    return int(np.prod(struct.shape, dtype=np.int64)) * np.dtype(struct.dtype).itemsize
