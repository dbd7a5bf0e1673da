"""What mixed precision buys on a GPU, and accumix's cost against a raw loop and HF Accelerate.

    python bench/gpu.py                        # CUDA: GPT-2-small shape, seq 1024 (< 7.5 min)
    python bench/gpu.py --json out.json        # also write the rows as JSON
    python bench/gpu.py --tiny                 # the tiny configuration (what a CPU runs)

The default GPT (``accumix.recipes.gpt``) trains for a fixed number of optimizer steps with
K micro-steps each, on real text (the Python standard library's source, as bytes, cut into full
windows: every row sees the same batches in the same order), once per row:

* accumix under ``fp32`` (TF32 off, torch's default), ``fp32`` with TF32 matmuls,
  ``bf16-mixed`` and ``fp16-mixed``; ``fsdp`` + ``bf16-mixed`` where it applies;
* the same job as a raw PyTorch loop (bf16 autocast) and with HF Accelerate (bf16).

All rows live side by side and are timed in interleaved windows (raw, accumix, ..., raw, ...)
after warm-up steps; CUDA events time each window and the table shows medians over windows.
Per row: tokens/s, the ratio to the raw loop (median of per-window ratios), the ratio to fp32,
MFU (``6 N + 12 L d T`` FLOPs per token over the bf16 matmul peak measured at start), the peak
memory the row allocates (its own resident memory plus its step's transient peak), the loss on
held-out text after the last step and its difference from fp32's (parity).

One process; a hard time budget (``--budget-s``) stops adding rows and windows before it runs
out, and every row runs inside try/except, so the table (printed last) always comes out. Without
CUDA the tiny configuration runs on the CPU so the script never rots.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from _common import Clock, bf16_peak_flops, fmt, machine_line, markdown_table, median

LR, MAX_NORM = 1e-3, 1.0
START = time.monotonic()


@dataclass(kw_only=True)
class Job:
    """What every row trains on: the model's first weights and the token windows."""

    device: torch.device
    config: object  # accumix.recipes.gpt.GPTConfig
    init_model: torch.nn.Module  # on the CPU; each row trains a deep copy
    xs: torch.Tensor  # [steps * K, B, T] inputs on the device
    ys: torch.Tensor  # [steps * K, B, T] next-token labels
    val_xs: torch.Tensor
    val_ys: torch.Tensor
    accum: int
    data_note: str


@dataclass(kw_only=True)
class Row:
    """One way of training the job, and what was measured of it."""

    key: str
    label: str
    step: Callable[[int], torch.Tensor] | None = None  # optimizer step s -> its mean loss
    evaluate: Callable[[], float] | None = None
    real_steps: Callable[[], int] | None = None  # optimizer steps that really updated
    error: str = ""
    times: list[float] = field(default_factory=list)  # seconds per window
    steps_done: int = 0
    resident: int = 0  # bytes the row holds between steps (weights, optimizer state)
    peak: int = 0  # bytes: resident + the largest transient of one of its steps
    loss: torch.Tensor | None = None  # the last step's mean loss, read after the timing
    val_loss: float = float("nan")
    last_loss: float = float("nan")


class NotApplicable(Exception):
    """A row that cannot be measured in this setting (its message says why); no traceback."""


def opt_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def mean_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss_sum, num_items = model(x, y)
    return loss_sum / num_items  # every position has a label: the mean over tokens


def accumix_row(job: Job, precision: str, strategy: str = "single", tf32: bool = False
                ) -> tuple[Callable, Callable, Callable]:
    import accumix as ax

    acc = ax.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=job.accum)
    model = copy.deepcopy(job.init_model)
    model, optimizer = acc.setup(model, opt_for(model))
    if strategy != "single" and not _is_sharded(model):
        raise NotApplicable(f"strategy {strategy!r} shards nothing in one process (it trains as "
                           "'single'); measure it under torchrun on 2+ GPUs")

    def step(s: int) -> torch.Tensor:
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        total = torch.zeros((), device=job.device)
        try:
            for k in range(s * job.accum, (s + 1) * job.accum):
                with acc.accumulate():
                    loss = mean_loss(model, job.xs[k], job.ys[k])
                    acc.backward(loss)
                    acc.clip_grad_norm_(MAX_NORM)
                    optimizer.step()
                    optimizer.zero_grad()
                total += loss.detach()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
        return total / job.accum

    return step, lambda: evaluate(model, job), lambda: acc.optimizer_steps


