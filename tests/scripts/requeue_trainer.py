"""A Trainer job pre-empted the SLURM way, for tests/distributed/test_slurm_requeue.py::

    accumix launch --nproc 2 requeue_trainer.py RUN_DIR [--signal-at N] [--reference DIR]

``Trainer(preemption_signals=("SIGUSR1",), requeue=True)``, ddp, K=2, shuffled data, dropout and
Adam (a resume that misses any state is not bitwise), a checkpoint every 4 steps, 9 steps.
``--signal-at N``: on a first run (no ``SLURM_RESTART_COUNT``), rank 1 sends SIGUSR1 to its
launcher one micro-step after step N, as ``#SBATCH --signal=USR1@90`` signals the job step's
task; the launcher forwards it to every rank. ``--reference DIR``: after the run, the same
processes train the job uninterrupted into DIR, and rank 0 writes ``RUN_DIR/result.json``: the
steps, where it resumed, and whether the parameters and every logged loss equal the reference's.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.trainer import Callback, Trainer


class SignalLauncher(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, batch: Any) -> None:
        if (trainer.accelerator.rank == 1 and trainer.step == self.step
                and trainer.micro_step == 1):
            os.kill(os.getppid(), signal.SIGUSR1)
            # Until the launcher's forwarded signal reached this rank: on a loaded machine it
            # could otherwise come after step 6's boundary (the save then at step 7).
            watch = trainer.accelerator._run.preemption._watch
            deadline = time.monotonic() + 60
            while not watch.signalled and time.monotonic() < deadline:
                time.sleep(0.01)


def fit(run_dir: Path, callbacks: list[Callback], **kwargs: Any) -> tuple[Trainer, list]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1))
    trainer = Trainer(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        train_loader=DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4,
                                shuffle=True),
        accelerator=ax.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=2,
                                   seed=0),
        step_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), max_steps=9,
        checkpoint_every=4, run_dir=run_dir, loggers=["csv"], progress_bar=False,
        callbacks=callbacks, **kwargs)
    result = trainer.fit()
    full = trainer.accelerator.strategy.full_state_dict(trainer.model)
    return trainer, [result, {k: v.clone() for k, v in full.items()}]


def losses(run_dir: Path) -> list[tuple[str, str]]:
    with (run_dir / "metrics.csv").open() as f:
        return [(row["step"], row["loss"]) for row in csv.DictReader(f)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--signal-at", type=int)
    parser.add_argument("--reference", type=Path)
    args = parser.parse_args()
    first = "SLURM_RESTART_COUNT" not in os.environ
    callbacks = [SignalLauncher(args.signal_at)] if first and args.signal_at else []
    trainer, (result, params) = fit(args.run_dir, callbacks, preemption_signals=("SIGUSR1",),
                                    requeue=True)
    if args.reference is None:
        return
    _, (_, expected) = fit(args.reference, [])
    if trainer.accelerator.is_main_process:
        (args.run_dir / "result.json").write_text(json.dumps({
            "step": result.step, "resumed_from": Path(result.resumed_from).name,
            "params_equal": all(torch.equal(params[k], expected[k]) for k in expected),
            "losses_equal": losses(args.run_dir) == losses(args.reference),
            "steps_logged": [int(step) for step, _ in losses(args.run_dir)],
            "launcher": trainer.accelerator.launch.launcher}))


if __name__ == "__main__":
    main()
