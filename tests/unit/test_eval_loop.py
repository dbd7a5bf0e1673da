"""Evaluation and logging in a plain loop, one process (issue 44): the file loggers outside the
Trainer, ``acc.gather`` / ``gather_for_metrics`` / ``setup_eval_loader`` on a world of one, the
eval loader's split and its refusal under a strategy whose forward communicates."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.data.eval_loader import EvalLoader, block
from accumix.trainer.loggers import CSVLogger, JSONLLogger


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_file_loggers_create_their_directory_and_resume_by_the_step_they_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    run = tmp_path / "runs" / "plain"  # not there yet (before: FileNotFoundError)
    loggers = [CSVLogger(), JSONLLogger()]
    for logger in loggers:
        logger.open(run)
    for epoch in range(3):  # a per-epoch step from 0, as Accelerate's example logs
        for logger in loggers:
            logger.log({"step": epoch, "attempt": 1})
    # Killed after logging epoch 2; the checkpoint was taken after epoch 0.
    loggers = [CSVLogger(), JSONLLogger()]
    for logger in loggers:
        logger.open(run, resume_step=0)  # before: 0 meant a fresh file, epoch 0's row was lost
        for epoch in (1, 2):
            logger.log({"step": epoch, "attempt": 2})
        logger.close()
    assert [(r["step"], r["attempt"]) for r in _csv(run / "metrics.csv")] == [
        ("0", "1"), ("1", "2"), ("2", "2")]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["attempt"]) for r in lines] == [(0, 1), (1, 2), (2, 2)]
    # Fractions of an epoch, and None for a fresh file.
    logger = CSVLogger("fractions.csv")
    logger.open(run)
    for step in (0.5, 1.0, 1.5):
        logger.log({"step": step, "loss": step})
    logger.close()
    logger.open(run, resume_step=1.0)
    logger.log({"step": 1.25, "loss": 9})
    logger.close()
    assert [r["step"] for r in _csv(run / "fractions.csv")] == ["0.5", "1.0", "1.25"]
    logger.open(run)
    logger.close()
    assert (run / "fractions.csv").read_text() == ""


def test_file_loggers_write_on_the_main_process_only(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    logger = CSVLogger()
    logger.open(tmp_path / "run")
    logger.log({"step": 1, "loss": 2.0})
    logger.close()
    assert not (tmp_path / "run").exists()  # before: rank 1 wrote (over) rank 0's file
    # It still checks the rows, so every rank raises alike.
    logger.open(tmp_path / "run")
    logger.log({"step": 3})
    with pytest.raises(ax.ConfigError, match=r"^metrics row with step 2 after step 3: "):
        logger.log({"step": 2})


def test_file_loggers_refuse_a_step_they_cannot_order(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    logger = CSVLogger()
    logger.open(tmp_path)
    logger.log({"step": 10, "loss": 1.0})
    logger.log({"step": 10, "loss": 1.0})  # repeated: the Trainer's skipped fp16 window
    with pytest.raises(ax.ConfigError) as exc:
        logger.log({"step": 2, "loss": 1.0})
    assert str(exc.value) == (
        "metrics row with step 2 after step 10: the loggers keep rows by step (a resume drops "
        "those after its resume_step), so steps must never decrease; log a per-epoch value as "
        "a column, or give resume_step in the numbering of the steps you log")
    with pytest.raises(ax.ConfigError, match=r"needs a numeric 'step'.*got step=None"):
        logger.log({"loss": 1.0})
    logger.close()
    # Resumed with the optimizer step while the rows count epochs: the next epoch is refused.
    logger.open(tmp_path, resume_step=40)
    with pytest.raises(ax.ConfigError, match="with step 3 after step 10"):
        logger.log({"step": 3})
    logger.close()


def test_tensorboard_steps_are_integers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard", reason="make test installs it (the tensorboard extra)")
    monkeypatch.delenv("RANK", raising=False)
    logger = ax.TensorBoardLogger()
    logger.open(tmp_path / "new")
    with pytest.raises(ax.ConfigError, match=r"TensorBoard steps are integers; got step=0\.5"):
        logger.log({"step": 0.5, "loss": 1.0})
    logger.log({"step": 1.0, "loss": 1.0})
    logger.close()
    assert len(list((tmp_path / "new" / "tensorboard").iterdir())) == 1


def test_setup_holds_what_it_was_given() -> None:
    """``loader = acc.setup(loader)`` frees the user's DataLoader; CPython gives its id to the
    next object, which acc.setup then refused as 'already set up' (seen in the NLP example:
    the model after the loaders)."""
    acc = ax.Accelerator(strategy="single", precision="fp32")
    data = TensorDataset(torch.zeros(4, 2))
    for _ in range(3):  # before: refused at the first
        acc.setup(DataLoader(data, batch_size=2))
        acc.setup(nn.Linear(2, 2))  # before: ConfigError "Linear was already set up"


def test_one_process_gathers_and_checks_like_many() -> None:
    acc = ax.Accelerator(strategy="single", precision="fp32")
    got = acc.gather({"a": torch.arange(3), "b": [torch.tensor(2.5)]})
    assert got["a"].tolist() == [0, 1, 2] and got["b"][0].tolist() == [2.5]
    with pytest.raises(ax.ConfigError, match=r"takes tensors .*; got a str at \['name'\]"):
        acc.gather({"name": "x"})
    data = TensorDataset(torch.arange(5))
    loader = acc.setup(DataLoader(data, batch_size=2))
    assert [acc.gather_for_metrics(i).tolist() for (i,) in loader] == [[0, 1], [2, 3], [4]]
    evaluation = acc.setup_eval_loader(DataLoader(data, batch_size=2))
    assert [i.tolist() for (i,) in evaluation] == [[0, 1], [2, 3], [4]]
    raw = DataLoader(data, batch_size=2)
    acc.setup_eval_loader(raw)
    with pytest.raises(ax.ConfigError, match="already set up"):
        acc.setup_eval_loader(raw)


def test_eval_loader_splits_in_blocks_and_refuses_uneven_batches_under_a_sharded_forward(
) -> None:
    assert [list(block(7, r, 3)) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(block(1, r, 3)) for r in range(3)] == [[0], [], []]
    data = TensorDataset(torch.arange(7))
    shards = [EvalLoader(DataLoader(data, batch_size=2), rank=r, world_size=3,
                         device=torch.device("cpu"), forward_collectives=lambda: None)
              for r in range(3)]
    assert [[i.tolist() for (i,) in shard] for shard in shards] == [
        [[0, 1], [2]], [[3, 4]], [[5, 6]]]
    fsdp = EvalLoader(DataLoader(data, batch_size=2), rank=1, world_size=3,
                      device=torch.device("cpu"), forward_collectives=lambda: "fsdp")
    with pytest.raises(ax.ConfigError) as exc:
        list(fsdp)
    assert str(exc.value) == (
        "the fsdp strategy runs collectives in the model's forward, so every rank must "
        "evaluate as many batches, but this uneven split gives rank 0 2, rank 1 1, rank 2 1 "
        "(batch size 2); set the loader up with acc.setup (padded, equal batches) and gather "
        "with acc.gather_for_metrics, or pick a batch size that gives every rank as many "
        "batches")
    even = EvalLoader(DataLoader(data, batch_size=3), rank=1, world_size=3,
                      device=torch.device("cpu"), forward_collectives=lambda: "fsdp")
    assert [i.tolist() for (i,) in even] == [[3, 4]]  # 1 batch on every rank: allowed
    with pytest.raises(ax.ConfigError, match=r"cannot split a DataLoader with an "
                                             r"IterableDataset \(_Stream\) over 2 ranks"):
        EvalLoader(DataLoader(_Stream()), rank=0, world_size=2,
                   device=torch.device("cpu"), forward_collectives=lambda: None)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(3))
