"""The façade's read-only view of the run state: who and where this process is, the policy and
strategy in force, the step's counters, K (and its setter) and the micro-batch as set.

``Accelerator`` inherits these properties; each reads ``RunState`` (``run_state.py``), which the
façade builds and keeps as ``self._run``, and holds no logic (the setter hands K to
``accum_steps.assign``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accumix.step import accum_steps

if TYPE_CHECKING:
    import torch

    from accumix.common.launch_env import LaunchEnv
    from accumix.common.micro_batch_search import MicroBatchChoice
    from accumix.precision import Policy
    from accumix.precision.reduce_dtype import EffectiveDtypes
    from accumix.step.run_state import RunState
    from accumix.strategies import Strategy


class RunView:
    """The ``Accelerator``'s read-only properties (and ``grad_accum_steps``' setter) over its
    run state."""

    _run: RunState

    @property
    def launch(self) -> LaunchEnv:
        """Who this process is in the job (rank, world, local rank, master address)."""
        return self._run.launch

    @property
    def device(self) -> torch.device:
        """The device this process trains on (``cuda:<local_rank>``, else the CPU)."""
        return self._run.device

    @property
    def policy(self) -> Policy:
        """The precision policy in force (param, compute and reduce dtypes)."""
        return self._run.policy

    @property
    def effective_dtypes(self) -> EffectiveDtypes:
        """The dtypes the run really uses: parameters, compute, gradient accumulation, the
        reduction (and how often it runs) and the optimizer's masters (logged at setup)."""
        return self._run.strategy.effective_dtypes()

    @property
    def strategy(self) -> Strategy:
        """The strategy in force (after ``"auto"`` chose, at the first set-up model)."""
        return self._run.strategy

    @property
    def seed(self) -> int | None:
        """The seed given to the ``Accelerator`` (None: not seeded)."""
        return self._run.seed

    @property
    def rank(self) -> int:
        """This process's rank among all processes of the job (0 to ``world_size - 1``)."""
        return self._run.launch.rank

    @property
    def world_size(self) -> int:
        """The number of processes in the job, over every node."""
        return self._run.launch.world_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (its GPU index)."""
        return self._run.launch.local_rank

    @property
    def is_main_process(self) -> bool:
        """Whether this is rank 0 (the one that prints, logs and writes single files)."""
        return self._run.launch.rank == 0

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps really taken (a skipped fp16 step does not count)."""
        return self._run.optimizer_steps

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last boundary's step was skipped (an fp16 overflow)."""
        return self._run.step_was_skipped

    @property
    def grad_accum_steps(self) -> int:
        """K, the micro-steps per optimizer step. Assigning it changes K for the windows that
        follow (a ``GradientAccumulationScheduler`` does); ``load_state`` restores it.

        Raises:
            ConfigError: on assignment, a value that is not an integer >= 1, or a window is
                half done.
        """
        return self._run.window.grad_accum_steps

    @grad_accum_steps.setter
    def grad_accum_steps(self, steps: int) -> None:
        accum_steps.assign(self._run, steps)

    @property
    def sync_gradients(self) -> bool:
        """Whether the current (or last) micro-step ends the accumulation window."""
        return self._run.window.is_boundary

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale, or None when no loss scaling is in use."""
        return self._run.strategy.loss_scale

    @property
    def micro_batch_size(self) -> int | str | None:
        """Samples per forward on one rank as set: the given number, ``"auto"`` until
        ``find_micro_batch_size`` chose (then the choice), or None (the loader's)."""
        return self._run.batch_sizes[2]

    @property
    def micro_batch_choice(self) -> MicroBatchChoice | None:
        """What ``micro_batch_size="auto"`` chose and why (None before, or without auto)."""
        return self._run.micro_batch_choice
