"""``acc.gather`` on JAX: every process's host rows, concatenated in process order, exact on
unequal first dimensions (the torch side's rule: ``accumix.common.gather_specs``).

``multihost_utils.process_allgather`` wants the same shape on every process and, without
``jax_enable_x64``, carries 64-bit values as 32-bit. So a gather is two gathers of uint8 arrays,
whatever the pytree: each process's payload length, then each process's payload padded to the
longest, a header (the pytree's structure and the leaves' paths, shapes and dtypes: a mismatch
is one line on every process) followed by the leaves' bytes; the real rows are cut back out
and viewed as their dtype again (``common.gather_specs``, as on the torch side).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from accumix.common.gather_specs import (
    LeafSpec,
    check_specs,
    decode_header,
    encode_header,
    payload_layout,
    rows_of,
)
from accumix.errors import ConfigError


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
    leaves = [a for a in arrays if a is not None]
    if jax.process_count() == 1:
        check_specs([specs], "acc.gather")
        out = [a.reshape(1) if a.ndim == 0 else a.copy() for a in leaves]
    else:
        every, payloads = _exchange(specs, str(treedef), leaves)
        check_specs(every, "acc.gather")
        parts = [_unpack(payload, rank_specs, leaves)
                 for payload, rank_specs in zip(payloads, every, strict=True)]
        out = [np.concatenate([rank_parts[i] for rank_parts in parts])
               for i in range(len(leaves))]
    return jax.tree_util.tree_unflatten(treedef, out)


def _all(payload: np.ndarray) -> np.ndarray:
    """Every process's equal-length uint8 ``payload``, stacked in process order."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(payload), dtype=np.uint8).reshape(
        jax.process_count(), -1)


def _exchange(specs: list[LeafSpec], tree: str, leaves: list[np.ndarray]
              ) -> tuple[list[list[LeafSpec]], list[tuple[int, np.ndarray]]]:
    """Every process's leaves and payload (its header's length, its bytes), through two
    gathers: the payloads' lengths, then the payloads padded to the longest.

    Raises:
        ConfigError: pytrees that differ (on every process alike).
    """
    header = encode_header(specs, tree)
    offsets, size = payload_layout(len(header), [a.nbytes for a in leaves])
    lengths = _all(np.asarray([len(header), size], np.int64).view(np.uint8)).view(np.int64)
    payload = np.zeros(int(lengths[:, 1].max()), np.uint8)
    payload[:len(header)] = np.frombuffer(header, np.uint8)
    for leaf, offset in zip(leaves, offsets, strict=True):
        raw = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8)
        payload[offset:offset + raw.size] = raw
    parts = _all(payload)
    decoded = [decode_header(bytes(part[:h])) for part, h in zip(parts, lengths[:, 0],
                                                                 strict=True)]
    trees = [tree for _, tree in decoded]
    if any(t != trees[0] for t in trees):
        listed = ", ".join(f"rank {r} {t}" for r, t in enumerate(trees))
        raise ConfigError(f"acc.gather got different pytrees on the processes: {listed}; give "
                          "every process the same structure")
    return ([every for every, _ in decoded],
            [(int(h), part) for part, h in zip(parts, lengths[:, 0], strict=True)])


def _unpack(payload: tuple[int, np.ndarray], specs: list[LeafSpec], leaves: list[np.ndarray]
            ) -> list[np.ndarray]:
    """One process's leaves cut from its payload (after ``check_specs``: each leaf's dtype and
    trailing shape are this process's, only the rows differ)."""
    header, part = payload
    rows = [rows_of(spec) for spec in specs]
    row_bytes = [leaf.dtype.itemsize * math.prod(leaf.shape[1:]) for leaf in leaves]
    offsets, _ = payload_layout(header, [n * b for n, b in zip(rows, row_bytes, strict=True)])
    return [part[offset:offset + n * b].view(leaf.dtype).reshape(n, *leaf.shape[1:])
            for leaf, offset, n, b in zip(leaves, offsets, rows, row_bytes, strict=True)]
