"""The fsdp memory job of issue 21, measured: ``memory_analysis()`` of the compiled window step
against ``accumix.jax.memory``'s model, per strategy and precision, on this process's devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/scripts/jax_fsdp_memory.py

Prints one JSON object: ``{"<strategy>/<precision>/<layers>": {"measured": bytes, "model":
bytes}}`` (arguments + temporaries per device). Layers of 512x512 float32 (plus a bias), tanh,
Adam, K=16, 8 rows per device; a job ending in ``/scan`` stacks the layers and scans them.
A job ending in ``/gpt`` (``/gpt-scan``: its blocks under ``nn.scan``) is the flax GPT of
``tests/scripts/jax_gpt.py`` instead (d=256, T=64, Adam, K=4, 2 rows per device); its "model"
counts no activations. Strategy ``plain`` measures what plain JAX keeps for one micro-batch's
backward (``plain_activations``).
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import accumix.jax as axj
from accumix.jax.memory import estimate_jax_memory

K, WIDTH, ROWS = 16, 512, 8
# Every step here is compiled for ``memory_analysis()`` alone, never run: LLVM's optimization
# level changes the machine code, not XLA's buffer assignment (every job's argument, temporary,
# output and alias bytes are equal at levels 0 and 3), and level 0 compiles in about half the
# time on a CPU.
MEMORY_ONLY = {"xla_backend_optimization_level": 0}


def params(layers: int, scan: bool = False) -> dict:
    rng = np.random.default_rng(0)
    p = {f"l{i}": {"w": (rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
                   "b": np.zeros(WIDTH, np.float32)} for i in range(layers)}
    if scan:  # the same layers stacked, for a loss that scans over them
        return {"w": np.stack([p[f"l{i}"]["w"] for i in range(layers)]),
                "b": np.stack([p[f"l{i}"]["b"] for i in range(layers)])}
    return p


def make_loss(layers: int, scan: bool = False):
    def loss_fn(p, batch, rng):
        x = batch["x"].astype(p["l0"]["w"].dtype)
        for i in range(layers):
            x = jnp.tanh(x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.mean((x.astype(jnp.float32) - batch["y"]) ** 2)

    def scanned(p, batch, rng):
        x = batch["x"].astype(p["w"].dtype)
        x, _ = jax.lax.scan(lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None), x,
                            (p["w"], p["b"]))
        return jnp.mean((x.astype(jnp.float32) - batch["y"]) ** 2)
    return scanned if scan else loss_fn


def strategy(word: str):
    """The strategy of a row; hsdp's rows: 2 replicas (2 simulated nodes of 2 devices)."""
    if word.startswith("hsdp"):
        return axj.HSDPStrategy(replicas=2, defer_reduce_scatter=word == "hsdp-defer")
    return axj.FSDPStrategy(sync_each_microstep=True) if word == "fsdp-sync" else word


GPT_K, GPT_ROWS = 4, 2


def job_of(layers: int, kind: str = "") -> tuple[Any, Any, Any, int]:
    """``(params, loss_fn, micro_batch(rows), K)`` of a job kind: ``""`` or ``"scan"`` (the
    Dense stack), ``"gpt"`` or ``"gpt-scan"`` (the flax GPT)."""
    if kind.startswith("gpt"):
        from tests.scripts import jax_gpt as gpt

        scan = kind == "gpt-scan"
        return (gpt.init_params(layers, scan), gpt.make_loss(layers, scan), gpt.micro_batch,
                GPT_K)
    scan = kind == "scan"

    def micro(rows: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(1)
        return {"x": rng.normal(size=(rows, WIDTH)).astype(np.float32),
                "y": rng.normal(size=(rows, WIDTH)).astype(np.float32)}
    return params(layers, scan), make_loss(layers, scan), micro, K


def plain_activations(layers: int, kind: str) -> int:
    """What plain JAX keeps for one micro-batch's backward: the temporaries of
    ``jit(grad(loss_fn))`` on one device for one device's rows (the params are its arguments,
    the gradients its outputs)."""
    p, loss_fn, micro, _ = job_of(layers, kind)
    rows = micro(GPT_ROWS if kind.startswith("gpt") else ROWS)
    grad = jax.jit(jax.grad(lambda q: loss_fn(q, rows, jax.random.key(0))))
    return int(grad.lower(jax.tree.map(jnp.asarray, p)).compile(MEMORY_ONLY).memory_analysis()
               .temp_size_in_bytes)


def measure(word: str, precision: str, layers: int, kind: str = "") -> dict[str, int]:
    """Arguments + temporaries of the compiled step per device, and the model's total (of
    the unstacked layers: the model does not know a scan gathers one slice at a time).
    ``word`` "plain": ``plain_activations`` (the model's total is 0)."""
    if word == "plain":
        return {"measured": plain_activations(layers, kind), "model": 0}
    p, loss_fn, micro, k = job_of(layers, kind)
    acc = axj.Accelerator(strategy=strategy(word), precision=precision, grad_accum_steps=k)
    state = acc.setup(p, optax.adam(1e-3))
    step = acc.train_step(loss_fn)
    rows = (GPT_ROWS if kind.startswith("gpt") else ROWS) * acc.local_devices
    window = acc.window([micro(rows) for _ in range(k)])
    stats = step.lower(state, window).compile(MEMORY_ONLY).memory_analysis()
    window_bytes = sum(x.nbytes for x in jax.tree.leaves(window.batch))
    unstacked = p if kind == "gpt" else params(layers) if kind in ("", "scan") else (
        job_of(layers, "gpt")[0])
    model = {e.strategy: e for e in estimate_jax_memory(
        unstacked, optax.adam(1e-3),
        num_devices=len(jax.devices()), precision=precision,
        platform=jax.devices()[0].platform, window_bytes=window_bytes,
        replicas=2 if word.startswith("hsdp") else 1)}[word]
    return {"measured": int(stats.argument_size_in_bytes + stats.temp_size_in_bytes),
            "model": int(model.total_bytes)}


def main(argv: list[str]) -> None:
    """``argv``: jobs ``strategy/precision/layers`` or ``strategy/precision/layers/KIND``
    (``scan``: the layers stacked and scanned; ``gpt``, ``gpt-scan``: the flax GPT); default:
    every strategy, both precisions, 8 layers."""
    warnings.simplefilter("ignore")  # bf16 on this CPU is emulated: said once, not per job
    jobs = argv or [f"{w}/{p}/8" for p in ("fp32", "bf16-mixed")
                    for w in ("single", "ddp", "zero1", "fsdp", "fsdp-sync")]
    out = {}
    for job in jobs:
        word, precision, layers, *kind = job.split("/")
        out[job] = measure(word, precision, int(layers), *kind)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
