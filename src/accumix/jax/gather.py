"""fsdp's parameters gathered where the forward uses them, and re-gathered in the backward.

Inside the step's ``shard_map`` each device holds its shard of every parameter. ``loss_fn``
still receives the params pytree, but each sharded leaf in it is the output of
``gather_at_use(shard, tap)``: an all-gather inside the micro-step, whose output is named
``GATHERED`` so that the micro-step, wrapped in ``jax.checkpoint`` with ``remat_policy``, saves
every activation except the gathered copies: the traced backward gathers again instead of
keeping the model gathered from forward to backward (ZeRO-3, as MaxText and FSDP2 do).

Measured limit (XLA CPU, jax 0.10): the CPU compiler drops the checkpoint's optimization
barriers and its CSE merges each re-gather with the forward's identical all-gather, so every
gathered leaf stays alive through the micro-step (``accumix.jax.memory`` counts them). Keeping
them apart (a never-merged random select before each gather) gave 15 all-gathers for 8 layers
but more memory, not less: XLA's scheduler issued the independent gathers early. Only a data
dependency on the layer order (a per-layer scan, as MaxText's) would bound them.

The gradient is taken with respect to ``tap``, a zero of the accumulator's shape and dtype
(float32; complex64 for a complex leaf), not the shard: that lets the backward route each
leaf's gradient where the strategy accumulates it (the custom VJP below), whatever the
forward's dtype. Only float and complex leaves pass through here (``accumix.jax.trainable``):

    mode                     tap shape    the gather's backward
    default                  full leaf    acc(g)                     (reduce-scatter once a window)
    sync_each_microstep      shard        psum_scatter(acc(g) * weight)         (each micro-step)

``weight`` is the device's own factor of fp16 item mode (its micro-batch's item count, by which
its scaled gradient was divided): it must multiply before devices are summed.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from accumix.jax.trainable import accum_dtype

GATHERED = "accumix_gathered"


def remat_policy(prim: Any, *avals: Any, **params: Any) -> bool:
    """``jax.checkpoint``'s policy: save every intermediate except a gathered copy.

    The gather (its custom VJP call, its all-gather and its name) must all be unsaveable:
    saving any one of them keeps the full leaf alive from forward to backward. A complex
    intermediate is recomputed, not saved: jax 0.10's checkpoint rounds each saved residual
    with ``reduce_precision``, which refuses complex dtypes (complex params train, issue 19).
    """
    if prim.name == "name":
        return params.get("name") != GATHERED
    if prim.name == "complex" or any(_is_complex(x) for x in (
            *avals, params.get("new_dtype"), params.get("preferred_element_type"))):
        return False
    return prim.name not in _GATHER_PRIMITIVES


def _is_complex(x: Any) -> bool:
    dtype = getattr(x, "dtype", x)
    try:
        return dtype is not None and bool(jnp.issubdtype(dtype, jnp.complexfloating))
    except TypeError:  # an extended dtype (a PRNG key's)
        return False


_GATHER_PRIMITIVES = frozenset({"all_gather", "custom_vjp_call", "custom_vjp_call_jaxpr"})
REMAT_POLICY = remat_policy


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
    g = g.astype(accum_dtype(g.dtype))  # the tap's dtype: float32, complex for complex leaves
    if scatter and dim is not None:
        g = jax.lax.psum_scatter(g * weight, axis, scatter_dimension=dim, tiled=True)
    elif scatter:  # a replicated leaf: summed over devices after the scan, like the others
        g = g * weight
    return zero_shard, g, jnp.zeros_like(weight)


gather_at_use.defvjp(_gather_fwd, _gather_bwd)


def name_gathered(x: jax.Array) -> jax.Array:
    """Marks a gathered copy as not worth saving for the backward (``REMAT_POLICY``)."""
    return checkpoint_name(x, GATHERED)
