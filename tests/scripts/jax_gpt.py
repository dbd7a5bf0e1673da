"""A flax linen GPT for accumix.jax's memory jobs (issue 30): token and position embeddings,
pre-LN blocks of causal multi-head attention and a GELU MLP, dropout, a final LayerNorm and an
output head tied to the token embedding (``nn.Embed.attend``); ``scan=True`` stacks the blocks
with ``nn.scan`` (the params of every block in one leaf per kind, as MaxText does).

    params = init_params(layers=8)                  # numpy, float32
    loss = make_loss(layers=8)                      # loss_fn(params, batch, rng): mean CE
    batch = micro_batch(rows=8)                     # {"ids": [rows, T], "labels": [rows, T]}
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

VOCAB, D, T, HEADS, DROPOUT = 512, 256, 64, 4, 0.1


class Block(nn.Module):
    """Pre-LN: x + drop(attn(ln(x))), then x + drop(mlp(ln(x)))."""

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=DROPOUT,
                                            deterministic=False)(
            h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32)))
        x = x + nn.Dropout(DROPOUT, deterministic=False)(h)
        h = nn.LayerNorm()(x)
        h = nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(h)))
        return x + nn.Dropout(DROPOUT, deterministic=False)(h), None


class GPT(nn.Module):
    layers: int
    scan: bool = False

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        embed = nn.Embed(VOCAB, D, embedding_init=nn.initializers.normal(0.02))
        pos = self.param("pos", nn.initializers.normal(0.02), (T, D))
        x = nn.Dropout(DROPOUT, deterministic=False)(embed(ids) + pos[: ids.shape[1]])
        if self.scan:
            stack = nn.scan(Block, variable_axes={"params": 0},
                            split_rngs={"params": True, "dropout": True}, length=self.layers)
            x, _ = stack(name="blocks")(x, None)
        else:
            for i in range(self.layers):
                x, _ = Block(name=f"block{i}")(x)
        return embed.attend(nn.LayerNorm()(x))


def init_params(layers: int, scan: bool = False) -> Any:
    """The model's params as numpy float32 (the same draw for a given ``layers``): the shapes
    flax's ``init`` gives (traced, not compiled: compiling the init took ~10 s per model, and
    the memory jobs compile the step only), LayerNorm scales 1, biases 0, every other leaf
    normal(0, 0.02)."""
    ids = jnp.zeros((1, T), jnp.int32)
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    shapes = jax.eval_shape(GPT(layers, scan).init, keys, ids)["params"]
    rng = np.random.default_rng(0)

    def draw(path: Any, leaf: jax.ShapeDtypeStruct) -> np.ndarray:
        name = str(path[-1].key)
        if name in ("scale", "bias"):
            return np.full(leaf.shape, 1.0 if name == "scale" else 0.0, np.float32)
        return (rng.normal(size=leaf.shape) * 0.02).astype(np.float32)
    return jax.tree_util.tree_map_with_path(draw, shapes)


def make_loss(layers: int, scan: bool = False):
    model = GPT(layers, scan)

    def loss_fn(params, batch, rng):
        logits = model.apply({"params": params}, batch["ids"], rngs={"dropout": rng})
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["labels"]).mean()
    return loss_fn


def micro_batch(rows: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(rows, T + 1)).astype(np.int32)
    return {"ids": ids[:, :-1], "labels": ids[:, 1:]}
