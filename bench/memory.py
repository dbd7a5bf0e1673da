"""Per-rank bytes of parameters, gradients and optimizer states, measured, next to
accumix.memory.model.

    python bench/memory.py                        # width 256, 4 blocks, Adam, fp32, 2 ranks
    python bench/memory.py --width 32 --blocks 2 --rows ddp,zero1,fsdp-full   # a smoke run

Two ranks on gloo (``accumix.testing.spawn``) train one step of an MLP of identical blocks with
Adam under each strategy: ddp, zero1, fsdp grad_op, fsdp full, and deepspeed stages 1-3 when
DeepSpeed is installed. Each rank measures what it holds, counting every tensor storage once:

* params: the peak, over every module's forward, of the parameter storage alive on the rank:
  the parameters (FSDP: its local shards plus the all-gathered buffers, allocated or freed;
  DeepSpeed stage 3: each parameter's partition plus its gathered data);
* grads: after the boundary's backward, the gradients the strategy will step with
  (``Strategy.local_grads``: FSDP's shards, DeepSpeed's partitions) and any ``param.grad``
  still alive beside them;
* optimizer: after the step, the optimizer's state tensors, plus any tensor it steps that is
  not a model parameter (a master copy, DeepSpeed's flat fp32 partition).

``accumix.memory.model.estimate_memory`` predicts the same three numbers (ZeRO's formulas); the
table shows measured / predicted. The larger rank's bytes are shown (shards can differ by padding).
"""

from __future__ import annotations

import argparse
import importlib.util
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import accumix as ax
from _common import machine_line, markdown_table
from accumix.memory.model import estimate_memory
from accumix.testing import ResidualBlock as Block
from accumix.testing import spawn

KIB = 1024
ROWS = ("ddp", "zero1", "fsdp-grad_op", "fsdp-full", "deepspeed-1", "deepspeed-2",
        "deepspeed-3")


def make_model(width: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), *(Block(width) for _ in range(blocks)),
                         nn.Linear(width, 8))


def make_strategy(row: str) -> Any:
    if row.startswith("fsdp-"):
        return ax.FSDPStrategy(sharding=row.split("-", 1)[1])
    if row.startswith("deepspeed-"):
        from accumix.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=int(row.split("-")[1]))
    return ax.ZeRO1Strategy() if row == "zero1" else row


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a freed FSDP buffer counts 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def param_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter storage the rank holds right now."""
    tensors = [local(p.data) for p in module.parameters()]
    tensors += [p.ds_tensor for p in module.parameters() if hasattr(p, "ds_tensor")]
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            # FSDP2 internals (no public API): a unit's shards and its all-gather buffers.
            group = unit._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else []:
                tensors.append(local(fsdp_param.sharded_param))
                tensors.extend(fsdp_param.all_gather_outputs)
    return tensors


def measure(row: str, width: int, blocks: int, batch: int) -> dict[str, int]:
    """One rank: set up, one step, the three byte counts."""
    warnings.filterwarnings("ignore")
    acc = ax.Accelerator(strategy=make_strategy(row), precision="fp32", grad_accum_steps=1,
                         micro_batch_size=batch)
    model = make_model(width, blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.setup(model, opt)
    module = acc.unwrap(model)
    peak = [0]

    def record(*_: Any) -> None:
        peak[0] = max(peak[0], storage_bytes(param_tensors(module)))

    for sub in module.modules():
        sub.register_forward_hook(record, prepend=True)  # before FSDP reshards the unit
    x = torch.randn(batch, 32)
    with acc.accumulate():
        acc.backward(model(x).square().mean())
        params = list(module.parameters())
        held = acc.strategy.local_grads(params) + [p.grad for p in params if p.grad is not None]
        grads = storage_bytes([local(g) for g in held])
        opt.step()
    model_storages = {local(p.data).untyped_storage().data_ptr() for p in module.parameters()}
    stepped = [p for g in opt.param_groups for p in g["params"]
               if local(p.data).untyped_storage().data_ptr() not in model_storages]
    states = [local(t) for s in opt.state.values() for t in s.values()
              if isinstance(t, torch.Tensor)]
    return {"params": peak[0], "grads": grads, "optimizer": storage_bytes(states + stepped)}


def rank_main(rows: list[str], width: int, blocks: int, batch: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in rows:
        try:
            out[row] = measure(row, width, blocks, batch)
        except Exception as exc:  # noqa: BLE001 - the row says why
            out[row] = f"{type(exc).__name__}: {exc}".splitlines()[0][:80]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"comma-separated subset of {','.join(ROWS)}")
    args = parser.parse_args()
    unknown = sorted(set(args.rows.split(",")) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")

    rows = [r for r in args.rows.split(",") if not r.startswith("deepspeed")
            or importlib.util.find_spec("deepspeed") is not None]
    results = spawn(rank_main, nprocs=2, args=(rows, args.width, args.blocks, args.batch),
                    timeout=600)
    model = make_model(args.width, args.blocks)
    predicted = {e.strategy: e for e in estimate_memory(model, world_size=2, precision="fp32",
                                                        optimizer_states=2)}
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
          "world size 2; KiB per rank, measured vs accumix.memory.model's prediction\n")
    headers = ["strategy", "params KiB", "predicted", "ratio", "grads KiB", "predicted",
               "ratio", "optimizer KiB", "predicted", "ratio", "note"]
    if not any(row[-1] for row in table):  # the note only says why a row could not run
        headers, table = headers[:-1], [row[:-1] for row in table]
    print(markdown_table(headers, table))


if __name__ == "__main__":
    main()
