"""The Trainer on one process: event order, the logged window loss against a hand computation,
the accumulation scheduler, resume, the guards."""

from __future__ import annotations

import csv
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
from accumix.trainer import (
    EVENTS,
    Callback,
    EarlyStopping,
    GradientAccumulationScheduler,
    LossGuard,
    StepMetrics,
    StragglerMonitor,
    Trainer,
)
from tests import workloads as w


class Recorder(Callback):
    """Records every event; at each optimizer step also K and the metrics."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.metrics: list[StepMetrics] = []
        self.ks: list[int] = []

    def __getattribute__(self, name: str) -> Any:
        if name in EVENTS:
            def record(trainer: Trainer, *args: Any) -> None:
                self.events.append(name)
                if name == "on_optimizer_step":
                    self.metrics.append(args[0])
                    self.ks.append(trainer.accelerator.grad_accum_steps)
            return record
        return super().__getattribute__(name)


def make_trainer(data: Any, step_fn: Any, *, k: int, micro: int, lr: float = 0.0,
                 **kwargs: Any) -> tuple[Trainer, Recorder]:
    recorder = Recorder()
    model = w.make_model(data.tensors[0].shape[-1])
    acc = ax.Accelerator(precision="fp32", grad_accum_steps=k)
    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                      train_loader=DataLoader(data, batch_size=micro), accelerator=acc,
                      step_fn=step_fn, progress_bar=False,
                      callbacks=[recorder, *kwargs.pop("callbacks", [])], **kwargs)
    return trainer, recorder


MICRO = ["on_train_batch_start", "on_before_backward", "on_after_backward"]


def test_event_order_with_eval_and_checkpoint_then_resume(tmp_path: Path) -> None:
    data = w.sequence_data(16)
    trainer, rec = make_trainer(data, w.item_loss, k=2, micro=4, max_steps=2, eval_every=2,
                                checkpoint_every=2, run_dir=tmp_path, lr=0.1,
                                val_loader=DataLoader(data, batch_size=8), loggers=["csv"])
    result = trainer.fit()
    off = [*MICRO, "on_train_batch_end"]
    step = [*MICRO, "on_before_optimizer_step", "on_optimizer_step"]
    assert rec.events == ["on_fit_start", *off, *step, "on_train_batch_end", *off, *step,
                          "on_validation_start", "on_validation_end", "on_write_checkpoint",
                          "on_save_checkpoint", "on_train_batch_end", "on_fit_end"]
    assert result.step == 2 and (tmp_path / "step-2").is_dir()

    # A new run in the same directory resumes at step 2 and trains 1 more: the end of fit
    # evaluates and checkpoints the last step.
    trainer, rec = make_trainer(data, w.item_loss, k=2, micro=4, max_steps=3, eval_every=2,
                                checkpoint_every=2, run_dir=tmp_path, lr=0.1,
                                val_loader=DataLoader(data, batch_size=8), loggers=["csv"])
    result = trainer.fit()
    assert rec.events == ["on_fit_start", "on_load_checkpoint", *off, *step,
                          "on_train_batch_end", "on_validation_start", "on_validation_end",
                          "on_write_checkpoint", "on_save_checkpoint", "on_fit_end"]
    assert result.step == 3 and result.resumed_from == tmp_path
    with (tmp_path / "metrics.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3]


def test_exception_reaches_callbacks_and_propagates() -> None:
    data = w.regression_data(16)
    calls = {"n": 0}

    def failing(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("bad batch")
        return w.mean_loss(model, batch)

    trainer, rec = make_trainer(data, failing, k=2, micro=4, max_steps=4)
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer.fit()
    assert rec.events[-2:] == ["on_train_batch_start", "on_exception"]
    assert "on_fit_end" not in rec.events


def test_window_loss_items_equals_hand_computation_with_short_last_window(
        tmp_path: Path) -> None:
    # 12 micro-batches of 4 variable-length sequences, K=5: windows of 5, 5 and 2 micro-steps.
    data = w.sequence_data(48)
    trainer, rec = make_trainer(data, w.item_loss, k=5, micro=4, max_epochs=1,
                                run_dir=tmp_path, loggers=["csv", "jsonl"])
    trainer.fit()
    model = w.make_model(4)  # lr=0: the parameters never change, so the reference is exact
    expected = []
    for first, last in ((0, 20), (20, 40), (40, 48)):
        loss_sum, items = w.item_loss(model, data[first:last])
        expected.append(loss_sum.item() / items.item())
    assert [m.loss for m in rec.metrics] == pytest.approx(expected, rel=1e-6)
    assert [m.items for m in rec.metrics] == [
        int(data[a:b][2].sum()) for a, b in ((0, 20), (20, 40), (40, 48))]
    assert [m.samples for m in rec.metrics] == [20, 20, 8]
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [float(r["loss"]) for r in rows] == [m.loss for m in rec.metrics]
    for column in ("step", "loss", "lr", "grad_norm", "loss_scale", "skipped", "samples_per_s",
                   "tokens_per_s", "step_time_s", "max_mem_mb"):
        assert column in rows[0]
    assert [r["skipped"] for r in rows] == ["0", "0", "0"] and rows[0]["loss_scale"] == ""
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_window_loss_mean_mode_is_the_mean_over_micro_steps() -> None:
    data = w.regression_data(40)  # 10 micro-batches of 4, K=4: windows of 4, 4, 2
    trainer, rec = make_trainer(data, w.mean_loss, k=4, micro=4, max_epochs=1)
    trainer.fit()
    model = w.make_model()
    micro = [w.mean_loss(model, data[i:i + 4]).item() for i in range(0, 40, 4)]
    expected = [sum(micro[0:4]) / 4, sum(micro[4:8]) / 4, sum(micro[8:10]) / 2]
    assert [m.loss for m in rec.metrics] == pytest.approx(expected, rel=1e-6)
    assert [m.items for m in rec.metrics] == [None, None, None]
    # The logged grad norm is the norm of the window's true (mean) gradient.
    model.zero_grad()
    w.mean_loss(model, data[32:40]).backward()
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    assert rec.metrics[-1].grad_norm == pytest.approx(norm, rel=1e-5)


def test_accumulation_scheduler_changes_k_by_step_and_by_epoch() -> None:
    data = w.regression_data(48)  # 12 micro-batches of 4
    by_step = GradientAccumulationScheduler({0: 1, 2: 3}, by="step")
    trainer, rec = make_trainer(data, w.mean_loss, k=2, micro=4, max_steps=5,
                                callbacks=[by_step])
    trainer.fit()
    assert rec.ks == [1, 1, 3, 3, 3]
    assert [m.samples for m in rec.metrics] == [4, 4, 12, 12, 12]

    by_epoch = GradientAccumulationScheduler({0: 2, 1: 4}, by="epoch")
    trainer, rec = make_trainer(data, w.mean_loss, k=1, micro=4, max_epochs=2,
                                callbacks=[by_epoch])
    result = trainer.fit()
    assert rec.ks == [2] * 6 + [4] * 3 and result.step == 9 and result.epoch == 1
    with pytest.raises(ax.ConfigError, match="grad_accum_steps >= 1"):
        GradientAccumulationScheduler({0: 0})


def test_accelerator_grad_accum_steps_setter_is_validated() -> None:
    acc = ax.Accelerator(precision="fp32", grad_accum_steps=2)
    model = w.make_model()
    model, opt, loader = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(w.regression_data(16), batch_size=4))
    with pytest.raises(ax.ConfigError, match="integer >= 1"):
        acc.grad_accum_steps = 0
    batch = next(iter(loader))
    with acc.accumulate():
        acc.backward(w.mean_loss(model, batch))
    with pytest.raises(ax.ConfigError, match="only between windows"):
        acc.grad_accum_steps = 3
    with acc.accumulate():
        acc.backward(w.mean_loss(model, batch))
        opt.step()
        opt.zero_grad()
    acc.grad_accum_steps = 3
    assert acc.grad_accum_steps == 3


def test_nan_loss_raises_or_stops() -> None:
    data = w.regression_data(32)

    def nan_at_step_3(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = w.mean_loss(model, batch)
        return loss * math.nan if trainer.step == 2 else loss

    trainer, _ = make_trainer(data, nan_at_step_3, k=1, micro=4, max_steps=6)
    with pytest.raises(ax.AccumixError, match="loss is nan at step 3"):
        trainer.fit()
    trainer, rec = make_trainer(data, nan_at_step_3, k=1, micro=4, max_steps=6,
                                callbacks=[LossGuard(on_nan="stop")])
    result = trainer.fit()
    assert result.step == 3 and len(rec.metrics) == 3


def test_trainer_rejects_bad_settings() -> None:
    data = w.regression_data(8)
    with pytest.raises(ax.ConfigError, match="max_steps or max_epochs"):
        make_trainer(data, w.mean_loss, k=1, micro=4)
    with pytest.raises(ax.ConfigError, match="eval_every=0"):
        make_trainer(data, w.mean_loss, k=1, micro=4, max_steps=1, eval_every=0)
    with pytest.raises(ax.ConfigError, match="unknown logger 'xml'"):
        make_trainer(data, w.mean_loss, k=1, micro=4, max_steps=1, run_dir="x", loggers=["xml"])
    trainer, _ = make_trainer(data, lambda m, b: m(b[0]), k=1, micro=4, max_steps=1)
    with pytest.raises(ax.ConfigError, match="returned Tensor"):
        trainer.fit()


@pytest.mark.filterwarnings("ignore:precision='fp16-mixed' on this CPU is emulated")
def test_fp16_overflow_row_is_skipped_and_keeps_the_step() -> None:
    data = w.regression_data(16)
    calls = {"n": 0}

    def overflow_second_window(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        loss = w.mean_loss(model, batch)
        return loss * math.inf if calls["n"] == 2 else loss

    recorder = Recorder()
    model = w.make_model()
    acc = ax.Accelerator(precision="fp16-mixed", grad_accum_steps=1,
                         loss_scale=ax.DynamicLossScale(init_scale=16.0, hysteresis=1))
    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      train_loader=DataLoader(data, batch_size=4), accelerator=acc,
                      step_fn=overflow_second_window, max_steps=3, progress_bar=False,
                      callbacks=[recorder])
    result = trainer.fit()
    rows = [(m.step, m.skipped, m.loss_scale) for m in recorder.metrics]
    assert rows == [(1, False, 16.0), (1, True, 16.0), (2, False, 8.0), (3, False, 8.0)]
    assert result.step == 3 and math.isinf(recorder.metrics[1].loss)


def test_a_finished_run_run_again_does_nothing_and_reports_the_saved_result(
        tmp_path: Path) -> None:
    # Issue 20.7: the checkpoint of a finished max_epochs=1 run says (epoch 1, position 0); the
    # loop checked the epoch only after running one, so a re-run trained a second epoch.
    data = w.regression_data(24)  # 6 micro-batches of 4, K=2: 3 steps an epoch
    val = DataLoader(data, batch_size=8)
    first, _ = make_trainer(data, w.mean_loss, k=2, micro=4, lr=0.1, max_epochs=1,
                            checkpoint_every=2, run_dir=tmp_path, val_loader=val)
    done = first.fit()
    weights = [p.detach().clone() for p in first.model.parameters()]
    again, rec = make_trainer(data, w.mean_loss, k=2, micro=4, lr=0.1, max_epochs=1,
                              checkpoint_every=2, run_dir=tmp_path, val_loader=val)
    result = again.fit()
    assert (done.step, result.step) == (3, 3)
    assert rec.metrics == [] and "on_validation_end" not in rec.events  # nothing ran again
    assert (result.epoch, result.loss, result.val_loss) == (done.epoch, done.loss,
                                                            done.val_loss)
    assert all(torch.equal(a, b) for a, b in zip(weights, again.model.parameters(),
                                                  strict=True))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-2", "step-3"]


def test_load_checkpoint_takes_any_step_directory_ray_s_checkpoint_directories_too(
        tmp_path: Path) -> None:
    # Issue 39: Ray names a reported checkpoint checkpoint_<time>; the Trainer refused it ("it
    # has no 'latest'") although it holds meta.json.
    data = w.regression_data(16)
    first, _ = make_trainer(data, w.mean_loss, k=2, micro=4, lr=0.1, max_steps=2,
                            checkpoint_every=2, run_dir=tmp_path / "run")
    first.fit()
    ray_dir = tmp_path / "checkpoint_2026-12-05_04-00-00.000000"
    shutil.copytree(tmp_path / "run" / "step-2", ray_dir)

    class LoadRays(Callback):
        def on_fit_start(self, trainer: Trainer) -> None:
            assert trainer.load_checkpoint(ray_dir) == ray_dir
            assert trainer.step == 2
            assert all(torch.equal(a, b) for a, b in zip(
                first.model.parameters(), trainer.model.parameters(), strict=True))

    again, rec = make_trainer(data, w.mean_loss, k=2, micro=4, lr=0.1, max_steps=3,
                              callbacks=[LoadRays()])
    assert again.fit().step == 3 and len(rec.metrics) == 1  # one step more, from step 2


class Counting(Callback):
    """A user's callback with state: the optimizer steps it has seen."""

    def __init__(self) -> None:
        self.seen = 0

    def on_optimizer_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        self.seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"seen": np.int64(self.seen)}  # a numpy number is stored as the int it equals

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


