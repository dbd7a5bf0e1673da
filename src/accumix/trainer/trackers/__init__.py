"""Experiment trackers as metric loggers: ``mlflow``, ``wandb``, ``clearml`` (optional extras).

Each is local by default (MLflow's SQLite store in the run directory, W&B and ClearML offline),
opens one run per job on rank 0 and keeps its id in ``run_dir/trackers.json`` (``base.py``).
"""

from __future__ import annotations

from typing import Any

from accumix.trainer.trackers.base import TrackerLogger, missing_package

TRACKER_WORDS = ("mlflow", "wandb", "clearml")


def make_tracker(word: str, **options: Any) -> TrackerLogger:
    """The tracker logger for ``word`` (one of ``TRACKER_WORDS``), built with ``options``.

    Raises:
        ConfigError: its library is not installed (one line naming the pip command).
    """
    error = missing_package(word, word)
    if error is not None:
        raise error
    if word == "mlflow":
        from accumix.trainer.trackers.mlflow_logger import MLflowLogger

        return MLflowLogger(**options)
    if word == "wandb":
        from accumix.trainer.trackers.wandb_logger import WandbLogger

        return WandbLogger(**options)
    from accumix.trainer.trackers.clearml_logger import ClearMLLogger

    return ClearMLLogger(**options)


__all__ = ["TRACKER_WORDS", "TrackerLogger", "make_tracker"]
