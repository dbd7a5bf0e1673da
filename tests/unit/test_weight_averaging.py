"""WeightAveraging on one process (issue 24.8): the EMA against a hand-computed EMA of a plain
PyTorch run, evaluation with the average, an fp16-skipped step, the refusals."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import accumix as ax
from accumix.errors import CheckpointError, ConfigError
from accumix.trainer import Callback, StepMetrics, Trainer, WeightAveraging
from tests import workloads as w

DECAY = 0.9


def reference_emas(data: Any, batch_size: int, steps: int, skip: int | None = None
                   ) -> list[list[torch.Tensor]]:
    """A plain PyTorch SGD run and its EMA by hand after each real step (``skip``: the
    1-based window whose step is not taken, as an fp16 overflow)."""
    model = w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = [p.detach().clone() for p in model.parameters()]
    out = []
    for window, batch in enumerate(DataLoader(data, batch_size=batch_size), start=1):
        if len(out) == steps:
            break
        if window == skip:
            continue
        w.mean_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for avg, p in zip(ema, model.parameters(), strict=True):
                avg.mul_(DECAY).add_(p, alpha=1 - DECAY)
        out.append([a.clone() for a in ema])
    return out


def fit_sgd(model: torch.nn.Module, callbacks: list[Callback], *, max_steps: int,
            run_dir: Path | None, rows: int = 64, **options: Any) -> None:
    """The Trainer run these tests share: SGD(lr=0.1), fp32, a mean loss over batches of 4 of
    ``rows`` regression rows, no clipping; ``options`` go to the Trainer."""
    Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            train_loader=DataLoader(w.regression_data(rows), batch_size=4),
            accelerator=ax.Accelerator(precision="fp32"), step_fn=w.mean_loss,
            max_steps=max_steps, grad_clip=None, progress_bar=False, run_dir=run_dir,
            callbacks=callbacks, **options).fit()


class Snapshots(Callback):
    """The average after each optimizer step (placed after the WeightAveraging callback)."""

    def __init__(self, ema: WeightAveraging) -> None:
        self.ema, self.seen = ema, []

    def on_optimizer_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        self.seen.append([a.clone() for a in self.ema.average])


def test_ema_equals_a_hand_computed_ema_and_evaluates_with_it() -> None:
    data = w.regression_data(32)
    ema = WeightAveraging(decay=DECAY, eval_with_average=True)
    snaps = Snapshots(ema)
    model = w.make_model()
    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      train_loader=DataLoader(data, batch_size=4), accelerator=ax.Accelerator(
                          precision="fp32"), step_fn=w.mean_loss, max_steps=5, grad_clip=None,
                      progress_bar=False, val_loader=DataLoader(data, batch_size=32),
                      callbacks=[ema, snaps])
    trainer.fit()
    expected = reference_emas(data, 4, 5)
    assert len(snaps.seen) == 5 and ema.updates == 5
    for got, want in zip(snaps.seen, expected, strict=True):
        assert all(torch.equal(g, e) for g, e in zip(got, want, strict=True))
    # The final evaluation ran with the average; the training weights came back bitwise.
    weights = [p.detach().clone() for p in model.parameters()]
    averaged = w.make_model()
    with torch.no_grad():
        for p, a in zip(averaged.parameters(), expected[-1], strict=True):
            p.copy_(a)
        want_loss = float(w.mean_loss(averaged, data.tensors))
    assert trainer.last_val["val_loss"] == pytest.approx(want_loss, rel=1e-6)
    trainer.validate()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), weights, strict=True))


@pytest.mark.filterwarnings("ignore:precision='fp16-mixed' on this CPU is emulated")
def test_an_fp16_skipped_step_does_not_update_the_average() -> None:
    data = w.regression_data(32)
    calls = {"n": 0}

    def overflow_second_window(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        loss = w.mean_loss(model, batch)
        return loss * math.inf if calls["n"] == 2 else loss

    ema = WeightAveraging(decay=DECAY)
    snaps = Snapshots(ema)
    model = w.make_model()
    acc = ax.Accelerator(precision="fp16-mixed", loss_scale=ax.DynamicLossScale(
        init_scale=16.0, hysteresis=1))
    Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            train_loader=DataLoader(data, batch_size=4), accelerator=acc,
            step_fn=overflow_second_window, max_steps=3, progress_bar=False, grad_clip=None,
            callbacks=[ema, snaps]).fit()
    assert ema.updates == 3 and len(snaps.seen) == 4  # 4 windows, the 2nd skipped
    assert all(torch.equal(a, b) for a, b in zip(snaps.seen[0], snaps.seen[1], strict=True))
    expected = reference_emas(data, 4, 3, skip=2)
    # fp16-mixed computes the forward in half precision: close to the fp32 reference.
    for got, want in zip(snaps.seen[-1], expected[-1], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


def test_bad_settings_and_strategies_are_refused() -> None:
    with pytest.raises(ConfigError, match="decay=1.0"):
        WeightAveraging(decay=1.0)
    with pytest.raises(ConfigError, match="every_n_steps=0"):
        WeightAveraging(every_n_steps=0)
    assert WeightAveraging(decay=np.float32(0.5), every_n_steps=np.int64(2)).every_n_steps == 2

    class Other:
        name = "my_strategy"  # a user's Strategy: how it holds its weights is unknown

    class Fake:
        accelerator = type("A", (), {"strategy": Other()})()
        model = torch.nn.Linear(1, 1)

    with pytest.raises(ConfigError, match="strategy='my_strategy'.*zero1, fsdp, deepspeed"):
        WeightAveraging().on_fit_start(Fake())  # type: ignore[arg-type]


def test_the_average_of_bfloat16_weights_is_float32_and_moves() -> None:
    """A bfloat16 average with decay 0.999 would stay the initial weights (each update is below
    half a bfloat16 step): the average is kept in float32, as the hand-computed one."""
    data = w.regression_data(32)

    def bf16_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)

    ema = WeightAveraging(decay=0.999)
    snaps = Snapshots(ema)
    model = w.make_model().to(torch.bfloat16)
    Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            train_loader=DataLoader(data, batch_size=4), accelerator=ax.Accelerator(
                precision="fp32"), step_fn=bf16_loss, max_steps=3, grad_clip=None,
            progress_bar=False, callbacks=[ema, snaps]).fit()
    initial = [p.float() for p in w.make_model().to(torch.bfloat16).parameters()]
    assert [a.dtype for a in ema.average] == [torch.float32] * len(initial)
    # Every step moved it (a bfloat16 average stayed the initial weights: 4 of 4 equal).
    for before, after in zip([initial, *snaps.seen[:-1]], snaps.seen, strict=True):
        assert not any(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # The last update, by hand in float32, from the step-2 average and the final weights.
    for avg, prev, p in zip(ema.average, snaps.seen[1], model.parameters(), strict=True):
        assert torch.equal(avg, prev.mul(0.999).add(p.detach().float(), alpha=1 - 0.999))


def test_per_rank_files_of_earlier_checkpoints_still_load(tmp_path: Path) -> None:
    """A checkpoint written before ``step-N/ema/`` (``ema-rank-<r>.pt``) resumes bitwise; one
    with neither is refused in one line; a run saved without the callback resumes a newly
    added one from the loaded weights."""
    def fit(max_steps: int, run_dir: Path = tmp_path, with_ema: bool = True
            ) -> WeightAveraging:
        ema = WeightAveraging(decay=DECAY)
        model = w.make_model()
        fit_sgd(model, [ema] if with_ema else [], max_steps=max_steps, run_dir=run_dir,
                rows=32, checkpoint_every=3)
        ema.weights = [p.detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]
        return ema

    saved = [a.clone() for a in fit(3).average]
    step = tmp_path / "step-3"
    assert sorted(f.name for f in (step / "ema").iterdir())[:1] == [".metadata"]
    shutil.rmtree(step / "ema")  # as the earlier accumix wrote it: not in the manifest
    meta = json.loads((step / "meta.json").read_text())
    meta["files"] = {k: v for k, v in meta["files"].items() if not k.startswith("ema/")}
    (step / "meta.json").write_text(json.dumps(meta))
    torch.save(saved, step / "ema-rank-0.pt")
    assert all(torch.equal(a, b) for a, b in zip(fit(3).average, saved, strict=True))
    (step / "ema-rank-0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"step-3/ema is missing"):
        fit(3)
    fit(3, tmp_path / "plain", with_ema=False)
    added = fit(3, tmp_path / "plain")
    assert added.updates == 0
    assert all(torch.equal(a, p) for a, p in zip(added.average, added.weights, strict=True))


def test_a_crash_while_the_average_is_written_leaves_the_previous_checkpoint_resumable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The average is part of the step directory before ``latest`` names it: a crash while it
    is written (here at step 6, ``keep_checkpoints=1``) leaves step 3 as ``latest``, complete,
    and the resumed run ends with the uninterrupted run's average bitwise. (It used to be
    written after ``latest`` moved and step 3 was pruned: no checkpoint could be resumed.)"""
    from accumix.checkpoint import dcp_state

    def fit(max_steps: int, run_dir: Path | None) -> WeightAveraging:
        ema = WeightAveraging(decay=DECAY)
        model = w.make_model()
        fit_sgd(model, [ema], max_steps=max_steps, run_dir=run_dir,
                checkpoint_every=3 if run_dir else None, keep_checkpoints=1)
        return ema

    want = fit(9, None).average
    write, calls = dcp_state.write, []

    def crash_on_the_second_average(state: dict[str, Any], directory: str) -> None:
        if "ema" in Path(directory).name:
            calls.append(directory)
            if len(calls) == 2:
                raise KeyboardInterrupt  # the process dies while writing step 6's average
        write(state, directory)

    monkeypatch.setattr(dcp_state, "write", crash_on_the_second_average)
    with pytest.raises(KeyboardInterrupt):
        fit(9, tmp_path)
    monkeypatch.setattr(dcp_state, "write", write)
    assert (tmp_path / "latest").read_text().strip() == "step-3"
    got = fit(9, tmp_path)
    assert got.updates == 9
    assert all(torch.equal(a, b) for a, b in zip(got.average, want, strict=True))


