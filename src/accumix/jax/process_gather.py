"""``acc.gather`` on JAX: every process's host rows, concatenated in process order, exact on
unequal first dimensions (the torch side's rule: ``accumix.common.gather_specs``).

``multihost_utils.process_allgather`` wants the same shape on every process and, without
``jax_enable_x64``, carries 64-bit values as 32-bit. So every process first learns every
process's leaves (paths, shapes, dtypes: a mismatch is one line on every process), then each
leaf travels as bytes, padded to the longest process's rows, in one gather; the real rows are
cut back out and viewed as their dtype again.
"""

from __future__ import annotations

import json
import math
from typing import Any

import jax
import numpy as np

from accumix.common.gather_specs import LeafSpec, check_specs, rows_of
from accumix.errors import ConfigError

_ALIGN = 16  # every leaf's bytes start at a multiple of this: aligned views as any dtype


def _host(value: Any) -> np.ndarray | None:
    """A leaf as a numpy array (None when it is not numeric data)."""
    if isinstance(value, (np.ndarray, np.generic, jax.Array, int, float, bool, complex)):
        array = np.asarray(value)
        return array if array.dtype.kind in "biufcV" else None
    return None


def gather(data: Any) -> Any:
    """Every process's ``data`` (a pytree of arrays holding this process's rows) concatenated
    along dim 0 in process order (0-dim leaves stacked), as numpy arrays.

    Raises:
        ConfigError: on every process alike, a leaf that is not an array, pytrees that differ,
            or a leaf whose trailing shape or dtype differs between processes.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(data)
    arrays = [_host(value) for _, value in flat]
    specs = [LeafSpec(jax.tree_util.keystr(path), None, type(value).__name__) if array is None
             else LeafSpec(jax.tree_util.keystr(path), array.shape, array.dtype.name)
             for (path, value), array in zip(flat, arrays, strict=True)]
    processes = jax.process_count()
    every = [specs] if processes == 1 else _every_spec(specs, treedef)
    check_specs(every, "acc.gather")
    leaves = [a for a in arrays if a is not None]
    if processes == 1:
        out = [a.reshape(1) if a.ndim == 0 else a.copy() for a in leaves]
    else:
        out = _exchange(leaves, every)
    return jax.tree_util.tree_unflatten(treedef, out)


def _all(payload: np.ndarray) -> np.ndarray:
    """Every process's equal-length uint8 ``payload``, stacked in process order."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(payload), dtype=np.uint8).reshape(
        jax.process_count(), -1)


def _every_spec(specs: list[LeafSpec], treedef: Any) -> list[list[LeafSpec]]:
    """Every process's leaves (and, as its structure, the pytree's), in process order."""
    text = json.dumps({"tree": str(treedef), "leaves": [[s.path, s.shape, s.dtype]
                                                         for s in specs]}).encode()
    lengths = _all(np.asarray([len(text)], np.int64).view(np.uint8)).view(np.int64)[:, 0]
    padded = np.frombuffer(text.ljust(int(lengths.max())), np.uint8)
    decoded = [json.loads(bytes(row[:length]).decode())
               for row, length in zip(_all(padded), lengths, strict=True)]
    trees = [d["tree"] for d in decoded]
    if any(t != trees[0] for t in trees):
        listed = ", ".join(f"rank {r} {t}" for r, t in enumerate(trees))
        raise ConfigError(f"acc.gather got different pytrees on the processes: {listed}; give "
                          "every process the same structure")
    return [[LeafSpec(p, None if s is None else tuple(s), d) for p, s, d in item["leaves"]]
            for item in decoded]


def _exchange(leaves: list[np.ndarray], every: list[list[LeafSpec]]) -> list[np.ndarray]:
    layout, size = [], 0
    for index, leaf in enumerate(leaves):
        row_bytes = leaf.dtype.itemsize * math.prod(leaf.shape[1:])
        layout.append((size, row_bytes))
        size += -(-row_bytes * max(rows_of(specs[index]) for specs in every) // _ALIGN) * _ALIGN
    buffer = np.zeros(max(size, 1), np.uint8)
    for leaf, (offset, _) in zip(leaves, layout, strict=True):
        raw = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8)
        buffer[offset:offset + raw.size] = raw
    parts = _all(buffer)
    out = []
    for index, (leaf, (offset, row_bytes)) in enumerate(zip(leaves, layout, strict=True)):
        pieces = []
        for part, specs in zip(parts, every, strict=True):
            rows = rows_of(specs[index])
            raw = part[offset:offset + rows * row_bytes]
            pieces.append(raw.view(leaf.dtype).reshape(rows, *leaf.shape[1:]))
        out.append(np.concatenate(pieces))
    return out
