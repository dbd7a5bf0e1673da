"""Gradient-reduction calls and bytes per optimizer step, with and without accumulation-aware sync.

    python bench/comm.py                          # width 256, 4 blocks, K = 1, 4, 8, 2 ranks
    python bench/comm.py --width 64 --blocks 2 --steps 1   # a smoke run

Two ranks on gloo (``accumix.testing.spawn``) train an MLP of identical blocks with K
micro-steps per optimizer step, four ways:

* ddp, accumulation-aware: ``DDP.no_sync()`` off the boundary (accumix's default);
* ddp, every micro-step: the same loop with a strategy whose ``no_sync`` does nothing (what a
  loop that forgets ``no_sync`` costs);
* fsdp (full), accumulation-aware: ``set_requires_gradient_sync(False)`` off the boundary;
* fsdp (full), ``sync_each_microstep=True``: a reduce-scatter on every micro-step.

Counted after one warm-up window, over ``--steps`` optimizer steps: DDP's bucket all-reduces
(a comm hook counting each bucket and its buffer's bytes) and FSDP2's gradient reduce-scatters
(calls of ``dist.reduce_scatter_single``, which fully_shard's default ReduceScatter uses, and
their input bytes). "x" is bytes per step over the accumulation-aware row of the same strategy
and K. "grad KiB held" is the gradient storage a rank holds between micro-steps of a window (after
the first, off the boundary): the memory side of the trade-off.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import accumix as ax
from _common import machine_line, markdown_table
from accumix.testing import ResidualBlock as Block
from accumix.testing import spawn

MIB, KIB = 1024**2, 1024
ROWS = (("ddp", "accumulation-aware"), ("ddp", "every micro-step"),
        ("fsdp", "accumulation-aware"), ("fsdp", "every micro-step"))


def make_model(width: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), *(Block(width) for _ in range(blocks)),
                         nn.Linear(width, 8))


class EveryMicroStepDDP(ax.DDPStrategy):
    """DDP that all-reduces on every micro-step: a loop without ``no_sync``."""

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


def make_strategy(strategy: str, sync: str) -> Any:
    if strategy == "fsdp":
        return ax.FSDPStrategy(sync_each_microstep=sync == "every micro-step")
    return EveryMicroStepDDP() if sync == "every micro-step" else ax.DDPStrategy()


def held_grad_bytes(module: nn.Module) -> int:
    """Gradient storage alive on this rank: ``param.grad`` (FSDP: its shard) and FSDP2's
    unsharded accumulated gradients (internals; no public API)."""
    tensors = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
               for p in module.parameters() if p.grad is not None]
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            group = unit._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else []:
                # Kept on the unsharded parameter, or upcast aside when reduce_dtype differs.
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                for grad in (fsdp_param.unsharded_accumulated_grad,
                             unsharded.grad if unsharded is not None else None):
                    if grad is not None:
                        tensors.append(grad)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def count(strategy: str, sync: str, k: int, width: int, blocks: int, steps: int
          ) -> dict[str, float]:
    """One rank: reductions and bytes per optimizer step, gradient bytes held mid-window."""
    warnings.filterwarnings("ignore")
    acc = ax.Accelerator(strategy=make_strategy(strategy, sync), precision="fp32",
                         grad_accum_steps=k)
    model = make_model(width, blocks)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, opt = acc.setup(model, opt)
    counted = {"on": False, "calls": 0, "bytes": 0}

    def note(nbytes: int) -> None:
        if counted["on"]:
            counted["calls"] += 1
            counted["bytes"] += nbytes

    if strategy == "ddp":
        def hook(state, bucket):  # unannotated: DDP checks the annotations' runtime types
            buffer = bucket.buffer()
            note(buffer.numel() * buffer.element_size())
            return allreduce_hook(state, bucket)

        model.register_comm_hook(dist.group.WORLD, hook)
    real = dist.reduce_scatter_single

    def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        source = kwargs.get("input", args[1] if len(args) > 1 else None)
        note(source.numel() * source.element_size())
        return real(*args, **kwargs)

    held = float("nan")
    x = torch.randn(8, 32)
    with mock.patch.object(dist, "reduce_scatter_single", reduce_scatter):
        for micro in range(k * (steps + 1)):
            counted["on"] = micro >= k  # the first window warms up (DDP rebuilds its buckets)
            with acc.accumulate():
                acc.backward(model(x).square().mean())
                if micro == k and k > 1:
                    held = held_grad_bytes(acc.unwrap(model))
                opt.step()
                opt.zero_grad()
    return {"calls": counted["calls"] / steps, "bytes": counted["bytes"] / steps, "held": held}


def rank_main(ks: list[int], width: int, blocks: int, steps: int) -> dict[str, Any]:
    return {f"{s}|{y}|{k}": count(s, y, k, width, blocks, steps)
            for k in ks for s, y in ROWS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="counted optimizer steps per row")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args()

    results = spawn(rank_main, nprocs=2, args=(args.k, args.width, args.blocks, args.steps),
                    timeout=600)
    table = []
    for k in args.k:
        for strategy, sync in ROWS:
            row = results[0][f"{strategy}|{sync}|{k}"]
            base = results[0][f"{strategy}|accumulation-aware|{k}"]
            held = "n/a" if row["held"] != row["held"] else f"{row['held'] / KIB:,.1f}"
            table.append([strategy, sync, k, f"{row['calls']:g}", f"{row['bytes'] / MIB:.3f}",
                          f"{row['bytes'] / base['bytes']:.2f}", held])
    model = make_model(args.width, args.blocks)
    n = sum(p.numel() for p in model.parameters())
    print(machine_line("2 ranks, gloo"))
    print(f"model: {n:,} parameters = {4 * n / MIB:.3f} MiB of fp32 gradients ({args.blocks} "
          f"blocks of width {args.width}; fsdp: {args.blocks} block units + the root), SGD, "
          f"fp32, world size 2; per optimizer step on rank 0, {args.steps} steps counted\n")
    print(markdown_table(["strategy", "gradient sync", "K", "reductions / step", "MiB / step",
                          "x", "grad KiB held"], table))


if __name__ == "__main__":
    main()
