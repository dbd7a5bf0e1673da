"""2 ranks on gloo, a small conv + BatchNorm net as a vision user trains it (issue 24).

One spawned job, shared with other modules (conftest.py); each run trains 4 optimizer steps
(K=2, micro-batch 4) on rank-dependent batches, saves after step 2 and is then resumed from that
checkpoint by a new Accelerator in the same process. Checked per run: every rank's parameters
and BN buffers, the evaluation loss each rank computes through the set-up model, and the loss
of the exported model.

1. BN buffers resume bit for bit (ddp, zero1, fsdp, deepspeed): DCP de-duplicates the
   replicated buffers from either rank; rank 0's are the ones that count.
2. Under fsdp and deepspeed every rank holds rank 0's buffers (DDP's semantics): evaluation on
   each rank and the export agree, and equal ddp's to float tolerance.
3. bf16-mixed + BatchNorm trains under fsdp and deepspeed (stages 2, 3), close to ddp's
   bf16-mixed run (fsdp: equal, its norm layers gathered in float32).
4. channels_last parameters set up under fsdp and deepspeed and train as ddp's contiguous run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import accumix as ax
from tests.distributed.shared_spawn import shared_result

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STEPS, SAVE_AT, K, MICRO = 4, 2, 2, 4


class ConvBNNet(nn.Module):
    """Two conv + BatchNorm layers and a linear head (a ResNet stem in miniature)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


