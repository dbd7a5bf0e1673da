"""Bytes crossing nodes per optimizer step, and memory per device: ddp, fsdp, hsdp on 2x2
simulated nodes, with a projection to a real cluster.

    python bench/hsdp.py                            # width 256, 4 blocks, K = 1, 4, 16
    python bench/hsdp.py --width 32 --blocks 2 --k 1 4 --steps 1 --rows hsdp,fsdp  # smoke

Four ranks on gloo as two nodes of two (``accumix.testing.spawn(nodes=2)``) train an MLP of
identical blocks (Adam, fp32, micro-batches of 8) with K micro-steps per optimizer step. Each
rank counts every collective after a warm-up window (``accumix.testing.CollectiveLog``;
DDP's reducer through torch's default comm hook, which calls ``dist.all_reduce``) and splits
their payload bytes by whether the group's ranks span both nodes. Rows:

* ddp: the model replicated, gradients all-reduced over all ranks once per step;
* fsdp (full): sharded over all 4 ranks; gradients reduce-scattered once per step
  (accumix's default ``set_requires_gradient_sync(False)`` off the boundary);
* hsdp (sharded grads): ``HSDPStrategy()``, reduce-scatter inside the node every micro-step,
  the shards all-reduced across nodes at the boundary;
* hsdp (full grads): ``HSDPStrategy(defer_reduce_scatter=True)``;
* deepspeed-3 and deepspeed-3 hpz (``DeepSpeedStrategy(stage=3, hpz="node")``), when
  DeepSpeed is installed, with ``stage3_param_persistence_threshold=0`` (every parameter
  gathered at its use, as a large model's are).

Memory per device: the model states a rank holds (each storage once, ``tests/model_states.py``):
the peak of parameter storage over the forward (shards and gathered buffers), the most gradient
storage held during the window or after the boundary's backward (FSDP2's unsharded or partial
accumulators too), the optimizer's states; next to ``accumix.memory.model``'s prediction for
that K (from K=2 fsdp's default and hsdp's ``defer_reduce_scatter`` hold the window's unsharded
gradients: rows ``fsdp-full`` and ``hsdp-full-defer``).

The projection (no speed is measured on a CPU): each cross-node collective, as a multiple of
the model's bytes, moved to a cluster (``--nodes`` x ``--gpus-per-node``, ``--params``,
``--gbps`` per node between nodes) with the same parallelism: a collective over all ranks
carries its payload once per node, one over a replicate group (one rank per node) once per
rank of the node, shrunk by the larger shard; each node sends ``(N-1)/N`` of it (all-gather,
reduce-scatter) or ``2(N-1)/N`` (all-reduce), the least any algorithm sends, at the node's
bandwidth. fp32 as measured (under bf16-mixed, fsdp's gathers halve; the gradients stay fp32
by default). JAX rows: ``--backend jax`` (``bench/jax_hsdp.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import warnings
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import accumix as ax
from _common import machine_line, markdown_table
from accumix.memory.model import estimate_memory
from accumix.testing import CollectiveLog, spawn
from accumix.testing import ResidualBlock as Block

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.model_states import grad_bytes, optimizer_bytes, param_bytes  # noqa: E402

KIB, MIB, GB = 1024, 1024**2, 1e9
NODES, WORLD, MICRO = 2, 4, 8
ROWS = {  # row: (label, gradient mode, memory model row)
    "ddp": ("ddp", "full, once per step", "ddp"),
    "fsdp": ("fsdp (full)", "full, reduce-scatter once per step", "fsdp-full"),
    "hsdp": ("hsdp (full)", "sharded: reduce-scatter in node, all-reduce at boundary",
             "hsdp-full"),
    "hsdp-defer": ("hsdp (full)", "full during the window (defer_reduce_scatter=True)",
                   "hsdp-full-defer"),
    "deepspeed-3": ("deepspeed-3", "reduce-scatter every micro-step", "deepspeed-3"),
    "deepspeed-3-hpz": ("deepspeed-3 hpz='node'", "reduce-scatter every micro-step",
                        "deepspeed-3"),
}


def make_model(width: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), *(Block(width) for _ in range(blocks)),
                         nn.Linear(width, 8))


def make_strategy(row: str) -> Any:
    if row == "fsdp":
        return ax.FSDPStrategy()
    if row.startswith("hsdp"):
        return ax.HSDPStrategy(defer_reduce_scatter=row == "hsdp-defer")
    if row.startswith("deepspeed"):
        # Threshold 0: every parameter partitioned and gathered at its use, as nearly all of a
        # large model's are (DeepSpeed keeps those under 1e5 elements, here all, gathered).
        return ax.DeepSpeedStrategy(stage=3, hpz="node" if row.endswith("hpz") else None,
                                    config={"zero_optimization": {
                                        "stage3_param_persistence_threshold": 0}})
    return "ddp"


def measure(row: str, k: int, width: int, blocks: int, steps: int) -> dict[str, Any]:
    """One rank: bytes per step by op and group (after a warm-up window), model-state bytes."""
    warnings.filterwarnings("ignore")
    acc = ax.Accelerator(strategy=make_strategy(row), precision="fp32", grad_accum_steps=k,
                         micro_batch_size=MICRO)
    model = make_model(width, blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.setup(model, opt)
    module = acc.unwrap(model)
    log = CollectiveLog()
    if row == "ddp":
        # DDP's reducer reduces in C++; with torch's default hook registered it calls
        # dist.all_reduce from Python, where the log sees it (the same all-reduce).
        model.register_comm_hook(dist.group.WORLD, allreduce_hook)
    peak = {"params": 0, "grads": 0}

    def params_now(*_: Any) -> None:
        peak["params"] = max(peak["params"], param_bytes(module))

    for sub in module.modules():
        sub.register_forward_hook(params_now, prepend=True)  # before FSDP reshards the unit
    x = torch.randn(MICRO, 32, generator=torch.Generator().manual_seed(acc.rank))
    with contextlib.ExitStack() as stack:
        for micro in range(k * (steps + 1)):
            if micro == k:  # the first window warms up (DDP rebuilds its buckets)
                stack.enter_context(log)
            with acc.accumulate():
                acc.backward(model(x).square().mean())
                peak["grads"] = max(peak["grads"], grad_bytes(acc.strategy, module))
                opt.step()
                opt.zero_grad()
    by: dict[str, float] = defaultdict(float)
    for call in log.calls:
        nodes = {r // (acc.world_size // NODES) for r in call.ranks}
        where = "inside" if len(nodes) == 1 else (
            "world" if len(call.ranks) == acc.world_size else "replicas")
        by[f"{where}|{call.op}"] += call.nbytes / steps
    return {"bytes": dict(by), "params": peak["params"], "grads": peak["grads"],
            "optimizer": optimizer_bytes(opt, module)}


def rank_main(rows: list[str], ks: list[int], width: int, blocks: int, steps: int
              ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in rows:
        for k in ks:
            try:
                out[f"{row}|{k}"] = measure(row, k, width, blocks, steps)
            except Exception as exc:  # noqa: BLE001 - the row says why
                out[f"{row}|{k}"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:100]
    return out


def measure_jax() -> None:
    """The JAX rows: ``bench/jax_hsdp.py`` (accumix.jax's hsdp on 4 host devices as 2 nodes of
    2, one process; XLA must see them before jax is imported), with this command's arguments."""
    import os
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax_hsdp.py")
    argv = [a for a in sys.argv[1:] if a not in ("--backend", "jax")]
    os.execv(sys.executable, [sys.executable, script, *argv])


