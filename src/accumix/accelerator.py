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

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from accumix.checkpoint import background as checkpoint_background
from accumix.checkpoint import model_file
from accumix.checkpoint import save_load as checkpoint
from accumix.common.micro_batch_search import (
    DEFAULT_HEADROOM,
    check_micro_batch_word,
    is_auto,
    parse_memory_limit,
)
from accumix.errors import ConfigError
from accumix.memory import oom_split
from accumix.memory.peak_memory import device_total_bytes
from accumix.precision import DynamicLossScale, NoLossScale, Policy, resolve_policy
from accumix.precision.loss_scale import check_loss_scale_use
from accumix.precision.policy import dtype_name, with_reduce_dtype
from accumix.precision.reduce_dtype import parse_reduce_dtype
from accumix.runtime import fault
from accumix.runtime.env import detect_launch_env, init_process_group, pick_device, seed_everything
from accumix.runtime.logging_setup import configure_logging
from accumix.step import accum_steps, boundary, lifecycle, micro_step, object_setup
from accumix.step.accumulation import AccumulationWindow
from accumix.step.collectives import Collectives
from accumix.step.compile import CompileSetting, resolve_compile, unwrap
from accumix.step.run_state import RunState
from accumix.step.run_view import RunView
from accumix.strategies import Strategy, resolve_strategy

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from accumix.data.eval_loader import EvalLoader


