"""The Trainer's parts on their own: schedules, loggers, guards, early stopping, throughput."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import accumix as ax
from accumix.trainer import (
    CSVLogger,
    EarlyStopping,
    JSONLLogger,
    LossGuard,
    StepMetrics,
    ThroughputMonitor,
    WarmupDecay,
)
from accumix.trainer.loggers import resolve_loggers, tensorboard_available
from accumix.trainer.metrics import batch_samples, split_loss


def metrics(step: int, loss: float, **extra: Any) -> StepMetrics:
    return StepMetrics(step=step, epoch=0, loss=loss, lrs=[0.1], grad_norm=1.0, loss_scale=None,
                       skipped=False, samples=32, items=extra.pop("items", 4000),
                       step_time_s=2.0, rank_busy_s=[1.0, 1.5], max_mem_mb=10.0, extra=extra)


def fake_trainer(step: int = 1) -> Any:
    return SimpleNamespace(should_stop=False, step=step,
                           accelerator=SimpleNamespace(is_main_process=True, world_size=2))


def test_warmup_then_cosine_or_linear_decay() -> None:
    cosine = WarmupDecay(warmup_steps=4, total_steps=14, decay="cosine", min_ratio=0.1)
    assert [cosine(s) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert cosine(4) == pytest.approx(1.0) and cosine(9) == pytest.approx(0.55)
    assert cosine(14) == pytest.approx(0.1) and cosine(100) == pytest.approx(0.1)
    linear = WarmupDecay(warmup_steps=0, total_steps=10, decay="linear")
    assert [linear(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = ax.warmup_schedule(opt, warmup_steps=1, total_steps=3, decay="constant")
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.25, 0.5, 0.5])
    # The schedule's settings travel in the scheduler's state as plain values.
    assert sched.state_dict()["lr_lambdas"][0] == {"warmup_steps": 1, "total_steps": 3,
                                                   "decay": "constant", "min_ratio": 0.0}
    with pytest.raises(ax.ConfigError, match="warmup_steps=5 exceeds total_steps=3"):
        WarmupDecay(warmup_steps=5, total_steps=3)
    with pytest.raises(ax.ConfigError, match="decay='step' is invalid"):
        WarmupDecay(warmup_steps=0, total_steps=3, decay="step")


def test_scale_lr_linear_and_sqrt() -> None:
    assert ax.scale_lr(1e-3, global_batch_size=256, base_batch_size=64) == pytest.approx(4e-3)
    assert ax.scale_lr(1e-3, global_batch_size=256, base_batch_size=64,
                       rule="sqrt") == pytest.approx(2e-3)
    with pytest.raises(ax.ConfigError, match="rule='cube' is invalid"):
        ax.scale_lr(1e-3, global_batch_size=2, base_batch_size=1, rule="cube")


def test_csv_logger_widens_and_trims_on_resume(tmp_path: Path) -> None:
    logger = CSVLogger()
    logger.open(tmp_path, resume_step=0)
    logger.log({"step": 1, "loss": 2.0, "loss_scale": None})
    logger.log({"step": 2, "loss": 1.5, "loss_scale": None, "val_loss": 1.7})
    logger.log({"step": 3, "loss": 1.2, "loss_scale": None})
    logger.close()
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"step": "1", "loss": "2.0", "loss_scale": "", "val_loss": ""},
                    {"step": "2", "loss": "1.5", "loss_scale": "", "val_loss": "1.7"},
                    {"step": "3", "loss": "1.2", "loss_scale": "", "val_loss": ""}]
    logger = CSVLogger()
    logger.open(tmp_path, resume_step=2)  # a resume from step 2 drops step 3's row
    logger.log({"step": 3, "loss": 1.1, "loss_scale": None, "val_loss": None})
    logger.close()
    with (tmp_path / "metrics.csv").open() as f:
        assert [(r["step"], r["loss"]) for r in csv.DictReader(f)] == [
            ("1", "2.0"), ("2", "1.5"), ("3", "1.1")]
    jsonl = JSONLLogger()
    jsonl.open(tmp_path, resume_step=0)
    jsonl.log({"step": 1, "loss": math.nan, "loss_scale": None})
    jsonl.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 1, "loss": "nan", "loss_scale": None}
    if not tensorboard_available():
        with pytest.raises(ax.ConfigError, match="pip install 'accumix\\[tensorboard\\]'"):
            resolve_loggers(["tensorboard"])
    assert [type(x).__name__ for x in resolve_loggers(["csv", "jsonl"])] == ["CSVLogger",
                                                                            "JSONLLogger"]


def test_loss_guard_spikes_and_early_stopping() -> None:
    guard, trainer = LossGuard(spike_factor=2.0, on_spike="stop", window=3), fake_trainer()
    for step, loss in enumerate([3.0, 2.0, 2.5, 2.2], start=1):
        guard.on_optimizer_step(trainer, metrics(step, loss))
    assert not trainer.should_stop  # median of the last 3 is 2.2: 4.5 would be a spike
    guard.on_optimizer_step(trainer, metrics(5, 4.5))
    assert trainer.should_stop and guard.spikes == 1
    with pytest.raises(ax.AccumixError, match="loss is inf at step 6"):
        LossGuard().on_optimizer_step(trainer, metrics(6, math.inf))

    stopper, trainer = EarlyStopping(patience=2, min_delta=0.01), fake_trainer()
    for value in (2.0, 1.5, 1.495, 1.6):
        stopper.on_validation_end(trainer, {"val_loss": value})
    assert trainer.should_stop and stopper.best == 1.5
    on_loss, trainer = EarlyStopping(monitor="loss", patience=1, mode="min"), fake_trainer()
    on_loss.on_optimizer_step(trainer, metrics(1, 2.0))
    on_loss.on_optimizer_step(trainer, metrics(2, 2.5))
    assert trainer.should_stop


def test_throughput_mfu_and_step_output_parsing() -> None:
    monitor, trainer = ThroughputMonitor(flops_per_item=1e6, peak_flops=1e9), fake_trainer()
    row = metrics(1, 1.0)  # 4000 items in 2 s on 2 ranks
    monitor.on_optimizer_step(trainer, row)
    assert row.extra == {"flops_per_s": pytest.approx(2e9), "mfu": pytest.approx(1.0)}
    assert row.as_row()["rank_busy_spread_s"] == 0.5 and row.as_row()["slowest_rank"] == 1
    loss = torch.tensor(2.0)
    assert split_loss(loss) == (loss, None)
    assert split_loss((loss, 7)) == (loss, 7)
    assert split_loss(SimpleNamespace(loss=loss)) == (loss, None)
    with pytest.raises(ax.ConfigError, match="returned list"):
        split_loss([loss])
    assert batch_samples({"input_ids": torch.zeros(5, 3)}) == 5
    assert batch_samples((torch.zeros(4, 2), torch.zeros(4))) == 4


def test_tensorboard_logger_writes_numeric_columns(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # tensorboard is an optional extra (not installed here): a stand-in SummaryWriter records
    # what the logger asks of it.
    import sys
    import types

    from accumix.trainer import loggers

    calls: list[tuple[Any, ...]] = []

    class Writer:
        def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
            calls.append(("open", Path(log_dir).name, purge_step))

        def add_scalar(self, key: str, value: float, step: int) -> None:
            calls.append((key, value, step))

        def flush(self) -> None:
            calls.append(("flush",))

        def close(self) -> None:
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=Writer))
    monkeypatch.setattr(loggers, "tensorboard_available", lambda: True)
    (logger,) = resolve_loggers(["tensorboard"])
    logger.open(tmp_path, resume_step=5)
    logger.log({"step": 6, "loss": 1.5, "loss_scale": None, "skipped": 0, "note": "x"})
    logger.close()
    # Flushed at each row: a killed job keeps every row it logged (SummaryWriter's default
    # waits up to 120 s).
    assert calls == [("open", "tensorboard", 6), ("loss", 1.5, 6), ("skipped", 0, 6), ("flush",),
                     ("close",)]
