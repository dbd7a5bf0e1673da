"""torch.compile on the default GPT recipe's step: eager vs compiled, single and ddp, fp32 and bf16.

    python bench/compile.py                               # the table in BENCHMARKS.md
    python bench/compile.py --tiny --backend eager --steps 1 --rows single-fp32   # a smoke run

The recipe's model (``accumix train``'s GPT: 4 layers, 4 heads, width 256, context 128, byte
vocabulary, ~3.2M parameters), AdamW, global batch 32 documents of 128 tokens (micro batch 8:
K=4 on one process, K=2 on each of 2 ddp ranks), the recipe's step (``model(ids, labels=...)``
returning the summed loss and its token count, ``acc.backward(loss_sum, num_items=n)``,
clipping to 1.0). Batches are random full-length byte blocks, so every micro-batch has one shape
(the recipe's real text is padded to each batch's longest document: mostly 128 too).

Each row is one Accelerator in one process per rank with one torch thread per rank (ddp: 2
ranks over gloo, spawned once for all its rows). The compiled variant is
``Accelerator(compile={"backend": B})``; its first optimizer step includes the compilation,
reported as "compile s" (the first step's wall time minus the median step's). Then ``--steps``
optimizer steps are timed; tokens/s is the world's tokens per step over the median step's CPU
time on rank 0 (the machine is shared: other processes' load inflates CPU time less than the
wall clock; "x eager (wall)" is the same ratio on the wall clock). The compiled and eager
rows start from the same weights and data; their losses after the first step are printed so a
reader sees they trained the same thing.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from _common import fmt, machine_line, markdown_table, median

GLOBAL_BATCH, MICRO_BATCH = 32, 8


def model_config(tiny: bool) -> Any:
    from accumix.recipes.gpt import GPTConfig

    if tiny:
        return GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    return GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256)


def run_row(*, strategy: str, precision: str, compiled: bool, backend: str, steps: int,
            tiny: bool) -> dict[str, float]:
    """One variant on this process's rank: first-step seconds, median step seconds, loss."""
    import accumix as ax
    from accumix.recipes.gpt import GPT

    torch.set_num_threads(1)
    torch._dynamo.reset()
    acc = ax.Accelerator(strategy=strategy, precision=precision, global_batch_size=GLOBAL_BATCH,
                         micro_batch_size=MICRO_BATCH, seed=0,
                         compile={"backend": backend} if compiled else None)
    config = model_config(tiny)
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The set-up loader gives each rank its share: the dataset is the world's.
    samples = GLOBAL_BATCH * (steps + 1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (samples, config.block_size + 1), generator=g)
    data = TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    loader = DataLoader(data, batch_size=MICRO_BATCH, shuffle=False)
    model, optimizer, loader = acc.setup(model, optimizer, loader)
    times: list[float] = []  # wall seconds per optimizer step
    cpu_times: list[float] = []  # this process's CPU seconds per optimizer step
    loss_first = float("nan")
    start, cpu_start = time.perf_counter(), time.process_time()
    for x, y in loader:
        with acc.accumulate():
            loss_sum, items = model(x, labels=y)
            acc.backward(loss_sum, num_items=items)
            acc.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
        if acc.sync_gradients:
            acc.barrier()
            now, cpu_now = time.perf_counter(), time.process_time()
            times.append(now - start)
            cpu_times.append(cpu_now - cpu_start)
            start, cpu_start = now, cpu_now
            if len(times) == 1:
                loss_first = float(loss_sum.detach()) / float(items)
    step, cpu_step = median(times[1:]), median(cpu_times[1:])
    tokens = GLOBAL_BATCH * config.block_size
    return {"first": times[0], "step": step, "cpu_step": cpu_step,
            "tokens_per_s": tokens / cpu_step, "wall_tokens_per_s": tokens / step,
            "loss": loss_first}


def run_rows(rows: list[tuple[str, str, bool]], backend: str, steps: int, tiny: bool
             ) -> list[dict[str, float]]:
    return [run_row(strategy=s, precision=p, compiled=c, backend=backend, steps=steps,
                    tiny=tiny) for s, p, c in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per row")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--rows", default="single-fp32,single-bf16-mixed,ddp-fp32,ddp-bf16-mixed")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT (smoke runs)")
    args = parser.parse_args()
    # A cold compile, as a user's first run: inductor's on-disk caches would hide most of it.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="accumix-bench-inductor-")
    wanted = [r.split("-", 1) for r in args.rows.split(",")]
    results: dict[tuple[str, str, bool], dict[str, float]] = {}
    for strategy in ("single", "ddp"):
        rows = [(s, p, c) for s, p in wanted if s == strategy for c in (False, True)]
        if not rows:
            continue
        if strategy == "single":
            out = run_rows(rows, args.backend, args.steps, args.tiny)
        else:
            from accumix.testing import spawn

            out = spawn(run_rows, 2, args=(rows, args.backend, args.steps, args.tiny),
                        timeout=3000)[0]
        results.update(zip(rows, out, strict=True))
    table = []
    for s, p in wanted:
        eager, comp = results[(s, p, False)], results[(s, p, True)]
        table.append([
            s, p, fmt(eager["tokens_per_s"]), fmt(comp["tokens_per_s"]),
            fmt(comp["tokens_per_s"] / eager["tokens_per_s"]),
            fmt(comp["wall_tokens_per_s"] / eager["wall_tokens_per_s"]),
            fmt(eager["cpu_step"]), fmt(comp["cpu_step"]),
            fmt(comp["first"] - comp["step"]),
            f"{eager['loss']:.6f} / {comp['loss']:.6f}",
        ])
    print(machine_line(f"1 torch thread per rank, backend {args.backend}, "
                       f"{os.getloadavg()[0]:.1f} load average at the end"))
    print(markdown_table(
        ["strategy", "precision", "eager tokens/s", "compiled tokens/s", "x eager",
         "x eager (wall)", "eager s/step", "compiled s/step", "compile s (wall)",
         "loss step 1 eager / compiled"],
        table))


if __name__ == "__main__":
    main()
