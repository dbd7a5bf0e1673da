"""Where ``micro_batch_size="auto"`` keeps its answer: ``<run_dir>/micro_batch_auto.json``, one
entry per key of what the answer depends on, so a restart with the same settings skips the
probe and one on another world size (or device, precision, strategy...) probes again."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from accumix.common.safe_write import replace_text
from accumix.memory.peak_memory import device_model
from accumix.step.compile import unwrap

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

CACHE_FILE = "micro_batch_auto.json"


def cache_key(run: RunState, sample: Any, global_batch: int, headroom: float) -> str:
    """What the answer depends on: world, precision, strategy and its memory settings
    (``Strategy.probe_settings``), the shapes of a one-row batch
    (``sample``), the device model, the parameters' shapes and dtypes (also those the
    optimizers step outside the models), the models' settings (``model_settings``: activation
    checkpointing on or off), the optimizers, the global batch, the limit and the headroom."""
    shapes = [(tuple(t.shape), str(t.dtype)) for t in tree_leaves(sample)
              if isinstance(t, torch.Tensor)]
    # Every parameter's shape, dtype and trainability, and each optimizer's class: a model of
    # the same size but other shapes (wider activations) or dtype, a frozen part or another
    # optimizer's states needs another answer, which a parameter count alone would not key.
    params = repr([(tuple(p.shape), str(p.dtype), p.requires_grad)
                   for model in run.models for p in model.parameters()]
                  + [(tuple(p.shape), str(p.dtype)) for p in outside_parameters(run)])
    optimizers = [type(run.strategy.state_optimizer(o.optimizer)).__name__
                  for o in run.optimizers]
    parts = {"world": run.strategy.dp_world_size, "precision": run.policy.name,
             "strategy": run.strategy.name, "shapes": repr(shapes),
             # Its memory settings: a DeepSpeed bucket size, FSDP's activation checkpointing.
             "strategy_settings": run.strategy.probe_settings(),
             "device": device_model(run.device), "params": params,
             "optimizers": optimizers,
             "model_settings": [model_settings(unwrap(run.strategy, model))
                                for model in run.models],
             "global_batch": global_batch, "limit": run.memory_limit, "headroom": headroom}
    return key_of(parts)


def outside_parameters(run: RunState) -> list[torch.Tensor]:
    """Tensors an optimizer steps that no set-up model holds (a learnable loss temperature, an
    ``nn.Parameter`` or a plain leaf tensor with ``requires_grad``): the probe keeps them as it
    keeps the models' (``micro_batch_probe``)."""
    inside = {id(p) for model in run.models for p in model.parameters()}
    found = {id(p): p for wrapped in run.optimizers for group in wrapped.optimizer.param_groups
             for p in group["params"] if isinstance(p, torch.Tensor) and id(p) not in inside}
    return list(found.values())


def model_settings(model: nn.Module) -> list[Any]:
    """What changes a model's memory without changing its parameters' shapes: each module's
    class and its public attributes of plain values (Hugging Face's ``gradient_checkpointing``
    flags, a user's ``use_checkpoint``, dropout rates, ``training``), and a Hugging Face
    ``config`` (``use_cache``, the attention implementation, ...). A restart that changes one
    probes again instead of reusing an answer measured with another setting."""
    plain = (bool, int, float, str, type(None))
    settings: list[Any] = [
        (name, type(module).__qualname__,
         sorted((k, v) for k, v in vars(module).items()
                if not k.startswith("_") and isinstance(v, plain)))
        for name, module in model.named_modules()]
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_dict", None)):
        settings.append(config.to_dict())
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None:  # private in the config, left out of to_dict()
        settings.append(("attn_implementation", str(implementation)))
    return settings


def key_of(parts: dict[str, Any]) -> str:
    """A short stable hash of ``parts`` (what an answer depends on), for either backend."""
    text = json.dumps(parts, sort_keys=True, default=repr)  # a config value JSON has no form for
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_cache(run_dir: str | os.PathLike[str] | None, key: str) -> int | None:
    """The cached micro-batch for ``key``, or None (no run directory, file or entry)."""
    if run_dir is None:
        return None
    try:
        entries = json.loads((Path(run_dir) / CACHE_FILE).read_text())
        return int(entries[key]["micro_batch_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_cache(run_dir: str | os.PathLike[str] | None, key: str, micro: int) -> None:
    """Adds ``key``'s answer to the run directory's file (atomically; rank 0 calls it)."""
    if run_dir is None:
        return
    path = Path(run_dir) / CACHE_FILE
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entries[key] = {"micro_batch_size": micro}
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, json.dumps(entries, indent=1, sort_keys=True), durable=False)
