"""WeightAveraging on 2 ranks (issue 24.8): ddp, zero1, fsdp and DeepSpeed ZeRO 2 and 3 in one
spawned job.

The average after each step equals the single-process hand-computed EMA; evaluation with the
average (at step 3, training on, and at the end) gives the reference's loss and leaves the training
weights as they were (the resumed run, which does not evaluate, ends with the same weights bitwise;
ZeRO-3 with persistent and per-forward gathered parameters); ``save_model`` exports the averaged
model; a run saved at step 3 (``step-3/ema/``, torch.distributed.checkpoint) and resumed by a new
Trainer to step 6 ends with the uninterrupted run's average bitwise on 2 ranks; one process loads
it bitwise (resharded) and trains on to the same average within 1e-7."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

import accumix as ax
from accumix.testing import spawn
from accumix.trainer import Callback, StepMetrics, Trainer, WeightAveraging
from tests import workloads as w
from tests.unit.test_weight_averaging import DECAY, reference_emas

STEPS, SAVE_AT, MICRO = 6, 3, 4
STRATEGIES = ["ddp", "zero1", "fsdp"]
if importlib.util.find_spec("deepspeed") is not None:  # find_spec: no import in this process
    STRATEGIES += ["deepspeed2", "deepspeed3"]


def _strategy(name: str) -> Any:
    if name == "deepspeed3":  # persistent (<= 20 elements) and gathered-per-forward params both
        return ax.DeepSpeedStrategy(stage=3, config={
            "zero_optimization": {"stage3_param_persistence_threshold": 20}})
    return ax.DeepSpeedStrategy(stage=int(name[-1])) if name.startswith("deepspeed") else name


class Gathered(Callback):
    """The whole average after each step, on every rank (only the test gathers)."""

    def __init__(self, ema: WeightAveraging) -> None:
        self.ema, self.seen = ema, []

    def on_optimizer_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        self.seen.append(_full(self.ema))


def _full(ema: WeightAveraging) -> list[np.ndarray]:
    return [ema._holder.full(a, p).detach().numpy().copy()
            for a, p in zip(ema.average, ema._params, strict=True)]


def _run(strategy: str, max_steps: int, run_dir: str | None, export: str | None = None
         ) -> tuple[Any, ...]:
    # The uninterrupted run (no run_dir) also evaluates with the average at step 3 (and trains
    # on) and at its end. A global batch of 8 is 2 ranks x 4, or one process accumulating 2 x 4.
    ema = WeightAveraging(decay=DECAY, eval_with_average=run_dir is None)
    gathered = Gathered(ema)
    model = w.make_model()
    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      train_loader=DataLoader(w.regression_data(64), batch_size=MICRO),
                      accelerator=ax.Accelerator(strategy=_strategy(strategy), precision="fp32",
                                                 global_batch_size=2 * MICRO),
                      step_fn=w.mean_loss, max_steps=max_steps, grad_clip=None,
                      progress_bar=False, run_dir=run_dir, val_loader=None if run_dir else
                      DataLoader(w.regression_data(64), batch_size=16),
                      eval_every=None if run_dir else SAVE_AT,
                      checkpoint_every=SAVE_AT if run_dir else None, callbacks=[ema, gathered])
    trainer.fit()
    if export:
        ema.save_model(trainer, export)
    # Whole tensors: a ZeRO-3 partition's padding is not part of the weights.
    weights = [ema._holder.full(ema._holder.local(p), p).clone() for p in ema._params]
    return gathered.seen, _full(ema), weights, ema.updates, trainer.last_val


def _job(root: str) -> dict[str, Any]:
    out = {}
    for strategy in STRATEGIES:
        seen, full, weights, _, val = _run(strategy, STEPS, None,
                                                export=str(Path(root) / f"{strategy}-export"))
        run_dir = Path(root) / strategy
        _run(strategy, SAVE_AT, str(run_dir))
        if torch.distributed.get_rank() == 0:  # kept at step 3 for the one-process resume
            shutil.copytree(run_dir, Path(root) / f"{strategy}-one")
        torch.distributed.barrier()
        _, full2, weights2, updates2, _ = _run(strategy, STEPS, str(run_dir))
        out[strategy] = {
            "seen": seen,
            "val_loss": val["val_loss"],
            "ema_bitwise": all(np.array_equal(a, b) for a, b in zip(full, full2, strict=True)),
            "weights_bitwise": all(torch.equal(a, b)
                                   for a, b in zip(weights, weights2, strict=True)),
            "updates": updates2,
        }
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ema")
    return root, spawn(_job, 2, args=(str(root),))


def test_ema_on_2_ranks_matches_the_reference_evaluates_exports_and_resumes_bitwise(
        two_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    root, ranks = two_ranks
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
                    np.testing.assert_allclose(a, b.numpy(), rtol=0, atol=1e-6, err_msg=strategy)
        # The export is the averaged model's: strict into a fresh plain model.
        fresh = w.make_model()
        fresh.load_state_dict(load_file(str(root / f"{strategy}-export" / "model.safetensors")))
        for p, want in zip(fresh.parameters(), ranks[0][strategy]["seen"][-1], strict=True):
            assert np.array_equal(p.detach().numpy(), want), strategy
        assert (root / strategy / "step-3" / "ema" / ".metadata").is_file()
        assert not list((root / strategy / "step-3").glob("ema-rank-*"))


def test_a_2_rank_average_resumes_on_one_process(
        two_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    root, ranks = two_ranks
    for strategy in STRATEGIES:
        # The average loaded at step 3 is the 2-rank run's bitwise (resharded into one process).
        ema = _loaded_average(root / f"{strategy}-one")
        for a, want in zip(ema, ranks[0][strategy]["seen"][SAVE_AT - 1], strict=True):
            assert np.array_equal(a, want), strategy
        # Trained on to step 6 by one process accumulating 2 micro-batches: its gradients are
        # summed in another order than 2 ranks' all-reduce (1 ulp apart in a few elements).
        _, full, _, updates, _ = _run("single", STEPS, str(root / f"{strategy}-one"))
        assert updates == STEPS
        for a, want in zip(full, ranks[0][strategy]["seen"][-1], strict=True):
            np.testing.assert_allclose(a, want, rtol=0, atol=1e-7, err_msg=strategy)


def _loaded_average(run_dir: Path) -> list[np.ndarray]:
    ema = WeightAveraging(decay=DECAY)
    model = w.make_model()
    Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            train_loader=DataLoader(w.regression_data(64), batch_size=MICRO),
            accelerator=ax.Accelerator(precision="fp32", global_batch_size=2 * MICRO),
            step_fn=w.mean_loss, max_steps=SAVE_AT, grad_clip=None, progress_bar=False,
            run_dir=str(run_dir), callbacks=[ema]).fit()
    return _full(ema)
