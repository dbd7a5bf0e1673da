"""What ``loss_fn`` returns, read once per compiled step: a mean, an item count, an aux.

    axj.Loss(mean_loss)                               # the same as a bare scalar
    axj.Loss(loss_sum, num_items=n)                   # item-weighted (tokens)
    axj.Loss(value, num_items=..., aux={"acc": a})    # aux: its mean comes back in metrics

Bare forms stay where they cannot be misread: a scalar is the mean loss; ``(loss_sum,
num_items, aux)``; and ``(loss, x)``, whose second entry is an item count only when it is a
scalar that does not depend on the params (an item count never does). An ``x`` computed from
the params (an accuracy) or a container of arrays is aux; a non-scalar ``x`` that does not
depend on the params (a count of shape ``(1,)``, or a constant aux) is refused: return
``axj.Loss`` to say which it is. The decision is made on the traced jaxpr, never on values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from accumix.errors import ConfigError


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Loss:
    """``loss_fn``'s explicit result: nothing about it is inferred from shapes.

    Attributes:
        value: a scalar: the mean loss, or the summed loss when ``num_items`` is given.
        num_items: a scalar item count (tokens) of this micro-batch on this device, or None
            for a mean loss. The step divides the window's summed loss by the summed count.
        aux: any pytree of arrays (or None); its mean over micro-steps and devices comes back
            as ``metrics["aux"]``.
    """

    value: Any
    num_items: Any = None
    aux: Any = None


@dataclass(frozen=True)
class LossForm:
    """How to read one ``loss_fn``'s result: fixed when the step is traced."""

    explicit: bool = False  # an axj.Loss
    items_at: int | None = None  # the tuple index of num_items
    aux_at: int | None = None  # the tuple index of aux
    explicit_items: bool = False  # an axj.Loss with num_items

    @property
    def item_mode(self) -> bool:
        return self.explicit_items if self.explicit else self.items_at is not None

    def split(self, out: Any) -> tuple[Any, Any, Any]:
        """``out`` as ``(loss, num_items or None, aux or None)``."""
        if self.explicit:
            return out.value, out.num_items, out.aux
        if not isinstance(out, (tuple, list)):
            return out, None, None
        items = out[self.items_at] if self.items_at is not None else None
        aux = out[self.aux_at] if self.aux_at is not None else None
        return out[0], items, aux


_FORMS = ("return a scalar mean loss, (loss_sum, num_items), (loss_sum, num_items, aux), or "
          "axj.Loss(value, num_items=..., aux=...)")


def read_form(loss_fn: Callable[..., Any], params: Any, batch: Any, rng: Any) -> LossForm:
    """The form of ``loss_fn(params, batch, rng)``'s result, from its jaxpr (abstract).

    Raises:
        ConfigError: a structure that is none of the forms, a loss or num_items that is not a
            scalar, or a bare ``(loss, x)`` that could be either reading.
    """
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (params, batch))
    closed, out = jax.make_jaxpr(loss_fn, return_shape=True)(*shapes, rng)
    depends = _depends_on_params(closed.jaxpr, len(jax.tree.leaves(params)))
    firsts = _first_leaf_indices(out)
    if isinstance(out, Loss):
        _need_scalar(out.value, "loss")
        if out.num_items is not None:
            _need_scalar(out.num_items, "num_items")
        return LossForm(explicit=True, explicit_items=out.num_items is not None)
    if not isinstance(out, (tuple, list)):
        _need_scalar(out, "loss")
        return LossForm()
    if len(out) not in (2, 3):
        raise ConfigError(f"loss_fn(params, batch, rng) returned a {len(out)}-tuple; {_FORMS}")
    _need_scalar(out[0], "loss")
    second = out[1]
    if len(out) == 3:
        _need_scalar(second, "num_items")
        _need_independent(depends[firsts[1]])
        return LossForm(items_at=1, aux_at=2)
    if not isinstance(second, jax.ShapeDtypeStruct):  # a dict, list... of metrics
        return LossForm(aux_at=1)
    if depends[firsts[1]]:  # computed from the params: a metric, not a count
        return LossForm(aux_at=1)
    if second.shape != ():
        raise ConfigError(
            f"loss_fn returned (loss, x) with x of shape {second.shape} that does not depend on "
            "the params: num_items must be a scalar; return axj.Loss(loss_sum, num_items=n) "
            "or axj.Loss(mean_loss, aux=x) to say which it is")
    return LossForm(items_at=1)


