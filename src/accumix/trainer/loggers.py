"""Metric loggers: one row per optimizer step into ``metrics.csv``, ``metrics.jsonl``, TensorBoard
(and experiment trackers, ``trackers/``).

Loggers run on rank 0 only, after every callback had its ``on_optimizer_step`` (so columns that
callbacks add, and the ``val_loss`` of an evaluation at that step, are in the same row). A resumed
run keeps the rows up to the step it resumed from and drops the rest, so the files always
describe one history.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from typing_extensions import override

from accumix.common.safe_write import make_dir, open_in_place, refuse_link
from accumix.errors import ConfigError

LOGGER_WORDS = ("csv", "jsonl", "tensorboard", "mlflow", "wandb", "clearml")


class MetricLogger:
    """Receives each step's row; subclasses write it somewhere."""

    def open(self, run_dir: Path, *, resume_step: int) -> None:
        """Called once before the first row.

        Args:
            run_dir: the run directory.
            resume_step: the step the run resumed from (0 for a fresh run): rows after it are
                stale and are dropped.
        """

    def log_params(self, params: Mapping[str, Any], *,
                   tags: Mapping[str, str] | None = None) -> None:
        """The run's configuration and derived facts, once after ``open`` (trackers keep them;
        the file loggers do not)."""

    def log(self, row: dict[str, Any]) -> None:
        """Writes one row (keys: column names; None for a missing value)."""

    def close(self) -> None:
        """Flushes and closes."""


def _number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf literals
    return value


class CSVLogger(MetricLogger):
    """``run_dir/metrics.csv``: a header, then one row per optimizer step, flushed each row.

    When a row brings a new column (say ``val_loss`` at the first evaluation), the file is
    rewritten with the wider header, so every row has every column.

    Args:
        filename: the file name inside the run directory.
    """

    def __init__(self, filename: str = "metrics.csv") -> None:
        self.filename = filename
        self.path: Path | None = None
        self._columns: list[str] = []
        self._rows: list[dict[str, Any]] = []
        self._file: Any = None

    @override
    def open(self, run_dir: Path, *, resume_step: int) -> None:
        self.path = refuse_link(Path(run_dir) / self.filename)
        self._rows = []
        if resume_step > 0 and self.path.exists():
            with self.path.open(newline="") as f:
                self._rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        self._columns = list(self._rows[0]) if self._rows else []
        self._rewrite()

    def _rewrite(self) -> None:
        assert self.path is not None
        if self._file is not None:
            self._file.close()
        self._file = open_in_place(self.path, "w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=self._columns, restval="")
        if self._columns:
            self._writer.writeheader()
            self._writer.writerows(self._rows)
        self._file.flush()

    @override
    def log(self, row: dict[str, Any]) -> None:
        clean = {k: ("" if v is None else v) for k, v in row.items()}
        self._rows.append(clean)
        new = [k for k in clean if k not in self._columns]
        if new:
            self._columns += new
            self._rewrite()
        else:
            self._writer.writerow(clean)
            self._file.flush()

    @override
    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class JSONLLogger(MetricLogger):
    """``run_dir/metrics.jsonl``: one JSON object per optimizer step (NaN written as "nan")."""

    def __init__(self, filename: str = "metrics.jsonl") -> None:
        self.filename = filename
        self._file: Any = None

    @override
    def open(self, run_dir: Path, *, resume_step: int) -> None:
        path = refuse_link(Path(run_dir) / self.filename)
        kept: list[str] = []
        if resume_step > 0 and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
        self._file = open_in_place(path, "w")
        self._file.write("".join(line + "\n" for line in kept))
        self._file.flush()

    @override
    def log(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _number(v) for k, v in row.items()}) + "\n")
        self._file.flush()

    @override
    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_rows(run_dir: Path, *, after: int, through: int) -> list[dict[str, Any]] | None:
    """The logged rows of steps ``after < step <= through``, from ``metrics.csv`` (numbers
    as numbers, empty cells left out) or else ``metrics.jsonl``; None when neither is there."""
    csv_path = refuse_link(Path(run_dir) / "metrics.csv")
    jsonl_path = refuse_link(Path(run_dir) / "metrics.jsonl")
    if csv_path.exists():
        with csv_path.open(newline="") as f:
            rows = [{k: _parse(v) for k, v in r.items() if v not in ("", None)}
                    for r in csv.DictReader(f)]
    elif jsonl_path.exists():
        rows = [{k: _parse(v) for k, v in json.loads(line).items()}
                for line in jsonl_path.read_text().splitlines() if line.strip()]
    else:
        return None
    return [r for r in rows if after < int(r["step"]) <= through]


