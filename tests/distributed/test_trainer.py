"""The Trainer on 2 ranks: the logged window loss is the large batch's loss over both ranks, the
validation loss covers every sample exactly once (the val loader's sampler and ``drop_last``
keep the evaluated set of one process), and a SIGTERM on one rank stops both at the same
boundary with a checkpoint the restart continues bit for bit (issue 29 items 1, 2, 9)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, SubsetRandomSampler, WeightedRandomSampler

import accumix as ax
from accumix.errors import ConfigError
from accumix.trainer import Callback, Trainer
from tests import workloads as w
from tests.distributed.shared_spawn import shared_result


class _Collect(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.val: list[float] = []

    def on_optimizer_step(self, trainer: Trainer, metrics: Any) -> None:
        self.rows.append({"loss": metrics.loss, "items": metrics.items,
                          "samples": metrics.samples, "ranks": len(metrics.rank_busy_s)})

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.val.append(metrics["val_loss"])


def _run(mode: str) -> dict[str, Any]:
    # 48 samples, no shuffle: rank r gets samples r, r+2, ...; micro 3, K=2 -> a window covers
    # 12 consecutive samples over both ranks. lr=0, so every window sees the same parameters.
    data = w.sequence_data(48) if mode == "items" else w.regression_data(48)
    step_fn = w.item_loss if mode == "items" else w.mean_loss
    model = w.make_model(data.tensors[0].shape[-1])
    collect = _Collect()
    trainer = Trainer(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        train_loader=DataLoader(data, batch_size=3),
        accelerator=ax.Accelerator(precision="fp32", grad_accum_steps=2),
        # 21 validation samples in batches of 4: ranks hold 11 and 10 (3 batches each).
        val_loader=DataLoader(torch.utils.data.Subset(data, range(21)), batch_size=4),
        step_fn=step_fn, max_epochs=1, eval_every=2, progress_bar=False, callbacks=[collect])
    trainer.fit()
    return {"rows": collect.rows, "val": collect.val}


def _validation_sets() -> dict[str, Any]:
    """What each rank's Trainer evaluates for val loaders whose set an unsharded split
    changed: a sampler over a split of one dataset, drop_last; a sampler that cannot be
    split is refused at construction, on every rank."""
    data = w.regression_data(40)

    def validate(loader: DataLoader) -> dict[str, float]:
        model = w.make_model()
        return Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                       train_loader=DataLoader(data, batch_size=4), val_loader=loader,
                       max_steps=1, accelerator=ax.Accelerator(precision="fp32"),
                       step_fn=w.mean_loss, progress_bar=False).validate()

    out: dict[str, Any] = {
        # ids 30..39 held out: one process evaluated 10 samples, two evaluated all 40
        "subset": validate(DataLoader(data, batch_size=4,
                                      sampler=SubsetRandomSampler(range(30, 40)))),
        # 37 samples, batch 4: one process evaluates 36, two evaluated 32
        "drop_last": validate(DataLoader(torch.utils.data.Subset(data, range(37)),
                                         batch_size=4, drop_last=True)),
    }
    try:
        validate(DataLoader(data, batch_size=4, sampler=WeightedRandomSampler([1.0] * 40, 10)))
        out["weighted"] = "accepted"
    except ConfigError as exc:
        out["weighted"] = str(exc)
    return out


class _TermOnRank1(Callback):
    """Rank 1 alone gets SIGTERM in the middle of step 3's window."""

    def on_train_batch_start(self, trainer: Trainer, batch: Any) -> None:
        if trainer.accelerator.rank == 1 and (trainer.step, trainer.micro_step) == (2, 1):
            os.kill(os.getpid(), signal.SIGTERM)


