"""The torch.compile job the unit and distributed tests share: the DESIGN.md loop with K=3 and a
short last window, run eagerly and compiled, reporting what dynamo did as numbers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

import accumix as ax
from accumix.testing import ResidualBlock
from tests import workloads as w

K = 3
MICRO_BATCH = 4


class BlockNet(nn.Module):
    """Two identical blocks between an input and a head: FSDP's auto wrap finds the blocks."""

    def __init__(self, width: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(6, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(2))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class TorchBlockNet(nn.Module):
    """Three blocks that are torch's own modules (issue 20.11): ``nn.Sequential(nn.Linear,
    nn.GELU)`` or ``nn.TransformerEncoderLayer``, between an input and a head."""

    def __init__(self, kind: str, width: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(6, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) if kind == "sequential"
            else nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0)
            for _ in range(3))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def reset_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def frames() -> int:
    """Frames dynamo converted so far: each first compile and each recompile adds one."""
    return int(counters["frames"]["total"])


def train(*, strategy: str, how: str, precision: str = "fp32", samples: int = 40,
          backend: str = "eager", blocks: str = "custom") -> dict[str, Any]:
    """Trains ``BlockNet`` one epoch; ``how``: ``eager``, ``wrapped`` (``acc.setup(
    torch.compile(model))``) or ``flag`` (``Accelerator(compile={...})``); ``blocks``:
    ``custom`` (``BlockNet``) or ``TorchBlockNet``'s ``sequential`` or ``transformer``.

    With 40 samples in micro-batches of 4, one process sees windows of 3, 3, 3 and 1 micro-steps
    and each of 2 ranks windows of 3 and 2: every run has a short last window.

    Returns:
        ``params`` (the user's module's, full), ``frames_first`` (after the first micro-step,
        which compiles everything the run uses), ``frames_end``, ``graphs``, ``steps``, ``keys``
        (the unwrapped model's state-dict keys), ``unwrap_is_user`` and ``saved_keys`` (what
        ``save_model`` wrote, rank 0 only).
    """
    reset_dynamo()
    user = BlockNet() if blocks == "custom" else TorchBlockNet(blocks)
    model: nn.Module = torch.compile(user, backend=backend) if how == "wrapped" else user
    acc = ax.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=K,
                         compile={"backend": backend} if how == "flag" else None)
    opt = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    loader = DataLoader(w.regression_data(samples), batch_size=MICRO_BATCH, shuffle=False)
    model, opt, loader = acc.setup(model, opt, loader)
    frames_first = None
    for batch in loader:
        with acc.accumulate():
            acc.backward(w.mean_loss(model, batch))
            acc.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        if frames_first is None:
            frames_first = frames()


    state = acc.strategy.full_state_dict(model)
    unwrapped = acc.unwrap(model)
    return {
        "params": [v.detach().clone() for k, v in state.items()] if acc.is_main_process else [],
        "frames_first": frames_first,
        "frames_end": frames(),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "steps": acc.optimizer_steps,
        "keys": sorted(unwrapped.state_dict()),
        "saved_keys": sorted(state),
        "unwrap_is_user": unwrapped is user,
    }


def check(result: dict[str, Any], eager: dict[str, Any], tol: float = 1e-6) -> dict[str, Any]:
    """What the tests assert, as numbers: the distance from the eager run and dynamo's counts."""
    diff = w.max_diff(result["params"], eager["params"]) if eager["params"] else 0.0
    return {
        "diff": diff, "within": diff <= tol,
        "frames": result["frames_first"],
        "recompiles": result["frames_end"] - result["frames_first"],
        "graphs": result["graphs"],
        "steps": (result["steps"], eager["steps"]),
        # save_model's keys: complete on rank 0, empty on the others for the sharded backends.
        "keys_clean": result["keys"] == eager["keys"]
        and result["saved_keys"] == eager["saved_keys"]
        and result["saved_keys"] in (eager["keys"], [])
        and not any("_orig_mod" in k or k.startswith("module.") for k in result["keys"]),
        "unwrap_is_user": result["unwrap_is_user"],
    }
