"""Writes the weights that ``tests/distributed/test_reduce_dtype*.py`` compare bitwise: each
torch strategy's run under its default reduction, trained by the code before ``reduce_dtype``
(bbd32c7; hsdp, which came later: 42bb48a), public API only, so the same script runs on both.

    PYTHONPATH=<old checkout>/src:. python tests/golden/pre_reduce33/make.py \
        tests/golden/pre_reduce33

Every case trains 3 optimizer steps (K=2, SGD with momentum, 2 ranks on gloo, each rank its own
batches; hsdp: 4 ranks as 2 simulated nodes, ``weights4.safetensors``) and keeps rank 0's full
state dict. ``--hsdp`` writes only the 4-rank file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import accumix as ax
from accumix.testing import ResidualBlock

# case -> (strategy, precision). DeepSpeed under the half precisions is left out on purpose: it
# reduced in the half dtype and summed the window in it before (now float32, issue 33).
CASES = {
    "ddp-fp32": ("ddp", "fp32"), "zero1-fp32": ("zero1", "fp32"), "fsdp-fp32": ("fsdp", "fp32"),
    "fsdp_sync-fp32": ("fsdp_sync", "fp32"), "deepspeed1-fp32": ("deepspeed1", "fp32"),
    "deepspeed2-fp32": ("deepspeed2", "fp32"), "deepspeed3-fp32": ("deepspeed3", "fp32"),
    "ddp-bf16-mixed": ("ddp", "bf16-mixed"), "fsdp-bf16-mixed": ("fsdp", "bf16-mixed"),
    "ddp-bf16-true": ("ddp", "bf16-true"), "fsdp-bf16-true": ("fsdp", "bf16-true"),
    "ddp-fp16-mixed": ("ddp", "fp16-mixed"),
}


CASES4 = {"hsdp-fp32": ("hsdp", "fp32"), "hsdp_defer-fp32": ("hsdp_defer", "fp32")}


def strategy_of(word: str) -> Any:
    if word == "hsdp_defer":
        return ax.HSDPStrategy(defer_reduce_scatter=True)
    if word.startswith("deepspeed"):
        return ax.DeepSpeedStrategy(stage=int(word[-1]))
    if word == "fsdp_sync":
        return ax.FSDPStrategy(sync_each_microstep=True)
    return word


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), ResidualBlock(16), ResidualBlock(16), nn.Linear(16, 1))


def train(strategy: Any, precision: str, steps: int = 3, accum: int = 2, **kwargs: Any
          ) -> tuple[ax.Accelerator, dict[str, torch.Tensor]]:
    """The loop of DESIGN.md; ``kwargs`` go to the Accelerator. Returns it and the full state
    dict (complete on rank 0)."""
    acc = ax.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=accum,
                         **kwargs)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.setup(model, opt)
    gen = torch.Generator().manual_seed(acc.rank)
    for _ in range(steps * accum):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
        with acc.accumulate():
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    state = {k: v.detach().float().cpu().clone()
             for k, v in acc.strategy.full_state_dict(model).items()}
    acc.end()
    return acc, state


def every_case(cases: dict[str, tuple[str, str]] = CASES) -> dict[str, Any]:
    """Each case's state dict under ``<case>/<key>`` as numpy arrays (they pickle by value
    across processes), rank 0's; empty on the others."""
    out = {}
    for case, (word, precision) in cases.items():
        _, state = train(strategy_of(word), precision)
        out.update({f"{case}/{k}": v.numpy() for k, v in state.items()})
    return out


def _write(directory: str, hsdp_only: bool) -> None:
    from safetensors.torch import save_file

    from accumix.testing import spawn

    runs = [("weights4.safetensors", 4, 2, CASES4)]
    if not hsdp_only:
        runs.insert(0, ("weights.safetensors", 2, 1, CASES))
    for name, ranks, nodes, cases in runs:
        weights = spawn(every_case, ranks, (cases,), timeout=900, nodes=nodes)[0]
        save_file({k: torch.from_numpy(v).contiguous() for k, v in weights.items()},
                  str(Path(directory) / name))


if __name__ == "__main__":
    _write(sys.argv[1], "--hsdp" in sys.argv[2:])