def _parse(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        number = float(value)  # "nan" and "inf" too, as the JSON lines write them
    except ValueError:
        return value
    return int(number) if number.is_integer() and value.lstrip("-").isdigit() else number


def tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package (needed by ``torch.utils.tensorboard``) is installed."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardLogger(MetricLogger):
    """Scalars into ``run_dir/tensorboard/`` (``pip install 'accumix[tensorboard]'``).

    Raises:
        ConfigError: tensorboard is not installed.
    """

    def __init__(self, subdir: str = "tensorboard") -> None:
        if not tensorboard_available():
            raise ConfigError(
                "the tensorboard logger needs the tensorboard package; "
                "pip install 'accumix[tensorboard]' or drop 'tensorboard' from loggers"
            )
        self.subdir = subdir
        self._writer: Any = None

    @override
    def open(self, run_dir: Path, *, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        directory = make_dir(Path(run_dir) / self.subdir)  # never a planted link
        self._writer = SummaryWriter(str(directory), purge_step=resume_step + 1
                                     if resume_step else None)

    @override
    def log(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, step)

    @override
    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def check_logger_words(words: Sequence[str]) -> None:
    """Each word once, each one known.

    Raises:
        ConfigError: an unknown word, or one given twice (it would log every row twice).
    """
    for index, word in enumerate(words):
        if word not in LOGGER_WORDS:
            raise ConfigError(
                f"unknown logger {word!r}; use {', '.join(LOGGER_WORDS)} or a MetricLogger"
            )
        if word in words[:index]:
            raise ConfigError(f"logger {word!r} is given twice, which would log every row "
                              f"twice; list each logger once")


def resolve_loggers(loggers: Sequence[str | MetricLogger] | None, *, log_model: bool = False,
                    run_name: str | None = None) -> list[MetricLogger]:
    """Turns logger words into loggers; the one place that knows them.

    Args:
        loggers: words from ``LOGGER_WORDS`` or ``MetricLogger`` objects; None for the default
            (csv and jsonl, plus tensorboard when it is installed).
        log_model: trackers made from words upload the final ``model.safetensors``.
        run_name: trackers' run name (default: the run directory's name).

    Raises:
        ConfigError: an unknown word, one given twice, or a logger whose library is not
            installed.
    """
    if loggers is None:
        loggers = ["csv", "jsonl", *(["tensorboard"] if tensorboard_available() else [])]
    from accumix.trainer.trackers import TRACKER_WORDS, make_tracker

    check_logger_words([item for item in loggers if isinstance(item, str)])
    out: list[MetricLogger] = []
    for item in loggers:
        if isinstance(item, MetricLogger):
            out.append(item)
        elif item == "csv":
            out.append(CSVLogger())
        elif item == "jsonl":
            out.append(JSONLLogger())
        elif item == "tensorboard":
            out.append(TensorBoardLogger())
        elif item in TRACKER_WORDS:
            out.append(make_tracker(item, log_model=log_model, run_name=run_name))
        else:
            raise ConfigError(
                f"unknown logger {item!r}; use {', '.join(LOGGER_WORDS)} or a MetricLogger"
            )
    return out
