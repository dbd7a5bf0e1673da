"""The Trainer on 2 ranks: the logged window loss is the large batch's loss over both ranks, and
the validation loss covers every sample exactly once."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accumix as ax
from accumix.testing import spawn
from accumix.trainer import Callback, Trainer
from tests import workloads as w


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


def _both_modes() -> dict[str, Any]:
    return {"items": _run("items"), "mean": _run("mean")}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_both_modes, nprocs=2)


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
