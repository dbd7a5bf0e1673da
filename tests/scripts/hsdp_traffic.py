"""A job for two ``accumix launch --nnodes 2 --nproc 2`` launchers: what crosses the nodes.

    python hsdp_traffic.py OUT_DIR      # on each rank, started by the launchers

Each rank trains the same MLP (SGD with momentum, clip at 1.0, fp32, 2 optimizer steps) under
hsdp (both gradient modes) at K=1 and K=16 and under fsdp at K=1 and K=4, counting every
collective with ``accumix.testing.CollectiveLog``, and compares the result with the one-process
large batch. A collective crosses nodes when its group holds ranks of two nodes (torchrun
numbers ranks node by node). Writes OUT_DIR/rank<R>.json: per run, bytes per optimizer step
across and inside nodes over the model's fp32 bytes, the steps, the difference to the
reference; and under "launch" the launcher, nodes and node rank the rank read.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import accumix as ax
from accumix.testing import CollectiveLog
from tests import workloads as w
from tests.distributed.test_sharded import Net

RUNS = {  # name: (strategy, K)
    "hsdp K=1": (lambda: ax.HSDPStrategy(), 1),
    "hsdp K=16": (lambda: ax.HSDPStrategy(), 16),
    "hsdp-defer K=1": (lambda: ax.HSDPStrategy(defer_reduce_scatter=True), 1),
    "hsdp-defer K=16": (lambda: ax.HSDPStrategy(defer_reduce_scatter=True), 16),
    "fsdp K=1": (lambda: ax.FSDPStrategy(), 1),
    "fsdp K=4": (lambda: ax.FSDPStrategy(), 4),
}
MICRO, STEPS = 2, 2


def run(make: Any, steps: int) -> dict[str, Any]:
    acc = ax.Accelerator(strategy=make(), precision="fp32", grad_accum_steps=steps)
    per_node = acc.launch.local_world_size
    model = Net()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    data = w.regression_data(MICRO * acc.world_size * steps * STEPS)
    ref = w.reference_params(model, data, MICRO * acc.world_size * steps, items=False)
    opt = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    model, opt, loader = acc.setup(model, opt, DataLoader(data, batch_size=MICRO))
    with CollectiveLog() as log:
        for batch in loader:
            with acc.accumulate():
                acc.backward(w.mean_loss(model, batch))
                acc.clip_grad_norm_(1e9)  # the global norm; the gradients stay as they are
                opt.step()
                opt.zero_grad()
    got = [p.full_tensor() if isinstance(p, DTensor) else p
           for p in acc.unwrap(model).parameters()]

    def crosses(ranks: tuple[int, ...]) -> bool:
        return len({r // per_node for r in ranks}) > 1

    per_step = acc.optimizer_steps * model_bytes
    return {"across": log.nbytes(crosses) / per_step,
            "inside": log.nbytes(lambda ranks: not crosses(ranks)) / per_step,
            "steps": acc.optimizer_steps, "diff": w.max_diff(ref, got)}


def main() -> None:
    warnings.filterwarnings("ignore")
    out: dict[str, Any] = {name: run(make, steps) for name, (make, steps) in RUNS.items()}
    launch = ax.Accelerator(precision="fp32").launch  # what the ranks read from the launcher
    out["launch"] = {"launcher": launch.launcher, "nodes": launch.num_nodes,
                     "node": launch.node_rank, "local_world": launch.local_world_size}
    rank = torch.distributed.get_rank()
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
