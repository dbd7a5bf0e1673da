"""accumix.jax's hsdp and reduce_dtype on 4 host devices seen as 2 nodes of 2, in one process.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/scripts/jax_hsdp.py OUT_DIR

Prints one JSON object (the last line) that ``tests/unit/test_jax_hsdp.py`` asserts on. Each
step is compiled once (``lower().compile()``, then that executable runs), 10 compilations in all:

    default     hsdp, item mode, K=4: 3 windows (the last short) vs the one-device large batch;
                where its collectives run and over which devices (compiled HLO); saved at
                step 2, reloaded under hsdp (continues bitwise), fsdp and ddp (state bitwise),
                and back from fsdp into hsdp (bitwise)
    k1          hsdp, item mode, K=1: vs the large batch; bytes crossing nodes equal to K=4's
    defer       hsdp(defer_reduce_scatter=True), mean mode, K=4: vs the large batch, HLO
    wire        reduce_dtype="bf16" lowered (not compiled) on ddp, zero1, fsdp, fsdp-sync,
                hsdp, hsdp-defer: the gradient collectives' operand dtypes
    error       ddp with reduce_dtype bf16 at K=1 and K=16 and fp32 at K=16 vs float64
    fp16        hsdp, fp16-mixed, reduce_dtype fp16: an overflow in one device's rows skips
    fp16_items  ddp, hsdp, hsdp-defer, fp16-mixed, reduce_dtype fp16, item mode at the
                default scale: no window skipped, the large batch's params
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import accumix.jax as axj
from accumix.jax.hlo import collective_ops, node_map
from tests import jax_workloads as w

ROWS = 8  # per micro-batch: 2 per device
NODE_OF = node_map(4, 2)


def windows_of(batches: list[Any], k: int) -> list[list[Any]]:
    return [batches[i:i + k] for i in range(0, len(batches), k)]


def compiled(acc: axj.Accelerator, state: Any, step: Any, window: Any) -> Any:
    return step.lower(state, acc.window(window)).compile()


def placement(text: str) -> dict[str, Any]:
    """Per collective kind: in loop / outside, spanning nodes or not; bytes across nodes."""
    out: dict[str, Any] = {"ops": [], "across_bytes": 0, "inside_bytes": 0}
    for op in collective_ops(text):
        spans = op.spans(NODE_OF)
        out["ops"].append([op.kind, op.in_loop, spans, list(op.dtypes)])
        out["across_bytes" if spans else "inside_bytes"] += op.payload_bytes
    return out


def run_hsdp(out: Path, result: dict[str, Any]) -> None:
    k = 4
    batches = w.micro_batches(2 * k + 2, rows=ROWS, seed=3)
    windows = windows_of(batches, k)  # 4, 4, 2: the last window is short
    ref = w.reference(windows, items=True)
    acc = axj.Accelerator(strategy=axj.HSDPStrategy(replicas=2), precision="fp32",
                          grad_accum_steps=k)
    state = acc.setup(w.init_params(), w.optimizer())
    step = compiled(acc, state, acc.train_step(w.item_loss), windows[0])
    result["default_hlo"] = placement(step.as_text())
    result["specs"] = str(state.params["hidden"]["w"].sharding.spec)
    result["mesh"] = dict(acc.strategy.mesh.shape)
    result["effective"] = acc.effective_dtypes.describe()
    memory = step.memory_analysis()
    result["default_bytes"] = int(memory.argument_size_in_bytes + memory.temp_size_in_bytes)
    for i, window in enumerate(windows):
        state, _ = step(state, acc.window(window))
        if i == 1:
            acc.save_state(out / "run", state)
    result["default"] = w.max_diff(state.params, ref)
    result["steps"] = int(state.step)
    # Every replica holds the same weights: the two nodes' copies of each shard.
    result["replicas_equal"] = all(
        np.array_equal(np.asarray(s1.data), np.asarray(s2.data))
        for leaf in jax.tree.leaves(state.params) for s1, s2 in _replica_pairs(leaf))
    uninterrupted = host(state.params)
    # Same mesh: reloaded, the last window again, bitwise.
    resumed = acc.load_state(out / "run", state)
    saved = host(resumed)
    resumed, _ = step(resumed, acc.window(windows[-1]))
    result["resume_bitwise"] = _equal(host(resumed.params), uninterrupted)
    # Other layouts: the saved state restored under fsdp (4 devices) and ddp, bitwise; fsdp's
    # save restored under hsdp again, bitwise.
    result["reshard"] = {}
    for word in ("fsdp", "ddp"):
        other = axj.Accelerator(strategy=word, precision="fp32", grad_accum_steps=k)
        template = other.setup(w.init_params(), w.optimizer())
        loaded = other.load_state(out / "run", template)
        result["reshard"][word] = [_equal(host(loaded), saved),
                                   str(loaded.params["hidden"]["w"].sharding.spec)]
        if word == "fsdp":
            other.save_state(out / "fsdp-run", loaded)
    back = acc.load_state(out / "fsdp-run", acc.setup(w.init_params(), w.optimizer()))
    result["reshard"]["fsdp->hsdp"] = [_equal(host(back), saved),
                                      str(back.params["hidden"]["w"].sharding.spec)]

    one = axj.Accelerator(strategy=axj.HSDPStrategy(replicas=2), precision="fp32",
                          grad_accum_steps=1)
    state = one.setup(w.init_params(), w.optimizer())
    single = windows_of(batches[:3], 1)
    step = compiled(one, state, one.train_step(w.item_loss), single[0])
    result["k1_hlo"] = placement(step.as_text())
    for window in single:
        state, _ = step(state, one.window(window))
    result["k1"] = w.max_diff(state.params, w.reference(single, items=True))

    defer = axj.Accelerator(strategy=axj.HSDPStrategy(replicas=2, defer_reduce_scatter=True),
                            precision="fp32", grad_accum_steps=k)
    state = defer.setup(w.init_params(), w.optimizer())
    step = compiled(defer, state, defer.train_step(w.mean_loss), windows[0])
    result["defer_hlo"] = placement(step.as_text())
    for window in windows[:2]:
        state, _ = step(state, defer.window(window))
    result["defer"] = w.max_diff(state.params, w.reference(windows[:2], items=False))


def _replica_pairs(leaf: jax.Array) -> list[tuple[Any, Any]]:
    """The shards of ``leaf`` held by device d of node 0 and device d of node 1."""
    shards = {s.device.id: s for s in leaf.addressable_shards}
    return [(shards[0], shards[2]), (shards[1], shards[3])]


def host(tree: Any) -> Any:
    """``tree`` as numpy (a PRNG key as its key data)."""
    def one(x: Any) -> np.ndarray:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)
    return jax.tree.map(one, tree)


def _equal(a: Any, b: Any) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                     strict=True))


def wire_dtypes(result: dict[str, Any]) -> None:
    """The lowered step (what a GPU or TPU compiles) under reduce_dtype="bf16": the dtypes of
    the float collectives (the gradients'; the loss and item sums are float32 scalars)."""
    k = 2
    out = {}
    for name in ("ddp", "zero1", "fsdp", "fsdp-sync", "hsdp", "hsdp-defer"):
        strategy: Any = {"fsdp-sync": axj.FSDPStrategy(sync_each_microstep=True),
                         "hsdp": axj.HSDPStrategy(replicas=2),
                         "hsdp-defer": axj.HSDPStrategy(replicas=2, defer_reduce_scatter=True)
                         }.get(name, name)
        acc = axj.Accelerator(strategy=strategy, precision="fp32", grad_accum_steps=k,
                              reduce_dtype="bf16")
        state = acc.setup(w.init_params(), w.optimizer())
        text = acc.train_step(w.item_loss).lower(
            state, acc.window(w.micro_batches(k, rows=ROWS))).compiler_ir("hlo").as_hlo_text()
        out[name] = sorted({(op.kind, op.dtypes[0], op.in_loop, op.spans(NODE_OF))
                            for op in collective_ops(text)
                            if op.kind != "all-gather" and op.result_bytes > 4})
        out[name + "/effective"] = acc.effective_dtypes.reductions
    result["wire"] = out


def reduction_error(result: dict[str, Any]) -> None:
    """ddp, SGD, 6 steps, the same global batch of 64 rows per step split into K micro-batches:
    relative weight error against the same run in float64 (one device, numpy inputs)."""
    steps, rows = 6, 64
    batches = w.micro_batches(steps, rows=rows, seed=5, ragged=False)
    p64 = jax.tree.map(lambda x: np.asarray(x, np.float64), w.init_params())
    with jax.enable_x64(True):
        p = jax.tree.map(jnp.asarray, p64)
        for big in batches:
            g = jax.grad(lambda q, b=big: w.mean_loss(q, jax.tree.map(
                lambda x: jnp.asarray(x, jnp.float64), b), None))(p)
            p = jax.tree.map(lambda q, d: q - 0.5 * d, p, g)
        p64 = host(p)
    norm = np.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(p64)))
    errors = {}
    for dtype, k in (("bf16", 1), ("bf16", 16), ("fp32", 16)):
        acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=k,
                              reduce_dtype=dtype)
        state = acc.setup(w.init_params(), optax.sgd(0.5))
        micro = [[{key: v[i * rows // k:(i + 1) * rows // k] for key, v in big.items()}
                  for i in range(k)] for big in batches]
        step = compiled(acc, state, acc.train_step(w.mean_loss), micro[0])
        for window in micro:
            state, _ = step(state, acc.window(window))
        diff = np.sqrt(sum(np.sum((np.asarray(a, np.float64) - b) ** 2) for a, b in
                           zip(jax.tree.leaves(state.params), jax.tree.leaves(p64), strict=True)))
        errors[f"{dtype}/{k}"] = float(diff / norm)
    result["error"] = errors


def fp16_wire(result: dict[str, Any]) -> None:
    """fp16-mixed, reduce_dtype fp16 on hsdp: an overflow only in rows of device 1 (node 0)
    skips that window on every device; the loss scale backs off."""
    k = 4
    windows = windows_of(w.micro_batches(3 * k, rows=ROWS, seed=9), k)
    windows[1][1]["y"][3, 0], windows[1][1]["mask"][3, 0] = 1e25, 1.0  # row 3: device 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = axj.Accelerator(strategy=axj.HSDPStrategy(replicas=2), precision="fp16-mixed",
                              grad_accum_steps=k, reduce_dtype="fp16",
                              loss_scale=axj.DynamicLossScale(init_scale=8.0, hysteresis=1))
    state = acc.setup(w.init_params(), w.optimizer())
    step = compiled(acc, state, acc.train_step(w.item_loss), windows[0])
    skipped, scales = [], []
    for window in windows:
        state, metrics = step(state, acc.window(window))
        skipped.append(bool(metrics["skipped"]))
        scales.append(float(metrics["loss_scale"]))
    result["fp16"] = {"skipped": skipped, "steps": int(state.step), "scales": scales,
                      "finite": bool(all(np.isfinite(np.asarray(x)).all()
                                         for x in jax.tree.leaves(state.params)))}


def fp16_item_wire(result: dict[str, Any]) -> None:
    """Issue 38 case 5: fp16-mixed, reduce_dtype fp16, item mode (``(loss_sum, num_items)``),
    the default loss scale (65536), K=4, windows of 4, 4, 4 and 2 micro-batches: the wire
    carried scale x the gradient of the window's loss *sum* and overflowed (windows skipped
    while the scale backed off); normalised, none skips and the run stays on the fp32 large
    batch. The three ways a gradient reaches the wire: accumulated then all-reduced (ddp, as
    zero1), accumulated in the backward then reduce-scattered once (hsdp-defer, as fsdp), and
    reduce-scattered every micro-step (hsdp, as fsdp-sync); hsdp's cross-node all-reduce too."""
    k = 4
    # 8 rows per device, values scaled so that each device's micro-step mean gradient x 65536
    # fits fp16 (the compute does not overflow); the window's loss-sum gradient does not.
    batches = [{**b, "x": b["x"] * 0.3, "y": b["y"] * 0.3}
               for b in w.micro_batches(3 * k + 2, rows=4 * ROWS, seed=21)]
    windows = windows_of(batches, k)
    ref = w.reference(windows, items=True)
    out = {}
    for name in ("ddp", "hsdp", "hsdp-defer"):
        strategy: Any = {"fsdp-sync": axj.FSDPStrategy(sync_each_microstep=True),
                         "hsdp": axj.HSDPStrategy(replicas=2),
                         "hsdp-defer": axj.HSDPStrategy(replicas=2, defer_reduce_scatter=True)
                         }.get(name, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            acc = axj.Accelerator(strategy=strategy, precision="fp16-mixed", grad_accum_steps=k,
                                  reduce_dtype="fp16")
        state = acc.setup(w.init_params(), w.optimizer())
        step = compiled(acc, state, acc.train_step(w.item_loss), windows[0])
        skipped = 0
        for window in windows:
            state, metrics = step(state, acc.window(window))
            skipped += bool(metrics["skipped"])
        out[name] = {"skipped": skipped, "scale": float(metrics["loss_scale"]),
                     "diff": w.max_diff(state.params, ref)}
    result["fp16_items"] = out


def main(out: Path) -> None:
    result: dict[str, Any] = {}
    run_hsdp(out, result)
    wire_dtypes(result)
    reduction_error(result)
    fp16_wire(result)
    fp16_item_wire(result)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(Path(sys.argv[1]))