def _is_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def raw_row(job: Job) -> tuple[Callable, Callable, Callable]:
    model = copy.deepcopy(job.init_model).to(job.device)
    optimizer = opt_for(model)
    done = [0]

    def step(s: int) -> torch.Tensor:
        total = torch.zeros((), device=job.device)
        for k in range(s * job.accum, (s + 1) * job.accum):
            with torch.autocast(job.device.type, dtype=torch.bfloat16):
                loss = mean_loss(model, job.xs[k], job.ys[k])
            (loss / job.accum).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done[0] += 1
        return total / job.accum

    def evaluate_raw() -> float:
        with torch.autocast(job.device.type, dtype=torch.bfloat16):
            return evaluate(model, job)

    return step, evaluate_raw, lambda: done[0]


def accelerate_row(job: Job) -> tuple[Callable, Callable, Callable]:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=job.accum,
                              cpu=job.device.type == "cpu")
    model = copy.deepcopy(job.init_model)
    model, optimizer = accelerator.prepare(model, opt_for(model))
    done = [0]

    def step(s: int) -> torch.Tensor:
        total = torch.zeros((), device=job.device)
        for k in range(s * job.accum, (s + 1) * job.accum):
            with accelerator.accumulate(model):
                loss = mean_loss(model, job.xs[k], job.ys[k])
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                optimizer.step()
                optimizer.zero_grad()
            total += loss.detach()
        done[0] += 1
        return total / job.accum

    return step, lambda: evaluate(model, job), lambda: done[0]


# key -> (label, builder); the order is the interleaving order, raw first (the baseline).
ROWS: dict[str, tuple[str, Callable[[Job], tuple[Callable, Callable, Callable]]]] = {
    "raw": ("raw PyTorch, bf16 autocast", raw_row),
    "bf16": ("accumix bf16-mixed", lambda job: accumix_row(job, "bf16-mixed")),
    "accelerate": ("HF Accelerate bf16", accelerate_row),
    "fp16": ("accumix fp16-mixed", lambda job: accumix_row(job, "fp16-mixed")),
    "fp32": ("accumix fp32", lambda job: accumix_row(job, "fp32")),
    "tf32": ("accumix fp32, TF32 matmuls", lambda job: accumix_row(job, "fp32", tf32=True)),
    "fsdp": ("accumix fsdp bf16-mixed", lambda job: accumix_row(job, "bf16-mixed", "fsdp")),
}
GPU_ROWS = "raw,bf16,accelerate,fp16,fp32,tf32,fsdp"
CPU_ROWS = "raw,bf16,accelerate,fp16,fp32,fsdp"  # TF32 is a CUDA setting


@torch.no_grad()
def evaluate(model: torch.nn.Module, job: Job) -> float:
    """Mean token loss on the held-out windows, through the row's own forward."""
    losses = [mean_loss(model, x, y) for x, y in zip(job.val_xs, job.val_ys, strict=True)]
    return torch.stack(losses).mean().item()


def load_tokens(count: int, seq: int, files: list, seed: int) -> tuple[torch.Tensor, str]:
    """``count`` windows of ``seq + 1`` bytes of real text; random bytes if there is none."""
    from accumix.recipes.text_data import ByteDocumentDataset

    need = count * (seq + 1)
    try:
        data = ByteDocumentDataset(files, seq, max_bytes=need).data
    except (FileNotFoundError, ValueError) as exc:
        data = torch.empty(0, dtype=torch.uint8)
        note = f"random bytes ({exc})"
    else:
        note = "stdlib source bytes"
    if data.numel() < need:
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(0, 256, (need,), generator=g, dtype=torch.uint8)
        note = "random bytes (not enough stdlib text)" if note.startswith("stdlib") else note
    return data[:need].to(torch.int64).view(count, seq + 1), note


