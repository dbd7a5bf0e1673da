"""Named evaluation sums (issue 24 item 7): a name that would overwrite one of the loss's own
columns (``val_items``) is refused instead of silently replacing it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.trainer.evaluation import evaluate


def _step(model: nn.Module, batch: Any) -> dict[str, Any]:
    x, y = batch
    loss_sum = nn.functional.mse_loss(model(x), y, reduction="sum")
    return {"loss": loss_sum, "num_items": len(x), "items": (torch.tensor(1.0), 4)}


def test_named_sum_called_items_is_refused_not_overwriting_val_items() -> None:
    acc = ax.Accelerator(strategy="single", seed=0)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    model = acc.setup(nn.Linear(3, 1))
    # Before: val_items was 0.25 (the named ratio 2 / 8), the 8 evaluated samples lost.
    with pytest.raises(ax.ConfigError, match="items"):
        evaluate(model, DataLoader(data, batch_size=4), _step, acc, sharded=False)
    plain = {"loss": torch.tensor(2.0), "num_items": 4, "accuracy": (3, 4)}
    result = evaluate(model, DataLoader(data, batch_size=4), lambda m, b: plain, acc,
                      sharded=False)
    assert result == {"val_loss": 0.5, "val_items": 8.0, "val_accuracy": 0.75}
    acc.end()
