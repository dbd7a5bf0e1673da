"""``sync_batchnorm=True`` (torch's SyncBatchNorm runs on CUDA only): a one-line refusal on CPU;
tests/gpu converts and trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accumix as ax


@pytest.mark.parametrize("strategy", [ax.DDPStrategy, ax.ZeRO1Strategy])
def test_sync_batchnorm_is_refused_on_cpu(strategy: type) -> None:
    acc = ax.Accelerator(strategy=strategy(sync_batchnorm=True), precision="fp32")
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    with pytest.raises(ax.ConfigError, match="sync_batchnorm=True needs CUDA") as info:
        acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "\n" not in str(info.value)
