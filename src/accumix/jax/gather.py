"""fsdp's whole-leaf gather with its gradient routed to the accumulator (``gather_at_use``).

Inside the step's ``shard_map`` each device holds its shard of every parameter. The micro-step
gathers each sharded leaf at each of its uses in ``loss_fn``'s jaxpr (``accumix.jax.per_use``,
which says what is gathered layer by layer and what is not); this module's ``gather_at_use``
is the whole-leaf gather it falls back on (a parameter that ``loss_fn`` returns, the item-count
forward of fp16 item mode) and the identity for a replicated leaf, whose gradient it routes
the same way.

History (measured on XLA CPU, jax 0.10, 8 layers of 512x512, 4 devices): one ``jax.checkpoint``
around the whole micro-step, saving everything but the gathered copies, held 0.58x of ddp's
memory, not the 0.50x asked: the checkpoint recomputes the whole forward at the start of the
backward, XLA's CPU pipeline drops optimization barriers, CSE merges each re-gather with the
forward's, and the scheduler issues independent gathers early. ``per_use`` ties each gather to
its layer's activation (forward) or cotangent (backward) by a real data dependency instead.

The gradient is taken with respect to ``tap``, a zero of the accumulator's shape and dtype
(float32; complex64 for a complex leaf), not the shard: that lets the backward route each
leaf's gradient where the strategy accumulates it (the custom VJP below), whatever the
forward's dtype. Only float and complex leaves pass through here (``accumix.jax.trainable``):

    mode                     tap shape    the gather's backward
    default                  full leaf    acc(g) * weight            (reduce-scatter once a window)
    sync_each_microstep      shard        psum_scatter(acc(g) * weight)         (each micro-step)

``weight`` is the device's own factor for this micro-step: fp16 item mode's item count (by which
its scaled gradient was divided: it must multiply before devices are summed), else 1; and 0 for
a padded micro-step (a window shorter on this process than on another): every device still
runs the backward and its reduce-scatters, and the padded one adds zeros.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from accumix.jax.trainable import accum_dtype


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def gather_at_use(shard: jax.Array, tap: jax.Array, weight: jax.Array, axis: str,
                  dim: int | None, scatter: bool) -> jax.Array:
    """The full leaf from this device's ``shard`` (identity for a replicated leaf).

    Differentiate with respect to ``tap`` (the accumulator's shape and dtype): its cotangent is
    the leaf's gradient, reduce-scattered when ``scatter``.
    """
    del tap, weight
    if dim is None:
        return shard
    return jax.lax.all_gather(shard, axis, axis=dim, tiled=True)


def _gather_fwd(shard: jax.Array, tap: jax.Array, weight: jax.Array, axis: str,
                dim: int | None, scatter: bool) -> tuple[jax.Array, jax.Array]:
    if dim is None:
        return shard, weight
    return jax.lax.all_gather(shard, axis, axis=dim, tiled=True), weight


def _gather_bwd(axis: str, dim: int | None, scatter: bool, weight: jax.Array,
                g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    shape = list(g.shape)
    if dim is not None:
        shape[dim] //= jax.lax.axis_size(axis)
    zero_shard = jnp.zeros(shape, g.dtype)  # the shard is not differentiated: the tap is
    return zero_shard, route(g, weight, axis, dim, scatter), jnp.zeros_like(weight)


def route(g: jax.Array, weight: jax.Array, axis: str, dim: int | None,
          scatter: bool) -> jax.Array:
    """A gathered leaf's cotangent ``g`` as its accumulator tap takes it: in the tap's dtype
    (float32, complex for complex leaves), times ``weight`` (selected away where ``weight`` is
    0: a padded micro-step's gradient, NaN or not, adds nothing), reduce-scattered over
    ``axis`` when ``scatter`` (every device issues it, padded or not)."""
    g = g.astype(accum_dtype(g.dtype))
    g = jnp.where(weight > 0, g * weight, jnp.zeros_like(g))
    if scatter and dim is not None:
        g = jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
    return g


gather_at_use.defvjp(_gather_fwd, _gather_bwd)