def project(by: dict[str, float], model_bytes: int, *, nodes: int, per_node: int, params: float,
            gbps: float) -> tuple[float, float]:
    """(bytes each node sends to other nodes per step, seconds at ``gbps``) on the cluster,
    from one rank's measured bytes per step (see the module docstring)."""
    cluster_model = 4 * params  # fp32, as measured
    sent = 0.0
    for key, nbytes in by.items():
        where, op = key.split("|")
        if where == "inside":
            continue
        multiple = nbytes / model_bytes  # of the model, per rank
        # a replicate group's payload is a shard: 1/per_node of the model on the cluster
        # instead of 1/(WORLD/NODES) here, and each of the node's ranks sends its own
        payload = multiple * cluster_model * (1 if where == "world" else WORLD // NODES)
        sent += (2 if op == "all_reduce" else 1) * (nodes - 1) / nodes * payload
    return sent, sent / (gbps * GB / 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="counted optimizer steps per row")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--backend", choices=("torch", "jax"), default="torch")
    parser.add_argument("--nodes", type=int, default=8, help="projection: nodes")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="projection: GPUs a node")
    parser.add_argument("--params", type=float, default=7e9, help="projection: parameters")
    parser.add_argument("--gbps", type=float, default=400.0,
                        help="projection: Gb/s between nodes, per node")
    args = parser.parse_args()
    if args.backend == "jax":
        measure_jax()
    rows = [r for r in args.rows.split(",") if not r.startswith("deepspeed")
            or importlib.util.find_spec("deepspeed") is not None]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    results = spawn(rank_main, WORLD, args=(rows, args.k, args.width, args.blocks, args.steps),
                    nodes=NODES, timeout=1800)
    model = make_model(args.width, args.blocks)
    n = sum(p.numel() for p in model.parameters())
    model_bytes = 4 * n
    # by K: from K=2 the window rows (fsdp's default and hsdp-*-defer hold it unsharded)
    predicted = {k: {e.strategy: e.total_bytes for e in estimate_memory(
        model, world_size=WORLD, ranks_per_node=WORLD // NODES, optimizer_states=2,
        grad_accum_steps=k)} for k in args.k}
    cluster = {k: {e.strategy: e.total_bytes for e in estimate_memory(
        int(args.params), world_size=args.nodes * args.gpus_per_node,
        ranks_per_node=args.gpus_per_node, optimizer_states=2, block_params=int(args.params)
        // 32, grad_accum_steps=k)} for k in args.k}
    measured, projected = [], []
    for row in rows:
        label, mode, window_row = ROWS[row]
        for k in args.k:
            # one micro-step a window: the defer row is hsdp's default (listed from K=2)
            memory_row = window_row if window_row in predicted[k] else "hsdp-full"
            per_rank = [r[f"{row}|{k}"] for r in results]
            if any(isinstance(r, str) for r in per_rank):
                reason = next(r for r in per_rank if isinstance(r, str))
                measured.append([label, mode, k, *["n/a"] * 7, reason])
                continue
            # the rank that moves the most (shards differ by padding)
            by = max((r["bytes"] for r in per_rank),
                     key=lambda b: sum(v for key, v in b.items() if "inside" not in key))
            across = sum(v for key, v in by.items() if not key.startswith("inside"))
            inside = sum(v for key, v in by.items() if key.startswith("inside"))
            held = max(r["params"] + r["grads"] + r["optimizer"] for r in per_rank)
            measured.append([label, mode, k, f"{across / MIB:.3f}", f"{across / model_bytes:.2f}",
                             f"{inside / MIB:.3f}", f"{inside / model_bytes:.2f}",
                             f"{held / KIB:,.1f}", f"{predicted[k][memory_row] / KIB:,.1f}",
                             f"{held / predicted[k][memory_row]:.3f}", ""])
            sent, seconds = project(by, model_bytes, nodes=args.nodes,
                                    per_node=args.gpus_per_node, params=args.params,
                                    gbps=args.gbps)
            projected.append([label, mode, k, f"{sent / GB:,.1f}", f"{seconds:.2f}",
                              f"{cluster[k][memory_row] / 2**30:,.1f}"])
    print(machine_line(f"{WORLD} ranks as {NODES} nodes of {WORLD // NODES}, gloo"))
    print(f"model: {n:,} parameters = {model_bytes / MIB:.3f} MiB fp32 ({args.blocks} blocks "
          f"of width {args.width}), Adam, fp32, micro-batch {MICRO}; per optimizer step, "
          f"{args.steps} steps counted after a warm-up window, the rank that moves most\n")
    headers = ["strategy", "gradients in the window", "K", "across nodes MiB/step", "x model",
               "inside nodes MiB/step", "x model", "model states KiB/device", "predicted",
               "ratio", "note"]
    if not any(row[-1] for row in measured):
        headers, measured = headers[:-1], [row[:-1] for row in measured]
    print(markdown_table(headers, measured))
    print(f"\nprojection: {args.nodes} nodes x {args.gpus_per_node} GPUs, {args.params:.3g} "
          f"parameters, {args.gbps:g} Gb/s per node between nodes, fp32 as measured; bytes each "
          "node sends to the others per step (the least any algorithm sends) and the seconds "
          "that takes; model states per GPU from accumix.memory.model (Adam, fp32, the "
          "largest block 1/32 of the model)\n")
    print(markdown_table(["strategy", "gradients in the window", "K", "GB sent / node / step",
                          "s / step across nodes", "model states GiB / GPU"], projected))


if __name__ == "__main__":
    main()
