"""Precision: the dtype ``Policy`` from a word, and the loss scalers.

The loss scalers and the words are torch-free; ``Policy`` (torch dtypes) loads on first use, so
the JAX backend can share the scaler without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from accumix.precision.loss_scale import DynamicLossScale, LossScaler, NoLossScale
from accumix.precision.words import PRECISION_WORDS

_LAZY = {"Policy": "accumix.precision.policy", "resolve_policy": "accumix.precision.policy"}

__all__ = [
    "PRECISION_WORDS",
    "DynamicLossScale",
    "LossScaler",
    "NoLossScale",
    "Policy",
    "resolve_policy",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'accumix.precision' has no attribute {name!r}")
