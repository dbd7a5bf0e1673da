"""Which leaves of a params pytree train: floating and complex ones; the rest is carried state.

An integer leaf (a step counter, the ``count`` of a flax nnx ``Rngs`` split with the params) or
a PRNG key has no gradient (``jax.grad`` refuses it) and no optimizer update: the step hands
only the trainable leaves to ``jax.grad`` and to the optimizer (its state is built for them
alone, ``None`` where a leaf is carried) and carries the others through unchanged; checkpoints
save and restore the whole tree.

A carried random stream (a PRNG key beside a ``count``, as a flax nnx ``Rngs`` stream is
split) reaches ``loss_fn`` folded with the micro-step's own key (``reseeded``): ``loss_fn``
cannot return the stream it advanced (an nnx ``Dropout`` bumps its count inside the trace
only), so an unchanged key would draw the same dropout mask on every micro-step, device and
window. Any other key leaf (a fixed random projection's seed) reaches it unchanged.
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
    """``tree`` with each random stream's key folded with bits drawn from ``key`` (the
    micro-step's and device's, so deterministic and resumed with the state).

    A stream is a PRNG key leaf at a path ending in ``key`` whose parent also holds a ``count``
    (a flax nnx ``RngStream``: ``.../key/value`` beside ``.../count/value``); every other leaf,
    other keys included, is returned as it is.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [tuple(_name(k) for k in path) for path, _ in flat]
    streams = {_stream(n, "count") for n in names} - {None}
    reseed = [_stream(n, "key") in streams and _is_key(x)
              for n, (_, x) in zip(names, flat, strict=True)]
    if not any(reseed):
        return tree
    data = jax.random.bits(key, dtype=jnp.uint32)

    def fold(x: jax.Array) -> jax.Array:
        flat_keys = jax.vmap(lambda k: jax.random.fold_in(k, data))(x.reshape(-1))
        return flat_keys.reshape(x.shape)
    return treedef.unflatten([fold(x) if r else x
                              for r, (_, x) in zip(reseed, flat, strict=True)])


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _name(entry: Any) -> str:
    """A path entry's name: a dict key, an attribute, an index."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _stream(names: tuple[str, ...], leaf: str) -> tuple[str, ...] | None:
    """The stream a path belongs to when it names ``leaf`` (``.../leaf`` or
    ``.../leaf/value``), else None."""
    if names and names[-1] == "value":
        names = names[:-1]
    return names[:-1] if names and names[-1] == leaf else None


def accum_dtype(dtype: Any) -> Any:
    """The gradient accumulator's dtype: float32 at least, complex for complex params (a float32
    accumulator would drop the imaginary part)."""
    return jnp.result_type(dtype, jnp.float32)
