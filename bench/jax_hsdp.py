"""The JAX rows of ``bench/hsdp.py``: bytes crossing nodes per optimizer step and memory per
device for ddp, fsdp and hsdp (both gradient modes), on 4 host devices seen as 2 nodes of 2.

    python bench/jax_hsdp.py                 # width 256, 4 blocks, K = 1, 4, 16
    python bench/hsdp.py --backend jax       # the same (it runs this script)

Each row's window step is compiled (never run) for the torch bench's MLP (Linear(32, width),
``blocks`` residual blocks ``x + tanh(x W + b)``, Linear(width, 8); Adam; fp32; 8 rows per
device per micro-step). Its optimized HLO is read with ``accumix.jax.hlo.collective_ops``: each
collective's payload (what an all-gather delivers, what a reduce-scatter or all-reduce
reduces), times K when it sits in the scan body, goes to "across nodes" when a group holds
devices of both nodes (mesh positions {0,1} and {2,3}). Integer collectives (the window's
validity counts, K x 4 bytes) are left out. Memory per device: arguments + temporaries of
``memory_analysis()``, next to ``accumix.jax.memory``'s model. The projection is
``bench/hsdp.py``'s, from these bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections import defaultdict
from typing import Any

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import accumix.jax as axj  # noqa: E402
from _common import machine_line, markdown_table  # noqa: E402
from accumix.jax.hlo import collective_ops, node_map  # noqa: E402
from accumix.jax.memory import estimate_jax_memory  # noqa: E402

MIB, KIB, GB = 1024**2, 1024, 1e9
ROWS = {  # row: (label, gradients in the window, memory model row)
    "ddp": ("ddp", "full, once per step", "ddp"),
    "fsdp": ("fsdp", "full, reduce-scatter once per step", "fsdp"),
    "hsdp": ("hsdp", "sharded: reduce-scatter in node, all-reduce after the scan", "hsdp"),
    "hsdp-defer": ("hsdp", "full during the window (defer_reduce_scatter=True)", "hsdp-defer"),
}
MICRO = 8  # rows per device


def params(width: int, blocks: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)

    def dense(i: int, o: int) -> dict[str, np.ndarray]:
        return {"w": (rng.normal(size=(i, o)) / np.sqrt(i)).astype(np.float32),
                "b": np.zeros(o, np.float32)}
    return {"in": dense(32, width), **{f"block{i}": dense(width, width) for i in range(blocks)},
            "out": dense(width, 8)}


def make_loss(blocks: int) -> Any:
    def loss_fn(p: Any, batch: Any, rng: Any) -> jax.Array:
        x = batch["x"] @ p["in"]["w"] + p["in"]["b"]
        for i in range(blocks):
            x = x + jnp.tanh(x @ p[f"block{i}"]["w"] + p[f"block{i}"]["b"])
        return jnp.mean(jnp.square(x @ p["out"]["w"] + p["out"]["b"]))
    return loss_fn


def strategy(row: str) -> Any:
    if row.startswith("hsdp"):
        return axj.HSDPStrategy(replicas=2, defer_reduce_scatter=row == "hsdp-defer")
    return row


def measure(row: str, k: int, width: int, blocks: int) -> dict[str, Any]:
    acc = axj.Accelerator(strategy=strategy(row), precision="fp32", grad_accum_steps=k)
    p = params(width, blocks)
    state = acc.setup(p, optax.adam(1e-3))
    rng = np.random.default_rng(1)
    window = acc.window([{"x": rng.normal(size=(MICRO * 4, 32)).astype(np.float32)}
                         for _ in range(k)])
    compiled = acc.train_step(make_loss(blocks)).lower(state, window).compile()
    by: dict[str, float] = defaultdict(float)
    nodes = node_map(4, 2)
    for op in collective_ops(compiled.as_text()):
        if op.dtypes and op.dtypes[0].startswith(("s", "u", "pred")):
            continue  # the validity counts
        where = "inside" if not op.spans(nodes) else (
            "world" if op.groups and len(op.groups[0]) == 4 else "replicas")
        by[f"{where}|{op.kind.replace('-', '_')}"] += op.payload_bytes * (k if op.in_loop else 1)
    stats = compiled.memory_analysis()
    window_bytes = sum(x.nbytes for x in jax.tree.leaves(window.batch))
    model = {e.strategy: e.total_bytes for e in estimate_jax_memory(
        p, optax.adam(1e-3), num_devices=4, window_bytes=window_bytes, replicas=2)}
    return {"bytes": dict(by), "held": int(stats.argument_size_in_bytes
                                           + stats.temp_size_in_bytes),
            "predicted": model[ROWS[row][2]]}


def main() -> None:
    from hsdp import project  # bench/hsdp.py's projection (this folder is on sys.path)

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--params", type=float, default=7e9)
    parser.add_argument("--gbps", type=float, default=400.0)
    args, _ = parser.parse_known_args()
    warnings.simplefilter("ignore")
    n = sum(x.size for x in jax.tree.leaves(params(args.width, args.blocks)))
    model_bytes = 4 * n
    measured, projected = [], []
    for row in args.rows.split(","):
        label, mode, _ = ROWS[row]
        for k in args.k:
            got = measure(row, k, args.width, args.blocks)
            by = got["bytes"]
            across = sum(v for key, v in by.items() if not key.startswith("inside"))
            inside = sum(v for key, v in by.items() if key.startswith("inside"))
            measured.append([label, mode, k, f"{across / MIB:.3f}", f"{across / model_bytes:.2f}",
                             f"{inside / MIB:.3f}", f"{inside / model_bytes:.2f}",
                             f"{got['held'] / KIB:,.1f}", f"{got['predicted'] / KIB:,.1f}",
                             f"{got['held'] / got['predicted']:.3f}"])
            sent, seconds = project(by, model_bytes, nodes=args.nodes,
                                    per_node=args.gpus_per_node, params=args.params,
                                    gbps=args.gbps)
            projected.append([label, mode, k, f"{sent / GB:,.1f}", f"{seconds:.2f}"])
    print(machine_line(f"jax {jax.__version__}; 4 host devices as 2 nodes of 2, one process"))
    print(f"model: {n:,} parameters = {model_bytes / MIB:.3f} MiB fp32 ({args.blocks} blocks of "
          f"width {args.width}), Adam, fp32, {MICRO} rows per device per micro-step; bytes from "
          "the compiled step's HLO (in-scan collectives x K), per optimizer step, per device\n")
    print(markdown_table(["strategy", "gradients in the window", "K", "across nodes MiB/step",
                          "x model", "inside nodes MiB/step", "x model",
                          "compiled step KiB/device", "model", "ratio"], measured))
    print(f"\nprojection: {args.nodes} nodes x {args.gpus_per_node} GPUs, {args.params:.3g} "
          f"parameters, {args.gbps:g} Gb/s per node between nodes (bench/hsdp.py's rule)\n")
    print(markdown_table(["strategy", "gradients in the window", "K", "GB sent / node / step",
                          "s / step across nodes"], projected))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
