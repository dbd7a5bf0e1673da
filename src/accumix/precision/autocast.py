"""The forward under autocast, with its floating outputs cast back (Fabric's forward_context)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accumix.precision.policy import Policy

_ORIGINAL_FORWARD = "_accumix_original_forward"


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """Casts every half-precision tensor inside nested tuples, lists and dicts to ``dtype``."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return type(value)((k, cast_floating(v, dtype)) for k, v in value.items())
    return value


def autocast_forward(module: nn.Module, policy: Policy, device: torch.device) -> nn.Module:
    """Makes ``module``'s forward run under the policy's autocast; returns the same module.

    The instance's ``forward`` is replaced (the class is untouched), so ``state_dict`` keys,
    hooks and ``isinstance`` stay those of the user's model, and a DDP wrapper built around it
    calls the autocast forward. A second call is a no-op.
    """
    if not policy.autocast or hasattr(module, _ORIGINAL_FORWARD):
        return module
    original: Callable[..., Any] = module.forward
    device_type, compute, output = device.type, policy.compute_dtype, policy.output_dtype

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type, dtype=compute):
            out = original(*args, **kwargs)
        return out if output is None else cast_floating(out, output)

    setattr(module, _ORIGINAL_FORWARD, original)
    module.forward = forward  # type: ignore[method-assign]
    return module
