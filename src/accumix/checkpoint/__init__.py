"""Checkpoints: ``save_state`` / ``load_state`` of a run, atomic on disk and exact on resume
(``save_load``); what ``meta.json`` records and checks (``meta``); models and optimizers through
torch.distributed.checkpoint (``dcp_state``); ``acc.save_model``'s one safetensors file
(``model_file``); values as plain Python for ``weights_only`` loading (``plain_values``); every
RNG a resume continues (``rng_state``). The run directory's layout is ``accumix.common.run_dir``,
shared with the JAX backend's orbax checkpoints.

Public: ``latest_checkpoint``, ``extra_state``, ``CheckpointError`` (importing them loads no
torch); ``save_state`` / ``load_state`` / ``resolve`` / ``FORMAT`` lazily from ``save_load``.

May import: torch, ``accumix.errors``, ``accumix.common``, ``accumix.runtime``, ``accumix.step``
(the window's counters it saves), never ``accumix.accelerator``.
"""

from __future__ import annotations

import importlib
from typing import Any

# Ray Train's checkpoint where a worker (re)starts under it, else run_dir/latest's.
from accumix.common.ray_checkpoint import latest_checkpoint
from accumix.common.run_dir import extra_state, resolve
from accumix.errors import CheckpointError

__all__ = ["CheckpointError", "extra_state", "latest_checkpoint", "load_state", "resolve",
           "save_state"]

_LAZY = {"save_state", "load_state", "FORMAT"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("accumix.checkpoint.save_load"), name)
    raise AttributeError(f"module 'accumix.checkpoint' has no attribute {name!r}")
