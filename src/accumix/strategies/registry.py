"""Words to strategies: the one place that knows every backend by name."""

from __future__ import annotations

import logging
from collections.abc import Callable

from accumix.env import LaunchEnv
from accumix.errors import ConfigError
from accumix.strategies.base import Strategy
from accumix.strategies.ddp import DDPStrategy
from accumix.strategies.single import SingleDeviceStrategy

log = logging.getLogger("accumix")

_FACTORIES: dict[str, Callable[[], Strategy]] = {
    "single": SingleDeviceStrategy,
    "ddp": DDPStrategy,
}
STRATEGY_WORDS = ("auto", "single", "ddp")


def register_strategy(word: str, factory: Callable[[], Strategy]) -> None:
    """Makes ``strategy=word`` build ``factory()`` (how sharded backends join the registry)."""
    global STRATEGY_WORDS
    _FACTORIES[word] = factory
    if word not in STRATEGY_WORDS:
        STRATEGY_WORDS = (*STRATEGY_WORDS, word)


def resolve_strategy(strategy: str | Strategy, launch: LaunchEnv) -> Strategy:
    """Turns a word (or a Strategy object) into the strategy for this launch.

    Args:
        strategy: ``"auto"``, a registered word, or a ``Strategy`` instance.
        launch: the launch environment.

    Returns:
        A strategy instance. ``"auto"`` is single for one process and ddp otherwise.

    Raises:
        ConfigError: an unknown word, or a one-process strategy in a multi-process launch.
    """
    if isinstance(strategy, Strategy):
        chosen = strategy
    elif not isinstance(strategy, str) or strategy not in (*_FACTORIES, "auto"):
        raise ConfigError(
            f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGY_WORDS)} "
            "or a Strategy object"
        )
    elif strategy == "auto":
        chosen = _FACTORIES["single" if launch.world_size == 1 else "ddp"]()
        log.info("strategy='auto' chose %s for a world of %d", chosen.name, launch.world_size)
    else:
        chosen = _FACTORIES[strategy]()
    if isinstance(chosen, SingleDeviceStrategy) and launch.world_size > 1:
        raise ConfigError(
            f"strategy='single' cannot run in a world of {launch.world_size} processes; "
            "use 'ddp' (or 'auto'), or launch one process"
        )
    return chosen