def test_a_save_while_the_average_is_swapped_in_is_refused(tmp_path: Path) -> None:
    """A callback listed before WeightAveraging that saves at ``on_validation_end`` saves while
    the average is still in the model: the checkpoint would resume from the averaged weights
    (0.067 off the uninterrupted run's weights after 6 steps). It is refused, nothing is
    published; listed after WeightAveraging, it saves the training weights."""
    class SaveOnValidation(Callback):
        def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
            trainer.save_checkpoint()

    def fit(max_steps: int, run_dir: Path | None, *, saver_first: bool = False
            ) -> list[torch.Tensor]:
        ema = WeightAveraging(decay=DECAY, eval_with_average=True)
        saver = [SaveOnValidation()] if run_dir is not None else []
        model = w.make_model()
        fit_sgd(model, [*saver, ema] if saver_first else [ema, *saver], max_steps=max_steps,
                run_dir=run_dir, val_loader=DataLoader(w.regression_data(16), batch_size=8),
                eval_every=3)
        return [p.detach().clone() for p in model.parameters()]

    with pytest.raises(CheckpointError, match="swapped in for evaluation"):
        fit(3, tmp_path, saver_first=True)
    assert not (tmp_path / "latest").exists()
    want = fit(6, None)
    fit(3, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(fit(6, tmp_path), want, strict=True))


def test_two_averages_are_saved_and_resumed_each_its_own(tmp_path: Path) -> None:
    """Two WeightAveraging callbacks (decays 0.9 and 0.5) each save their average
    (``step-N/ema``, ``step-N/ema-1``): the resumed run ends with the uninterrupted run's two
    averages bitwise (both used to be written to ``step-N/ema``: each resumed the other's)."""
    def fit(max_steps: int, run_dir: Path | None) -> list[list[torch.Tensor]]:
        emas = [WeightAveraging(decay=DECAY), WeightAveraging(decay=0.5)]
        model = w.make_model()
        fit_sgd(model, list(emas), max_steps=max_steps, run_dir=run_dir,
                checkpoint_every=3 if run_dir else None)
        return [ema.average for ema in emas]

    want = fit(6, None)
    fit(3, tmp_path)
    got = fit(6, tmp_path)
    for averages, expected in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(averages, expected, strict=True))
    assert sorted(p.name for p in (tmp_path / "step-6").glob("ema*")) == ["ema", "ema-1"]
