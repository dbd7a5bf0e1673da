"""Issues 14 and 12 on 2 ranks (gloo): an optimizer parameter without gradients under fsdp, a
pre-emption signal on one rank in an epoch's last window, and a dataset drawing random
augmentation (torch, numpy, python) under ddp and fsdp with 0 and 2 DataLoader workers. One
spawn saves mid-epoch, a second one (new processes and process group) resumes; each must end
bit-identical to the uninterrupted run.

48 samples in micro-batches of 2 on 2 ranks, K=3: 4 windows an epoch, 2 epochs.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

import accumix as ax
from accumix.testing import spawn
from tests.scripts.resumable_train import build, build_unused_head, dataset, params, train

EPOCHS = 2
UNUSED_HEAD = ["fsdp"]  # ddp shares the code path (one process: tests/unit)
# (strategy, num_workers); persistent workers: tests/unit/test_data.py (a persistent
# iterator dropped mid-epoch takes torch 20 s to shut down here).
AUGMENTED = [("ddp", 0), ("ddp", 2), ("fsdp", 0), ("fsdp", 2)]


class _Augmented(Dataset):
    """The resumable job's samples with noise from all three global RNGs, drawn per read."""

    def __init__(self) -> None:
        self.data = dataset()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[index]
        noise = 0.1 * torch.randn(6) + float(np.random.normal(0, 0.1)) + 0.1 * random.random()
        return x + noise, y


def _build_augmented(acc: ax.Accelerator, num_workers: int) -> tuple[Any, ...]:
    # Workers forked, as under torchrun (these ranks were spawned: spawned workers would
    # re-import torch, seconds each).
    workers = {"num_workers": num_workers, "multiprocessing_context": "fork"} if (
        num_workers) else {}
    return build(acc, data=_Augmented(), **workers)


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
        if (acc.rank == 1 and acc.optimizer_steps == 3 and acc._run.window.micro_step == 1):
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
        out[strategy] = _job(strategy, build_unused_head)
        _job(strategy, build_unused_head, run_dir=f"{tmp}/{strategy}", save_at={2}, stop_at=2)
    out["preempted-at"] = _preempt_last_window(f"{tmp}/preempted")
    out["ddp-plain"] = _job("ddp", build)
    for strategy, workers in AUGMENTED:
        def builder(acc: ax.Accelerator, workers: int = workers) -> tuple[Any, ...]:
            return _build_augmented(acc, workers)
        name = f"{strategy}-aug-{workers}"
        if not workers:  # the uninterrupted run: with workers it must be the same model
            out[name] = _job(strategy, builder)
        # Step 5: two batches into epoch 1's second window (mid-epoch, mid-worker-prefetch).
        _job(strategy, builder, run_dir=f"{tmp}/{name}", save_at={5}, stop_at=5)
    return out


def _resume(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {s: _job(s, build_unused_head, load=f"{tmp}/{s}") for s in UNUSED_HEAD}
    out["preempted"] = _job("ddp", build, load=f"{tmp}/preempted")
    for strategy, workers in AUGMENTED:
        name = f"{strategy}-aug-{workers}"
        out[name] = _job(strategy, lambda acc, w=workers: _build_augmented(acc, w),
                         load=f"{tmp}/{name}")
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
    for strategy, workers in AUGMENTED:
        # The augmentation depends on the sample only: resumed with 2 workers, the model is the
        # one trained uninterrupted with none.
        diffs[f"{strategy}-aug-{workers}"] = _max_diff(resumed[f"{strategy}-aug-{workers}"],
                                                      saved[f"{strategy}-aug-0"])
    assert diffs == dict.fromkeys(diffs, 0.0), diffs
    for strategy, workers in AUGMENTED:
        assert _equal(resumed[f"{strategy}-aug-{workers}"], saved[f"{strategy}-aug-0"])
    for strategy in UNUSED_HEAD:
        assert "extra.weight" in resumed[strategy]
        assert _equal(resumed[strategy], saved[strategy]), strategy
    assert _equal(resumed["preempted"], saved["ddp-plain"])