def make_job(args: argparse.Namespace, device: torch.device) -> Job:
    from accumix.recipes.gpt import GPT, GPTConfig
    from accumix.recipes.text_data import split_files, stdlib_files

    if args.tiny:
        config = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
    else:
        config = GPTConfig.gpt2_small()
    seq, batch, accum = config.block_size, args.micro_batch, args.accum
    total_steps = args.warmup + args.windows * args.window
    try:
        train_files, val_files = split_files(stdlib_files(), val_fraction=0.05)
    except (FileNotFoundError, ValueError):
        train_files, val_files = [], []
    windows, note = load_tokens(total_steps * accum * batch, seq, train_files, seed=1)
    val, _ = load_tokens(args.val_batches * batch, seq, val_files, seed=2)
    windows = windows.view(total_steps * accum, batch, seq + 1).to(device)
    val = val.view(args.val_batches, batch, seq + 1).to(device)
    torch.manual_seed(0)
    return Job(device=device, config=config, init_model=GPT(config),
               xs=windows[..., :-1].contiguous(), ys=windows[..., 1:].contiguous(),
               val_xs=val[..., :-1].contiguous(), val_ys=val[..., 1:].contiguous(),
               accum=accum, data_note=note)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def run_steps(row: Row, job: Job, count: int) -> None:
    """``count`` optimizer steps of ``row``; tracks its transient memory peak on CUDA."""
    cuda = job.device.type == "cuda"
    if cuda:
        base = torch.cuda.memory_allocated(job.device)
        torch.cuda.reset_peak_memory_stats(job.device)
    for _ in range(count):
        assert row.step is not None
        row.loss = row.step(row.steps_done)  # a device tensor: no host sync while timed
        row.steps_done += 1
    if cuda:
        transient = torch.cuda.max_memory_allocated(job.device) - base
        row.peak = max(row.peak, row.resident + transient)


def out_of_time(args: argparse.Namespace, needed: float = 0.0) -> bool:
    return time.monotonic() - START + needed > args.budget_s


def fail(row: Row, exc: BaseException) -> None:
    if isinstance(exc, NotApplicable):
        row.error = str(exc)
    else:
        row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        print(f"[gpu.py] {row.label} failed:\n{traceback.format_exc()}", file=sys.stderr)
    row.step = row.evaluate = row.real_steps = None  # drops the row's model and optimizer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def set_up(rows: list[Row], job: Job, args: argparse.Namespace) -> None:
    """Builds each row and runs its warm-up steps (untimed), one row after the other."""
    for row in rows:
        if out_of_time(args, needed=30):
            row.error = "time budget spent before this row"
            continue
        try:
            before = allocated(job.device)
            row.step, row.evaluate, row.real_steps = ROWS[row.key][1](job)
            row.resident = allocated(job.device) - before  # weights; the steps add the rest
            run_steps(row, job, 1)
            row.resident = allocated(job.device) - before  # + optimizer state, grads freed
            run_steps(row, job, args.warmup - 1)
        except Exception as exc:
            fail(row, exc)


def measure(rows: list[Row], job: Job, args: argparse.Namespace, clock: Clock) -> None:
    """Interleaved windows: each live row runs ``--window`` steps in turn, ``--windows`` times."""
    last_round = 0.0
    for index in range(args.windows):
        if index and out_of_time(args, needed=last_round + 10):
            print(f"[gpu.py] time budget: stopping after {index} windows", file=sys.stderr)
            break
        began = time.monotonic()
        for row in rows:
            if row.step is None:
                continue
            try:
                row.times.append(clock.time(lambda row=row: run_steps(row, job, args.window)))
            except Exception as exc:
                fail(row, exc)
        last_round = time.monotonic() - began
        live = ", ".join(f"{r.key} {r.times[-1] * 1e3:.0f} ms" for r in rows if r.step)
        print(f"[gpu.py] window {index + 1}/{args.windows} ({last_round:.1f} s): {live}",
              file=sys.stderr, flush=True)


def finish(rows: list[Row], job: Job) -> None:
    for row in rows:
        if row.step is None or row.evaluate is None:
            continue
        try:
            row.last_loss = row.loss.item() if row.loss is not None else float("nan")
            row.val_loss = row.evaluate()
        except Exception as exc:
            fail(row, exc)


