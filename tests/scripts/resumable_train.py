"""A small resumable training job: the checkpoint tests import it, the fault tests launch it.

Dropout, a shuffled loader, AdamW, an LR scheduler and K=3: everything an exact resume has to
restore. As a script it auto-resumes from ``RUN_DIR/latest`` and can hurt itself on purpose::

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 \\
        tests/scripts/resumable_train.py RUN_DIR [--kill-at N] [--term-at N] [--hang-at N]
        [--hang-between N] [--hang-before-save N] [--hang-in-write N] [--kill-in-write N]

``--strategy S``: ddp unless given. ``--per-node``: each node (torchrun's ``GROUP_RANK``) has
its own run directory, ``RUN_DIR/node<g>`` (no shared disk).
``--kill-at N``: on the first attempt, rank 1 SIGKILLs itself one micro-step after step N.
``--kill-in-write N``: the first attempt saves in the background, and rank 1 SIGKILLs itself
inside its write of step N (later attempts save in the loop).
``--term-at N``: on a restarted attempt, rank 1 sends itself SIGTERM one micro-step after
step N (pre-emption: every rank saves at the next boundary and exits 0).
``--hang-at N``: rank 1 sleeps forever one micro-step after step N; ``--hang-between N``: at
the boundary of step N, after its save (rank 0 goes on to the pre-emption check);
``--hang-before-save N``: at the boundary of step N, before its save (rank 0 goes on into
``save_state``); ``--hang-in-write N``: inside its checkpoint write at step N (its disk
stalls; rank 0 has written its files and waits). Rank 0 writes ``RUN_DIR/final`` (the
model's safetensors) at the end and appends what happened to ``RUN_DIR/events.txt``;
``--reference DIR`` then trains the same job uninterrupted in the same processes and writes it
to DIR.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.checkpoint import latest_checkpoint

MICRO_BATCH, STEPS = 2, 3  # 48 samples on 2 ranks: 4 windows an epoch


def dataset(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    y = (x @ torch.randn(6, 1, generator=g)).tanh()
    return TensorDataset(x, y)


class WithUnusedHead(nn.Module):
    """The job's model plus a head in the optimizer that the forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
        self.extra = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def build(acc: ax.Accelerator, *, dropout: float = 0.2, micro_batch: int = MICRO_BATCH,
          make_model: Callable[[], nn.Module] | None = None, data: Any = None,
          **loader_kwargs: Any) -> tuple[Any, ...]:
    """Model (``make_model()``, seeded, else the MLP), optimizer, loader (of ``data``, default
    ``dataset()``, with ``loader_kwargs``) and scheduler, set up."""
    torch.manual_seed(0)
    model = make_model() if make_model is not None else nn.Sequential(
        nn.Linear(6, 16), nn.Dropout(dropout), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    loader = DataLoader(dataset() if data is None else data, batch_size=micro_batch,
                        shuffle=True, **loader_kwargs)
    return acc.setup(model, opt, loader, sched)


def build_unused_head(acc: ax.Accelerator) -> tuple[Any, ...]:
    return build(acc, make_model=WithUnusedHead)


def train(acc: ax.Accelerator, objects: tuple[Any, ...], *, epochs: int,
          stop_at: int | None = None, save_at: Container[int] = (),
          run_dir: str | os.PathLike[str] | None = None,
          after_micro_step: Callable[[ax.Accelerator], None] | None = None,
          at_boundary: Callable[[ax.Accelerator], None] | None = None,
          background: bool = False) -> None:
    """The loop of DESIGN.md; saves after the steps in ``save_at`` (``background``: behind
    the loop), returns after ``stop_at``; ``at_boundary`` runs after each boundary's
    micro-step, before its save."""
    model, opt, loader, sched = objects
    for _ in range(loader.epoch, epochs):
        for x, y in loader:
            with acc.accumulate():
                acc.backward(nn.functional.mse_loss(model(x), y))
                acc.clip_grad_norm_(1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            if acc.sync_gradients:
                if at_boundary is not None:
                    at_boundary(acc)
                if acc.optimizer_steps in save_at:
                    acc.save_state(run_dir, keep_last=2, background=background)
                if acc.optimizer_steps == stop_at:
                    return
            if after_micro_step is not None:
                after_micro_step(acc)


def params(acc: ax.Accelerator, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters (collective; complete on rank 0)."""
    return {k: v.detach().clone() for k, v in acc.strategy.full_state_dict(model).items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--per-node", action="store_true")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--term-at", type=int)
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--hang-between", type=int)
    parser.add_argument("--hang-before-save", type=int)
    parser.add_argument("--hang-in-write", type=int)
    parser.add_argument("--kill-in-write", type=int)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=0, help="the loader's num_workers")
    parser.add_argument("--slow", type=float, default=0.0,
                        help="seconds each micro-step sleeps (time for a signal to land)")
    parser.add_argument("--reference", help="then train uninterrupted, write it here")
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    if args.per_node:
        run_dir = run_dir / f"node{os.environ['GROUP_RANK']}"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    acc = ax.Accelerator(strategy=args.strategy, precision="fp32", grad_accum_steps=STEPS,
                         seed=0, timeout=args.timeout)
    objects = build(acc, num_workers=args.workers)
    acc.handle_preemption(run_dir)
    resumed = acc.load_state(run_dir).name if latest_checkpoint(run_dir) else "-"
    event(run_dir, acc, f"attempt {attempt} resumed {resumed}")

    def hang() -> None:
        (run_dir / "hang_started").write_text(str(time.time()))
        time.sleep(3600)

    def hurt(acc: ax.Accelerator) -> None:
        time.sleep(args.slow)
        step = acc.optimizer_steps
        if acc.rank != 1:
            return
        if acc.sync_gradients and step == args.hang_between:
            hang()
        if acc._run.window.micro_step != 1:  # one micro-step into a window
            return
        if step == args.kill_at and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.term_at and attempt > 0:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == args.hang_at:
            hang()

    def before_save(acc: ax.Accelerator) -> None:
        if acc.rank == 1 and acc.optimizer_steps == args.hang_before_save:
            hang()
        if acc.rank == 1 and acc.optimizer_steps == args.hang_in_write:
            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            FileSystemWriter.write_data = lambda *_: hang()  # type: ignore[method-assign]
        if acc.rank == 1 and acc.optimizer_steps == args.kill_in_write and attempt == 0:
            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            def die(*_: Any) -> None:  # inside this rank's (background) write of the step
                os.kill(os.getpid(), signal.SIGKILL)

            FileSystemWriter.write_data = die  # type: ignore[method-assign]

    train(acc, objects, epochs=args.epochs, save_at=range(2, 10**6, 2), run_dir=run_dir,
          after_micro_step=hurt, at_boundary=before_save,
          background=args.kill_in_write is not None and attempt == 0)
    acc.save_model(run_dir / "final", objects[0])
    event(run_dir, acc, f"attempt {attempt} finished at step {acc.optimizer_steps}")
    if args.reference:  # the same job never interrupted (saves a launch in the tests)
        ref = ax.Accelerator(strategy=args.strategy, precision="fp32", grad_accum_steps=STEPS,
                             seed=0)
        ref_objects = build(ref)
        train(ref, ref_objects, epochs=args.epochs)
        ref.save_model(args.reference, ref_objects[0])
    acc.end()


def event(run_dir: Path, acc: ax.Accelerator, line: str) -> None:
    if acc.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "events.txt", "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
