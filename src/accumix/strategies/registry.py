"""Words to strategies: the one place that knows every backend by name.

Sharded backends are imported only when their word is asked for: DeepSpeed's import alone costs
seconds and it may not be installed.
"""

from __future__ import annotations

import importlib
import logging

import torch
from torch import nn
from torch.optim import Optimizer

from accumix.errors import ConfigError
from accumix.memory.device_memory import device_free_bytes
from accumix.memory.model import PRECISIONS, estimate_memory
from accumix.memory.strategy_choice import choose_strategy
from accumix.precision import Policy
from accumix.runtime.env import LaunchEnv
from accumix.strategies.base import Strategy

log = logging.getLogger("accumix")

# word -> "module:Class"; the class is built with no arguments (its defaults).
_STRATEGIES = {
    "single": "accumix.strategies.single:SingleDeviceStrategy",
    "ddp": "accumix.strategies.ddp:DDPStrategy",
    "zero1": "accumix.strategies.zero1:ZeRO1Strategy",
    "fsdp": "accumix.strategies.fsdp:FSDPStrategy",
    "hsdp": "accumix.strategies.hsdp:HSDPStrategy",
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


def choose_auto_strategy(
    model: nn.Module,
    optimizers: list[Optimizer],
    *,
    policy: Policy,
    world_size: int,
    device_bytes: int,
    headroom: float = 0.8,
    ranks_per_node: int | None = None,
    grad_accum_steps: int | None = 1,
) -> tuple[Strategy, str]:
    """What ``strategy="auto"`` becomes once the model is known: the memory model's choice.

    One process is ``single``; otherwise the least communication whose model states fit
    ``headroom * device_bytes`` per rank: ddp, then zero1, fsdp ``grad_op``, fsdp ``full``
    (``accumix.memory.strategy_choice.choose_strategy``; fsdp ``full`` also when nothing fits). On
    several nodes hsdp (``grad_op``, then ``full``) comes right after ddp: a model that fits
    sharded within a node then crosses the link between nodes once per step. With a window
    (K >= 2, or K not known yet) fsdp's default holds the window's unsharded gradients, and fsdp
    with ``sync_each_microstep=True`` (sharded gradients, K reductions) comes last.

    Args:
        model: the user's plain model (its parameters are counted).
        optimizers: its optimizers (they give the states per parameter; Adam-like 2 if unknown).
        policy: the precision policy.
        world_size: data-parallel ranks.
        device_bytes: memory one rank may use, the same number on every rank.
        headroom: fraction of ``device_bytes`` the model states may take.
        ranks_per_node: the ranks of one node when the world spans several (the launch's
            ``local_world_size``); None: one node.
        grad_accum_steps: K, micro-steps per optimizer step; None when not known yet.

    Returns:
        A fresh (unconnected) strategy and the one-line reason for the log.
    """
    estimates = estimate_memory(
        model, world_size=world_size, precision=_precision_word(policy),
        optimizer_states=_optimizer_states(optimizers), device_bytes=device_bytes,
        headroom=headroom, ranks_per_node=ranks_per_node, grad_accum_steps=grad_accum_steps,
    )
    choice = choose_strategy(estimates, device_bytes=device_bytes, headroom=headroom,
                             world_size=world_size, ranks_per_node=ranks_per_node)
    cls = strategy_class(choice.strategy)
    kwargs: dict[str, object] = {"sharding": choice.sharding} if choice.sharding else {}
    if choice.sync_each_microstep:
        kwargs["sync_each_microstep"] = True
    strategy = cls(**kwargs)  # type: ignore[arg-type]  # fsdp, hsdp take these
    return strategy, choice.reason


def agreed_free_bytes(strategy: Strategy, device: torch.device, local_world_size: int) -> int:
    """The device memory one rank may use, the minimum over ranks so all choose alike."""
    free = device_free_bytes(device, local_world_size=local_world_size)
    agreed = strategy.all_reduce(torch.tensor([float(free)], device=device), "min")
    return int(agreed.item())


def _precision_word(policy: Policy) -> str:
    if policy.name in PRECISIONS:
        return policy.name
    if policy.param_dtype != torch.float32:
        return "bf16-true"
    return "bf16-mixed" if policy.autocast else "fp32"


def _optimizer_states(optimizers: list[Optimizer]) -> int:
    """States per parameter: 1 for SGD with momentum, Adagrad, RMSprop; 0 for plain SGD; 2 else."""
    def states(opt: Optimizer) -> int:
        name = type(opt).__name__
        if name == "SGD":
            return int(any(group.get("momentum", 0) for group in opt.param_groups))
        return {"Adagrad": 1, "RMSprop": 1}.get(name, 2)

    return max((states(opt) for opt in optimizers), default=2)
