"""torch.compile under every multi-rank strategy, in one 2-rank job: each compiled run really
compiled (dynamo's counters), had no recompilation over K=3 with a short last window (each
rank's windows: 3 and 2 micro-steps), equals the eager run to 1e-6 and unwraps to the user's
module with plain keys; an FSDP2 checkpoint saved compiled loads into an eager run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import accumix as ax
from accumix.testing import spawn
from tests import compile_workloads as cw

# (strategy, precision, how): both ways in (torch.compile'd model, Accelerator(compile=)) and
# autocast once, without running every combination (each costs a second or two per rank).
RUNS = [
    ("ddp", "fp32", "wrapped"),
    ("ddp", "bf16-mixed", "flag"),
    ("zero1", "fp32", "wrapped"),
    ("fsdp", "fp32", "wrapped"),
    ("fsdp", "fp32", "flag"),
    ("deepspeed", "fp32", "wrapped"),
    ("deepspeed", "fp32", "flag"),  # through the engine's compile()
]
# Issue 20.11: FSDP units that are torch's own modules (the frames dynamo skips).
TORCH_BLOCKS = [("wrapped", "sequential"), ("flag", "transformer")]


def _fsdp_checkpoint(run_dir: str) -> float:
    """Saved by a compiled FSDP2 run, loaded by an eager one: the largest weight difference."""
    import torch.distributed as dist

    states = []
    for compiled in (True, False):
        cw.reset_dynamo()
        acc = ax.Accelerator(strategy="fsdp", precision="fp32", grad_accum_steps=cw.K,
                             compile={"backend": "eager"} if compiled else None)
        model = cw.BlockNet(seed=0 if compiled else 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.setup(model, opt)
        if compiled:
            with acc.accumulate():
                acc.backward(model(torch.randn(4, 6)).square().mean())
            for _ in range(cw.K - 1):
                with acc.accumulate():
                    acc.backward(model(torch.randn(4, 6)).square().mean())
                    opt.step()
                    opt.zero_grad()
            acc.save_state(run_dir)
        else:
            acc.load_state(run_dir)
        states.append(acc.strategy.full_state_dict(model))
    dist.barrier()
    if not states[0]:
        return 0.0  # rank 1: the full state dict lives on rank 0
    return max((states[0][k] - states[1][k]).abs().max().item() for k in states[0])


def _job(run_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    eager: dict[tuple[str, str], dict[str, Any]] = {}
    for strategy, precision, how in RUNS:
        if (strategy, precision) not in eager:
            eager[(strategy, precision)] = cw.train(strategy=strategy, how="eager",
                                                    precision=precision)
        got = cw.train(strategy=strategy, how=how, precision=precision)
        out[f"{strategy}-{precision}-{how}"] = cw.check(got, eager[(strategy, precision)])
    for how, blocks in TORCH_BLOCKS:
        reference = cw.train(strategy="fsdp", how="eager", blocks=blocks)
        got = cw.train(strategy="fsdp", how=how, blocks=blocks)
        out[f"fsdp-{blocks}-{how}"] = cw.check(got, reference)
    out["fsdp-checkpoint-diff"] = _fsdp_checkpoint(run_dir)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(_job, 2, args=(str(tmp_path_factory.mktemp("ckpt")),))


@pytest.mark.parametrize("run", [f"{s}-{p}-{h}" for s, p, h in RUNS]
                         + [f"fsdp-{b}-{h}" for h, b in TORCH_BLOCKS])
def test_compiled_equals_eager_without_recompiling(results: list[dict[str, Any]], run: str
                                                   ) -> None:
    for rank, result in enumerate(results):
        got = result[run]
        assert got["diff"] <= 1e-6, (rank, got)
        # Really compiled: dynamo captured graphs, not only converted frames.
        assert got["frames"] >= 1 and got["graphs"] >= 1, (rank, got)
        assert got["recompiles"] == 0, (rank, got)
        assert got["steps"] == (2, 2), (rank, got)
        assert got["keys_clean"] and got["unwrap_is_user"], (rank, got)


def test_fsdp_checkpoint_loads_across_compiled_and_eager(results: list[dict[str, Any]],
                                                         tmp_path: Path) -> None:
    assert results[0]["fsdp-checkpoint-diff"] == 0.0
