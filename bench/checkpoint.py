"""What a checkpoint costs the training loop: ``save_state`` in the loop vs in the background.

    python bench/checkpoint.py                         # ~200 MB of state (MLP + AdamW), 5 saves
    python bench/checkpoint.py --width 64 --saves 2    # a smoke run
    python bench/checkpoint.py --run-dir s3://bucket/bench   # an object store (s3fs)

One process, ``strategy="single"``, fp32. The model is ``--layers`` square Linear layers of
``--width`` (2048 x 4: 16.8 M parameters, 67 MB, plus AdamW's two moments: 201 MB of state),
trained a few steps so the optimizer holds its state. Then, alternately, ``--saves`` saves of
each kind, each at a new step (every save is a new step directory; ``keep_last=2``):

* in the loop: ``acc.save_state(run_dir)``; the loop is blocked for the whole write;
* background: ``acc.save_state(run_dir, background=True)``; the loop is blocked only while the
  state is copied to host memory. Before each, the previous background save is waited for,
  outside the timing (what is timed is what the loop waits for when nothing is in flight);
  the write's own time (call to published) is reported beside it.

The table: the median over the saves of each time, and the ratio of the loop's blocked time in
the background to the synchronous save's, measured in the same run (each save's times are
printed above it). The first background save allocates the host copy that later ones reuse.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import accumix as ax
from _common import machine_line, markdown_table, median


def build(acc: ax.Accelerator, width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return acc.setup(model, optimizer)


def step(acc: ax.Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer,
         width: int) -> None:
    with acc.accumulate():
        acc.backward(model(torch.randn(8, width)).square().mean())
        optimizer.step()
        optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--run-dir", help="where to save (default: a temporary directory)")
    args = parser.parse_args()

    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=1, seed=0)
    model, optimizer = build(acc, args.width, args.layers)
    step(acc, model, optimizer, args.width)
    params = sum(p.numel() for p in model.parameters())
    state_mb = 3 * params * 4 / 1e6  # fp32 params + AdamW's exp_avg and exp_avg_sq
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or str(Path(tmp) / "run")
        in_loop, blocked, written = [], [], []
        for _ in range(args.saves):
            step(acc, model, optimizer, args.width)
            started = time.perf_counter()
            acc.save_state(run_dir, keep_last=2)
            in_loop.append(time.perf_counter() - started)
            step(acc, model, optimizer, args.width)
            started = time.perf_counter()
            acc.save_state(run_dir, keep_last=2, background=True)
            blocked.append(time.perf_counter() - started)
            acc.wait_for_save()
            written.append(time.perf_counter() - started)
        acc.end()
    sync_s, blocked_s, written_s = median(in_loop), median(blocked), median(written)
    print(machine_line(f"{params / 1e6:.1f} M params, {state_mb:.1f} MB of state"))
    print(f"run_dir: {args.run_dir or 'a local temporary directory'}; {args.saves} saves each")
    for name, values in (("in the loop", in_loop), ("background, blocked", blocked),
                         ("background, published", written)):
        print(f"  {name} s: " + ", ".join(f"{v:.3f}" for v in values))
    print(markdown_table(
        ["save", "loop blocked s (median)", "write to published s (median)",
         "blocked / in-loop save"],
        [["in the loop", f"{sync_s:.3f}", f"{sync_s:.3f}", "1.000"],
         ["background", f"{blocked_s:.3f}", f"{written_s:.3f}", f"{blocked_s / sync_s:.3f}"]]))


if __name__ == "__main__":
    main()
