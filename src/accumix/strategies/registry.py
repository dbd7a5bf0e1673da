"""Words to strategies: the one place that knows every backend by name.

Sharded backends are imported only when their word is asked for: DeepSpeed's import alone costs
seconds and it may not be installed.
"""

from __future__ import annotations

import importlib
import logging

from accumix.env import LaunchEnv
from accumix.errors import ConfigError
from accumix.strategies.base import Strategy

log = logging.getLogger("accumix")

# word -> "module:Class"; the class is built with no arguments (its defaults).
_STRATEGIES = {
    "single": "accumix.strategies.single:SingleDeviceStrategy",
    "ddp": "accumix.strategies.ddp:DDPStrategy",
    "zero1": "accumix.strategies.zero1:ZeRO1Strategy",
    "fsdp": "accumix.strategies.fsdp:FSDPStrategy",
    "deepspeed": "accumix.strategies.deepspeed:DeepSpeedStrategy",
}
STRATEGY_WORDS = ("auto", *_STRATEGIES)


def strategy_class(word: str) -> type[Strategy]:
    """The class behind a strategy word.

    Raises:
        ConfigError: an unknown word.
    """
    if word not in _STRATEGIES:
        raise ConfigError(
            f"unknown strategy {word!r}; use one of {', '.join(STRATEGY_WORDS)} "
            "or a Strategy object"
        )
    module, name = _STRATEGIES[word].split(":")
    return getattr(importlib.import_module(module), name)


def resolve_strategy(strategy: str | Strategy, launch: LaunchEnv) -> Strategy:
    """Turns a word (or a Strategy object) into the strategy for this launch.

    Args:
        strategy: ``"auto"``, a strategy word, or a ``Strategy`` instance.
        launch: the launch environment.

    Returns:
        A strategy instance. ``"auto"`` is single for one process and ddp otherwise (the
        Accelerator may revise ddp from the memory model when the model is set up).

    Raises:
        ConfigError: an unknown word, or a one-process strategy in a multi-process launch.
    """
    if isinstance(strategy, Strategy):
        chosen = strategy
    elif not isinstance(strategy, str):
        raise ConfigError(
            f"strategy={strategy!r} is invalid; use one of {', '.join(STRATEGY_WORDS)} "
            "or a Strategy object"
        )
    elif strategy == "auto":
        chosen = strategy_class("single" if launch.world_size == 1 else "ddp")()
    else:
        chosen = strategy_class(strategy)()
    if chosen.name == "single" and launch.world_size > 1:
        raise ConfigError(
            f"strategy='single' cannot run in a world of {launch.world_size} processes; "
            "use 'ddp' (or 'auto'), or launch one process"
        )
    return chosen
