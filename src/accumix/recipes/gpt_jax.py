"""The recipe's byte-level GPT in plain JAX: the same shape, parameter names and layout as
``recipes/gpt.py``, so one ``model.safetensors`` serves both backends.

Plain JAX rather than flax: the params are a nested dict whose dotted paths *are* the torch
``state_dict`` keys (``blocks.0.attn.c_attn.weight``, Linear weights ``[out, in]``), so a file
written by either backend loads into the other without a conversion table, and accumix.jax's
strategies shard them as any pytree. The forward mirrors the torch one op for op (pre-LN
blocks, exact-erf GELU, LayerNorm eps 1e-5, tied output head, float32 loss).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from accumix.recipes.gpt import IGNORE_INDEX, GPTConfig

Params = dict[str, Any]


def init_params(config: GPTConfig, seed: int = 0, *, shapes_only: bool = False) -> Params:
    """GPT-2's init (normal 0.02, residual projections 0.02 / sqrt(2 n_layer)), as numpy;
    ``shapes_only``: the same tree of ``jax.ShapeDtypeStruct`` (nothing drawn or allocated,
    for sizing a model too big to build)."""
    rng = np.random.default_rng(seed)
    c, bias = config.n_embd, config.bias

    def filled(shape: tuple[int, ...], value: float) -> Any:
        if shapes_only:
            return jax.ShapeDtypeStruct(shape, np.float32)
        return np.full(shape, value, np.float32)

    def normal(*shape: int, std: float = 0.02) -> Any:
        if shapes_only:
            return jax.ShapeDtypeStruct(shape, np.float32)
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def linear(out: int, inp: int, std: float = 0.02) -> dict[str, Any]:
        layer = {"weight": normal(out, inp, std=std)}
        if bias:
            layer["bias"] = filled((out,), 0.0)
        return layer

    def norm() -> dict[str, Any]:
        layer = {"weight": filled((c,), 1.0)}
        if bias:
            layer["bias"] = filled((c,), 0.0)
        return layer

    residual = 0.02 / math.sqrt(2 * config.n_layer)
    params: Params = {
        "wte": {"weight": normal(config.vocab_size, c)},
        "wpe": {"weight": normal(config.block_size, c)},
        "blocks": {str(i): {
            "ln_1": norm(),
            "attn": {"c_attn": linear(3 * c, c), "c_proj": linear(c, c, residual)},
            "ln_2": norm(),
            "mlp": {"c_fc": linear(4 * c, c), "c_proj": linear(c, 4 * c, residual)},
        } for i in range(config.n_layer)},
        "ln_f": norm(),
    }
    if not config.tie_weights:
        params["lm_head"] = {"weight": normal(config.vocab_size, c)}
    return params


def _linear(layer: Params, x: jax.Array) -> jax.Array:
    y = x @ layer["weight"].T
    return y + layer["bias"] if "bias" in layer else y


def _layer_norm(layer: Params, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)  # torch's LayerNorm normalises in float32 under autocast too
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    y = ((x32 - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * layer["weight"]
    return y + layer["bias"] if "bias" in layer else y


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def logits(params: Params, idx: jax.Array, config: GPTConfig,
           rng: jax.Array | None = None) -> jax.Array:
    """``logits[B, T, vocab]`` of token ids ``idx[B, T]`` (dropout only when ``rng`` is given)."""
    batch, seq = idx.shape
    heads, width = config.n_head, config.n_embd
    keys = iter(jax.random.split(rng, 1 + 2 * config.n_layer)) if rng is not None else None
    nxt = (lambda: next(keys)) if keys is not None else (lambda: None)  # noqa: E731
    x = params["wte"]["weight"][idx] + params["wpe"]["weight"][:seq]
    x = _dropout(x, config.dropout, nxt())
    for i in range(config.n_layer):
        block = params["blocks"][str(i)]
        q, k, v = jnp.split(_linear(block["attn"]["c_attn"], _layer_norm(block["ln_1"], x)),
                            3, axis=-1)
        q, k, v = (t.reshape(batch, seq, heads, width // heads) for t in (q, k, v))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(batch, seq, width)
        x = x + _dropout(_linear(block["attn"]["c_proj"], y), config.dropout, nxt())
        h = jax.nn.gelu(_linear(block["mlp"]["c_fc"], _layer_norm(block["ln_2"], x)),
                        approximate=False)
        x = x + _dropout(_linear(block["mlp"]["c_proj"], h), config.dropout, nxt())
    head = params["lm_head"]["weight"] if "lm_head" in params else params["wte"]["weight"]
    return _layer_norm(params["ln_f"], x) @ head.T


def loss_sum(params: Params, batch: dict[str, jax.Array], config: GPTConfig,
             rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``(loss_sum, num_items)``: float32 cross-entropy summed over the labelled positions."""
    out = logits(params, batch["input_ids"], config, rng).astype(jnp.float32)
    labels = batch["labels"]
    valid = labels != IGNORE_INDEX
    logp = jax.nn.log_softmax(out, axis=-1)
    picked = jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], -1)[..., 0]
    return -(picked * valid).sum(), valid.sum().astype(jnp.float32)


def to_torch_keys(params: Params, config: GPTConfig) -> dict[str, np.ndarray]:
    """The params as the torch GPT's ``state_dict``: dotted keys, float32, the tied head too."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        flat[".".join(str(getattr(k, "key", k)) for k in path)] = np.asarray(leaf, np.float32)
    if config.tie_weights:
        flat["lm_head.weight"] = flat["wte.weight"]
    return flat


def from_torch_keys(tensors: dict[str, np.ndarray], config: GPTConfig) -> Params:
    """Params from a torch GPT's ``state_dict`` (or ``model.safetensors``) of this shape.

    Raises:
        ValueError: a missing or extra key, or a shape that differs from ``config``'s.
    """
    expected = to_torch_keys(init_params(config), config)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"does not fit this GPT: missing {missing[:4]}, unexpected "
                         f"{extra[:4]}; set model.* to the shape it was trained with")
    for key, value in expected.items():
        if tuple(tensors[key].shape) != value.shape:
            raise ValueError(f"does not fit this GPT: {key} is {tuple(tensors[key].shape)}, "
                             f"this GPT's {value.shape}; set model.* to the shape it was "
                             "trained with")
    params = init_params(config)

    def put(path: tuple[Any, ...], _: Any) -> np.ndarray:
        key = ".".join(str(getattr(k, "key", k)) for k in path)
        return np.asarray(tensors[key], np.float32)

    return jax.tree_util.tree_map_with_path(put, params)


def num_parameters(config: GPTConfig) -> int:
    """Non-embedding parameters, as ``GPT.num_parameters`` counts them: the position table
    out, the token table out unless it is tied to the head."""
    total = sum(int(np.size(x)) for x in jax.tree.leaves(init_params(config)))
    total -= config.block_size * config.n_embd
    if not config.tie_weights:
        total -= config.vocab_size * config.n_embd
    return total


def flops_per_token(config: GPTConfig) -> int:
    """nanoGPT's training FLOPs per token, as ``GPT.flops_per_token`` counts them."""
    return 6 * num_parameters(config) + 12 * config.n_layer * config.n_embd * config.block_size
