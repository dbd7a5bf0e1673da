"""Metric loggers: one row per optimizer step into ``metrics.csv``, ``metrics.jsonl``, TensorBoard
(and experiment trackers, ``trackers/``).

Loggers run on rank 0 only, after every callback had its ``on_optimizer_step`` (so columns that
callbacks add, and the ``val_loss`` of an evaluation at that step, are in the same row). A resumed
run keeps the rows up to the step it resumed from and drops the rest, so the files always
describe one history.

The file loggers work the same in a plain loop: every rank may call ``open`` / ``log`` /
``close``; the main process (rank 0, process 0 on JAX) creates the directory and writes, the
others write nothing. A row's ``step`` is any number that never decreases (the optimizer step,
an epoch from 0, a fraction of an epoch); ``open(..., resume_step=s)`` keeps the rows whose
step is at most ``s``, in that same numbering, and ``resume_step=None`` starts the files anew.
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

from accumix.common.launch_env import process_rank
from accumix.common.safe_write import make_dir, open_in_place, refuse_link
from accumix.errors import ConfigError

LOGGER_WORDS = ("csv", "jsonl", "tensorboard", "mlflow", "wandb", "clearml")


class MetricLogger:
    """Receives each step's row; subclasses write it somewhere."""

    def open(self, run_dir: Path, *, resume_step: float | None = None) -> None:
        """Called once before the first row.

        Args:
            run_dir: the run directory.
            resume_step: the step of the last row the resumed run's checkpoint covers, in the
                rows' own numbering: later rows are stale and are dropped; None for a fresh
                run.
        """

    def log_params(self, params: Mapping[str, Any], *,
                   tags: Mapping[str, str] | None = None) -> None:
        """The run's configuration and derived facts, once after ``open`` (trackers keep them;
        the file loggers do not).

        Args:
            params: names and plain values (the resolved config, ``world_size``,
                ``grad_accum_steps``, ``dtype_*``, ...).
            tags: short labels (``job``).
        """

    def log(self, row: dict[str, Any]) -> None:
        """Writes one row.

        Args:
            row: column names to values (``step``, ``loss``, ...); None for a missing value.
        """

    def close(self) -> None:
        """Flushes and closes."""


def _number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf literals
    return value


def row_step(row: Mapping[str, Any]) -> float:
    """The row's ``step`` as a number (a row read back from ``metrics.csv`` holds its text).

    Raises:
        ConfigError: no ``step``, or one that is not a number.
    """
    step = row.get("step")
    try:
        if isinstance(step, (bool, bytes)) or step is None:
            raise TypeError
        return float(step)
    except (TypeError, ValueError):
        raise ConfigError(f"a metrics row needs a numeric 'step' (the optimizer step, the epoch, "
                          f"...); got step={step!r}") from None


class FileLogger(MetricLogger):
    """A logger that writes files under the run directory from the main process only.

    ``open`` creates the directory; on the other ranks ``open``, ``log`` and ``close`` write
    nothing (``log`` still checks the row, so every rank raises alike). Subclasses implement
    ``_open(directory, resume_step)``, ``_write(row)`` and ``_close()``.
    """

    def __init__(self) -> None:
        self.active = False  # this process writes (set by open)
        self._last_step: float | None = None

    @override
    def open(self, run_dir: Path, *, resume_step: float | None = None) -> None:
        self._last_step = None
        self.active = process_rank() == 0
        if not self.active:
            return
        directory = Path(run_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"the {type(self).__name__} cannot create run_dir "
                              f"{str(directory)!r} ({exc.strerror}); give a writable one"
                              ) from None
        self._last_step = self._open(directory, resume_step)

    @override
    def log(self, row: dict[str, Any]) -> None:
        step = row_step(row)
        if self._last_step is not None and step < self._last_step:
            raise ConfigError(
                f"metrics row with step {row['step']!r} after step {self._last_step:g}: the "
                "loggers keep rows by step (a resume drops those after its resume_step), so "
                "steps must never decrease; log a per-epoch value as a column, or give "
                "resume_step in the numbering of the steps you log")
        self._last_step = step
        if self.active:
            self._write(row)

    @override
    def close(self) -> None:
        if self.active:
            self._close()
        self.active = False

    def _open(self, directory: Path, resume_step: float | None) -> float | None:
        """Opens the files; returns the step of the last row kept (None when none is)."""
        raise NotImplementedError

    def _write(self, row: dict[str, Any]) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


