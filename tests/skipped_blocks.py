"""Blocks a micro-step does not run (LayerDrop, stochastic depth, an MoE expert no token of
that micro-batch picked), each block its own FSDP unit, against the one-process large batch.

K=3 with a pattern that leaves a unit out of the first, the middle and the last micro-step of
each window, and one unit run on the middle micro-step only (issue 38, case 1: hsdp dropped
the shard of a unit the window's last micro-step did not reach).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import accumix as ax
from accumix.testing import ResidualBlock

K, MICRO, WINDOWS, WIDTH = 3, 2, 2, 6
# The blocks left out on each micro-step of a window: block 0 on the first, block 1 on the
# middle, block 2 on the first and the last (it runs on the middle one only).
SKIPPED = ({0, 2}, {1}, {2})


class SkippingNet(nn.Module):
    """Three residual blocks and a head; ``skip`` names the blocks the next forward leaves
    out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(ResidualBlock(WIDTH) for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x = block(x)
        return self.head(x)


def _data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(WINDOWS * K * world * MICRO, WIDTH, generator=g)
    return x, torch.randn(len(x), 1, generator=g)


def _rows(window: int, micro_step: int, world: int) -> slice:
    """The rows of one micro-step over all ranks (rank r takes its ``MICRO`` of them)."""
    start = (window * K + micro_step) * world * MICRO
    return slice(start, start + world * MICRO)


def reference(world: int) -> list[torch.Tensor]:
    """Plain PyTorch on one process: each window's loss the mean of its micro-steps' (equal
    sizes), each micro-step's rows of every rank through the blocks it runs."""
    model, (x, y) = SkippingNet(), _data(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for window in range(WINDOWS):
        opt.zero_grad()
        total = torch.zeros(())
        for j in range(K):
            model.skip, rows = SKIPPED[j], _rows(window, j, world)
            total = total + nn.functional.mse_loss(model(x[rows]), y[rows])
        (total / K).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def max_diff_to_reference(strategy: Any) -> dict[str, Any]:
    """The DESIGN.md loop under ``strategy`` on this rank's rows: the largest difference of
    the full parameters to ``reference`` and the optimizer steps taken."""
    model = SkippingNet()
    acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=K)
    world, rank = acc.world_size, acc.rank
    x, y = _data(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.setup(model, opt)
    inner = acc.unwrap(model)
    for window in range(WINDOWS):
        for j in range(K):
            rows = _rows(window, j, world)
            mine = slice(rows.start + rank * MICRO, rows.start + (rank + 1) * MICRO)
            inner.skip = SKIPPED[j]
            with acc.accumulate():
                acc.backward(nn.functional.mse_loss(model(x[mine]), y[mine]))
                opt.step()
                opt.zero_grad()
    got = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in
           inner.parameters()]
    diff = max(float((a - b).abs().max()) for a, b in zip(got, reference(world), strict=True))
    return {"diff": diff, "steps": acc.optimizer_steps}
