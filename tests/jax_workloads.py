"""A tiny JAX workload and its one-device large-batch reference, for accumix.jax's tests.

An MLP on rows with a ragged per-row item mask (tokens): item mode sums the masked errors and
returns their count; the reference trains one device on the whole window at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROWS = 4  # rows per micro-batch of one process


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"hidden": {"w": rng.normal(size=(4, 8)).astype(np.float32) * 0.5,
                       "b": np.zeros((8,), np.float32)},
            "out": {"w": rng.normal(size=(8, 1)).astype(np.float32) * 0.5,
                    "b": np.zeros((1,), np.float32)}}


def micro_batches(count: int, rows: int = ROWS, seed: int = 1, ragged: bool = True
                  ) -> list[dict[str, np.ndarray]]:
    """Micro-batches whose item counts differ a lot (1 to 3 tokens per row, some rows empty)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        tokens = rng.integers(0, 4, size=(rows, 3)) if ragged else np.full((rows, 3), 3)
        mask = (np.arange(3)[None, :] < tokens).astype(np.float32)
        if ragged and i % 2:
            mask[:, 1:] = 0  # every other micro-batch is short: mean-of-means is biased
        out.append({"x": rng.normal(size=(rows, 3, 4)).astype(np.float32),
                    "y": rng.normal(size=(rows, 3)).astype(np.float32), "mask": mask})
    return out


def forward(params, x):
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return (h @ params["out"]["w"] + params["out"]["b"])[..., 0]


def item_loss(params, batch, rng):
    err = (forward(params, batch["x"]) - batch["y"]) ** 2 * batch["mask"]
    return err.sum(), batch["mask"].sum()


def mean_loss(params, batch, rng):
    return jnp.mean((forward(params, batch["x"]) - batch["y"]) ** 2)


def optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)


def concat(batches):
    return jax.tree.map(lambda *xs: np.concatenate(xs), *batches)


def large_batch_loss(params, batch, items: bool):
    if items:
        loss_sum, count = item_loss(params, batch, None)
        return loss_sum / count
    return mean_loss(params, batch, None)


def reference(windows, *, items: bool, params=None, clip_norm=None):
    """One device, one large batch per window: the update accumulation must equal."""
    p = jax.tree.map(jnp.asarray, params or init_params())
    tx = optimizer()
    state = tx.init(p)
    for window in windows:
        grads = jax.grad(large_batch_loss, argnums=0)(p, concat(window), items)
        if clip_norm is not None:
            coef = jnp.minimum(clip_norm / (optax.tree.norm(grads) + 1e-6), 1.0)
            grads = jax.tree.map(lambda g, c=coef: g * c, grads)
        updates, state = tx.update(grads, state, p)
        p = optax.apply_updates(p, updates)
    return p


def mean_of_means(windows, params=None):
    """optax MultiSteps' / Keras' rule: each micro-batch's item mean, averaged over K."""
    p = jax.tree.map(jnp.asarray, params or init_params())
    tx = optimizer()
    state = tx.init(p)
    for window in windows:
        grads = [jax.grad(lambda q, b=b: (lambda s, n: s / n)(*item_loss(q, b, None)))(p)
                 for b in window]
        mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
        updates, state = tx.update(mean, state, p)
        p = optax.apply_updates(p, updates)
    return p


def max_diff(a, b) -> float:
    """The largest absolute difference; NaN when any element differs by NaN (in numpy: XLA's
    CPU max skips NaN, and Python's ``max`` keeps an earlier finite value over a later NaN)."""
    return float(np.max([np.max(np.abs(_host(x) - _host(y)))
                         for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]))


def _host(x) -> np.ndarray:
    """``x`` as float32 numpy; an array spanning other processes' devices is gathered first
    (collective: every process calls ``max_diff`` on the same leaves)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x, np.float32)