def _need_scalar(leaf: Any, what: str) -> None:
    if not isinstance(leaf, jax.ShapeDtypeStruct) or leaf.shape != ():
        shape = getattr(leaf, "shape", type(leaf).__name__)
        raise ConfigError(f"loss_fn(params, batch, rng) returned a {what} of shape {shape}; "
                          f"it must be a scalar: {_FORMS}")


def _need_independent(depends: bool) -> None:
    if depends:
        raise ConfigError(
            "loss_fn returned (loss_sum, num_items, aux) with a num_items computed from the "
            "params (an item count never is); return axj.Loss(loss_sum, num_items=n, aux=...) "
            "if it really is the count")


def _first_leaf_indices(out: Any) -> list[int]:
    """The flat index of each top-level entry's first leaf (a tuple's entries, in order)."""
    if not isinstance(out, (tuple, list)):
        return [0]
    starts, at = [], 0
    for entry in out:
        starts.append(at)
        at += len(jax.tree.leaves(entry))
    return starts


def _depends_on_params(jaxpr: Any, num_params: int) -> list[bool]:
    """For each output of ``jaxpr``: whether any of its first ``num_params`` inputs reaches it."""
    return _reach(jaxpr, [i < num_params for i in range(len(jaxpr.invars))])


def _reach(jaxpr: Any, inputs: list[bool]) -> list[bool]:
    """Which outputs the marked inputs reach. A call of a jitted or rematerialised function is
    followed inside (a jitted loss_fn is one such call holding both loss and count), and so are
    ``lax.cond`` (every branch) and ``lax.scan``/``while_loop`` (their carries, to a fixed
    point); any other equation is conservative: all its outputs depend on any of its inputs."""
    reached = {id(v) for v, marked in zip(jaxpr.invars, inputs, strict=True) if marked}
    for eqn in jaxpr.eqns:
        ins = [not hasattr(v, "val") and id(v) in reached for v in eqn.invars]
        if not any(ins):
            continue
        outs = _reach_eqn(eqn, ins)
        reached.update(id(v) for v, hit in zip(eqn.outvars, outs, strict=True) if hit)
    return [not hasattr(v, "val") and id(v) in reached for v in jaxpr.outvars]


def _reach_eqn(eqn: Any, ins: list[bool]) -> list[bool]:
    """Which of ``eqn``'s outputs its marked inputs reach."""
    name, params = eqn.primitive.name, eqn.params
    if name == "cond":  # inputs: the branch index, then the branches' operands
        if ins[0]:  # which branch runs depends on the params: so does every output
            return [True] * len(eqn.outvars)
        hits = [_reach(b.jaxpr, ins[1:]) for b in params["branches"]]
        return [any(h) for h in zip(*hits, strict=True)]
    if name == "scan":  # inputs: consts, carry, xs; outputs: carry, ys
        consts, carry = params["num_consts"], params["num_carry"]
        marks = list(ins)
        while True:  # a carry marked in one iteration is an input of the next
            outs = _reach(params["jaxpr"].jaxpr, marks)
            fed = [m or o for m, o in zip(marks[consts:consts + carry], outs[:carry], strict=True)]
            if fed == marks[consts:consts + carry]:
                return outs
            marks[consts:consts + carry] = fed
    if name == "while":  # inputs: cond consts, body consts, carry; outputs: carry
        cond_n, body_n = params["cond_nconsts"], params["body_nconsts"]
        marks = list(ins[cond_n + body_n:])
        while True:
            if any(_reach(params["cond_jaxpr"].jaxpr, ins[:cond_n] + marks)):
                return [True] * len(eqn.outvars)  # the trip count depends on the params
            outs = _reach(params["body_jaxpr"].jaxpr, ins[cond_n:cond_n + body_n] + marks)
            fed = [m or o for m, o in zip(marks, outs, strict=True)]
            if fed == marks:
                return fed
            marks = fed
    inner = _called_jaxpr(eqn)
    return _reach(inner, ins) if inner is not None else [True] * len(eqn.outvars)


def _called_jaxpr(eqn: Any) -> Any:
    """The jaxpr that ``eqn`` calls with its own inputs and outputs (pjit, remat, custom_jvp),
    or None."""
    for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr holds its Jaxpr
        if (hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars)
                and len(inner.outvars) == len(eqn.outvars)):
            return inner
    return None