def test_callbacks_state_resumes_with_the_run(tmp_path: Path) -> None:
    # Issue 20.8: a resumed EarlyStopping counted from zero (the uninterrupted run stops at step
    # 4, the resumed one stopped at 6); LossGuard's recent losses started empty.
    data = w.regression_data(48)

    def run(max_steps: int, run_dir: Path | None) -> tuple[Any, ...]:
        stopping = EarlyStopping(monitor="loss", patience=3, min_delta=1e9)  # never improves
        guard, counting = LossGuard(window=4), Counting()
        trainer, rec = make_trainer(data, w.mean_loss, k=1, micro=4, lr=0.05,
                                    max_steps=max_steps, checkpoint_every=1, run_dir=run_dir,
                                    callbacks=[stopping, counting, guard, Counting()])
        result = trainer.fit()
        return result, stopping, guard, counting, trainer

    whole = run(10, None)
    run(2, tmp_path)
    resumed = run(10, tmp_path)
    assert (whole[0].step, resumed[0].step) == (4, 4)
    assert resumed[1].state_dict() == whole[1].state_dict()
    assert resumed[2].state_dict() == whole[2].state_dict()
    assert resumed[2].state_dict()["recent"] and resumed[3].seen == whole[3].seen == 4
    # The stop is saved too: run again, the stopped run does nothing more.
    again = run(10, tmp_path)
    assert again[0].step == 4 and again[3].seen == 4 and again[0].loss == whole[0].loss
    # StragglerMonitor's count of slow steps (one process has no stragglers to count).
    straggler = StragglerMonitor()
    straggler._slow, straggler._warned = 4, True
    back = StragglerMonitor()
    back.load_state_dict(json.loads(json.dumps(straggler.state_dict())))
    assert (back._slow, back._warned) == (4, True)
    # A callback whose state is not JSON is named at the save, before anything is written.

    class Opaque(Callback):
        def state_dict(self) -> dict[str, Any]:
            return {"model": torch.nn.Linear(1, 1)}

    trainer, _ = make_trainer(data, w.mean_loss, k=1, micro=4, max_steps=1, checkpoint_every=1,
                              run_dir=tmp_path / "opaque", callbacks=[Opaque()])
    with pytest.raises(ax.ConfigError, match="callback Opaque's state_dict"):
        trainer.fit()
    assert not list((tmp_path / "opaque").glob("step-*"))


