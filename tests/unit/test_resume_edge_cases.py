"""Issue 14: ways a resumed run came back wrong or not at all (one process each).

Every test compares the resumed run against the same job never interrupted, number for number.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as lrs

import accumix as ax

STEPS, SAVE_AT = 8, 3


# -- 1. every torch LR scheduler's state survives the checkpoint exactly ---------------------
def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: lrs.LambdaLR(o, lambda s: 0.9 ** s),
    "MultiplicativeLR": lambda o: lrs.MultiplicativeLR(o, lambda s: 0.8),
    "StepLR": lambda o: lrs.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: lrs.MultiStepLR(o, milestones=[2, 5], gamma=0.1),
    "ConstantLR": lambda o: lrs.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: lrs.LinearLR(o, start_factor=0.2, total_iters=6),
    "ExponentialLR": lambda o: lrs.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o: lrs.PolynomialLR(o, total_iters=6, power=2.0),
    "CosineAnnealingLR": lambda o: lrs.CosineAnnealingLR(o, T_max=5),
    "CosineAnnealingWarmRestarts": lambda o: lrs.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "CyclicLR": lambda o: lrs.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
    "OneCycleLR": lambda o: lrs.OneCycleLR(o, max_lr=0.2, total_steps=STEPS + 2),
    "ReduceLROnPlateau": lambda o: lrs.ReduceLROnPlateau(o, factor=0.5, patience=1),
    "SequentialLR": lambda o: lrs.SequentialLR(
        o, [lrs.ConstantLR(o, factor=0.1, total_iters=2), lrs.MultiStepLR(o, [2, 4], 0.5)],
        milestones=[3]),
    "ChainedScheduler": lambda o: lrs.ChainedScheduler(
        [lrs.MultiStepLR(o, milestones=[1, 4], gamma=0.1), lrs.ExponentialLR(o, gamma=0.9)]),
}


def _lr_run(make: Callable[[torch.optim.Optimizer], Any], *, steps: int,
            save: Path | None = None, load: Path | None = None) -> list[float]:
    acc = ax.Accelerator(strategy="single", precision="fp32", seed=0)
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = _sgd(model)
    model, opt, sched = acc.setup(model, opt, make(opt))
    if load is not None:
        acc.load_state(load)
    x = torch.ones(4, 2)
    lrs_seen = []
    for _ in range(steps):
        with acc.accumulate():
            loss = model(x).pow(2).mean()
            acc.backward(loss)
            opt.step()
            if isinstance(sched.scheduler, lrs.ReduceLROnPlateau):
                sched.step(1.0)  # a plateau: the LR falls after `patience` steps
            else:
                sched.step()
            opt.zero_grad()
        lrs_seen.append(opt.param_groups[0]["lr"])
    if save is not None:
        acc.save_state(save)
    return lrs_seen


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_lr_scheduler_resumes_exactly(name: str, tmp_path: Path) -> None:
    make = SCHEDULERS[name]
    reference = _lr_run(make, steps=STEPS)
    first = _lr_run(make, steps=SAVE_AT, save=tmp_path)
    rest = _lr_run(make, steps=STEPS - SAVE_AT, load=tmp_path)
    assert first + rest == reference, (name, first + rest, reference)
