"""The precision words as jnp dtypes: the same words and the same ``auto`` rule as the torch side.

* ``fp32``: everything in float32.
* ``bf16-mixed`` / ``fp16-mixed``: float32 master params and optimizer state; the params are cast
  to the compute dtype once per window (outside the scan), so a model on token ids computes in
  half precision; gradients are summed in float32. fp16 adds the loss scale. The batch is passed
  as it comes: casting every floating input would also round masks and item counts (bf16 holds
  integers exactly only up to 256), so a model with float features casts them itself
  (``x.astype(params_leaf.dtype)``), as with jmp or flax's ``dtype=``.
* ``bf16-true``: params and optimizer state stored in bfloat16.
* ``auto``: bf16-mixed on a GPU or TPU; on a CPU bf16-mixed where bf16 is native, else fp32.

``reduce_dtype`` (``Accelerator(reduce_dtype=)``, the torch side's words) is what gradients
travel in between devices: float32 by default under every word.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from accumix.errors import ConfigError
from accumix.precision.reduce_dtype import (
    EffectiveDtypes,
    check_fp16_reduction,
    parse_reduce_dtype,
)
from accumix.precision.words import PRECISION_WORDS, cpu_has_native_bf16

log = logging.getLogger("accumix")


@dataclass(kw_only=True, frozen=True, slots=True)
class JaxPolicy:
    """The dtypes of one precision word (the torch ``Policy``'s fields, as jnp dtypes).

    Attributes:
        name: the precision word (``"bf16-mixed"``, ...).
        param_dtype: the dtype the master params (and optimizer state) are held in.
        compute_dtype: the dtype ``loss_fn`` sees the params in.
        output_dtype: the dtype of the loss and metrics.
        reduce_dtype: what gradients travel in between devices (float32 unless
            ``Accelerator(reduce_dtype=)`` says otherwise).
    """

    name: str
    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32
    # What gradients travel in between devices (``accumix.jax.wire``). float32 under every
    # word, bf16-true included (its window sums in float32 and was always reduced so).
    reduce_dtype: Any = jnp.float32

    @property
    def needs_loss_scaling(self) -> bool:
        """Whether float16 is in play, so the step scales the loss."""
        return jnp.float16 in (self.compute_dtype, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Floating leaves of ``tree`` in the compute dtype (integers kept)."""
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """``tree``'s floating leaves in the parameter dtype."""
        return _cast_floating(tree, self.param_dtype)


_POLICIES = {
    "fp32": JaxPolicy(name="fp32"),
    "bf16-mixed": JaxPolicy(name="bf16-mixed", compute_dtype=jnp.bfloat16),
    "fp16-mixed": JaxPolicy(name="fp16-mixed", compute_dtype=jnp.float16),
    "bf16-true": JaxPolicy(name="bf16-true", param_dtype=jnp.bfloat16,
                           compute_dtype=jnp.bfloat16),
}


def _cast_floating(tree: Any, dtype: Any) -> Any:
    def cast(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x
    return jax.tree.map(cast, tree)


def resolve_jax_policy(precision: str, platform: str) -> JaxPolicy:
    """A precision word as a ``JaxPolicy`` for devices of ``platform`` ("cpu", "gpu", "tpu").

    Raises:
        ConfigError: an unknown word.
    """
    if isinstance(precision, JaxPolicy):
        return precision
    if precision == "auto":
        if platform != "cpu":
            policy, reason = _POLICIES["bf16-mixed"], f"{platform} supports bf16"
        elif cpu_has_native_bf16():
            policy, reason = _POLICIES["bf16-mixed"], "this CPU has native bf16 instructions"
        else:
            policy, reason = _POLICIES["fp32"], "cpu without native bf16: half would be slower"
        log.info("precision='auto' chose %s: %s", policy.name, reason)
        return policy
    if precision not in _POLICIES:
        raise ConfigError(
            f"unknown precision {precision!r}; use one of {', '.join(PRECISION_WORDS)}"
        )
    policy = _POLICIES[precision]
    if platform == "cpu" and (policy.compute_dtype == jnp.float16 or (
            policy.compute_dtype == jnp.bfloat16 and not cpu_has_native_bf16())):
        warnings.warn(
            f"precision={precision!r} on this CPU is emulated and much slower than fp32; "
            "it is meant for testing semantics", stacklevel=3)
    return policy


def with_reduce_dtype(policy: JaxPolicy, reduce_dtype: Any) -> JaxPolicy:
    """``policy`` with the user's ``reduce_dtype`` (``"fp32"``, ``"bf16"``, ``"fp16"``, a dtype,
    or None: float32).

    Raises:
        ConfigError: an unknown value, or fp16 on the wire where no loss scale runs (nothing
            would recover from an overflow: use bf16, the same bytes with float32's range).
    """
    name = parse_reduce_dtype(reduce_dtype)
    if name is None:
        return policy
    check_fp16_reduction(name, loss_scaled=policy.needs_loss_scaling, precision=policy.name)
    return dataclasses.replace(policy, reduce_dtype=jnp.dtype(name))


def effective_dtypes(policy: JaxPolicy, *, reduction: str, reductions: str) -> EffectiveDtypes:
    """The dtypes a JAX run really uses: the window's gradients always sum in float32 (the
    accumulators, ``trainable.accum_dtype``), the optimizer steps the stored params.

    Args:
        reduction: the wire's dtype name, or ``"none"`` on one device.
        reductions: how often gradients cross devices (the strategy's ``reductions()``).
    """
    stored = jnp.dtype(policy.param_dtype).name
    return EffectiveDtypes(params=stored, compute=jnp.dtype(policy.compute_dtype).name,
                           accumulation="float32", reduction=reduction, masters=stored,
                           reductions=reductions)
