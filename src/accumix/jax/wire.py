"""What gradients travel in between devices: the policy's ``reduce_dtype`` around a collective.

Every JAX strategy sums a window's gradients locally in float32 (``trainable.accum_dtype``) and
reduces them once after the scan (``strategies.JaxStrategy.reduce_grads``). A ``Wire`` casts
just before the collective and back just after it:

    send(g)     = (g / D).astype(reduce_dtype)   # each device's share divided by the D devices
                                                 #   first (in float32), as the torch side does:
                                                 #   fp16's range holds the sum where the
                                                 #   values fit
    collective  psum | psum_scatter (| psum over the replica axis: hsdp, still 16-bit)
    receive(g)  = g.astype(float32)
    finish(g)   = g * D                          # once, after every stage

so a 16-bit reduction rounds once per optimizer step whatever K is (the window is summed in
float32 first). Where a mode reduces every micro-step (fsdp's ``sync_each_microstep``, hsdp's
default reduce-scatter inside a node) each micro-step's reduce-scatter rounds; its shards sum
in float32 and the cross-node all-reduce rounds once (``EffectiveDtypes.reductions`` says so).

float32 (the default) is the identity: no division, no cast, the code of before bit for bit.
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
        devices: the devices summed over in all (the pre-division's divisor).
    """

    dtype: str = "float32"
    devices: int = 1

    @property
    def narrow(self) -> bool:
        """Whether gradients are cast for the collective (anything but float32)."""
        return self.dtype != "float32"

    def _applies(self, g: jax.Array) -> bool:
        return self.narrow and bool(jnp.issubdtype(g.dtype, jnp.floating))

    def send(self, g: jax.Array) -> jax.Array:
        """``g`` as it enters the first collective: divided by the devices, then cast."""
        if not self._applies(g):
            return g
        return (g / self.devices).astype(DTYPES[self.dtype])

    def recast(self, g: jax.Array) -> jax.Array:
        """``g``, already divided (a reduce-scattered float32 shard), cast for the next
        collective (hsdp's cross-node all-reduce after its per-micro-step reduce-scatters)."""
        if not self._applies(g):
            return g
        return g.astype(DTYPES[self.dtype])

    def receive(self, g: jax.Array, like: jax.Array) -> jax.Array:
        """A collective's result back in ``like``'s dtype (the float32 accumulator's)."""
        return g.astype(like.dtype) if g.dtype != like.dtype else g

    def finish(self, g: jax.Array) -> jax.Array:
        """The reduced sum at full scale: times the devices the shares were divided by."""
        if not self._applies(g):
            return g
        return g * self.devices


FLOAT32 = Wire()  # the default: gradients travel as they are summed