def _batch(step: int, rank: int, channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(MICRO, 3, 6, 6, generator=g) * (1 + rank)  # the ranks' statistics differ
    y = torch.randint(0, 4, (MICRO,), generator=g)
    return (x.to(memory_format=torch.channels_last) if channels_last else x), y


def _eval_loss(model: nn.Module, channels_last: bool = False) -> float:
    x, y = _batch(999, 0, channels_last)
    was = model.training
    model.eval()
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    model.train(was)
    return float(loss)


def _strategy(name: str) -> Any:
    if name.startswith("deepspeed"):
        return ax.DeepSpeedStrategy(stage=int(name[-1]))
    return name


def _snapshot(acc: ax.Accelerator, model: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter and buffer as this rank holds it (gathered where sharded)."""
    state = acc.unwrap(model).state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().numpy()
            .copy() for k, v in state.items()}


def _run(name: str, precision: str, channels_last: bool, run_dir: str, resume: bool
         ) -> dict[str, Any]:
    acc = ax.Accelerator(strategy=_strategy(name), precision=precision, grad_accum_steps=K,
                         seed=0)
    model = ConvBNNet()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model, opt = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    if resume:
        acc.load_state(Path(run_dir) / f"step-{SAVE_AT}")
    for micro_step in range(acc.optimizer_steps * K, STEPS * K):
        x, y = _batch(micro_step, acc.rank, channels_last)
        with acc.accumulate():
            acc.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        if not resume and acc.sync_gradients and acc.optimizer_steps == SAVE_AT:
            acc.save_state(run_dir)
    out = {"state": _snapshot(acc, model), "eval": _eval_loss(model, channels_last)}
    path = acc.save_model(Path(run_dir) / ("export-resumed" if resume else "export"), model)
    if acc.rank == 0:
        fresh = ConvBNNet()
        fresh.load_state_dict(load_file(str(path)))
        out["export_eval"] = _eval_loss(fresh)
    acc.end()
    return out


def _job(root: str, runs: list[tuple[str, str, bool]], resumed: list[str]) -> dict[str, Any]:
    """Each run's uninterrupted (and for ``resumed`` keys, resumed) results on this rank, or
    the error it raised."""
    results: dict[str, Any] = {}
    for name, precision, channels_last in runs:
        key = _key(name, precision, channels_last)
        run_dir = str(Path(root) / key)
        try:
            results[key] = {"full": _run(name, precision, channels_last, run_dir, False)}
            if key in resumed:
                results[key]["resumed"] = _run(name, precision, channels_last, run_dir, True)
        except Exception as exc:  # noqa: BLE001 - reported per run, asserted by the test
            results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return results


def _key(name: str, precision: str, channels_last: bool) -> str:
    return f"{name}-{precision}-{'cl' if channels_last else 'contig'}"


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _differing(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    return [k for k in a if not np.array_equal(a[k], b[k])]


FP32_RUNS = [("ddp", "fp32", False), ("zero1", "fp32", False), ("fsdp", "fp32", True)]
BF16_RUNS = [("ddp", "bf16-mixed", False), ("fsdp", "bf16-mixed", False)]
if HAS_DEEPSPEED:
    FP32_RUNS.append(("deepspeed3", "fp32", True))
    BF16_RUNS += [("deepspeed2", "bf16-mixed", True), ("deepspeed3", "bf16-mixed", False)]


def shared_job(root: Path) -> tuple[Any, tuple[Any, ...]]:
    """This module's job, run in the spawn it shares with other modules (conftest.py)."""
    return _job, (str(root), FP32_RUNS + BF16_RUNS, [_key(*r) for r in FP32_RUNS])


@pytest.fixture(scope="module")
def vision_results(shared_spawn: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return shared_result(shared_spawn, __name__)


def test_batchnorm_buffers_resume_bit_for_bit(vision_results: list[dict[str, Any]]) -> None:
    for name, precision, cl in FP32_RUNS:
        key = _key(name, precision, cl)
        for rank, res in enumerate(vision_results):
            assert "error" not in res[key], (key, res[key])
            full, resumed = res[key]["full"], res[key]["resumed"]
            differing = _differing(full["state"], resumed["state"])
            assert not differing, (key, rank, differing,
                                   _max_diff(full["state"], resumed["state"]))
            assert full["eval"] == resumed["eval"], (key, rank, full["eval"], resumed["eval"])


def test_batchnorm_buffers_agree_eval_and_export(vision_results: list[dict[str, Any]]) -> None:
    ref = vision_results[0]["ddp-fp32-contig"]["full"]
    for name, precision, cl in FP32_RUNS:
        key = _key(name, precision, cl)
        assert "error" not in vision_results[0][key], (key, vision_results[0][key])
        rank0, rank1 = (r[key]["full"] for r in vision_results)
        if name not in ("ddp", "zero1"):  # DDP overwrites rank 1's at its next forward
            # DDP's semantics: every rank holds rank 0's buffers ...
            assert not _differing(rank0["state"], rank1["state"]), (key, _differing(
                rank0["state"], rank1["state"]))
        # ... so evaluates rank 0's model ...
        assert rank0["eval"] == rank1["eval"], (key, rank0["eval"], rank1["eval"])
        # ... which is the exported one, and (fp32) ddp's up to the reduction order.
        assert abs(rank0["eval"] - rank0["export_eval"]) < 1e-6, (key, rank0["eval"],
                                                                 rank0["export_eval"])
        assert _max_diff(rank0["state"], ref["state"]) < 1e-5, (key, _max_diff(
            rank0["state"], ref["state"]))


def test_bf16_mixed_batchnorm_and_channels_last_train(vision_results: list[dict[str, Any]]
                                                     ) -> None:
    ref = vision_results[0]["ddp-bf16-mixed-contig"]["full"]
    for name, precision, cl in BF16_RUNS:
        key = _key(name, precision, cl)
        res = vision_results[0][key]
        assert "error" not in res, (key, res)
        # bf16 rounding of the gathered weights (fsdp) or the stored module (deepspeed).
        assert _max_diff(res["full"]["state"], ref["state"]) < 3e-2, (key, _max_diff(
            res["full"]["state"], ref["state"]))
        assert abs(res["full"]["eval"] - ref["eval"]) < 3e-2, (key, res["full"]["eval"],
                                                               ref["eval"])
