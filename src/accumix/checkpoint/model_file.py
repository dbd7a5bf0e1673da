"""``acc.save_model``: the unwrapped model's full state dict as one ``model.safetensors`` file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn

from accumix.common.safe_write import replace_with
from accumix.errors import ConfigError

if TYPE_CHECKING:
    from accumix.step.run_state import RunState
    from accumix.strategies.base import Strategy


def save_model(run: RunState, directory: str | os.PathLike[str], model: nn.Module | None
               ) -> Path:
    """``acc.save_model(directory, model)``: collective; rank 0 writes; returns the path."""
    if model is None:
        if len(run.models) != 1:
            raise ConfigError(
                f"save_model needs model= when {len(run.models)} models are set up"
            )
        model = run.models[0]
    return write_full_state(run.strategy, run.strategy.full_state_dict(model), directory)


def write_full_state(strategy: Strategy, state: dict[str, torch.Tensor],
                     directory: str | os.PathLike[str]) -> Path:
    """Writes a full (unsharded) state dict as ``directory/model.safetensors``: rank 0 writes,
    every rank waits (collective). Returns the file's path."""
    path = Path(directory) / "model.safetensors"
    if strategy.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Copies: safetensors refuses tensors that share storage (tied embeddings).
        tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
        replace_with(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    strategy.barrier()
    return path
