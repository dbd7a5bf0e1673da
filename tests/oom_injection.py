"""A model that runs out of memory on demand: the injected ``torch.OutOfMemoryError`` of the
safety-net and ``micro_batch_size="auto"`` tests (a real one needs a full GPU)."""

from __future__ import annotations

import logging

import torch
from torch import nn


class OOMAbove(nn.Module):
    """Passes its input through; raises ``torch.OutOfMemoryError`` when ``limit`` is set and the
    input has more than ``limit`` rows. At the end of the model: after every FSDP block's
    all-gather, where a language model allocates its logits."""

    def __init__(self) -> None:
        super().__init__()
        self.limit: int | None = None
        self.raised = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.limit is not None and x.shape[0] > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError(f"injected: {x.shape[0]} rows > {self.limit}")
        return x


def make_model(in_features: int = 6, seed: int = 0) -> nn.Sequential:
    """Three Linear blocks (three FSDP units) and the injecting head."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_features, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 1), OOMAbove())


class LogLines(logging.Handler):
    """Collects the messages of a logger it is added to (accumix's does not propagate)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
