"""A fresh ``TrainState`` placed on the mesh (``acc.setup``): the params cast to the policy's
storage dtype and sharded per strategy, the optimizer state built sharded where it rests, the
scaler's state, the step and the PRNG key replicated.

Every process holds the params whole on the host; each takes its own shards of them.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accumix.jax import trainable
from accumix.jax.state import TrainState

if TYPE_CHECKING:
    import optax

    from accumix.jax.loss_scale import LossScaleRule
    from accumix.jax.precision import JaxPolicy
    from accumix.jax.strategies import JaxStrategy


def initial_state(params: Any, optimizer: optax.GradientTransformation, *,
                  strategy: JaxStrategy, policy: JaxPolicy, scaler: LossScaleRule,
                  seed: int) -> TrainState:
    """The ``TrainState`` ``acc.setup(params, optimizer)`` returns, on ``strategy``'s mesh."""
    params = policy.cast_to_param(jax.tree.map(_host_value, params))
    param_sh = jax.tree.map(lambda x: strategy.sharding(strategy.param_spec(x)), params)
    params = jax.tree.map(_global_array, params, param_sh)
    # The optimizer sees the trainable leaves only (integer leaves and keys are carried).
    init = lambda p: optimizer.init(trainable.select(p, p))  # noqa: E731
    opt_shape = jax.eval_shape(init, params)
    opt_sh = jax.tree.map(lambda x: strategy.sharding(strategy.opt_spec(x)), opt_shape)
    opt_state = jax.jit(init, out_shardings=opt_sh)(params)
    replicated = strategy.sharding(P())
    loss_scale, step, rng = jax.jit(
        lambda: (scaler.init(), jax.numpy.zeros((), jax.numpy.int32), jax.random.key(seed)),
        out_shardings=replicated)()
    return TrainState(params=params, opt_state=opt_state, loss_scale=loss_scale, step=step,
                      rng=rng)


def _host_value(leaf: Any) -> Any:
    """A params leaf on the host (numpy); a PRNG key stays a key (numpy cannot hold one)."""
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
        return leaf
    return np.asarray(leaf)


def _global_array(value: Any, sharding: NamedSharding) -> jax.Array:
    """A global array from a value every process holds whole (each takes its shards)."""
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):  # as raw bits, rewrapped
        impl = jax.random.key_impl(value)
        bits = np.asarray(jax.random.key_data(value))
        data = jax.make_array_from_callback(bits.shape, NamedSharding(
            sharding.mesh, P(*sharding.spec, None)), lambda index: bits[index])
        # Rewrapped under jit with the key's own sharding: wrapped outside, a key on a
        # one-device mesh keeps its bits' spec (P(None,) for a scalar key), which the step's
        # shard_map refuses as too long for the key's rank.
        return jax.jit(partial(jax.random.wrap_key_data, impl=impl),
                       out_shardings=sharding)(data)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

