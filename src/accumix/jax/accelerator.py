"""The JAX façade: the same words and semantics as ``accumix.Accelerator``, on jit and a mesh.

    acc = axj.Accelerator(strategy="fsdp", precision="bf16-mixed", grad_accum_steps=4)
    state = acc.setup(params, optax.adamw(3e-4))    # sharded TrainState
    step = acc.train_step(loss_fn, clip_norm=1.0)   # jitted once; state donated
    for window in loader:                           # K micro-batches of this process
        state, metrics = step(state, window)        # one optimizer step, no host sync

It holds the pieces (strategy, policy, scaler rule, windows) and hands them to ``step.py``,
``data.py`` and ``checkpoint.py``; it has no per-strategy branches.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from accumix.common.batch_sizes import derive_grad_accum_steps
from accumix.common.hardware import peak_flops_by_name
from accumix.common.micro_batch_search import (
    DEFAULT_HEADROOM,
    MicroBatchChoice,
    check_micro_batch_word,
    is_auto,
    parse_memory_limit,
)
from accumix.errors import ConfigError
from accumix.jax import checkpoint, checkpoint_save, distributed, process_gather
from accumix.jax.data import Window, WindowLoader, make_window
from accumix.jax.loader import checked_loader, window_loader
from accumix.jax.loss_scale import LossScaleRule
from accumix.jax.memory import agreed_free_bytes, choose_auto
from accumix.jax.micro_batch import device_total_bytes, find
from accumix.jax.placement import initial_state
from accumix.jax.precision import effective_dtypes, resolve_jax_policy, with_reduce_dtype
from accumix.jax.state import TrainState
from accumix.jax.step import LossFn, build_eval, build_step
from accumix.jax.step_calls import EvalStep, TrainStep
from accumix.jax.strategies import JaxStrategy, resolve_jax_strategy
from accumix.precision.loss_scale import DynamicLossScale, check_loss_scale_use
from accumix.precision.reduce_dtype import EffectiveDtypes
from accumix.runtime.logging_setup import configure_logging

log = logging.getLogger("accumix")


class Accelerator:
    """Runs one jitted training step per window on one device, many devices or many processes.

    Args:
        strategy: ``"single"``, ``"ddp"``, ``"zero1"``, ``"fsdp"``, ``"hsdp"`` (replicas: the
            processes) or ``"auto"`` (the memory model's choice at setup); ``"deepspeed"`` is
            a ConfigError.
        precision: ``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"``, ``"bf16-true"``, ``"auto"``.
        grad_accum_steps: micro-steps per optimizer step (K); None derives it from the two batch
            sizes, else 1.
        global_batch_size: samples per optimizer step over all processes.
        micro_batch_size: samples per micro-step of one process (a set-up DataLoader's
            ``batch_size`` by default); ``"auto"``: the largest that fits, chosen from the
            compiled step by ``find_micro_batch_size`` (``accumix.jax.micro_batch``).
        memory_limit: what ``"auto"`` may use per device: bytes, or a percentage such as
            ``"90%"`` of the device's memory; None: the device's (required on CPU).
        loss_scale: an ``ax.DynamicLossScale`` for fp16; None uses its defaults.
        seed: the PRNG key's seed (and python's, numpy's, torch's if loaded), the same on every
            process.
        reduce_dtype: what gradients travel in between devices, on every strategy: ``"fp32"``
            (None: the default), ``"bf16"`` or ``"fp16"`` (``fp16-mixed`` only). The window is
            summed in float32 and cast only for its reduction (``accumix.jax.wire``);
            ``acc.effective_dtypes`` states what runs.

    Raises:
        ConfigError: an unknown word, ``"deepspeed"``, or batch sizes that do not divide.
    """

    def __init__(
        self,
        strategy: str | JaxStrategy = "auto",
        precision: str = "auto",
        grad_accum_steps: int | None = None,
        global_batch_size: int | None = None,
        micro_batch_size: int | str | None = None,
        loss_scale: DynamicLossScale | None = None,
        seed: int = 0,
        memory_limit: int | str | None = None,
        reduce_dtype: Any = None,
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed={seed!r} is invalid; use an integer")
        self.launch = distributed.initialize()
        configure_logging(jax.process_index())
        self._strategy_word = strategy
        self._strategy = resolve_jax_strategy(strategy)
        self.policy = with_reduce_dtype(resolve_jax_policy(precision, jax.devices()[0].platform),
                                        reduce_dtype)
        self._connect()
        check_loss_scale_use(loss_scale, precision=precision, chosen=self.policy.name,
                             scales=self.policy.needs_loss_scaling)
        self.scaler = LossScaleRule(
            (loss_scale or DynamicLossScale()) if self.policy.needs_loss_scaling else None)
        check_micro_batch_word(micro_batch_size, global_batch_size)
        self._memory_limit = parse_memory_limit(memory_limit, device_total=device_total_bytes())
        self._batch_sizes = (grad_accum_steps, global_batch_size, micro_batch_size)
        self._grad_accum_steps = self._derive_steps(
            None if is_auto(micro_batch_size) else micro_batch_size)
        self.seed = seed
        random.seed(seed)
        np.random.seed(seed % 2**32)
        if "torch" in sys.modules:  # a torch DataLoader's workers draw their seeds from it
            sys.modules["torch"].manual_seed(seed)
        self._optimizer: optax.GradientTransformation | None = None
        self._shardings: TrainState | None = None
        self._loader: WindowLoader | None = None
        self._pending_save: Any = None  # a background save in flight (checkpoint_save.py)
        self._micro_batch_choice: MicroBatchChoice | None = None
        distributed.check_same_config((self.policy.name, self._batch_sizes, seed,
                                       None if loss_scale is None else repr(loss_scale),
                                       jax.numpy.dtype(self.policy.reduce_dtype).name))

    # -- read-only state -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's index in the job (``jax.process_index()``)."""
        return jax.process_index()

    @property
    def world_size(self) -> int:
        """The number of processes (``jax.process_count()``); devices: ``num_devices``."""
        return jax.process_count()

    @property
    def num_devices(self) -> int:
        """Devices in the mesh, over every process."""
        return self.strategy.num_devices

    @property
    def local_devices(self) -> int:
        """Devices in the mesh that this process drives."""
        return sum(d.process_index == jax.process_index() for d in self.strategy.mesh.devices.flat)

    @property
    def is_main_process(self) -> bool:
        """Whether this is process 0 (the one that prints, logs and writes single files)."""
        return jax.process_index() == 0

    @property
    def strategy(self) -> JaxStrategy:
        """The strategy in force.

        Raises:
            ConfigError: under ``strategy="auto"`` before ``setup`` chose one.
        """
        if self._strategy is None:
            raise ConfigError("strategy='auto' is chosen at acc.setup(params, optimizer); "
                              "call setup first")
        return self._strategy

    @property
    def effective_dtypes(self) -> EffectiveDtypes:
        """The dtypes the run really uses: params, compute, gradient accumulation (float32),
        the reduction (and how often it runs), the optimizer's masters (logged at setup)."""
        wire = self.strategy.wire
        return effective_dtypes(self.policy, reduction=wire.dtype if wire.devices > 1 else
                                "none", reductions=self.strategy.reductions())

    def _connect(self) -> None:
        """Hands the chosen strategy the reduce dtype (once it is known: ``auto`` at setup)."""
        if self._strategy is not None:
            self._strategy.connect(jax.numpy.dtype(self.policy.reduce_dtype).name)

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step over all processes, as given."""
        return self._batch_sizes[1]

    @property
    def micro_batch_size(self) -> int | str | None:
        """Samples per micro-step of one process as set: the given number, ``"auto"`` until
        ``find_micro_batch_size`` chose (then the choice), or None (the loader's)."""
        return self._batch_sizes[2]

    @property
    def memory_limit(self) -> int | None:
        """What ``micro_batch_size="auto"`` may use per device, in bytes (None: unknown)."""
        return self._memory_limit

    @property
    def optimizer(self) -> optax.GradientTransformation | None:
        """The optax optimizer given to ``setup`` (None before)."""
        return self._optimizer

    @property
    def state_shardings(self) -> TrainState | None:
        """The ``TrainState``'s shardings on the mesh, as ``setup`` placed it (None before)."""
        return self._shardings

    @property
    def loader(self) -> WindowLoader | None:
        """The DataLoader set up (as windows), whose position checkpoints keep; or None."""
        return self._loader

    @property
    def grad_accum_steps(self) -> int:
        """K, the micro-batches of one jitted optimizer step.

        Raises:
            ConfigError: ``global_batch_size`` without ``micro_batch_size`` before a loader
                was set up to take it from.
        """
        if self._grad_accum_steps is None:
            raise ConfigError("global_batch_size was given without micro_batch_size and no "
                              "DataLoader was set up to take it from; pass micro_batch_size=")
        return self._grad_accum_steps

    def peak_flops(self) -> float | None:
        """One device's datasheet bf16 peak FLOP/s (for MFU): GPUs only, half precision only."""
        device = jax.local_devices()[0]
        if device.platform != "gpu" or self.policy.compute_dtype == jax.numpy.float32:
            return None
        return peak_flops_by_name(device.device_kind)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def gather(self, data: Any) -> Any:
        """Every process's rows (a pytree of numpy or process-local arrays) concatenated along
        dim 0 in process order, 0-dim leaves stacked, as numpy arrays; the first dimension may
        differ between processes, nothing else (``ConfigError`` on every process, naming each
        one's shape). Collective.

        Args:
            data: this process's rows: an array or a pytree of them.
        """
        return process_gather.gather(data)

    def _derive_steps(self, micro_batch_size: int | None) -> int | None:
        steps, global_batch, _ = self._batch_sizes
        return derive_grad_accum_steps(grad_accum_steps=steps, global_batch_size=global_batch,
                                       micro_batch_size=micro_batch_size,
                                       dp_world_size=jax.process_count())

    # -- setup -----------------------------------------------------------------------------
    def setup(self, params: Any, optimizer: optax.GradientTransformation,
              loader: Any = None, *, loss_fn: LossFn | None = None,
              batch: Any = None) -> TrainState | tuple[TrainState, WindowLoader]:
        """Places ``params`` and a fresh optimizer state on the mesh, per the strategy.

        Args:
            params: a pytree of arrays (numpy or jax), the same on every process.
            optimizer: an optax ``GradientTransformation``.
            loader: a torch ``DataLoader`` (optional): returned as windows of K batches,
                sharded over processes, resumable mid-epoch.
            loss_fn: with ``batch``, for ``strategy="auto"``: each candidate's window step
                for this ``loss_fn`` is compiled (never run) and sized with its activations,
                the numbers ``accumix estimate-memory`` prints; without them ``auto`` sizes
                the params and optimizer state alone.
            batch: one micro-batch of this process's rows (a pytree of arrays or
                ``jax.ShapeDtypeStruct``), as ``acc.window`` takes them.

        Returns:
            The ``TrainState``, or ``(state, window_loader)`` when a loader is given.

        Raises:
            ConfigError: an optimizer that is not optax's, params without arrays, a loader
                that is not a torch DataLoader, ``loss_fn`` without ``batch`` (or the other
                way round), a batch the local devices do not divide.
        """
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise ConfigError(f"optimizer {type(optimizer).__name__} is not an optax "
                              "GradientTransformation; pass e.g. optax.adamw(3e-4)")
        leaves = jax.tree.leaves(params)
        if not leaves or not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
            raise ConfigError("params must be a pytree of arrays (numpy or jax)")
        if self._strategy is None or jax.process_count() > 1:
            free = agreed_free_bytes()  # a collective: every process joins, "auto" or not
        if (loss_fn is None) != (batch is None):
            raise ConfigError("acc.setup(loss_fn=, batch=) go together: pass both (one "
                              "micro-batch of this process's rows) or neither")
        if self._strategy is None:  # every process the same: from the minimum free memory
            sized = None
            if loss_fn is not None:  # each row from its compiled window step for loss_fn
                from accumix.jax.compiled_memory import sizing

                steps = self._grad_accum_steps or (self._derive_steps(loader.batch_size)
                                                   if getattr(loader, "batch_size", None)
                                                   else self.grad_accum_steps)
                sized = sizing(loss_fn, params, optimizer, batch, grad_accum_steps=steps,
                               precision=self.policy.name)
            self._strategy = choose_auto(params, optimizer, precision=self.policy.name,
                                         free_bytes=free, sized=sized)
        self._connect()
        distributed.check_same_config((repr(self._strategy),))  # the choice, not the word "auto"
        self._optimizer = optimizer
        strategy = self.strategy
        state = initial_state(params, optimizer, strategy=strategy, policy=self.policy,
                              scaler=self.scaler, seed=self.seed)
        self._shardings = jax.tree.map(lambda x: x.sharding, state)
        log.info("accumix.jax: strategy %s on %d devices (%d processes), precision %s, K=%s; "
                 "%s", strategy.name, strategy.num_devices, jax.process_count(),
                 self.policy.name, self._grad_accum_steps, self.effective_dtypes.describe())
        if loader is None:
            return state
        return state, self._wrap_loader(loader)

    def find_micro_batch_size(self, state: TrainState, loss_fn: LossFn,
                              make_batch: Callable[[int], Any], *,
                              clip_norm: float | None = None,
                              headroom: float = DEFAULT_HEADROOM,
                              run_dir: str | os.PathLike[str] | None = None) -> int:
        """``micro_batch_size="auto"``: the choice read from the compiled step (never run); K
        follows. Collective.

        Call it after ``state = acc.setup(params, optimizer)``, before building windows or
        ``acc.setup_loader(loader)``; nothing in ``state`` changes.

        Args:
            state: the set-up state (its shapes and shardings are read).
            loss_fn: as for ``train_step`` (the same compiled step is sized).
            make_batch: ``make_batch(n)``: this process's micro-batch of n rows (numpy
                arrays), the longest the data can give.
            clip_norm: as for ``train_step``.
            headroom: the fraction of the memory limit left free.
            run_dir: where the answer is cached (``micro_batch_auto.json``); a restart with the
                same settings reuses it, one on another world size chooses again.

        Returns:
            The chosen micro-batch size (this process's rows per micro-step).

        Raises:
            ConfigError: ``micro_batch_size`` is not ``"auto"`` or setup was not called; no
                memory limit known (the CPU backend reports none: pass ``memory_limit=`` in
                bytes); not even one row fits on some process.
        """
        choice = find(self, state, loss_fn, make_batch, clip_norm=clip_norm, headroom=headroom,
                      run_dir=run_dir)
        self._micro_batch_choice = choice  # what the loader is re-batched to
        self._batch_sizes = (self._batch_sizes[0], self._batch_sizes[1], choice.micro_batch_size)
        self._grad_accum_steps = choice.grad_accum_steps
        return choice.micro_batch_size

    @property
    def micro_batch_choice(self) -> MicroBatchChoice | None:
        """What ``micro_batch_size="auto"`` chose and why (None before, or without auto)."""
        return self._micro_batch_choice

    def setup_loader(self, loader: Any) -> WindowLoader:
        """A torch ``DataLoader`` as windows of K batches (``setup``'s third argument, for a
        loader set up after ``find_micro_batch_size``, re-batched to the chosen size).

        Args:
            loader: a torch ``DataLoader``; its dataset, sampler, collate_fn and workers are
                kept, sharded over the processes.
        """
        return self._wrap_loader(loader)

    def _wrap_loader(self, loader: Any) -> WindowLoader:
        loader = checked_loader(loader, micro_batch_size=self._batch_sizes[2],
                                choice=self._micro_batch_choice)
        if self._grad_accum_steps is None and loader.batch_size:
            self._grad_accum_steps = self._derive_steps(loader.batch_size)
        self._loader = window_loader(loader, grad_accum_steps=self.grad_accum_steps,
                                     seed=self.seed, make=self.window)
        return self._loader

    # -- the step --------------------------------------------------------------------------
    def window(self, micro_batches: list[Any]) -> Window:
        """This process's micro-batches as one global window for the step.

        Args:
            micro_batches: 1 to K pytrees of numpy arrays, each this process's rows of one
                micro-step; fewer than K is a short window, masked (no recompilation).
        """
        return make_window(list(micro_batches), grad_accum_steps=self.grad_accum_steps,
                           strategy=self.strategy, local_devices=self.local_devices)

    def train_step(self, loss_fn: LossFn, clip_norm: float | None = None, *,
                   check_every: int = 100) -> TrainStep:
        """The jitted window step for ``loss_fn``; call it as ``state, metrics = step(state,
        window)``.

        Args:
            loss_fn: ``loss_fn(params, batch, rng)`` of one micro-batch's rows on one device,
                returning the mean loss, or ``(loss_sum, num_items)`` for item-weighted
                accumulation; either may add an ``aux`` pytree as a last element (its mean over
                micro-steps and devices comes back as ``metrics["aux"]``).
            clip_norm: clip the true gradients' global norm to this (torch's rule), or None.
            check_every: read the fp16 floor flag every this many steps (one host sync).

        Raises:
            ConfigError: ``setup`` not called yet, or a bad ``clip_norm`` / ``check_every``.
        """
        if self._optimizer is None or self._shardings is None:
            raise ConfigError("call state = acc.setup(params, optimizer) before acc.train_step")
        if clip_norm is not None and not (isinstance(clip_norm, (int, float)) and clip_norm > 0):
            raise ConfigError(f"clip_norm={clip_norm!r} is invalid; use a number > 0 or None")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ConfigError(f"check_every={check_every!r} is invalid; use an integer >= 1")
        jitted = build_step(loss_fn, optimizer=self._optimizer, strategy=self.strategy,
                            policy=self.policy, scaler=self.scaler,
                            grad_accum_steps=self.grad_accum_steps,
                            clip_norm=None if clip_norm is None else float(clip_norm),
                            state_shardings=self._shardings)
        return TrainStep(jitted, self, check_every)

    def eval_step(self, loss_fn: LossFn) -> EvalStep:
        """A jitted evaluation of one batch: ``loss_sum, num_items = evaluate(state, batch)``.

        ``batch`` is this process's rows (a pytree of numpy arrays); ``loss_fn`` is called with
        ``rng=None``. Pass ``weight=0.0`` on a process that has run out of batches (it repeats
        one so that every process makes the same collective calls). The sums are device
        scalars over every process: add them up and read them once.
        """
        if self._shardings is None:
            raise ConfigError("call state = acc.setup(params, optimizer) before acc.eval_step")
        jitted = build_eval(loss_fn, strategy=self.strategy, policy=self.policy,
                            state_shardings=self._shardings)
        return EvalStep(jitted, self)

    def check(self, state: TrainState) -> None:
        """Raises ``LossScaleError`` if fp16 overflowed at the loss-scale floor (a host read).

        Args:
            state: the train state the step returned.
        """
        self.scaler.check(state.loss_scale)

    # -- checkpoints and weights -----------------------------------------------------------
    def save_state(self, run_dir: str | os.PathLike[str], state: TrainState,
                   keep_last: int | None = None, *,
                   extra_state: dict[str, Any] | None = None,
                   before_publish: Callable[[Any], None] | None = None,
                   background: bool = False) -> Any:
        """Writes ``run_dir/step-N`` (N = ``state.step``) atomically, then ``run_dir/latest``.

        The state (params, optimizer state, loss scale, step, PRNG key) goes through orbax,
        sharded; each process's host RNGs and the set-up loader's epoch and position go
        beside it; ``extra_state`` (JSON-safe, process 0's) goes into ``meta.json``, read back
        with ``accumix.checkpoint.extra_state``; ``before_publish(tmp_step_dir)`` (every process)
        writes more files into the step directory before it is published. Collective: every
        process calls it, between windows. ``run_dir``: a directory every process sees, or an
        object store URL (``s3://...``, through a local staging copy: ``checkpoint_save.py``).
        ``background``: return once orbax has the state on the host; the write and publish go
        on in a thread (the next save, ``load_state``, ``wait_for_save``, ``end`` wait for it).

        Args:
            run_dir: the run's directory.
            state: the train state to save.
            keep_last: keep this many newest step directories, deleting older ones.
            extra_state: a JSON-safe dict stored with the checkpoint.
            before_publish: writes more files into the temporary step directory.

        Returns:
            The step directory written.

        Raises:
            LossScaleError: fp16 overflowed at the floor (nothing is written).
            ConfigError: ``extra_state`` is not JSON (nothing is written).
            CheckpointError: a run directory per process, or the previous background save
                failed.
        """
        self.check(state)
        return checkpoint_save.save(self, run_dir, state, keep_last=keep_last,
                                    extra_state=extra_state, before_publish=before_publish,
                                    background=background)

    def wait_for_save(self) -> Any:
        """Waits for the background save in flight (collective); its step directory, or None.

        Raises:
            CheckpointError: it failed on some process (every process raises it).
        """
        return checkpoint_save.finish(self, "acc.wait_for_save")

    def end(self) -> None:
        """Waits for the background save in flight (raising its error); call it at the end."""
        checkpoint_save.finish(self, "acc.end")

    def load_state(self, path: str | os.PathLike[str], state: TrainState) -> TrainState:
        """The state saved at ``path`` (a run directory's latest, or one step directory; a
        path or an object store URL), placed like ``state`` (this run's mesh: resharded if
        the device count differs).

        Raises:
            CheckpointError: a missing, torn or foreign checkpoint; the message names the file.
        """
        return checkpoint.load(self, path, state)

    def save_model(self, directory: str | os.PathLike[str], state: TrainState) -> Path:
        """Writes the params as ``directory/model.safetensors``: float32, keys ``"a.b.c"``.

        Collective; process 0 writes. The torch side's ``init_from`` reads it.

        Args:
            directory: created if needed.
            state: the train state whose params are written.

        Returns:
            The file's path.
        """
        return checkpoint.save_model(self, Path(directory), state)

