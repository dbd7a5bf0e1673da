"""fsdp's gather at each use of a parameter, found in ``loss_fn``'s own data flow.

``loss_fn`` is traced to a jaxpr with full-shape params, then evaluated equation by equation.
An equation that consumes a sharded parameter (directly, or through a chain of cheap unary ops
on it: a cast, transpose, reshape, broadcast...) runs inside ``use``, a custom VJP whose:

- forward all-gathers the shard (after a narrowing cast, so a bf16 use gathers bf16), applies
  the chain and the equation, and saves only the shard and the equation's other inputs;
- backward re-gathers from the shard and runs the VJP of chain + equation, routing the
  parameter's cotangent into the strategy's accumulator tap (``accumix.jax.gather``'s table).

Order and liveness come from data dependencies, not from a whole-step rematerialisation:
the forward gather is computed from the equation's other inputs (the layer's activation;
``ordering.after``), so XLA cannot issue every gather at the start of the step; the backward
re-gather is computed from the incoming cotangent, so it runs when that layer's backward does
and CSE cannot merge it with the forward's gather. (``optimization_barrier`` would say the same, but
XLA's CPU pipeline removes barriers before CSE and scheduling.) A re-gather whose backward
needs no parameter value (``x @ w`` with no cotangent for ``x``, a bias's add) is dropped.
A parameter used twice (tied embeddings) is gathered at each use; its cotangents sum.

Per layer: equations at the top level of ``loss_fn`` and inside ``jax.jit``/``closed_call``/
``jax.checkpoint`` calls (inlined; a user's checkpoint around a block is dropped when a sharded
parameter flows into it), and inside a ``lax.scan`` over stacked layers: a stacked leaf that
the scan takes as an ``xs`` (sharded on another axis than the stacking one) is sliced, shard
and accumulator tap alike, and each slice gathered at its uses in the body, per iteration;
the scan's backward adds each iteration's gradient into its accumulator slice
(``accumix.jax.scan_accumulate``; the leaves it did so for are ``call_at_use``'s
``accumulated``).
Not per layer: a parameter that a scan takes as a constant or carry (or sharded on the
stacking axis) is gathered whole before the scan (its other, stacked params still per
iteration; a scan with none is one use, as below); a parameter that a ``while``/``cond`` body
or a ``custom_jvp``/``custom_vjp`` function uses: that whole equation is the "use" (gathered
once for it, the leaf's full copy alive while it runs, and the equation recomputed in the
backward). A parameter that ``loss_fn`` returns is
gathered like the strategy's other leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from accumix.jax.gather import gather_at_use, gather_leading, route
from accumix.jax.ordering import after
from accumix.jax.scan_accumulate import scan_into_accumulators
from accumix.jax.wire import FLOAT32, Wire

# Unary ops carried along with the parameter to its use (gathered first, then applied).
CHAIN = frozenset({"convert_element_type", "transpose", "reshape", "broadcast_in_dim",
                   "squeeze", "expand_dims", "copy", "copy_p", "reduce_precision"})
# Calls whose body is evaluated in line, so that each equation in it is its own use.
INLINE = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "remat2",
                    "checkpoint"})


@dataclass(frozen=True)
class Leaf:
    """One sharded parameter inside the step: its shard, accumulator tap and sharded dim."""

    shard: jax.Array
    tap: jax.Array
    dim: int


@dataclass(frozen=True)
class _Param:
    """A value that is sharded leaf ``index`` of the params after ``chain`` (not yet gathered)."""

    index: int
    chain: tuple[Any, ...] = ()


def call_at_use(fn: Callable[..., Any], params: Any, leaves: dict[int, Leaf], *,
                weight: jax.Array, axis: str, scatter: bool,
                accumulated: set[int] | None = None, wire: Wire = FLOAT32) -> Any:
    """``fn(params)`` with each sharded leaf gathered at each of its uses.

    ``params``: the pytree ``fn`` takes, with ``jax.ShapeDtypeStruct`` (the full leaf's shape)
    at the flat positions named in ``leaves``; every other leaf is a value. ``accumulated``
    (a set, filled here): the leaves whose taps hold their accumulators and whose tap
    cotangent is that accumulator plus their gradient (a scan over stacked layers,
    ``accumix.jax.scan_accumulate``); None: every tap cotangent is a gradient alone.
    """
    flat, tree = jax.tree.flatten(params)
    avals = [x if i in leaves else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
             for i, x in enumerate(flat)]
    closed, out_shape = jax.make_jaxpr(lambda *xs: fn(jax.tree.unflatten(tree, xs)),
                                       return_shape=True)(*avals)
    run = _Run(leaves, weight, axis, scatter, accumulated, wire)
    args = [_Param(i) if i in leaves else x for i, x in enumerate(flat)]
    outs = run.eval(closed.jaxpr, closed.consts, args)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _bind(eqn: Any, values: list[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: tuple[Any, ...] = ()
    if isinstance(params, tuple):  # older jax: (subfuns, params)
        subfuns, params = params
    out = eqn.primitive.bind(*subfuns, *values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _apply_chain(chain: tuple[Any, ...], x: jax.Array) -> jax.Array:
    for eqn in chain:
        x = _bind(eqn, [x])[0]
    return x


class _Run:
    """One evaluation of the traced ``loss_fn``."""

    def __init__(self, leaves: dict[int, Leaf], weight: jax.Array, axis: str,
                 scatter: bool, accumulated: set[int] | None = None,
                 wire: Wire = FLOAT32) -> None:
        self.leaves, self.weight, self.axis, self.scatter = leaves, weight, axis, scatter
        self.wire = wire  # what a reduce-scatter in the backward travels in
        # Where the leaves whose tap cotangent is their accumulator are recorded (the top
        # level's; None inside a scan body, where nothing is accumulated twice).
        self.accumulated = accumulated

    def eval(self, jaxpr: Any, consts: list[Any], args: list[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            if not any(isinstance(x, _Param) for x in ins):
                outs = _bind(eqn, ins)
            elif name in CHAIN and len(ins) == 1:
                outs = [_Param(ins[0].index, (*ins[0].chain, eqn))]
            elif name in INLINE and ("jaxpr" in eqn.params or "call_jaxpr" in eqn.params):
                sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                inner, sub_consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (
                    sub, [])
                outs = self.eval(inner, list(sub_consts), ins)
            elif name == "scan" and self._scannable(eqn, ins):
                outs = self.scan(eqn, ins)
            else:
                outs = self.use(eqn, ins)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [self.materialize(x) if isinstance(x, _Param) else x
                for x in (read(v) for v in jaxpr.outvars)]

    def _sliced(self, eqn: Any, i: int, x: Any) -> bool:
        """Whether input ``i`` of ``eqn`` (a scan) is a stacked leaf scanned over (an ``xs``,
        unsharded on its leading axis): gathered per iteration inside the body."""
        start = eqn.params["num_consts"] + eqn.params["num_carry"]
        return (isinstance(x, _Param) and i >= start and not x.chain
                and self.leaves[x.index].dim > 0)

    def _scannable(self, eqn: Any, ins: list[Any]) -> bool:
        """Whether any param ``eqn`` (a scan) takes is gathered per iteration."""
        return any(self._sliced(eqn, i, x) for i, x in enumerate(ins))

    def scan(self, eqn: Any, ins: list[Any]) -> list[Any]:
        """A scan whose stacked params are sliced (shard and tap) per iteration, and each
        slice gathered at its uses in the body. Its other params (a constant, a carry, an
        ``xs`` sharded on the stacking axis, as a stack of per-layer scalars is) are gathered
        whole before it: the sliced ones stay per iteration (before, one such leaf made the
        whole scan one use, every stacked leaf gathered whole)."""
        ins = [self.materialize(x) if isinstance(x, _Param) and not self._sliced(eqn, i, x)
               else x for i, x in enumerate(ins)]
        params = eqn.params
        nc, ncarry = params["num_consts"], params["num_carry"]
        body = params["jaxpr"]
        consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
        slots = [i for i, x in enumerate(xs) if isinstance(x, _Param)]
        plain = [x for x in xs if not isinstance(x, _Param)]
        stacked = [self.leaves[xs[i].index] for i in slots]

        def step(consts: list[Any], c: list[Any], plain_row: list[Any],
                 shard_rows: list[Any], tap_rows: list[Any]) -> tuple[list[Any], list[Any]]:
            leaves = {k: Leaf(shard, tap, leaf.dim - 1)
                      for k, (shard, tap, leaf) in enumerate(zip(shard_rows, tap_rows, stacked,
                                                                 strict=True))}
            it, args = iter(plain_row), []
            for i in range(len(xs)):
                args.append(_Param(slots.index(i)) if i in slots else next(it))
            inner = _Run(leaves, self.weight, self.axis, self.scatter, wire=self.wire)
            outs = inner.eval(body.jaxpr, list(body.consts), [*consts, *c, *args])
            return outs[:ncarry], outs[ncarry:]

        indices = {xs[i].index for i in slots}
        shards, taps = [leaf.shard for leaf in stacked], [leaf.tap for leaf in stacked]
        if self.accumulated is not None and not indices & self.accumulated:
            # The stacked leaves' taps hold their accumulators: each iteration's gradient
            # is added into its slice inside the scan's backward (once per leaf: a second
            # scan over the same leaf takes JAX's transpose).
            self.accumulated |= indices
            c, ys = scan_into_accumulators(
                step, consts=list(consts), carry=list(carry), plain=plain, shards=shards,
                taps=taps, length=params["length"], reverse=params["reverse"],
                unroll=params["unroll"])
            return [*c, *ys]
        c, ys = jax.lax.scan(lambda c, row: step(consts, c, *row), list(carry),
                             (plain, shards, taps), length=params["length"],
                             reverse=params["reverse"], unroll=params["unroll"])
        return [*c, *ys]

    def materialize(self, ref: _Param) -> jax.Array:
        """The whole gathered leaf (a use this module does not see into)."""
        leaf = self.leaves[ref.index]
        full = gather_at_use(leaf.shard, leaf.tap, self.weight, self.axis, leaf.dim,
                             self.scatter, self.wire)
        return _apply_chain(ref.chain, full)

    def use(self, eqn: Any, ins: list[Any]) -> list[Any]:
        """``eqn`` on gathered params, inside a custom VJP that keeps no gathered copy."""
        slots = [i for i, x in enumerate(ins) if isinstance(x, _Param)]
        refs = [ins[i] for i in slots]
        others = [x for x in ins if not isinstance(x, _Param)]
        leaves = [self.leaves[r.index] for r in refs]
        pres = [_narrowing_casts(r.chain, leaf.shard.dtype)
                for r, leaf in zip(refs, leaves, strict=True)]
        axis = self.axis

        def gather(shards: list[jax.Array]) -> list[jax.Array]:
            return [gather_leading(_apply_chain(r.chain[:n], s), axis, leaf.dim)
                    for s, r, n, leaf in zip(shards, refs, pres, leaves, strict=True)]

        def apply(fulls: list[jax.Array], rest: list[Any]) -> list[Any]:
            vals, it, pit = [], iter(rest), iter(zip(fulls, refs, pres, strict=True))
            for i in range(len(ins)):
                if i in slots:
                    full, r, n = next(pit)
                    vals.append(_apply_chain(r.chain[n:], full))
                else:
                    vals.append(next(it))
            return _bind(eqn, vals)

        @jax.custom_vjp
        def f(shards: list[jax.Array], taps: list[jax.Array], weight: jax.Array,
              rest: list[Any]) -> list[Any]:
            return apply(gather(shards), rest)

        def fwd(shards: list[jax.Array], taps: list[jax.Array], weight: jax.Array,
                rest: list[Any]) -> tuple[list[Any], tuple[Any, ...]]:
            # Gather no earlier than the layer's activation exists.
            return apply(gather(after(shards, rest)), rest), (shards, weight, rest)

        def bwd(res: tuple[Any, ...], g: list[Any]) -> tuple[Any, ...]:
            shards, weight, rest = res
            # Re-gather when this layer's cotangent arrives: not merged with the forward's.
            fulls = gather(after(shards, g))
            _, vjp = jax.vjp(apply, fulls, rest)
            d_fulls, d_rest = vjp(g)
            d_taps = [self._route(d, s, r.chain[:n], leaf, weight)
                      for d, s, r, n, leaf in zip(d_fulls, shards, refs, pres, leaves,
                                                  strict=True)]
            return ([jnp.zeros_like(s) for s in shards], d_taps, jnp.zeros_like(weight),
                    d_rest)

        f.defvjp(fwd, bwd)
        return f([leaf.shard for leaf in leaves], [leaf.tap for leaf in leaves], self.weight,
                 others)

    def _route(self, d: jax.Array, shard: jax.Array, pre: tuple[Any, ...], leaf: Leaf,
               weight: jax.Array) -> jax.Array:
        """A gathered copy's cotangent, as ``gather_at_use``'s backward routes it."""
        if pre:  # back through the casts done before the gather (exact, as autodiff would)
            full = jax.ShapeDtypeStruct(d.shape, shard.dtype)
            d = jax.linear_transpose(lambda x: _apply_chain(pre, x), full)(d)[0]
        return route(d, weight, self.axis, leaf.dim, self.scatter, self.wire)


def _narrowing_casts(chain: tuple[Any, ...], dtype: Any) -> int:
    """How many leading casts of ``chain`` to apply before the gather: those that end in a
    smaller dtype (half the traffic and memory), none otherwise."""
    n = 0
    while n < len(chain) and chain[n].primitive.name == "convert_element_type":
        n += 1
    if n and jnp.dtype(chain[n - 1].params["new_dtype"]).itemsize < jnp.dtype(dtype).itemsize:
        return n
    return 0
