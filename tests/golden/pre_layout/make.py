"""Writes the checkpoint that ``tests/unit/test_layout.py`` resumes: run with the code of the
commit before the layout change (edc5529), public API only, so the same script runs on both.

    PYTHONPATH=<old checkout>/src python tests/golden/pre_layout/make.py tests/golden/pre_layout

It trains 4 optimizer steps (K=2, Adam, StepLR, a shuffled loader) and saves at step 2
(mid-epoch), then writes the weights after step 4 of the same uninterrupted run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax


def build() -> tuple[ax.Accelerator, nn.Module, object, object, object]:
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=2, seed=0)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24, 6, generator=gen), torch.randn(24, 1, generator=gen))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    loader = DataLoader(data, batch_size=3, shuffle=True)
    model, opt, loader, sched = acc.setup(model, opt, loader, sched)
    return acc, model, opt, loader, sched


def train(acc: ax.Accelerator, model: nn.Module, opt: object, loader: object, sched: object,
          until: int, save_at: int | None = None, run_dir: Path | None = None) -> None:
    while acc.optimizer_steps < until:
        for x, y in loader:
            with acc.accumulate():
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                sched.step()
                opt.zero_grad()
            if acc.sync_gradients and acc.optimizer_steps == save_at:
                acc.save_state(run_dir)
            if acc.optimizer_steps >= until:
                return


if __name__ == "__main__":
    out = Path(sys.argv[1])
    acc, model, opt, loader, sched = build()
    train(acc, model, opt, loader, sched, until=4, save_at=2, run_dir=out / "run")
    save_file({k: v.contiguous() for k, v in acc.unwrap(model).state_dict().items()},
              str(out / "after-step-4.safetensors"))
