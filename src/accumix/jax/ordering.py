"""Ordering by data dependency: a value that XLA may compute only once an anchor exists.

XLA's CPU pipeline removes ``optimization_barrier`` before CSE and scheduling, and its
scheduler issues independent work (a gather, a slice copied for a reduce-scatter) as early as
it likes, keeping every such buffer alive at once. ``after(values, anchors)`` returns the values
unchanged, bit for bit, but computed from the anchors: fsdp ties each gather to its layer's
activation or cotangent (``accumix.jax.per_use``) and each relayout for a reduce-scatter to the
previous one (``accumix.jax.strategies``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def after(shards: list[jax.Array], anchors: Any) -> list[jax.Array]:
    """``shards``, unchanged in value, but computed from ``anchors``' largest array.

    A real data dependency, so the gather (or copy) that follows cannot be issued before the
    anchor exists nor merged with another gather of the same shard. The added zero
    is +0 whatever the anchor holds (an infinite or NaN element, as a masked score has, is
    selected away; an integer at its minimum is cast before its abs), ``s - (+0)`` is ``s``
    bit for bit, signed zeros included, and XLA folds neither the product with 0 nor the
    select.
    """
    arrays = [a for a in jax.tree.leaves(anchors) if jnp.size(a) and _numeric(a)]
    if not arrays:
        return shards
    # Cast before abs: an integer's abs overflows at its minimum (abs(int8 -128) is -128),
    # and a negative v would make the zero -0, turning a -0 parameter into +0.
    first = jnp.ravel(max(arrays, key=jnp.size))[0]
    v = jnp.abs(first.astype(jnp.result_type(first, jnp.float32))).astype(jnp.float32)
    zero = jnp.where(v < jnp.inf, v * 0, 0.0)
    return [s - zero.astype(s.dtype) for s in shards]


def _numeric(x: Any) -> bool:
    """A float, complex or integer array (not a bool, not a PRNG key)."""
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    try:
        return bool(jnp.issubdtype(dtype, jnp.number))
    except TypeError:  # an extended dtype (a PRNG key's)
        return False
