"""Schedulers on timm's protocol (issue 24 item 6): accepted by setup, ``step_update`` once per
real optimizer step with the real count (none on an fp16-skipped step), ``step(epoch)`` as
called, state saved and restored. timm cannot be installed here (it pulls another torch): the
double below follows its ``Scheduler`` (state_dict = its ``__dict__`` without the optimizer)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accumix as ax

K, WINDOWS, OVERFLOW_WINDOW, SAVE_AT = 2, 6, 2, 3


class CosineLikeTimm:
    """timm's ``CosineLRScheduler`` protocol, per update (``t_in_epochs=False``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, t_initial: int) -> None:
        self.optimizer = optimizer
        self.t_initial = t_initial
        self.base_values = [g["lr"] for g in optimizer.param_groups]
        self.updates: list[int] = []
        self.epochs: list[int] = []

    def _lr(self, t: int, base: float) -> float:
        return 0.5 * base * (1 + math.cos(math.pi * min(t, self.t_initial) / self.t_initial))

    def step(self, epoch: int, metric: Any = None) -> None:
        self.epochs.append(epoch)

    def step_update(self, num_updates: int, metric: Any = None) -> None:
        self.updates.append(num_updates)
        for group, base in zip(self.optimizer.param_groups, self.base_values, strict=True):
            group["lr"] = self._lr(num_updates, base)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _run(run_dir: Path, *, resume: bool) -> tuple[CosineLikeTimm, nn.Module, ax.Accelerator]:
    with pytest.warns(UserWarning, match="emulated"):
        acc = ax.Accelerator(strategy="single", precision="fp16-mixed", grad_accum_steps=K,
                             seed=0, loss_scale=ax.DynamicLossScale(init_scale=2.0**8))
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = CosineLikeTimm(opt, t_initial=WINDOWS)
    model, opt, wrapped = acc.setup(model, opt, sched)
    if resume:
        acc.load_state(run_dir)
    start = SAVE_AT if resume else 0
    for window in range(start, WINDOWS):
        for micro in range(K):
            g = torch.Generator().manual_seed(10 * window + micro)
            x, y = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
            with acc.accumulate():
                loss = nn.functional.mse_loss(model(x), y)
                if window == OVERFLOW_WINDOW:
                    loss = loss * math.inf  # the fp16 step is skipped
                acc.backward(loss)
                opt.step()
                wrapped.step_update(num_updates=window * K + micro)  # a micro-step count
                opt.zero_grad()
        if not resume and window + 1 == SAVE_AT:
            acc.save_state(run_dir)
    wrapped.step(epoch=1)  # an epoch end goes through as called
    return sched, model, acc


def test_timm_scheduler_steps_with_real_updates_and_resumes(tmp_path: Path) -> None:
    full, model, acc = _run(tmp_path, resume=False)
    # One call per real step, with the real count: the overflow window has none.
    assert full.updates == [1, 2, 3, 4, 5], full.updates
    assert acc.optimizer_steps == 5 and full.epochs == [1]
    lr_full = acc._run.optimizers[0].param_groups[0]["lr"]
    assert lr_full == full._lr(5, 0.1)
    acc.end()
    resumed, model2, acc2 = _run(tmp_path, resume=True)
    assert resumed.updates == full.updates and resumed.epochs == [1]
    assert acc2._run.optimizers[0].param_groups[0]["lr"] == lr_full
    assert torch.equal(acc2.unwrap(model2).weight, acc.unwrap(model).weight)
    acc2.end()


class LambdaWithStepUpdate(torch.optim.lr_scheduler.LambdaLR):
    """A torch scheduler that also has a ``step_update`` method (a user's convenience): it is
    a torch scheduler, so ``step()`` must advance once per real optimizer step."""

    def step_update(self, num_updates: int, metric: Any = None) -> None:
        raise AssertionError("not called in this test")


def test_torch_scheduler_with_step_update_still_steps_once_per_real_step() -> None:
    acc = ax.Accelerator(strategy="single", grad_accum_steps=K, seed=0)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = LambdaWithStepUpdate(opt, lambda step: 0.5 ** step)
    model, opt, wrapped = acc.setup(model, opt, sched)
    for window in range(3):
        for micro in range(K):
            g = torch.Generator().manual_seed(10 * window + micro)
            with acc.accumulate():
                acc.backward(model(torch.randn(4, 3, generator=g)).sum())
                opt.step()
                wrapped.step()  # every micro-step, as in accelerate-style loops
                opt.zero_grad()
    # Plain PyTorch: one scheduler step per optimizer step, 3 steps -> lr 0.5**3.
    assert sched.last_epoch == 3, sched.last_epoch
    assert opt.param_groups[0]["lr"] == 0.5 ** 3
    acc.end()
