"""Strategies: one file per backend behind the interface in ``base.py``."""

from __future__ import annotations

from accumix.strategies.base import Strategy
from accumix.strategies.ddp import DDPStrategy
from accumix.strategies.registry import STRATEGY_WORDS, resolve_strategy, strategy_class
from accumix.strategies.single import SingleDeviceStrategy

__all__ = [
    "STRATEGY_WORDS",
    "DDPStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "resolve_strategy",
    "strategy_class",
]
