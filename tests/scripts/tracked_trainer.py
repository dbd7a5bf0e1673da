"""A small Trainer job with trackers, which the tracker tests run in a process they can kill::

    python tests/scripts/tracked_trainer.py RUN_DIR --loggers csv,wandb --max-steps 8
        [--checkpoint-every 4] [--kill-at N]

``--kill-at N``: the process SIGKILLs itself as step N's window begins (the rows up to N-1
logged, the checkpoint of ``--checkpoint-every`` written). The tests import ``fit`` to resume
the same job in their own process.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.trainer import Callback, Trainer


class _KillAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, batch: Any) -> None:
        if trainer.step + 1 == self.step and trainer.micro_step == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def fit(run_dir: Path, loggers: list[str], *, max_steps: int, checkpoint_every: int = 4,
        kill_at: int | None = None, callbacks: tuple[Callback, ...] = (), k: int = 2,
        **options: Any) -> Trainer:
    """Trains to ``max_steps`` (``options``: more Trainer keywords, e.g. ``resume=False``)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    trainer = Trainer(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        train_loader=DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4,
                                shuffle=True),
        accelerator=ax.Accelerator(precision="fp32", grad_accum_steps=k, seed=0),
        step_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), max_steps=max_steps,
        checkpoint_every=checkpoint_every, run_dir=run_dir, loggers=loggers,
        progress_bar=False, **{"system_metrics_every": None, **options},
        callbacks=[*callbacks, *([_KillAt(kill_at)] if kill_at else [])])
    trainer.fit()
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--loggers", default="csv")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    fit(args.run_dir, args.loggers.split(","), max_steps=args.max_steps,
        checkpoint_every=args.checkpoint_every, kill_at=args.kill_at)


if __name__ == "__main__":
    main()
