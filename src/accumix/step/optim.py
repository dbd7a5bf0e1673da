"""Optimizer and LR-scheduler wrappers: calls that are no-ops off the boundary.

The user's loop calls ``optimizer.step()``, ``scheduler.step()`` and ``optimizer.zero_grad()``
on every micro-step; these wrappers let only the meaningful calls through:

* ``step()`` runs the Accelerator's boundary step (unscale, agree, step or skip) at a boundary
  and does nothing elsewhere;
* ``zero_grad()`` does nothing while this optimizer's gradients hold an unfinished window, so it
  may be called at the top of the loop or after the step alike (a window whose step the loop
  skipped is cleared by the window's end);
* the scheduler advances once per real optimizer step: never on a skipped fp16 step, never K or
  world-size times per step (accelerate #963, #1382).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from accumix.step import boundary, window_end
from accumix.step.boundary import WindowGrads

if TYPE_CHECKING:
    from accumix.step.run_state import RunState


class AcceleratedOptimizer(Optimizer):
    """The user's optimizer, stepped by the Accelerator. Shares its state and param groups."""

    def __init__(self, optimizer: Optimizer, run: RunState,
                 model: nn.Module | None = None) -> None:
        # Optimizer.__init__ is skipped on purpose: state and groups stay the inner optimizer's.
        self.optimizer = optimizer
        self._run = run
        self.model = model  # the set-up model whose parameters it steps
        self.window_grads = WindowGrads()  # what its gradients hold in the current window
        self.stepped_window = -1  # index of the last window whose step really ran

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """At a boundary: the Accelerator's step (unscale, overflow check, clip-aware step).

        With a closure (grad_accum_steps=1 only), each evaluation's gradients are finalized
        before the optimizer reads them, and the first evaluation's loss is returned, as torch
        returns it. Off the boundary: nothing, and None.
        """
        return boundary.optimizer_step(self._run, self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients, unless they hold a window that has not been stepped yet; on the
        boundary micro-step, a window the loop did not step is cleared by its end at the
        latest (``window_end.zero_grad``)."""
        window_end.zero_grad(self._run, self, set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def is_scheduler(obj: Any) -> bool:
    """A torch LR scheduler, or one on timm's protocol (``step_update(num_updates)`` per
    optimizer step, ``step(epoch)`` at epoch ends, an ``optimizer``, state dicts)."""
    return _is_torch_scheduler(obj) or _is_timm_like(obj)


def _is_torch_scheduler(obj: Any) -> bool:
    import torch

    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler,
                            torch.optim.lr_scheduler.ReduceLROnPlateau))


def _is_timm_like(obj: Any) -> bool:
    # A torch scheduler stays one even with a ``step_update`` method: its ``step()`` is per
    # optimizer step, not timm's per-epoch ``step(epoch)`` that goes through as called.
    return not _is_torch_scheduler(obj) and all(callable(getattr(obj, name, None)) for name in (
        "step_update", "step", "state_dict", "load_state_dict")) and isinstance(
        getattr(obj, "optimizer", None), Optimizer)


class AcceleratedScheduler:
    """An LR scheduler that advances only when its optimizer really stepped in this window.

    A scheduler on timm's protocol: ``step_update`` goes through once per real optimizer step
    (never on a skipped fp16 step), with ``num_updates`` = ``acc.optimizer_steps`` whatever
    the loop passes (a count of micro-steps or of skipped steps would be wrong), and
    ``step(epoch)`` goes through as called (an epoch end is one whatever its last step did).
    """

    def __init__(self, scheduler: Any, optimizer: AcceleratedOptimizer | None,
                 run: RunState) -> None:
        self.scheduler = scheduler
        self._optimizer = optimizer
        self._run = run
        self._stepped_window = -1

    def step(self, *args: Any, **kwargs: Any) -> None:
        if _is_timm_like(self.scheduler):
            self.scheduler.step(*args, **kwargs)
            return
        if self._advances():
            self.scheduler.step(*args, **kwargs)

    def step_update(self, num_updates: int | None = None, metric: Any = None) -> None:
        """timm's per-update call: once per real optimizer step, with the real step count."""
        if self._advances():
            self.scheduler.step_update(num_updates=self._run.optimizer_steps,
                                       metric=metric)

    def _advances(self) -> bool:
        """Whether a per-step call advances now: once per window whose step really ran."""
        window = self._run.window.index
        if self._optimizer is not None and self._optimizer.stepped_window != window:
            return False  # off the boundary, or the fp16 step was skipped
        if self._stepped_window == window:
            return False  # a second call in the same window (e.g. inside and after the context)
        self._stepped_window = window
        return True

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found normally: get_last_lr(), base_lrs, last_epoch, ...
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
