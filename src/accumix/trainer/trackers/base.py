"""What every experiment tracker shares: one run per job, its id in the run directory, rank 0 only.

A tracker logger is a ``MetricLogger`` whose rows go to a tracking service (MLflow, W&B,
ClearML). It is gated on the process's rank itself, so the same object works without the
Trainer: every rank may call ``open`` / ``log`` / ``close``; only rank 0 (process 0 on JAX)
creates the run and sends anything, the others do nothing and never fail. The run's id is kept
in ``run_dir/trackers.json``, so a resumed job (auto-resume, an elastic restart) continues the
same run instead of starting a new one; a fresh start (``Trainer(resume=False)``) forgets it and
opens a new run. Each continuation is an *attempt*, counted there too.

A library that buffers rows in another process (W&B's wandb-core) loses them when the job is
killed: only a run closed cleanly is known to hold what it was sent. ``trackers.json`` keeps
the last step so held (``logged_through``), and a resumed attempt re-sends the rows after it
up to its checkpoint's step from the run directory's ``metrics.csv`` (or ``metrics.jsonl``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from typing_extensions import override

from accumix.common.launch_env import process_rank
from accumix.common.redact import redact, redact_values
from accumix.common.safe_write import refuse_link, replace_text
from accumix.errors import ConfigError, Preempted
from accumix.trainer.loggers import MetricLogger, read_rows

log = logging.getLogger("accumix")

RUN_IDS_FILE = "trackers.json"
MODEL_FILE = "model.safetensors"


def read_run_ids(run_dir: Path) -> dict[str, Any]:
    """``run_dir/trackers.json`` (``{}`` when absent)."""
    path = refuse_link(Path(run_dir) / RUN_IDS_FILE)
    return json.loads(path.read_text()) if path.exists() else {}


def write_run_id(run_dir: Path, name: str, entry: dict[str, Any]) -> None:
    """Records one tracker's run in ``run_dir/trackers.json`` (atomically: temp file, rename)."""
    ids = read_run_ids(run_dir)
    ids[name] = entry
    replace_text(Path(run_dir) / RUN_IDS_FILE, json.dumps(ids, indent=1, sort_keys=True) + "\n",
                 durable=False)


def forget_runs(run_dir: Path) -> None:
    """A fresh start: the run directory's trackers open new runs (the old ones stay in their
    stores, under their ids)."""
    path = Path(run_dir) / RUN_IDS_FILE
    if path.exists():
        path.unlink()


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"n_layer": 2}}`` -> ``{"model.n_layer": 2}`` (lists kept as values)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def numeric_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's numbers as floats (numpy and torch scalars too), without ``step`` and None."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "step" or value is None or isinstance(value, (str, bytes)):
            continue
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def missing_package(word: str, module: str) -> ConfigError | None:
    """The one-line error for a tracker word whose library is not installed, else None."""
    if importlib.util.find_spec(module) is not None:
        return None
    return ConfigError(f"the {word} logger needs the {module} package; pip install "
                       f"'accumix[{word}]' or drop {word!r} from loggers")


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, passwords in URIs masked (``redact``)."""
    text = str(exc).strip().splitlines()
    return redact(f"{type(exc).__name__}: {text[0] if text else ''}")


def run_outcome(exc: BaseException | None) -> str:
    """How a run that closes while ``exc`` is handled ended: MLflow's words, and
    ``PREEMPTED`` for the Trainer's save-and-stop after SIGTERM (``accumix.Preempted``)."""
    if isinstance(exc, Preempted):
        return "PREEMPTED"
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
        return "FINISHED"
    return "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"


