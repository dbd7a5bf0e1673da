"""A scan over stacked layers whose backward adds each iteration's gradient into the
accumulator (fsdp, ``accumix.jax.per_use``): no full-size stack of per-iteration gradients.

JAX's own transpose of a ``lax.scan`` returns the gradient of a stacked ``xs`` leaf as a new
``[L, ...]`` array (the backward loop's stacked outputs), which the micro-step then adds to the
accumulator: for a scanned stack, a second full-size float32 copy of its gradient lives beside
the accumulator (fsdp's default mode held 0.65x of ddp on a scanned Dense stack, 0.42x
unrolled). Here the scan is a custom VJP:

    forward   lax.scan; each iteration's body under jax.vjp, its residuals stacked
              (a residual that is an input of the iteration, a slice of xs or a constant, is
              read from that input again, not stacked twice)
    backward  lax.scan in the other direction; carry = (cotangent of the carry, the constants'
              summed cotangents, the accumulator slices of the stacked leaves). Iteration i
              runs the saved VJP and adds its gradient for the stacked leaves into slice i of
              the accumulator, in place (dynamic_update_slice on the loop's carry)

The accumulator enters as the value of the stacked leaves' taps (``per_use``'s gradient
targets, whose value nothing else reads), and the taps' cotangent that leaves is the
accumulator with this micro-step's scan gradient added: the caller records that these leaves'
cotangents are accumulators, not increments (``accumulated``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def scan_into_accumulators(body: Callable[..., tuple[list[Any], list[Any]]], *,
                           consts: list[Any], carry: list[Any], plain: list[Any],
                           shards: list[jax.Array], taps: list[jax.Array], length: int,
                           reverse: bool, unroll: int | bool) -> tuple[list[Any], list[Any]]:
    """``lax.scan`` of ``body(consts, carry, plain_row, shard_rows, tap_rows) -> (carry,
    ys_row)`` over ``(plain, shards, taps)``; the cotangent of ``taps`` is ``taps`` (their
    value: the accumulators) plus the scan's gradient for them.

    Returns:
        ``(carry, ys)`` as ``lax.scan`` would.
    """
    consts = [x if hasattr(x, "dtype") else jnp.asarray(x) for x in consts]
    const_diff = [_differentiable(x) for x in consts]
    carry_diff = [_differentiable(x) for x in carry]
    plain_diff = [_differentiable(x) for x in plain]
    static: dict[str, Any] = {}

    def saving_step(consts: list[Any], c: list[Any], row: tuple[Any, ...]
                    ) -> tuple[list[Any], Any]:
        """One forward iteration under ``jax.vjp``: its outputs and its stacked residuals."""
        plain_row, shard_rows, tap_rows = row

        def differentiated(dc: list[Any], dcarry: list[Any], dplain: list[Any],
                           dtaps: list[Any]) -> tuple[Any, Any]:
            c_out, ys_row = body(_merge(consts, dc, const_diff), _merge(c, dcarry, carry_diff),
                                 _merge(plain_row, dplain, plain_diff), shard_rows, dtaps)
            static["ys_diff"] = ys_diff = [_differentiable(y) for y in ys_row]
            return ((_pick(c_out, carry_diff, True), _pick(ys_row, ys_diff, True)),
                    (_pick(c_out, carry_diff, False), _pick(ys_row, ys_diff, False)))

        (dc_out, dys), vjp, (ic_out, iys) = jax.vjp(
            differentiated, _pick(consts, const_diff, True), _pick(c, carry_diff, True),
            _pick(plain_row, plain_diff, True), list(tap_rows), has_aux=True)
        leaves, tree = jax.tree.flatten(vjp)
        # Where each residual comes from: an input of this iteration (a constant, a row of
        # xs) is read again in the backward; anything else is stacked.
        sources = (("const", consts), ("plain", plain_row), ("shard", shard_rows))
        kinds, stacked = [], []
        for leaf in leaves:
            kind = next(((name, j) for name, group in sources for j, x in enumerate(group)
                         if leaf is x), None)
            if kind is None:
                kind = ("stack", len(stacked))
                stacked.append(leaf)
            kinds.append(kind)
        static["tree"], static["kinds"] = tree, kinds
        return (_join(dc_out, ic_out, carry_diff),
                (_join(dys, iys, static["ys_diff"]), stacked))

    @jax.custom_vjp
    def run(consts: list[Any], carry: list[Any], plain: list[Any], shards: list[jax.Array],
            taps: list[jax.Array]) -> tuple[list[Any], list[Any]]:
        return jax.lax.scan(lambda c, row: body(consts, c, *row), list(carry),
                            (list(plain), list(shards), list(taps)), length=length,
                            reverse=reverse, unroll=unroll)

    def fwd(consts: list[Any], carry: list[Any], plain: list[Any],
            shards: list[jax.Array], taps: list[jax.Array]) -> tuple[Any, Any]:
        c_out, (ys, stacked) = jax.lax.scan(
            lambda c, row: saving_step(consts, c, row), list(carry),
            (list(plain), list(shards), list(taps)), length=length, reverse=reverse,
            unroll=unroll)
        return (c_out, ys), (stacked, consts, plain, shards, taps)

    def bwd(res: Any, cts: Any) -> tuple[Any, ...]:
        stacked, consts_in, plain, shards, taps = res
        ct_carry, ct_ys = cts
        tree, kinds, ys_diff = static["tree"], static["kinds"], static["ys_diff"]

        def step(state: tuple[Any, ...], row: tuple[Any, ...]) -> tuple[Any, Any]:
            ct_c, ct_consts, acc = state
            i, res_row, plain_row, shard_rows, ct_y = row
            groups = {"stack": res_row, "const": consts_in, "plain": plain_row,
                      "shard": shard_rows}
            vjp = jax.tree.unflatten(tree, [groups[name][j] for name, j in kinds])
            d_consts, d_carry, d_plain, d_taps = vjp((ct_c, ct_y))
            # This iteration's gradient joins its slice of the accumulator, in place.
            acc = [jax.lax.dynamic_update_index_in_dim(
                a, jax.lax.dynamic_index_in_dim(a, i, keepdims=False) + d.astype(a.dtype), i,
                axis=0) for a, d in zip(acc, d_taps, strict=True)]
            ct_consts = [s + d for s, d in zip(ct_consts, d_consts, strict=True)]
            return (list(d_carry), ct_consts, acc), list(d_plain)

        init = (_pick(ct_carry, carry_diff, True),
                [jnp.zeros(jnp.shape(x), jnp.result_type(x))
                 for x in _pick(consts_in, const_diff, True)], list(taps))
        (ct_carry0, ct_consts, acc), ct_plain = jax.lax.scan(
            step, init, (jnp.arange(length), stacked, list(plain), list(shards),
                         _pick(ct_ys, ys_diff, True)), length=length, reverse=not reverse)
        return (_join(ct_consts, None, const_diff), _join(ct_carry0, None, carry_diff),
                _join(ct_plain, None, plain_diff), [None] * len(shards), acc)

    run.defvjp(fwd, bwd)
    c_out, ys = run(consts, list(carry), list(plain), list(shards), list(taps))
    return list(c_out), list(ys)


def _differentiable(x: Any) -> bool:
    """A float or complex array (not a PRNG key): it takes a cotangent."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        dtype = jnp.result_type(x)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _pick(values: Sequence[Any], mask: Sequence[bool], diff: bool) -> list[Any]:
    """The entries of ``values`` whose ``mask`` is ``diff``."""
    return [x for x, m in zip(values, mask, strict=True) if m == diff]


def _merge(values: Sequence[Any], diff: Sequence[Any], mask: Sequence[bool]) -> list[Any]:
    """``values`` with its differentiable entries replaced by ``diff``'s, in order."""
    it = iter(diff)
    return [next(it) if m else x for x, m in zip(values, mask, strict=True)]


def _join(diff: Sequence[Any], other: Sequence[Any] | None, mask: Sequence[bool]) -> list[Any]:
    """``diff`` and ``other`` interleaved back by ``mask`` (None for the others when
    ``other`` is None: a zero cotangent)."""
    d, o = iter(diff), iter(other if other is not None else [])
    return [next(d) if m else (next(o) if other is not None else None) for m in mask]
