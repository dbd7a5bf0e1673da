"""The Trainer and its parts: callbacks, metric loggers, LR schedules and YAML configs."""

from __future__ import annotations

from accumix.trainer.callbacks import (
    EarlyStopping,
    GradientAccumulationScheduler,
    LossGuard,
    LRMonitor,
    StragglerMonitor,
    ThroughputMonitor,
)
from accumix.trainer.config import load_config
from accumix.trainer.events import EVENTS, Callback
from accumix.trainer.loggers import CSVLogger, JSONLLogger, MetricLogger, TensorBoardLogger
from accumix.trainer.metrics import StepMetrics
from accumix.trainer.progress import ProgressBar
from accumix.trainer.schedules import WarmupDecay, scale_lr, warmup_schedule
from accumix.trainer.trainer import FitResult, Trainer
from accumix.trainer.weight_averaging import WeightAveraging

__all__ = [
    "EVENTS",
    "CSVLogger",
    "Callback",
    "EarlyStopping",
    "FitResult",
    "GradientAccumulationScheduler",
    "JSONLLogger",
    "LRMonitor",
    "LossGuard",
    "MetricLogger",
    "ProgressBar",
    "StepMetrics",
    "StragglerMonitor",
    "TensorBoardLogger",
    "ThroughputMonitor",
    "Trainer",
    "WarmupDecay",
    "WeightAveraging",
    "load_config",
    "scale_lr",
    "warmup_schedule",
]
