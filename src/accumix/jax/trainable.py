"""Which leaves of a params pytree train: floating and complex ones; the rest is carried state.

An integer leaf (a step counter, the ``count`` of a flax nnx ``Rngs`` split with the params) or
a PRNG key has no gradient (``jax.grad`` refuses it) and no optimizer update: the step hands
only the trainable leaves to ``jax.grad`` and to the optimizer (its state is built for them
alone, ``None`` where a leaf is carried) and carries the others through unchanged; checkpoints
save and restore the whole tree.

A carried PRNG key reaches ``loss_fn`` folded with the micro-step's own key (``reseeded``):
``loss_fn`` cannot return the stream it advanced (an nnx ``Dropout`` bumps its ``Rngs``
count inside the trace only), so an unchanged key would draw the same dropout mask on every
micro-step, device and window.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def is_trainable(leaf: Any) -> bool:
    """Floating and complex leaves take gradients; integers, booleans and PRNG keys do not."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def select(tree: Any, like: Any) -> Any:
    """``tree`` (shaped like the params ``like``) with ``None`` at the carried leaves."""
    keep = [is_trainable(x) for x in jax.tree.leaves(like)]
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([x if k else None for x, k in zip(leaves, keep, strict=True)])


def merge(trainable: Any, like: Any) -> Any:
    """The params ``like`` with its trainable leaves replaced by ``trainable``'s."""
    leaves, treedef = jax.tree.flatten(like)
    new = iter(jax.tree.leaves(trainable))
    return treedef.unflatten([next(new) if is_trainable(x) else x for x in leaves])


def reseeded(tree: Any, key: jax.Array) -> Any:
    """``tree`` with each PRNG key leaf folded with bits drawn from ``key`` (the micro-step's
    and device's, so deterministic and resumed with the state); other leaves as they are."""
    def is_key(x: Any) -> bool:
        return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)

    if not any(is_key(x) for x in jax.tree.leaves(tree)):
        return tree
    data = jax.random.bits(key, dtype=jnp.uint32)

    def fold(x: Any) -> Any:
        if not is_key(x):
            return x
        if x.shape == ():
            return jax.random.fold_in(x, data)
        flat = jax.vmap(lambda k: jax.random.fold_in(k, data))(x.reshape(-1))
        return flat.reshape(x.shape)
    return jax.tree.map(fold, tree)


def accum_dtype(dtype: Any) -> Any:
    """The gradient accumulator's dtype: float32 at least, complex for complex params (a float32
    accumulator would drop the imaginary part)."""
    return jnp.result_type(dtype, jnp.float32)
