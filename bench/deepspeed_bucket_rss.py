"""DeepSpeed ZeRO on CPU: what its reduction buckets really occupy, next to what the
``micro_batch_size="auto"`` probe counts for them.

    python bench/deepspeed_bucket_rss.py                  # stage 2, bf16-mixed
    python bench/deepspeed_bucket_rss.py --stage 1 --precision fp32 --overlap-comm

One process (a fresh one per run: ``ru_maxrss`` only grows). A 3-layer MLP (513 parameters)
runs the first micro-step (4 rows, K=2: off the boundary) at DeepSpeed's default
``reduce_bucket_size`` (5e8 elements); the line gives the process's peak resident growth over
that backward (``ru_maxrss``), the bucket bytes ZeRO still holds after it (stage 2 frees them
at the end of each backward), and the growth the probe (``micro_batch_probe.measure``)
counts for 4 rows.
"""

from __future__ import annotations

import argparse
import gc
import resource

import torch
from torch import nn

import accumix as ax
from accumix.memory.micro_batch_probe import measure


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--overlap-comm", action="store_true")
    args = parser.parse_args()
    config = {"zero_optimization": {"overlap_comm": args.overlap_comm}}
    acc = ax.Accelerator(strategy=ax.DeepSpeedStrategy(stage=args.stage, config=config),
                         precision=args.precision, global_batch_size=8,
                         micro_batch_size=4, seed=0)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 1))
    model, _ = acc.setup(net, torch.optim.AdamW(net.parameters()))

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch[0]).float(), batch[1])

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 6), torch.randn(n, 1)

    probed = measure(acc._run, step, make, 4).growth
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with acc.accumulate():
        acc.backward(step(make(4)))
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    held = sum(b.nbytes for bucket in model.optimizer.ipg_buckets.values()
               for b in bucket.buffer)
    print(f"stage {args.stage} {args.precision} overlap_comm={args.overlap_comm}: "
          f"resident growth of the first backward {grown:,} bytes; buckets allocated "
          f"{held:,} bytes; the probe counts {probed:,} bytes of growth")
    acc.end()


if __name__ == "__main__":
    main()
