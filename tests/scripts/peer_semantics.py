"""What Accelerate, Lightning Fabric and accumix do on 2 CPU processes, for the migration guide
(docs/guides/migrating.md cites this script's output; not part of the test suite).

    python -m accumix.cli.main launch --nproc 2 tests/scripts/peer_semantics.py

Each check prints one line from rank 0: which samples each rank's loader yields (7 samples,
batch 2; 5 samples, batch 2), how many times a prepared scheduler steps per optimizer step,
what the short last window of an epoch is divided by, what gathering an evaluation set gives,
and the one-line changes that give a peer's behaviour in accumix.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

RANK = int(os.environ["RANK"])


def report(name: str, value: object) -> None:
    """Every rank's value, printed by rank 0 (an all-gather of objects)."""
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    if RANK == 0:
        print(f"{name}: {json.dumps(every)}", flush=True)


def batches(loader: object) -> list[list[int]]:
    return [b[0].tolist() for b in loader]  # type: ignore[attr-defined]


def short_window_grads(acc: object, model: nn.Module, opt: object, loader: object,
                       accumulate: object, weight: nn.Parameter) -> list[float]:
    """The weight's gradient at each boundary, as the optimizer steps with it: loss = w * x
    with x = 1, so every micro-batch's gradient is 1 (3 batches a rank, K = 2: windows of 2
    micro-batches and of 1)."""
    out = []
    for (x,) in loader:  # type: ignore[attr-defined]
        with accumulate():  # type: ignore[operator]
            acc.backward(model(x.float()[:, None]).mean())  # type: ignore[attr-defined]
            opt.step()  # type: ignore[attr-defined]
            if acc.sync_gradients:  # type: ignore[attr-defined]
                out.append(round(weight.grad.item(), 6))
            opt.zero_grad()  # type: ignore[attr-defined]
    return out


def accelerate_checks() -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    report("accelerate.distributed_type", str(acc.distributed_type))
    report("accelerate.batches(7 samples, batch 2)",
           batches(acc.prepare(DataLoader(TensorDataset(torch.arange(7)), batch_size=2))))
    report("accelerate.batches(5 samples, batch 2)",
           batches(acc.prepare(DataLoader(TensorDataset(torch.arange(5)), batch_size=2))))
    model = nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 + s)
    model, opt, sched = acc.prepare(model, opt, sched)
    loader = acc.prepare(DataLoader(TensorDataset(torch.ones(12)), batch_size=2))
    steps, lrs = [], []
    for (x,) in loader:
        with acc.accumulate(model):
            acc.backward(model(x[:, None]).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
            if acc.sync_gradients:
                steps.append(sched.scheduler.last_epoch)
                lrs.append(sched.get_last_lr()[0])
    report("accelerate.scheduler_steps_after_each_optimizer_step (K=2)", steps)
    report("accelerate.lr_factor (lambda s: 1 + s)", lrs)
    model2 = raw = nn.Linear(1, 1, bias=False)
    model2, opt2, loader = acc.prepare(model2, torch.optim.SGD(model2.parameters(), lr=0.0),
                                       DataLoader(TensorDataset(torch.ones(6)), batch_size=1))
    report("accelerate.boundary_grads (K=2, 3 batches a rank: windows of 2 and 1)",
           short_window_grads(acc, model2, opt2, loader, lambda: acc.accumulate(model2),
                              raw.weight))
    evaluation = acc.prepare(DataLoader(TensorDataset(torch.arange(7)), batch_size=2))
    gathered, plain = [], []
    for (i,) in evaluation:
        gathered += acc.gather_for_metrics(i).tolist()
        plain += acc.gather(i).tolist()
    report("accelerate.gather_for_metrics(7 samples)", gathered)
    report("accelerate.gather(7 samples)", plain)


def fabric_checks() -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    report("fabric.batches(7 samples, batch 2)",
           batches(fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(7)),
                                                       batch_size=2))))
    report("fabric.batches(5 samples, batch 2)",
           batches(fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(5)),
                                                       batch_size=2))))
    model = nn.Linear(1, 1, bias=False)
    model, _ = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    grads = []
    for x in (torch.ones(1), torch.ones(1)):  # two micro-batches, no_backward_sync on the first
        with fabric.no_backward_sync(model, enabled=not grads):
            fabric.backward(model(x[:, None]).mean())
        grads.append(round(model.weight.grad.item(), 6))
    report("fabric.grad_after_2_micro_batches_of_grad_1 (backward adds, no division)", grads)


