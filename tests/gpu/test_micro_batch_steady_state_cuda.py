"""GPU tier of ``tests/unit/test_micro_batch_steady_state.py`` (issue 28, cases 1 and 2): on
CUDA, ``micro_batch_size="auto"`` under a limit chooses a size whose real steady state (three
windows of training, the allocator's peak) stays under the limit and within 10% of the probe's
peak, and the next size up does not fit, whether optimizer states and accumulated gradients
(AdamW) or the parameters alone with K=1 (SGD) decide. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.common.micro_batch_search import candidates
from accumix.memory.micro_batch_probe import measure
from accumix.memory.peak_memory import PeakMeter
from tests.unit.test_micro_batch_steady_state import GLOBAL, MB, Dense

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(("width", "optimizer", "limit_mb"),
                         [(256, torch.optim.AdamW, 200), (256, torch.optim.AdamW, 150),
                          (16, torch.optim.SGD, 60)])
def test_the_chosen_size_trains_under_the_limit_at_the_probed_peak_on_cuda(
        width: int, optimizer: type[torch.optim.Optimizer], limit_mb: int) -> None:
    torch.cuda.empty_cache()
    data = TensorDataset(torch.randn(3 * GLOBAL, 64, generator=torch.Generator().manual_seed(1)))
    acc = ax.Accelerator(strategy="single", global_batch_size=GLOBAL, micro_batch_size="auto",
                         memory_limit=limit_mb * MB, precision="fp32")
    assert acc.device.type == "cuda"
    net = Dense(width)
    model, opt = acc.setup(net, optimizer(net.parameters()))
    make = lambda n: torch.randn(n, 64)  # noqa: E731
    chosen = acc.find_micro_batch_size(model, make)
    sizes = candidates(GLOBAL, 1)
    if chosen != sizes[-1]:  # the next size up does not fit (the largest, K=1, tried alone)
        meter = measure(acc._run, model, make, sizes[sizes.index(chosen) + 1])
        assert meter is None or meter.peak > 0.9 * limit_mb * MB
    loader = acc.setup(DataLoader(data, batch_size=2))
    meter = PeakMeter(acc.device)
    with meter.measure():
        for (x,) in loader:
            with acc.accumulate():
                acc.backward(model(x))
                opt.step()
                opt.zero_grad()
    probe = acc.micro_batch_choice.peak_bytes
    print(f"{optimizer.__name__} {limit_mb} MB: chose {chosen}, probe {probe / MB:.1f} MB, "
          f"run {meter.peak / MB:.1f} MB")
    assert acc.optimizer_steps == 3
    assert meter.peak <= limit_mb * MB
    assert abs(meter.peak / probe - 1) < 0.1
