"""One process, one device: the base behaviour with nothing to communicate."""

from __future__ import annotations

from accumix.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Trains on one device in one process (CPU or ``cuda:0``)."""

    name = "single"
