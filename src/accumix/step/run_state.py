"""The state of one Accelerator's run: one object that the pieces of the step take.

The façade (``accelerator.py``) builds it and keeps it (privately); ``step/``,
``checkpoint/``, ``memory/`` and ``runtime/fault.py`` read and change it, and never the
façade's attributes. Everything a run holds that changes while it runs is here, grouped by
who changes it:

* **where it runs** (fixed once set up): ``launch``, ``device``, ``policy``, ``strategy``
  (swapped once, by ``strategy="auto"`` at the first model), ``compile``, ``seed``,
  ``memory_limit``;
* **the batch geometry**: ``batch_sizes`` as given (the micro batch replaced by ``auto``'s
  choice), the ``window`` (K, the micro-step, the window index), whether K is known yet and
  whether the user assigned it;
* **what was set up**: ``models``, ``optimizers``, ``schedulers``, ``loaders`` (wrapped, in
  set-up order, which checkpoints follow), the ids of the objects the user handed in;
* **the step**: whether a micro-step is open and for which models, the window's record
  across optimizers, the optimizer steps taken and whether the last was skipped;
* **faults**: the pre-emption handler, the watchdog, and the collectives accumix entered
  between windows (the watchdog's progress and the label of the one in flight);
* **background saves**: the one in flight and the process group its thread uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from accumix.step.boundary import StepRecord

if TYPE_CHECKING:
    import torch
    from torch import nn

    from accumix.common.launch_env import LaunchEnv
    from accumix.common.micro_batch_search import MicroBatchChoice
    from accumix.data.eval_loader import EvalLoader
    from accumix.data.loader import AcceleratedDataLoader
    from accumix.precision import Policy
    from accumix.runtime.fault import PreemptionHandler, Watchdog
    from accumix.step.accumulation import AccumulationWindow
    from accumix.step.compile import Compiler
    from accumix.step.optim import AcceleratedOptimizer, AcceleratedScheduler
    from accumix.strategies.base import Strategy

BatchSizes = tuple["int | None", "int | None", "int | str | None"]


@dataclass(kw_only=True, eq=False)
class RunState:
    """One run's mutable state (see the module docstring for who changes what)."""

    # where it runs
    launch: LaunchEnv
    device: torch.device
    policy: Policy
    strategy: Strategy
    compile: Compiler | bool | None
    seed: int | None
    memory_limit: int | None
    auto_strategy: bool  # "auto" in a world > 1: the memory model chooses at the first model
    # the batch geometry
    batch_sizes: BatchSizes  # (grad_accum_steps, global_batch_size, micro_batch_size)
    window: AccumulationWindow
    steps_known: bool  # K is known (else it comes from the first loader's batch size)
    steps_assigned: bool = False  # the user assigned K (load_state keeps it)
    micro_batch_choice: MicroBatchChoice | None = None
    # what was set up
    models: list[nn.Module] = field(default_factory=list)
    optimizers: list[AcceleratedOptimizer] = field(default_factory=list)
    schedulers: list[AcceleratedScheduler] = field(default_factory=list)
    loaders: list[AcceleratedDataLoader] = field(default_factory=list)
    eval_loaders: list[EvalLoader] = field(default_factory=list)  # not checkpointed
    # The objects handed to setup, by id; held, so that no new object can take a freed one's id
    # (``train = acc.setup(train)`` frees the user's DataLoader; the next model may reuse it).
    set_up: dict[int, object] = field(default_factory=dict)
    # the step
    in_micro_step: bool = False
    micro_step_models: tuple[nn.Module, ...] = ()  # accumulate()'s models; (): every model
    step: StepRecord = field(default_factory=StepRecord)
    optimizer_steps: int = 0
    step_was_skipped: bool = False
    # faults
    preemption: PreemptionHandler | None = None
    watchdog: Watchdog | None = None
    sync_points: int = 0  # accumix's collectives entered between windows (watchdog progress)
    sync_label: str = ""  # the one in flight, for the diagnosis of a hang
    # checkpoints written behind the loop (checkpoint/background.py)
    pending_save: Any = None  # the save in flight, at most one
    checkpoint_group: Any = None  # the checkpoint thread's own process group
    timeout: float | None = None  # seconds a collective may wait (the Accelerator's)

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def is_main_process(self) -> bool:
        return self.launch.rank == 0

    @property
    def grad_accum_steps(self) -> int:
        return self.window.grad_accum_steps

    @property
    def is_boundary(self) -> bool:
        """The current (or last) micro-step ends the window (``acc.sync_gradients``)."""
        return self.window.is_boundary