def _preemptable(run_dir: Path, *callbacks: Callback) -> list[torch.Tensor] | tuple:
    """Shuffled data, dropout, Adam, K=2 on 2 ranks; the parameters at the end, or what the
    pre-emption reported."""
    data = w.regression_data(48)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1))
    trainer = Trainer(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        train_loader=DataLoader(data, batch_size=3, shuffle=True),
        accelerator=ax.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=2,
                                   seed=0),
        step_fn=w.mean_loss, max_steps=6, checkpoint_every=4, run_dir=run_dir,
        loggers=["csv"], progress_bar=False, callbacks=list(callbacks))
    try:
        trainer.fit()
    except ax.Preempted as exc:
        return ("preempted", exc.code, exc.step, (run_dir / "latest").read_text().strip(),
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    return [p.detach().clone() for p in model.parameters()]


def _preemption(tmp: Path) -> dict[str, Any]:
    reference = _preemptable(tmp / "reference")
    stopped = _preemptable(tmp / "run", _TermOnRank1())
    resumed = _preemptable(tmp / "run")
    from accumix.trainer.run_lock import lock_run_dir

    held = lock_run_dir(tmp / "busy") if int(os.environ["RANK"]) == 0 else None
    try:  # another job's live lock: one agreed error on every rank, no collective failure
        _preemptable(tmp / "busy")
        refused: Any = "ran"
    except ConfigError as exc:
        refused = (str(exc).split(";")[0], getattr(exc, "every_rank", False))
    finally:
        if held is not None:
            held.release()
    return {"stopped": stopped, "bitwise": all(torch.equal(a, b) for a, b in zip(
        resumed, reference, strict=True)), "refused": refused}


def _job(tmp: Path) -> dict[str, Any]:
    return {"items": _run("items"), "mean": _run("mean"), "validation": _validation_sets(),
            "preemption": _preemption(tmp)}


def shared_job(tmp: Path) -> tuple[Any, tuple[Any, ...]]:
    """This module's job, run in the spawn it shares with other modules (conftest.py)."""
    return _job, (tmp,)


@pytest.fixture(scope="module")
def results(shared_spawn: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return shared_result(shared_spawn, __name__)


def test_item_window_loss_is_the_large_batch_loss_over_both_ranks(results: Any) -> None:
    data, model = w.sequence_data(48), w.make_model(4)
    expected = []
    for first in range(0, 48, 12):
        loss_sum, items = w.item_loss(model, data[first:first + 12])
        expected.append((loss_sum.item() / items.item(), int(items.item())))
    for rank_result in results:
        rows = rank_result["items"]["rows"]
        assert [r["loss"] for r in rows] == pytest.approx([e[0] for e in expected], rel=1e-6)
        assert [r["items"] for r in rows] == [e[1] for e in expected]
        assert [(r["samples"], r["ranks"]) for r in rows] == [(12, 2)] * 4
    # Every rank logs the same numbers: the decisions taken from them agree.
    assert results[0]["items"] == results[1]["items"]


def test_mean_window_loss_averages_micro_steps_and_ranks(results: Any) -> None:
    data, model = w.regression_data(48), w.make_model()
    micro = [w.mean_loss(model, data[[i, i + 2, i + 4]]).item()
             for start in range(0, 48, 6) for i in (start, start + 1)]
    # window j: micro-batches 2j, 2j+1 of each rank
    per_window = [sum(micro[4 * j: 4 * j + 4]) / 4 for j in range(4)]
    for rank_result in results:
        assert [r["loss"] for r in rank_result["mean"]["rows"]] == pytest.approx(per_window,
                                                                                 rel=1e-6)


def test_validation_loss_counts_each_sample_once(results: Any) -> None:
    data, model = w.sequence_data(48), w.make_model(4)
    loss_sum, items = w.item_loss(model, data[0:21])
    mean_model, regression = w.make_model(), w.regression_data(48)
    mean = w.mean_loss(mean_model, regression[0:21]).item()
    for rank_result in results:
        assert rank_result["items"]["val"] == pytest.approx([loss_sum.item() / items.item()] * 2,
                                                            rel=1e-6)
        assert rank_result["mean"]["val"] == pytest.approx([mean] * 2, rel=1e-6)


def test_validation_keeps_the_loaders_sampler_and_drop_last_set(results: Any) -> None:
    data, model = w.regression_data(40), w.make_model()
    held_out = w.mean_loss(model, data[30:40]).item()
    whole_batches = w.mean_loss(model, data[0:36]).item()
    for rank_result in results:
        val = rank_result["validation"]
        assert val["subset"]["val_items"] == 10  # was 40: the training samples too
        assert val["subset"]["val_loss"] == pytest.approx(held_out, rel=1e-6)
        assert val["drop_last"]["val_items"] == 36  # was 32
        assert val["drop_last"]["val_loss"] == pytest.approx(whole_batches, rel=1e-6)
        assert val["weighted"].startswith("val_loader's sampler WeightedRandomSampler cannot "
                                          "be split over 2 ranks")


def test_sigterm_on_one_rank_stops_both_at_one_boundary_and_resumes_bitwise(
        results: Any) -> None:
    for rank_result in results:
        run = rank_result["preemption"]
        # rank 1's signal mid-window of step 3: both ranks saved step 3, stopped with 143
        assert run["stopped"] == ("preempted", 143, 3, "step-3", True)
        assert run["bitwise"]
        message, every_rank = run["refused"]
        assert every_rank and message.startswith("run directory ")
        assert "is in use by a live job (pid " in message
