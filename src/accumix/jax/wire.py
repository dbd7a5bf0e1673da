"""What gradients travel in between devices: the policy's ``reduce_dtype`` around a collective.

Every JAX strategy sums a window's gradients locally in float32 (``trainable.accum_dtype``) and
reduces them once after the scan (``strategies.JaxStrategy.reduce_grads``). A ``Wire`` casts
just before the collective and back just after it:

    send(g)     = g.astype(reduce_dtype)
    collective  psum | psum_scatter (| psum over the replica axis: hsdp, still 16-bit)
    receive(g)  = g.astype(float32)

On a 16-bit wire what is sent is already normalised (``accumix.jax.step``): each micro-step's
gradient joins the float32 accumulator multiplied by its share of the window's mean, ``n_i /
N`` (item mode: its items over the window's items on every device; mean mode ``1 / M``, M
the valid micro-steps over devices), so a device sends its part of ``scale x`` the window's
mean gradient, and the devices' parts sum to it. fp16's range then holds what the mean
gradient's does: before, item mode sent ``scale x`` the gradient of the window's loss *sum*
(tokens per device x K times the mean; issue 38: 6 of 10 windows skipped at scale 65536).
The item-weighted result stays exact: the shares are the weights of the one division by N.

A 16-bit reduction rounds once per optimizer step whatever K is (the window is summed in
float32 first). Where a mode reduces every micro-step (fsdp's ``sync_each_microstep``, hsdp's
default reduce-scatter inside a node) each micro-step's reduce-scatter rounds; its shards sum
in float32 and the cross-node all-reduce rounds once (``EffectiveDtypes.reductions`` says so).

float32 (the default) is the identity: no cast, the code of before bit for bit (its
accumulators keep the window's sums; the step divides once, after the reduction).
Complex leaves travel as they are (a real reduce dtype would drop the imaginary part).

XLA's CPU backend promotes 16-bit all-reduces and reduce-scatters to float32 (its compiled HLO
shows ``convert`` to bf16 and back around an f32 collective whose reduction is ``_promoted``):
each device's operand is rounded to 16 bits, as on the wire, and the sum is taken in float32.
The lowered HLO, what a GPU or TPU compiles, has the 16-bit operands (``tests/unit/
test_jax_hsdp.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass(frozen=True)
class Wire:
    """The dtype gradients are reduced in over ``devices`` devices (hashable: a static
    argument of the custom VJPs that reduce-scatter in the backward).

    Attributes:
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (``precision.reduce_dtype``'s
            names).
        devices: the devices summed over in all (1: nothing travels).
    """

    dtype: str = "float32"
    devices: int = 1

    @property
    def narrow(self) -> bool:
        """Whether gradients are cast for the collective (anything but float32): the step
        then normalises what it accumulates (see the module doc)."""
        return self.dtype != "float32"

    def send(self, g: jax.Array) -> jax.Array:
        """``g`` (normalised, float32) as it enters a collective: cast to the wire's dtype."""
        if not (self.narrow and bool(jnp.issubdtype(g.dtype, jnp.floating))):
            return g
        return g.astype(DTYPES[self.dtype])

    def receive(self, g: jax.Array, like: jax.Array) -> jax.Array:
        """A collective's result back in ``like``'s dtype (the float32 accumulator's)."""
        return g.astype(like.dtype) if g.dtype != like.dtype else g


FLOAT32 = Wire()  # the default: gradients travel as they are summed
