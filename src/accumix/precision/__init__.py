"""Precision: the dtype ``Policy`` from a word, and the loss scalers."""

from __future__ import annotations

from accumix.precision.loss_scale import DynamicLossScale, LossScaler, NoLossScale
from accumix.precision.policy import PRECISION_WORDS, Policy, resolve_policy

__all__ = [
    "PRECISION_WORDS",
    "DynamicLossScale",
    "LossScaler",
    "NoLossScale",
    "Policy",
    "resolve_policy",
]
