"""WeightAveraging on 2 ranks (issue 24.8), ddp, zero1 and fsdp in one spawned job.

The average after each step equals the single-process hand-computed EMA; evaluation with the
average gives the reference's loss and leaves the training weights as they were (the resumed
run, which does not evaluate, ends with the same weights bitwise); a run saved at step 3 and
resumed by a new Trainer to step 6 ends with the uninterrupted run's average bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

import accumix as ax
from accumix.testing import spawn
from accumix.trainer import Callback, StepMetrics, Trainer, WeightAveraging
from tests import workloads as w
from tests.unit.test_weight_averaging import DECAY, reference_emas

STEPS, SAVE_AT, MICRO = 6, 3, 4
STRATEGIES = ("ddp", "zero1", "fsdp")


def _full(avg: torch.Tensor, param: torch.Tensor) -> np.ndarray:
    """The whole average of ``param`` (an fsdp shard is gathered; only the test gathers)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import DTensor
        avg = DTensor.from_local(avg, param.device_mesh, param.placements, shape=param.shape,
                                 stride=param.stride()).full_tensor()
    return avg.detach().numpy().copy()


class Gathered(Callback):
    def __init__(self, ema: WeightAveraging) -> None:
        self.ema, self.seen = ema, []

    def on_optimizer_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        self.seen.append([_full(a, p) for a, p in zip(self.ema.average, self.ema._params,
                                                        strict=True)])


def _run(strategy: str, max_steps: int, run_dir: str | None) -> tuple[Any, ...]:
    # The uninterrupted run (no run_dir) also evaluates with the average at its end.
    ema = WeightAveraging(decay=DECAY, eval_with_average=run_dir is None)
    gathered = Gathered(ema)
    model = w.make_model()
    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      train_loader=DataLoader(w.regression_data(64), batch_size=MICRO),
                      accelerator=ax.Accelerator(strategy=strategy, precision="fp32"),
                      step_fn=w.mean_loss, max_steps=max_steps, grad_clip=None,
                      progress_bar=False, run_dir=run_dir, val_loader=None if run_dir else
                      DataLoader(w.regression_data(64), batch_size=16),
                      checkpoint_every=SAVE_AT if run_dir else None, callbacks=[ema, gathered])
    trainer.fit()
    local = [a.clone() for a in ema.average]
    weights = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone()
               for p in ema._params]
    return gathered.seen, local, weights, ema.updates, trainer.last_val


def _job(root: str) -> dict[str, Any]:
    out = {}
    for strategy in STRATEGIES:
        seen, local, weights, _, val = _run(strategy, STEPS, None)
        run_dir = str(Path(root) / strategy)
        _run(strategy, SAVE_AT, run_dir)
        _, local2, weights2, updates2, _ = _run(strategy, STEPS, run_dir)
        out[strategy] = {
            "seen": seen,
            "val_loss": val["val_loss"],
            "ema_bitwise": all(torch.equal(a, b) for a, b in zip(local, local2, strict=True)),
            "weights_bitwise": all(torch.equal(a, b)
                                   for a, b in zip(weights, weights2, strict=True)),
            "updates": updates2,
        }
    return out


def test_ema_under_ddp_zero1_fsdp_matches_the_reference_and_resumes_bitwise(tmp_path: Path
                                                                             ) -> None:
    ranks = spawn(_job, 2, args=(str(tmp_path),))
    data = w.regression_data(64)
    expected = reference_emas(data, 2 * MICRO, STEPS)
    averaged = w.make_model()
    with torch.no_grad():
        for p, a in zip(averaged.parameters(), expected[-1], strict=True):
            p.copy_(a)
        want_val = float(w.mean_loss(averaged, data.tensors))
    for strategy in STRATEGIES:
        for rank in ranks:
            got = rank[strategy]
            assert (got["ema_bitwise"], got["weights_bitwise"], got["updates"]) == (
                True, True, STEPS), strategy
            assert len(got["seen"]) == STEPS
            assert abs(got["val_loss"] - want_val) <= 1e-5 * want_val, strategy
            for step_avgs, want in zip(got["seen"], expected, strict=True):
                for a, b in zip(step_avgs, want, strict=True):
                    np.testing.assert_allclose(a, b.numpy(), rtol=0, atol=1e-6)
        assert sorted(p.name for p in (tmp_path / strategy / "step-3").glob("ema-*")) == [
            "ema-rank-0.pt", "ema-rank-1.pt"]
