"""What a gather across ranks agrees on before it moves a byte: each rank's leaves (their paths,
shapes and dtypes), checked the same way on every rank; backend-free (torch and JAX use it).

A gather concatenates along the first dimension, so only that dimension may differ between
ranks. Sent as they are, unequal tensors are a collective mismatch: gloo aborts the process
(``op.preamble.length <= op.nbytes``, SIGABRT) or, when the sizes happen to fit, returns rows of
zeros. Here every rank first learns every rank's shapes (one small all-gather), then pads to
the longest, gathers and trims; a difference beyond the first dimension, or in dtype or in the
nesting, is one ``ConfigError`` naming each rank's shape, raised on every rank alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from accumix.errors import ConfigError


@dataclass(frozen=True, slots=True)
class LeafSpec:
    """One leaf of a rank's data: where it sits, its shape (None: not an array) and dtype."""

    path: str
    shape: tuple[int, ...] | None
    dtype: str


def flatten(data: Any, is_array: Callable[[Any], bool], path: str = ""
            ) -> list[tuple[str, Any]]:
    """The leaves of ``data`` (nested dicts, lists, tuples and named tuples) with their paths,
    in a fixed order (dict keys in insertion order, as every rank builds them)."""
    if is_array(data):
        return [(path, data)]
    if isinstance(data, dict):
        return [leaf for key, value in data.items()
                for leaf in flatten(value, is_array, f"{path}[{key!r}]")]
    if isinstance(data, (list, tuple)):
        return [leaf for index, value in enumerate(data)
                for leaf in flatten(value, is_array, f"{path}[{index}]")]
    return [(path, data)]


def rebuild(data: Any, leaves: Sequence[Any], is_array: Callable[[Any], bool]) -> Any:
    """``data``'s nesting with its leaves replaced by ``leaves`` (in ``flatten``'s order)."""
    it = iter(leaves)

    def build(node: Any) -> Any:
        if is_array(node):
            return next(it)
        if isinstance(node, dict):
            return type(node)((key, build(value)) for key, value in node.items())
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*(build(value) for value in node))
        if isinstance(node, (list, tuple)):
            return type(node)(build(value) for value in node)
        return next(it)

    return build(data)


def check_specs(every: Sequence[Sequence[LeafSpec]], what: str) -> None:
    """Raises, on every rank alike, unless the ranks' leaves can be concatenated along dim 0.

    Args:
        every: each rank's leaves, in rank order (the same list on every rank).
        what: the call, for the message (``"acc.gather"``).

    Raises:
        ConfigError: a leaf that is not an array, nestings that differ, or a leaf whose shape
            beyond the first dimension, number of dimensions or dtype differs; the one line
            names each rank's value.
    """
    for spec in every[0]:
        if spec.shape is None:
            where = f" at {spec.path}" if spec.path else ""
            raise ConfigError(f"{what} takes tensors (nested in dicts, lists and tuples); got a "
                              f"{spec.dtype}{where}; gather it with an object gather or "
                              "convert it to a tensor")
    paths = [[spec.path for spec in specs] for specs in every]
    if any(p != paths[0] for p in paths):
        listed = ", ".join(f"rank {r} {' '.join(p) or 'a tensor'}" for r, p in enumerate(paths))
        raise ConfigError(f"{what} got different nestings on the ranks: {listed}; give every "
                          "rank the same keys and lengths")
    for index, spec in enumerate(every[0]):
        leaf = [specs[index] for specs in every]
        if any(_tail(s) != _tail(spec) or s.dtype != spec.dtype for s in leaf):
            where = f" at {spec.path}" if spec.path else ""
            listed = ", ".join(f"rank {r} {describe(s)}" for r, s in enumerate(leaf))
            raise ConfigError(f"{what} needs the same shape after the first dimension and the "
                              f"same dtype on every rank{where}: {listed}; only the first "
                              "dimension may differ")


def _tail(spec: LeafSpec) -> tuple[int, ...] | None:
    """The shape beyond the first dimension; None marks a 0-dim leaf (stacked, not concatenated),
    which only matches another 0-dim leaf."""
    assert spec.shape is not None
    return spec.shape[1:] if spec.shape else None


def describe(spec: LeafSpec) -> str:
    """``[2, 3] float32`` (``[]`` for a 0-dim leaf)."""
    return f"{list(spec.shape or ())} {spec.dtype}"


def rows_of(spec: LeafSpec) -> int:
    """The rows a leaf contributes: its first dimension, 1 for a 0-dim leaf (stacked)."""
    assert spec.shape is not None
    return spec.shape[0] if spec.shape else 1
