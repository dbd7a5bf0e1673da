"""GPU tier: the same semantics on CUDA (NCCL for several GPUs). Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader

import accumix as ax
from accumix.testing import spawn
from tests import workloads as w

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _train(precision: str, *, items: bool, strategy: str = "auto") -> list[torch.Tensor]:
    data = w.sequence_data(48) if items else w.regression_data(48)
    model = w.make_model(4 if items else 6)
    acc = ax.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=4)
    assert acc.device.type == "cuda"
    opt = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    model, opt, loader = acc.setup(model, opt, DataLoader(data, batch_size=3))
    for batch in loader:
        assert all(t.is_cuda for t in batch)
        with acc.accumulate():
            if items:
                loss_sum, n = w.item_loss(model, batch)
                acc.backward(loss_sum, num_items=n)
            else:
                acc.backward(w.mean_loss(model, batch))
            opt.step()
            opt.zero_grad()
    return [p.detach().cpu() for p in acc.unwrap(model).parameters()]


@pytest.mark.parametrize("items", [False, True])
def test_fp32_on_gpu_equals_cpu_reference(items: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    data = w.sequence_data(48) if items else w.regression_data(48)
    ref = w.reference_params(w.make_model(4 if items else 6), data, 12, items=items)
    assert w.max_diff(ref, _train("fp32", items=items)) < 1e-5


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_on_gpu_is_close_to_fp32(precision: str) -> None:
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("GPU without bf16")
    ref = _train("fp32", items=True)
    got = _train(precision, items=True)
    assert w.max_diff(ref, got) < 5e-2


def test_auto_precision_on_gpu() -> None:
    acc = ax.Accelerator(precision="auto")
    expected = "bf16-mixed" if torch.cuda.get_device_capability()[0] >= 8 else "fp16-mixed"
    assert acc.policy.name == expected


def _nccl_job() -> list[list[float]]:
    params = _train("fp32", items=True, strategy="ddp")
    return [p.flatten().tolist() for p in params]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_over_nccl_equals_reference() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    results = spawn(_nccl_job, nprocs=2)
    data = w.sequence_data(48)
    ref = w.reference_params(copy.deepcopy(w.make_model(4)), data, 24, items=True)
    for rank_params in results:
        got = [torch.tensor(p).view_as(r) for p, r in zip(rank_params, ref, strict=True)]
        assert w.max_diff(ref, got) < 1e-5


def test_sync_batchnorm_converts_and_trains() -> None:
    acc = ax.Accelerator(strategy=ax.DDPStrategy(sync_batchnorm=True), precision="fp32")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.setup(model, opt)
    assert isinstance(acc.unwrap(model)[1], torch.nn.SyncBatchNorm)
    with acc.accumulate():
        acc.backward(model(torch.randn(2, 3, 5, 5, device=acc.device)).square().mean())
        opt.step()
    assert acc.optimizer_steps == 1
