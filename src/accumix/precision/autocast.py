"""The forward under autocast, with its floating outputs cast back (Fabric's forward_context)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accumix.precision.policy import Policy

_ORIGINAL_FORWARD = "_accumix_original_forward"


_HALF = (torch.float16, torch.bfloat16)


def cast_floating(value: Any, dtype: torch.dtype, only: tuple[torch.dtype, ...] | None = None
                  ) -> Any:
    """Casts floating tensors inside nested tuples, lists and dicts to ``dtype``.

    Args:
        value: a tensor or a nest of them; other leaves pass through.
        dtype: the target dtype.
        only: cast only tensors of these dtypes (default: every floating tensor).
    """
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype != dtype and (
            only is None or value.dtype in only
        ):
            return value.to(dtype)
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(cast_floating(v, dtype, only) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype, only) for v in value)
    if isinstance(value, dict):
        return type(value)((k, cast_floating(v, dtype, only)) for k, v in value.items())
    return value


def autocast_forward(module: nn.Module, policy: Policy, device: torch.device) -> nn.Module:
    """Makes ``module``'s forward run in the policy's precision; returns the same module.

    Mixed policies run the forward under ``torch.autocast``; "true" half policies (parameters
    stored in bf16) cast floating inputs to the parameters' dtype instead, as Fabric's
    ``HalfPrecision`` does. Floating outputs are cast to ``policy.output_dtype`` either way.
    The instance's ``forward`` is replaced (the class is untouched), so ``state_dict`` keys,
    hooks and ``isinstance`` stay those of the user's model, and a DDP wrapper built around it
    calls the new forward. A second call is a no-op.
    """
    half_params = policy.param_dtype != torch.float32
    if not (policy.autocast or half_params) or hasattr(module, _ORIGINAL_FORWARD):
        return module
    original: Callable[..., Any] = module.forward
    device_type, compute, output = device.type, policy.compute_dtype, policy.output_dtype
    param_dtype = policy.param_dtype

    if policy.autocast:

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device_type, dtype=compute):
                out = original(*args, **kwargs)
            return out if output is None else cast_floating(out, output, _HALF)

    else:

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            out = original(*cast_floating(args, param_dtype), **cast_floating(kwargs, param_dtype))
            return out if output is None else cast_floating(out, output, _HALF)

    setattr(module, _ORIGINAL_FORWARD, original)
    module.forward = forward  # type: ignore[method-assign]
    return module
