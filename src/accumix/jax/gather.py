"""fsdp's whole-leaf gather with its gradient routed to the accumulator (``gather_at_use``).

Inside the step's ``shard_map`` each device holds its shard of every parameter. The micro-step
gathers each sharded leaf at each of its uses in ``loss_fn``'s jaxpr (``accumix.jax.per_use``,
which says what is gathered layer by layer and what is not); this module's ``gather_at_use``
is the whole-leaf gather it falls back on (a parameter that ``loss_fn`` returns, the item-count
forward of fp16 item mode) and the identity for a replicated leaf, whose gradient it routes
the same way.

History (measured on XLA CPU, jax 0.10, 8 layers of 512x512, 4 devices): one ``jax.checkpoint``
around the whole micro-step, saving everything but the gathered copies, held 0.58x of ddp's
memory, not the 0.50x asked: the checkpoint recomputes the whole forward at the start of the
backward, XLA's CPU pipeline drops optimization barriers, CSE merges each re-gather with the
forward's, and the scheduler issues independent gathers early. ``per_use`` ties each gather to
its layer's activation (forward) or cotangent (backward) by a real data dependency instead.

The gradient is taken with respect to ``tap``, a zero of the accumulator's shape and dtype
(float32; complex64 for a complex leaf), not the shard: that lets the backward route each
leaf's gradient where the strategy accumulates it (the custom VJP below), whatever the
forward's dtype. Only float and complex leaves pass through here (``accumix.jax.trainable``):

    mode                     tap shape    the gather's backward
    default                  full leaf    acc(g) * weight            (reduce-scatter once a window)
    sync_each_microstep      shard        psum_scatter(acc(g) * weight)         (each micro-step)

The tap's value is the accumulator itself (nothing in the forward reads it): the step takes the
taps' cotangent as the new accumulator (``into_accumulators`` adds the old one; a scan over
stacked layers adds each iteration's gradient into it in place, ``scan_accumulate``).

``weight`` is the device's own factor for this micro-step (``accumix.jax.step``): in fp16 item
mode its micro-batch's item count, by which its scaled gradient was divided; on a 16-bit wire
its share of the window's mean (``accumix.jax.wire``). It must multiply before devices are
summed. A device whose
micro-step is padding still runs this backward (its peers' reduce-scatters need it) with a
zero loss seed: its ``g`` is exactly 0 (``accumix.jax.step``).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from accumix.jax.trainable import accum_dtype
from accumix.jax.wire import FLOAT32, Wire


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def gather_at_use(shard: jax.Array, tap: jax.Array, weight: jax.Array, axis: str,
                  dim: int | None, scatter: bool, wire: Wire = FLOAT32) -> jax.Array:
    """The full leaf from this device's ``shard`` (identity for a replicated leaf).

    Differentiate with respect to ``tap`` (the accumulator's shape and dtype): its cotangent is
    the leaf's gradient, reduce-scattered when ``scatter`` (in ``wire``'s dtype).
    """
    del tap, weight, wire
    if dim is None:
        return shard
    return gather_leading(shard, axis, dim)


def _gather_fwd(shard: jax.Array, tap: jax.Array, weight: jax.Array, axis: str,
                dim: int | None, scatter: bool, wire: Wire) -> tuple[jax.Array, jax.Array]:
    if dim is None:
        return shard, weight
    return gather_leading(shard, axis, dim), weight


def _gather_bwd(axis: str, dim: int | None, scatter: bool, wire: Wire, weight: jax.Array,
                g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    shape = list(g.shape)
    if dim is not None:
        shape[dim] //= jax.lax.axis_size(axis)
    zero_shard = jnp.zeros(shape, g.dtype)  # the shard is not differentiated: the tap is
    return zero_shard, route(g, weight, axis, dim, scatter, wire), jnp.zeros_like(weight)


def gather_leading(shard: jax.Array, axis: str, dim: int) -> jax.Array:
    """``all_gather(shard, axis, dim, tiled)`` gathered on the leading dimension: XLA's CPU
    all-gather wants the gathered dimension outermost and otherwise copies every such shard
    into that layout before the micro-step loop (a copy of those shards alive for the whole
    window); the transpose here is one use's, inside the loop."""
    if dim == 0:
        return jax.lax.all_gather(shard, axis, axis=0, tiled=True)
    moved = jax.lax.all_gather(jnp.moveaxis(shard, dim, 0), axis, axis=0, tiled=True)
    return jnp.moveaxis(moved, 0, dim)


def route(g: jax.Array, weight: jax.Array, axis: str, dim: int | None,
          scatter: bool, wire: Wire = FLOAT32) -> jax.Array:
    """A gathered leaf's cotangent ``g`` as its accumulator tap takes it: in the tap's dtype
    (float32, complex for complex leaves), times ``weight``, reduce-scattered over ``axis``
    when ``scatter``: in ``wire``'s dtype (normalised by ``weight`` there,
    ``accumix.jax.wire``), back in the tap's dtype after."""
    g = g.astype(accum_dtype(g.dtype)) * weight
    if scatter and dim is not None:
        g = wire.receive(jax.lax.psum_scatter(wire.send(g), axis, scatter_dimension=dim,
                                              tiled=True), g)
    return g


@jax.custom_vjp
def into_accumulators(loss: jax.Array, taps: list[jax.Array]) -> jax.Array:
    """``loss``, unchanged; in the backward, each tap's cotangent receives the tap's value.

    The taps hold the accumulators (fsdp): with this, a tap's cotangent is its accumulator
    plus the micro-step's gradient, added where the backward yields it, so the micro-step's
    result is the new accumulator. (A cotangent channel, not a derivative: ``loss`` is the
    objective whose gradient is taken, with a unit seed.)
    """
    del taps
    return loss


def _into_fwd(loss: jax.Array, taps: list[jax.Array]) -> tuple[jax.Array, list[jax.Array]]:
    return loss, taps


def _into_bwd(taps: list[jax.Array], g: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    return g, list(taps)


into_accumulators.defvjp(_into_fwd, _into_bwd)


gather_at_use.defvjp(_gather_fwd, _gather_bwd)
