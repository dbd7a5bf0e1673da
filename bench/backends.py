"""The default recipe on both backends: tokens/s and validation loss after the same steps.

    .venv/bin/python bench/backends.py              # make run's job: 120 steps, 2 processes
    .venv/bin/python bench/backends.py --steps 20   # quicker

Runs ``accumix train backend={torch,jax} precision={fp32,bf16-mixed} nproc=2`` one after the
other (the same model, data, seed, schedule and global batch), reads each run's metrics.csv,
and prints one table: median tokens/s over the steps after warm-up (the JAX rows' first read
includes the compilation), its ratio to the torch row of the same precision, the wall time,
and the final validation loss.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import fmt, machine_line, markdown_table


def run(backend: str, precision: str, steps: int, out: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "accumix.cli.main", "train", f"backend={backend}",
           f"precision={precision}", f"max_steps={steps}", f"eval_every={steps}",
           "checkpoint_every=null", "sample.max_new_tokens=0", "plot=false",
           "progress_bar=false", "nproc=2", f"output_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "XLA_FLAGS")}
    started = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    warm = rows[len(rows) // 5:] or rows  # the first fifth holds compilation and warm-up
    return {
        "tokens_per_s": statistics.median(float(r["tokens_per_s"]) for r in warm),
        "val_loss": float(rows[-1]["val_loss"]),
        "loss": float(rows[-1]["loss"]),
        "wall_s": wall,
        "steps": len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    args = parser.parse_args()
    results: dict[tuple[str, str], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions.split(","):
            for backend in ("torch", "jax"):
                results[backend, precision] = run(backend, precision, args.steps,
                                                  Path(tmp) / f"{backend}-{precision}")
                print(f"{backend} {precision}: {results[backend, precision]}", flush=True)
    rows = []
    for (backend, precision), r in results.items():
        base = results["torch", precision]["tokens_per_s"]
        rows.append([backend, precision, f"{r['tokens_per_s']:,.0f}",
                     fmt(r["tokens_per_s"] / base), f"{r['wall_s']:.0f}", int(r["steps"]),
                     f"{r['loss']:.4f}", f"{r['val_loss']:.4f}"])
    print()
    print(machine_line("2 processes"))
    print(markdown_table(["backend", "precision", "tokens/s (median)", "x torch", "wall s",
                          "steps", "final train loss", "final val loss"], rows))


if __name__ == "__main__":
    main()
