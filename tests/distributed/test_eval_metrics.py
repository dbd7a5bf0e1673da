"""Named evaluation sums on 2 ranks (issue 24 item 7): the validation step returns
``(sum, count)`` pairs beside its loss, and the Trainer reports each as ``val_<name>`` over the
whole set, every sample once (uneven shards: one rank pads with a weight-0 batch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.trainer import Callback, Trainer
from tests.distributed.shared_spawn import shared_result

SAMPLES, CLASSES = 9, 5


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 4, generator=g),
                         torch.randint(0, CLASSES, (SAMPLES,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, CLASSES)


def _val_step(model: nn.Module, batch: Any) -> dict[str, Any]:
    x, y = batch
    logits = model(x)
    top2 = logits.topk(2, dim=-1).indices
    n = y.shape[0]
    return {"loss": nn.functional.cross_entropy(logits, y, reduction="sum"), "num_items": n,
            "accuracy": ((logits.argmax(-1) == y).sum(), n),
            "top2": ((top2 == y[:, None]).any(-1).sum(), n)}


class _Collect(Callback):
    def __init__(self) -> None:
        self.val: list[dict[str, float]] = []

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.val.append(dict(metrics))


def _job() -> list[dict[str, float]]:
    model, collect = _model(), _Collect()
    trainer = Trainer(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        train_loader=DataLoader(_data(), batch_size=2),
        accelerator=ax.Accelerator(strategy="ddp", precision="fp32"),
        # 9 samples in batches of 2: rank 0 holds 5 (3 batches), rank 1 holds 4 (2 + padding).
        val_loader=DataLoader(_data(), batch_size=2), val_step_fn=_val_step,
        step_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
        max_steps=1, progress_bar=False, callbacks=[collect])
    trainer.fit()
    return collect.val


def shared_job(_: Path) -> tuple[Any, tuple[Any, ...]]:
    """This module's job, run in the spawn it shares with other modules (conftest.py)."""
    return _job, ()


def test_named_eval_sums_are_exact_over_ranks(shared_spawn: dict[str, list[Any]]) -> None:
    x, y = _data().tensors
    logits = _model()(x)
    expected = {
        "val_loss": nn.functional.cross_entropy(logits, y).item(),
        "val_accuracy": (logits.argmax(-1) == y).sum().item() / SAMPLES,
        "val_top2": (logits.topk(2, -1).indices == y[:, None]).any(-1).sum().item() / SAMPLES,
    }
    assert 0 < expected["val_accuracy"] < expected["val_top2"] < 1  # the check can tell
    for rank_vals in shared_result(shared_spawn, __name__):
        assert rank_vals, "no validation ran"
        last = rank_vals[-1]
        assert last["val_items"] == SAMPLES
        assert last["val_accuracy"] == expected["val_accuracy"], last
        assert last["val_top2"] == expected["val_top2"], last
        assert abs(last["val_loss"] - expected["val_loss"]) < 1e-6, last
