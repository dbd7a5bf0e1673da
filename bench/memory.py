"""Per-rank bytes of parameters, gradients and optimizer states, measured, next to
accumix.memory.model.

    python bench/memory.py                        # width 256, 4 blocks, Adam, fp32, 2 ranks
    python bench/memory.py --k 2                  # a window of 2 micro-steps, sync rows too
    python bench/memory.py --width 32 --blocks 2 --rows ddp,zero1,fsdp-full   # a smoke run

Two ranks on gloo (``accumix.testing.spawn``) train one optimizer step of K micro-steps (``--k``)
of an MLP of identical blocks with Adam under each strategy: ddp, zero1, fsdp grad_op, fsdp
full (with K >= 2 also with ``sync_each_microstep=True``: the ``-sync`` rows), and deepspeed
stages 1-3 when DeepSpeed is installed. Each rank measures what it holds, counting every tensor
storage once (``tests/model_states.py``):

* params: the peak, over every module's forward, of the parameter storage alive on the rank:
  the parameters (FSDP: its local shards plus the all-gathered buffers, allocated or freed;
  DeepSpeed stage 3: each parameter's partition plus its gathered data);
* grads: the most held after a micro-step's backward: the gradients the strategy will step
  with (``Strategy.local_grads``: FSDP's shards, DeepSpeed's partitions), any ``param.grad``,
  FSDP2's unsharded window gradients;
* optimizer: after the step, the optimizer's state tensors, plus any tensor it steps that is
  not a model parameter (a master copy, DeepSpeed's flat fp32 partition).

``accumix.memory.model.estimate_memory`` predicts the same three numbers (ZeRO's formulas, and
the window's unsharded gradients from K=2); the table shows measured / predicted. The larger
rank's bytes are shown (shards can differ by padding).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import warnings
from typing import Any

import torch
from torch import nn

import accumix as ax
from _common import machine_line, markdown_table
from accumix.memory.model import estimate_memory
from accumix.testing import ResidualBlock as Block
from accumix.testing import spawn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.model_states import window_model_states  # noqa: E402

KIB = 1024
ROWS = ("ddp", "zero1", "fsdp-grad_op", "fsdp-full", "fsdp-grad_op-sync", "fsdp-full-sync",
        "deepspeed-1", "deepspeed-2", "deepspeed-3")


def make_model(width: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), *(Block(width) for _ in range(blocks)),
                         nn.Linear(width, 8))


def make_strategy(row: str) -> Any:
    if row.startswith("fsdp-"):
        return ax.FSDPStrategy(sharding=row.split("-")[1], sync_each_microstep=row.endswith("sync"))
    if row.startswith("deepspeed-"):
        from accumix.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=int(row.split("-")[1]))
    return ax.ZeRO1Strategy() if row == "zero1" else row


def measure(row: str, width: int, blocks: int, batch: int, k: int) -> dict[str, int]:
    """One rank: set up, one optimizer step of ``k`` micro-steps, the three byte counts."""
    warnings.filterwarnings("ignore")
    acc = ax.Accelerator(strategy=make_strategy(row), precision="fp32", grad_accum_steps=k,
                         micro_batch_size=batch)
    model = make_model(width, blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.setup(model, opt)
    return window_model_states(acc, model, opt, torch.randn(batch, 32), micro_steps=k)


def rank_main(rows: list[str], width: int, blocks: int, batch: int, k: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in rows:
        try:
            out[row] = measure(row, width, blocks, batch, k)
        except Exception as exc:  # noqa: BLE001 - the row says why
            out[row] = f"{type(exc).__name__}: {exc}".splitlines()[0][:80]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"comma-separated subset of {','.join(ROWS)}")
    args = parser.parse_args()
    unknown = sorted(set(args.rows.split(",")) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")

    rows = [r for r in args.rows.split(",") if (not r.startswith("deepspeed")
            or importlib.util.find_spec("deepspeed") is not None)
            and (args.k > 1 or not r.endswith("sync"))]  # at K=1 the sync rows are fsdp's
    results = spawn(rank_main, nprocs=2, args=(rows, args.width, args.blocks, args.batch,
                                               args.k), timeout=600)
    model = make_model(args.width, args.blocks)
    predicted = {e.strategy: e for e in estimate_memory(model, world_size=2, precision="fp32",
                                                        optimizer_states=2,
                                                        grad_accum_steps=args.k)}
    table = []
    for row in rows:
        if any(isinstance(r[row], str) for r in results):
            reason = next(r[row] for r in results if isinstance(r[row], str))
            table.append([row, *(["n/a"] * 9), reason])
            continue
        cells: list[object] = [row]
        for kind in ("params", "grads", "optimizer"):
            measured = max(r[row][kind] for r in results)
            expected = getattr(predicted[row], f"{kind}_bytes")
            cells += [f"{measured / KIB:,.1f}", f"{expected / KIB:,.1f}",
                      f"{measured / expected:.3f}"]
        table.append([*cells, ""])
    n = sum(p.numel() for p in model.parameters())
    print(machine_line("2 ranks, gloo"))
    print(f"model: {n:,} parameters ({args.blocks} blocks of width {args.width}), Adam, fp32, "
          f"world size 2, K={args.k}; KiB per rank, measured vs accumix.memory.model's "
          "prediction\n")
    headers = ["strategy", "params KiB", "predicted", "ratio", "grads KiB", "predicted",
               "ratio", "optimizer KiB", "predicted", "ratio", "note"]
    if not any(row[-1] for row in table):  # the note only says why a row could not run
        headers, table = headers[:-1], [row[:-1] for row in table]
    print(markdown_table(headers, table))


if __name__ == "__main__":
    main()
