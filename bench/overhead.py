"""accumix's per-step cost against a raw PyTorch loop, HF Accelerate and Lightning Fabric.

    python bench/overhead.py                      # the default job (under a minute here)
    python bench/overhead.py --rounds 2 --warmup 1 --steps 3 --width 16   # a smoke run

One process on the CPU, one thread; an MLP trained with AdamW, K = 4 micro-steps per optimizer
step and gradient clipping to 1.0. Each variant is the same job written the way its library's
documentation recommends, over the same DataLoader (each library wraps the loader its own way):

* raw:        loss / K, backward; at every K-th micro-step clip, step, zero_grad;
* accumix:    DESIGN.md's loop (acc.accumulate, acc.backward, acc.clip_grad_norm_, step,
              zero_grad) in fp32;
* accelerate: Accelerator(gradient_accumulation_steps=K), accelerator.accumulate(model),
              accelerator.backward, clip_grad_norm_ when sync_gradients;
* fabric:     fabric.no_backward_sync(model, enabled=is_accumulating), fabric.backward(loss / K),
              fabric.clip_gradients at the boundary;
* control:    the raw loop once more, on its own copy: its ratio to raw is the noise floor.

Rounds are interleaved, each variant's position rotating from round to round (raw, accumix, ...,
control; accumix, ..., control, raw; ...); a round is one epoch of ``--steps`` optimizer steps for
each variant. After ``--warmup`` untimed rounds, each
round's time per optimizer step is recorded (by default this process's CPU time, which other
processes' load inflates less than the wall clock); the table shows the median, the median and
middle half of the per-round ratios to the raw loop and the median per-round difference (paired,
so a drift of the machine's speed cancels). raw and accumix must end with the same parameters
(asserted), so the two did equal work.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _common import fmt, machine_line, markdown_table, median, quartiles

K = 4  # micro-steps per optimizer step
LR = 1e-3
MAX_NORM = 1.0
PARAM_TOL = 1e-6  # raw vs accumix, fp32: the same operations, so equal to float tolerance


@dataclass(kw_only=True)
class Variant:
    """One way of writing the job: ``run`` trains one epoch, ``params`` reads the weights."""

    name: str
    run: Callable[[], None]
    params: Callable[[], list[torch.Tensor]]
    times: list[float] = field(default_factory=list)  # seconds per optimizer step, per round
    error: str = ""


def make_job(args: argparse.Namespace) -> tuple[nn.Module, TensorDataset]:
    """The MLP and a dataset of exactly one epoch of ``--steps`` full windows."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(args.features, args.width), nn.ReLU(),
        nn.Linear(args.width, args.width), nn.ReLU(),
        nn.Linear(args.width, args.outputs),
    )
    samples = args.steps * K * args.batch
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, args.features, generator=g)
    y = torch.randn(samples, args.outputs, generator=g)
    return model, TensorDataset(x, y)


def loader_of(data: TensorDataset, batch: int) -> DataLoader:
    return DataLoader(data, batch_size=batch, shuffle=False)


def raw_variant(model: nn.Module, data: TensorDataset, batch: int) -> Variant:
    loader = loader_of(data, batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def run() -> None:
        for i, (x, y) in enumerate(loader):
            loss = F.mse_loss(model(x), y)
            (loss / K).backward()
            if (i + 1) % K == 0:
                nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                optimizer.step()
                optimizer.zero_grad()

    return Variant(name="raw PyTorch", run=run, params=lambda: list(model.parameters()))


def accumix_variant(model: nn.Module, data: TensorDataset, batch: int) -> Variant:
    import accumix as ax

    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=K)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer, loader = acc.setup(model, optimizer, loader_of(data, batch))

    def run() -> None:
        for x, y in loader:
            with acc.accumulate():
                loss = F.mse_loss(model(x), y)
                acc.backward(loss)
                acc.clip_grad_norm_(MAX_NORM)
                optimizer.step()
                optimizer.zero_grad()

    return Variant(name="accumix", run=run, params=lambda: list(acc.unwrap(model).parameters()))


def accelerate_variant(model: nn.Module, data: TensorDataset, batch: int) -> Variant:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=K)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader_of(data, batch))

    def run() -> None:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                optimizer.step()
                optimizer.zero_grad()

    unwrapped = accelerator.unwrap_model(model)
    return Variant(name="HF Accelerate", run=run, params=lambda: list(unwrapped.parameters()))


def fabric_variant(model: nn.Module, data: TensorDataset, batch: int) -> Variant:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader_of(data, batch))

    def run() -> None:
        for i, (x, y) in enumerate(loader):
            is_accumulating = (i + 1) % K != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                loss = F.mse_loss(model(x), y)
                fabric.backward(loss / K)
            if not is_accumulating:
                fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
                optimizer.step()
                optimizer.zero_grad()

    return Variant(name="Lightning Fabric", run=run,
                   params=lambda: list(model.parameters()))


def control_variant(model: nn.Module, data: TensorDataset, batch: int) -> Variant:
    """The raw loop again, timed like the others: its ratio to raw is the noise floor."""
    variant = raw_variant(model, data, batch)
    variant.name = "raw PyTorch again (control)"
    return variant


