"""Finding the micro-batch that fits: accumix vs Accelerate vs Lightning, on one injected limit.

    python bench/auto_batch.py                        # G=64, the forward runs out above 20 rows
    python bench/auto_batch.py --global-batch 48 --limit 13

The same job for each (an MLP on 4096 rows, SGD, global batch G, one process) and the same
injected out-of-memory: the model raises ``torch.OutOfMemoryError("CUDA out of memory. ...")``
when its forward sees more than ``--limit`` rows (a real OOM needs a full GPU; the message is
the one both peers look for). Columns:

* trials: batch sizes tried (each a forward + backward until it fits or raises);
* seconds: from the start until the size is decided (wall clock, this machine);
* chosen / true largest: the micro-batch picked, the largest that fits (``--limit``) and the
  largest that fits *and divides G* (the only ones that keep G exact with an integer K);
* global trained: rows per optimizer step actually trained afterwards (two steps, counted).

accumix: the public path, ``acc.find_micro_batch_size(step, make_batch)`` after ``acc.setup``
(the real probe: forward, backward and the optimizer's first states, state restored), which
bisects the candidates that divide G; the user's loader is then re-batched to the choice and
K = G / chosen. On CPU the probe first runs the two smallest candidates (1 and 2) to predict
the peak of the others (no out-of-memory error before the kernel's OOM killer there).
Accelerate: ``find_executable_batch_size`` with its documented automatic-accumulation example
(``examples/by_feature/automatic_gradient_accumulation.py``: start at G, x0.9 per OOM,
``gradient_accumulation_steps = G // batch_size``). Lightning: ``Tuner.scale_batch_size``
(``BatchSizeFinder``) in ``binsearch`` mode from 2, no accumulation of its own; it refuses every
distributed strategy ("Tuning the batch size is currently not supported with distributed
strategies"), so all three run on one process.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _common import machine_line, markdown_table
from accumix.common.micro_batch_search import candidates


class InjectedOOM(nn.Module):
    """The job's model: raises the out-of-memory error above ``limit`` rows; counts the sizes
    its forward was called with."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 1))
        self.limit = limit
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sizes.append(int(x.shape[0]))
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {x.shape[0]} rows (injected)")
        return self.net(x)


def data(rows: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 32, generator=g)
    return TensorDataset(x, x.sum(-1, keepdim=True).tanh())


def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def distinct(sizes: list[int]) -> list[int]:
    """Each size once, in the order first tried (a trial may call the forward several times)."""
    out: list[int] = []
    for s in sizes:
        if s not in out:
            out.append(s)
    return out


def run_accumix(global_batch: int, limit: int) -> dict[str, Any]:
    import accumix as ax

    acc = ax.Accelerator(strategy="single", precision="fp32", global_batch_size=global_batch,
                         micro_batch_size="auto")
    net = InjectedOOM(limit)
    model, opt = acc.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    start = time.perf_counter()
    chosen = acc.find_micro_batch_size(lambda batch: loss_of(model, batch),
                                       lambda n: data(n).tensors)
    seconds = time.perf_counter() - start
    trials = distinct(net.sizes)
    loader = acc.setup(DataLoader(data(), batch_size=2))  # re-batched to the choice
    rows, per_step = 0, []
    for batch in loader:
        with acc.accumulate():
            acc.backward(loss_of(model, batch))
            rows += len(batch[0])
            opt.step()
            opt.zero_grad()
        if acc.sync_gradients:
            per_step.append(rows)
            rows = 0
            if len(per_step) == 2:
                break
    return {"trials": trials, "seconds": seconds, "chosen": chosen, "per_step": per_step}


def run_accelerate(global_batch: int, limit: int) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size

    accelerator = Accelerator(cpu=True)
    start = time.perf_counter()
    entered: list[tuple[int, float]] = []
    observed_batch_size = global_batch

    @find_executable_batch_size(starting_batch_size=observed_batch_size)
    def inner_training_function(batch_size: int) -> list[int]:
        nonlocal accelerator
        entered.append((batch_size, time.perf_counter() - start))
        accelerator.free_memory()
        accelerator.gradient_accumulation_steps = observed_batch_size // batch_size
        model = InjectedOOM(limit)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(data(), batch_size=batch_size)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        rows, per_step = 0, []
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_of(model, batch))
                rows += len(batch[0])
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                per_step.append(rows)
                rows = 0
                if len(per_step) == 2:
                    break
        return per_step

    per_step = inner_training_function()
    chosen, seconds = entered[-1]
    return {"trials": [b for b, _ in entered], "seconds": seconds, "chosen": chosen,
            "per_step": per_step}


def run_lightning(global_batch: int, limit: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = InjectedOOM(limit)
            self.batch_size = 2
            self.rows: list[int] = []

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            self.rows.append(len(batch[0]))
            return loss_of(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(data(), batch_size=self.batch_size)

    def trainer(steps: int) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)

    module = Module()
    start = time.perf_counter()
    chosen = Tuner(trainer(2)).scale_batch_size(module, mode="binsearch", init_val=2)
    seconds = time.perf_counter() - start
    trials = distinct(module.model.sizes)
    module.rows.clear()
    trainer(2).fit(module)  # accumulate_grad_batches=1: Lightning derives no K
    return {"trials": trials, "seconds": seconds, "chosen": chosen, "per_step": module.rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--limit", type=int, default=20, help="rows above which the forward "
                        "raises the injected out-of-memory error")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    g, limit = args.global_batch, args.limit
    divides = max(m for m in candidates(g, 1) if m <= limit)
    rows = []
    for name, run in (("accumix acc.find_micro_batch_size", run_accumix),
                      ("Accelerate find_executable_batch_size + K example", run_accelerate),
                      ("Lightning BatchSizeFinder (binsearch)", run_lightning)):
        r = run(g, limit)
        rows.append([name, f"{len(r['trials'])} ({', '.join(map(str, r['trials']))})",
                     f"{r['seconds']:.2f}", r["chosen"], f"{limit} / {divides}",
                     "/".join(map(str, r["per_step"])) + f" (G={g})"])
    print(machine_line(f"one process, G={g}, injected OOM above {limit} rows"))
    print(markdown_table(["method", "trials (sizes tried)", "seconds to decide", "chosen",
                          "true largest / dividing G", "global batch trained"], rows))


if __name__ == "__main__":
    main()
