"""ZeRO stage 1: DDP for the gradients, ``ZeroRedundancyOptimizer`` for the optimizer states."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from accumix.errors import ConfigError
from accumix.strategies.ddp import DDPStrategy
from accumix.strategies.optimizer_exactness import check_zero1


class ZeRO1Strategy(DDPStrategy):
    """DDP with each rank's optimizer holding the states of only its share of the parameters.

    The user's optimizer is rebuilt as ``ZeroRedundancyOptimizer(optimizer_class=type(opt))``
    over the same parameter groups: each rank steps its partition (whole parameters, balanced
    by size) and broadcasts the updated parameters. Gradients are all-reduced as in DDP, once
    per window (``no_sync`` off the boundary). The ZeRO optimizer shares the user's
    ``param_groups`` dicts, so an LR scheduler built on the user's optimizer drives the learning
    rate that really steps.

    On one process nothing is sharded (the model trains as with ``"single"``).

    Args:
        parameters_as_bucket_view: ZeroRedundancyOptimizer's flag: parameters alias flat
            buckets, so the post-step broadcast is one call per bucket.
        find_unused_parameters: DDP's flag, for models whose forward skips parameters.
        static_graph: DDP's flag, for graphs that do not change between iterations.
        bucket_cap_mb: DDP's bucket size; None keeps torch's default.
        gradient_as_bucket_view: DDP's flag: gradients alias the buckets (saves a copy).
        sync_batchnorm: DDP's option (``torch.nn.SyncBatchNorm``, CUDA only).
    """

    name = "zero1"

    def __init__(
        self,
        *,
        parameters_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
        sync_batchnorm: bool = False,
    ) -> None:
        super().__init__(
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            sync_batchnorm=sync_batchnorm,
        )
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._sources: dict[int, Optimizer] = {}  # id(ZeRO optimizer) -> the user's optimizer

    def setup(
        self, model: nn.Module, optimizers: list[Optimizer]
    ) -> tuple[nn.Module, list[Optimizer]]:
        model, optimizers = super().setup(model, optimizers)
        if self.world_size > 1:
            optimizers = [self._shard(opt) for opt in optimizers]
        return model, optimizers

    def state_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """This rank's partition's local optimizer (its step broadcasts nothing)."""
        return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer

    def setup_late_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return self._shard(optimizer) if self.world_size > 1 else optimizer

    def _shard(self, optimizer: Optimizer) -> ZeroRedundancyOptimizer:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        if optimizer.state:
            raise ConfigError(f"{type(optimizer).__name__} already holds state; set it up with "
                              "its model before its first step")
        check_zero1(optimizer)
        optimizer_class = type(optimizer)
        zero = _SharedGroupsZeRO(
            optimizer.param_groups,
            optimizer_class=optimizer_class,
            parameters_as_bucket_view=self.parameters_as_bucket_view,
            **_constructor_defaults(optimizer_class, optimizer.defaults),
        )
        zero.share(optimizer.param_groups)
        self._sources[id(zero)] = optimizer
        return zero

    def optimizer_step(self, optimizer: Optimizer, *, skip: bool, closure: Any = None) -> bool:
        stepped = super().optimizer_step(optimizer, skip=skip, closure=closure)
        source = self._sources.get(id(optimizer))
        if stepped and source is not None:
            # torch's LRScheduler warns "lr_scheduler.step() before optimizer.step()" unless
            # the optimizer it holds (the user's, which ZeRO replaced) records a step.
            source._opt_called = True  # type: ignore[attr-defined]
        return stepped

    # -- checkpoints: the default (torch.distributed.checkpoint) format, so a zero1 checkpoint
    # loads into ddp, fsdp or one process, on any world size, and the other way round.
    @property
    def checkpoint_format(self) -> str:
        return "dcp"

    def checkpoint_state(self, models: list[nn.Module], optimizers: list[Optimizer]
                         ) -> dict[str, Any]:
        """Each rank's shard's states under the plain optimizer's keys.

        ``get_state_dict`` cannot read a ZeroRedundancyOptimizer, so the user's optimizer (same
        parameters, same groups) lends it this rank's states; nothing is gathered, and the
        shards together hold every parameter's state once. The state dict keeps the lent
        tensors after the loan ends.
        """
        plain = [self._lend_states(opt) for opt in optimizers]
        try:
            return super().checkpoint_state(models, plain)
        finally:
            for opt, lent in zip(optimizers, plain, strict=True):
                if lent is not opt:
                    lent.state.clear()

    def load_checkpoint(
        self, directory: str, models: list[nn.Module], optimizers: list[Optimizer], *,
        strict: bool = True,
    ) -> None:
        """Reads every parameter's state into the user's optimizer, then each ZeRO optimizer
        keeps its own partition's (``ZeroRedundancyOptimizer.load_state_dict``)."""
        plain = [self._sources.get(id(opt), opt) for opt in optimizers]
        for opt, source in zip(optimizers, plain, strict=True):
            if source is not opt:
                source.state.clear()
        super().load_checkpoint(directory, models, plain, strict=strict)
        for opt, source in zip(optimizers, plain, strict=True):
            if source is opt:
                continue
            opt.load_state_dict(source.state_dict())
            # torch's load_state_dict gave the user's optimizer new group dicts: point it (and
            # so its scheduler) back at the ones ZeRO steps with.
            source.param_groups = opt.param_groups
            source.state.clear()

    def _lend_states(self, optimizer: Optimizer) -> Optimizer:
        source = self._sources.get(id(optimizer))
        if source is None:
            return optimizer
        source.state.clear()
        source.state.update(optimizer.state)  # the same tensors: no copy
        return source


def _constructor_defaults(optimizer_class: type[Optimizer], defaults: dict[str, Any]
                          ) -> dict[str, Any]:
    """The defaults the class's constructor accepts (AdamW's record a flag its __init__ lacks)."""
    parameters = inspect.signature(optimizer_class.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in parameters}


class _SharedGroupsZeRO(ZeroRedundancyOptimizer):
    """A ZeroRedundancyOptimizer on the user's param-group dicts, its shard's states as ``state``.

    ZeRO copies the groups it is given; on the user's dicts instead, a scheduler holding the
    user's optimizer writes the lr that ZeRO copies into its local optimizer before each step.
    ``state`` is the local optimizer's (torch leaves it empty), so ``not opt.state`` tells
    whether it has stepped, as for any optimizer. Both survive ``load_state_dict``, which in
    torch replaces the groups and the state.
    """

    def share(self, groups: list[dict[str, Any]]) -> None:
        self.param_groups = groups
        self.state = self.optim.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = self.param_groups
        super().load_state_dict(state_dict)
        for mine, loaded in zip(groups, self.param_groups, strict=True):
            mine.update((k, v) for k, v in loaded.items() if k != "params")
        self.share(groups)
