"""Precision as data: which dtype parameters are stored in, computed in, and reduced in.

A ``Policy`` is parsed once from a word and handed to the strategy, which turns it into its native
form: autocast + loss scaler (single, DDP), ``MixedPrecisionPolicy`` (FSDP2), the fp16/bf16 block
(DeepSpeed). The idea is DeepMind jmp's ``get_policy("params=float32,compute=bfloat16")``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from accumix.errors import ConfigError
from accumix.precision.reduce_dtype import parse_reduce_dtype
from accumix.precision.words import PRECISION_WORDS, cpu_has_native_bf16

log = logging.getLogger("accumix")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True, frozen=True, slots=True)
class Policy:
    """The dtypes of one precision setting.

    Attributes:
        name: the word it came from (``"fp32"``, ``"bf16-mixed"``, ...).
        param_dtype: dtype parameters (and optimizer states) are stored in.
        compute_dtype: dtype of the forward's matmuls; autocast runs when it differs from
            ``param_dtype``.
        reduce_dtype: dtype gradients travel in between ranks (every strategy; the window's
            gradients are summed locally in float32 and cast only for the reduction).
        output_dtype: floating outputs of the forward are cast to this (float32 by default, so
            losses are computed in full precision); ``None`` leaves them as they come.
    """

    name: str
    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype | None = torch.float32

    @property
    def autocast(self) -> bool:
        """Whether the forward runs under ``torch.autocast``."""
        return self.compute_dtype != self.param_dtype

    @property
    def needs_loss_scaling(self) -> bool:
        """fp16 gradients underflow without a loss scale; bf16's exponent range does not."""
        return self.compute_dtype == torch.float16 or self.param_dtype == torch.float16

    @property
    def half_dtype(self) -> torch.dtype | None:
        """The reduced-precision dtype in play, if any."""
        if self.compute_dtype != torch.float32:
            return self.compute_dtype
        return self.param_dtype if self.param_dtype != torch.float32 else None


_POLICIES = {
    "fp32": Policy(name="fp32"),
    "bf16-mixed": Policy(name="bf16-mixed", compute_dtype=torch.bfloat16),
    "fp16-mixed": Policy(name="fp16-mixed", compute_dtype=torch.float16),
    "bf16-true": Policy(
        name="bf16-true",
        param_dtype=torch.bfloat16,
        compute_dtype=torch.bfloat16,
        reduce_dtype=torch.bfloat16,
    ),
}


def cuda_has_bf16(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 8  # Ampere and newer


def resolve_policy(precision: str | Policy, device: torch.device) -> Policy:
    """Turns a precision word into a ``Policy`` for ``device``.

    Args:
        precision: one of ``PRECISION_WORDS`` or a ``Policy``.
        device: the device the forward runs on.

    Returns:
        The policy. ``"auto"`` is bf16-mixed on a GPU with bf16, fp16-mixed on an older GPU, and
        on a CPU bf16-mixed where it is native, fp32 otherwise; the reason is logged once.

    Raises:
        ConfigError: an unknown word, or bf16 asked of a GPU without it.
    """
    if isinstance(precision, Policy):
        policy = precision
    elif precision == "auto":
        policy, reason = _auto_policy(device)
        log.info("precision='auto' chose %s: %s", policy.name, reason)
    elif precision in _POLICIES:
        policy = _POLICIES[precision]
    else:
        raise ConfigError(
            f"unknown precision {precision!r}; use one of {', '.join(PRECISION_WORDS)}"
        )
    half = policy.half_dtype
    if device.type == "cuda" and half == torch.bfloat16 and not cuda_has_bf16(device):
        raise ConfigError(
            f"precision={policy.name!r} needs bf16, which {torch.cuda.get_device_name(device)} "
            "lacks; use precision='fp16-mixed'"
        )
    if device.type == "cpu" and half is not None and (
        half == torch.float16 or not cpu_has_native_bf16()
    ):
        warnings.warn(
            f"precision={policy.name!r} on this CPU is emulated and much slower than fp32; "
            "it is meant for testing semantics",
            stacklevel=3,
        )
    return policy


def _auto_policy(device: torch.device) -> tuple[Policy, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if cuda_has_bf16(device):
            return _POLICIES["bf16-mixed"], f"{name} supports bf16"
        return _POLICIES["fp16-mixed"], f"{name} has no bf16; fp16 with dynamic loss scaling"
    if device.type == "cpu" and cpu_has_native_bf16():
        return _POLICIES["bf16-mixed"], "this CPU has native bf16 instructions"
    return _POLICIES["fp32"], f"{device.type} without native bf16: half precision would be slower"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the backend-free name)."""
    return str(dtype).removeprefix("torch.")


def with_reduce_dtype(policy: Policy, reduce_dtype: Any) -> Policy:
    """``policy`` with the user's ``reduce_dtype`` (a word, a torch dtype, or None: unchanged).

    Raises:
        ConfigError: an unknown value.
    """
    name = parse_reduce_dtype(reduce_dtype)
    if name is None:
        return policy
    return dataclasses.replace(policy, reduce_dtype=TORCH_DTYPES[name])
