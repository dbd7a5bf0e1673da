"""``acc.setup``: models, optimizers, LR schedulers and DataLoaders, wrapped in one call.

Loaders come first (one may fix K and the micro batch an engine needs), then each model with the
optimizers it owns (through the strategy, ``"auto"`` choosing it at the first model), then the
optimizers set up after their model, then the schedulers.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from accumix.common.micro_batch_search import is_auto
from accumix.data.eval_loader import EvalLoader
from accumix.data.loader import AcceleratedDataLoader, with_batch_size
from accumix.errors import ConfigError
from accumix.step import accum_steps, micro_step
from accumix.step.compile import split_compiled, unwrap
from accumix.step.optim import AcceleratedOptimizer, AcceleratedScheduler, is_scheduler
from accumix.strategies.registry import agreed_free_bytes, choose_auto_strategy

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

log = logging.getLogger("accumix")


def setup(run: RunState, objects: tuple[Any, ...]) -> Any:
    """``acc.setup(*objects)``: the prepared objects in the same order; one in, that one out."""
    for obj in objects:
        if id(obj) in run.set_up:
            raise ConfigError(f"{type(obj).__name__} was already set up; set it up once")
        if not (isinstance(obj, (nn.Module, Optimizer, DataLoader)) or is_scheduler(obj)):
            raise ConfigError(
                f"cannot set up a {type(obj).__name__}; pass nn.Module, torch.optim "
                "optimizers, LR schedulers and DataLoaders"
            )
    result: dict[int, Any] = {}
    models = [o for o in objects if isinstance(o, nn.Module)]
    optimizers = [o for o in objects if isinstance(o, Optimizer)]
    _check_one_model_per_optimizer(models, optimizers)
    for obj in objects:  # loaders first: one may fix K and the micro batch an engine needs
        if isinstance(obj, DataLoader):
            result[id(obj)] = _wrap_loader(run, obj)
    for given in models:
        owned = [o for o in optimizers if _owns(given, o)]
        # torch.compile'd: its module goes to the strategy, compiled after it (compile.py).
        model, compiler = split_compiled(given, run.compile)
        if run.auto_strategy:
            _choose_auto_strategy(run, model, owned)
        micro = run.batch_sizes[2] or next(
            (w.loader.batch_size for w in run.loaders if w.loader.batch_size), None)
        micro = None if is_auto(micro) else micro
        run.strategy.set_batch_geometry(micro_batch_size=micro,
                                        grad_accum_steps=run.grad_accum_steps)
        wrapped, opts = run.strategy.setup(model, owned)
        if not run.models:  # the strategy is final now ("auto" chose at this model)
            log.info(run.strategy.effective_dtypes().describe())
        if compiler is not None:
            wrapped = run.strategy.compile_module(wrapped, compiler)
        run.models.append(wrapped)
        result[id(given)] = wrapped
        for raw, opt in zip(owned, opts, strict=True):
            result[id(raw)] = _wrap_optimizer(run, opt, wrapped)
    for opt in optimizers:
        if id(opt) not in result:
            owner = next((m for m in run.models if _owns(unwrap(run.strategy, m), opt)), None)
            if owner is None:
                raise ConfigError(
                    "an optimizer's parameters belong to no set-up model; "
                    "call acc.setup(model, optimizer) with its model"
                )
            result[id(opt)] = _wrap_optimizer(run, run.strategy.setup_late_optimizer(opt),
                                              owner)
    for obj in objects:
        if is_scheduler(obj):
            result[id(obj)] = _wrap_scheduler(run, obj)
    run.set_up.update((id(o), o) for o in objects)
    out = tuple(result[id(o)] for o in objects)
    return out[0] if len(out) == 1 else out


def _choose_auto_strategy(run: RunState, model: nn.Module, optimizers: list[Optimizer]
                          ) -> None:
    """Swaps the provisional ddp for the memory model's choice, before anything is set up."""
    run.auto_strategy = False
    free = agreed_free_bytes(run.strategy, run.device, run.launch.local_world_size)
    launch = run.launch
    chosen, reason = choose_auto_strategy(
        model, optimizers, policy=run.policy, world_size=run.world_size, device_bytes=free,
        ranks_per_node=launch.local_world_size if launch.num_nodes > 1 else None,
        # Not known yet (micro_batch_size="auto"): sized as a window, the larger figure.
        grad_accum_steps=run.grad_accum_steps if run.steps_known else None,
    )
    chosen.connect(launch=run.launch, device=run.device, policy=run.policy,
                   scaler=run.strategy.scaler)
    run.strategy = chosen
    log.info("strategy='auto' chose %s", reason)