class CSVLogger(FileLogger):
    """``run_dir/metrics.csv``: a header, then one row per optimizer step, flushed each row.

    When a row brings a new column (say ``val_loss`` at the first evaluation), the file is
    rewritten with the wider header, so every row has every column.

    Args:
        filename: the file name inside the run directory.
    """

    def __init__(self, filename: str = "metrics.csv") -> None:
        super().__init__()
        self.filename = filename
        self.path: Path | None = None
        self._columns: list[str] = []
        self._rows: list[dict[str, Any]] = []
        self._file: Any = None

    @override
    def _open(self, directory: Path, resume_step: float | None) -> float | None:
        self.path = refuse_link(directory / self.filename)
        self._rows = []
        if resume_step is not None and self.path.exists():
            with self.path.open(newline="") as f:
                self._rows = [r for r in csv.DictReader(f) if row_step(r) <= resume_step]
        self._columns = list(self._rows[0]) if self._rows else []
        self._rewrite()
        return row_step(self._rows[-1]) if self._rows else None

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
    def _write(self, row: dict[str, Any]) -> None:
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
    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class JSONLLogger(FileLogger):
    """``run_dir/metrics.jsonl``: one JSON object per optimizer step (NaN written as "nan").

    Args:
        filename: the file's name inside the run directory.
    """

    def __init__(self, filename: str = "metrics.jsonl") -> None:
        super().__init__()
        self.filename = filename
        self._file: Any = None

    @override
    def _open(self, directory: Path, resume_step: float | None) -> float | None:
        path = refuse_link(directory / self.filename)
        kept: list[str] = []
        if resume_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and row_step(json.loads(line)) <= resume_step]
        self._file = open_in_place(path, "w")
        self._file.write("".join(line + "\n" for line in kept))
        self._file.flush()
        return row_step(json.loads(kept[-1])) if kept else None

    @override
    def _write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _number(v) for k, v in row.items()}) + "\n")
        self._file.flush()

    @override
    def _close(self) -> None:
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


class TensorBoardLogger(FileLogger):
    """Scalars into ``run_dir/tensorboard/`` (``pip install 'accumix[tensorboard]'``), one event
    file per attempt, flushed each row (a killed job keeps every row it logged). A resumed
    attempt marks the steps after ``resume_step`` as purged: TensorBoard shows each step once.
    Steps are integers here (TensorBoard's ``global_step``).

    Args:
        subdir: the directory inside the run directory that holds the event files.

    Raises:
        ConfigError: tensorboard is not installed.
    """

    def __init__(self, subdir: str = "tensorboard") -> None:
        if not tensorboard_available():
            raise ConfigError(
                "the tensorboard logger needs the tensorboard package; "
                "pip install 'accumix[tensorboard]' or drop 'tensorboard' from loggers"
            )
        super().__init__()
        self.subdir = subdir
        self._writer: Any = None

    @override
    def _open(self, directory: Path, resume_step: float | None) -> float | None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events of this step and later, written by an earlier attempt, are
        # discarded when TensorBoard reads the directory.
        purge = None if resume_step is None else math.floor(resume_step) + 1
        events = make_dir(directory / self.subdir)  # never a planted link
        self._writer = SummaryWriter(str(events), purge_step=purge)
        return None

    @override
    def log(self, row: dict[str, Any]) -> None:
        step = row_step(row)
        if not step.is_integer():
            raise ConfigError(f"TensorBoard steps are integers; got step={row['step']!r} (log "
                              "a fraction of an epoch to csv/jsonl, or an integer step here)")
        super().log(row)

    @override
    def _write(self, row: dict[str, Any]) -> None:
        step = int(row_step(row))
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    @override
    def _close(self) -> None:
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
