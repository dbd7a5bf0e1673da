"""Three jobs of an elastic launch that lose a node and carry on, for test_elastic.py::

    accumix launch --nnodes 1:2 ... elastic_train.py OUT [--kill-at N] [--hold-alone-at N]

torchrun starts this script again on every restart; each start runs three jobs in lockstep,
each resuming from its own run directory under OUT and saving every optimizer step: the
Trainer (ddp), a plain loop with ddp and one with fsdp (the Trainer's callback advances the two
loops one optimizer step per Trainer step). Global batch 16 of micro-batches of 4: K=2 on two
nodes of one process, K=4 on one. Rank 0 appends every step's world, K and sample indices to
``OUT/<job>.jsonl``.

``--kill-at N``: once (``OUT/killed``), the rank whose launcher does not host the c10d
rendezvous (``ELASTIC_NODE=b``) SIGKILLs that launcher and itself (the node is lost) after the
Trainer's step N.
``--hold-alone-at N``: a start on one node holds after step N until its launcher restarts it
(a node joined back: torchrun stops the ranks with SIGTERM; the Trainer saves and stops).
After the three jobs, the same processes train the job uninterrupted (a plain ddp loop) on the
world they have, and rank 0 writes ``OUT/result.json``: per job, the largest difference to that
reference, and whether every step's samples were the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.checkpoint import latest_checkpoint
from accumix.trainer import Callback, Trainer

GLOBAL, MICRO, STEPS = 16, 4, 12


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(GLOBAL * STEPS, 6, generator=g)
    return TensorDataset(x, (x @ torch.randn(6, 1, generator=g)).tanh(),
                         torch.arange(GLOBAL * STEPS))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def accelerator(strategy: str) -> ax.Accelerator:
    return ax.Accelerator(strategy=strategy, precision="fp32", global_batch_size=GLOBAL,
                          micro_batch_size=MICRO, seed=0)


def loss(m: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.mse_loss(m(batch[0]), batch[1])


def record(out: Path, job: str, acc: ax.Accelerator, seen: list[torch.Tensor]) -> None:
    """The step's samples over every rank (collective); rank 0 appends them to the job's log."""
    samples = acc.gather(torch.cat(seen))
    seen.clear()
    if acc.is_main_process:
        with open(out / f"{job}.jsonl", "a") as f:
            f.write(json.dumps({"step": acc.optimizer_steps, "world": acc.world_size,
                                "K": acc.grad_accum_steps,
                                "samples": sorted(samples.tolist())}) + "\n")


def plain(out: Path, job: str, strategy: str, made: dict[str, Any]) -> Iterator[None]:
    """A plain loop that resumes from ``out/job`` and yields after each saved step;
    ``made[job]`` is its (accelerator, model)."""
    acc = accelerator(strategy)
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.02)
    net, opt, loader = acc.setup(net, opt, DataLoader(data(), batch_size=MICRO, shuffle=True))
    made[job] = (acc, net)
    if latest_checkpoint(out / job):
        acc.load_state(out / job)
    seen: list[torch.Tensor] = []
    for batch in loader:
        with acc.accumulate():
            acc.backward(loss(net, batch))
            opt.step()
            opt.zero_grad()
        seen.append(batch[2])
        if acc.sync_gradients:
            record(out, job, acc, seen)
            if job != "reference":
                acc.save_state(out / job, keep_last=2)
            yield


class Lockstep(Callback):
    """The Trainer's own sample log, the plain loops' steps, and the node's loss or hold."""

    def __init__(self, out: Path, args: argparse.Namespace,
                 loops: list[Iterator[Any]]) -> None:
        self.out, self.args, self.loops, self.seen = out, args, loops, []

    def on_train_batch_start(self, trainer: Trainer, batch: Any) -> None:
        self.seen.append(batch[2])

    def on_optimizer_step(self, trainer: Trainer, metrics: Any) -> None:
        record(self.out, "trainer", trainer.accelerator, self.seen)
        for loop in self.loops:
            next(loop, None)
        step = trainer.step
        if (step == self.args.kill_at and os.environ.get("ELASTIC_NODE") == "b"
                and not (self.out / "killed").exists()):
            (self.out / "killed").write_text(str(step))
            os.kill(os.getppid(), signal.SIGKILL)  # the node is lost: its launcher first
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.args.hold_alone_at and trainer.accelerator.launch.num_nodes == 1:
            (self.out / "holding").write_text(str(step))
            watch = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)  # the Trainer's
            deadline = time.monotonic() + 300
            while not watch.requested() and time.monotonic() < deadline:
                time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--hold-alone-at", type=int)
    args = parser.parse_args()
    made: dict[str, Any] = {}
    loops = [plain(args.out, "ddp", "ddp", made), plain(args.out, "fsdp", "fsdp", made)]
    net = model()
    trainer = Trainer(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=0.02),
                      train_loader=DataLoader(data(), batch_size=MICRO, shuffle=True),
                      accelerator=accelerator("ddp"), step_fn=loss, max_steps=STEPS,
                      checkpoint_every=1, keep_checkpoints=2, run_dir=args.out / "trainer",
                      grad_clip=None, loggers=[], progress_bar=False,
                      callbacks=[Lockstep(args.out, args, loops)])
    trainer.fit()
    finals = {"trainer": trainer.accelerator.strategy.full_state_dict(trainer.model)}
    for job, loop in zip(("ddp", "fsdp"), loops, strict=True):
        for _ in loop:  # the steps the Trainer's end left
            pass
        acc, net = made[job]
        finals[job] = acc.strategy.full_state_dict(net)
    for _ in plain(args.out, "reference", "ddp", made):
        pass
    ref_acc, ref_net = made["reference"]
    expected = ref_acc.strategy.full_state_dict(ref_net)
    if ref_acc.is_main_process:
        logs = {job: [json.loads(row) for row in (args.out / f"{job}.jsonl").open()]
                for job in ("trainer", "ddp", "fsdp", "reference")}
        want = {row["step"]: row["samples"] for row in logs["reference"]}  # the last of each
        result = {}
        for job in ("trainer", "ddp", "fsdp"):
            last_of_step = {row["step"]: row for row in logs[job]}  # a step redone: its last
            result[job] = {
                "diff": max((finals[job][k] - expected[k]).abs().max().item()
                            for k in expected),
                "samples": all(last_of_step[s]["samples"] == want[s] for s in want),
                "steps": sorted(last_of_step),
                "worlds": [last_of_step[s]["world"] for s in sorted(last_of_step)],
                "K": [last_of_step[s]["K"] for s in sorted(last_of_step)]}
        (args.out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
