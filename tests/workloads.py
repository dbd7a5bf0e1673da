"""Tiny deterministic jobs shared by the unit and distributed tests, with plain-PyTorch
references: the large-batch step on one process that accumix must reproduce."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax

LR, MOMENTUM = 0.1, 0.9


def regression_data(n: int = 48, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x @ torch.randn(6, 1, generator=g)).tanh() + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def sequence_data(n: int = 48, t: int = 7, seed: int = 1) -> TensorDataset:
    """Variable-length sequences, right-padded: lengths 1..t, so micro-batches differ in items."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, t, 4, generator=g)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    y = x.sum(-1).sin() * mask
    return TensorDataset(x, y, mask)


def make_model(in_features: int = 6, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_features, 16), nn.Tanh(), nn.Linear(16, 1))


def mean_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def item_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, mask = batch
    err = (model(x).squeeze(-1) - y) ** 2 * mask
    return err.sum(), mask.sum()


def reference_params(model: nn.Module, data: TensorDataset, window_samples: int, *,
                     items: bool, epochs: int = 1, sched: bool = False) -> list[torch.Tensor]:
    """Plain PyTorch: one SGD+momentum step per window of `window_samples` consecutive
    samples (the last window may be short), loss averaged over the window's samples/items."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if sched else None
    for _ in range(epochs):
        for batch in DataLoader(data, batch_size=window_samples, shuffle=False):
            opt.zero_grad()
            if items:
                loss_sum, n = item_loss(model, batch)
                (loss_sum / n).backward()
            else:
                mean_loss(model, batch).backward()
            opt.step()
            if scheduler:
                scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


def accumix_params(model: nn.Module, data: TensorDataset, *, micro_batch: int, steps: int,
                   items: bool | str, strategy: str = "auto", epochs: int = 1, sched: bool = False,
                   clip: float | None = None) -> tuple[list[torch.Tensor], ax.Accelerator]:
    """The loop of DESIGN.md with accumix, as a user writes it."""
    model = copy.deepcopy(model)
    acc = ax.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=steps)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if sched else None
    loader = DataLoader(data, batch_size=micro_batch, shuffle=False)
    if scheduler:
        model, opt, loader, scheduler = acc.setup(model, opt, loader, scheduler)
    else:
        model, opt, loader = acc.setup(model, opt, loader)
    for _ in range(epochs):
        for batch in loader:
            with acc.accumulate():
                if items == "per-batch-mean":  # HF Trainer's old, biased way
                    loss_sum, n = item_loss(model, batch)
                    acc.backward(loss_sum / n)
                elif items:
                    loss_sum, n = item_loss(model, batch)
                    acc.backward(loss_sum, num_items=int(n.item()) if items == "int" else n)
                else:
                    acc.backward(mean_loss(model, batch))
                if clip is not None:
                    acc.clip_grad_norm_(clip)
                opt.step()
                if scheduler:
                    scheduler.step()
                opt.zero_grad()
    return [p.detach().clone() for p in acc.unwrap(model).parameters()], acc


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))
