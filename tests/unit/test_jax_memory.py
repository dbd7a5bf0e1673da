"""accumix.jax.memory against XLA's ``memory_analysis()``: carried leaves, and the activations
``accumix estimate-memory --backend jax`` takes from the compiled step (conftest's 2 devices)."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import accumix.jax as axj  # noqa: E402
from accumix.jax.memory import estimate_jax_memory  # noqa: E402

WIDTH, K = 512, 4


def carried_params() -> dict:
    """A float matrix, an int32 step-counter array as large as it, and a PRNG key."""
    rng = np.random.default_rng(0)
    return {"w": (rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
            "count": np.zeros(WIDTH * WIDTH, np.int32), "key": jax.random.key(3)}


def carried_loss(p, batch, rng):
    noise = jax.random.normal(p["key"], (WIDTH,)) * 1e-3  # both carried leaves are used
    err = jnp.mean((jnp.tanh(batch["x"] @ p["w"] + noise) - batch["y"]) ** 2)
    return err + 1e-9 * jnp.sum(p["count"]).astype(jnp.float32)


@pytest.mark.parametrize("word", ["ddp", "fsdp"])
def test_carried_leaves_count_once_without_gradients_or_optimizer_state(word) -> None:
    """Before: each int/key element was a float32 param with an Adam state and two float32
    gradient buffers: the model was +64% (ddp) and +32% (fsdp) of the compiled step."""
    acc = axj.Accelerator(strategy=word, precision="fp32", grad_accum_steps=K)
    state = acc.setup(carried_params(), optax.adam(1e-3))
    rng = np.random.default_rng(1)
    window = acc.window([{"x": rng.normal(size=(8, WIDTH)).astype(np.float32),
                          "y": rng.normal(size=(8, WIDTH)).astype(np.float32)}
                         for _ in range(K)])
    stats = acc.train_step(carried_loss).lower(state, window).compile().memory_analysis()
    measured = stats.argument_size_in_bytes + stats.temp_size_in_bytes
    window_bytes = sum(x.nbytes for x in jax.tree.leaves(window.batch))
    model = {e.strategy: e for e in estimate_jax_memory(
        carried_params(), optax.adam(1e-3), num_devices=2, window_bytes=window_bytes)}[word]
    assert abs(model.total_bytes / measured - 1) < 0.10, (model, measured)
    # The optimizer holds Adam's two moments of ``w`` alone (plus its step count).
    assert model.optimizer_bytes == pytest.approx(2 * 4 * WIDTH * WIDTH / (
        2 if word == "fsdp" else 1), abs=64)