def accumix_checks() -> None:
    import accumix as ax

    acc = ax.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=2)
    report("accumix.batches(7 samples, batch 2)",
           batches(acc.setup(DataLoader(TensorDataset(torch.arange(7)), batch_size=2))))
    report("accumix.batches(5 samples, batch 2)",
           batches(acc.setup(DataLoader(TensorDataset(torch.arange(5)), batch_size=2))))
    # The one-line changes for Accelerate's batches (docs/guides/migrating.md, items 4 and 5).
    from torch.utils.data import ConcatDataset, Subset

    five = TensorDataset(torch.arange(5))
    padded = ConcatDataset([five, Subset(five, range(-len(five) % (2 * acc.world_size)))])
    report("accumix.batches(5 samples padded with its first, batch 2)",
           batches(acc.setup(DataLoader(padded, batch_size=2))))
    eight, b, w = TensorDataset(torch.arange(8)), 2, acc.world_size
    blocked = Subset(eight, [g * b * w + r * b + i for g in range(len(eight) // (b * w))
                             for i in range(b) for r in range(w)])
    report("accumix.batches(8 samples reordered for blocks, batch 2)",
           batches(acc.setup(DataLoader(blocked, batch_size=2))))
    report("accelerate-like blocks expected for 8 samples", "rank 0 [[0, 1], [4, 5]], "
           "rank 1 [[2, 3], [6, 7]]")
    model = nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    f = lambda s: 1.0 + s  # noqa: E731 - the schedule's factor
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    # The one-line change for Accelerate's stepping: the schedule read at world_size x steps.
    peer = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))],
                                                             lr=1.0),
                                             lambda s: f(s * acc.world_size))
    model, opt, sched, loader = acc.setup(
        model, opt, sched, DataLoader(TensorDataset(torch.ones(12)), batch_size=2))
    steps, lrs = [], []
    for (x,) in loader:
        with acc.accumulate():
            acc.backward(model(x[:, None]).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            steps.append(sched.scheduler.last_epoch)
            peer.step()  # stepped by hand: its optimizer is a stand-in
            lrs.append(peer.get_last_lr()[0])
    report("accumix.scheduler_steps_after_each_optimizer_step (K=2)", steps)
    report("accumix.lr_factor (lambda s: 1 + s)", [1.0 + s for s in steps])
    report("accumix.lr_factor with lambda s: f(s * acc.world_size)", lrs)
    model2 = raw = nn.Linear(1, 1, bias=False)
    model2, opt2, loader = acc.setup(model2, torch.optim.SGD(model2.parameters(), lr=0.0),
                                     DataLoader(TensorDataset(torch.ones(6)), batch_size=1))
    report("accumix.boundary_grads (K=2, 3 batches a rank: windows of 2 and 1)",
           short_window_grads(acc, model2, opt2, loader, acc.accumulate, raw.weight))
    data = TensorDataset(torch.arange(7))
    evaluation = acc.setup(DataLoader(data, batch_size=2))
    gathered, plain = [], []
    for (i,) in evaluation:
        gathered += acc.gather_for_metrics(i).tolist()
        plain += acc.gather(i).tolist()
    report("accumix.gather_for_metrics(7 samples)", gathered)
    report("accumix.gather(7 samples)", plain)
    report("accumix.setup_eval_loader(7 samples, batch 2)",
           batches(acc.setup_eval_loader(DataLoader(data, batch_size=2))))


if __name__ == "__main__":
    accumix_checks()  # makes the process group the peers then use
    accelerate_checks()
    fabric_checks()
