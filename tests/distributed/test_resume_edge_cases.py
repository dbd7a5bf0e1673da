"""Issue 14 on 2 ranks (gloo): an optimizer parameter without gradients under fsdp, and
a pre-emption signal on one rank in an epoch's last window. One spawn saves, a second one (new
processes and process group) resumes; both must end bit-identical to the uninterrupted run.

48 samples in micro-batches of 2 on 2 ranks, K=3: 4 windows an epoch, 2 epochs.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

import accumix as ax
from accumix.testing import spawn
from tests.scripts.resumable_train import build, dataset, params, train

EPOCHS = 2
UNUSED_HEAD = ["fsdp"]  # ddp shares the code path (one process: tests/unit)


class _WithUnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
        self.extra = nn.Linear(16, 3)  # in the optimizer, never in the forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _build_unused_head(acc: ax.Accelerator) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = _WithUnusedHead()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    return acc.setup(model, opt, DataLoader(dataset(), batch_size=2, shuffle=True), sched)


def _acc(strategy: str) -> ax.Accelerator:
    return ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=3, seed=0)


def _job(strategy: str, builder: Any, *, load: str | None = None, **kwargs: Any
         ) -> dict[str, np.ndarray]:
    acc = _acc(strategy)
    objects = builder(acc)
    if load is not None:
        torch.manual_seed(1234)
        acc.load_state(load)
    train(acc, objects, epochs=EPOCHS, **kwargs)
    return {k: v.float().numpy() for k, v in params(acc, objects[0]).items()}


class _Stop(Exception):
    pass


def _preempt_last_window(run_dir: str) -> int:
    acc = _acc("ddp")
    objects = build(acc)
    handler = acc.handle_preemption(run_dir, exit=False)

    def hook(acc: ax.Accelerator) -> None:
        # Rank 1 only, one micro-step into window 4: the last of epoch 0.
        if (acc.rank == 1 and acc.optimizer_steps == 3 and acc._window.micro_step == 1):
            os.kill(os.getpid(), signal.SIGTERM)
        if handler.triggered:
            raise _Stop

    try:
        train(acc, objects, epochs=EPOCHS, after_micro_step=hook)
    except _Stop:
        pass
    return acc.optimizer_steps


def _save(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in UNUSED_HEAD:
        out[strategy] = _job(strategy, _build_unused_head)
        _job(strategy, _build_unused_head, run_dir=f"{tmp}/{strategy}", save_at={2}, stop_at=2)
    out["preempted-at"] = _preempt_last_window(f"{tmp}/preempted")
    out["ddp-plain"] = _job("ddp", build)
    return out


def _resume(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {s: _job(s, _build_unused_head, load=f"{tmp}/{s}") for s in UNUSED_HEAD}
    out["preempted"] = _job("ddp", build, load=f"{tmp}/preempted")
    return out


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(torch.from_numpy(a[k]), torch.from_numpy(b[k])) for k in a)


def test_resume_edge_cases_on_two_ranks(tmp_path: Path) -> None:
    saved = spawn(_save, nprocs=2, args=(str(tmp_path),))[0]
    assert saved["preempted-at"] == 4  # saved at the boundary that ends epoch 0
    assert (tmp_path / "preempted" / "latest").read_text() == "step-4\n"
    resumed = spawn(_resume, nprocs=2, args=(str(tmp_path),))[0]
    diffs = {s: _max_diff(resumed[s], saved[s]) for s in UNUSED_HEAD}
    diffs["preempted"] = _max_diff(resumed["preempted"], saved["ddp-plain"])
    assert diffs == {"fsdp": 0.0, "preempted": 0.0}, diffs
    for strategy in UNUSED_HEAD:
        assert "extra.weight" in resumed[strategy]
        assert _equal(resumed[strategy], saved[strategy]), strategy
    assert _equal(resumed["preempted"], saved["ddp-plain"])