class Accelerator(RunView, Collectives):
    """Runs one plain PyTorch loop on a CPU, a GPU, many GPUs or many machines.

    Args:
        strategy: ``"auto"``, ``"single"``, ``"ddp"``, ``"zero1"``, ``"fsdp"``, ``"hsdp"``,
            ``"deepspeed"``, or a ``Strategy`` object (``ax.FSDPStrategy(...)``).
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
        reduce_dtype: what gradients travel in between ranks, on every strategy: ``"fp32"``,
            ``"bf16"`` (half the bytes) or ``"fp16"`` (half the bytes, ``fp16-mixed`` only: its
            loss scaling recovers from an overflow); None: the precision's (float32, bfloat16
            under ``bf16-true``). The window's gradients are summed locally in float32 and
            cast only for the reduction; ``acc.effective_dtypes`` states what runs.
        seed: seeds python, numpy and torch identically on every rank.
        timeout: seconds a collective may wait before every rank stops with an error.
        compile: ``True`` or a dict of ``torch.compile`` keyword arguments compiles each model
            after the strategy wrapped or sharded it; None (default) compiles only a model that
            comes ``torch.compile``'d (with its own options, likewise after the strategy);
            ``False`` runs even such a model eagerly.

    Raises:
        ConfigError: an unknown word, an impossible combination or batch sizes that don't divide.

    Example:
        ```python
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        import accumix as ax

        data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        acc = ax.Accelerator(global_batch_size=16, micro_batch_size=4, seed=0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer, loader = acc.setup(model, optimizer, DataLoader(data, batch_size=4))
        for x, y in loader:
            with acc.accumulate():
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        assert (acc.grad_accum_steps, acc.optimizer_steps) == (4, 4)
        ```

    Read-only state (``rank``, ``device``, ``optimizer_steps``, ...): ``step/run_view.py``.
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
        reduce_dtype: str | torch.dtype | None = None,
    ) -> None:
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ConfigError(f"timeout={timeout!r} is invalid; use seconds > 0")
        compile_setting = resolve_compile(compile)
        launch = detect_launch_env()
        configure_logging(launch.rank)
        device = pick_device(launch)
        init_process_group(launch, device, timeout)
        policy = with_reduce_dtype(resolve_policy(precision, device), reduce_dtype)
        check_loss_scale_use(loss_scale, precision=precision, chosen=policy.name,
                             scales=policy.needs_loss_scaling)
        scaler: DynamicLossScale | NoLossScale = NoLossScale()
        if policy.needs_loss_scaling:
            scaler = loss_scale or DynamicLossScale()
        chosen = resolve_strategy(strategy, launch)
        chosen.connect(launch=launch, device=device, policy=policy, scaler=scaler)
        policy = _agreed_reduce_dtype(chosen, reduce_dtype)
        check_micro_batch_word(micro_batch_size, global_batch_size)
        memory_limit = parse_memory_limit(memory_limit, device_total=device_total_bytes(
            device, local_world_size=launch.local_world_size))
        batch_sizes = (grad_accum_steps, global_batch_size, micro_batch_size)
        steps = accum_steps.derive_from(batch_sizes, chosen.dp_world_size,
                                        None if is_auto(micro_batch_size) else micro_batch_size)
        # All of the run's mutable state, in one object the pieces take (step/run_state.py).
        self._run = run = RunState(
            launch=launch, device=device, policy=policy, strategy=chosen,
            compile=compile_setting, seed=seed, memory_limit=memory_limit,
            # "auto" in a world > 1 starts as ddp; the memory model revises it at the first model.
            auto_strategy=strategy == "auto" and launch.world_size > 1,
            batch_sizes=batch_sizes, window=AccumulationWindow(steps or 1),
            steps_known=steps is not None, timeout=timeout,
        )
        if seed is not None:
            seed_everything(seed)
        run.watchdog = fault.start_watchdog(run, timeout)
        fault.die_with_launcher()
        self._micro_step = micro_step._MicroStep(run, ())  # accumulate()'s common context
        lifecycle.check_same_config(run)

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
        return object_setup.setup(self._run, objects)

    def setup_eval_loader(self, loader: DataLoader) -> EvalLoader:
        """An evaluation loader that gives each sample to one rank: contiguous blocks of the
        loader's samples, uneven, no padding (``acc.setup`` pads, as training needs). Sum a
        metric's parts and ``acc.reduce(sums, "sum")`` after the loop, or ``acc.gather`` the
        kept rows once after it (rank order is the loader's order): the one-process result on
        any world size. Ranks may run different numbers of batches: no collective in the loop
        (evaluate under ``torch.no_grad()``).

        Args:
            loader: the evaluation ``DataLoader`` (a plain one, not set up by ``acc.setup``).

        Raises:
            ConfigError: a loader that cannot be split without repeating or losing samples
                (an IterableDataset or a custom batch_sampler on several ranks, a weighted
                sampler); at an epoch's start, unequal batch counts under a strategy whose
                forward communicates (fsdp, hsdp, DeepSpeed stage 3).
        """
        return object_setup.setup_eval_loader(self._run, loader)

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
        from accumix.memory.micro_batch_probe import find_micro_batch_size

        return find_micro_batch_size(self._run, step, make_batch, headroom=headroom,
                                     run_dir=run_dir)

    # -- the step ------------------------------------------------------------------------------
    def accumulate(self, *models: nn.Module) -> micro_step._MicroStep:
        """One micro-step: ``with acc.accumulate(): ...`` around its forward, backward and steps.

        Off the boundary, gradient communication is off; the last micro-step of a window (or
        of the epoch's data) is the boundary, where ``sync_gradients`` is True and the
        optimizer steps really step.

        Args:
            models: the models whose gradient communication this micro-step controls
                (default: every set-up model).

        Returns:
            A context manager (enter it once per micro-step; micro-steps never nest).
        """
        # The common call has no arguments: reuse one context (micro-steps never nest).
        return micro_step._MicroStep(self._run, models) if models else self._micro_step

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
        micro_step.backward(self._run, loss, num_items)

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
        return oom_split.run_micro_batch(self._run, step_fn, batch)

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
        return boundary.clip_grad_norm(self._run, max_norm, norm_type, parameters)

    # -- helpers ------------------------------------------------------------------------------
    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside what ``setup`` returned (never ``torch.compile``'s wrapper).

        Args:
            model: a set-up model (or a plain one, returned as it is).
        """
        return unwrap(self._run.strategy, model)

    def save_model(self, directory: str | os.PathLike[str], model: nn.Module | None = None
                   ) -> Path:
        """Writes the unwrapped model's full state dict as ``directory/model.safetensors``.

        Collective: every rank calls it; rank 0 writes. Keys are the unwrapped model's
        ``state_dict`` keys.

        Args:
            directory: created if needed.
            model: the set-up model to write (default: the only one set up).

        Returns:
            The file's path.
        """
        return model_file.save_model(self._run, directory, model)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_state(self, run_dir: str | os.PathLike[str], keep_last: int | None = None, *,
                   extra_state: dict[str, Any] | None = None,
                   before_publish: Callable[[Any], None] | None = None,
                   background: bool = False) -> Any:
        """Saves everything a run needs to continue exactly, as ``run_dir/step-<optimizer_steps>``.

        Models and optimizers (through the strategy: sharded where it shards), LR schedulers,
        the loss scaler, the accumulation counters, ``optimizer_steps``, every rank's RNG
        (python, numpy, torch, CUDA) and every set-up DataLoader's epoch and position. Written
        to a temporary directory, flushed and renamed; ``run_dir/latest`` is replaced last.
        Collective: every rank calls it, between windows (after the ``with acc.accumulate():``
        block of a boundary). ``run_dir`` may be on a filesystem all ranks share, on each
        node's own disk (every node then publishes its ranks' files and the metadata a load
        needs, and ``latest`` moves only once every node has), or an fsspec URL
        (``s3://bucket/job``: objects written in place, ``meta.json`` then ``latest`` last).

        Args:
            run_dir: the run's directory (created if needed), a path or an object store URL.
            keep_last: keep this many newest step directories, deleting older ones.
            extra_state: a JSON-safe dict stored with the checkpoint (rank 0's), read back
                with ``accumix.checkpoint.extra_state(step_dir)``; the Trainer keeps its
                callbacks' state there.
            before_publish: ``before_publish(tmp_step_dir)``, on every rank, writes more files
                into the step directory before it is published (listed in its manifest, so a
                crash in between never publishes a checkpoint without them).
            background: return once the state is copied to host memory; the write and the
                publish run in a thread. At most one save is in flight: the next save, a load,
                ``wait_for_save`` and ``end`` wait for it and raise its error on every rank.

        Returns:
            The step directory written (with ``background``: being written).

        Raises:
            AccumixError: called inside an accumulation window.
            ConfigError: ``extra_state`` is not JSON, or ``run_dir`` a URL that cannot be used
                (nothing is written).
            CheckpointError: a rank failed to write (every rank raises it), or the previous
                background save failed.
        """
        return checkpoint.save_state(self._run, run_dir, keep_last=keep_last,
                                     extra_state=extra_state, before_publish=before_publish,
                                     background_write=background)

    def wait_for_save(self) -> Any:
        """Waits for the background save in flight (collective when there is one).

        Returns:
            The step directory it published, or None when none was in flight.

        Raises:
            CheckpointError: it failed on some rank (every rank raises it).
        """
        return checkpoint_background.finish(self._run, "acc.wait_for_save")

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
        return checkpoint.load_state(self._run, path, strict=strict)

    def handle_preemption(
        self,
        run_dir: str | os.PathLike[str],
        *,
        signals: tuple[int | str, ...] = (signal.SIGTERM,),
        requeue: bool = False,
        keep_last: int | None = None,
        exit: bool = True,
        save: Callable[[], Any] | None = None,
    ) -> fault.PreemptionHandler:
        """On one of ``signals`` (on any rank), save at the next window boundary, then exit 0.

        The ranks agree at each boundary with one scalar all-reduce, so they all save at the
        same step whichever of them got the signal. Boundaries are seen between batches of a
        set-up DataLoader (or at the next ``accumulate()`` when none is set up).

        Args:
            run_dir: where ``save_state`` writes.
            signals: the signals that mean "stop soon", numbers or names (add ``SIGINT`` for
                Ctrl-C; ``SIGUSR1`` for ``sbatch --signal=USR1@90``).
            requeue: after the save is published, rank 0 runs ``scontrol requeue`` (SLURM).
            keep_last: passed to ``save_state``.
            exit: raise ``SystemExit(0)`` after the save; False only sets the returned
                handler's ``triggered`` (the loop then breaks itself).
            save: what writes the checkpoint (every rank calls it at the same boundary; it
                returns the step directory); default ``acc.save_state(run_dir,
                keep_last=keep_last)``. The Trainer passes its own, which adds its loop's
                state.

        Returns:
            The handler (``triggered``, ``checkpoint``).
        """
        return lifecycle.handle_preemption(
            self._run, run_dir, signals=signals, requeue=requeue, keep_last=keep_last, exit=exit,
            save=(lambda directory, keep: save()) if save is not None
            else lambda directory, keep: self.save_state(directory, keep_last=keep))

    def end(self) -> None:
        """Waits for the background save in flight (raising its error, on every rank), then
        for every rank, and releases what the strategy holds.

        The process group stays up for a later Accelerator in this process and is destroyed at
        exit: destroying it here races a rank that re-creates it at once against a peer whose
        old store still answers on the same port (a hang).
        """
        try:
            checkpoint_background.finish(self._run, "acc.end")
        finally:
            lifecycle.end(self._run)


def _agreed_reduce_dtype(strategy: Strategy, reduce_dtype: str | torch.dtype | None) -> Policy:
    """The policy the connected strategy runs (it may carry its own ``reduce_dtype``, as
    ``FSDPStrategy(reduce_dtype=)`` does).

    Raises:
        ConfigError: the strategy's reduce dtype contradicts the one given to the Accelerator.
    """
    policy = strategy.policy
    assert policy is not None
    asked = parse_reduce_dtype(reduce_dtype)
    if asked is not None and dtype_name(policy.reduce_dtype) != asked:
        raise ConfigError(
            f"reduce_dtype={asked!r} contradicts the strategy's own reduce_dtype="
            f"{dtype_name(policy.reduce_dtype)!r}; give it in one place")
    return policy
