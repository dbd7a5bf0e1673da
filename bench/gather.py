"""``acc.gather`` against a plain ``dist.all_gather`` of the same rows, on 2 ranks over gloo.

    python bench/gather.py                 # 64 rows of 16 float32, 300 calls each, 2 ranks
    python bench/gather.py --rows 4096 --calls 100

Each rank gathers ``--rows`` rows (rank 1 one row fewer for ``acc.gather``: unequal sizes are
what it is for); a plain ``torch.distributed.all_gather`` of equal ``[rows, 16]`` tensors is
the floor. Calls alternate between the two (so a load change on the machine hits both alike);
the median of each is reported, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import accumix as ax
from accumix.testing import spawn


def job(rows: int, calls: int) -> dict[str, float]:
    acc = ax.Accelerator(strategy="ddp", precision="fp32")
    mine = torch.randn(rows - acc.rank, 16)
    equal = torch.randn(rows, 16)
    out = [torch.empty_like(equal) for _ in range(acc.world_size)]
    plain, ours = [], []
    for _ in range(calls):
        start = time.perf_counter()
        dist.all_gather(out, equal)
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        acc.gather(mine)
        ours.append(time.perf_counter() - start)
    acc.end()
    return {"plain_us": statistics.median(plain) * 1e6,
            "gather_us": statistics.median(ours) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    result = spawn(job, 2, (args.rows, args.calls), timeout=600)[0]
    print(f"rows {args.rows}: dist.all_gather {result['plain_us']:.0f} us, acc.gather "
          f"{result['gather_us']:.0f} us, ratio {result['gather_us'] / result['plain_us']:.2f}")


if __name__ == "__main__":
    main()
