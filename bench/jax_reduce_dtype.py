"""What gradients travel in, on accumix.jax: bytes and error of fp32/bf16 reductions at K=1, 4, 16
for every JAX strategy on 4 host devices (hsdp: 2 nodes of 2), against float64.

    python bench/jax_reduce_dtype.py                       # every row, K = 1, 4, 16
    python bench/jax_reduce_dtype.py --rows ddp --k 1 4    # a subset

The run: an MLP (Linear(16, 64), 2 residual blocks ``x + tanh(x W + b)`` of width 64,
Linear(64, 4); 9,668 parameters), 10 steps of SGD (lr 0.1, momentum 0.9), a mean-squared loss
on 64 rows per step split into K micro-batches (the global batch does not change with K), fp32
compute. The reference is the same 10 steps in float64 on one device (numpy inputs, the whole
64 rows at once). Errors: ||w - w64|| / ||w64|| and the same over the float64 run's own
movement ||w64 - w0||.

bytes/step: the gradient payload one device hands to its collectives per optimizer step, read
from the *lowered* HLO (the program's dtypes: XLA's CPU backend promotes 16-bit reductions to
float32 when it compiles, after rounding each operand; a GPU or TPU keeps them), float
collectives of more than one element (the loss sums and validity counts left out), in-scan
collectives x K.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import accumix.jax as axj  # noqa: E402
from _common import machine_line, markdown_table  # noqa: E402
from accumix.jax.hlo import collective_ops  # noqa: E402

STEPS, ROWS, WIDTH, BLOCKS = 10, 64, 64, 2
STRATEGIES = ("ddp", "zero1", "fsdp", "fsdp-sync", "hsdp", "hsdp-defer")


def params() -> dict[str, Any]:
    rng = np.random.default_rng(0)

    def dense(i: int, o: int) -> dict[str, np.ndarray]:
        return {"w": (rng.normal(size=(i, o)) / np.sqrt(i)).astype(np.float32),
                "b": (rng.normal(size=o) * 0.1).astype(np.float32)}
    return {"in": dense(16, WIDTH), **{f"block{i}": dense(WIDTH, WIDTH) for i in range(BLOCKS)},
            "out": dense(WIDTH, 4)}


def loss_fn(p: Any, batch: Any, rng: Any) -> jax.Array:
    x = batch["x"].astype(p["in"]["w"].dtype) @ p["in"]["w"] + p["in"]["b"]
    for i in range(BLOCKS):
        x = x + jnp.tanh(x @ p[f"block{i}"]["w"] + p[f"block{i}"]["b"])
    return jnp.mean(jnp.square(x @ p["out"]["w"] + p["out"]["b"] - batch["y"]))


def data() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(ROWS, 16)).astype(np.float32),
             "y": rng.normal(size=(ROWS, 4)).astype(np.float32)} for _ in range(STEPS)]


def optimizer() -> optax.GradientTransformation:
    return optax.sgd(0.1, momentum=0.9)


def float64_run() -> tuple[Any, Any]:
    """(w0, w64): the start and the end of the run in float64 on one device."""
    with jax.enable_x64(True):
        p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params())
        start = jax.tree.map(np.asarray, p)
        tx = optimizer()
        state = tx.init(p)
        for big in data():
            batch = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), big)
            grads = jax.grad(lambda q, b=batch: loss_fn(q, b, None))(p)
            updates, state = tx.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        return start, jax.tree.map(np.asarray, p)


def strategy(name: str) -> Any:
    return {"fsdp-sync": axj.FSDPStrategy(sync_each_microstep=True),
            "hsdp": axj.HSDPStrategy(replicas=2),
            "hsdp-defer": axj.HSDPStrategy(replicas=2, defer_reduce_scatter=True)}.get(name, name)


def measure(name: str, reduce: str, k: int) -> dict[str, Any]:
    acc = axj.Accelerator(strategy=strategy(name), precision="fp32", grad_accum_steps=k,
                          reduce_dtype=reduce)
    state = acc.setup(params(), optimizer())
    windows = [[{key: v[i * ROWS // k:(i + 1) * ROWS // k] for key, v in big.items()}
                for i in range(k)] for big in data()]
    lowered = acc.train_step(loss_fn).lower(state, acc.window(windows[0]))
    grads = [op for op in collective_ops(lowered.compiler_ir("hlo").as_hlo_text())
             if op.kind != "all-gather" and op.dtypes[0] in ("f32", "bf16", "f16")
             and op.result_bytes > 4]
    compiled = lowered.compile()
    for window in windows:
        state, _ = compiled(state, acc.window(window))
    return {"bytes": sum(op.payload_bytes * (k if op.in_loop else 1) for op in grads),
            "wire": "/".join(sorted({op.dtypes[0] for op in grads})),
            "params": jax.tree.map(np.asarray, state.params),
            "reductions": acc.effective_dtypes.reductions}


def norm(tree: Any) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                             for x in jax.tree.leaves(tree))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(STRATEGIES))
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--reduce", default="fp32,bf16")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    start, w64 = float64_run()
    moved = norm(jax.tree.map(lambda a, b: a - b, w64, start))
    rows = []
    for name in args.rows.split(","):
        for reduce in args.reduce.split(","):
            for k in args.k:
                got = measure(name, reduce, k)
                diff = norm(jax.tree.map(lambda a, b: a - b, got["params"], w64))
                rows.append([name, reduce, k, f"{got['bytes']:,}", got["wire"],
                             f"{diff / norm(w64):.2e}", f"{diff / moved:.2e}",
                             got["reductions"]])
    n = sum(x.size for x in jax.tree.leaves(params()))
    print(machine_line(f"jax {jax.__version__}; 4 host devices (hsdp: 2 nodes of 2), one "
                       "process"))
    print(f"model: {n:,} parameters; {STEPS} steps of SGD, {ROWS} rows per step in K "
          "micro-batches; errors against the same run in float64\n")
    print(markdown_table(["strategy", "reduce", "K", "bytes/step (lowered HLO)", "wire dtype",
                          "rel. error (weights)", "rel. error (update)", "reductions"], rows))


if __name__ == "__main__":
    main()
