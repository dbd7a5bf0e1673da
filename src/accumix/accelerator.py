"""The façade: holds the pieces and calls them in the canonical order; owns no backend logic.

The step, as the user's loop drives it (each call a no-op where it has nothing to do):

    with acc.accumulate():          # micro-step: no gradient sync unless it ends the window
        acc.backward(loss)          # loss x scale / K (or / items hint) -> strategy.backward
        acc.clip_grad_norm_(1.0)    # boundary: finalize (unscale + normalise + inf check, one
                                    #   pass), agree on overflow, clip the true gradients
        optimizer.step()            # boundary: finalize this optimizer's gradients if a
                                    #   backward reached them since, step or skip
        scheduler.step()            # only if the optimizer really stepped
        optimizer.zero_grad()       # only once the window's gradients have been used
                                    # (the loss scale moves once per window, after its last
                                    #   step, in the block or after it: ``window_end.py``)

With several optimizers each keeps its own window (``boundary.py``): the backward calls that
reached its parameters, their item counts, its finalize and its step.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from accumix import boundary, checkpoint, fault, oom_split, window_end
from accumix.accumulation import AccumulationWindow, derive_grad_accum_steps
from accumix.batch_sizes import batch_geometry
from accumix.compile import CompileSetting, resolve_compile, split_compiled, strip_compiled
from accumix.data import AcceleratedDataLoader, with_batch_size
from accumix.env import detect_launch_env, init_process_group, pick_device, seed_everything
from accumix.errors import AccumixError, ConfigError
from accumix.logging_setup import configure_logging
from accumix.micro_batch_search import (
    DEFAULT_HEADROOM,
    MicroBatchChoice,
    check_micro_batch_word,
    is_auto,
    parse_memory_limit,
)
from accumix.optim import AcceleratedOptimizer, AcceleratedScheduler, is_scheduler
from accumix.peak_memory import device_total_bytes
from accumix.precision import DynamicLossScale, NoLossScale, Policy, resolve_policy
from accumix.precision.loss_scale import check_loss_scale_use
from accumix.strategies import Strategy, resolve_strategy
from accumix.strategies.base import params_of
from accumix.strategies.registry import agreed_free_bytes, choose_auto_strategy

log = logging.getLogger("accumix")

class _MicroStep:
    """The context of ``acc.accumulate()``; a class rather than a generator for speed."""

    __slots__ = ("acc", "models", "stack")

    def __init__(self, acc: Accelerator, models: tuple[nn.Module, ...]) -> None:
        self.acc, self.models, self.stack = acc, models, []

    def __enter__(self) -> None:
        acc = self.acc
        acc._begin_micro_step()
        acc._micro_step_models = self.models
        if not acc._window.is_boundary:
            for model in self.models or acc._models:
                ctx = acc.strategy.no_sync(model)
                ctx.__enter__()
                self.stack.append(ctx)

    def __exit__(self, *exc: Any) -> None:
        while self.stack:
            self.stack.pop().__exit__(*exc)
        acc = self.acc
        acc._in_micro_step = False
        if acc._window.is_boundary:
            window_end.update_loss_scale(acc)
        acc._window.end()


class Accelerator:
    """Runs one plain PyTorch loop on a CPU, a GPU, many GPUs or many machines.

    Args:
        strategy: ``"auto"``, ``"single"``, ``"ddp"`` (and the sharded words once installed), or
            a ``Strategy`` object.
        precision: ``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"``, ``"bf16-true"``, ``"auto"``,
            or a ``Policy``.
        grad_accum_steps: micro-steps per optimizer step (int >= 1); None derives it from the
            two batch sizes, else 1.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        micro_batch_size: samples per forward on one rank (default: the set-up loader's);
            ``"auto"``: the largest that fits, chosen by ``find_micro_batch_size``.
        memory_limit: what ``"auto"`` may use per device: bytes, or a percentage such as
            ``"90%"`` of the device's memory (on CPU: this process's share of the host's);
            None: the whole device.
        loss_scale: a ``DynamicLossScale`` for fp16; None uses its defaults.
        seed: seeds python, numpy and torch identically on every rank.
        timeout: seconds a collective may wait before every rank stops with an error.
        compile: ``True`` or a dict of ``torch.compile`` keyword arguments compiles each model
            after the strategy wrapped or sharded it; None (default) compiles only a model that
            comes ``torch.compile``'d (with its own options, likewise after the strategy);
            ``False`` runs even such a model eagerly.

    Raises:
        ConfigError: an unknown word, an impossible combination or batch sizes that don't divide.
    """

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        precision: str | Policy = "auto",
        grad_accum_steps: int | None = None,
        global_batch_size: int | None = None,
        micro_batch_size: int | str | None = None,
        memory_limit: int | str | None = None,
        loss_scale: DynamicLossScale | None = None,
        seed: int | None = None,
        timeout: float = 600.0,
        compile: CompileSetting = None,
    ) -> None:
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ConfigError(f"timeout={timeout!r} is invalid; use seconds > 0")
        self._compile = resolve_compile(compile)
        self.launch = detect_launch_env()
        configure_logging(self.launch.rank)
        self.device = pick_device(self.launch)
        init_process_group(self.launch, self.device, timeout)
        self.policy = resolve_policy(precision, self.device)
        check_loss_scale_use(loss_scale, precision=precision, chosen=self.policy.name,
                             scales=self.policy.needs_loss_scaling)
        scaler: DynamicLossScale | NoLossScale = NoLossScale()
        if self.policy.needs_loss_scaling:
            scaler = loss_scale or DynamicLossScale()
        self.strategy = resolve_strategy(strategy, self.launch)
        # "auto" in a world > 1 starts as ddp; the memory model revises it at the first model.
        self._auto_strategy = strategy == "auto" and self.launch.world_size > 1
        self.strategy.connect(
            launch=self.launch, device=self.device, policy=self.policy, scaler=scaler
        )
        check_micro_batch_word(micro_batch_size, global_batch_size)
        self._memory_limit = parse_memory_limit(memory_limit, device_total=device_total_bytes(
            self.device, local_world_size=self.launch.local_world_size))
        self._batch_sizes = (grad_accum_steps, global_batch_size, micro_batch_size)
        steps = self._derive_steps(None if is_auto(micro_batch_size) else micro_batch_size)
        self._window = AccumulationWindow(steps or 1)
        self._steps_known = steps is not None
        self._steps_assigned = False
        self.seed = seed
        if seed is not None:
            seed_everything(seed)
        self._models: list[nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._loaders: list[AcceleratedDataLoader] = []
        self._preemption: fault.PreemptionHandler | None = None
        self._watchdog = fault.start_watchdog(self, timeout)
        self._set_up: set[int] = set()
        self._in_micro_step = False
        self._micro_step = _MicroStep(self, ())
        self._micro_step_models: tuple[nn.Module, ...] = ()  # accumulate()'s (): every model
        self._step = boundary.StepRecord()
        self.optimizer_steps = 0
        self.step_was_skipped = False
        self._micro_batch_choice: MicroBatchChoice | None = None
        self._check_same_config()

    # -- read-only state ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def local_rank(self) -> int:
        return self.launch.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.launch.rank == 0

    @property
    def grad_accum_steps(self) -> int:
        return self._window.grad_accum_steps

    @grad_accum_steps.setter
    def grad_accum_steps(self, steps: int) -> None:
        """Changes K for the windows that follow (e.g. a ``GradientAccumulationScheduler``).

        Raises:
            ConfigError: ``steps`` is not an integer >= 1, or a window is half done.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"grad_accum_steps={steps!r} is invalid; use an integer >= 1")
        if self._window.micro_step:
            raise ConfigError(
                f"grad_accum_steps can change only between windows, not after micro-step "
                f"{self._window.micro_step} of {self._window.grad_accum_steps}"
            )
        self._window.grad_accum_steps = steps
        self._steps_known = True
        self._steps_assigned = True  # an explicit K: load_state keeps it

    @property
    def sync_gradients(self) -> bool:
        """Whether the current (or last) micro-step ends the accumulation window."""
        return self._window.is_boundary

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale, or None when no loss scaling is in use."""
        return self.strategy.loss_scale

    # -- setup ---------------------------------------------------------------------------------
    def setup(self, *objects: Any) -> Any:
        """Prepares modules, optimizers, LR schedulers and DataLoaders, in any order.

        Args:
            objects: the things to prepare; an optimizer is set up in the same call as its
                model (or after it); a scheduler with (or after) its optimizer.

        Returns:
            The prepared objects in the same order; one object in, that object out.

        Raises:
            ConfigError: an object set up twice, of an unknown type, or without its partner.
        """
        for obj in objects:
            if id(obj) in self._set_up:
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
                result[id(obj)] = self._wrap_loader(obj)
        for given in models:
            owned = [o for o in optimizers if _owns(given, o)]
            # torch.compile'd: its module goes to the strategy, compiled after it (compile.py).
            model, compiler = split_compiled(given, self._compile)
            if self._auto_strategy:
                self._choose_auto_strategy(model, owned)
            micro = self._batch_sizes[2] or next(
                (w.loader.batch_size for w in self._loaders if w.loader.batch_size), None)
            micro = None if is_auto(micro) else micro
            self.strategy.set_batch_geometry(micro_batch_size=micro,
                                             grad_accum_steps=self.grad_accum_steps)
            wrapped, opts = self.strategy.setup(model, owned)
            if compiler is not None:
                wrapped = self.strategy.compile_module(wrapped, compiler)
            self._models.append(wrapped)
            result[id(given)] = wrapped
            for raw, opt in zip(owned, opts, strict=True):
                result[id(raw)] = self._wrap_optimizer(opt, wrapped)
        for opt in optimizers:
            if id(opt) not in result:
                owner = next((m for m in self._models if _owns(self.unwrap(m), opt)), None)
                if owner is None:
                    raise ConfigError(
                        "an optimizer's parameters belong to no set-up model; "
                        "call acc.setup(model, optimizer) with its model"
                    )
                result[id(opt)] = self._wrap_optimizer(self.strategy.setup_late_optimizer(opt),
                                                       owner)
        for obj in objects:
            if is_scheduler(obj):
                result[id(obj)] = self._wrap_scheduler(obj)
        self._set_up.update(id(o) for o in objects)
        out = tuple(result[id(o)] for o in objects)
        return out[0] if len(out) == 1 else out

    def find_micro_batch_size(self, step: Callable[[Any], Any], make_batch: Callable[[int], Any],
                              *, headroom: float = DEFAULT_HEADROOM,
                              run_dir: str | os.PathLike[str] | None = None) -> int:
        """Chooses ``micro_batch_size="auto"``: the largest micro-batch that divides
        ``global_batch_size / data-parallel world`` and fits on every rank; K follows.

        Call it after setting up the model(s) and optimizer(s), before setting up the
        DataLoader (which is then re-batched to the chosen size). Collective. Probing changes
        no state: the run is bit-identical to one given the chosen size (``micro_batch_probe``).

        Args:
            step: ``step(batch) -> loss`` (or ``(loss_sum, num_items)``): the forward and loss
                of a micro-step on the set-up model; accumix runs the backward.
            make_batch: ``make_batch(n)``: a batch of n rows, the longest the data can give.
            headroom: the fraction of the memory limit left free.
            run_dir: where the choice is cached (an elastic restart on another world re-probes).

        Returns:
            The chosen micro-batch size.

        Raises:
            ConfigError: ``micro_batch_size`` is not ``"auto"``, nothing was set up, or not even
                a micro-batch of 1 fits.
        """
        from accumix.micro_batch_probe import find_micro_batch_size

        return find_micro_batch_size(self, step, make_batch, headroom=headroom, run_dir=run_dir)

    @property
    def micro_batch_choice(self) -> MicroBatchChoice | None:
        """What ``micro_batch_size="auto"`` chose and why (None before, or without auto)."""
        return self._micro_batch_choice

    def _choose_auto_strategy(self, model: nn.Module, optimizers: list[Optimizer]) -> None:
        """Swaps the provisional ddp for the memory model's choice, before anything is set up."""
        self._auto_strategy = False
        free = agreed_free_bytes(self.strategy, self.device, self.launch.local_world_size)
        chosen, reason = choose_auto_strategy(
            model, optimizers, policy=self.policy, world_size=self.world_size, device_bytes=free
        )
        chosen.connect(launch=self.launch, device=self.device, policy=self.policy,
                       scaler=self.strategy.scaler)
        self.strategy = chosen
        log.info("strategy='auto' chose %s", reason)

    def _wrap_optimizer(self, optimizer: Optimizer, model: nn.Module) -> AcceleratedOptimizer:
        wrapped = AcceleratedOptimizer(optimizer, self, model)
        self._optimizers.append(wrapped)
        return wrapped

    def _wrap_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        # Matched by the param groups the scheduler writes: a strategy may step a rebuilt
        # optimizer (ZeRO) that shares the user's groups.
        groups = scheduler.optimizer.param_groups
        owner = next((o for o in self._optimizers if o.param_groups is groups), None)
        if owner is None:
            raise ConfigError(
                f"{type(scheduler).__name__}'s optimizer was not set up; "
                "call acc.setup(model, optimizer, scheduler)"
            )
        wrapped = AcceleratedScheduler(scheduler, owner, self)
        self._schedulers.append(wrapped)
        return wrapped

    def _wrap_loader(self, loader: DataLoader) -> AcceleratedDataLoader:
        _, global_batch, micro = self._batch_sizes
        if is_auto(micro):
            raise ConfigError("micro_batch_size='auto' is not chosen yet: set up the model and "
                              "optimizer, call acc.find_micro_batch_size(step, make_batch), "
                              "then set up the DataLoader")
        if self._micro_batch_choice is not None:
            loader = with_batch_size(loader, micro)  # the chosen size, whatever it was given
        if micro is not None and loader.batch_size not in (None, micro):
            raise ConfigError(
                f"DataLoader batch_size={loader.batch_size} differs from micro_batch_size="
                f"{micro}; make them equal"
            )
        if not self._steps_known and global_batch is not None and loader.batch_size:
            self._window.grad_accum_steps = self._derive_steps(loader.batch_size) or 1
            self._steps_known = True
        wrapped = AcceleratedDataLoader(
            loader,
            device=self.device,
            rank=self.launch.rank,
            world_size=self.strategy.dp_world_size,
            seed=self.seed or 0,
            on_batch=self._on_batch,
            between_batches=self._between_batches,
        )
        self._loaders.append(wrapped)
        return wrapped

    def _batch_geometry(self) -> dict[str, Any]:
        """K now, K as the settings give it, and what gave it (checkpoints restore K by it)."""
        steps, global_batch, micro = self._batch_sizes
        micro = micro or self.strategy.micro_batch_size or next(
            (w.batch_size for w in self._loaders if w.batch_size), None)
        given = ("grad_accum_steps" if steps is not None else
                 "global_batch_size" if global_batch is not None else "none")
        return batch_geometry(steps=self.grad_accum_steps,
                              configured=self._derive_steps(micro) or 1,
                              given=given, micro_batch_size=micro,
                              dp_world_size=self.strategy.dp_world_size)

    def _derive_steps(self, micro_batch_size: int | None) -> int | None:
        steps, global_batch, _ = self._batch_sizes
        return derive_grad_accum_steps(
            grad_accum_steps=steps,
            global_batch_size=global_batch,
            micro_batch_size=micro_batch_size,
            dp_world_size=self.strategy.dp_world_size,
        )

    def _on_batch(self, is_last: bool) -> None:
        self._window.end_of_data = is_last

    def _between_batches(self) -> None:
        if self._preemption is not None:
            self._preemption.at_batch()

    # -- the step ------------------------------------------------------------------------------
    def accumulate(self, *models: nn.Module) -> _MicroStep:
        """One micro-step. Off the boundary, gradient communication is off for ``models``
        (default: every set-up model); the last micro-step of a window (or of the epoch's data)
        is the boundary, where ``sync_gradients`` is True."""
        # The common call has no arguments: reuse one context (micro-steps never nest).
        return _MicroStep(self, models) if models else self._micro_step

    def _begin_micro_step(self) -> None:
        if self._in_micro_step:
            raise AccumixError("acc.accumulate() was entered twice; micro-steps do not nest")
        if is_auto(self._batch_sizes[2]):
            raise ConfigError("micro_batch_size='auto' is not chosen yet; call "
                              "acc.find_micro_batch_size(step, make_batch) before the loop")
        if not self._steps_known:
            raise ConfigError(
                "global_batch_size was given without micro_batch_size and no DataLoader was "
                "set up to take it from; pass micro_batch_size="
            )
        if self._preemption is not None and not self._loaders:
            self._preemption.at_batch()  # no set-up loader calls it between batches
        if not self._window.micro_step:  # a new window: the last one's end comes first
            window_end.close_window(self)
        self._in_micro_step = True
        self._window.begin()

    def backward(self, loss: torch.Tensor, num_items: int | float | torch.Tensor | None = None
                 ) -> None:
        """Backward of one micro-step's loss.

        Args:
            loss: the micro-batch's mean loss; or, with ``num_items``, its summed loss.
            num_items: the items (tokens, samples) ``loss`` sums over. Gradients then equal the
                mean over all items of the window on all ranks, however they were distributed;
                with several models, each optimizer's over the backward calls that reached it.

        Raises:
            AccumixError: called outside ``acc.accumulate()``.
        """
        if not self._in_micro_step:
            raise AccumixError(
                "acc.backward() must be called inside `with acc.accumulate():`"
            )
        window, scaler = self._window, self.strategy.scaler
        if window.needs_first_hint(num_items, scaler.enabled):
            window.set_first_hint(boundary.agreed_count(num_items, self.strategy, self.device))
        multiplier = window.loss_multiplier(num_items) * scaler.scale
        before = boundary.marks_before(self._optimizers, self.strategy)
        self.strategy.backward(loss * multiplier if multiplier != 1.0 else loss,
                               self._models[0] if self._models else None)
        boundary.record_backward(self, before, num_items)

    def run_micro_batch(self, step_fn: Any, batch: Any) -> Any:
        """Forward and backward of one micro-batch, with the out-of-memory safety net.

        Call it inside ``with acc.accumulate():`` instead of the forward and ``acc.backward``.
        A micro-batch whose forward raises ``torch.OutOfMemoryError`` is cut into pieces that
        run in the same micro-step, on every rank alike: the same gradient, the same window and
        optimizer step, one log line (``oom_split``).

        Args:
            step_fn: ``step_fn(batch) -> mean_loss | (loss_sum, num_items)``; a mean loss must
                be the mean over the batch's rows (first dimension).
            batch: the micro-batch: a tensor, or dicts/lists/tuples of tensors, rows first.

        Returns:
            ``step_fn``'s result for the whole micro-batch (the pieces' combined, if split).

        Raises:
            torch.OutOfMemoryError: not even one row fits (on every rank).
        """
        return oom_split.run_micro_batch(self, step_fn, batch)

    def _finalize(self, optimizers: list[AcceleratedOptimizer]) -> None:
        boundary.finalize(self, optimizers)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, parameters: Any = None
    ) -> torch.Tensor | None:
        """Clips the window's true gradients (unscaled and normalised) at the boundary.

        Args:
            max_norm: the largest total norm allowed.
            norm_type: the p of the p-norm.
            parameters: the parameters to clip (default: every set-up optimizer's).

        Returns:
            The total norm before clipping over all ranks, or None off the boundary.
        """
        if not isinstance(max_norm, (int, float)) or max_norm <= 0:
            raise ConfigError(f"clip_grad_norm_(max_norm={max_norm!r}) needs a number > 0")
        if not self.sync_gradients:
            return None
        if parameters is None:
            self._finalize(self._optimizers)
            params = self._trained_params()
        else:
            params = list(parameters)
            self._finalize(boundary.owners(self._optimizers, params))
        return self.strategy.clip_grad_norm_(params, float(max_norm), float(norm_type))

    def _trained_params(self) -> list[nn.Parameter]:
        """Every set-up optimizer's parameters, once each (read anew: groups may change)."""
        return list(params_of(o.optimizer for o in self._optimizers))

    def _optimizer_step(self, optimizer: AcceleratedOptimizer, closure: Any) -> Any:
        return boundary.optimizer_step(self, optimizer, closure)

    # -- collectives and helpers ---------------------------------------------------------------
    def reduce(self, tensor: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """A copy of ``tensor`` reduced over all ranks (``"mean"`` or ``"sum"``)."""
        if reduction not in ("mean", "sum"):
            raise ConfigError(f"reduction={reduction!r} is invalid; use 'mean' or 'sum'")
        return self.strategy.all_reduce(tensor.detach().clone(), reduction)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 (stacked if 0-dim), rank order."""
        parts = self.strategy.all_gather(tensor.detach())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def barrier(self) -> None:
        self.strategy.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside what ``setup`` returned (never ``torch.compile``'s wrapper)."""
        return strip_compiled(self.strategy.unwrap(strip_compiled(model)))

    def save_model(self, directory: str | os.PathLike[str], model: nn.Module | None = None
                   ) -> Path:
        """Writes the unwrapped model's full state dict as ``directory/model.safetensors``.

        Collective: every rank calls it; rank 0 writes. Keys are the unwrapped model's
        ``state_dict`` keys.

        Returns:
            The file's path.
        """
        if model is None:
            if len(self._models) != 1:
                raise ConfigError(
                    f"save_model needs model= when {len(self._models)} models are set up"
                )
            model = self._models[0]
        state = self.strategy.full_state_dict(model)
        path = Path(directory) / "model.safetensors"
        if self.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Copies: safetensors refuses tensors that share storage (tied embeddings).
            tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
            save_file(tensors, str(path), metadata={"format": "pt"})
        self.barrier()
        return path

    # -- checkpoints ---------------------------------------------------------------------------
    def save_state(self, run_dir: str | os.PathLike[str], keep_last: int | None = None, *,
                   extra_state: dict[str, Any] | None = None) -> Path:
        """Saves everything a run needs to continue exactly, as ``run_dir/step-<optimizer_steps>``.

        Models and optimizers (through the strategy: sharded where it shards), LR schedulers,
        the loss scaler, the accumulation counters, ``optimizer_steps``, every rank's RNG
        (python, numpy, torch, CUDA) and every set-up DataLoader's epoch and position. Written
        to a temporary directory, flushed and renamed; ``run_dir/latest`` is replaced last.
        Collective: every rank calls it, between windows (after the ``with acc.accumulate():``
        block of a boundary), with ``run_dir`` on a filesystem all ranks share.

        Args:
            run_dir: the run's directory (created if needed).
            keep_last: keep this many newest step directories, deleting older ones.
            extra_state: a JSON-safe dict stored with the checkpoint (rank 0's), read back
                with ``accumix.run_dir.extra_state(step_dir)``; the Trainer keeps its
                callbacks' state there.

        Returns:
            The step directory written.

        Raises:
            AccumixError: called inside an accumulation window.
            ConfigError: ``extra_state`` is not JSON (nothing is written).
            CheckpointError: a rank failed to write (every rank raises it).
        """
        return checkpoint.save_state(self, run_dir, keep_last=keep_last, extra_state=extra_state)

    def load_state(self, path: str | os.PathLike[str], *, strict: bool = True) -> Path:
        """Restores a ``save_state`` checkpoint into what was set up; training then continues
        bit for bit as if never stopped (same world size) or resharded (another world size).

        Call it after ``acc.setup(...)`` with the same kinds of objects, before the loop.
        Collective. A world size that differs re-maps each loader's position by samples.

        Everything that can be checked is checked before any state is replaced: a refused
        checkpoint leaves the run as it was.

        Args:
            path: a run directory (its ``latest`` is loaded) or one ``step-N`` directory.
            strict: the models' keys must be exactly the checkpoint's; False loads the keys
                both have (for a model that grew or lost a part).

        Returns:
            The step directory loaded.

        Raises:
            CheckpointError: a missing, torn or corrupt file, or a checkpoint that does not fit
                this run (another strategy family, precision, model, keys, scheduler type, set
                of objects, or a loader position it cannot continue); the message names the
                file. Every rank raises it.
        """
        return checkpoint.load_state(self, path, strict=strict)

    def handle_preemption(
        self,
        run_dir: str | os.PathLike[str],
        *,
        signals: tuple[int, ...] = (signal.SIGTERM,),
        keep_last: int | None = None,
        exit: bool = True,
    ) -> fault.PreemptionHandler:
        """On one of ``signals`` (on any rank), save at the next window boundary, then exit 0.

        The ranks agree at each boundary with one scalar all-reduce, so they all save at the
        same step whichever of them got the signal. Boundaries are seen between batches of a
        set-up DataLoader (or at the next ``accumulate()`` when none is set up).

        Args:
            run_dir: where ``save_state`` writes.
            signals: the signals that mean "stop soon" (add ``signal.SIGINT`` for Ctrl-C).
            keep_last: passed to ``save_state``.
            exit: raise ``SystemExit(0)`` after the save; False only sets the returned
                handler's ``triggered`` (the loop then breaks itself).

        Returns:
            The handler (``triggered``, ``checkpoint``).
        """
        if self._preemption is not None:
            self._preemption.close()
        self._preemption = fault.PreemptionHandler(
            self, run_dir, signals=tuple(signals), keep_last=keep_last, exit=exit
        )
        return self._preemption

    def end(self) -> None:
        """Waits for every rank and releases what the strategy holds.

        The process group stays up for a later Accelerator in this process and is destroyed at
        exit: destroying it here races a rank that re-creates it at once against a peer whose
        old store still answers on the same port (a hang).
        """
        # A signal in the last window or after the loop: saved now (collective), exit below.
        preempted = self._preemption is not None and self._preemption.at_end()
        if self._preemption is not None:
            self._preemption.close()
        if self._watchdog is not None:
            self._watchdog.finish()
        self.strategy.teardown()
        if dist.is_initialized():
            dist.barrier()
        if preempted:
            raise SystemExit(0)

    def _check_same_config(self) -> None:
        mine = (type(self.strategy).__name__, self.policy.name, self._batch_sizes,
                type(self.strategy.scaler).__name__)
        every = self.strategy.all_gather_object(mine)
        if any(other != mine for other in every):
            diff = {r: cfg for r, cfg in enumerate(every) if cfg != every[0]}
            raise ConfigError(
                f"ranks disagree on (strategy, precision, batch sizes, scaler): rank 0 has "
                f"{every[0]}, others {diff}; launch every rank with the same settings"
            )


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