BUILDERS = {
    "raw": raw_variant,
    "accumix": accumix_variant,
    "accelerate": accelerate_variant,
    "fabric": fabric_variant,
    "control": control_variant,
}
LABELS = {"raw": "raw PyTorch", "accumix": "accumix", "accelerate": "HF Accelerate",
          "fabric": "Lightning Fabric", "control": "raw PyTorch again (control)"}


def build(names: list[str], model: nn.Module, data: TensorDataset, batch: int) -> list[Variant]:
    """Each variant on its own copy of the same initial model; an unavailable library's row
    says why instead of stopping the benchmark."""
    variants = []
    for name in names:
        try:
            variants.append(BUILDERS[name](copy.deepcopy(model), data, batch))
        except Exception as exc:  # ImportError, or a library's setup failing on this machine
            variants.append(Variant(name=LABELS[name], run=lambda: None, params=lambda: [],
                                    error=f"{type(exc).__name__}: {exc}"))
    return variants


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if not a or len(a) != len(b):
        return float("nan")
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b, strict=True))


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def measure(variants: list[Variant], *, rounds: int, warmup: int, steps: int,
            clock: Callable[[], float]) -> None:
    """Interleaved rounds; a round's time per optimizer step is recorded after ``warmup``.

    Round r starts at variant r mod n (ABCD, BCDA, ...): each variant runs in every position
    equally often, so whatever the variant before leaves behind (warm caches and branch
    predictors for shared code, allocator state) favours none of them.
    """
    for round_index in range(warmup + rounds):
        start_at = round_index % len(variants)
        for variant in variants[start_at:] + variants[:start_at]:
            if variant.error:
                continue
            start = clock()
            try:
                variant.run()
            except Exception as exc:
                variant.error = f"{type(exc).__name__}: {exc}"
                continue
            if round_index >= warmup:
                variant.times.append((clock() - start) / steps)


def report(variants: list[Variant], args: argparse.Namespace) -> str:
    raw = variants[0]
    raw_params = raw.params()
    headers = ["variant", "ms / optimizer step (median)", "x raw loop", "x raw, middle half",
               "+us / step vs raw", "min ms / step", "rounds", "max abs param diff vs raw"]
    rows = []
    for v in variants:
        if v.error:
            rows.append([v.name, f"n/a: {v.error}", "n/a", "n/a", "n/a", "n/a", 0, "n/a"])
            continue
        # Paired with raw's round: a drift of the machine's speed cancels.
        ratios = [t / r for t, r in zip(v.times, raw.times, strict=False)]
        extra = [(t - r) * 1e6 for t, r in zip(v.times, raw.times, strict=False)]
        low, high = quartiles(ratios)
        rows.append([v.name, fmt(median(v.times) * 1e3, 4), fmt(median(ratios), 4),
                     f"{low:.3f} - {high:.3f}", f"{median(extra):+.0f}",
                     fmt(min(v.times) * 1e3, 4), len(v.times),
                     f"{max_diff(v.params(), raw_params):.1e}"])
    job = (f"job: MLP {args.features}-{args.width}-{args.width}-{args.outputs} "
           f"({sum(p.numel() for p in raw_params):,} params), micro-batch {args.batch}, K={K}, "
           f"AdamW, clip {MAX_NORM}, {args.steps} optimizer steps per round, {args.rounds} timed "
           f"rounds after {args.warmup} warm-up, 1 thread, {args.clock} clock")
    return "\n".join([job, machine_line(), "", markdown_table(headers, rows)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100, help="timed rounds per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per round")
    parser.add_argument("--batch", type=int, default=16, help="micro-batch size")
    parser.add_argument("--width", type=int, default=64, help="hidden width of the MLP")
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--outputs", type=int, default=8)
    parser.add_argument("--clock", choices=CLOCKS, default="cpu",
                        help="cpu: this process's CPU time (steady on a shared machine, where "
                        "other processes' load inflates wall time); wall: elapsed time")
    parser.add_argument("--variants", default="raw,accumix,accelerate,fabric,control",
                        help="comma-separated, raw first: " + ",".join(BUILDERS))
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    if args.variants[0] != "raw" or not set(args.variants) <= set(BUILDERS):
        parser.error(f"--variants must start with raw and name only {', '.join(BUILDERS)}")
    if min(args.rounds, args.steps, args.batch, args.width) < 1 or args.warmup < 0:
        parser.error("--rounds, --steps, --batch and --width must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # A CPU job even where a GPU exists: accumix and Accelerate would otherwise pick the GPU.
    # Set before anything initialises CUDA (torch reads it then; the libraries import later).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)  # one thread: per-step times are stable and overhead is visible
    warnings.filterwarnings("ignore")  # libraries' one-time advice would interleave the table
    model, data = make_job(args)
    variants = build(args.variants, model, data, args.batch)
    measure(variants, rounds=args.rounds, warmup=args.warmup, steps=args.steps,
            clock=CLOCKS[args.clock])
    if "accumix" in args.variants:
        mine = next(v for v in variants if v.name == "accumix")
        if not mine.error:
            # Equal work: same data, same order, same maths, so the same weights.
            diff = max_diff(mine.params(), variants[0].params())
            assert diff <= PARAM_TOL, f"accumix's parameters differ from raw's by {diff:.3g}"
    print(report(variants, args), flush=True)


if __name__ == "__main__":
    main()