def _wrap_optimizer(run: RunState, optimizer: Optimizer, model: nn.Module
                    ) -> AcceleratedOptimizer:
    wrapped = AcceleratedOptimizer(optimizer, run, model)
    run.optimizers.append(wrapped)
    return wrapped


def _wrap_scheduler(run: RunState, scheduler: Any) -> AcceleratedScheduler:
    # Matched by the param groups the scheduler writes: a strategy may step a rebuilt
    # optimizer (ZeRO) that shares the user's groups.
    groups = scheduler.optimizer.param_groups
    owner = next((o for o in run.optimizers if o.param_groups is groups), None)
    if owner is None:
        raise ConfigError(
            f"{type(scheduler).__name__}'s optimizer was not set up; "
            "call acc.setup(model, optimizer, scheduler)"
        )
    wrapped = AcceleratedScheduler(scheduler, owner, run)
    run.schedulers.append(wrapped)
    return wrapped


def _wrap_loader(run: RunState, loader: DataLoader) -> AcceleratedDataLoader:
    _, global_batch, micro = run.batch_sizes
    if is_auto(micro):
        raise ConfigError("micro_batch_size='auto' is not chosen yet: set up the model and "
                          "optimizer, call acc.find_micro_batch_size(step, make_batch), "
                          "then set up the DataLoader")
    if run.micro_batch_choice is not None:
        loader = with_batch_size(loader, micro)  # the chosen size, whatever it was given
    if micro is not None and loader.batch_size not in (None, micro):
        raise ConfigError(
            f"DataLoader batch_size={loader.batch_size} differs from micro_batch_size="
            f"{micro}; make them equal"
        )
    if not run.steps_known and global_batch is not None and loader.batch_size:
        run.window.grad_accum_steps = accum_steps.derive(run, loader.batch_size) or 1
        run.steps_known = True
    wrapped = AcceleratedDataLoader(
        loader,
        device=run.device,
        rank=run.launch.rank,
        world_size=run.strategy.dp_world_size,
        seed=run.seed or 0,
        on_batch=functools.partial(micro_step.on_batch, run),
        between_batches=functools.partial(micro_step.between_batches, run),
    )
    run.loaders.append(wrapped)
    return wrapped


def setup_eval_loader(run: RunState, loader: DataLoader) -> EvalLoader:
    """``acc.setup_eval_loader(loader)``: this rank's block of the loader (``data.eval_loader``).

    Raises:
        ConfigError: not a DataLoader, set up already, or a loader that cannot be split.
    """
    if not isinstance(loader, DataLoader):
        raise ConfigError(f"acc.setup_eval_loader takes a torch DataLoader, not a "
                          f"{type(loader).__name__}")
    if id(loader) in run.set_up:
        raise ConfigError("this DataLoader was already set up; set it up once")

    def forward_collectives() -> str | None:
        strategy = run.strategy  # read when an epoch starts: "auto" chooses at the model
        return strategy.name if strategy.forward_collectives else None

    wrapped = EvalLoader(loader, rank=run.launch.rank, world_size=run.strategy.dp_world_size,
                         device=run.device, forward_collectives=forward_collectives)
    run.eval_loaders.append(wrapped)
    run.set_up[id(loader)] = loader
    return wrapped


def _check_one_model_per_optimizer(models: list[nn.Module], optimizers: list[Optimizer]) -> None:
    # Each model is set up with the optimizers it owns: a shared one would be wrapped twice
    # (and a checkpoint would hold it twice: DCP's KeyError inside save_state).
    for index, opt in enumerate(optimizers):
        owners = [i for i, m in enumerate(models) if _owns(m, opt)]
        if len(owners) > 1:
            raise ConfigError(
                f"optimizer {index} ({type(opt).__name__}) holds parameters of models "
                f"{owners} of this setup call; give each model its own optimizer, or put the "
                "models in one nn.Module and set that up"
            )


def _owns(model: nn.Module, optimizer: Optimizer) -> bool:
    mine = {id(p) for p in model.parameters()}
    return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])
