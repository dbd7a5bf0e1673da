"""What a 16-bit gradient reduction saves and costs: bytes per step and error vs float64.

    python bench/reduce_dtype.py                          # 4 ranks, K = 1, 4, 16, every row
    python bench/reduce_dtype.py --rows ddp-bf16 --k 1    # one row, a smoke run

Four ranks on gloo (``accumix.testing.spawn``, as 2 simulated nodes of 2 for hsdp) train the
same small transformer (``accumix.testing.TinyTransformer``, 2 layers of width 32) for 10 SGD
steps; the global batch is fixed (16 sequences per rank) and split into K micro-batches per
rank. Each row is one (strategy, precision, reduce dtype) through
``accumix.testing.reduction_error_job``:

* bytes/step: gradient payload one rank hands to its all-reduces and reduce-scatters per
  optimizer step (``CollectiveLog`` around the backward calls; ddp's float32 rows register
  torch's ``allreduce_hook``, since DDP's built-in C++ all-reduce is invisible to it);
* error: ||w - w64|| / ||w64|| and, stricter, over the training's own movement ||w64 - w0||,
  against the same run in float64 on one process.

fp16 on the wire needs ``fp16-mixed`` (accumix refuses it elsewhere), so the fp16 row has a
``fp16-mixed`` float32-wire row beside it: their difference is the wire's. The ``accelerate``
row is the same job under Accelerate's documented way, ``Accelerator(gradient_accumulation_
steps=K)`` with ``DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16)``: torch's
``bf16_compress_hook`` (casts, then divides in bf16), registered through a wrapper because DDP
refuses that hook by name off NCCL.

The projection: a ring all-reduce moves 2(W-1)/W of the payload per rank; at a link's bandwidth,
without overlap with compute (the upper bound of what halving saves), the seconds per optimizer
step for a 1B and a 7B-parameter model on 8 nodes, from the measured bytes per parameter.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import torch
import torch.distributed as dist

from _common import machine_line, markdown_table
from accumix.testing import (
    CollectiveLog,
    TinyTransformer,
    flat_weights,
    next_token_loss,
    reduction_error_job,
    reference_weights,
    relative_errors,
    spawn,
    token_batches,
)

# row -> (strategy, precision, reduce_dtype)
ROWS = {
    "ddp-fp32": ("ddp", "fp32", "fp32"), "ddp-bf16": ("ddp", "fp32", "bf16"),
    "ddp-fp16mixed-fp32": ("ddp", "fp16-mixed", "fp32"),
    "ddp-fp16mixed-fp16": ("ddp", "fp16-mixed", "fp16"),
    "fsdp-fp32": ("fsdp", "fp32", "fp32"), "fsdp-bf16": ("fsdp", "fp32", "bf16"),
    "deepspeed1-fp32": ("deepspeed1", "fp32", "fp32"),
    "deepspeed1-bf16": ("deepspeed1", "fp32", "bf16"),
    "deepspeed2-bf16": ("deepspeed2", "fp32", "bf16"),
    "hsdp-fp32": ("hsdp", "fp32", "fp32"), "hsdp-bf16": ("hsdp", "fp32", "bf16"),
    "accelerate-bf16-hook": ("accelerate", "fp32", "bf16"),
}
LINKS = (("100 Gb/s Ethernet", 12.5e9), ("400 Gb/s InfiniBand", 50e9))
MODELS = (("1B", 1e9), ("7B", 7e9))
NODES = 8


def _strategy(word: str) -> Any:
    import accumix as ax

    if word.startswith("deepspeed"):
        return ax.DeepSpeedStrategy(stage=int(word[-1]))
    if word == "ddp":
        # The float32 wire through torch's allreduce_hook: DDP's C++ all-reduce, made visible.
        class VisibleDDP(ax.DDPStrategy):
            def setup(self, model: Any, optimizers: Any) -> Any:
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                    allreduce_hook,
                )

                model, optimizers = super().setup(model, optimizers)
                if self.world_size > 1 and self._wire_dtype(model) is None:
                    model.register_comm_hook(None, allreduce_hook)
                return model, optimizers

        return VisibleDDP()
    return word


def _accelerate(grad_accum_steps: int, *, steps: int = 10, per_rank: int = 16, lr: float = 0.1,
                momentum: float = 0.9, seed: int = 0) -> dict[str, Any]:
    """The same job under Accelerate with its BF16 DDP communication hook."""
    from accelerate import Accelerator
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=grad_accum_steps)
    world, rank = accelerator.num_processes, accelerator.process_index
    batches = token_batches(steps, per_rank * world, seed=seed)
    torch.manual_seed(seed)
    model = TinyTransformer()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model, opt = accelerator.prepare(model, opt)
    # DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16) registers torch's
    # bf16_compress_hook, which DDP refuses by name off NCCL ("required CUDA 11+ and NCCL
    # 2.10+"); gloo all-reduces bf16 (checked), so the same function runs through a wrapper.
    model.register_comm_hook(None, lambda state, bucket: bf16_compress_hook(state, bucket))
    micro, log = per_rank // grad_accum_steps, CollectiveLog()
    for batch in batches:
        for part in batch[rank * per_rank:(rank + 1) * per_rank].split(micro):
            with accelerator.accumulate(model):
                loss = next_token_loss(model, part)
                with log:
                    accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
    grads = [c for c in log.calls if c.op == "all_reduce"]
    out: dict[str, Any] = {"bytes": sum(c.nbytes for c in grads) / steps,
                           "dtypes": sorted({str(c.dtype) for c in grads})}
    if rank == 0:
        first, exact = reference_weights(batches, lr=lr, momentum=momentum, seed=seed)
        weights = flat_weights(accelerator.unwrap_model(model).state_dict())
        out.update(relative_errors(weights, first, exact))
    accelerator.wait_for_everyone()
    return out


def rank_main(rows: list[str], ks: list[int]) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    out = {}
    for row in rows:
        word, precision, reduce_dtype = ROWS[row]
        for k in ks:
            if word == "accelerate":
                out[f"{row}|{k}"] = _accelerate(k)
            else:
                out[f"{row}|{k}"] = reduction_error_job(
                    _strategy(word), reduce_dtype=reduce_dtype, precision=precision,
                    grad_accum_steps=k)
    if dist.is_initialized():
        dist.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; use {', '.join(ROWS)}")
    results = spawn(rank_main, nprocs=4, args=(rows, args.k), timeout=3600, nodes=2)[0]
    params = sum(p.numel() for p in TinyTransformer().parameters())
    table, per_param = [], {}
    for row in rows:
        word, precision, reduce_dtype = ROWS[row]
        for k in args.k:
            r = results[f"{row}|{k}"]
            per_param[reduce_dtype] = per_param.get(reduce_dtype) or (
                r["bytes"] / params if word in ("ddp", "accelerate") and k == 1 else None)
            table.append([word, precision, reduce_dtype, k, f"{r['bytes']:,.0f}",
                          "/".join(d.removeprefix("torch.") for d in r["dtypes"]),
                          f"{r['weights']:.2e}", f"{r['update']:.2e}"])
    print(machine_line("4 ranks as 2 nodes, gloo"))
    print(f"model: TinyTransformer, {params:,} parameters; 10 SGD steps (lr 0.1, momentum 0.9), "
          "16 sequences of 16 tokens per rank per step, in K micro-batches\n")
    print(markdown_table(["strategy", "precision", "reduce", "K", "bytes/step", "wire dtype",
                          "rel. error (weights)", "rel. error (update)"], table))
    ring = 2 * (NODES - 1) / NODES
    projection = []
    for name, count in MODELS:
        for link, bandwidth in LINKS:
            fp32, bf16 = (per_param.get(d) for d in ("fp32", "bf16"))
            if fp32 is None or bf16 is None:
                continue
            t32, t16 = (ring * count * b / bandwidth for b in (fp32, bf16))
            projection.append([name, link, f"{fp32:g}", f"{bf16:g}", f"{t32:.3f}", f"{t16:.3f}",
                               f"{t32 - t16:.3f}"])
    if projection:
        print(f"\nprojected all-reduce seconds per optimizer step, {NODES} nodes, ring, no "
              "overlap (reductions once per step; x K where a mode reduces every micro-step)\n")
        print(markdown_table(["model", "link", "B/param fp32", "B/param bf16", "s fp32",
                              "s bf16", "saved s/step"], projection))


if __name__ == "__main__":
    main()
