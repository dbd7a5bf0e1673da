"""Checkpoint values as plain Python: what ``torch.load(weights_only=True)`` reads back.

A learning rate computed with numpy (``lr = base * np.sqrt(bs / 256)``) is a ``np.float64``:
pickled as a numpy scalar, which ``weights_only`` loading refuses, so a checkpoint holding one
in a param group (or in a scheduler's ``base_lrs``) was written and could never be loaded.
Numpy scalars are stored as the Python numbers they equal (bit for bit: a ``float64`` is a
Python float), except ``float32`` and ``float16`` ones: a scheduler multiplies them in their own
precision (``lr * gamma``), so as Python floats a resumed schedule drifted from the
uninterrupted one; they are kept and read back under ``numpy_floats()``. Any other object a
safe load cannot rebuild is refused before anything is written, naming where it sits.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import numpy as np
import torch

from accumix.errors import ConfigError

_KEPT = (np.float32, np.float16)  # their arithmetic is not a Python float's
_ATOMS = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def plain(obj: Any, where: str) -> Any:
    """``obj`` with numpy scalars as Python numbers (containers copied only where one was).

    Args:
        obj: a state dict or any part of one (tensors are left as they are).
        where: how to name ``obj`` in an error (``"optimizer 0's param_groups"``).

    Raises:
        ConfigError: a value (named by its keys under ``where``) that a ``weights_only`` load
            cannot rebuild.
    """
    if isinstance(obj, torch.Tensor) or type(obj) in _ATOMS:
        return obj
    if type(obj) in _KEPT:
        return obj
    if isinstance(obj, np.generic) and obj.shape == ():
        return obj.item()
    if isinstance(obj, dict):
        items = {k: plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
        if all(items[k] is obj[k] for k in obj):
            return obj
        new = copy.copy(obj)  # keeps the mapping's type (a MultiStepLR's Counter)
        new.update(items)
        return new
    if type(obj) in (list, tuple):
        values = [plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        if all(a is b for a, b in zip(values, obj, strict=True)):
            return obj
        return type(obj)(values)
    _check_loads(obj, where)
    return obj


def numpy_floats() -> Any:
    """The context a ``weights_only`` load reads ``float32``/``float16`` numpy scalars in
    (numpy's scalar constructor and those two dtypes only)."""
    try:  # numpy >= 2 moved it; pyproject allows numpy 1.x too
        from numpy._core.multiarray import scalar
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import scalar

    return torch.serialization.safe_globals(
        [scalar, np.dtype, np.dtypes.Float32DType, np.dtypes.Float16DType])


def _check_loads(obj: Any, where: str) -> None:
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        with numpy_floats():
            torch.load(buffer, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - pickling errors, refused globals
        raise ConfigError(
            f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a checkpoint "
            f"cannot load back safely ({type(exc).__name__}); store a Python number, string, "
            "tensor or a list/dict of them there"
        ) from None