class TrackerLogger(MetricLogger):
    """A tracker run, opened on rank 0 only; subclasses talk to one library.

    Subclasses implement ``_start(saved)`` (create or continue the run; return its id and what
    to keep in ``trackers.json``), ``_params``, ``_metrics``, ``_upload`` and ``_finish``.

    Args:
        log_model: at ``close``, upload ``run_dir/model.safetensors`` when this run wrote it
            (never checkpoints).
        run_name: the run's display name (default: the run directory's name); also the
            ``job`` tag.
    """

    word = ""  # the logger word, also the key in trackers.json and the pip extra
    module = ""  # the import name of the library
    # The library may lose rows it was sent when the process is killed (see the module doc).
    buffers_rows = False

    def __init__(self, *, log_model: bool = False, run_name: str | None = None) -> None:
        error = missing_package(self.word, self.module)
        if error is not None:
            raise error
        self.log_model = log_model
        self.run_name = run_name
        self.run_id: str | None = None
        self.run_dir: Path | None = None
        self.active = False
        self.attempt = 1  # 1 + the earlier attempts of the same tracker run
        self._opened_at = 0.0
        self._entry: dict[str, Any] = {}
        self._last_step = 0

    def check(self, run_dir: Path) -> None:
        """Fails now, with the one line ``open`` would give, when the run could not be opened
        (for a launcher, before it starts any worker); creates no run.

        Args:
            run_dir: the run directory the job will use.

        Raises:
            ConfigError: the run directory or the tracking location cannot be used.
        """
        self._writable(Path(run_dir))

    def _writable(self, run_dir: Path) -> None:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"the {self.word} logger cannot write to run_dir "
                              f"{str(run_dir)!r} ({exc.strerror}); give a writable one") from None

    @override
    def open(self, run_dir: Path, *, resume_step: float | None = None) -> None:
        """Creates the run on rank 0, or continues the one ``run_dir/trackers.json`` names
        (``resume_step``: the optimizer step resumed from; None or 0 for a fresh start).

        Raises:
            ConfigError: the tracking location cannot be written (one line naming it).
        """
        resume_step = int(resume_step or 0)
        self.active = False
        if process_rank() != 0:
            return
        self.run_dir = Path(run_dir)
        self._writable(self.run_dir)
        self.run_name = self.run_name or self.run_dir.resolve().name
        self._opened_at = time.time()
        saved = read_run_ids(self.run_dir).get(self.word)
        entry = self._start(saved, resume_step)
        continued = saved is not None and saved.get("run_id") == entry["run_id"]
        self.attempt = int(saved.get("attempt", 1)) + 1 if continued and saved else 1
        held = int(saved.get("logged_through", 0)) if continued and saved else 0
        entry.update(attempt=self.attempt, logged_through=held)
        self.active = True
        self.run_id = entry["run_id"]
        self._entry, self._last_step = entry, held
        write_run_id(self.run_dir, self.word, entry)
        if continued and self.buffers_rows and resume_step > held:
            self._resend(held, resume_step)

    def _resend(self, after: int, through: int) -> None:
        """The rows of steps ``after < step <= through`` again, from the run directory's
        metric files: the attempt that logged them was killed before its library wrote them
        (a duplicate of a step the library did keep is ignored: its history moves forward)."""
        assert self.run_dir is not None
        rows = read_rows(self.run_dir, after=after, through=through)
        if rows is None:
            log.warning("%s: steps %d..%d may be missing from the run (a killed attempt); "
                        "metrics.csv and metrics.jsonl are not there to re-send them from",
                        self.word, after + 1, through)
            return
        for row in rows:
            self.log(row)
        if rows:
            log.info("%s: re-sent steps %d..%d from %s's metric files (the attempt that logged "
                     "them was killed before closing its run)", self.word, int(rows[0]["step"]),
                     int(rows[-1]["step"]), self.run_dir)

    def log_params(self, params: Mapping[str, Any], *,
                   tags: Mapping[str, str] | None = None) -> None:
        """The run's parameters (nested mappings are flattened with dots) and tags."""
        if self.active:  # a URI's password never reaches the tracker
            self._params(redact_values(flatten(params)), redact_values(dict(tags or {})))

    @override
    def log(self, row: dict[str, Any]) -> None:
        # A skipped fp16 window repeats the previous step number: a tracker indexed by step
        # would get two values for one step, so it gets the next real step's row only.
        if not self.active or row.get("skipped"):
            return
        metrics = {k: v for k, v in numeric_metrics(row).items() if k != "skipped"}
        step = int(row["step"])
        self._metrics(metrics, step)
        self._last_step = max(self._last_step, step)

    @override
    def close(self) -> None:
        """Ends the run. Called while an exception is being handled (the Trainer's failure
        path, or a plain loop's ``finally``), the run ends as failed (``KILLED`` for Ctrl-C)
        and uploads no model; a ``SystemExit(0)`` (a plain loop's pre-emption save-and-exit)
        ends it normally, the Trainer's pre-emption (``accumix.Preempted``) as pre-empted.
        Once the library has closed the run, ``trackers.json`` records the steps it holds."""
        if not self.active:
            return
        self.active = False
        status = run_outcome(sys.exc_info()[1])
        model = self.run_dir / MODEL_FILE if self.run_dir is not None else None
        if (status == "FINISHED" and self.log_model and model is not None and model.exists()
                and model.stat().st_mtime >= self._opened_at - 1):
            self._upload(model)
        self._finish(status)
        if self.run_dir is not None and self._entry:
            write_run_id(self.run_dir, self.word, {**self._entry,
                                                   "logged_through": self._last_step})

    # -- what a library does -------------------------------------------------------------------
    def _start(self, saved: dict[str, Any] | None, resume_step: int) -> dict[str, Any]:
        raise NotImplementedError

    def _params(self, params: dict[str, Any], tags: dict[str, str]) -> None:
        raise NotImplementedError

    def _metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def _upload(self, path: Path) -> None:
        raise NotImplementedError

    def _finish(self, status: str) -> None:
        """Ends the run as ``FINISHED``, ``FAILED``, ``KILLED`` or ``PREEMPTED``
        (``run_outcome``)."""
        raise NotImplementedError
