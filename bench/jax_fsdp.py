"""accumix.jax's strategies on 4 host devices: per-device memory (measured, modelled) and time.

    python bench/jax_fsdp.py                 # issue 21's job, then the torch side's table
    python bench/jax_fsdp.py --no-torch      # the JAX table only
    python bench/jax_fsdp.py --no-torch --job gpt   # the flax GPT (issue 30); gpt-scan, scan

The job: 8 layers of 512x512 (+ bias), tanh, Adam, K=16 micro-batches of 8 rows per device,
fp32 (``--precision bf16-mixed`` for the other), one process with 4 host devices
(``--xla_force_host_platform_device_count=4``, set here before JAX loads). Per strategy:

* measured: ``memory_analysis()`` of the compiled window step, arguments + temporaries, per
  device (XLA's own accounting: the buffers the step needs, not the process's RSS);
* model: ``accumix.jax.memory.estimate_jax_memory`` for the same params, optimizer and window;
* time: the median wall time of ``--steps`` optimizer steps after one untimed step (4 host
  "devices" share this machine's cores: the collectives are memory copies, so the figure says
  what each mode costs in work, not in network time).

The torch side's columns come from ``bench/memory.py`` (2 ranks on gloo, its own MLP of
``--torch-blocks`` residual blocks of width 512, Adam, fp32), run as a subprocess after.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/scripts/jax_fsdp_memory.py: the job itself

from tests.scripts import jax_fsdp_memory as job  # noqa: E402

import accumix.jax as axj  # noqa: E402
from _common import machine_line, markdown_table  # noqa: E402
from accumix.jax.memory import estimate_jax_memory  # noqa: E402

MIB = 2**20


def run(word: str, precision: str, layers: int, steps: int, kind: str = "") -> dict[str, float]:
    p, loss_fn, micro, k = job.job_of(layers, kind)
    acc = axj.Accelerator(strategy=job.strategy(word), precision=precision, grad_accum_steps=k)
    state = acc.setup(p, optax.adam(1e-3))
    step = acc.train_step(loss_fn)
    rows = (job.GPT_ROWS if kind.startswith("gpt") else job.ROWS) * acc.local_devices
    window = acc.window([micro(rows) for _ in range(k)])
    stats = step.lower(state, window).compile().memory_analysis()
    unstacked = job.job_of(layers, kind.replace("scan", "").rstrip("-"))[0]
    model = {e.strategy: e for e in estimate_jax_memory(
        unstacked, optax.adam(1e-3), num_devices=acc.num_devices, precision=precision,
        window_bytes=sum(x.nbytes for x in jax.tree.leaves(window.batch)))}[word]
    state, metrics = step(state, window)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, window)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return {"measured": (stats.argument_size_in_bytes + stats.temp_size_in_bytes) / MIB,
            "model": model.total_bytes / MIB, "seconds": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--torch-blocks", type=int, default=8)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--job", default="dense", choices=("dense", "scan", "gpt", "gpt-scan"),
                        help="the Dense stack (scan: stacked and scanned) or the flax GPT of "
                             "tests/scripts/jax_gpt.py (gpt-scan: its blocks under nn.scan)")
    args = parser.parse_args()
    kind = "" if args.job == "dense" else args.job
    words = ("ddp", "zero1", "fsdp", "fsdp-sync")
    results = {w: run(w, args.precision, args.layers, args.steps, kind) for w in words}
    ddp = results["ddp"]
    print(machine_line(f"jax {jax.__version__}, 4 host devices, 1 process"))
    if kind.startswith("gpt"):
        plain = job.plain_activations(args.layers, kind) / MIB
        print(f"job: flax GPT, {args.layers} layers, d=256, T=64, Adam, {args.precision}, "
              f"K={job.GPT_K}, {job.GPT_ROWS} rows per device per micro-step; plain JAX keeps "
              f"{plain:.1f} MiB for one micro-batch's backward (the model column has no "
              "activations)")
    else:
        print(f"job: {args.layers} layers of {job.WIDTH}x{job.WIDTH} + bias ({args.job}), "
              f"Adam, {args.precision}, K={job.K}, {job.ROWS} rows per device per micro-step")
    rows = [(w, f"{r['measured']:.1f}", f"{r['model']:.1f}",
             f"{r['model'] / r['measured']:.3f}", f"{r['measured'] / ddp['measured']:.2f}x",
             f"{r['seconds'] * 1000:.0f}", f"{r['seconds'] / ddp['seconds']:.2f}x")
            for w, r in results.items()]
    print(markdown_table(("strategy", "measured MiB/device", "model MiB/device",
                          "model/measured", "vs ddp", "ms/step", "time vs ddp"), rows))
    if not args.no_torch:
        print("\ntorch side (bench/memory.py, 2 ranks):", flush=True)
        subprocess.run([sys.executable, str(HERE / "memory.py"), "--width", "512", "--blocks",
                        str(args.torch_blocks), "--rows", "ddp,zero1,fsdp-grad_op,fsdp-full"],
                       check=True, env={k: v for k, v in os.environ.items()
                                        if k != "XLA_FLAGS"})


if __name__ == "__main__":
    main()