def table(rows: list[Row], job: Job, args: argparse.Namespace, peak: float) -> tuple[str, list]:
    seq, batch = job.config.block_size, args.micro_batch
    tokens_per_window = args.window * job.accum * batch * seq
    flops_per_token = job.init_model.flops_per_token()
    by_key = {r.key: r for r in rows}
    raw, fp32 = by_key.get("raw"), by_key.get("fp32")
    headers = ["row", "steps (real)", "tokens/s", "x raw bf16", "x fp32", "MFU %",
               "peak mem GiB", "last train loss", "held-out loss", "loss vs fp32 %"]
    lines, records = [], []
    for row in rows:
        if not row.times or math.isnan(row.val_loss):
            reason = row.error or "not timed (time budget)"
            lines.append([row.label, row.steps_done, f"n/a: {reason}"] + ["n/a"] * 7)
            records.append({"row": row.label, "error": reason})
            continue
        tps = tokens_per_window / median(row.times)

        def ratio(other: Row | None, row: Row = row) -> float:
            if other is None or not other.times:
                return float("nan")
            return median([a / b for a, b in zip(other.times, row.times, strict=False)])

        parity = (100 * (row.val_loss - fp32.val_loss) / fp32.val_loss
                  if fp32 is not None and not math.isnan(fp32.val_loss) else float("nan"))
        real = row.real_steps() if row.real_steps else row.steps_done
        record = {
            "row": row.label, "steps": row.steps_done, "real_steps": real, "tokens_per_s": tps,
            "x_raw": ratio(raw), "x_fp32": ratio(fp32), "mfu_pct": 100 * tps * flops_per_token
            / peak, "peak_mem_gib": row.peak / 2**30 if job.device.type == "cuda" else None,
            "last_train_loss": row.last_loss, "val_loss": row.val_loss, "loss_vs_fp32_pct": parity,
            "window_s": row.times,
        }
        records.append(record)
        lines.append([row.label, f"{row.steps_done} ({real})", fmt(tps, 4), fmt(record["x_raw"]),
                      fmt(record["x_fp32"]), fmt(record["mfu_pct"]),
                      fmt(record["peak_mem_gib"]), fmt(row.last_loss, 4), fmt(row.val_loss, 4),
                      f"{parity:+.2f}" if not math.isnan(parity) else "n/a"])
    cfg = job.config
    head = [
        f"job: GPT {cfg.n_layer}L/{cfg.n_head}H/{cfg.n_embd}d, seq {seq}, vocab "
        f"{cfg.vocab_size}, {job.init_model.num_parameters():,} params (non-embedding); "
        f"micro-batch {batch} x K={job.accum} = {job.accum * batch * seq:,} tokens per "
        f"optimizer step; AdamW lr {LR}, clip {MAX_NORM}; data: {job.data_note}",
        f"timing: {args.warmup} warm-up steps, then windows of {args.window} steps interleaved "
        f"over rows ({'CUDA events' if job.device.type == 'cuda' else 'wall clock'}), medians; "
        f"bf16 matmul peak measured {peak / 1e12:.4g} TFLOP/s; "
        f"{time.monotonic() - START:.0f} s in all",
        machine_line(_device_name(job.device)),
    ]
    if job.device.type != "cuda":
        head.insert(2, "CPU smoke configuration: these numbers say nothing about GPU speed")
    return "\n".join([*head, "", markdown_table(headers, lines)]), records


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "device CPU"
    return f"GPU {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny configuration (default without CUDA)")
    parser.add_argument("--rows", default=None,
                        help=f"comma-separated from {','.join(ROWS)}; default {GPU_ROWS} "
                        f"(CPU: {CPU_ROWS})")
    parser.add_argument("--micro-batch", type=int, default=None, help="default 16 (tiny: 2)")
    parser.add_argument("--accum", type=int, default=None, help="K; default 4 (tiny: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="default 5 (tiny: 1)")
    parser.add_argument("--window", type=int, default=None, help="steps; default 5 (tiny: 1)")
    parser.add_argument("--windows", type=int, default=None, help="default 8 (tiny: 2)")
    parser.add_argument("--val-batches", type=int, default=None, help="default 8 (tiny: 2)")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="stop adding rows and windows before this many seconds")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    args.tiny = args.tiny or not torch.cuda.is_available()
    defaults = dict(micro_batch=(2, 16), accum=(2, 4), warmup=(1, 5), window=(1, 5),
                    windows=(2, 8), val_batches=(2, 8))
    for name, (tiny, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    rows = args.rows or (GPU_ROWS if torch.cuda.is_available() else CPU_ROWS)
    args.rows = rows.split(",")
    if not set(args.rows) <= set(ROWS):
        parser.error(f"--rows must name only {', '.join(ROWS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")  # libraries' one-time advice would bury the table
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    job = make_job(args, device)
    peak = bf16_peak_flops(device, args.tiny)
    rows = [Row(key=key, label=ROWS[key][0]) for key in args.rows]
    try:
        set_up(rows, job, args)
        measure(rows, job, args, Clock(device))
        finish(rows, job)
    except BaseException as exc:  # KeyboardInterrupt too: print what was measured
        print(f"[gpu.py] stopped early: {type(exc).__name__}: {exc}", file=sys.stderr)
    text, records = table(rows, job, args, peak)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": text.split("\n\n")[0], "rows": records}, f, indent=1)
    print(text, flush=True)


if __name__ == "__main__":
    main()