def test_callbacks_of_a_class_added_or_removed_keep_their_own_state(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Two Counting callbacks (2 and 102 steps seen) saved; the user removes the first. Matched
    # by class name and order, the one left loaded the removed one's 2 (then 3, not 1).
    data = w.regression_data(48)

    def run(max_steps: int, callbacks: list[Counting]) -> None:
        trainer, _ = make_trainer(data, w.mean_loss, k=1, micro=4, lr=0.05, max_steps=max_steps,
                                  checkpoint_every=1, run_dir=tmp_path, callbacks=callbacks)
        trainer.fit()

    first, second = Counting(), Counting()
    second.seen = 100
    run(2, [first, second])
    assert (first.seen, second.seen) == (2, 102)
    # The same callbacks in the same order resume their own state.
    again = [Counting(), Counting()]
    run(3, again)
    assert [c.seen for c in again] == [3, 103]
    left = Counting()
    with caplog.at_level("WARNING"):
        run(4, [left])
    assert left.seen == 1 and "had 2 Counting callback(s), this run has 1" in caplog.text


def test_a_run_early_stopping_ended_continues_when_its_patience_is_raised(
        tmp_path: Path) -> None:
    # Stopped at step 4 by patience=3 and resumed with patience=6, the run stayed stopped (step
    # 4); the uninterrupted patience=6 run stops at step 7, which the resume now reaches too.
    data = w.regression_data(48)

    def run(patience: int, run_dir: Path | None) -> tuple[Any, Trainer]:
        stopping = EarlyStopping(monitor="loss", patience=patience, min_delta=1e9)
        trainer, _ = make_trainer(data, w.mean_loss, k=1, micro=4, lr=0.05, max_steps=20,
                                  checkpoint_every=1, run_dir=run_dir, callbacks=[stopping])
        return trainer.fit(), trainer

    whole, reference = run(6, None)
    assert run(3, tmp_path)[0].step == 4
    resumed, trainer = run(6, tmp_path)
    assert (whole.step, resumed.step) == (7, 7)
    assert all(torch.equal(a, b) for a, b in zip(reference.model.parameters(),
                                                  trainer.model.parameters(), strict=True))
    assert run(6, tmp_path)[0].step == 7  # stopped with patience 6: stays stopped
    assert run(3, tmp_path)[0].step == 7
